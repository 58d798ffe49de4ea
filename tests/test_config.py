"""Configuration: shipped files load, the default file matches the code, errors name keys."""

import re
from pathlib import Path

import pytest

from dlrm_jax.config import (
    CONFIG_DIR,
    CRITEO_KAGGLE_CARDINALITIES,
    RENAMED_KEYS,
    Config,
    ConfigError,
    config_from_dict,
    load_config,
    parse_override,
)

CONFIGS = sorted(Path(CONFIG_DIR).glob("*.yaml"))


def test_configs_dir_is_shipped():
    assert {p.stem for p in CONFIGS} >= {"default", "criteo_kaggle", "mlperf_dlrm_v1", "smoke"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_loads(path):
    assert isinstance(load_config(path), Config)


def test_configs_joined_with_plus_layer_in_order_and_a_missing_one_is_named(tmp_path):
    both = load_config("criteo_kaggle+stream", ["mesh.devices=2"])
    assert both.data.cardinalities == CRITEO_KAGGLE_CARDINALITIES and both.embedding.ids == "dynamic"
    assert both.embedding.dynamic == load_config("stream").embedding.dynamic and both.mesh.devices == 2
    assert load_config("stream+criteo_kaggle").embedding.ids == "dynamic"  # (kaggle does not set it)
    odd = tmp_path / "a+b.yaml"  # a file whose name has a plus is that file
    odd.write_text("train:\n  steps: 7\n")
    assert load_config(odd).train.steps == 7 and load_config(str(odd)).train.steps == 7
    with pytest.raises(ConfigError, match="config file nope does not exist"):
        load_config("criteo_kaggle+nope")


def test_default_file_equals_embedded_default():
    assert load_config(CONFIG_DIR / "default.yaml") == Config() == load_config(None)
    # ... and lists every key, so it documents them all.
    import yaml

    listed = yaml.safe_load((CONFIG_DIR / "default.yaml").read_text())
    assert {s: set(v) for s, v in listed.items()} == {s: set(v) for s, v in Config().to_dict().items()}


def test_named_configs():
    kaggle = load_config("criteo_kaggle")
    assert kaggle.data.cardinalities == CRITEO_KAGGLE_CARDINALITIES
    assert kaggle.table_rows == CRITEO_KAGGLE_CARDINALITIES  # uncapped
    assert kaggle.model.bottom_mlp == (512, 256, 64, 16) and kaggle.model.top_mlp == (512, 256, 1)
    mlperf = load_config("mlperf_dlrm_v1")
    assert mlperf.model.embedding_dim == 128 and max(mlperf.table_rows) <= 40_000_000
    assert mlperf.model.top_mlp == (1024, 1024, 512, 256, 1)


def test_overrides():
    cfg = load_config(
        None,
        [
            "train.steps=7",
            "model.bottom_mlp=[32, 16]",
            "data.bag_sizes=3",
            "train.progress_bar=false",
            "data.source=binary",
            "data.path=/x/y",
            "train.learning_rate=1e-3",
        ],
    )
    assert cfg.train.steps == 7 and cfg.model.bottom_mlp == (32, 16)
    assert cfg.bag_sizes == (3,) * 26 and cfg.train.progress_bar is False
    assert cfg.train.learning_rate == 1e-3
    assert parse_override("a.b.c=[1,2]") == {"a": {"b": {"c": [1, 2]}}}


@pytest.mark.parametrize(
    "override,words",
    [
        ("train.stepz=3", ["train.stepz", "train.steps"]),
        ("nope.steps=3", ["nope", "train"]),
        ("embedding.sharding=diagonal", ["embedding.sharding", "diagonal", "replicated", "row", "column"]),
        ("embedding.optimizer=lamb", ["embedding.optimizer", "rowwise_adagrad"]),
        ("model.interaction=mul", ["model.interaction", "dot", "cat"]),
        ("data.source=parquet", ["data.source", "synthetic", "criteo", "binary"]),
        ("train.steps=abc", ["train.steps", "integer", "abc"]),
        ("train.steps=-1", ["train.steps", "> 0"]),
        ("train.learning_rate=fast", ["train.learning_rate", "number"]),
        ("model.bottom_mlp=[32, 8]", ["model.bottom_mlp", "embedding_dim"]),
        ("model.top_mlp=[32, 2]", ["model.top_mlp", "1"]),
        ("data.bag_sizes=[1, 2]", ["data.bag_sizes", "26"]),
        ("data.source=binary", ["data.path", "binary"]),
        (
            "data.source=criteo|data.path=x.tsv|data.reader_processes=true",
            ["data.reader_processes", "data.source=criteo"],
        ),
        ("train.progress_bar=maybe", ["train.progress_bar", "true or false"]),
        ("train.steps", ["KEY=VALUE"]),
        ("embedding.sync=host_replicas|embedding.sync_every=5", ["embedding.sync_every=5", "never averaged"]),
        (
            "embedding.sync=host_replicas|embedding.hot.rows=64",
            ["embedding.sync=host_replicas", "embedding.hot.rows=0"],
        ),
        (
            "embedding.sync=per_host|mesh.hosts=2|embedding.hot.rows=0|embedding.table_sharding=[cat_1=host_column]",
            ["embedding.sync=per_host", "host_column", "embedding.sync=global"],
        ),
        # Values that were once accepted silently.
        ("train.decay_power=-1", ["train.decay_power", "> 0"]),
        ("train.learning_rate=.nan", ["train.learning_rate", "finite", "nan"]),
        ("train.learning_rate=nan", ["train.learning_rate", "finite"]),
        ("train.max_loss_ratio=.inf", ["train.max_loss_ratio", "finite", "inf"]),
        ("embedding.hot.memory_mb=-inf", ["embedding.hot.memory_mb", "finite"]),
        ("embedding.adagrad_eps=-1e-8", ["embedding.adagrad_eps", ">= 0"]),
        # Finite as a float64, not in the float32 the step computes in (before: trained as inf, or as 0)
        ("train.learning_rate=1e39", ["train.learning_rate", "1e+39", "it is inf"]),
        ("embedding.learning_rate=1e-50", ["embedding.learning_rate", "1e-50", "it is 0"]),
        ("model.kind=wide_deep|model.interaction=cat|model.wide.l1=1e40", ["model.wide.l1", "it is inf"]),
        # Before: accepted, and a row first looked up with a zero gradient became NaN (0 / 0)
        (
            "embedding.optimizer=rowwise_adagrad|embedding.adagrad_eps=0",
            ["embedding.adagrad_eps=0", "embedding.adagrad_initial_accumulator=0", "0 by 0"],
        ),
        (
            "embedding.table_sharding=[cat_1=row, cat_2=table, cat_1=column]",
            ["embedding.table_sharding", "cat_1 is named twice", "'cat_1=row'", "'cat_1=column'"],
        ),
        ("embedding.table_storage=[cat_3=tiered, cat_3=device]", ["embedding.table_storage", "cat_3 is named twice"]),
        ("embedding.table_sharding=[=row]", ["embedding.table_sharding[0]", "TABLE=STRATEGY"]),
        (
            "model.interaction=dcn|model.dcn_rank=433",
            ["model.dcn_rank=433", "width 432", "16 + model.embedding_dim 16 x 26"],
        ),
        ("model.bottom_mlp={a: 1, a: 2}", ["override 'model.bottom_mlp={a: 1, a: 2}'", "'a' is given twice"]),
        ("train.steps=5|train.steps.x=1", ["train.steps: is 5, not a mapping"]),
        ("train.keep_best=accuracy", ["train.keep_best", "auc", "logloss"]),
        ("train.target_auc=1.5", ["train.target_auc", "[0, 1]"]),
        ("train.early_stop_evals=-1", ["train.early_stop_evals", ">= 0"]),
        ("train.early_stop_evals=3|train.eval_every=0", ["train.early_stop_evals", "train.eval_every > 0"]),
        ("train.target_auc=0.8|train.eval_every=0", ["train.target_auc", "train.eval_every > 0"]),
        # before: 3 tables, without a word
        ("data.cardinalities=1000,,50,5000", ["data.cardinalities: an empty entry in '1000,,50,5000'"]),
    ],
)
def test_bad_values_name_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, override.split("|"))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_a_bad_value_in_a_file_is_named_by_its_file_and_line(tmp_path):
    """Before: 'train.steps: expected an integer, got 10.0', naming no file (cli.md says it does)."""
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  log_every: 5\n  steps: 10.0\nmodel:\n  bottom_mlp: [32, x]\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value) == f"config file {f}:3: train.steps: expected an integer, got 10.0"
    with pytest.raises(ConfigError) as e:
        load_config(f"smoke+{f}", ["train.steps=3"])  # (no file: smoke+c.yaml is the two layered)
    assert str(e.value) == f"config file {f}:5: model.bottom_mlp[1]: expected an integer, got 'x'"
    with pytest.raises(ConfigError) as e:
        load_config(f, ["train.steps=3", "model.bottom_mlp=[8, y]"])  # the --set's value: no file
    assert str(e.value) == "model.bottom_mlp[1]: expected an integer, got 'y'"


