"""Setting up tiered tables for a run: cache sizes, fill capacity and predicted hit rates.

The fill capacity (rows one program may fill per device and group) and the predicted hit
rates come from planning the first batches with empty caches, as the run itself will: the
busiest device's fills per batch after the first, times ``embedding.capacity_factor`` (the
first batches of a run, or of a resumed one, fill in extra rounds).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from dlrm_jax.config_schema import TierConfig
from dlrm_jax.embedding.dynamic.idmap import MapSpec, home_rows
from dlrm_jax.embedding.plan.embedding_plan import (
    DTYPE_BYTES,
    EmbeddingPlan,
    Strategy,
    TierPlan,
    optimizer_bytes_per_row,
)
from dlrm_jax.embedding.plan.layout import build_groups
from dlrm_jax.embedding.plan.planner import cache_slots
from dlrm_jax.embedding.plan.stats import fmt_bytes
from dlrm_jax.embedding.tiers.cache_planner import TableCache, plan_stream
from dlrm_jax.hostmem import available_bytes
from dlrm_jax.ids import PAD_ID

MIN_FILL_ROWS = 16
HOST_CACHE_SHARE = 0.5  # of the memory available when planning, for the DRAM caches together
DEFAULT_HOST_FRACTION = 0.25  # where the memory available is unknown
# A device cache holds at least this many times the most distinct rows one of the first
# batches needed on one owner: a later batch needing more than the cache cannot run.
CACHE_HEADROOM = 2


def _dynamic_need(cache: TableCache, spec: MapSpec, raw_blocks: list[np.ndarray]) -> int:
    """The most rows one batch needs on one owner of a dynamic table: one for each distinct raw
    id whose shard is there (ids never share a row, and probe within their shard), and the
    shared row of each of their shards (ids not yet admitted or without a row, and the rows new
    ids start from). Home rows alone undercount: two ids with one home take two rows."""
    need = 0
    for block in raw_blocks:
        homes = home_rows(spec, np.unique(block[block != PAD_ID])).astype(np.int64)
        shared = np.unique(homes // spec.slots) * spec.slots
        rows = np.concatenate([cache.space_of(homes), cache.space_of(shared)])
        need = max(need, int(np.bincount(rows, minlength=cache.num_spaces).max(initial=0)))
    return need


def fit_caches(
    plan: EmbeddingPlan,
    id_batches: list[np.ndarray],
    log=print,
    dynamic: DynamicIds | None = None,
    saved: SavedTiers | None = None,
) -> EmbeddingPlan:
    """Device caches that can work: each must hold the distinct rows one batch needs on its
    busiest owner (else that batch could not run; CACHE_HEADROOM times what the first batches
    needed); a cache grown to its whole part of the table gains nothing from the tier, so such
    a table stays on its devices. A checkpoint being resumed (``saved``; None: none is) keeps
    each table where it has it, as an owner's part differs on another device count: one it
    keeps in the tier stays there, its cache holding a whole part if need be; one its run asked
    to tier and the planner kept on the devices stays there. All are logged. (A table the
    config moves is left as asked: the restore refuses it.) ``dynamic``: the dynamic tables'
    maps and the batches' raw ids, which size their caches (``id_batches`` holds their home
    rows)."""
    slot_table = np.repeat(np.arange(len(plan.tables)), [tp.spec.bag_size for tp in plan.tables])
    tables = list(plan.tables)
    for t in plan.tiered_tables:
        tp, cache = plan.tables[t], TableCache(plan.tables[t], plan.num_devices)
        if saved is not None and t not in saved.tiered and t in saved.asked:
            log(f"table {tp.spec.name}: kept on the devices, as the checkpoint being restored has it")
            tables[t] = dataclasses.replace(tp, cache_rows=0)
            continue
        if dynamic is not None and t in dynamic.maps:
            need = _dynamic_need(cache, dynamic.maps[t], [ids[:, slot_table == t] for ids in dynamic.raw_batches])
        else:
            need = 0
            for ids in id_batches:
                rows = np.unique(ids[:, slot_table == t])
                rows = rows[rows >= 0]
                need = max(
                    need, int(np.bincount(cache.space_of(rows), minlength=cache.num_spaces).max()) if rows.size else 0
                )
        owned = -(-tp.spec.rows // tp.spaces(plan.num_devices))  # rows of the table per cache space
        need = min(owned, CACHE_HEADROOM * need)  # later batches may need more than these did
        if need >= owned and saved is not None and t in saved.tiered:
            log(
                f"table {tp.spec.name}: one batch needs {need:,} of the {owned:,} rows an owner holds; kept in the "
                f"disk tier as the checkpoint has it, its device cache holding all {owned:,}"
            )
            tables[t] = dataclasses.replace(tp, cache_rows=owned)
        elif need >= owned:
            log(
                f"table {tp.spec.name}: one batch needs {need:,} of the {owned:,} rows an owner holds; kept on the devices"
            )
            tables[t] = dataclasses.replace(tp, cache_rows=0)
        elif need > tp.cache_rows:
            log(
                f"table {tp.spec.name}: device cache raised from {tp.cache_rows:,} to {need:,} rows per owner "
                f"(one batch needs {need // CACHE_HEADROOM:,}; twice that for later ones)"
            )
            tables[t] = dataclasses.replace(tp, cache_rows=need)
    return dataclasses.replace(plan, tables=tuple(tables))


class SavedTiers(NamedTuple):
    """Where a checkpoint being restored keeps its tables: ``tiered``, those in the disk tier;
    ``asked``, those its run asked to tier (the rest of them the planner kept on the devices)."""

    tiered: frozenset[int]
    asked: frozenset[int]


class DynamicIds(NamedTuple):
    """Tiered dynamic tables' id maps ({table: MapSpec}) and the first batches' raw ids."""

    maps: dict
    raw_batches: list


def tier_plan(
    tier: TierConfig,
    plan: EmbeddingPlan,
    id_batches: list[np.ndarray],
    log=print,
    dynamic: DynamicIds | None = None,
    saved: SavedTiers | None = None,
) -> EmbeddingPlan:
    """``plan`` with its TierPlan (the ``embedding.tier`` section ``tier``): device caches fitted
    to the batches (``saved``: :func:`fit_caches`'), DRAM cache rows, fill capacities (the plan's
    ``capacity_factor`` times the most one batch filled) and predicted device hit rates from
    planning ``id_batches`` (global ids [B, S]) with empty caches."""
    n = plan.num_devices
    plan = fit_caches(plan, id_batches, log, dynamic, saved)
    if not plan.tiered_tables:
        return plan
    # (host_cache_rows sizes every cache itself: no fraction, and no line saying one)
    fraction = tier.host_cache_fraction or (
        0.0 if tier.host_cache_rows else host_cache_fraction_from_memory(plan, available_bytes(), log)
    )
    host_rows = tuple(
        cache_slots(tp.spec.rows, tier.host_cache_rows, fraction) if tp.tiered else 0 for tp in plan.tables
    )
    caches = {t: TableCache(plan.tables[t], n) for t in plan.tiered_tables}
    slot_table = np.repeat(np.arange(len(plan.tables)), [tp.spec.bag_size for tp in plan.tables])
    groups = build_groups(plan.device_view())
    most = {g.name: 0 for g in groups}
    filled = np.zeros(len(plan.tables))
    wanted = np.zeros(len(plan.tables))
    for i, (ids, _, fills) in enumerate(plan_stream(caches, slot_table, id_batches, tier.lookahead)):
        if i == 0:
            continue  # every row is a miss in the first batch
        for g in groups:
            count = np.zeros(n, np.int64)
            for vt in g.vtables:
                f = fills.get(vt.table)
                if f is not None:
                    row_wise = plan.tables[vt.table].strategy == Strategy.ROW
                    count += (
                        np.bincount(f.space, minlength=n) if row_wise else np.eye(n, dtype=np.int64)[vt.device] * len(f)
                    )
            most[g.name] = max(most[g.name], int(count.max()))
        for t, f in fills.items():
            cols = slot_table == t
            filled[t] += len(f)
            wanted[t] += len(np.unique(ids[:, cols][ids[:, cols] >= 0]))
    tiered_groups = {g.name for g in groups for vt in g.vtables if plan.tables[vt.table].tiered}
    fill_rows = tuple(
        (name, tier.fill_rows or max(MIN_FILL_ROWS, math.ceil(plan.capacity_factor * most[name])))
        for name in sorted(tiered_groups)
    )
    hit = tuple(
        float(1 - filled[t] / wanted[t]) if plan.tables[t].tiered and wanted[t] else 0.0
        for t in range(len(plan.tables))
    )
    host_hit = tuple(
        _host_hit_rate(plan, t, host_rows[t], _ids_of(id_batches, slot_table, t)) if plan.tables[t].tiered else 0.0
        for t in range(len(plan.tables))
    )
    return dataclasses.replace(plan, tier=TierPlan(host_rows, tier.policy, tier.lookahead, fill_rows, hit, host_hit))


def host_cache_fraction_from_memory(plan: EmbeddingPlan, available: int | None, log=print) -> float:
    """The DRAM caches' share of each tiered table's rows when the config leaves it to the
    machine (``host_cache_fraction=0``): together they take at most HOST_CACHE_SHARE of the
    memory available now, the rest left to the page cache (the disk tier reads through it),
    the runtime and, on simulated devices, the devices' memory. All rows when that fits."""
    dim = plan.tables[0].spec.dim
    row = DTYPE_BYTES[plan.dtype] * dim + optimizer_bytes_per_row(plan.optimizer, dim)
    total = sum(plan.tables[t].spec.rows for t in plan.tiered_tables) * row
    if available is None:
        log(f"DRAM caches: {DEFAULT_HOST_FRACTION:.0%} of the tiered rows (the memory available is unknown)")
        return DEFAULT_HOST_FRACTION
    fraction = min(1.0, HOST_CACHE_SHARE * available / max(total, 1))
    log(
        f"DRAM caches: {fraction:.1%} of the tiered rows, {fmt_bytes(int(fraction * total))} "
        f"({HOST_CACHE_SHARE:.0%} of the {fmt_bytes(available)} available; embedding.tier.host_cache_fraction sets it)"
    )
    return fraction


