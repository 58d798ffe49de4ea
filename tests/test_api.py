"""The notebook-facing API: every export resolves, and importing the package starts no JAX."""

import subprocess
import sys

import pytest

import dlrm_jax


def test_every_export_resolves_with_a_docstring():
    for name in dlrm_jax.__all__:
        obj = getattr(dlrm_jax, name)
        assert obj.__doc__, name
    # What a notebook catches or passes in (a stopped or diverged run, data of one's own).
    assert {"Interrupted", "TrainingDiverged", "ArraySource", "with_overrides", "load_config"} <= set(dlrm_jax.__all__)


@pytest.mark.slow
def test_import_does_not_start_jax():
    code = "import sys, dlrm_jax; dlrm_jax.request_cpu_devices(3); print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_subpackage_is_an_attribute_after_a_plain_import():
    """docs/python-api.md's ``dlrm_jax.serving.load`` after ``import dlrm_jax`` alone: it
    raised AttributeError unless something had imported the subpackage first."""
    code = (
        "import sys, dlrm_jax\n"
        "print(sorted(m for m in sys.modules if m.startswith('dlrm_jax.')))\n"
        "print(dlrm_jax.serving.load is sys.modules['dlrm_jax.serving'].load)\n"
        "try:\n"
        "    dlrm_jax.no_such_part\n"
        "except AttributeError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.splitlines()[1:] == ["True", "module 'dlrm_jax' has no attribute 'no_such_part'"], out.stdout
    assert "dlrm_jax.serving" not in out.stdout.splitlines()[0]  # (imported when asked for, not with the package)


@pytest.mark.slow
def test_notebook_flow(tmp_path):
    """And the notebook's root logger is left alone: absl (orbax's logger, from its import on)
    gave it a stderr handler, so a basicConfig(level=...) after a run did nothing."""
    code = (
        "import logging, dlrm_jax\n"
        "dlrm_jax.request_cpu_devices(2)\n"
        "cfg = dlrm_jax.load_config('smoke', ['train.steps=4', 'train.progress_bar=false', 'mesh.devices=2'])\n"
        f"s = dlrm_jax.train_and_evaluate(cfg, {str(tmp_path)!r}, log=lambda *_: None)\n"
        f"dlrm_jax.evaluate_run({str(tmp_path)!r}, log=None)\n"
        "print(logging.getLogger().handlers)\n"
        "print(s.step, 0.0 <= s.auc <= 1.0)\n"
    )
    env_free = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env_free)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-2:] == ["[]", "4 True"]


def test_what_a_notebook_catches_pickles_and_log_none_is_quiet_everywhere(tiny, tmp_path, capsys):
    """Interrupted could not be unpickled (a process pool returning it raised TypeError), and
    export_serving/export_run took log=None as train_and_evaluate does only until their last
    line: a TypeError after the export was written."""
    import pickle

    stopped = pickle.loads(pickle.dumps(dlrm_jax.Interrupted(2, 5, True)))
    assert (stopped.signum, stopped.step, stopped.saved, str(stopped)) == (2, 5, True, "stopped by SIGINT after step 5")
    run = tmp_path / "run"
    dlrm_jax.train_and_evaluate(tiny("mesh.devices=1", "train.steps=2", "train.progress_bar=false"), run, log=None)
    capsys.readouterr()
    assert dlrm_jax.export_run(run, tmp_path / "tables", log=None) == 2
    assert dlrm_jax.export_serving(run, tmp_path / "art", log=None) == 2
    assert capsys.readouterr().out == ""


def test_overrides_as_a_list_a_string_or_a_dict_and_a_changed_copy():
    a = dlrm_jax.load_config("smoke", ["train.steps=7", "model.bottom_mlp=[16, 8]"])
    b = dlrm_jax.load_config("smoke", {"train.steps": 7, "model.bottom_mlp": [16, 8]})
    assert a == b and a.train.steps == 7
    assert dlrm_jax.load_config("smoke", "train.steps=7").train.steps == 7  # one string: not 14 characters
    longer = dlrm_jax.with_overrides(a, {"train.steps": 70})
    assert longer.train.steps == 70 and a.train.steps == 7 and longer.model == a.model
    import pytest

    with pytest.raises(dlrm_jax.ConfigError, match="train.stepz"):
        dlrm_jax.with_overrides(a, {"train.stepz": 1})


