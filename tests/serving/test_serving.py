"""The serving artifact (export --serving, dlrm_jax.serving, dlrm-jax predict) against eval's own
scores: equal to float32 rounding (bitwise on some CPUs), and bitwise to each other by ids, by
raw lines and through the CLI; int8 and bfloat16
tables near them; a base plus its deltas equal to the full export of the last step."""

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dlrm_jax import serving
from dlrm_jax.config import load_config
from dlrm_jax.data.preprocessing.criteo_preprocess import preprocess_criteo
from dlrm_jax.data.preprocessing.tabular import preprocess_tabular
from dlrm_jax.data.sources import make_source
from dlrm_jax.data.sources.criteo import CriteoFormatError, write_criteo_tsv
from dlrm_jax.data.sources.synthetic import SyntheticGenerator
from dlrm_jax.observe.metrics import roc_auc
from dlrm_jax.serving.artifact import ArtifactError
from dlrm_jax.serving.rules import parse_criteo
from dlrm_jax.train.evaluate import eval_scores
from dlrm_jax.train.export import restore_run
from dlrm_jax.train.saved_run import restored
from dlrm_jax.train.serving_export import export_serving
from dlrm_jax.train.trainer import train_and_evaluate
from tests.child_env import child_env
from tests.data.public_layouts import make_movielens
from tests.helpers import QUIET, tiny_config

LINES, VAL = 1500, 300


def scores_of(run_dir):
    """eval's probabilities of the held-out rows (as ``dlrm-jax eval`` scores them: tiered
    tables from the tier's snapshot), and those rows' dense features and ids."""
    state, driver = restored(run_dir, **QUIET)
    try:
        source, runner = driver.source, getattr(driver, "runner", None)
        probs, dense, ids = [], [], []
        scored = eval_scores(driver.steps, state, source, runner)
        for (p, _, m), b in zip(scored, source.eval_batches(), strict=True):
            probs.append(p[m])
            dense.append(b.dense)
            ids.append(b.ids)
    finally:
        driver.close()
    return np.concatenate(probs), np.concatenate(dense), np.concatenate(ids)


def run_config(tmp, *more):
    """The fixture's run on ``tmp``'s preprocessed lines (``more``: overrides)."""
    return load_config(
        None,
        [
            "data.source=binary",
            f"data.path={tmp / 'ds'}",
            "train.batch_size=128",
            "train.steps=16",
            "train.checkpoint_every=8",
            "train.eval_every=8",
            "train.eval_batches=0",
            "train.progress_bar=false",
            "mesh.devices=4",
            "model.embedding_dim=8",
            "model.bottom_mlp=[16, 8]",
            "model.top_mlp=[16, 1]",
            "train.keep_checkpoints=3",
            *more,
        ],
    )


def criteo_sample(tmp, seed: int, rows: int = 400, lines: int = LINES, val: int = VAL, **preprocess) -> list[bytes]:
    """``tmp/day.tsv``: Criteo lines drawn from the synthetic generator (tables of 40 and
    ``rows`` values in turn), preprocessed in order into ``tmp/ds`` with the last ``val`` held
    out (``preprocess``: more of preprocess_criteo's options); its lines."""
    gen = SyntheticGenerator(
        seed=seed, num_dense=13, table_rows=(40, rows) * 13, bag_sizes=(1,) * 26, zipf_exponent=1.1, positive_rate=0.3
    )
    write_criteo_tsv(tmp / "day.tsv", gen.raw(0, 0, 0, lines), missing_cat_rate=0.05)
    kw = dict(val_fraction=val / lines, shuffle_seed=None, workers=1, progress=False)
    preprocess_criteo([str(tmp / "day.tsv")], str(tmp / "ds"), **kw, **preprocess)
    return (tmp / "day.tsv").read_bytes().splitlines(keepends=True)


def movielens_sample(tmp, **preprocess) -> list[bytes]:
    """MovieLens-1M-shaped ratings in ``tmp/ml`` (600, time-ordered), preprocessed by the shipped
    schema into ``tmp/ds`` with the latest 20% held out; the ratings' lines."""
    ml = tmp / "ml"
    make_movielens(ml, n=600)
    preprocess_tabular(
        "movielens_1m",
        [str(ml / "ratings.dat")],
        str(tmp / "ds"),
        val_fraction=0.2,
        joins={"users": str(ml / "users.dat"), "movies": str(ml / "movies.dat")},
        shuffle_seed=None,
        workers=1,
        progress=False,
        **preprocess,
    )
    return (ml / "ratings.dat").read_bytes().splitlines(keepends=True)


def smoke_run(tmp, *more):
    """The smoke config on ``tmp/ds`` for 10 steps on 2 devices, saved at the end."""
    base = ["data.source=binary", f"data.path={tmp / 'ds'}", "train.steps=10", "train.checkpoint_every=10"]
    quiet = ["train.eval_every=0", "train.eval_batches=0", "train.progress_bar=false", "mesh.devices=2"]
    return load_config("smoke", [*base, *quiet, *more])


def train_and_export(cfg, tmp):
    """``cfg`` trained into ``tmp/run`` and exported to ``tmp/art``; eval's scores (scores_of)."""
    train_and_evaluate(cfg, tmp / "run", **QUIET)
    export_serving(tmp / "run", tmp / "art", **QUIET)
    return scores_of(tmp / "run")


