"""The edge: the one module that reads a :class:`~dlrm_jax.config.Config` into the typed pieces
the layers below take (table specs, a cluster, planner options and a plan, sparse optimizers,
the dense model, the wide part, the tier's folder). Nothing under ``embedding/`` or ``model/``
sees a ``Config``; they take specs, plans and single config sections.

Derived values are computed here and passed on, never written back into a config: one host's
share of the batch for per-host tables is ``batch_size``'s argument, not a copy of the config
with ``train.batch_size`` rewritten.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx

from dlrm_jax.choices import Pooling, RowLayoutChoice, Sharding, Storage, Strategy
from dlrm_jax.config import Config, ConfigError
from dlrm_jax.data.batch import train_ids
from dlrm_jax.embedding.dynamic.idmap import MapSpec, home_rows
from dlrm_jax.embedding.dynamic.sharded import check_split
from dlrm_jax.embedding.dynamic.sizing import map_bytes_per_device, maps_report, route_capacities
from dlrm_jax.embedding.exchange.dynamic_tables import routed_lookup_group, rows_sent_back, unsent_row_id_bytes
from dlrm_jax.embedding.plan.cost import Cluster, DenseWork, cluster_for
from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan
from dlrm_jax.embedding.plan.estimates import TableStats
from dlrm_jax.embedding.plan.layout import build_groups
from dlrm_jax.embedding.plan.planner import (
    PlanOptions,
    PlanRequest,
    parse_overrides,
    wide_bytes_per_device,
    wide_plan,
    wide_report,
)
from dlrm_jax.embedding.plan.specs import TableSpec
from dlrm_jax.embedding.plan.stats import plan_report
from dlrm_jax.files import check_dir
from dlrm_jax.ids import PAD_ID, raw_values
from dlrm_jax.model.dlrm import DLRMDense
from dlrm_jax.model.parts import SparsePart
from dlrm_jax.model.wide import WidePart
from dlrm_jax.model.work import dense_work as model_dense_work
from dlrm_jax.train.optimizer_setup import dense_optimizer, learning_rate_schedule, wide_optimizer_from_config
from dlrm_jax.train.spec import StepSpec
from dlrm_jax.wording import run_dir_flag


def specs_from_config(cfg: Config) -> tuple[TableSpec, ...]:
    """One table per categorical feature, named ``cat_<feature>``, rows capped by data.max_rows
    (a dynamic table's: its map's, :func:`dynamic_maps`)."""
    rows = list(cfg.table_rows)
    for f, spec in dynamic_maps(cfg).items():
        rows[f] = spec.rows
    return tuple(
        TableSpec(f"cat_{f}", r, cfg.model.embedding_dim, bag, Pooling(cfg.data.pooling))
        for f, (r, bag) in enumerate(zip(rows, cfg.bag_sizes, strict=True))
    )


def dynamic_maps(cfg: Config) -> dict[int, MapSpec]:
    """{feature: its id map} of the tables taking raw ids (``embedding.ids``,
    ``embedding.table_ids``), sized by ``embedding.dynamic``."""
    d, out = cfg.embedding.dynamic, {}
    for f in cfg.dynamic_tables:
        try:
            out[f] = MapSpec.sized(cfg.table_rows[f], d.rows, d.vshards, **map_fields(cfg))
        except ValueError as e:
            raise ConfigError(f"embedding.dynamic: table cat_{f}: {e}") from None
    return out


def map_fields(cfg: Config) -> dict:
    """``embedding.dynamic``'s settings every map of a run shares, as MapSpec's fields."""
    d = cfg.embedding.dynamic
    return dict(
        probes=d.probes,
        policy=d.policy,
        half_life=d.half_life,
        admit=d.admit,
        sketch_width=d.sketch_width,
        control_flow=d.control_flow,
    )


def cluster_from_config(cfg: Config, simulated: bool) -> Cluster:
    """The ``cluster.*`` keys as a :class:`~dlrm_jax.embedding.plan.cost.Cluster`
    (``simulated``: the run is on simulated CPU devices, which ``cluster.profile=auto`` prices
    as such)."""
    c = dataclasses.asdict(cfg.cluster)
    return cluster_for(c.pop("profile"), c, simulated)


def dynamic_homes(cfg: Config, batches: list[np.ndarray]) -> list[np.ndarray]:
    """Batches' ids with each dynamic table's (its raw ids) replaced by their home rows in its
    map (``idmap.home_rows``): the rows its owners will see, for measuring the traffic."""
    maps, starts = dynamic_maps(cfg), np.cumsum([0, *cfg.bag_sizes])
    if not maps:
        return batches
    out = []
    for ids in batches:
        ids = ids.copy()
        for f, spec in maps.items():
            block = ids[:, starts[f] : starts[f + 1]]
            block[...] = np.where(block == PAD_ID, PAD_ID, home_rows(spec, block))
        out.append(ids)
    return out


def raw_id_batches(cfg: Config, source, count: int) -> list[np.ndarray]:
    """The first ``count`` training batches' ids (int64 [B, S]) with each dynamic table's slots
    holding the raw ids its map will see: a source's raw values where it carries them
    (:class:`~dlrm_jax.data.batch.RawBatch`; the slots hold placeholders), else the ids."""
    dynamic, starts = cfg.dynamic_tables, np.cumsum([0, *cfg.bag_sizes])
    slots = np.concatenate([np.arange(starts[f], starts[f + 1]) for f in dynamic]) if dynamic else []
    out = []
    for i in range(count):
        if not dynamic:
            out.append(np.asarray(train_ids(source, i)).astype(np.int64))
            continue
        batch = source.train_batch(i)
        ids = np.asarray(batch.ids).astype(np.int64)
        if getattr(batch, "raw", None) is not None:
            values = raw_values(batch.raw).view(np.int64)
            ids[:, slots] = np.where(ids[:, slots] == PAD_ID, PAD_ID, values)
        out.append(ids)
    return out


def plan_options(
    cfg: Config,
    specs: Sequence[TableSpec],
    budget_bytes: int,
    cluster: Cluster,
    stats: Sequence[TableStats] | None = None,
    ids_hosts: int = 1,
    devices: int = 0,
    budget_key: str = "embedding.memory_budget_gb",
) -> PlanOptions:
    """The ``embedding.*`` keys a plan is made under, as one record (``ids_hosts``: see
    ``PlanOptions``; ``devices``: the plan's, 1 lets dynamic tables be replicated)."""
    e = cfg.embedding
    # Dynamic tables: row-wise, their maps split with their rows; on one device the replicated
    # form holds the same rows without the exchange's routing (unless the table is tiered).
    whole = lambda f: devices == 1 and e.storage_of(f"cat_{f}") != "tiered"
    dynamic = {f"cat_{f}": Strategy.REPLICATED if whole(f) else Strategy.ROW for f in cfg.dynamic_tables}
    return PlanOptions(
        overrides=dynamic | parse_overrides(e.table_sharding, specs),
        row_layout=RowLayoutChoice(e.row_layout),
        capacity_factor=e.capacity_factor,
        dtype=e.dtype,
        exchange_dtype=e.exchange_dtype,
        budget_bytes=budget_bytes,
        budget_key=budget_key,
        bag_exchange=e.bag_exchange,
        storage=e.storage,
        storage_overrides=parse_overrides(e.table_storage, specs, "embedding.table_storage", Storage),
        device_cache=(e.tier.device_cache_rows, e.tier.device_cache_fraction),
        cluster=cluster,
        stats=stats,
        ids_hosts=ids_hosts,
        block_rows=frozenset(dynamic),
    )


def device_budget(cfg: Config, cluster: Cluster, bytes_limit: int | None = None) -> tuple[int, str]:
    """The planner's memory budget a device (0: none), and what set it: ``embedding.memory_budget_gb``;
    else 90% of what the device says it can hold (``bytes_limit``: a run on an accelerator);
    else 90% of the cluster's device memory (``cluster.device_memory_gb``, or its profile's).
    ``plan`` (no devices) and a run on CPU devices take the cluster's, as both price plans."""
    if cfg.embedding.memory_budget_gb:
        return int(cfg.embedding.memory_budget_gb * 2**30), "embedding.memory_budget_gb"
    if bytes_limit:
        return int(0.9 * bytes_limit), "0.9 x the device's memory, as embedding.memory_budget_gb=0"
    if cluster.device_memory_gb:
        return int(
            0.9 * cluster.device_memory_gb * 2**30
        ), "0.9 x cluster.device_memory_gb, as embedding.memory_budget_gb=0"
    return 0, "no budget"


def _host_share(cfg: Config, num_devices: int, hosts: int) -> tuple[int, int]:
    """The devices and the batch a plan is for: with per-host tables, one host's share."""
    per_host = cfg.embedding.tables_per_host and hosts > 1
    return (num_devices // hosts, cfg.train.batch_size // hosts) if per_host else (num_devices, cfg.train.batch_size)


def _maps_on_devices(cfg: Config) -> dict:
    """The dynamic tables' maps the devices hold (tiered tables' are on the host)."""
    return {f: s for f, s in dynamic_maps(cfg).items() if f not in cfg.tiered_tables}


def plan_budget(
    cfg: Config,
    num_devices: int,
    cluster: Cluster,
    *,
    hosts: int = 1,
    bytes_limit: int | None = None,
    budget_bytes: int | None = None,
) -> tuple[int, str]:
    """A device's budget for the tables, their state and the exchange's and hot rows' buffers,
    and what set it (:func:`plan_request`'s): ``budget_bytes`` where given, else
    :func:`device_budget`'s, less the wide part of Wide&Deep, which every device holds whole,
    and each device's share of the dynamic tables' id maps."""
    devices, batch = _host_share(cfg, num_devices, hosts)
    budget, key = (
        device_budget(cfg, cluster, bytes_limit) if budget_bytes is None else (budget_bytes, "the budget given")
    )
    if budget and cfg.model.kind == "wide_deep":
        budget = max(budget - wide_bytes_per_device(wide_plan_from_config(cfg, devices, batch)), 1)
        key += ", less the wide part"
    on_devices = _maps_on_devices(cfg)
    if budget and on_devices:
        budget = max(budget - sum(map_bytes_per_device(s, devices) for s in on_devices.values()), 1)
        key += ", less the id maps"
    return budget, key


def plan_request(
    cfg: Config,
    num_devices: int,
    budget_bytes: int | None = None,
    *,
    hosts: int = 1,
    cluster: Cluster | None = None,
    stats: Sequence[TableStats] | None = None,
    ids_hosts: int = 1,
    bytes_limit: int | None = None,
) -> PlanRequest:
    """The plan a config asks for on ``num_devices`` devices, as one record. With per-host
    tables (embedding.sync per_host or host_replicas) each of ``hosts`` hosts holds a whole set
    over its own devices: the request is one host's, its ``num_devices / hosts`` devices and its
    share of the batch. The budget: :func:`plan_budget`'s (``bytes_limit``: what the device
    says it can hold);
    ``cluster`` defaults to the config's for simulated devices (:func:`cluster_from_config`);
    ``stats``: the tables' id statistics in the data (``exchange.capacity.table_stats``);
    ``ids_hosts``: hosts the ids exchange goes over in two levels (1: one level)."""
    if num_devices < 1:  # (mesh.devices=0 is "every device" for a run; a plan needs the count)
        raise ConfigError(f"num_devices={num_devices}: a plan is for 1 or more devices (jax.device_count(): all)")
    specs = specs_from_config(cfg)
    cluster = cluster or cluster_from_config(cfg, simulated=True)
    devices, batch = _host_share(cfg, num_devices, hosts)
    for f, spec in _maps_on_devices(cfg).items():  # (plan refuses what the run would: a device holds whole shards)
        try:
            check_split(spec, devices)
        except ValueError as e:
            fix = f" (a multiple of {devices})" if devices & (devices - 1) == 0 else ""
            raise ConfigError(f"embedding.dynamic.vshards: table cat_{f}: {e}{fix}") from None
    budget, key = plan_budget(
        cfg, num_devices, cluster, hosts=hosts, bytes_limit=bytes_limit, budget_bytes=budget_bytes
    )
    options = plan_options(cfg, specs, budget, cluster, stats, ids_hosts, devices, key)
    return PlanRequest(tuple(specs), Sharding(cfg.embedding.sharding), devices, cfg.embedding.optimizer, batch, options)


def plan_from_config(cfg: Config, num_devices: int, budget_bytes: int | None = None, **kwargs) -> EmbeddingPlan:
    """The plan for a config's tables on ``num_devices`` devices without the data's statistics
    unless ``stats`` are given (``auto`` may then choose otherwise than a run, which measures
    them: ``build(cfg, mesh, source)`` plans as training does); ``dlrm_jax.train.wiring.plan_request``'s, with
    its keywords: ``hosts``, ``cluster``, ``stats``, ``ids_hosts``)."""
    return plan_request(cfg, num_devices, budget_bytes, **kwargs).plan()


def wide_plan_from_config(cfg: Config, num_devices: int, batch_size: int | None = None) -> EmbeddingPlan:
    """Wide&Deep's wide part (model.kind=wide_deep) on ``num_devices`` devices."""
    batch = cfg.train.batch_size if batch_size is None else batch_size
    rows = [s.rows for s in specs_from_config(cfg)]  # a dynamic table's wide weights: one per row of its map
    return wide_plan(rows, cfg.bag_sizes, cfg.model.wide.optimizer, batch, num_devices)


def config_plan_report(cfg: Config, plan: EmbeddingPlan) -> str:
    """:func:`~dlrm_jax.embedding.plan.stats.plan_report` (with per-host tables, one host's plan:
    its header names the global batch and the host's share), and for Wide&Deep a line on its
    wide part."""
    report = plan_report(plan, cfg.train.batch_size if cfg.embedding.tables_per_host else None)
    maps = dynamic_maps(cfg)
    if maps:
        specs, bags = {f"cat_{f}": s for f, s in maps.items()}, {f"cat_{f}": cfg.bag_sizes[f] for f in maps}
        on_devices = [t for t in maps if t not in set(plan.tiered_tables)]
        ids = cfg.train.batch_size // plan.num_devices * sum(cfg.bag_sizes[t] for t in on_devices)
        routes = on_devices and route_capacities(ids, plan.num_devices)  # (else the ids are gathered)
        routed = routed_lookup_group(plan, build_groups(plan), on_devices) if routes else None
        unsent = 0 if routed is None else unsent_row_id_bytes(plan, routed)
        rows_back = rows_sent_back(routed is not None, plan.hot_rows > 0, bool(model_entry(cfg).parts))
        lines = maps_report(specs, bags, plan.num_devices, cfg.train.batch_size, plan.tiered_tables, unsent, rows_back)
        report = f"{report}\n{lines}"
    if cfg.model.kind != "wide_deep":
        return report
    return f"{report}\n{wide_report(wide_plan_from_config(cfg, plan.num_devices), cfg.model.wide.optimizer)}"


def dlrm_from_config(
    cfg: Config, rngs: nnx.Rngs, num_dense: int | None = None, num_features: int | None = None
) -> DLRMDense:
    """The dense DLRM of ``model.*`` over the data's dense and categorical features (or
    ``num_dense`` and ``num_features``: data the config does not describe)."""
    m = cfg.model
    return DLRMDense(
        num_dense=cfg.data.num_dense if num_dense is None else num_dense,
        num_features=cfg.num_features if num_features is None else num_features,
        embedding_dim=m.embedding_dim,
        bottom_mlp=m.bottom_mlp,
        top_mlp=m.top_mlp,
        interaction=m.interaction,
        compute_dtype=cfg.train.compute_dtype,
        dcn_layers=m.dcn_layers,
        dcn_rank=m.dcn_rank,
        dot_pairs=dot_pairs(cfg),
        cross_layers=cross_layers(cfg),
        rngs=rngs,
    )


def dot_pairs(cfg: Config) -> str:
    """How the dot interaction's pairs are made (``model.dot_pairs``): ``auto`` is ``xla``
    everywhere until the kernels are measured on a GPU (off GPUs Pallas only interprets them)."""
    return "fused" if cfg.model.dot_pairs == "fused" else "xla"


def cross_layers(cfg: Config) -> str:
    """How a low-rank cross layer's second product and elementwise work run
    (``model.cross_layers``): ``auto`` is ``xla`` until the kernel is measured on a GPU."""
    return "fused" if cfg.model.cross_layers == "fused" else "xla"


def dense_work(cfg: Config) -> DenseWork:
    """The dense part's FLOPs and parameters as the step-time model prices them."""
    return model_dense_work(cfg.model, cfg.data.num_dense, cfg.num_features, cfg.train.compute_dtype)


def wide_part(cfg: Config, mesh: jax.sharding.Mesh) -> WidePart:
    """Wide&Deep's wide part on ``mesh``: its plan, optimizer and linear term."""
    return WidePart(
        wide_plan_from_config(cfg, mesh.size),
        wide_optimizer_from_config(cfg),
        cfg.data.num_dense,
        cfg.model.wide.learning_rate,
        mesh,
    )


class ModelEntry(NamedTuple):
    """How one ``model.kind`` is built. ``dense(cfg, rngs)``: the Flax NNX module called as
    ``(dense [B, num_dense], pooled [B, F, D], tensor) -> logits [B]`` (``tensor``: the tensor
    layout with model.mlp_parallel=tensor, else None); ``parts``: extra sparse parts by name,
    each ``make(cfg, mesh)`` a :class:`~dlrm_jax.model.parts.SparsePart` whose logits are added."""

    dense: Callable[[Config, nnx.Rngs], nnx.Module]
    parts: Mapping[str, Callable[[Config, jax.sharding.Mesh], SparsePart]] = MappingProxyType({})


# model.kind -> how it is built; choices.MODEL_KINDS names the same models for the config.
MODELS: dict[str, ModelEntry] = {
    "dlrm": ModelEntry(dlrm_from_config),
    "wide_deep": ModelEntry(dlrm_from_config, {"wide": wide_part}),
}


def model_entry(cfg: Config) -> ModelEntry:
    """The registered model of ``model.kind``."""
    if cfg.model.kind not in MODELS:
        raise ConfigError(f"model.kind={cfg.model.kind!r}: no model registered by that name ({', '.join(MODELS)})")
    return MODELS[cfg.model.kind]


def step_spec(cfg: Config, mesh: jax.sharding.Mesh) -> StepSpec:
    """What the config asks of the train and eval steps (:class:`~dlrm_jax.train.step.StepSpec`)."""
    entry = model_entry(cfg)
    schedule = learning_rate_schedule(cfg)
    return StepSpec(
        dense=lambda rngs: entry.dense(cfg, rngs),
        parts={name: make(cfg, mesh) for name, make in entry.parts.items()},
        tx=dense_optimizer(cfg, schedule),
        schedule=schedule,
        emb_lr_scale=cfg.embedding_learning_rate / cfg.train.learning_rate,
        seed=cfg.train.seed,
        batch_size=cfg.train.batch_size,
        bag_sizes=cfg.bag_sizes,
        num_dense=cfg.data.num_dense,
        mlp_parallel=cfg.model.mlp_parallel,
        microbatches=cfg.model.microbatches,
        maps=dynamic_maps(cfg),
        new_rows=cfg.embedding.dynamic.new_rows,
    )


def tier_root(cfg: Config, run_dir: Path | None) -> Path:
    """The disk tier's folder: embedding.tier.path, or RUN_DIR/tier."""
    if cfg.embedding.tier.path:
        if run_dir is not None and Path(cfg.embedding.tier.path).resolve() == Path(run_dir).resolve():
            raise ConfigError(  # (its lock is the run dir's: the run was refused as the tier's other user)
                f"embedding.tier.path={cfg.embedding.tier.path}: the run dir itself; give the tier a folder of "
                f"its own, or leave the key '' for RUN_DIR/tier"
            )
        return check_dir(cfg.embedding.tier.path, "embedding.tier.path")
    if run_dir is None:
        raise ValueError(f"embedding.storage=tiered needs a run dir ({run_dir_flag()}) or embedding.tier.path")
    return check_dir(Path(run_dir) / "tier", "tier path")