@pytest.mark.slow
def test_a_ctrl_c_while_the_first_attribute_imports_jax_leaves_it_whole():
    """Before: JAX stayed half-imported ("partially initialized module 'jax' has no attribute
    'version'") until the kernel restarted."""
    code = (
        "import os, signal, sys, threading, time, dlrm_jax\n"
        "def interrupt():\n"
        "    while 'jax._src.api' not in sys.modules:\n"
        "        time.sleep(0.001)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "threading.Thread(target=interrupt).start()\n"
        "try:\n    dlrm_jax.train_and_evaluate\nexcept KeyboardInterrupt:\n    print('interrupted')\n"
        "cfg = dlrm_jax.load_config('smoke', ['train.steps=2', 'mesh.devices=1', 'train.progress_bar=false'])\n"
        "print(dlrm_jax.train_and_evaluate(cfg, None, log=None).step)\n"
    )
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.stdout.split() == ["interrupted", "2"], out.stderr


@pytest.mark.slow
def test_asking_for_devices_after_they_started_is_refused():
    code = (
        "import jax, dlrm_jax; jax.devices()\n"
        "try:\n    dlrm_jax.request_cpu_devices(4)\nexcept RuntimeError as e:\n    print(e)\n"
    )
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "already started its devices with 1 CPU device(s)" in out.stdout and "restart the kernel" in out.stdout


@pytest.mark.slow  # 6-10 s on 2 cores
def test_train_on_arrays_of_ones_own_for_epochs(tiny, tmp_path):
    """A notebook's numpy arrays through ArraySource: each epoch reads every row once in a new
    order, epochs count its rows, evaluation scores its whole val split, and the run learns."""
    import numpy as np

    cfg = tiny(
        "train.steps=1",
        "train.epochs=3",
        "train.eval_every=0",
        "mesh.devices=2",
        "train.batch_size=32",
        "train.eval_batches=0",
    )
    rng = np.random.default_rng(0)

    def split(n):
        ids = np.stack([rng.integers(0, r, n) for r in cfg.table_rows], axis=1).astype(np.int32)
        dense = rng.normal(size=(n, 13)).astype(np.float32)
        dense[:, 0] = np.arange(n)  # tells the rows apart
        return dense, ids, (ids[:, 1] % 2).astype(np.float32)  # labels learnable from one feature

    source = dlrm_jax.ArraySource(split(192), split(100), 32, table_rows=cfg.table_rows, bag_sizes=cfg.bag_sizes)
    order = [np.concatenate([source.train_batch(e * 6 + s).dense[:, 0] for s in range(6)]) for e in range(2)]
    assert sorted(order[0]) == sorted(order[1]) == list(range(192)) and not np.array_equal(order[0], order[1])
    summary = dlrm_jax.train_and_evaluate(cfg, tmp_path / "run", source=source, log=lambda *_: None)
    assert summary.step == 3 * 192 // 32 and summary.eval_samples == 100 and summary.auc > 0.6
    # evaluated again, on the same arrays: the run says it needs them (it scored the config's
    # synthetic data, without a word)
    import pytest

    with pytest.raises(ValueError, match=r"run: trained on data given in Python \(ArraySource\), not its config's"):
        dlrm_jax.evaluate_run(tmp_path / "run", log=lambda *_: None)
    again = dlrm_jax.evaluate_run(tmp_path / "run", log=lambda *_: None, source=source)
    assert (again.step, again.auc, again.eval_samples) == (summary.step, summary.auc, 100)
    # Resumed without the arrays (the CLI): refused, the marker kept. Before: it trained on
    # synthetic data from the checkpoint on and removed the marker, so eval then scored that.
    from dlrm_jax.train.rundir import RunDirError

    with pytest.raises(RunDirError, match=r"was trained on data given in Python \(ArraySource\), not its config's"):
        dlrm_jax.train_and_evaluate(
            tiny("train.steps=30", "train.eval_every=0", "mesh.devices=2", "train.batch_size=32"),
            tmp_path / "run",
            log=lambda *_: None,
        )
    assert (tmp_path / "run" / "given_source.json").exists()


