"""The hot-row performance model: how many of the most frequent rows to replicate everywhere.

Deduplication per owner already sends a row that several samples of a device need once, so
replicating a hot row saves no bytes by itself. What it saves is padded capacity: every
all-to-all bucket is as large as the busiest owner's distinct requests, and on skewed data the
busiest owner is the one holding the hot rows (a frequency-ordered vocabulary puts them at the
bottom of every table, so ``row_layout=block`` sends most requests to device 0). Replicated rows
leave the buckets; their gradients are summed over devices instead (an all-reduce of
``[H, D]``). The model prices each candidate set on sample batches with the engine's own
capacity measurement (the hot ids masked out, as they would never enter a bucket) and picks
the cheapest predicted communication time, no replication included as a candidate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dlrm_jax.data.batch import PAD_ID
from dlrm_jax.embedding.hot import RowCounts
from dlrm_jax.embedding.plan import DTYPE_BYTES, EmbeddingPlan, optimizer_bytes_per_row
from dlrm_jax.embedding.stats import exchange_bytes_per_step


@dataclass(frozen=True)
class HotCandidate:
    """One priced hot set. Bytes are what one device sends per step."""

    rows_per_table: tuple[int, ...]
    hit_rate: float
    capacities: tuple[tuple[str, int, int], ...]
    a2a_bytes: int
    allreduce_bytes: int
    memory_bytes: int  # per device: the hot rows and their optimizer state
    predicted_s: float

    @property
    def rows(self) -> int:
        return sum(self.rows_per_table)


def candidate_sizes(counts: RowCounts, max_rows: int) -> list[tuple[int, ...]]:
    """Hot sets to price: the globally most frequent rows, 0, 64, 128, ... rows in all (doubling,
    up to ``max_rows`` and to the rows seen), split per table as the global ranking falls."""
    table = np.concatenate([np.full(c.size, t) for t, c in enumerate(counts.counts)] or [np.zeros(0, int)])
    weight = np.concatenate(counts.counts or (np.zeros(0),))
    ids = np.concatenate(counts.ids or (np.zeros(0, np.int64),))
    ranked = table[np.lexsort((ids, table, -weight))]
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
            block = out[:, starts[t]:starts[t + 1]]
            block[np.isin(block, rows)] = PAD_ID
    return out


def price(plan: EmbeddingPlan, measure_capacities, counts: RowCounts, id_batches: Sequence[np.ndarray],
          rows_per_table: Sequence[int], a2a_bytes_per_s: float, allreduce_bytes_per_s: float) -> HotCandidate:
    """Price one hot set (``rows_per_table`` most frequent rows of each table).

    ``measure_capacities(host id batches) -> capacities``: the engine's measurement (see
    ``EmbeddingCollection.measure_capacities``), so the model and the compiled step agree on
    what a bucket holds.
    """
    hot = [counts.most_frequent(t, k) for t, k in enumerate(rows_per_table)]
    bags = [t.spec.bag_size for t in plan.tables]
    capacities = measure_capacities([mask_hot(ids, hot, bags) for ids in id_batches])
    a2a = exchange_bytes_per_step(dataclasses.replace(plan, capacities=capacities))
    n = plan.num_devices
    hot_bytes = sum(h.size * t.spec.dim * 4 for h, t in zip(hot, plan.tables, strict=True))  # f32 gradients
    allreduce = 2 * (n - 1) * hot_bytes // n if n > 1 else 0  # ring all-reduce, bytes one device sends
    memory = sum(h.size * (t.spec.dim * DTYPE_BYTES[plan.dtype] + optimizer_bytes_per_row(plan.optimizer, t.spec.dim))
                 for h, t in zip(hot, plan.tables, strict=True))
    seconds = a2a / a2a_bytes_per_s + allreduce / allreduce_bytes_per_s
    return HotCandidate(tuple(int(h.size) for h in hot), counts.hit_rate(hot), capacities, a2a, allreduce,
                        memory, seconds)


def choose_hot_rows(plan: EmbeddingPlan, measure_capacities, counts: RowCounts, id_batches: Sequence[np.ndarray],
                    memory_bytes: int, a2a_bytes_per_s: float = 1.0, allreduce_bytes_per_s: float = 1.0,
                    max_rows: int | None = None) -> tuple[HotCandidate, list[HotCandidate]]:
    """The candidate with the least predicted communication time within ``memory_bytes`` per
    device (ties: fewer rows), and every candidate priced. The empty set is always a candidate,
    so the choice is never predicted worse than no replication."""
    widest = max(t.spec.dim * DTYPE_BYTES[plan.dtype] + optimizer_bytes_per_row(plan.optimizer, t.spec.dim)
                 for t in plan.tables)
    limit = memory_bytes // widest if max_rows is None else min(max_rows, memory_bytes // widest)
    priced = [price(plan, measure_capacities, counts, id_batches, k, a2a_bytes_per_s, allreduce_bytes_per_s)
              for k in candidate_sizes(counts, int(limit))]
    fits = [c for c in priced if c.memory_bytes <= memory_bytes]
    best = min(fits, key=lambda c: (c.predicted_s, c.rows))
    return best, priced
