"""The plan a run trains with, from its config and its data, without JAX: what ``build`` uses
and what ``dlrm-jax plan`` prints, so the two agree.

The tables' id statistics in the first batches steer ``embedding.sharding=auto`` (the ids
buckets a row-wise split would need), and once the plan is made its ids buckets are measured
on the same batches (``embedding.capacity_from=measured``). Every process computes both from
its own rows; ``agree`` (several processes: through the coordination service) combines them
so that every process compiles the same step.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from dlrm_jax.config import Config
from dlrm_jax.data.batch import DataSource
from dlrm_jax.embedding.exchange.capacity import measure_capacities, table_stats
from dlrm_jax.embedding.plan.cost import bound_link_bytes, exchange_link_bytes, predict_step
from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan, ExchangeKind, RowLayout
from dlrm_jax.embedding.plan.layout import exchange_parts, two_level_ids
from dlrm_jax.embedding.plan.search import TableStats
from dlrm_jax.embedding.plan.stats import (
    exchange_bytes_per_step,
    fmt_bytes,
    lower_bound_bytes,
    per_device_bytes,
)
from dlrm_jax.train.wiring import (
    cluster_from_config,
    config_plan_report,
    dense_work,
    host_plan_from_config,
    specs_from_config,
)

CALIBRATION_BATCHES = 4
STATS_DEVICES = 256  # devices' shares of a batch the statistics read at most (an estimate)


def _alone(kind: str, value):
    return value


def plan_for_run(
    cfg: Config,
    num_devices: int,
    hosts: int,
    source: DataSource | None,
    simulated: bool,
    budget_bytes: int | None = None,
    agree: Callable = _alone,
) -> EmbeddingPlan:
    """The plan for ``num_devices`` devices (``hosts``: of per-host tables) with the ids
    buckets measured on ``source``'s first batches (none without a source, or with
    ``embedding.capacity_from=batch``: the batch-size bound). ``agree(kind, value)``: the
    value every process uses (``kind``: "stats" or "capacities")."""
    local = cfg.train.batch_size // num_devices
    plan_devices = num_devices // hosts if cfg.embedding.tables_per_host else num_devices
    batches = [source.train_batch(i).ids for i in range(CALIBRATION_BATCHES)] if source is not None else []
    stats = None
    if batches and (cfg.embedding.sharding == "auto" or cfg.embedding.row_layout == "auto"):
        rows = min(len(batches[0]), STATS_DEVICES * local)
        stats = agree(
            "stats", table_stats(list(specs_from_config(cfg)), [b[:rows] for b in batches], plan_devices, local)
        )
    cluster = cluster_from_config(cfg, simulated)

    def measured(cfg: Config) -> EmbeddingPlan:
        plan = host_plan_from_config(cfg, num_devices, hosts, budget_bytes, cluster=cluster, stats=stats)
        if batches and cfg.embedding.capacity_from == "measured" and plan.num_devices > 1:
            capacities = agree("capacities", measure_capacities(plan, batches, cfg.embedding.capacity_factor))
            plan = dataclasses.replace(plan, capacities=capacities)
        return plan

    plan = measured(cfg)
    if cfg.embedding.row_layout == "auto" and batches:
        # The search weighs layouts by estimated buckets (per owner, the tables' busiest owners
        # added up); measured, the plan of blocks alone may still be faster: keep the faster.
        block = measured(dataclasses.replace(cfg, embedding=dataclasses.replace(cfg.embedding, row_layout="block")))
        if predict_step(block, cluster).embedding_s <= predict_step(plan, cluster).embedding_s:
            plan = block
    hosts = two_level_hosts(cfg, plan, cluster.devices_per_host)
    if hosts > 1:  # the ids exchange in two levels: kept when asked for, or when predicted faster
        two = dataclasses.replace(plan, ids_hosts=hosts)
        if batches and cfg.embedding.capacity_from == "measured":  # the same buckets, and the two stages'
            capacities = agree("capacities", measure_capacities(two, batches, cfg.embedding.capacity_factor))
            two = dataclasses.replace(two, capacities=capacities)
        if cfg.embedding.ids_exchange == "two_level" or (
            predict_step(two, cluster).embedding_s < predict_step(plan, cluster).embedding_s
        ):
            plan = two
    return plan


def two_level_hosts(cfg: Config, plan: EmbeddingPlan, devices_per_host: int) -> int:
    """Hosts the plan's ids exchange may go over in two levels (1: none): tables over every
    device (not per host), hosts of several devices tiling them, an ids part that can, and
    ``embedding.ids_exchange`` not ``flat``."""
    n = plan.num_devices
    if cfg.embedding.ids_exchange == "flat" or cfg.embedding.tables_per_host or devices_per_host < 2:
        return 1
    if n % devices_per_host or n // devices_per_host < 2:
        return 1
    hosts = n // devices_per_host
    probe = dataclasses.replace(plan, ids_hosts=hosts)
    parts = [p for p in exchange_parts(probe) if p.kind == ExchangeKind.IDS and two_level_ids(probe, p.group)]
    return hosts if parts else 1


def _most(values):
    return None if None in values else max(values)


def agree_by_max(values) -> list:
    """How processes combine what each measured: statistics by their mean distinct rows, and
    largest buckets and batch distinct rows (each process's scaled up from its own rows);
    capacities by the largest (``values``: every process's, in order)."""
    first = values[0]
    if first and isinstance(first[0], TableStats):
        return [
            TableStats(
                sum(v[t].distinct for v in values) / len(values),
                max(v[t].row_owner for v in values),
                max(v[t].owner(RowLayout.CYCLIC) for v in values),
                _most([v[t].batch_distinct for v in values]),
            )
            for t in range(len(first))
        ]
    return tuple((name, max(dict(v)[name] for v in values)) for name, _ in first)


def run_plan_report(cfg: Config, plan: EmbeddingPlan, simulated: bool) -> str:
    """The printed plan (``wiring.config_plan_report``), then the predicted step of one
    device by phase on the cluster it was priced for, beside the exchange's lower bound."""
    cluster = cluster_from_config(cfg, simulated)
    step = predict_step(plan, cluster, dense_work(cfg))
    phases = ", ".join(f"{k} {1e3 * v:.3f}" for k, v in step.phases.items())
    bound = lower_bound_bytes(plan)
    sent = exchange_bytes_per_step(plan)
    lines = [
        config_plan_report(cfg, plan),
        f"Lower bound of the exchange per step per device: {fmt_bytes(bound)} (predicted / bound: {sent / max(bound, 1):.2f})",
    ]
    if plan.num_devices > cluster.devices_per_host:  # the slow links' share, what hosts decide
        within, between = exchange_link_bytes(plan, cluster)
        bound_between = bound_link_bytes(plan, cluster)[1]
        lines.append(
            f"Between hosts ({cluster.devices_per_host} devices a host): {fmt_bytes(int(between))} of it per "
            f"device and step, the bound's {fmt_bytes(int(bound_between))} ({between / max(bound_between, 1):.2f}x); "
            f"within hosts {fmt_bytes(int(within))}"
        )
    lines.append(
        f"Predicted step per device on {cluster.name} ({_cluster_words(cluster)}): {1e3 * step.total_s:.3f} ms = {phases} "
        f"(ms); the bound's exchange alone {1e3 * step.bound_exchange_s:.3f} ms"
    )
    return "\n".join(lines)


def plan_summary(cfg: Config, plan: EmbeddingPlan, simulated: bool, run_dir=None) -> str:
    """The plan in three lines: where the tables went, memory and exchange per device, and the
    predicted step (the whole report: ``run_plan_report``, in the run dir's plan.txt)."""
    counts = Counter(t.strategy.value + (f" x{t.column_slices}" if t.column_slices > 1 else "") for t in plan.tables)
    placed = ", ".join(f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    memory = max(sum(per_device_bytes(plan).values()))
    sent, bound = exchange_bytes_per_step(plan), lower_bound_bytes(plan)
    step = predict_step(plan, cluster_from_config(cfg, simulated), dense_work(cfg))
    where = f"; the whole plan: {Path(run_dir) / 'plan.txt'}" if run_dir else ""
    return "\n".join(
        [
            f"plan: {len(plan.tables)} tables on {plan.num_devices} devices: {placed}",
            f"  {fmt_bytes(memory)} of tables, optimizer state and buffers on the busiest device; exchange "
            f"{fmt_bytes(sent)} a step per device ({sent / max(bound, 1):.2f}x the lower bound)",
            f"  predicted step {1e3 * step.total_s:.3f} ms on the {cluster_from_config(cfg, simulated).name} profile{where}",
        ]
    )


def _cluster_words(c) -> str:
    return (
        f"{c.devices_per_host} devices a host, {c.intra_host_gbps:g} GB/s within and {c.inter_host_gbps:g} GB/s "
        f"between hosts, {c.hbm_gbps:g} GB/s memory, {c.tflops:g} TFLOP/s"
    )