def test_bad_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("train: 3\n")
    with pytest.raises(ConfigError, match="train"):
        load_config(scalar)


def test_dcn_rank_up_to_the_cross_width_is_fine():
    assert load_config(None, ["model.interaction=dcn", "model.dcn_rank=432"]).model.dcn_rank == 432


@pytest.mark.parametrize(
    "text,where",
    [
        (
            "train:\n  steps: 5\n  batch_size: 64\n  steps: 7\n",
            r"dup.yaml:4: .*'steps' is given twice \(lines 2 and 4\)",
        ),
        (
            "train:\n  steps: 5\nmodel:\n  embedding_dim: 8\ntrain:\n  seed: 1\n",
            r"dup.yaml:5: .*'train' is given twice",
        ),
    ],
)
def test_duplicate_keys_in_a_file_name_the_file_line_and_key(tmp_path, text, where):
    """PyYAML keeps the last of two equal keys; a config file that says both is refused."""
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=where):
        load_config(path)


def test_yaml_anchors_and_merge_keys_still_load(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("model:\n  top_mlp: &top [32, 1]\ntrain:\n  steps: 9\n")
    assert load_config(path).model.top_mlp == (32, 1)


def test_binary_config_file_names_the_file(tmp_path):
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"train:\n  steps: \xff\xfe\x00\x01\n")
    with pytest.raises(ConfigError, match=r"config file .*bin.yaml: not UTF-8 text \(byte 0xff at offset 16\)"):
        load_config(path)


