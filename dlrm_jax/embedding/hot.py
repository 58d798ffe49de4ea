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

    def ranked(self) -> tuple[np.ndarray, np.ndarray]:
        """Every counted row, most frequent first (ties: smaller table, then smaller id), as
        (table int64 [n], id int64 [n])."""
        table = np.concatenate([np.full(c.size, t, np.int64) for t, c in enumerate(self.counts)] or [[]])
        weight = np.concatenate(self.counts or (np.zeros(0),))
        ids = np.concatenate(self.ids or (np.zeros(0, np.int64),))
        order = np.lexsort((ids, table, -weight))
        return table[order].astype(np.int64), ids[order].astype(np.int64)

    def top_rows(self, k: int) -> list[np.ndarray]:
        """The ``k`` most looked-up rows over all tables, as one array of ids per table (the
        first rows of :meth:`ranked`; a table's share is its :meth:`most_frequent` rows)."""
        table, ids = self.ranked()
        return [np.sort(ids[:k][table[:k] == t]) for t in range(self.num_tables)]

    def truncated(self, k: int) -> RowCounts:
        """Only the ``k`` most looked-up rows' counts: bounds the memory of running statistics."""
        keep = self.top_rows(k)
        masks = [np.isin(i, h) for i, h in zip(self.ids, keep, strict=True)]
        return RowCounts(tuple(i[m] for i, m in zip(self.ids, masks, strict=True)),
                         tuple(c[m] for c, m in zip(self.counts, masks, strict=True)))

    def to_json(self) -> dict:
        """Lists of ids and counts per table (floats round-trip exactly through JSON)."""
        return {"ids": [i.tolist() for i in self.ids], "counts": [c.tolist() for c in self.counts]}

    @classmethod
    def from_json(cls, raw: dict) -> RowCounts:
        return cls(tuple(np.asarray(i, np.int64) for i in raw["ids"]),
                   tuple(np.asarray(c, np.float64) for c in raw["counts"]))

    def most_frequent(self, table: int, k: int) -> np.ndarray:
        """The ``k`` most looked-up rows of ``table`` (fewer if fewer were seen), most frequent
        first; ties go to the smaller id, so the choice is deterministic."""
        ids, counts = self.ids[table], self.counts[table]
        order = np.lexsort((ids, -counts))[:max(k, 0)]
        return ids[order]

    def table_hit_rates(self, hot: Sequence[np.ndarray]) -> tuple[float, ...]:
        """Per table, the share of its counted lookups that fall on its hot rows."""
        return tuple(float(c[np.isin(i, h)].sum() / c.sum()) if c.sum() else 0.0
                     for i, c, h in zip(self.ids, self.counts, hot, strict=True))

    def hit_rate(self, hot: Sequence[np.ndarray]) -> float:
        """The share of counted lookups that fall on the given hot rows (one array per table)."""
        total = self.lookups()
        if total == 0:
            return 0.0
        hits = sum(c[np.isin(i, h)].sum() for i, c, h in zip(self.ids, self.counts, hot, strict=True))
        return float(hits / total)


class HotSchedule:
    """When training counts lookups and refreshes the hot set, and the counts it keeps.

    With ``refresh_every`` = R > 0, the ``window`` batches before every R-th step are counted
    into the running statistics; after step kR the hot set becomes the ``capacity`` most
    counted rows, and the counts are multiplied by ``decay`` (older traffic fades). The
    statistics are truncated to the ``keep`` most counted rows at each refresh, so they stay
    small enough to travel with every checkpoint (:meth:`to_json`), which a resumed run needs
    to choose the same rows. Host-side only: the caller runs the refresh program.
    """

    def __init__(self, capacity: int, bag_sizes: Sequence[int], counts: RowCounts, *, window: int,
                 refresh_every: int, decay: float):
        self.capacity, self.bag_sizes = capacity, tuple(bag_sizes)
        self.window, self.refresh_every, self.decay = window, refresh_every, decay
        self.keep = max(16 * capacity, 4096)
        self.counts = counts.truncated(self.keep)

    def counts_batch(self, step: int) -> bool:
        """Whether batch ``step`` (0-based: the one trained in step ``step + 1``) is counted."""
        r = self.refresh_every
        return bool(r) and step % r >= r - min(self.window, r)

    def add(self, ids: np.ndarray) -> None:
        """Count one global batch's ids (int [B, S], as in Batch)."""
        self.counts = self.counts.decayed(1.0, RowCounts.from_batches([ids], self.bag_sizes))

    def refresh_due(self, steps_done: int) -> bool:
        return bool(self.refresh_every) and steps_done % self.refresh_every == 0

    def current_rows(self) -> list[np.ndarray]:
        """Per table, the rows the statistics now rank hottest (at most ``capacity`` in all)."""
        return self.counts.top_rows(self.capacity)

    def refresh(self) -> list[np.ndarray]:
        """The next hot set (:meth:`current_rows`), then the counts decayed and truncated."""
        rows = self.current_rows()
        self.counts = self.counts.decayed(self.decay, RowCounts.empty(self.counts.num_tables)).truncated(self.keep)
        return rows

    def to_json(self) -> dict:
        return self.counts.to_json()

    def load_json(self, raw: dict) -> None:
        self.counts = RowCounts.from_json(raw)