def test_array_sources_raw_ids_are_checked_against_the_dynamic_tables_before_any_work(tiny, tmp_path):
    """Raw ids of the wrong width failed 15 frames inside the traced step, after planning
    ("All input arrays must have the same shape"); given with no dynamic table, ignored."""
    import numpy as np
    import pytest

    def source(cfg, width, val_raw=True):
        rng = np.random.default_rng(0)
        ids = np.stack([rng.integers(0, r, 64) for r in cfg.table_rows], axis=1).astype(np.int32)
        split = (rng.normal(size=(64, 13)).astype(np.float32), ids, np.zeros(64), rng.integers(0, 300, (64, width)))
        val = split if val_raw else split[:3]
        return dlrm_jax.ArraySource(split, val, 32, table_rows=cfg.table_rows, bag_sizes=cfg.bag_sizes)

    dynamic = tiny("embedding.table_ids=[cat_0=dynamic]", "mesh.devices=2", "train.batch_size=32")
    for cfg, width, val_raw, says in (
        (dynamic, 3, True, r"ArraySource train: raw ids have 3 columns; the dynamic tables \(cat_0\) take 1"),
        (tiny("mesh.devices=2", "train.batch_size=32"), 1, True, "ArraySource train: raw ids given, and no table is"),
        # (the val split's row ids were scored as raw ids, without a word: AUC 0.48)
        (dynamic, 1, False, "ArraySource: raw ids given for train and not for val; give both splits' dynamic"),
    ):
        with pytest.raises(ValueError, match=says):
            dlrm_jax.train_and_evaluate(cfg, tmp_path / "run", source=source(cfg, width, val_raw), log=lambda *_: None)
    assert not (tmp_path / "run").exists()


def test_what_a_notebook_gets_wrong_first_is_named_in_one_line(tmp_path):
    """Before: a config's name where a Config goes was "must be called with a dataclass type
    or instance"; a folder that is no run dir was "config file X/config.yaml does not exist;
    shipped configs: ..."; a plan for 0 devices (mesh.devices=0 means all) was a
    ZeroDivisionError."""
    with pytest.raises(TypeError, match=r"^expected a Config, got str 'smoke': make one with dlrm_jax.load_config"):
        dlrm_jax.train_and_evaluate("smoke", tmp_path / "run", log=lambda *_: None)
    assert not (tmp_path / "run").exists()
    with pytest.raises(dlrm_jax.ConfigError, match=r"nope/config.yaml does not exist: is \S+nope a run directory\?$"):
        dlrm_jax.evaluate_run(tmp_path / "nope", log=lambda *_: None)
    with pytest.raises(dlrm_jax.ConfigError, match=r"^num_devices=0: a plan is for 1 or more devices"):
        dlrm_jax.plan_from_config(dlrm_jax.load_config("smoke"), 0)


def test_a_source_of_ones_own_is_what_trains(tiny):
    """A subclass of SyntheticSource that changes its batches is trained on them, its planning
    reads them too, and an object with no more than the protocol's train_batch, eval_batches and
    skip_report trains. Before, training took the parent's batches made on the devices: the
    change was called once (the compile), the loss that of plain synthetic data, a raise at
    step 3 never seen."""
    import numpy as np

    cfg = tiny("train.steps=4", "train.eval_every=0", "mesh.devices=2", "train.batch_size=32")
    quiet = dict(log=lambda *_: None)

    class AllPositive(dlrm_jax.SyntheticSource):
        def train_batch(self, step):
            self.asked.append(step)
            batch = super().train_batch(step)
            return batch._replace(labels=np.ones_like(batch.labels))

    changed = AllPositive(cfg)
    changed.asked = []
    plain = dlrm_jax.train_and_evaluate(cfg, None, **quiet)
    ones = dlrm_jax.train_and_evaluate(cfg, None, source=changed, **quiet)
    assert {1, 2, 3} <= set(changed.asked) and ones.loss != plain.loss

    class Minimal:  # the protocol a notebook's docstring names, and nothing else
        def __init__(self):
            self.inner = dlrm_jax.SyntheticSource(cfg)

        def train_batch(self, step):
            return self.inner.train_batch(step)

        def eval_batches(self):
            return self.inner.eval_batches()

        def skip_report(self):
            return ""

    minimal = dlrm_jax.train_and_evaluate(cfg, None, source=Minimal(), **quiet)
    assert minimal.loss == plain.loss  # (the same batches, read on the host)


def test_array_source_ids_must_be_whole_numbers_and_dense_values_finite_as_float32(tiny):
    """Ids of 3.7 trained as row 3 without a word; a NaN id failed in the planner ("'list'
    argument must have no negative elements"). Whole-number floats (read from a CSV) are ids."""
    import numpy as np

    cfg = tiny("mesh.devices=2", "train.batch_size=32")
    ids = np.stack([np.arange(64) % r for r in cfg.table_rows], axis=1).astype(np.float64)
    split = lambda ids: (np.zeros((64, 13)), ids, np.zeros(64))
    make = lambda ids: dlrm_jax.ArraySource(
        split(ids), split(ids), 32, table_rows=cfg.table_rows, bag_sizes=cfg.bag_sizes
    )
    assert make(ids).train_batch(0).ids.dtype == np.int32
    for bad, says in ((3.7, "3.7"), (np.nan, "nan")):
        odd = ids.copy()
        odd[5, 1] = bad
        with pytest.raises(ValueError, match=rf"ArraySource train: id {says} in row 5 is not a whole number"):
            make(odd)
    # Dense values finite as float64 but not as the float32 that trains (before: 1e300 became inf,
    # with NumPy's overflow warning, and the run 'diverged' naming the learning rate)
    for bad, says in ((1e300, "dense row 7 is not finite as float32"), (np.inf, "dense row 7 is not finite$")):
        dense = np.zeros((64, 13))
        dense[7, 2] = bad
        with pytest.raises(ValueError, match=f"ArraySource train: {says}"):
            dlrm_jax.ArraySource(
                (dense, ids, np.zeros(64)), split(ids), 32, table_rows=cfg.table_rows, bag_sizes=cfg.bag_sizes
            )


def test_array_sources_that_do_not_fit_the_config_are_refused_before_any_work(tiny, tmp_path):
    """Ids up to 9,999 for tables the config gives 50-5,000 rows trained without a word
    (table-wise sharding) or failed deep in the planner ("cannot reshape array of size 21");
    an empty val split trained every step, then failed at the final evaluation, losing the
    steps since the last checkpoint. The config's train.seed and train.eval_batches rule
    where the source was not given its own (it scored the whole split, shuffled by seed 0)."""
    import numpy as np

    cfg = tiny("mesh.devices=2", "train.batch_size=32", "train.steps=2", "train.eval_every=0")
    rng = np.random.default_rng(0)

    def split(n, rows=cfg.table_rows, bags=cfg.bag_sizes, dense=13):
        ids = np.concatenate([rng.integers(0, r, (n, b)) for r, b in zip(rows, bags, strict=True)], axis=1)
        return rng.normal(size=(n, dense)), ids, rng.integers(0, 2, n)

    def source(rows=cfg.table_rows, bags=cfg.bag_sizes, dense=13, batch=32, val=100, **kw):
        make = lambda n: split(n, rows, bags, dense)
        return dlrm_jax.ArraySource(make(96), make(val), batch, table_rows=rows, bag_sizes=bags, **kw)

    wider = [10_000] * len(cfg.table_rows)
    for made, says in (
        (source(rows=wider), r"ArraySource table_rows: cat_0 has 10,000 here, \S+ in the config \(data.cardinalities"),
        (source(rows=wider[:-1], bags=cfg.bag_sizes[:-1]), r"ArraySource table_rows: \d+ tables, the config \d+"),
        (source(bags=[2, *cfg.bag_sizes[1:]]), r"ArraySource bag_sizes: cat_0 has 2 here, 1 in the config"),
        (source(dense=5), r"ArraySource: 5 dense columns, the config's data.num_dense=13"),
        (source(batch=16), r"ArraySource: 16 rows a batch, the config's train.batch_size=32"),
        (source(val=0), r"ArraySource: the val split is empty, and the run evaluates"),
    ):
        with pytest.raises(ValueError, match=says):
            dlrm_jax.train_and_evaluate(cfg, tmp_path / "run", source=made, log=lambda *_: None)
        assert not (tmp_path / "run").exists()
    train, val = split(96), split(100)
    arrays = lambda **kw: dlrm_jax.ArraySource(train, val, 32, table_rows=cfg.table_rows, bag_sizes=cfg.bag_sizes, **kw)
    seven = dlrm_jax.with_overrides(cfg, {"train.seed": 7})  # (tiny: train.eval_batches=2)
    mine, given = arrays(), arrays(seed=0, eval_batches=0)
    first = mine.train_batch(0).ids
    mine.check_config(seven)
    given.check_config(seven)
    assert not np.array_equal(mine.train_batch(0).ids, first) and len(list(mine.eval_batches())) == 2
    assert np.array_equal(given.train_batch(0).ids, first) and len(list(given.eval_batches())) == 4