@pytest.mark.parametrize(
    "text,key,got",
    [
        ("train: [1, 2]\n", "train", "got [1, 2]"),
        ("embedding:\n  hot: 3\n", "embedding.hot", "got 3"),
        ("train:\n", "train", "nothing"),
    ],
)
def test_a_section_that_is_not_a_mapping_is_refused_not_replaced_by_set(tmp_path, text, key, got):
    """Before: ``--set train.steps=3`` over a file's ``train: [1, 2]`` replaced the list silently."""
    path = tmp_path / "list.yaml"
    path.write_text(text)
    for overrides in ([], [f"{key}.steps=3"]):
        with pytest.raises(ConfigError) as e:
            load_config(path, overrides)
        assert f"list.yaml: {key} must be a mapping of keys" in str(e.value), str(e.value)
        assert got in str(e.value)


def test_yaml_syntax_error_is_one_line_with_the_line_number(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: [1, 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert "\n" not in str(e.value) and "bad.yaml:" in str(e.value)


def _bounded_keys(section, prefix=""):
    import dataclasses

    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            yield from _bounded_keys(value, f"{prefix}{f.name}.")
        elif f.type in ("int", "float", "int | str", "tuple[int, ...]"):
            yield f"{prefix}{f.name}", f.metadata.get("bound"), f.metadata.get("bound_each", False)


def test_every_numeric_key_declares_its_bound_and_a_value_outside_it_is_named():
    from dlrm_jax.config_schema import Config

    keys = list(_bounded_keys(Config()))
    unbounded = {k for k, rule, _ in keys if rule is None}
    # the wide part's keys are bounded where they are used (wide_deep)
    assert unbounded == {"model.wide.learning_rate", "model.wide.l1", "model.wide.l2"}, unbounded
    for key, rule, each in keys:
        if rule is None:
            continue
        if rule in (">0", ">=0"):
            bad = 0 if rule == ">0" else -1
        else:
            lo, hi = (float(x) for x in rule[1:-1].split(","))
            bad = hi + 0.5 if rule[-1] == "]" else hi
        value = f"[{bad}]" if each else bad
        with pytest.raises(ConfigError, match=re.escape(f"{key}[0]" if each else key)):
            load_config(None, [f"{key}={value}"])


def test_every_dense_optimizer_the_schema_allows_is_built_and_no_other():
    """train.optimizer's choices are DENSE_OPTIMIZERS' names; a name past validation (a config
    built in code) is an error naming the key, not a silent Adam."""
    import dataclasses

    import optax

    from dlrm_jax.config_schema import TrainConfig
    from dlrm_jax.train.optimizer_setup import DENSE_OPTIMIZERS, dense_optimizer

    allowed = TrainConfig.__dataclass_fields__["optimizer"].metadata["choices"]
    assert tuple(DENSE_OPTIMIZERS) == tuple(allowed)
    cfg = load_config(None, [])
    for name in allowed:
        assert dense_optimizer(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, optimizer=name)), 0.1)
    bad = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, optimizer="lamb"))
    with pytest.raises(ConfigError, match="train.optimizer='lamb' is not one of sgd, adagrad, adam"):
        dense_optimizer(bad, optax.constant_schedule(0.1))


