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

from dlrm_jax.choices import RowLayoutChoice, Sharding
from dlrm_jax.config import Config
from dlrm_jax.data.batch import DataSource, train_ids
from dlrm_jax.embedding.exchange.capacity import measure_capacities, table_stats
from dlrm_jax.embedding.plan.cost import bound_link_bytes, exchange_link_bytes, predict_step
from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan, ExchangeKind, RowLayout
from dlrm_jax.embedding.plan.estimates import TableStats
from dlrm_jax.embedding.plan.layout import two_level_ids, why_ids_flat
from dlrm_jax.embedding.plan.part_kinds import exchange_parts
from dlrm_jax.embedding.plan.planner import PlanRequest
from dlrm_jax.embedding.plan.stats import (
    exchange_bytes_per_step,
    fmt_bytes,
    lower_bound_bytes,
    per_device_bytes,
)
from dlrm_jax.train.wiring import cluster_from_config, config_plan_report, dense_work, dynamic_homes, plan_request

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
    bytes_limit: int | None = None,
    agree: Callable = _alone,
) -> EmbeddingPlan:
    """The plan for ``num_devices`` devices (``hosts``: of per-host tables) with the ids
    buckets measured on ``source``'s first batches (none without a source, or with
    ``embedding.capacity_from=batch``: the batch-size bound). ``bytes_limit``: what a device
    says it can hold (``wiring.device_budget``). ``agree(kind, value)``: the
    value every process uses (``kind``: "stats" or "capacities")."""
    local = cfg.train.batch_size // num_devices
    batches = dynamic_homes(cfg, [train_ids(source, i) for i in range(CALIBRATION_BATCHES)]) if source else []
    cluster = cluster_from_config(cfg, simulated)
    ids_hosts = two_level_hosts(cfg, num_devices, cluster.devices_per_host)
    request = plan_request(cfg, num_devices, hosts=hosts, cluster=cluster, bytes_limit=bytes_limit)
    auto_sharding = request.sharding is Sharding.AUTO
    auto_layout = request.options.row_layout is RowLayoutChoice.AUTO
    if batches and (auto_sharding or auto_layout):
        rows = min(len(batches[0]), STATS_DEVICES * local)
        host_devices = cluster.devices_per_host if ids_hosts > 1 else 1
        shares = [b[:rows] for b in batches]
        request = request.with_options(
            stats=agree("stats", table_stats(list(request.specs), shares, request.num_devices, local, host_devices))
        )

    def with_capacities(plan: EmbeddingPlan) -> EmbeddingPlan:
        if batches and cfg.embedding.capacity_from == "measured" and plan.num_devices > 1:
            capacities = agree("capacities", measure_capacities(plan, batches, cfg.embedding.capacity_factor))
            plan = dataclasses.replace(plan, capacities=capacities)
        return plan

    def measured(request: PlanRequest) -> EmbeddingPlan:
        return with_capacities(request.plan())

    plan = measured(request)
    if auto_layout and batches:
        # The search weighs layouts by estimated buckets (per owner, the tables' busiest owners
        # added up); measured, the plan of blocks alone may still be faster: keep the faster.
        block = measured(request.with_options(row_layout=RowLayoutChoice.BLOCK))
        if predict_step(block, cluster).embedding_s <= predict_step(plan, cluster).embedding_s:
            plan = block
    if ids_hosts > 1:
        # The ids exchange in two levels: this placement's ids parts, and (when the search
        # places tables from the data) the placement searched with two levels priced; kept
        # when asked for (embedding.ids_exchange=two_level) or when predicted faster.
        two = [with_capacities(dataclasses.replace(plan, ids_hosts=ids_hosts))]
        if request.options.stats is not None and auto_sharding:
            two.append(measured(request.with_options(ids_hosts=ids_hosts)))
        two = [p for p in two if any_two_level(p)]
        candidates = two if cfg.embedding.ids_exchange == "two_level" and two else [plan, *two]
        plan = min(candidates, key=lambda p: predict_step(p, cluster).embedding_s)
    return plan


def any_two_level(plan: EmbeddingPlan) -> bool:
    """Whether some ids part of the plan goes in two levels."""
    return any(p.kind == ExchangeKind.IDS and two_level_ids(plan, p.group) for p in exchange_parts(plan))


def two_level_hosts(cfg: Config, num_devices: int, devices_per_host: int) -> int:
    """Hosts an ids exchange may go over in two levels (1: none): tables over every device
    (not per host), hosts of several devices tiling them, and ``embedding.ids_exchange`` not
    ``flat`` (``two_level`` where they cannot: refused by ``checks.check_runnable``)."""
    if cfg.embedding.ids_exchange == "flat" or why_not_two_levels(cfg, num_devices, devices_per_host):
        return 1
    return num_devices // devices_per_host


def why_not_two_levels(cfg: Config, num_devices: int, devices_per_host: int) -> str:
    """Why no ids exchange of this mesh can go in two levels ('' when one can)."""
    per_host, g = cfg.embedding.tables_per_host, devices_per_host
    if per_host:
        return f"per-host tables (embedding.sync={cfg.embedding.sync}) exchange no ids between hosts"
    if g < 2:
        return f"hosts of {g} device (cluster.devices_per_host) have no requests to merge"
    if num_devices <= g:
        return f"the {num_devices} devices fit one host of {g} (cluster.devices_per_host)"
    if num_devices % g:
        return f"the {num_devices} devices do not split into hosts of {g} (cluster.devices_per_host)"
    return ""


def _most(values):
    return None if None in values else max(values)


def _most_each(values):
    """Per split and owner, the most of every process's (None if one has none)."""
    if any(v is None for v in values):
        return None
    return tuple(tuple(max(x) for x in zip(*(v[k] for v in values), strict=True)) for k in range(2))


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
                _most_each([v[t].by_owner for v in values]),
                _most_each([v[t].by_owner_host for v in values]),
            )
            for t in range(len(first))
        ]
    return tuple((name, max(dict(v)[name] for v in values)) for name, _ in first)


def run_plan_report(cfg: Config, plan: EmbeddingPlan, simulated: bool) -> str:
    """The printed plan (``wiring.config_plan_report``), then the predicted step of one
    device by phase on the cluster it was priced for, beside the pooled-exchange bound (a
    pooled vector each way per lookup, no dedup: :func:`~dlrm_jax.embedding.plan.stats.lower_bound_bytes`),
    which replicated tables, hot rows and deduplicated ids go below."""
    cluster = cluster_from_config(cfg, simulated)
    step = predict_step(plan, cluster, dense_work(cfg))
    phases = ", ".join(f"{k} {1e3 * v:.3f}" for k, v in step.phases.items())
    bound = lower_bound_bytes(plan)
    sent = exchange_bytes_per_step(plan)
    lines = [
        config_plan_report(cfg, plan),
        f"Pooled-exchange bound (no dedup) per step per device: {fmt_bytes(bound)} "
        + (
            f"(predicted / bound: {sent / bound:.2f}{below_bound_words(plan) if sent < bound else ''})"
            if bound
            else "(nothing crosses devices)"
        ),
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
    return "\n".join(lines + [two_levels_unused(cfg, plan)]).strip()


def below_bound_words(plan: EmbeddingPlan) -> str:
    """Why a plan sends less than the pooled-exchange bound, which counts one vector each way
    per lookup of every table: the parts of this plan that send less."""
    kinds = {p.kind for p in exchange_parts(plan)}
    why = [
        "replicated tables look up on every device" if kinds & {ExchangeKind.ALLREDUCE, ExchangeKind.GATHER} else "",
        "hot rows are replicated" if plan.hot else "",
        "ids parts send each distinct row once" if ExchangeKind.IDS in kinds else "",
    ]
    return "; below it as " + (", ".join(w for w in why if w) or "fewer vectors than lookups are sent")


def two_levels_unused(cfg: Config, plan: EmbeddingPlan) -> str:
    """One line when embedding.ids_exchange=two_level is asked of a plan none of whose
    exchange's ids parts can go in two levels (the mesh can: ``checks`` refuses it otherwise);
    '' when one does, or two levels were not asked for."""
    if cfg.embedding.ids_exchange != "two_level" or any_two_level(plan):
        return ""
    ids = [p.group for p in exchange_parts(plan) if p.kind == ExchangeKind.IDS]
    if ids:  # (it said no part sent ids, beside the report's ids exchange)
        why = sorted({why_ids_flat(plan, g) for g in ids})
        return f"embedding.ids_exchange=two_level: nothing goes in two levels: {'; '.join(why)}"
    return (
        "embedding.ids_exchange=two_level: no part of this plan's exchange sends ids to the tables' owners "
        "(the form whose requests two levels merge), so nothing goes in two levels"
    )


def plan_summary(cfg: Config, plan: EmbeddingPlan, simulated: bool, run_dir=None) -> str:
    """The plan in three lines: where the tables went, memory and exchange per device, and the
    predicted step (the whole report: ``run_plan_report``, in the run dir's plan.txt)."""
    counts = Counter(t.strategy.value + (f" x{t.column_slices}" if t.column_slices > 1 else "") for t in plan.tables)
    placed = ", ".join(f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    memory = max(sum(per_device_bytes(plan).values()))
    sent, bound = exchange_bytes_per_step(plan), lower_bound_bytes(plan)
    step = predict_step(plan, cluster_from_config(cfg, simulated), dense_work(cfg))
    where = f"; the whole plan: {Path(run_dir) / 'plan.txt'}" if run_dir else ""
    unused = two_levels_unused(cfg, plan)
    return "\n".join(
        [
            f"plan: {len(plan.tables)} tables on {plan.num_devices} devices: {placed}",
            f"  {fmt_bytes(memory)} of tables, optimizer state and buffers on the busiest device; exchange "
            f"{fmt_bytes(sent)} a step per device ({sent / max(bound, 1):.2f}x the pooled-exchange bound)",
            f"  predicted step {1e3 * step.total_s:.3f} ms on the {cluster_from_config(cfg, simulated).name} profile{where}",
            *([f"  {unused}"] if unused else []),
        ]
    )


def _cluster_words(c) -> str:
    return (
        f"{c.devices_per_host} devices a host, {c.intra_host_gbps:g} GB/s within and {c.inter_host_gbps:g} GB/s "
        f"between hosts, {c.hbm_gbps:g} GB/s memory, {c.tflops:g} TFLOP/s"
    )
