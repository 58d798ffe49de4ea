"""Checks of a built config: every key's declared bound, then the rules across keys that a
field's type cannot express. :func:`validate` runs on every config :mod:`dlrm_jax.config`
builds (before JAX is imported or anything compiles); :func:`check_features` runs again once a
preprocessed dataset's metadata gives the features. A bad value raises :class:`ConfigError`
naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dlrm_jax.choices import Ids, Storage, Strategy
from dlrm_jax.config_schema import Config, ConfigError


def check_rows_or_fraction(value: float, name: str) -> None:
    """A table size given as a whole number of rows (>= 1) or a fraction (< 1) of its values:
    1.5 rows means nothing (it was read as 1, then rounded up to the maps' least)."""
    if value >= 1 and value != int(value):
        raise ConfigError(f"{name}: a whole number of rows (>= 1), or a fraction (< 1) of each feature's values")


def _positive(key: str, value: int | float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}: must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def _check_table_overrides(key: str, items: tuple[str, ...], what: str, values: tuple[str, ...], example: str) -> None:
    """``TABLE=VALUE`` items: each well formed, each table named once (else the last would win)."""
    first: dict[str, str] = {}
    for i, item in enumerate(items):
        name, sep, value = item.partition("=")
        if not sep or not name or value not in values:
            raise ConfigError(
                f"{key}[{i}]: {item!r} must be TABLE={what} with {what} one of {', '.join(values)}, e.g. {example}"
            )
        if name in first:
            raise ConfigError(
                f"{key}: table {name} is named twice ({first[name]!r} and {item!r}); give each table once"
            )
        first[name] = item


def check_features(cfg: Config) -> Config:
    """Checks of keys that depend on the data's features (data.num_dense, data.cardinalities)."""
    m, d = cfg.model, cfg.data
    if m.interaction == "dcn" and m.dcn_rank:
        # The cross network's input: the bottom output (or the raw dense features) and every embedding.
        bottom = m.bottom_mlp[-1] if m.bottom_mlp else d.num_dense
        width = bottom + m.embedding_dim * len(d.cardinalities)
        if m.dcn_rank > width:
            raise ConfigError(
                f"model.dcn_rank={m.dcn_rank} exceeds the cross network's input width {width} "
                f"({bottom} + model.embedding_dim {m.embedding_dim} x {len(d.cardinalities)} features): "
                f"use at most {width}, or 0 for full-rank layers"
            )
    names, e = [f"cat_{f}" for f in range(len(d.cardinalities))], cfg.embedding
    for key, items in (
        ("embedding.table_ids", e.table_ids),  # (a typo would leave the table on vocabulary ids, silently)
        ("embedding.table_sharding", e.table_sharding),
        ("embedding.table_storage", e.table_storage),
    ):
        named = [(item, *item.partition("=")) for item in items]  # (malformed items: refused by their form)
        unknown = [item for item, name, sep, _ in named if sep and name and name not in names]
        if unknown:
            raise ConfigError(
                f"{key}: {unknown[0]!r}: no table named {unknown[0].partition('=')[0]!r} "
                f"(tables: {names[0]} to {names[-1]})"
            )
    return cfg


def _check_bounds(section: Any, prefix: str) -> None:
    """Every numeric key's declared bound (config_schema ``_bound``), section by section; a
    word such as ``auto`` in place of a number is not a number to bound."""
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_bounds(value, f"{key}.")
        elif "bound" in f.metadata and not isinstance(value, str):
            rule, note = f.metadata["bound"], f.metadata["bound_note"]
            items = [(f"{key}[{i}]", v) for i, v in enumerate(value)] if f.metadata["bound_each"] else [(key, value)]
            for name, v in items:
                _check_bound(name, v, rule, note)
        if (
            f.metadata.get("float32")
            and not isinstance(value, str)
            and value
            and not _F32_TINY <= abs(value) <= _F32_MAX
        ):
            raise ConfigError(
                f"{key}: {value:g} is {'beyond' if abs(value) > _F32_MAX else 'below'} what float32, in which the step "
                f"computes, holds (from {_F32_TINY:.3g} to {_F32_MAX:.3g}; written there it is "
                f"{'inf' if abs(value) > _F32_MAX else '0'})"
            )


_F32_MAX, _F32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38  # (its largest and smallest normal)


def _check_bound(key: str, value: float, rule: str, note: str) -> None:
    if rule in (">0", ">=0"):
        _positive(key, value, allow_zero=rule == ">=0")
        return
    lo, hi = (float(x) for x in rule[1:-1].split(","))
    above = value >= lo if rule[0] == "[" else value > lo
    below = value <= hi if rule[-1] == "]" else value < hi
    if not (above and below):
        raise ConfigError(f"{key}: must be in {rule}{note}, got {value}")


def validate(cfg: Config) -> Config:
    """Every key's declared bound, then the checks across keys that a field's type cannot express."""
    if not isinstance(cfg, Config):  # (a name given where a Config goes: "must be called with a dataclass")
        raise TypeError(
            f"expected a Config, got {type(cfg).__name__} {cfg!r}: make one with dlrm_jax.load_config({cfg!r})"
            if isinstance(cfg, str)
            else f"expected a Config, got {type(cfg).__name__}"
        )
    _check_bounds(cfg, "")
    _check_train(cfg.train)
    _check_data(cfg)
    _check_progressive(cfg)
    _check_model(cfg)
    _check_embedding(cfg)
    _check_mesh(cfg)
    return cfg


def _check_train(t) -> None:
    for key in ("target_auc", "early_stop_evals"):
        if getattr(t, key) and t.eval_every <= 0:
            raise ConfigError(
                f"train.{key}: early stopping needs evaluations during the run; set "
                f"train.eval_every > 0 (it is {t.eval_every}: {'only at the end' if t.evaluates else 'never'})"
            )
    if t.keep_best and not t.evaluates:
        raise ConfigError("train.keep_best: the best checkpoint needs evaluations; train.eval_every=-1 makes none")
    if not t.epochs:  # (train.epochs sets the steps from the data: checked once it has)
        check_schedule(t)


def check_schedule(t, steps_from: str = "") -> None:
    """The learning rate's warmup and decay fit the run's ``train.steps`` (``steps_from``: where
    the steps came from, for the message)."""
    steps = f"train.steps ({t.steps}{steps_from})"
    if t.decay_start:
        if not t.decay_steps:
            raise ConfigError(f"train.decay_start={t.decay_start}: there is no decay to start (train.decay_steps=0)")
        if t.decay_start < t.warmup_steps:
            raise ConfigError(
                f"train.decay_start={t.decay_start} is inside the warmup (train.warmup_steps={t.warmup_steps})"
            )
        if t.decay_start >= t.steps:
            raise ConfigError(f"train.decay_start={t.decay_start}: the run ends before it, at {steps}")
    elif t.warmup_steps + t.decay_steps > t.steps:
        raise ConfigError(
            f"train.warmup_steps + train.decay_steps ({t.warmup_steps} + {t.decay_steps}) exceeds {steps}"
        )


def _check_data(cfg: Config) -> None:
    d = cfg.data
    if not d.cardinalities:
        raise ConfigError("data.cardinalities: at least one categorical feature is needed")
    if len(d.bag_sizes) not in (1, len(d.cardinalities)):
        raise ConfigError(
            f"data.bag_sizes: give one value or one per feature ({len(d.cardinalities)}), got {len(d.bag_sizes)}"
        )
    if d.source in ("criteo", "binary") and not d.path:
        raise ConfigError(f"data.path: required when data.source={d.source}")
    if d.source == "synthetic" and d.path:
        raise ConfigError(
            f"data.path={d.path}: data.source=synthetic generates its data and reads no path; "
            f"set data.source=binary for a folder made by `dlrm-jax preprocess`, or "
            f"data.source=criteo for a Criteo text file"
        )
    if d.reader_processes and d.source not in ("binary", "synthetic"):  # (synthetic: made on the devices)
        raise ConfigError(
            f"data.reader_processes: only data.source=binary is read in worker processes, got data.source={d.source}"
        )
    if d.source != "binary":  # binary data: once its meta.json gives the features (data/sources/)
        check_features(cfg)


def _check_model(cfg: Config) -> None:
    m, e = cfg.model, cfg.embedding
    if m.kind == "wide_deep":
        if m.bottom_mlp:
            raise ConfigError(
                f"model.bottom_mlp: must be empty ([]) for model.kind=wide_deep, whose deep part "
                f"takes the dense features as they are; got {list(m.bottom_mlp)}"
            )
        if m.interaction == "dot":
            raise ConfigError(
                "model.interaction: model.kind=wide_deep has no dot interaction; use cat (Wide&Deep) "
                "or dcn (a cross network on the deep part)"
            )
        _positive("model.wide.learning_rate", m.wide.learning_rate)
        _positive("model.wide.l1", m.wide.l1, allow_zero=True)
        _positive("model.wide.l2", m.wide.l2, allow_zero=True)
    elif not m.bottom_mlp:
        raise ConfigError("model.bottom_mlp: DLRM needs at least one layer (empty only for model.kind=wide_deep)")
    elif m.interaction == "dot" and m.bottom_mlp[-1] != m.embedding_dim:
        raise ConfigError(
            f"model.bottom_mlp: the last width must equal model.embedding_dim "
            f"({m.embedding_dim}) for the dot interaction, got {list(m.bottom_mlp)}"
        )
    if not m.top_mlp or m.top_mlp[-1] != 1:
        raise ConfigError(f"model.top_mlp: the last width must be 1, got {list(m.top_mlp)}")
    for key, what in (("dot_pairs", "pairs"), ("cross_layers", "layers")):  # the models' Pallas kernels
        if getattr(m, key) == "fused" and m.mlp_parallel == "pipeline":
            raise ConfigError(
                f"model.{key}=fused: not with model.mlp_parallel=pipeline (its first stage runs "
                f"inside shard_map, where the {what} are XLA's); use xla or auto"
            )
    if m.kind == "wide_deep":  # the wide part reads the batch's own ids on every device
        _not_with("model.kind=wide_deep", e, per_host=True, tiered=True)


def _check_progressive(cfg: Config) -> None:
    """``train.progressive_window=data`` reads the windows a preprocessed dataset recorded."""
    if cfg.train.progressive_window != "data":
        return
    if cfg.data.source != "binary" or cfg.data.shuffle:
        raise ConfigError(
            f"train.progressive_window=data: the dataset's own windows need data.source=binary (preprocessed "
            f"with --no-shuffle) read in order (data.shuffle=false); got data.source={cfg.data.source}, "
            f"data.shuffle={str(cfg.data.shuffle).lower()}"
        )


def _check_embedding(cfg: Config) -> None:
    e = cfg.embedding
    wide = cfg.model.wide.optimizer if cfg.model.kind == "wide_deep" else ""
    uses_adagrad = "adagrad" in (e.optimizer, wide) or e.optimizer == "rowwise_adagrad"
    if e.adagrad_eps == 0 and e.adagrad_initial_accumulator == 0 and uses_adagrad:
        raise ConfigError(
            "embedding.adagrad_eps=0 with embedding.adagrad_initial_accumulator=0: a row first looked up with a "
            "zero gradient divides 0 by 0 (NaN, and the run diverges); give either a value > 0"
        )
    _check_table_overrides("embedding.table_sharding", e.table_sharding, "STRATEGY", tuple(Strategy), "cat_2=row")
    _check_table_overrides("embedding.table_storage", e.table_storage, "STORAGE", tuple(Storage), "cat_2=tiered")
    _check_table_overrides("embedding.table_ids", e.table_ids, "IDS", tuple(Ids), "cat_2=dynamic")
    _check_dynamic(cfg)
    every = [f"cat_{f}" for f in range(cfg.num_features)]
    if e.storage == Storage.TIERED and all(e.sharding_of(t) == Strategy.REPLICATED for t in every):  # (no-op)
        raise ConfigError(
            f"embedding.storage=tiered: no table is tiered, each is replicated (embedding.sharding="
            f"{e.sharding}, embedding.table_sharding), and replicated tables stay on their devices; shard "
            f"them (embedding.sharding=row or auto) or keep embedding.storage=device"
        )
    if not e.tables_per_host:
        return
    if e.hot.rows != 0:
        raise ConfigError(
            f"embedding.sync={e.sync}: hot rows (embedding.hot.rows) are not supported with "
            "per-host tables yet; set embedding.hot.rows=0"
        )
    _not_with(f"embedding.sync={e.sync}", e, tiered=True)
    within = [e.sharding] + [item.partition("=")[2] for item in e.table_sharding]
    if any(s in (Strategy.HOST_ROW, Strategy.HOST_COLUMN) for s in within):
        raise ConfigError(
            f"embedding.sync={e.sync}: each host's tables live on its own devices already; "
            "host_row and host_column (embedding.sharding, embedding.table_sharding) split a table "
            "within one host of the global mesh: use embedding.sync=global for them"
        )
    if e.sync == "host_replicas" and e.sync_every:
        raise ConfigError(
            f"embedding.sync_every={e.sync_every}: host replicas (embedding.sync=host_replicas) "
            "stay equal by construction and are never averaged; set embedding.sync_every=0"
        )


def _check_dynamic(cfg: Config) -> None:
    """Dynamic tables (embedding.ids, embedding.table_ids): row-wise, on the devices, in DLRM."""
    e = cfg.embedding
    if e.ids != Ids.DYNAMIC and not any(item.endswith("=dynamic") for item in e.table_ids):
        return
    what = "embedding.ids=dynamic" if e.ids == Ids.DYNAMIC else "dynamic tables (embedding.table_ids)"
    for item in e.table_sharding:
        name, _, strategy = item.partition("=")
        if e.ids_of(name) == Ids.DYNAMIC and strategy != Strategy.ROW:
            raise ConfigError(
                f"embedding.table_sharding: {item!r}: table {name} takes raw ids ({what}) and a dynamic table "
                f"is row-wise (its id map is split with its rows); use {name}=row or drop the override"
            )
    every = len(cfg.dynamic_tables) == cfg.num_features
    if every and e.sharding not in ("auto", Strategy.ROW):  # (it changed nothing, without a word)
        raise ConfigError(
            f"embedding.sharding={e.sharding}: every table takes raw ids ({what}), and a dynamic table is "
            f"row-wise (its id map is split with its rows); use embedding.sharding=row or auto"
        )
    _not_with(what, e, per_host=True)
    check_rows_or_fraction(e.dynamic.rows, f"embedding.dynamic.rows={e.dynamic.rows:g}")
    v = e.dynamic.vshards
    if v & (v - 1):
        raise ConfigError(f"embedding.dynamic.vshards={v}: a power of two (0 = chosen from the rows)")


def _check_mesh(cfg: Config) -> None:
    mesh, e = cfg.mesh, cfg.embedding
    if e.tables_per_host and mesh.devices and mesh.hosts and mesh.devices % mesh.hosts:
        raise ConfigError(f"mesh.hosts={mesh.hosts} must divide mesh.devices={mesh.devices}")
    if mesh.devices and mesh.devices % mesh.model:
        raise ConfigError(f"mesh.model={mesh.model} must divide mesh.devices={mesh.devices}")
    if mesh.model > 1 and e.tables_per_host:
        raise ConfigError(
            "mesh.model > 1: model groups are not supported with per-host tables "
            f"(embedding.sync={e.sync}) yet; use mesh.model=1"
        )


def _not_with(what: str, e, per_host: bool = False, tiered: bool = False) -> None:
    """The one home of "not supported with per-host tables / tiered tables yet"."""
    if per_host and e.tables_per_host:
        raise ConfigError(
            f"{what}: per-host tables (embedding.sync={e.sync}) are not supported yet; use embedding.sync=global"
        )
    named = [item for item in e.table_storage if item.endswith("=tiered")]
    if tiered and (e.storage != "device" or named):
        where = "with per-host tables " if what.startswith("embedding.sync") else ""
        given = (  # (the key the user set: before, always embedding.storage)
            f"embedding.table_storage=[{', '.join(named)}]"
            if e.storage == "device"
            else f"embedding.storage={e.storage}"
        )
        raise ConfigError(
            f"{what}: tiered tables ({given}) are not supported {where}yet; keep every table on the devices "
            f"(embedding.storage=device, no =tiered in embedding.table_storage)"
        )