def test_former_key_names_load_as_their_current_ones(tmp_path):
    """Wide&Deep's keys moved into model.wide; configs, --sets and saved run dirs that use the
    former names load as before, and a file giving both names is refused naming them."""
    old = tmp_path / "old.yaml"
    old.write_text("model:\n  kind: wide_deep\n  bottom_mlp: []\n  interaction: cat\n  wide_l1: 0.5\n")
    cfg = load_config(old, ["model.wide_learning_rate=0.2"])
    assert (cfg.model.wide.l1, cfg.model.wide.learning_rate) == (0.5, 0.2)
    assert load_config(None, {"model.wide_optimizer": "adagrad"}).model.wide.optimizer == "adagrad"
    saved = cfg.to_dict()
    saved["model"]["wide_l2"] = saved["model"]["wide"].pop("l2") + 0.25
    assert config_from_dict(saved).model.wide.l2 == 0.25
    both = tmp_path / "both.yaml"
    both.write_text("model:\n  wide_l1: 0.5\n  wide:\n    l1: 0.1\n")
    with pytest.raises(ConfigError, match=r"both.yaml: model.wide_l1 and model.wide.l1 both given"):
        load_config(both)
    for old_key, new_key in RENAMED_KEYS.items():  # every former name points at a key that exists
        section = cfg.to_dict()
        for part in new_key.split("."):
            section = section[part]
        assert old_key != new_key


@pytest.mark.parametrize(
    "key,item", [("table_sharding", "cat_99=row"), ("table_storage", "nope=tiered"), ("table_ids", "cat_30=dynamic")]
)
def test_a_per_table_override_naming_no_table_is_refused_by_the_config(key, item):
    """Before: `dlrm-jax config` took table_sharding and table_storage overrides of tables that do
    not exist (refused only by plan and train), table_ids' alone were checked."""
    name = item.partition("=")[0]
    with pytest.raises(ConfigError, match=rf"embedding.{key}: '{item}': no table named '{name}' \(tables: cat_0 to"):
        load_config(None, [f"embedding.{key}=[{item}]"])


def test_a_global_tiered_storage_leaves_replicated_tables_on_their_devices():
    """Before: embedding.storage=tiered tiered replicated tables too (plan listed them as both);
    train made the tier, then failed on a reshape ('cannot reshape array of size 3160 into shape
    (8,3160)'). The docs: replicated tables stay on their devices."""
    from dlrm_jax.train.wiring import plan_from_config

    cfg = load_config("smoke", ["embedding.storage=tiered", "embedding.table_sharding=[cat_2=replicated]"])
    assert cfg.tiered_tables == (0, 1, 3)
    plan = plan_from_config(cfg, 8)
    assert plan.tiered_tables == (0, 1, 3) and plan.tables[2].strategy == "replicated"
    with pytest.raises(ConfigError, match=r"embedding.storage=tiered: no table is tiered, each is replicated"):
        load_config("smoke", ["embedding.storage=tiered", "embedding.sharding=replicated"])
    # A dynamic table is row-wise whatever embedding.sharding says, so it is tiered (before: refused,
    # 'each is replicated', though the same asked by table_storage was accepted)
    dynamic = ["embedding.table_ids=[cat_0=dynamic]", "embedding.sharding=replicated"]
    assert load_config("smoke", [*dynamic, "embedding.storage=tiered"]).tiered_tables == (0,)
    assert load_config("smoke", [*dynamic, "embedding.table_storage=[cat_0=tiered]"]).tiered_tables == (0,)


