"""What a plan costs: bytes per device, bytes exchanged per step, and the printed report."""

from __future__ import annotations

import dataclasses

import numpy as np

from dlrm_jax.embedding.plan.embedding_plan import (
    DTYPE_BYTES,
    EmbeddingPlan,
    Strategy,
    optimizer_bytes_per_row,
    vector_bytes,
)
from dlrm_jax.embedding.plan.layout import ExchangePart
from dlrm_jax.embedding.plan.part_kinds import exchange_parts, part_kind


def part_collective_bytes(plan: EmbeddingPlan, part: ExchangePart, table_copies: int = 1) -> dict[str, float]:
    """Bytes one device sends per step in one exchange part's collectives, by kind (named as
    in HLO and counted as ``bench.common.hlo_collective_bytes`` counts a compiled program):
    its kind's links (``part_kinds``) summed by kind."""
    out = {"all-to-all": 0.0, "all-gather": 0.0, "all-reduce": 0.0, "reduce-scatter": 0.0}
    for kind, sent, _ in part_kind(part).links(plan, part, table_copies):
        out[kind] += sent
    return out


def exchange_buffer_bytes(plan: EmbeddingPlan) -> int:
    """Per device: every part's exchange buffers plus the hot rows' gradient sums. An
    overflowing ids part runs in rounds at the same capacity, so this bounds it too."""
    total = sum(part_kind(p).buffer_bytes(plan, p) for p in exchange_parts(plan))
    if plan.hot_rows:  # the hot rows' summed gradients, and each slot's hot row
        local_batch = plan.local_batch
        total += (
            plan.hot_rows * plan.tables[0].spec.dim * 4 + local_batch * sum(t.spec.bag_size for t in plan.tables) * 4
        )
    return total


def per_device_bytes(plan: EmbeddingPlan) -> dict[str, np.ndarray]:
    """int64 [N] for each of: parameters, optimizer state (both with the hot rows every device
    holds), exchange buffers."""
    n = plan.num_devices
    tot = sum(t.bytes_on_device(n, plan.optimizer, plan.dtype) for t in plan.tables)
    hot_params, hot_state = plan.hot_bytes_per_device()
    return {
        "parameters": tot[:, 0] + hot_params,
        "optimizer_state": tot[:, 1] + hot_state,
        "exchange_buffers": np.full(n, exchange_buffer_bytes(plan), np.int64),
    }


def collective_bytes(plan: EmbeddingPlan, table_copies: int = 1) -> dict[str, int]:
    """Bytes one device sends to the others per step at the compiled sizes, by collective
    (named as in HLO): every exchange part's (:func:`part_collective_bytes`) and the hot
    rows' float32 gradients, all-reduced (ring: 2 (N-1)/N of the buffer)."""
    n = plan.num_devices
    out = {"all-to-all": 0.0, "all-gather": 0.0, "all-reduce": 0.0, "reduce-scatter": 0.0}
    for part in exchange_parts(plan):
        for kind, b in part_collective_bytes(plan, part, table_copies).items():
            out[kind] += b
    if plan.hot_rows and n > 1:
        out["all-reduce"] += 2 * (n - 1) * plan.hot_rows * plan.tables[0].spec.dim * 4 / n
    return {k: int(round(v)) for k, v in out.items()}


def exchange_bytes_per_step(plan: EmbeddingPlan) -> int:
    """Bytes one device sends to the others per step, every collective together."""
    return sum(collective_bytes(plan).values())


def lower_bound_bytes(plan: EmbeddingPlan) -> int:
    """The exchange's lower bound per device and step: each device receives one pooled vector
    per feature for each of its B/N samples and sends one gradient back, and sends its ids to
    the owners once: ``(2 B/N sum(dims) wire + B/N sum(bags) 4) (N-1)/N`` (``wire``: the plan's
    exchange width). Replicated tables and hot rows can go below it; deduplicated one-hot ids
    on skewed data too."""
    n, lb = plan.num_devices, plan.global_batch / plan.num_devices
    vectors = sum(vector_bytes(plan.exchange_dtype, t.spec.dim) for t in plan.tables)
    bags = sum(t.spec.bag_size for t in plan.tables)
    return int(round((2 * lb * vectors + lb * bags * 4) * (n - 1) / n))


