"""The hot-row performance model: how many of the most frequent rows to replicate everywhere.

Deduplication per owner already sends a row that several samples of a device need once, so
replicating a hot row saves no bytes by itself. What it saves is padded capacity: every
all-to-all bucket is as large as the busiest owner's distinct requests, and on skewed data the
busiest owner is the one holding the hot rows (a frequency-ordered vocabulary puts them at the
bottom of every table, so ``row_layout=block`` sends most requests to device 0). Replicated rows
leave the buckets; their gradients are summed over devices instead (an all-reduce of
``[H, D]``). The model prices each candidate set on sample batches with the engine's own
capacity measurement (the hot ids masked out, as they would never enter a bucket) by the
planner's step-time model (``plan.cost``: both collectives over the cluster's links, the hot
rows' update) and picks the shortest predicted step, no replication included as a candidate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dlrm_jax.embedding.hot.counts import RowCounts
from dlrm_jax.embedding.plan.cost import PROFILES, Cluster, predict_step
from dlrm_jax.embedding.plan.embedding_plan import (
    DTYPE_BYTES,
    EmbeddingPlan,
    HotPlan,
    optimizer_bytes_per_row,
)
from dlrm_jax.embedding.plan.stats import collective_bytes
from dlrm_jax.ids import PAD_ID


@dataclass(frozen=True)
class HotCandidate:
    """One priced hot set. Bytes are what one device sends per step."""

    rows_per_table: tuple[int, ...]
    hit_rate: float
    capacities: tuple[tuple[str, int, int], ...]
    a2a_bytes: int
    allreduce_bytes: int
    memory_bytes: int  # per device: the hot rows and their optimizer state
    predicted_s: float  # the embedding part of the predicted step (plan.cost.predict_step)

    @property
    def rows(self) -> int:
        return sum(self.rows_per_table)


def candidate_sizes(counts: RowCounts, max_rows: int) -> list[tuple[int, ...]]:
    """Hot sets to price: the globally most frequent rows, 0, 64, 128, ... rows in all (doubling,
    up to ``max_rows`` and to the rows seen), split per table as the global ranking falls."""
    ranked, _ = counts.ranked()
    limit = min(max_rows, ranked.size)
    sizes, h = [0], 64
    while h < limit:
        sizes.append(h)
        h *= 2
    if limit > 0:
        sizes.append(limit)
    return [tuple(np.bincount(ranked[:h], minlength=counts.num_tables).tolist()) for h in sizes]


def mask_hot(ids: np.ndarray, hot: Sequence[np.ndarray], bag_sizes: Sequence[int]) -> np.ndarray:
    """The batch's ids with every hot id replaced by PAD_ID: what the exchange still carries."""
    out = np.array(ids, copy=True)
    starts = np.concatenate([[0], np.cumsum(bag_sizes)])
    for t, rows in enumerate(hot):
        if rows.size:
            block = out[:, starts[t] : starts[t + 1]]
            block[np.isin(block, rows)] = PAD_ID
    return out


def hot_plan(
    plan: EmbeddingPlan,
    hot: Sequence[np.ndarray],
    capacities,
    no_hot_capacities,
    counts: RowCounts,
    capacity: int | None = None,
) -> EmbeddingPlan:
    """``plan`` with these hot rows (capacity: their number unless given), the bucket
    capacities measured with them masked and without them, and their hit rates in ``counts``."""
    per_table = tuple(int(h.size) for h in hot)
    rows = sum(per_table) if capacity is None else capacity
    if rows == 0:
        return dataclasses.replace(plan, capacities=capacities, hot=None)
    return dataclasses.replace(
        plan,
        capacities=capacities,
        hot=HotPlan(rows, per_table, counts.hit_rate(hot), tuple(no_hot_capacities), counts.table_hit_rates(hot)),
    )


def price(
    plan: EmbeddingPlan,
    measure_capacities,
    counts: RowCounts,
    id_batches: Sequence[np.ndarray],
    rows_per_table: Sequence[int],
    cluster: Cluster,
) -> HotCandidate:
    """Price one hot set (``rows_per_table`` most frequent rows of each table); ``plan`` has
    the capacities measured without hot rows.

    ``measure_capacities(host id batches) -> capacities``: the engine's measurement (see
    ``EmbeddingCollection.measure_capacities``), so the model and the compiled step agree on
    what a bucket holds. Time: the embedding part of ``plan.cost.predict_step`` on ``cluster``.
    """
    hot = [counts.most_frequent(t, k) for t, k in enumerate(rows_per_table)]
    bags = [t.spec.bag_size for t in plan.tables]
    capacities = (
        measure_capacities([mask_hot(ids, hot, bags) for ids in id_batches]) if any(rows_per_table) else plan.capacities
    )
    candidate = hot_plan(plan, hot, capacities, plan.capacities, counts)
    sent = collective_bytes(candidate)
    a2a = sent["all-to-all"] + sent["all-gather"]
    params, state = candidate.hot_bytes_per_device()
    return HotCandidate(
        tuple(int(h.size) for h in hot),
        counts.hit_rate(hot),
        capacities,
        a2a,
        sent["all-reduce"],
        params + state,
        predict_step(candidate, cluster).embedding_s,
    )


def choose_hot_rows(
    plan: EmbeddingPlan,
    measure_capacities,
    counts: RowCounts,
    id_batches: Sequence[np.ndarray],
    memory_bytes: int,
    cluster: Cluster = PROFILES["cpu"],
    max_rows: int | None = None,
) -> tuple[HotCandidate, list[HotCandidate]]:
    """The candidate with the least predicted communication time within ``memory_bytes`` per
    device (ties: fewer rows), and every candidate priced. The empty set is always a candidate,
    so the choice is never predicted worse than no replication. Every candidate's buckets are
    measured on ``id_batches`` (host, global batches), the empty set's too."""
    per_row = plan.tables[0].spec.dim * DTYPE_BYTES[plan.dtype] + optimizer_bytes_per_row(
        plan.optimizer, plan.tables[0].spec.dim
    )
    limit = memory_bytes // per_row if max_rows is None else min(max_rows, memory_bytes // per_row)
    plan = dataclasses.replace(plan, capacities=measure_capacities(list(id_batches)), hot=None)
    priced = [
        price(plan, measure_capacities, counts, id_batches, k, cluster) for k in candidate_sizes(counts, int(limit))
    ]
    fits = [c for c in priced if c.memory_bytes <= memory_bytes]
    best = min(fits, key=lambda c: (c.predicted_s, c.rows))
    return best, priced