def test_numbers_with_leading_zeros_are_decimal_in_set_and_in_files(tmp_path):
    """Before: YAML 1.1 read a leading zero as octal: --set train.steps=010 trained 8 steps, and
    data.cardinalities=[1000, 0300] made a table of 192 rows."""
    from dlrm_jax.config import load_config

    cfg = load_config(None, ["train.steps=010", "data.cardinalities=[1000, 0300, 050]", "train.batch_size=0x40"])
    assert cfg.train.steps == 10 and cfg.data.cardinalities == (1000, 300, 50) and cfg.train.batch_size == 64
    (tmp_path / "c.yaml").write_text("train:\n  steps: 0120\n  log_every: 1_0\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg.train.steps == 120 and cfg.train.log_every == 10


@pytest.mark.parametrize("name", ["smoke+", "+smoke", "smoke++stream"])
def test_an_empty_config_layer_is_named(name):
    """Before: 'config file .: cannot be read (Is a directory)'."""
    with pytest.raises(ConfigError, match=re.escape(f"config {name}: a name on each side of '+'")):
        load_config(name)


def test_a_hash_in_a_set_value_is_kept():
    """Before: YAML read ' #b' as a comment, so --set embedding.tier.path='a #b' became 'a'."""
    assert load_config(None, ["embedding.tier.path=runs/a #b"]).embedding.tier.path == "runs/a #b"
    with pytest.raises(ConfigError, match="train.steps"):
        load_config(None, ["train.steps=5 # five"])


def test_the_learning_rate_schedule_is_the_one_documented():
    """Warmup: step k of W (from 1) at k/W of the rate (before: W+1 steps to reach it, 0.25,
    0.4375, 0.625, 0.8125 of it for W=4); decay over decay_steps, from decay_start where given
    (HugeCTR's MLPerf-v1 schedule decays from step 49,315 on, past the run's end; before, the
    decay could only take a run's last steps: 3e-8 at mlperf_dlrm_v1's last step, not 0.046)."""
    from dlrm_jax.train.optimizer_setup import learning_rate_schedule

    cfg = load_config(None, ["train.steps=10", "train.learning_rate=1", "train.warmup_steps=4", "train.decay_steps=3"])
    rates = [float(learning_rate_schedule(cfg)(k)) for k in range(10)]  # step k + 1's rate
    assert rates == pytest.approx([0.25, 0.5, 0.75, 1, 1, 1, 1, 1, 4 / 9, 1 / 9])
    v1 = learning_rate_schedule(load_config("mlperf_dlrm_v1"))
    assert float(v1(49315)) == 24.0 and float(v1(49316)) < 24.0
    assert float(v1(75867)) == pytest.approx(24 * (1 - 26552 / 27772) ** 2, rel=1e-4)
    with pytest.raises(ConfigError, match=r"train.decay_start=3 is inside the warmup \(train.warmup_steps=4\)"):
        load_config(None, ["train.warmup_steps=4", "train.decay_steps=3", "train.decay_start=3"])
    with pytest.raises(ConfigError, match=r"train.decay_start=5: there is no decay to start"):
        load_config(None, ["train.decay_start=5"])


def test_a_schedule_that_epochs_leave_no_room_for_is_refused(tmp_path):
    """Before: train.epochs set the steps after the warmup and decay were checked against the
    config's own train.steps; 43 steps with 30 of warmup and 30 of decay trained, at a rate
    that jumped from 0.42 of the full rate to all of it at step 13."""
    from dlrm_jax.train.trainer import with_epoch_steps

    cfg = load_config(None, ["train.epochs=1", "train.batch_size=100", "train.warmup_steps=30", "train.decay_steps=30"])
    source = type("Split", (), {"num_train": 4300})()
    with pytest.raises(ConfigError, match=r"\(30 \+ 30\) exceeds train.steps \(43, from train.epochs=1\)"):
        with_epoch_steps(cfg, source)
    assert with_epoch_steps(load_config(None, ["train.epochs=1", "train.batch_size=100"]), source).train.steps == 43


def test_the_dense_adagrad_is_torchs_and_the_tables():
    """Before: optax.adagrad's epsilon inside the root, rsqrt(sum + eps): a first gradient of 1e-5
    moved its weight by 0.1 of the rate, where torch's Adagrad (MLPerf DLRM-DCNv2's dense
    optimizer) and the tables' move it by the rate: g / (sqrt(sum) + eps)."""
    import jax.numpy as jnp
    import numpy as np
    import optax

    from dlrm_jax.train.optimizer_setup import DENSE_OPTIMIZERS

    tx = DENSE_OPTIMIZERS["adagrad"](optax.constant_schedule(0.5))
    params = {"w": jnp.zeros(4), "b": jnp.zeros(2)}
    state = tx.init(params)
    total = {"w": np.zeros(4), "b": np.zeros(2)}
    for g in ({"w": jnp.asarray([1e-5, -1e-3, 0.0, 2.0]), "b": jnp.asarray([1e-7, 3.0])},) * 2:
        updates, state = tx.update(g, state, params)
        for k in total:
            total[k] += np.asarray(g[k], np.float64) ** 2
            want = -0.5 * np.asarray(g[k], np.float64) / (np.sqrt(total[k]) + 1e-8)
            np.testing.assert_allclose(np.asarray(updates[k]), want, rtol=1e-5)
    assert isinstance(state[0], optax.ScaleByRssState)  # optax.adagrad's state: earlier checkpoints restore