@pytest.fixture(scope="module")
def criteo(tmp_path_factory):
    """A run on preprocessed Criteo lines (4 devices, checkpoints at steps 8 and 16), its
    artifacts (float32 at 8 and 16, int8 and bfloat16 at 16, a delta 8 -> 16) and eval's scores."""
    tmp = tmp_path_factory.mktemp("serving")
    criteo_sample(tmp, seed=3)
    train_and_evaluate(run_config(tmp), tmp / "run", **QUIET)
    art = {}
    for name, step, kw in (
        ("f8", 8, {}),
        ("f16", 16, {}),
        ("i8", 16, {"tables": "int8"}),
        ("b16", 16, {"tables": "bfloat16"}),
        ("d", 16, {"since": 8}),
    ):
        export_serving(tmp / "run", tmp / name, step=step, **kw, **QUIET)
        art[name] = tmp / name
    return tmp, art, scores_of(tmp / "run")


def assert_scores_of_eval(got, probs):
    """Serving's scores against eval's: the same graph, compiled for other shapes (eval's rows
    per device, a call's padded rows). Equal bitwise where XLA:CPU takes the same matmul
    kernels for both (the CPUs this suite ran on before); on an AVX2-only AMD EPYC
    (2026-11-27) 65 of 300 rows differed by up to 5 ulps. Float32 rounding, never more."""
    np.testing.assert_array_max_ulp(got, probs, maxulp=8)


@pytest.mark.slow
def test_scores_equal_evals_by_ids_by_raw_lines_and_through_the_cli(criteo):
    tmp, art, (probs, dense, ids) = criteo
    with serving.load(art["f16"]) as model:
        assert model.step == 16 and model.manifest["evaluation"]["auc"] > 0.5
        by_ids = model.predict(dense, ids)
        assert_scores_of_eval(by_ids, probs)
        for batch in (1, 100, 4096):  # a row's score does not depend on the batch it came in
            np.testing.assert_array_equal(model.predict(dense, ids, batch_size=batch), by_ids)
        val_lines = (tmp / "day.tsv").read_bytes().splitlines(keepends=True)[-VAL:]
        np.testing.assert_array_equal(model.predict_raw(val_lines), by_ids)
    unlabeled = tmp / "unlabeled.tsv.gz"
    with gzip.open(unlabeled, "wb") as f:
        f.writelines(line.split(b"\t", 1)[1] for line in val_lines)
    bad = tmp / "bad.tsv"
    bad.write_bytes(b"".join(val_lines[:5]) + b"1\tnot a line\n" + b"".join(val_lines[5:10]))
    out = tmp / "pred.txt"
    cli = [
        sys.executable,
        "-m",
        "dlrm_jax",
        "predict",
        "--model",
        str(art["f16"]),
        "--output",
        str(out),
        "--overwrite",  # each run below writes the same file
        "--no-progress",
    ]
    r = subprocess.run(
        [*cli, "--input", str(tmp / "day.tsv"), str(unlabeled)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert f"predicted {LINES + VAL} of {LINES + VAL} lines" in r.stdout
    scored = np.loadtxt(out, dtype=np.float32)
    np.testing.assert_array_equal(scored[LINES - VAL : LINES], by_ids)
    np.testing.assert_array_equal(scored[LINES:], by_ids)  # without the label column, from .gz
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dlrm_jax",
            "export",
            "--run-dir",
            str(tmp / "run"),
            "--output",
            str(tmp / "x"),
            "--tables",
            "int8",
        ],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=60,
    )
    assert r.returncode != 0 and "go with --serving" in r.stderr and not (tmp / "x").exists()
    r = subprocess.run([*cli, "--input", str(bad)], capture_output=True, text=True, env=child_env(), timeout=120)
    assert r.returncode != 0 and f"{bad}:6: " in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not list(tmp.glob("*.partial"))
    r = subprocess.run(
        [*cli, "--input", str(bad), "--skip-bad-lines"], capture_output=True, text=True, env=child_env(), timeout=120
    )
    assert r.returncode == 0 and "skipped 1 malformed line" in r.stdout
    scored = np.loadtxt(out, dtype=np.float32)
    assert np.isnan(scored[5]) and np.array_equal(scored[:5], by_ids[:5]) and np.array_equal(scored[6:], by_ids[5:10])


