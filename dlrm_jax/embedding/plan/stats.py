"""What a plan costs: bytes per device, bytes exchanged per step, and the printed report."""

from __future__ import annotations

import dataclasses

import numpy as np

from dlrm_jax.embedding.plan.embedding_plan import (
    DTYPE_BYTES,
    EmbeddingPlan,
    Strategy,
    optimizer_bytes_per_row,
)
from dlrm_jax.embedding.plan.layout import build_groups, group_capacity, uses_pooled_exchange


def exchange_buffer_bytes(plan: EmbeddingPlan) -> int:
    """Per device: the step's all-to-all buffers (ids, vectors, gradients at the compiled
    capacity) plus the gathered rows and gradients of replicated tables and the hot rows'
    gradient sums. An overflowing step
    runs in rounds at the same capacity, so this bounds it too (pooled groups' rounds use the
    unpooled exchange's buffers, counted as well)."""
    n = plan.num_devices
    wire = DTYPE_BYTES[plan.exchange_dtype]
    local_batch = plan.global_batch // n
    total = 0
    for g in build_groups(plan):
        if g.replicated:
            total += plan.global_batch * g.num_vslots * (4 + 4 * g.width)
            continue
        cap = group_capacity(plan, g)
        total += 2 * n * cap * (4 + 2 * wire * g.width)  # row ids out, vectors back, gradients out
        if uses_pooled_exchange(plan, g):  # (row, segment, weight) both ways; partial sums; grads
            total += 2 * n * cap * 12 + n * local_batch * len(g.vtables) * g.width * (4 + 2 * wire)
    if plan.hot_rows:  # the hot rows' summed gradients, and each slot's hot row
        total += plan.hot_rows * plan.tables[0].spec.dim * 4 + local_batch * sum(t.spec.bag_size for t in plan.tables) * 4
    return total


def per_device_bytes(plan: EmbeddingPlan) -> dict[str, np.ndarray]:
    """int64 [N] for each of: parameters, optimizer state (both with the hot rows every device
    holds), exchange buffers."""
    n = plan.num_devices
    tot = sum(t.bytes_on_device(n, plan.optimizer, plan.dtype) for t in plan.tables)
    hot_params, hot_state = plan.hot_bytes_per_device()
    return {"parameters": tot[:, 0] + hot_params, "optimizer_state": tot[:, 1] + hot_state,
            "exchange_buffers": np.full(n, exchange_buffer_bytes(plan), np.int64)}


def collective_bytes(plan: EmbeddingPlan, replicas: int = 1) -> dict[str, int]:
    """Bytes one device sends to the others per step at the compiled capacity, by collective
    (named as in HLO). all-to-all: per sharded group, row ids out and vectors back (forward),
    row ids and gradients out (backward); pooled groups send (row, segment, weight) requests
    both ways and partial sums back, and all-gather the pooled gradients. all-gather:
    replicated tables send the device's rows and gradients to every other device. all-reduce:
    the hot rows' float32 gradients, summed over devices (ring: 2 (N-1)/N of the buffer).

    ``replicas``: hosts holding equal replicas of ``plan`` (embedding.sync=host_replicas);
    every owner also all-gathers, from its counterparts on the other hosts, the rows and
    float32 gradients they received, and replicated tables gather every host's batch."""
    n, local_batch = plan.num_devices, plan.global_batch // plan.num_devices
    wire = DTYPE_BYTES[plan.exchange_dtype]
    out = {"all-to-all": 0, "all-gather": 0, "all-reduce": 0}
    for g in build_groups(plan):
        if not g.replicated:  # (the owner's received [N, C] buffers)
            out["all-gather"] += (replicas - 1) * n * group_capacity(plan, g) * (4 + 4 * g.width)
        if g.replicated:
            out["all-gather"] += (n * replicas - 1) * local_batch * g.num_vslots * (4 + 4 * g.width)
        elif uses_pooled_exchange(plan, g):
            segments = local_batch * len(g.vtables)
            out["all-to-all"] += (n - 1) * group_capacity(plan, g) * 12 * 2
            out["all-gather"] += (n - 1) * segments * wire * g.width
            out["all-to-all"] += (n - 1) * segments * wire * g.width  # partial sums back
        else:
            out["all-to-all"] += (n - 1) * group_capacity(plan, g) * 2 * (4 + wire * g.width)
    if plan.hot_rows and n > 1:
        out["all-reduce"] += 2 * (n - 1) * plan.hot_rows * plan.tables[0].spec.dim * 4 // n
    return out


def exchange_bytes_per_step(plan: EmbeddingPlan) -> int:
    """Bytes one device sends to the others per step, every collective together."""
    return sum(collective_bytes(plan).values())


def plan_report(plan: EmbeddingPlan, global_batch: int | None = None) -> str:
    """The plan as a table, then per-device totals and the predicted exchange volume.

    ``global_batch``: the run's, when the plan is one host's of per-host tables and its own
    ``global_batch`` is that host's share."""
    n = plan.num_devices
    hot = plan.hot
    head = (f"{'table':<12}{'rows':>13}{'dim':>5}{'bag':>5}  {'strategy':<16}{'devices':<18}{'bytes/device':>13}"
            + (f"{'hot rows':>10}{'hit rate':>9}" if hot else ""))
    batch = f"global batch {plan.global_batch}"
    if global_batch is not None and global_batch != plan.global_batch:
        batch = (f"global batch {global_batch} ({plan.global_batch} per host: the share of one host's "
                 f"{n} devices)")
    lines = [f"Embedding plan: {len(plan.tables)} tables on {n} devices, optimizer {plan.optimizer}, "
             f"storage {plan.dtype}, exchange {plan.exchange_dtype}, {batch}",
             head, "-" * len(head)]
    for i, t in enumerate(plan.tables):
        strategy = t.strategy.value
        if t.strategy == Strategy.ROW:
            strategy += f" ({t.row_layout.value})"
        elif t.strategy == Strategy.COLUMN:
            strategy += f" x{t.column_slices}"
        whole = t.strategy in (Strategy.REPLICATED, Strategy.ROW)
        devs = "all" if whole else _device_list(t.devices)
        per = int(t.bytes_on_device(n, plan.optimizer, plan.dtype).sum(1).max())
        lines.append(f"{t.spec.name:<12}{t.spec.rows:>13,}{t.spec.dim:>5}{t.spec.bag_size:>5}  "
                     f"{strategy:<16}{devs:<18}{fmt_bytes(per):>13}"
                     + (_hot_columns(hot, i) if hot else ""))
    per_dev = per_device_bytes(plan)
    total = sum(per_dev.values())
    lines += ["", f"{'device':<8}{'parameters':>14}{'optimizer':>14}{'exchange':>14}{'total':>14}"]
    shown = range(n) if n <= 16 else (int(np.argmax(total)),)
    for d in shown:
        lines.append(f"{d:<8}" + "".join(f"{fmt_bytes(int(v[d])):>14}" for v in per_dev.values())
                     + f"{fmt_bytes(int(total[d])):>14}")
    if n > 16:
        lines.append(f"(the busiest of {n} devices)")
    groups = [g for g in build_groups(plan) if not g.replicated]
    if groups:
        measured = {c[0] for c in plan.capacities}
        lb = plan.global_batch // n
        lines.append("All-to-all capacity per owner: " + ", ".join(
            f"{g.name} {group_capacity(plan, g):,} of {g.max_capacity(lb):,} "
            f"({'measured' if g.name in measured else 'from batch'}"
            f"{', owners pool bags' if uses_pooled_exchange(plan, g) else ''})" for g in groups))
    if hot:
        lines += hot_report(plan)
    if plan.tier:
        lines += tier_report(plan)
    lines.append(f"Predicted exchange per step per device: {fmt_bytes(exchange_bytes_per_step(plan))}")
    return "\n".join(lines)


def tier_report(plan: EmbeddingPlan) -> list[str]:
    """Per tiered table: its bytes in the disk tier, DRAM cache and each owner's device cache,
    the device-cache hit rate predicted from the first batches, and the share of device misses
    the DRAM cache is predicted to serve (``embedding/tiers/setup.py``)."""
    tier, dim = plan.tier, plan.tables[0].spec.dim
    row = DTYPE_BYTES[plan.dtype] * dim + optimizer_bytes_per_row(plan.optimizer, dim)
    lines = [f"Tiered tables (DRAM cache {tier.policy}, lookahead {tier.lookahead} batches, fill rows "
             + ", ".join(f"{g} {r}" for g, r in tier.fill_rows) + "):",
             f"{'table':<12}{'disk tier':>12}{'DRAM cache':>12}{'device cache':>14}{'per owner':>11}{'device hits':>13}"
             f"{'DRAM hits':>11}"]
    for t in plan.tiered_tables:
        tp = plan.tables[t]
        hit = tier.device_hit_rates[t] if tier.device_hit_rates else 0.0
        host = tier.host_hit_rates[t] if tier.host_hit_rates else 0.0
        lines.append(f"{tp.spec.name:<12}{fmt_bytes(tp.spec.rows * row):>12}{fmt_bytes(tier.host_rows[t] * row):>12}"
                     f"{fmt_bytes(tp.cache_rows * row):>14}{tp.cache_rows:>11,}{100 * hit:>12.1f}%{100 * host:>10.1f}%")
    return lines


def _hot_columns(hot, table: int) -> str:
    rows = hot.per_table[table] if hot.per_table else 0
    rate = f"{100 * hot.table_hit_rates[table]:.1f}%" if hot.table_hit_rates else "-"
    return f"{rows:>10,}{rate:>9}"


def hot_report(plan: EmbeddingPlan) -> list[str]:
    """The hot-row decision: rows, their share of lookups, and the bytes with and without."""
    hot = plan.hot
    params, state = plan.hot_bytes_per_device()
    with_hot = collective_bytes(plan)
    without = collective_bytes(dataclasses.replace(plan, hot=None, capacities=hot.no_hot_capacities))
    chosen = sum(hot.per_table)
    return [f"Hot rows: capacity {hot.rows:,} on every device ({fmt_bytes(params + state)} with optimizer "
            f"state), {chosen:,} chosen, {100 * hot.hit_rate:.1f}% of lookups in the statistics batches",
            f"  per step per device: all-to-all {fmt_bytes(with_hot['all-to-all'])} (without hot rows "
            f"{fmt_bytes(without['all-to-all'])}), all-reduce {fmt_bytes(with_hot['all-reduce'])}; total "
            f"{fmt_bytes(sum(with_hot.values()))} (without {fmt_bytes(sum(without.values()))})"]


def _device_list(devices: tuple[int, ...]) -> str:
    text = ",".join(map(str, devices))
    return text if len(text) <= 16 else f"{devices[0]}..{devices[-1]} ({len(devices)})"


def fmt_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError
