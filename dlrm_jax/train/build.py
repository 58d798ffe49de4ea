"""From a config and a mesh to the jitted steps: the sharding plan, the exchange's bucket
sizes measured on the first batches, the hot rows and the tier's caches."""

from __future__ import annotations

import json
from pathlib import Path

import jax

from dlrm_jax.config import Config
from dlrm_jax.data.batch import DataSource
from dlrm_jax.data.pipeline import input_readers
from dlrm_jax.data.shards import content_digest
from dlrm_jax.embedding.exchange.collection import EmbeddingCollection
from dlrm_jax.embedding.exchange.host_tables import HostTables
from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan
from dlrm_jax.embedding.plan.estimates import TableStats
from dlrm_jax.embedding.plan.planner import check_budget
from dlrm_jax.embedding.tiers.setup import DynamicIds, SavedTiers, tier_plan
from dlrm_jax.parallel.coordination import check_same_everywhere, outcomes_of_every_process
from dlrm_jax.parallel.mesh import hosts_of, make_mesh
from dlrm_jax.train import hot_setup
from dlrm_jax.train.checks import check_batch, check_tiers_in_one_process
from dlrm_jax.train.optimizer_setup import sparse_optimizer_from_config
from dlrm_jax.train.planning import CALIBRATION_BATCHES, agree_by_max, plan_for_run
from dlrm_jax.train.step import StepFunctions
from dlrm_jax.train.wiring import (
    cluster_from_config,
    dynamic_homes,
    dynamic_maps,
    plan_budget,
    raw_id_batches,
    step_spec,
)


def build(
    cfg: Config,
    mesh: jax.sharding.Mesh,
    source: DataSource | None = None,
    log=print,
    tiered_saved: SavedTiers | None = None,
) -> tuple[EmbeddingPlan, StepFunctions]:
    """Plan the tables for this mesh and build the jitted steps (no state allocated yet).
    ``tiered_saved``: where a checkpoint to be restored keeps its tables (``restore.saved_tiers``;
    None: none is restored): each stays where the checkpoint has it, whatever its cache needs on
    this device count.

    With a data source and ``embedding.capacity_from=measured``, the all-to-all buckets are
    sized from the distinct requests of the first training batches (always the same batches,
    so a resumed run compiles the same step). With ``embedding.hot.rows`` set, the hot rows
    are chosen from the data too (:mod:`~dlrm_jax.train.hot_setup`); they need a source.
    """
    check_batch(cfg, mesh.size)
    bytes_limit = _bytes_limit()
    plan = plan_for_run(
        cfg,
        mesh.size,
        hosts_of(mesh),
        source,
        jax.default_backend() == "cpu",
        bytes_limit,
        agree=_every_process,
    )
    optimizer = sparse_optimizer_from_config(cfg)
    schedule = None
    if cfg.embedding.hot.rows != 0:
        if source is None:
            raise ValueError("embedding.hot.rows: choosing hot rows needs the training data")
        cluster = cluster_from_config(cfg, jax.default_backend() == "cpu")
        hot = cfg.embedding.hot
        plan, schedule = hot_setup.choose(
            hot,
            plan,
            mesh,
            source,
            CALIBRATION_BATCHES,
            cluster,
            input_readers(cfg.data.readers),
            log,
            dynamic=cfg.dynamic_tables,
            to_rows=lambda batches: dynamic_homes(cfg, batches),
        )
        # the hot rows' buffers on every device count in the budget (checked before they were added)
        check_budget(plan, *plan_budget(cfg, mesh.size, cluster, hosts=hosts_of(mesh), bytes_limit=bytes_limit))
    if not plan.tiered_tables:
        return plan, StepFunctions(step_spec(cfg, mesh), mesh, _tables(cfg, plan, mesh, optimizer), schedule)
    if source is None:
        raise ValueError("embedding.storage=tiered: sizing the device-cache fills needs the training data")
    check_tiers_in_one_process(cfg, jax.process_count())  # (eval's and the Python API's builds too)
    raw = raw_id_batches(cfg, source, cfg.embedding.hot.stats_batches)
    dynamic = DynamicIds(dynamic_maps(cfg), raw)
    plan = tier_plan(cfg.embedding.tier, plan, dynamic_homes(cfg, raw), log, dynamic, tiered_saved)
    if not plan.tiered_tables:
        return plan, StepFunctions(step_spec(cfg, mesh), mesh, EmbeddingCollection(plan, mesh, optimizer), schedule)
    collection = EmbeddingCollection(plan.device_view(), mesh, optimizer, plan.tiered_tables)
    return plan, StepFunctions(
        step_spec(cfg, mesh), mesh, collection, schedule, cache_groups=tuple(name for name, _ in plan.tier.fill_rows)
    )


def _tables(cfg: Config, plan: EmbeddingPlan, mesh, optimizer) -> EmbeddingCollection | HostTables:
    """The collection on ``mesh``, or per-host tables (embedding.sync per_host or host_replicas)
    around it."""
    e = cfg.embedding
    if not e.tables_per_host:
        return EmbeddingCollection(plan, mesh, optimizer)
    return HostTables(plan, mesh, optimizer, replicas=e.sync == "host_replicas", sync_every=e.sync_every)


def _every_process(kind: str, value):
    """What every process uses of what each measured on its own rows (``planning.agree_by_max``)."""
    if jax.process_count() == 1:
        return value
    every = [json.loads(o) for o in outcomes_of_every_process(json.dumps(value, default=vars))]
    if kind == "stats":
        every = [[TableStats(**s) for s in v] for v in every]
    return agree_by_max(every)


def mesh_from_config(cfg: Config) -> jax.sharding.Mesh:
    """The (data, model) mesh of ``mesh.devices`` in groups of ``mesh.model``; with
    per-host tables (embedding.sync per_host or host_replicas), (hosts, data, model) with
    ``mesh.hosts`` hosts (0: one per process). First, with several processes, every process's
    resolved config and dataset are compared (a one-line refusal naming what differs)."""
    if jax.process_count() > 1:  # (one process: nothing to compare, and the dataset's digest reads files)
        check_same_everywhere(_comparable(cfg), "configs")
    hosts = (cfg.mesh.hosts or jax.process_count()) if cfg.embedding.tables_per_host else 0
    return make_mesh(cfg.mesh.devices, hosts, cfg.mesh.model)


def _comparable(cfg: Config) -> dict[str, str]:
    """The config as key -> JSON text, without the keys that are paths on each host, plus the
    dataset's own fingerprint for binary data (its content without the shards' checksums:
    ``data.shards.content_digest``)."""
    flat: dict[str, str] = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat[f"{prefix}{k}"] = json.dumps(v)

    walk(cfg.to_dict(), "")
    for key in ("data.path", "embedding.tier.path"):
        flat.pop(key, None)
    if cfg.data.source == "binary" and (Path(cfg.data.path) / "meta.json").is_file():
        # (by content: hosts that each preprocessed the same files, from their own folders, agree;
        # not by the shards' checksums: a host may hold only the shards it reads)
        flat["the dataset (data.path's content)"] = content_digest(cfg.data.path, shards=False)[:12]
    return flat


def _bytes_limit() -> int | None:
    """What an accelerator says one device can hold (None on CPUs, or where it does not say)."""
    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None
