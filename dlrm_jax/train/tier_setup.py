"""Setting up tiered tables for a run: cache sizes, fill capacity and predicted hit rates.

The fill capacity (rows one program may fill per device and group) and the predicted hit
rates come from planning the first batches with empty caches, as the run itself will: the
busiest device's fills per batch after the first, times ``embedding.capacity_factor`` (the
first batches of a run, or of a resumed one, fill in extra rounds).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

from dlrm_jax.embedding.device_cache import TableCache, plan_stream
from dlrm_jax.embedding.layout import build_groups
from dlrm_jax.embedding.plan import EmbeddingPlan, Strategy, TierPlan
from dlrm_jax.embedding.planner import cache_slots

MIN_FILL_ROWS = 16
# A device cache holds at least this many times the most distinct rows one of the first
# batches needed on one owner: a later batch needing more than the cache cannot run.
CACHE_HEADROOM = 2


def fit_caches(plan: EmbeddingPlan, id_batches: list[np.ndarray], log=print) -> EmbeddingPlan:
    """Device caches that can work: each must hold the distinct rows one batch needs on its
    busiest owner (else that batch could not run; CACHE_HEADROOM times what the first batches
    needed); a cache grown to its whole part of the table gains nothing from the tier, so such
    a table stays on its devices. Both are logged."""
    slot_table = np.repeat(np.arange(len(plan.tables)), [tp.spec.bag_size for tp in plan.tables])
    tables = list(plan.tables)
    for t in plan.tiered_tables:
        tp, cache = plan.tables[t], TableCache(plan.tables[t], plan.num_devices)
        need = 0
        for ids in id_batches:
            rows = np.unique(ids[:, slot_table == t])
            rows = rows[rows >= 0]
            need = max(need, int(np.bincount(cache.space_of(rows), minlength=cache.num_spaces).max()) if rows.size else 0)
        owned = -(-tp.spec.rows // tp.spaces(plan.num_devices))  # rows of the table per cache space
        need = min(owned, CACHE_HEADROOM * need)  # later batches may need more than these did
        if need >= owned:
            log(f"table {tp.spec.name}: one batch needs {need:,} of the {owned:,} rows an owner holds; kept on the devices")
            tables[t] = dataclasses.replace(tp, cache_rows=0)
        elif need > tp.cache_rows:
            log(f"table {tp.spec.name}: device cache raised from {tp.cache_rows:,} to {need:,} rows per owner "
                f"(one batch needs {need // CACHE_HEADROOM:,}; twice that for later ones)")
            tables[t] = dataclasses.replace(tp, cache_rows=need)
    return dataclasses.replace(plan, tables=tuple(tables))


def tier_plan(cfg, plan: EmbeddingPlan, id_batches: list[np.ndarray], log=print) -> EmbeddingPlan:
    """``plan`` with its TierPlan: device caches fitted to the batches, DRAM cache rows, fill
    capacities and predicted device hit rates from planning ``id_batches`` (global ids [B, S])
    with empty caches."""
    tier, n = cfg.embedding.tier, plan.num_devices
    plan = fit_caches(plan, id_batches, log)
    if not plan.tiered_tables:
        return plan
    host_rows = tuple(cache_slots(tp.spec.rows, tier.host_cache_rows, tier.host_cache_fraction) if tp.tiered else 0
                      for tp in plan.tables)
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
                    count += np.bincount(f.space, minlength=n) if row_wise else np.eye(n, dtype=np.int64)[vt.device] * len(f)
            most[g.name] = max(most[g.name], int(count.max()))
        for t, f in fills.items():
            cols = slot_table == t
            filled[t] += len(f)
            wanted[t] += len(np.unique(ids[:, cols][ids[:, cols] >= 0]))
    tiered_groups = {g.name for g in groups for vt in g.vtables if plan.tables[vt.table].tiered}
    fill_rows = tuple((name, tier.fill_rows or max(MIN_FILL_ROWS, math.ceil(cfg.embedding.capacity_factor * most[name])))
                      for name in sorted(tiered_groups))
    hit = tuple(float(1 - filled[t] / wanted[t]) if plan.tables[t].tiered and wanted[t] else 0.0
                for t in range(len(plan.tables)))
    return dataclasses.replace(plan, tier=TierPlan(host_rows, tier.policy, tier.lookahead, fill_rows, hit, ()))


def tier_root(cfg, run_dir: Path | None) -> Path:
    """The disk tier's folder: embedding.tier.path, or RUN_DIR/tier."""
    if cfg.embedding.tier.path:
        return Path(cfg.embedding.tier.path)
    if run_dir is None:
        raise ValueError("embedding.storage=tiered needs a run dir (--run-dir) or embedding.tier.path")
    return Path(run_dir) / "tier"