def test_configs_of_a_sweep_or_built_in_code_are_read_or_named_by_their_key():
    """numpy's scalars and arrays (a sweep over np.arange) were refused ('expected an integer,
    got np.int64(5)'); a Config given to load_config, overrides of None or a dict among strings,
    and a name given to with_overrides failed with TypeErrors from inside; a Config built in code
    with a dict section or a string step with an AttributeError or a comparison's TypeError."""
    import dataclasses

    import numpy as np

    from dlrm_jax.config import validated

    cfg = dlrm_jax.load_config("smoke", {"train.steps": np.int64(5), "model.bottom_mlp": np.array([16, 8])})
    assert (cfg.train.steps, cfg.model.bottom_mlp) == (5, (16, 8)) and type(cfg.train.steps) is int
    assert dlrm_jax.load_config("smoke", None) == dlrm_jax.load_config("smoke")
    with pytest.raises(TypeError, match=r"got Config: to change a Config, dlrm_jax.with_overrides\(cfg, overrides\)"):
        dlrm_jax.load_config(cfg)
    with pytest.raises(TypeError, match=r"KEY=VALUE strings; got a dict among the strings: \{'train.steps': 5\}"):
        dlrm_jax.load_config("smoke", [{"train.steps": 5}])
    with pytest.raises(TypeError, match=r"with_overrides takes a Config \(dlrm_jax.load_config makes one\), got str"):
        dlrm_jax.with_overrides("smoke", {"train.steps": 5})
    assert validated(dlrm_jax.Config(train={"steps": 10})).train.steps == 10
    with pytest.raises(dlrm_jax.ConfigError, match="train.steps: expected an integer, got '10'"):
        validated(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps="10")))


def test_one_path_where_several_go_is_a_list_of_one(tmp_path):
    """preprocess_criteo("day.tsv", ...) read the string as its characters ('--input /: a
    folder, not a file'), as serving.load(model, deltas="delta") did (files.as_paths)."""
    from dlrm_jax.data.sources.criteo import write_criteo_tsv
    from dlrm_jax.data.sources.synthetic import SyntheticGenerator

    gen = SyntheticGenerator(
        seed=1, num_dense=13, table_rows=(50,) * 26, bag_sizes=(1,) * 26, zipf_exponent=1.1, positive_rate=0.3
    )
    write_criteo_tsv(tmp_path / "day.tsv", gen.raw(0, 0, 0, 200))
    report = dlrm_jax.preprocess_criteo(str(tmp_path / "day.tsv"), str(tmp_path / "ds"), workers=1, progress=False)
    assert report.train_rows + report.val_rows == 200


def test_plan_embeddings_names_what_it_cannot_take():
    """An optimizer it does not know was a KeyError 'adam' from the bytes of its state, no
    devices a ZeroDivisionError, a misspelt strategy in overrides enum's "'tabel' is not a valid
    Strategy", naming neither the table nor the choices."""
    specs = [dlrm_jax.TableSpec("u", 1000, 8), dlrm_jax.TableSpec("i", 500, 8)]
    for args, says in (
        (("row", 8, "adam"), r"optimizer: 'adam' is not one of sgd, adagrad, rowwise_adagrad"),
        (("row", 0, "sgd"), "num_devices: expected a positive integer, got 0"),
    ):
        with pytest.raises(dlrm_jax.PlanError, match=says):
            dlrm_jax.plan_embeddings(specs, *args, 1024)
    with pytest.raises(dlrm_jax.PlanError, match=r"overrides\['u'\]: 'tabel' is not one of auto, replicated, table"):
        dlrm_jax.plan_embeddings(specs, "row", 8, "sgd", 1024, overrides={"u": "tabel"})


def test_what_is_not_a_source_is_named_before_any_work_and_log_none_is_quiet(tiny, tmp_path, capsys):
    """A generator of batches as source= failed after planning began ("'generator' object has
    no attribute 'skip_report'"); ArraySource given a dict split, with "unhashable type: 'slice'";
    log=None, with "'NoneType' object is not callable"."""
    import numpy as np

    cfg = tiny("mesh.devices=2", "train.batch_size=32", "train.steps=2", "train.eval_every=0")
    batches = (dlrm_jax.SyntheticSource(cfg).train_batch(i) for i in range(2))
    with pytest.raises(TypeError, match=r"source: a generator has no train_batch or eval_batches\(\); a data source"):
        dlrm_jax.train_and_evaluate(cfg, tmp_path / "run", source=batches)
    assert not (tmp_path / "run").exists()
    split = {"dense": np.zeros((64, 13)), "ids": np.zeros((64, 4)), "labels": np.zeros(64)}
    with pytest.raises(ValueError, match=r"ArraySource train: expected \(dense, ids, labels\)"):
        dlrm_jax.ArraySource(split, split, 32, table_rows=cfg.table_rows, bag_sizes=cfg.bag_sizes)
    capsys.readouterr()
    assert dlrm_jax.train_and_evaluate(cfg, None, log=None).step == 2
    assert capsys.readouterr().out == ""


