"""Which rows are hot: per-table lookup counts, gathered on the host and decayed as training goes.

The statistics behind hot-row replication (a small set of very frequent rows kept on every
device). Counts are sparse, only for rows actually seen, so their memory follows the distinct
ids of the sampled batches rather than the tables' sizes. Everything here is host-side numpy:
choosing hot rows is planning, not part of the traced step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from dlrm_jax.data.batch import PAD_ID


@dataclass(frozen=True)
class RowCounts:
    """Per table: the distinct row ids seen (sorted, int64) and how often each was looked up.

    Counts are float64 so that decayed counts (``decayed``) keep their fractions.
    """

    ids: tuple[np.ndarray, ...]
    counts: tuple[np.ndarray, ...]

    @classmethod
    def empty(cls, num_tables: int) -> RowCounts:
        return cls(tuple(np.zeros(0, np.int64) for _ in range(num_tables)),
                   tuple(np.zeros(0, np.float64) for _ in range(num_tables)))

    @classmethod
    def from_batches(cls, id_batches: Iterable[np.ndarray], bag_sizes: Sequence[int]) -> RowCounts:
        """Counts over ``id_batches`` (each int [B, sum(bag_sizes)], features one after another,
        PAD_ID for empty bag slots, as in :class:`~dlrm_jax.data.batch.Batch`)."""
        per_table: list[list[np.ndarray]] = [[] for _ in bag_sizes]
        starts = np.concatenate([[0], np.cumsum(bag_sizes)])
        for ids in id_batches:
            for t in range(len(bag_sizes)):
                block = np.asarray(ids[:, starts[t]:starts[t + 1]]).reshape(-1)
                per_table[t].append(block[block != PAD_ID].astype(np.int64))
        ids_out, counts_out = [], []
        for parts in per_table:
            seen = np.concatenate(parts) if parts else np.zeros(0, np.int64)
            uniq, counts = np.unique(seen, return_counts=True)
            ids_out.append(uniq)
            counts_out.append(counts.astype(np.float64))
        return cls(tuple(ids_out), tuple(counts_out))

    @property
    def num_tables(self) -> int:
        return len(self.ids)

    def lookups(self) -> float:
        """Total lookups counted (decayed counts included)."""
        return float(sum(c.sum() for c in self.counts))

    def decayed(self, factor: float, new: RowCounts) -> RowCounts:
        """``factor * self + new``, row by row: the running statistics a refresh keeps."""
        if not 0.0 <= factor <= 1.0:
            raise ValueError(f"decay factor must be in [0, 1], got {factor}")
        if new.num_tables != self.num_tables:
            raise ValueError(f"counts of {new.num_tables} tables cannot be merged into {self.num_tables}")
        ids_out, counts_out = [], []
        for old_ids, old_c, new_ids, new_c in zip(self.ids, self.counts, new.ids, new.counts, strict=True):
            ids = np.concatenate([old_ids, new_ids])
            weights = np.concatenate([old_c * factor, new_c])
            uniq, inverse = np.unique(ids, return_inverse=True)
            summed = np.zeros(uniq.size, np.float64)
            np.add.at(summed, inverse, weights)
            keep = summed > 0  # a factor of 0 forgets the old rows entirely
            ids_out.append(uniq[keep])
            counts_out.append(summed[keep])
        return RowCounts(tuple(ids_out), tuple(counts_out))

    def most_frequent(self, table: int, k: int) -> np.ndarray:
        """The ``k`` most looked-up rows of ``table`` (fewer if fewer were seen), most frequent
        first; ties go to the smaller id, so the choice is deterministic."""
        ids, counts = self.ids[table], self.counts[table]
        order = np.lexsort((ids, -counts))[:max(k, 0)]
        return ids[order]

    def hit_rate(self, hot: Sequence[np.ndarray]) -> float:
        """The share of counted lookups that fall on the given hot rows (one array per table)."""
        total = self.lookups()
        if total == 0:
            return 0.0
        hits = sum(c[np.isin(i, h)].sum() for i, c, h in zip(self.ids, self.counts, hot, strict=True))
        return float(hits / total)