@pytest.mark.slow
def test_loading_and_predicting_need_no_flax_optax_or_orbax(criteo):
    tmp, art, (probs, dense, ids) = criteo
    np.savez(tmp / "inputs.npz", dense=dense[:50], ids=ids[:50])
    code = (
        "import sys\n"
        "for m in ('flax', 'optax', 'orbax', 'orbax.checkpoint'): sys.modules[m] = None\n"
        "import numpy as np\nfrom dlrm_jax.serving import load\n"
        f"x = np.load({str(tmp / 'inputs.npz')!r})\n"
        f"np.save({str(tmp / 'p.npy')!r}, load({str(art['f16'])!r}).predict(x['dense'], x['ids']))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    with serving.load(art["f16"]) as model:
        np.testing.assert_array_equal(np.load(tmp / "p.npy"), model.predict(dense[:50], ids[:50]))


@pytest.mark.slow
def test_int8_and_bfloat16_tables_score_near_float32_in_a_fraction_of_the_bytes(criteo):
    tmp, art, (probs, dense, ids) = criteo
    labels = np.concatenate([y[m] for _, y, m in eval_scores(*_run_parts(tmp))])
    sizes = {k: sum(p.stat().st_size for p in (art[k] / "tables").rglob("c.*")) for k in ("f16", "i8", "b16")}
    dim = 8  # int8: a byte a value and two float32 a row
    assert sizes["i8"] == sizes["f16"] * (dim + 8) // (4 * dim) and sizes["b16"] == sizes["f16"] // 2
    for name in ("i8", "b16"):
        with serving.load(art[name]) as model:
            p = model.predict(dense, ids)
        assert np.abs(p - probs).max() < 5e-3, name
        assert abs(roc_auc(labels, p) - roc_auc(labels, probs)) < 2e-3, name


def _run_parts(tmp):
    run = restore_run(tmp / "run", **QUIET)
    return run.steps, run.state, make_source(run.cfg, 0, 1, trains=False, evaluates=True)


@pytest.mark.slow
@pytest.mark.parametrize("memory_bytes", [None, 0])  # 0: every table behind the row cache
def test_a_base_and_its_delta_load_to_the_full_export_of_the_last_step(criteo, memory_bytes):
    tmp, art, (probs, dense, ids) = criteo
    delta = json.loads((art["d"] / "manifest.json").read_text())
    changed = sum(f["rows_changed"] for f in delta["features"])
    assert 0 < changed < sum(f["rows"] for f in delta["features"])  # 16 batches of 128 touch some rows, not all
    with (
        serving.load(art["f8"], [art["d"]], memory_bytes=memory_bytes, cache_rows=64) as merged,
        serving.load(art["f16"], memory_bytes=memory_bytes) as full,
    ):
        assert merged.step == full.step == 16
        for f in full.features:
            a, b = merged.tables.table_fields(f["table"]), full.tables.table_fields(f["table"])
            for k in b:
                np.testing.assert_array_equal(a[k], b[k], err_msg=f["table"])
        np.testing.assert_array_equal(merged.predict(dense, ids), full.predict(dense, ids))
    with pytest.raises(ArtifactError, match="apply the deltas in order"):
        serving.load(art["f16"], [art["d"]])
    with pytest.raises(ArtifactError, match="a delta"):
        serving.load(art["d"])


def test_reloads_and_deltas_keep_the_compiled_dense_function(criteo):
    """A run's exports and deltas share the dense function: a server loading the next delta
    keeps its compiled programs (each load compiled them again: 557 -> 9 ms a load and first
    call, and JAX's caches grew about 40 KB a load)."""
    _, art, (_, dense, ids) = criteo
    with serving.load(art["f8"]) as first:
        want = first.predict(dense[:8], ids[:8])
        call = first._call
    programs = call._cache_size()  # (other tests' calls of other sizes may have compiled some too)
    with serving.load(art["f8"]) as again, serving.load(art["f8"], [art["d"]]) as moved:
        assert again._call is call and moved._call is call
        np.testing.assert_array_equal(again.predict(dense[:8], ids[:8]), want)
        assert moved.step == 16 and moved.predict(dense[:8], ids[:8]).shape == (8,)
    assert call._cache_size() == programs  # none compiled again


def test_threads_predicting_at_once_through_a_row_cache_score_as_one_does(criteo):
    """A server's threads share one model: through tables behind a small row cache, 4 threads
    scored 7-11 of 960 rows each with other ids' rows (or raised a shape error), the cache's
    slots moved under them."""
    import threading

    _, art, (_, dense, ids) = criteo
    with serving.load(art["f16"]) as whole, serving.load(art["f16"], memory_bytes=0, cache_rows=64) as cached:
        want = whole.predict(dense, ids)
        rng = np.random.default_rng(0)
        picks = [[rng.choice(len(ids), 64, replace=False) for _ in range(15)] for _ in range(4)]
        start, wrong, failed = threading.Barrier(4), [0] * 4, []

        def serve(t):
            start.wait()
            try:
                for sel in picks[t]:
                    wrong[t] += int(np.sum(cached.predict(dense[sel], ids[sel], batch_size=8) != want[sel]))
            except Exception as e:  # noqa: BLE001 - reported below
                failed.append(e)

        threads = [threading.Thread(target=serve, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not failed and wrong == [0] * 4


def test_predicts_arguments_that_would_score_wrong_are_refused(criteo):
    """batch_size=-1 returned uninitialised memory as scores; ids of 3.7 scored as 3, a NaN id
    was an IndexError. Whole-number floats (ids read from a CSV) score as their integers."""
    _, art, (_, dense, ids) = criteo
    with serving.load(art["f16"]) as m:
        for bad in (-1, 0, 2.5):
            with pytest.raises(ValueError, match=f"batch_size must be a positive integer, got {bad}"):
                m.predict(dense[:3], ids[:3], batch_size=bad)
        with pytest.raises(ValueError, match=r"predict: id 3.7 in row 0 is not a whole number"):
            m.predict(dense[:3], np.where(np.arange(ids.shape[1]) == 0, 3.7, ids[:3]))
        with pytest.raises(ValueError, match=r"predict: id nan in row 2 is not a whole number"):
            m.predict(dense[:3], np.where(np.arange(3)[:, None] == 2, np.nan, ids[:3]))
        np.testing.assert_array_equal(m.predict(dense[:3], ids[:3].astype(np.float64)), m.predict(dense[:3], ids[:3]))
        # Dense values training refuses (before: NaN scores, or an overflow warning and NaN for 1e300)
        for bad in (np.nan, np.inf, 1e300):
            odd = dense[:3].astype(np.float64)
            odd[1, 2] = bad
            with pytest.raises(
                ValueError, match=rf"dense row 1, column 2: {re.escape(repr(bad))} is not a finite float32"
            ):
                m.predict(odd, ids[:3])


def test_one_raw_line_says_whether_it_has_the_label(criteo):
    """A lone line that lost a field reads as one without its label, its fields shifted (scored
    0.52 where the whole line scores 0.24): a server scoring one request at a time says which it
    sends (labeled=), and a line is one line, not its characters."""
    tmp, art, _ = criteo
    line = (tmp / "day.tsv").read_bytes().splitlines(keepends=True)[-1]
    cut = line.rstrip(b"\n").rsplit(b"\t", 1)[0] + b"\n"
    with serving.load(art["f16"]) as m:
        want = m.predict_raw([line])
        with pytest.raises(CriteoFormatError, match="line 1: expected 40 tab-separated fields"):
            m.predict_raw([cut], labeled=True)
        np.testing.assert_array_equal(m.predict_raw([line.split(b"\t", 1)[1]], labeled=False), want)
        np.testing.assert_array_equal(m.predict_raw(line.decode()), want)
        # (before: 'no label, as the file's other lines', of a lone line whose caller said so)
        with pytest.raises(
            CriteoFormatError, match=r"expected 39 tab-separated fields \(no label, as labeled=False says"
        ):
            m.predict_raw([line], labeled=False)


@pytest.mark.slow
def test_a_damaged_or_unfinished_artifact_is_one_error_naming_the_file(criteo, tmp_path):
    import shutil

    _, art, _ = criteo
    copy = tmp_path / "a"
    shutil.copytree(art["f16"], copy)
    params = copy / "dense" / "params.npz"
    params.write_bytes(params.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(ArtifactError, match=f"{params}: its sha256 differs"):
        serving.load(copy)
    shutil.copytree(art["f16"], tmp_path / "b")
    values = next((tmp_path / "b" / "tables" / "cat_3" / "values").glob("c.*"))
    values.write_bytes(values.read_bytes()[::-1])
    with pytest.raises(ArtifactError, match="cat_3/values/c.*sha256 differs"):
        serving.load(tmp_path / "b")  # tables read whole are checked as they are read
    with pytest.raises(ArtifactError, match="cat_3/values/c"):
        serving.load(tmp_path / "b", memory_bytes=0, verify_tables=True)
    _, dense, ids = criteo[2]
    with serving.load(tmp_path / "b", memory_bytes=0) as model:  # behind the row cache: at first use
        with pytest.raises(ArtifactError, match="cat_3/values/c.*sha256 differs"):
            model.predict(dense, ids)
    (copy / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match="manifest.json: missing"):
        serving.load(copy)
    with pytest.raises(FileExistsError, match="not empty"):
        export_serving(criteo[0] / "run", art["f16"], **QUIET)


@pytest.mark.slow
def test_bags_and_the_wide_part_score_as_eval_and_raw_rows_are_refused_without_rules(tmp_path):
    cfg = tiny_config(
        "model.kind=wide_deep",
        "model.bottom_mlp=[]",
        "model.interaction=cat",
        "data.bag_sizes=[1, 3, 1, 4]",
        "data.pooling=mean",
        "train.checkpoint_every=6",
        "mesh.devices=2",
    )
    probs, dense, ids = train_and_export(cfg, tmp_path)
    with serving.load(tmp_path / "art") as model:
        assert [f["bag_size"] for f in model.features] == [1, 3, 1, 4] and len(model.part_features["wide"]) == 4
        # named as `dlrm-jax export` names them (they were wide_wide_0 ...)
        assert [f["table"] for f in model.part_features["wide"]] == ["wide_0", "wide_1", "wide_2", "wide_3"]
        assert sorted(p.name for p in (tmp_path / "art" / "tables").iterdir() if p.name.startswith("wide")) == [
            "wide_0",
            "wide_1",
            "wide_2",
            "wide_3",
        ]
        assert_scores_of_eval(model.predict(dense, ids), probs)
        with pytest.raises(ArtifactError, match="data.source=synthetic"):
            model.predict_raw(["1\t2"])


@pytest.mark.slow
def test_multi_hot_bags_and_tiered_tables_score_raw_lines_as_eval(tmp_path):
    """A DLRM-DCNv2-style dataset (``preprocess --multi-hot``) trained with two tables tiered
    and one capped (``data.max_rows``): the export holds every row the tier holds, not the
    devices' cache of it, and raw lines draw their bags by the dataset's rule, so they score
    as the held-out rows' ids do and as evaluation does."""
    bags = (3, 1, 2, *(1,) * 22, 4)
    lines = criteo_sample(tmp_path, seed=5, rows=700, multi_hot=bags)
    cfg = run_config(
        tmp_path,
        f"data.bag_sizes={list(bags)}",
        "data.max_rows=100",  # cat_1 (268 values) and the other wide ones wrap into 100 rows, bags too
        "mesh.devices=2",
        "embedding.table_storage=[cat_1=tiered, cat_25=tiered]",
        "embedding.tier.device_cache_fraction=0.1",
    )
    probs, dense, ids = train_and_export(cfg, tmp_path)
    with serving.load(tmp_path / "art") as model:
        cards = json.loads((tmp_path / "ds" / "meta.json").read_text())["cardinalities"]
        assert [f["rows"] for f in model.features] == [min(c, 100) for c in cards]  # tiered ones whole
        assert [f["bag_size"] for f in model.features] == list(bags)
        by_ids = model.predict(dense, ids)
        assert_scores_of_eval(by_ids, probs)
        val_lines = lines[-VAL:]
        np.testing.assert_array_equal(model.raw_inputs(parse_criteo(val_lines))[1], ids)
        np.testing.assert_array_equal(model.predict_raw(val_lines), by_ids)


@pytest.mark.slow
def test_tabular_records_with_or_without_their_label_score_as_eval(tmp_path):
    ratings = movielens_sample(tmp_path)
    # the join files and the schema preprocessing read may go: the dataset holds its copies
    # (export read the originals: 'No such file or directory', or other scores where they had
    # been edited)
    (tmp_path / "ml").rename(tmp_path / "ml_gone")
    train_and_evaluate(smoke_run(tmp_path), tmp_path / "run", **QUIET)
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    meta["schema"] = str(tmp_path / "gone" / Path(meta["schema"]).name)  # (the same dataset, its schema elsewhere)
    (tmp_path / "ds" / "meta.json").write_text(json.dumps(meta))
    export_serving(tmp_path / "run", tmp_path / "art", **QUIET)
    probs, _, _ = scores_of(tmp_path / "run")
    val = ratings[-len(probs) :]  # the latest ratings
    unlabeled = tmp_path / "unlabeled.dat"
    unlabeled.write_bytes(b"".join(b"::".join(line.split(b"::")[:2] + line.split(b"::")[3:]) for line in val))
    with serving.load(tmp_path / "art") as model:
        assert model.manifest["preprocessing"]["format"] == "tabular"
        by_raw = model.predict_raw(val)
        assert_scores_of_eval(by_raw, probs)
        np.testing.assert_array_equal(model.predict_raw(unlabeled.read_bytes().splitlines()), by_raw)
        # a first line that lost a field does not decide the file's layout (it did: every other line was bad)
        cut = [b"::".join(val[0].split(b"::")[:3]) + b"\n", *val[1:]]
        got = model.predict_raw(cut, skip_bad_lines=True)
        assert np.isnan(got[0]) and not np.isnan(got[1:]).any()
        np.testing.assert_array_equal(got[1:], by_raw[1:])
    out = tmp_path / "p.txt"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dlrm_jax",
            "predict",
            "--model",
            str(tmp_path / "art"),
            "--input",
            str(unlabeled),
            "--output",
            str(out),
            "--format",
            "tabular",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(np.loadtxt(out, dtype=np.float32), by_raw)


def _predict_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "dlrm_jax", "predict", *args, "--no-progress"],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )


@pytest.mark.slow
def test_latin1_records_quoting_their_delimiter_score_as_given_with_or_without_their_label_or_header(tmp_path):
    """A schema's own encoding and quoting, as its files were read: lines given as text were
    encoded as UTF-8 (746 of 1,000 scores off, by up to 0.4, where values held accents), and
    records without their label column were refused where a quoted field held the delimiter
    (their fields counted by a plain split). A schema's header is optional (records alone, as a
    server sends them, were refused), one request says whether it has the label, and text or no
    lines score as lines do."""
    import csv
    import io

    (tmp_path / "s.yaml").write_text(
        "format: csv\ndelimiter: ','\nheader: true\nquoting: true\nencoding: latin-1\n"
        "columns: [price, qty, click, user, note]\nlabel: {column: click}\n"
        "dense: [price, qty]\ncategorical: [user, note]\n"
    )
    rng = np.random.default_rng(0)
    notes = ["café, au lait", "naïve", "n,2", "über,all", "plain"]  # most holding the delimiter

    def lines(n, label=True):
        out = io.StringIO()
        for i in range(n):
            note = notes[(i * 7) % 5]
            click = int(note in ("café, au lait", "n,2")) if rng.random() < 0.8 else int(rng.integers(2))
            row = [f"{rng.random() * 9:.2f}", str(i % 4), click, f"u{i % 30}", note]
            csv.writer(out, lineterminator="\n").writerow(row if label else row[:2] + row[3:])
        return out.getvalue().encode("latin-1").splitlines(keepends=True)

    header = b"price,qty,click,user,note\n"
    records = lines(600)
    (tmp_path / "t.csv").write_bytes(header + b"".join(records))
    preprocess_tabular(
        tmp_path / "s.yaml",
        [str(tmp_path / "t.csv")],
        str(tmp_path / "ds"),
        val_fraction=0.2,
        shuffle_seed=None,
        workers=1,
        progress=False,
    )
    train_and_export(smoke_run(tmp_path, "train.batch_size=64"), tmp_path)
    rng = np.random.default_rng(0)  # the same rows again, without their label
    unlabeled = lines(600, label=False)
    with serving.load(tmp_path / "art") as model:
        want = model.predict_raw([header, *records])
        assert len(want) == 600 and not np.isnan(want).any()
        np.testing.assert_array_equal(model.predict_raw(records), want)
        np.testing.assert_array_equal(model.predict_raw([x.decode("latin-1") for x in records]), want)
        np.testing.assert_array_equal(model.predict_raw(b"".join(records).decode("latin-1")), want)
        np.testing.assert_array_equal(model.predict_raw(unlabeled), want)
        np.testing.assert_array_equal(model.predict_raw(unlabeled[2], labeled=False), want[2:3])
        assert model.predict_raw([]).shape == (0,)


@pytest.mark.slow
def test_records_without_a_header_score_where_the_schema_names_its_columns_only_in_one(tmp_path):
    """A schema with ``header: true`` and no ``columns:`` (its columns named by the files' header
    lines): records sent alone were refused, the first read as a header ("column 'price' (named in
    the schema) is not in the header: 1700021591, u5_1, ..."). Preprocessing now records the
    header's columns, and serving reads records without one by them; a model exported before
    that says what to do in one line."""
    from dlrm_jax.data.preprocessing.preprocess import DataFormatError

    (tmp_path / "s.yaml").write_text(
        "format: csv\nheader: true\nlabel: click\ndense: [price]\ncategorical: [user, item]\n"
    )
    rng = np.random.default_rng(0)
    rows = [
        (f"u{rng.integers(40)}", f"i{rng.integers(90)}", f"{rng.random() * 9:.3f}", rng.integers(2)) for _ in range(640)
    ]
    header = b"user,item,price,click\n"
    records = [f"{u},{i},{p},{c}\n".encode() for u, i, p, c in rows]
    (tmp_path / "t.csv").write_bytes(header + b"".join(records))
    preprocess_tabular(tmp_path / "s.yaml", [str(tmp_path / "t.csv")], str(tmp_path / "ds"), workers=1, progress=False)
    train_and_export(smoke_run(tmp_path, "train.batch_size=64"), tmp_path)
    unlabeled = [f"{u},{i},{p}\n".encode() for u, i, p, _ in rows]
    reordered = [b"click,price,item,user\n", *(f"{c},{p},{i},{u}\n".encode() for u, i, p, c in rows)]
    with serving.load(tmp_path / "art") as model:
        want = model.predict_raw([header, *records])
        assert len(want) == 640 and not np.isnan(want).any()
        np.testing.assert_array_equal(model.predict_raw(records), want)
        np.testing.assert_array_equal(model.predict_raw(unlabeled), want)
        np.testing.assert_array_equal(model.predict_raw(reordered), want)  # a header still read by its names
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    del manifest["preprocessing"]["header_columns"]  # (as an export before the record)
    (tmp_path / "art" / "manifest.json").write_text(json.dumps(manifest))
    with serving.load(tmp_path / "art") as model:
        np.testing.assert_array_equal(model.predict_raw([header, *records]), want)
        with pytest.raises(DataFormatError, match=r":1: records without a header line, .* send the header line first"):
            model.predict_raw(records)


@pytest.mark.slow
def test_predict_never_replaces_its_input_or_its_model_and_checks_paths_before_scoring(criteo, tmp_path):
    import shutil

    from dlrm_jax.serving.files import predict_files

    tmp, art, _ = criteo
    day, model = tmp_path / "day.tsv", tmp_path / "m"
    shutil.copy(tmp / "day.tsv", day)
    shutil.copytree(art["f16"], model)
    lines, manifest = day.read_bytes(), (model / "manifest.json").read_bytes()
    (tmp_path / "out.txt").symlink_to(model / "manifest.json")  # (its folder is outside: the target's is not)
    for output, says in (
        (day, f"--output {day} is also --input {day}"),
        (model / "manifest.json", "lies inside the serving artifact"),
        (tmp_path / "out.txt", "lies inside the serving artifact"),
    ):
        r = _predict_cli("--model", str(model), "--input", str(day), "--output", str(output))
        assert r.returncode == 1 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert day.read_bytes() == lines and (model / "manifest.json").read_bytes() == manifest
    (tmp_path / "folder").mkdir()
    (tmp_path / "dangling.txt").symlink_to(tmp_path / "nowhere" / "p.txt")  # (it named a temporary file)
    with pytest.raises(ArtifactError, match=f"{day}: a file, not a serving artifact's folder"):
        serving.load(day)  # ("[Errno 20] Not a directory" before)
    with serving.load(model) as m:
        m.predict = None  # every refusal comes before a line is scored
        for inputs, output, error, says in (
            ([day], tmp_path / "folder", IsADirectoryError, "a folder; give the path of the file"),
            ([day], tmp_path / "none" / "p.txt", FileNotFoundError, "its folder .*none does not exist"),
            ([tmp_path / "folder"], tmp_path / "p.txt", IsADirectoryError, "--input .*folder: a folder"),
            ([tmp_path / "absent.tsv"], tmp_path / "p.txt", FileNotFoundError, "--input .*absent.tsv: no such file"),
            ([day], model / "dense" / "new.txt", ValueError, "inside the serving artifact"),
            ([day], tmp_path / "dangling.txt", FileNotFoundError, "a link to .*nowhere.*whose folder does not exist"),
        ):
            with pytest.raises(error, match=says):
                predict_files(m, inputs, output, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling.txt", "day.tsv", "folder", "m", "out.txt"]


@pytest.mark.slow
def test_predict_replaces_an_existing_file_only_when_asked_and_writes_through_links_pipes_and_stdout(
    criteo, tmp_path, capfd
):
    """Before: an existing output was replaced without a word, and a symbolic link, a pipe or
    /dev/stdout was replaced by a regular file (a partial file renamed over it)."""
    import threading

    from dlrm_jax.serving.files import predict_files

    tmp, art, _ = criteo
    day = [str(tmp / "day.tsv")]
    with serving.load(art["f16"]) as model:
        predict_files(model, day, tmp_path / "want.txt", progress=False)
        want = (tmp_path / "want.txt").read_text()
        kept = tmp_path / "kept.txt"
        kept.write_text("earlier scores\n")
        with pytest.raises(FileExistsError, match=f"--output {kept}: exists; pass --overwrite to replace it"):
            predict_files(model, day, kept, progress=False)
        assert kept.read_text() == "earlier scores\n"
        link = tmp_path / "link.txt"
        link.symlink_to(kept)
        predict_files(model, day, link, progress=False, overwrite=True)
        assert link.is_symlink() and kept.read_text() == want
        fifo, read = tmp_path / "fifo", []
        os.mkfifo(fifo)
        reader = threading.Thread(target=lambda: read.append(fifo.read_text()))
        reader.start()
        predict_files(model, day, fifo, progress=False)
        reader.join(60)
        assert read == [want] and fifo.is_fifo()
        capfd.readouterr()
        predict_files(model, day, "-", progress=False)
        assert capfd.readouterr().out == want
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "kept.txt", "link.txt", "want.txt"]


@pytest.mark.slow
def test_a_file_is_read_with_its_label_or_without_it_whole_so_a_line_that_lost_a_field_is_bad(criteo, tmp_path):
    """Before: each Criteo line of 39 fields was read as one without its label (every field
    shifted by one, scored without a word), and a chunk's (a tabular file's) first line decided
    the layout of all the others: a first line that lost a field made every good line bad."""
    from dlrm_jax.serving.files import predict_files

    tmp, art, (probs, dense, ids) = criteo
    val = (tmp / "day.tsv").read_bytes().splitlines(keepends=True)[-VAL:][:6]
    cut = lambda line: b"\t".join(line.split(b"\t")[:-1]) + b"\n"  # one field lost
    unlabeled = [line.split(b"\t", 1)[1] for line in val]
    with serving.load(art["f16"]) as model:
        want = model.predict_raw(val)
        for lines, bad_at in (
            ([*val[:2], cut(val[2]), *val[3:]], 2),  # a labeled file: the cut line is bad
            ([cut(val[0]), *val[1:]], 0),  # its first line too, and the others still score
            ([*unlabeled[:4], val[4], unlabeled[5]], 4),  # a file without labels: a labeled line is bad
        ):
            (tmp_path / "in.tsv").write_bytes(b"".join(lines))
            predict_files(
                model, [tmp_path / "in.tsv"], tmp_path / "p.txt", progress=False, skip_bad_lines=True, overwrite=True
            )
            got = np.loadtxt(tmp_path / "p.txt", dtype=np.float32)
            np.testing.assert_array_equal(np.isnan(got), np.arange(6) == bad_at)
            np.testing.assert_array_equal(np.delete(got, bad_at), np.delete(want, bad_at))
            np.testing.assert_array_equal(model.predict_raw(lines, skip_bad_lines=True), got)  # the API alike
            with pytest.raises(CriteoFormatError, match=f"^line {bad_at + 1}: expected (40|39) tab-separated"):
                model.predict_raw(lines)  # numbered from 1, as the files' lines are
            with pytest.raises(ValueError, match=f"in.tsv:{bad_at + 1}: expected"):
                predict_files(model, [tmp_path / "in.tsv"], tmp_path / "q.txt", progress=False)


@pytest.mark.slow
def test_an_export_whose_datasets_vocabulary_is_gone_names_the_file(criteo, tmp_path):
    """A bare ``[Errno 2] No such file or directory: '.../vocab/feature_0.npy'`` before."""
    import shutil

    tmp, _, _ = criteo
    shutil.copytree(tmp / "ds", tmp_path / "ds")
    (tmp_path / "ds" / "vocab" / "feature_0.npy").unlink()
    with pytest.raises(FileNotFoundError, match="feature_0.npy: missing from the dataset the run trained on"):
        export_serving(tmp / "run", tmp_path / "art", [f"data.path={tmp_path / 'ds'}"], **QUIET)
    assert not (tmp_path / "art").exists()


@pytest.mark.slow
def test_predict_into_a_pipe_its_reader_closes_ends_quietly(criteo):
    """``predict --output - | head -1``: ``dlrm-jax: error: [Errno 32] Broken pipe`` and exit 1
    before; now no word, and the status of a process the pipe's signal ended (141)."""
    tmp, art, _ = criteo
    command = [sys.executable, "-m", "dlrm_jax", "predict", "--model", str(art["f16"]), "--output", "-"]
    inputs = ["--input", *[str(tmp / "day.tsv")] * 8, "--no-progress"]  # 12,000 scores: past a pipe's buffer
    with subprocess.Popen(
        [*command, *inputs], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env(), text=True
    ) as p:
        assert float(p.stdout.readline()) > 0
        p.stdout.close()
        assert p.wait(120) == 141 and p.stderr.read() == ""


@pytest.mark.slow
def test_predict_to_dev_stdout_redirected_to_a_file_writes_through_the_redirect(criteo, tmp_path):
    """``--output /dev/stdout`` with the shell's ``>> run.log``: before, /dev/stdout was followed
    to the log file, refused as an existing file, and with --overwrite the log was replaced whole
    (its earlier lines lost); the scores now go through the descriptor, after the earlier lines."""
    from dlrm_jax.serving.files import predict_files

    tmp, art, _ = criteo
    with serving.load(art["f16"]) as model:
        predict_files(model, [str(tmp / "day.tsv")], tmp_path / "want.txt", progress=False)
    log = tmp_path / "run.log"
    log.write_text("earlier lines\n")
    command = [sys.executable, "-m", "dlrm_jax", "predict", "--model", str(art["f16"]), "--input"]
    with open(log, "a") as out:
        r = subprocess.run(
            [*command, str(tmp / "day.tsv"), "--output", "/dev/stdout", "--no-progress"],
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
            timeout=120,
        )
    assert r.returncode == 0 and r.stderr.startswith("predicted "), r.stderr  # (the summary: not amid the scores)
    assert log.read_text() == "earlier lines\n" + (tmp_path / "want.txt").read_text()


@pytest.mark.slow
def test_a_full_disk_while_predicting_is_one_line_naming_the_output_and_keeps_the_old_scores(criteo, tmp_path):
    """The disk filling while the scores are written (`[Errno 28] No space left on device`,
    naming nothing, before): one line naming ``--output``; an earlier output stays as it was,
    and no partial file is left."""
    import errno
    import io

    from dlrm_jax.serving import files

    tmp, art, _ = criteo
    old = tmp_path / "p.txt"
    old.write_text("earlier scores\n")

    class Full(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    real_open = open
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            files,
            "open",
            lambda path, mode="r", *a, **k: Full() if mode in ("x", "w") else real_open(path, mode, *a, **k),
            raising=False,
        )
        with serving.load(art["f16"]) as model:
            for output, state in ((old, "the file is as it was"), (tmp_path / "new.txt", "nothing was written")):
                with pytest.raises(OSError, match=f"--output {output}: no space left on device .*; {state}") as e:
                    files.predict_files(model, [str(tmp / "day.tsv")], output, progress=False, overwrite=True)
                assert e.value.errno == errno.ENOSPC
            # standard output on a full disk (`predict --output - > full/p.txt`) is named too
            with pytest.raises(OSError, match="--output -: no space left on device while writing the scores"):
                files.predict_files(model, [str(tmp / "day.tsv")], "-", progress=False)
    assert old.read_text() == "earlier scores\n" and sorted(p.name for p in tmp_path.iterdir()) == ["p.txt"]
    with pytest.raises(NotADirectoryError, match=f"--output {old}/x: {old} is a file, not a folder"):
        files.check_paths([str(tmp / "day.tsv")], old / "x", [])


@pytest.mark.slow
def test_a_manifest_that_disagrees_with_its_function_is_refused_at_load_naming_both(criteo, tmp_path):
    import shutil

    shutil.copytree(criteo[1]["f16"], tmp_path / "m")
    file = tmp_path / "m" / "manifest.json"
    manifest = json.loads(file.read_text())
    file.write_text(json.dumps({**manifest, "num_dense": 12}))
    with pytest.raises(ArtifactError, match=f"{file}: num_dense 12, but its dense function .*function.jax takes 13"):
        serving.load(tmp_path / "m")


def test_an_export_whose_tables_hold_fewer_rows_than_its_ids_is_refused_at_load(criteo, tmp_path):
    """Exports of tiered tables before 2026-12-06 held only the devices' cache rows: loaded,
    every line with a later id failed with 'an id out of range', naming neither the artifact
    nor the remedy."""
    import shutil

    _, art, _ = criteo
    shutil.copytree(art["f16"], tmp_path / "art")
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    rows = manifest["features"][2]["rows"]
    manifest["features"][2]["rows"] = rows // 2
    (tmp_path / "art" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        ArtifactError, match=rf"table cat_2 holds {rows // 2:,} rows where its rules give ids up to {rows:,}: an"
    ):
        serving.load(tmp_path / "art")


@pytest.mark.slow
def test_a_delta_from_another_run_with_the_same_shapes_and_steps_is_refused(criteo, tmp_path):
    tmp, art, _ = criteo
    other = run_config(tmp, "train.seed=5", "train.steps=8", "train.eval_every=0", "mesh.devices=1")
    train_and_evaluate(other, tmp_path / "other", **QUIET)
    export_serving(tmp_path / "other", tmp_path / "o8", **QUIET)
    with pytest.raises(ArtifactError, match=f"{art['d']}: a delta from another trained state than .*o8"):
        serving.load(tmp_path / "o8", [art["d"]])
    serving.load(art["f8"], [art["d"]]).close()  # its own base


def test_a_model_let_go_without_close_leaves_no_open_files(criteo):
    """Before: a served model dropped without close() (a server reloading its export) kept one
    descriptor a chunk file open for good: 10 loads, 6 -> 46 open files."""
    import gc
    import os

    _, art, (_, dense, ids) = criteo
    fds = lambda: len(os.listdir("/proc/self/fd"))
    first = serving.load(art["f16"])
    first.predict(dense[:8], ids[:8])
    del first
    gc.collect()
    before = fds()
    for _ in range(5):
        model = serving.load(art["f16"])
        model.predict(dense[:8], ids[:8])
        del model
        gc.collect()
    assert fds() <= before


@pytest.mark.parametrize(
    "sets", [["model.dot_pairs=fused"], ["model.interaction=dcn", "model.dcn_rank=4", "model.cross_layers=fused"]]
)
def test_a_run_with_fused_kernels_exports_its_serving_function(sets):
    """Before: export --serving of a run trained with model.dot_pairs or model.cross_layers fused
    failed ('unsupported operand type(s) for &: _DimExpr'): the kernels size their tiles from the
    batch, which the exported function leaves symbolic. It is exported with XLA's forms, whose
    parameters are the trained ones."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dlrm_jax.train.serving_export import _portable_graphdef
    from dlrm_jax.train.wiring import model_entry

    cfg = tiny_config(*sets, "train.compute_dtype=float32")
    trained = nnx.split(nnx.eval_shape(lambda: model_entry(cfg).dense(cfg, nnx.Rngs(0))), nnx.Param)
    portable = _portable_graphdef(cfg)
    (b,) = jax.export.symbolic_shape("b")
    args = (
        trained[1],
        jax.ShapeDtypeStruct((b, cfg.data.num_dense), jnp.float32),
        jax.ShapeDtypeStruct((b, cfg.num_features, cfg.model.embedding_dim), jnp.float32),
    )
    with pytest.raises(TypeError, match="_DimExpr"):  # (the trained model's own forms)
        jax.export.export(jax.jit(lambda p, d, e: nnx.merge(trained[0], p)(d, e)))(*args)
    jax.export.export(jax.jit(lambda p, d, e: nnx.merge(portable, p)(d, e)))(*args)