def test_an_array_source_takes_the_configs_data_shuffle(tiny):
    """Before: data.shuffle=false was ignored for arrays given in Python (shuffled unless the
    constructor was told): progressive validation scored shuffled windows, the same bits as
    data.shuffle=true, where the docs call it time-ordered."""
    import numpy as np

    import dlrm_jax

    cfg = tiny("train.batch_size=32", "data.shuffle=false")
    rng = np.random.default_rng(0)
    ids = np.stack([rng.integers(0, r, 96) for r in cfg.table_rows], axis=1).astype(np.int32)
    dense = np.tile(np.arange(96, dtype=np.float32)[:, None], (1, 13))
    arrays = (dense, ids, (ids[:, 1] % 2).astype(np.float32))
    make = lambda **kw: dlrm_jax.ArraySource(
        arrays, arrays, 32, table_rows=cfg.table_rows, bag_sizes=cfg.bag_sizes, **kw
    )
    first = lambda source: source.train_batch(0).dense[:, 0].tolist()
    source = make()
    source.check_config(cfg)
    assert first(source) == list(range(32))  # in the order given
    source.check_config(tiny("train.batch_size=32"))  # data.shuffle: true, the default
    assert first(source) != list(range(32))
    given = make(shuffle=True)  # given: kept over the config's
    given.check_config(cfg)
    assert first(given) != list(range(32))


def test_the_process_wide_jax_settings_of_a_notebook_change_nothing(tiny, tmp_path):
    """A notebook's jax_enable_x64 made the dense parameters float64 (checkpoints of either kind
    then read as damaged in the other), its PRNG settings drew other initial weights from the
    same seed, strict promotion failed deep in the step; a context mesh and disable_jit failed
    there too. Now the settings are held around each call, and the two that cannot be are
    refused in one line."""
    import jax

    cfg = tiny("mesh.devices=1", "train.steps=2", "train.progress_bar=false", "train.eval_batches=1")
    plain = dlrm_jax.train_and_evaluate(cfg, tmp_path / "plain", log=None)
    settings = {
        "jax_enable_x64": True,
        "jax_threefry_partitionable": False,
        "jax_default_prng_impl": "rbg",
        "jax_numpy_rank_promotion": "raise",
        "jax_numpy_dtype_promotion": "strict",
    }
    before = {k: getattr(jax.config, k) for k in settings}
    try:
        for k, v in settings.items():
            jax.config.update(k, v)
        again = dlrm_jax.train_and_evaluate(cfg, tmp_path / "again", log=None)
        assert (again.loss, again.auc, again.logloss) == (plain.loss, plain.auc, plain.logloss)
        assert dlrm_jax.evaluate_run(tmp_path / "plain", log=None).auc == plain.auc  # (read as damaged, before)
    finally:
        for k, v in before.items():
            jax.config.update(k, v)
    with jax.set_mesh(jax.make_mesh((1,), ("x",))), pytest.raises(RuntimeError, match="a mesh is set in JAX's context"):
        dlrm_jax.evaluate_run(tmp_path / "plain", log=None)
    with jax.disable_jit(), pytest.raises(RuntimeError, match="jax_disable_jit is on"):
        dlrm_jax.evaluate_run(tmp_path / "plain", log=None)


def test_a_second_run_at_once_in_one_process_is_refused(tiny, tmp_path):
    """Two runs in two threads of a sweep broke each other's checkpoints ('File exists: ...
    orbax-checkpoint-tmp'): orbax's checkpointing is process-wide."""
    import threading

    from dlrm_jax.train import trainer

    started, finish = threading.Event(), threading.Event()
    held = threading.Thread(target=lambda: trainer._one_run_at_a_time(lambda: (started.set(), finish.wait(60)))())
    held.start()
    started.wait(60)
    try:
        with pytest.raises(RuntimeError, match="another dlrm_jax run is training in this process"):
            dlrm_jax.train_and_evaluate(tiny("train.steps=1"), tmp_path / "run", log=None)
    finally:
        finish.set()
        held.join(60)
    assert not (tmp_path / "run").exists()