def _ids_of(id_batches: list[np.ndarray], slot_table: np.ndarray, t: int) -> np.ndarray:
    ids = np.concatenate([b[:, slot_table == t].ravel() for b in id_batches])
    return ids[ids >= 0]


def _host_hit_rate(plan: EmbeddingPlan, t: int, host_rows: int, ids: np.ndarray) -> float:
    """The predicted share of device-cache misses the DRAM cache serves. Both caches are taken
    as LRU over independent lookups (Che's approximation) with row frequencies from ``ids``;
    the DRAM cache holds what the devices recently evicted or read, so together they act as
    one cache of both sizes: host hits = (H(device + DRAM) - H(device)) / (1 - H(device))."""
    tp = plan.tables[t]
    p = _row_probabilities(ids, tp.spec.rows)
    device = che_hit_rate(p, tp.cache_rows * tp.spaces(plan.num_devices))
    both = che_hit_rate(p, tp.cache_rows * tp.spaces(plan.num_devices) + host_rows)
    return float((both - device) / (1 - device)) if device < 1 else 0.0


def _row_probabilities(ids: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(probabilities, how many rows have each): seen rows by their counts; the rows never
    seen share the Good-Turing estimate of unseen mass (the share of rows seen once)."""
    if not ids.size:
        return np.array([1.0 / rows]), np.array([rows], np.float64)
    _, counts = np.unique(ids, return_counts=True)
    n = counts.sum()
    unseen_rows = rows - counts.size
    unseen = (counts == 1).sum() / n if unseen_rows else 0.0
    probs = np.append(counts / n * (1 - unseen), unseen / max(unseen_rows, 1))
    return probs, np.append(np.ones(counts.size), unseen_rows).astype(np.float64)


def che_hit_rate(dist: tuple[np.ndarray, np.ndarray], capacity: int) -> float:
    """LRU hit rate of a cache of ``capacity`` rows under independent lookups with row
    probabilities ``dist`` = (p, multiplicity): Che's approximation, hit = sum p (1 - e^(-pT))
    with T such that sum (1 - e^(-pT)) = capacity."""
    p, mult = dist
    if capacity >= mult[p > 0].sum():
        return 1.0
    if capacity <= 0:
        return 0.0
    lo, hi = 0.0, 1.0
    while (mult * -np.expm1(-p * hi)).sum() < capacity:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if (mult * -np.expm1(-p * mid)).sum() < capacity else (lo, mid)
    return float((mult * p * -np.expm1(-p * hi)).sum())