def plan_report(plan: EmbeddingPlan, global_batch: int | None = None) -> str:
    """The plan as a table, then per-device totals and the predicted exchange volume.

    ``global_batch``: the run's, when the plan is one host's of per-host tables and its own
    ``global_batch`` is that host's share."""
    n = plan.num_devices
    hot = plan.hot
    head = f"{'table':<12}{'rows':>13}{'dim':>5}{'bag':>5}  {'strategy':<16}{'devices':<18}{'bytes/device':>13}" + (
        f"{'hot rows':>10}{'hit rate':>9}" if hot else ""
    )
    batch = f"global batch {plan.global_batch}"
    if global_batch is not None and global_batch != plan.global_batch:
        batch = f"global batch {global_batch} ({plan.global_batch} per host: the share of one host's {n} devices)"
    lines = [
        f"Embedding plan: {len(plan.tables)} tables on {n} devices, optimizer {plan.optimizer}, "
        f"storage {plan.dtype}, exchange {plan.exchange_dtype}, {batch}",
        head,
        "-" * len(head),
    ]
    for i, t in enumerate(plan.tables):
        strategy = t.strategy.value
        if t.strategy == Strategy.ROW:
            strategy += f" ({t.row_layout.value})"
        elif t.strategy in (Strategy.HOST_ROW, Strategy.HOST_COLUMN):
            strategy += f" x{len(t.devices)}"
        elif t.strategy == Strategy.COLUMN:
            strategy += f" x{t.column_slices}"
        whole = t.strategy in (Strategy.REPLICATED, Strategy.ROW)
        devs = "all" if whole else _device_list(t.devices)
        per = int(t.bytes_on_device(n, plan.optimizer, plan.dtype).sum(1).max())
        lines.append(
            f"{t.spec.name:<12}{t.spec.rows:>13,}{t.spec.dim:>5}{t.spec.bag_size:>5}  "
            f"{strategy:<16}{devs:<18}{fmt_bytes(per):>13}" + (_hot_columns(hot, i) if hot else "")
        )
    per_dev = per_device_bytes(plan)
    total = sum(per_dev.values())
    lines += ["", f"{'device':<8}{'parameters':>14}{'optimizer':>14}{'exchange':>14}{'total':>14}"]
    shown = range(n) if n <= 16 else (int(np.argmax(total)),)
    for d in shown:
        lines.append(
            f"{d:<8}"
            + "".join(f"{fmt_bytes(int(v[d])):>14}" for v in per_dev.values())
            + f"{fmt_bytes(int(total[d])):>14}"
        )
    if n > 16:
        lines.append(f"(the busiest of {n} devices)")
    lines += exchange_report(plan)
    if hot:
        lines += hot_report(plan)
    if plan.tier:
        lines += tier_report(plan)
    lines.append(f"Predicted exchange per step per device: {fmt_bytes(exchange_bytes_per_step(plan))}")
    return "\n".join(lines)


def exchange_report(plan: EmbeddingPlan) -> list[str]:
    """One line per exchange part: its form, the tables it serves and its buffers' sizes."""
    lines = []
    for part in exchange_parts(plan):
        names = _table_list(plan, sorted({vt.table for vt in part.group.vtables}))
        where, how = part_kind(part).describe(plan, part)
        lines.append(f"Exchange {part.kind} ({where}): {names}; {how}")
    return lines


def _table_list(plan: EmbeddingPlan, tables: list[int]) -> str:
    names = [plan.tables[t].spec.name for t in tables]
    return ", ".join(names) if len(names) <= 6 else f"{', '.join(names[:5])} and {len(names) - 5} more"


def tier_report(plan: EmbeddingPlan) -> list[str]:
    """Per tiered table: its bytes in the disk tier, DRAM cache and each owner's device cache,
    the device-cache hit rate predicted from the first batches, and the share of device misses
    the DRAM cache is predicted to serve (``embedding/tiers/setup.py``)."""
    tier, dim = plan.tier, plan.tables[0].spec.dim
    row = DTYPE_BYTES[plan.dtype] * dim + optimizer_bytes_per_row(plan.optimizer, dim)
    lines = [
        f"Tiered tables (DRAM cache {tier.policy}, lookahead {tier.lookahead} batches, fill rows "
        + ", ".join(f"{g} {r}" for g, r in tier.fill_rows)
        + "):",
        f"{'table':<12}{'disk tier':>12}{'DRAM cache':>12}{'device cache':>14}{'per owner':>11}{'device hits':>13}"
        f"{'DRAM hits':>11}",
    ]
    for t in plan.tiered_tables:
        tp = plan.tables[t]
        hit = tier.device_hit_rates[t] if tier.device_hit_rates else 0.0
        host = tier.host_hit_rates[t] if tier.host_hit_rates else 0.0
        lines.append(
            f"{tp.spec.name:<12}{fmt_bytes(tp.spec.rows * row):>12}{fmt_bytes(tier.host_rows[t] * row):>12}"
            f"{fmt_bytes(tp.cache_rows * row):>14}{tp.cache_rows:>11,}{100 * hit:>12.1f}%{100 * host:>10.1f}%"
        )
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
    return [
        f"Hot rows: capacity {hot.rows:,} on every device ({fmt_bytes(params + state)} with optimizer "
        f"state), {chosen:,} chosen, {100 * hot.hit_rate:.1f}% of lookups in the statistics batches",
        f"  per step per device: all-to-all {fmt_bytes(with_hot['all-to-all'])} (without hot rows "
        f"{fmt_bytes(without['all-to-all'])}), all-reduce {fmt_bytes(with_hot['all-reduce'])}; total "
        f"{fmt_bytes(sum(with_hot.values()))} (without {fmt_bytes(sum(without.values()))})",
    ]


def _device_list(devices: tuple[int, ...]) -> str:
    text = ",".join(map(str, devices))
    if len(text) <= 16:
        return text
    if devices == tuple(range(devices[0], devices[0] + len(devices))):
        return f"{devices[0]}..{devices[-1]} ({len(devices)})"
    return f"{len(devices)} of {min(devices)}..{max(devices)}"


def fmt_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError
