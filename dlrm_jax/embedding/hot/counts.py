"""Which rows are hot: per-table lookup counts, gathered on the host and decayed as training goes.

The statistics behind hot-row replication (a small set of very frequent rows kept on every
device). Counts are sparse, only for rows actually seen, so their memory follows the distinct
ids of the sampled batches rather than the tables' sizes. Everything here is host-side numpy:
choosing hot rows is planning, not part of the traced step.

Cost, because training counts batches while it runs (``schedule``) (``dlrm-jax profile`` reports it): a batch
is counted per table with ``bincount`` when its ids are small numbers and a sort otherwise (not
a hash: numpy's sort of 65,536 ids beat pyarrow's ``value_counts`` 2x, BENCHMARKS.md); counts
are summed with a stable sort of concatenated sorted runs (timsort merges them in linear time)
and the top rows chosen by a count threshold, not by ranking every row.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from dlrm_jax.ids import PAD_ID


def sum_counts(ids: np.ndarray, weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(distinct ids sorted, as int64; the summed ``weights`` of each, float64, or how often it
    occurs when ``weights`` is None) of a 1-D id array: a ``bincount`` when the ids are small
    numbers, else a stable sort (linear on the concatenated sorted runs that merging gives)."""
    if ids.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.float64)
    top = int(ids.max())
    if int(ids.min()) >= 0 and top < 4 * ids.size + 4096:  # dense enough: one pass, no sort
        summed = np.bincount(ids, weights, minlength=top + 1)
        seen = np.flatnonzero(summed)
        return seen.astype(np.int64), summed[seen].astype(np.float64)
    if weights is None:
        ids = np.sort(ids)
    else:
        order = np.argsort(ids, kind="stable")
        ids, weights = ids[order], weights[order]
    starts = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]]))
    summed = np.diff(np.append(starts, ids.size)) if weights is None else np.add.reduceat(weights, starts)
    return ids[starts].astype(np.int64), summed.astype(np.float64)


@dataclass(frozen=True)
class RowCounts:
    """Per table: the distinct row ids seen (sorted, int64) and how often each was looked up.

    Counts are float64 so that decayed counts (``decayed``) keep their fractions; counts of
    whole batches are integers, exact in float64, so summing them in any order gives the same
    bits.
    """

    ids: tuple[np.ndarray, ...]
    counts: tuple[np.ndarray, ...]

    @classmethod
    def empty(cls, num_tables: int) -> RowCounts:
        return cls(
            tuple(np.zeros(0, np.int64) for _ in range(num_tables)),
            tuple(np.zeros(0, np.float64) for _ in range(num_tables)),
        )

    @classmethod
    def from_batches(cls, id_batches: Iterable[np.ndarray], bag_sizes: Sequence[int]) -> RowCounts:
        """Counts over ``id_batches`` (each int [B, sum(bag_sizes)], features one after another,
        PAD_ID for empty bag slots, as in :class:`~dlrm_jax.data.batch.Batch`)."""
        starts = np.concatenate([[0], np.cumsum(bag_sizes)])
        parts = [cls.empty(len(bag_sizes))]  # sums to no rows when there are no batches
        for ids in id_batches:
            ids = np.asarray(ids)
            per_table = []
            for t in range(len(bag_sizes)):
                block = ids[:, starts[t] : starts[t + 1]].reshape(-1)
                per_table.append(sum_counts(block[block != PAD_ID]))
            parts.append(cls(tuple(i for i, _ in per_table), tuple(c for _, c in per_table)))
        return cls.total(parts)

    @property
    def num_tables(self) -> int:
        return len(self.ids)

    def lookups(self) -> float:
        """Total lookups counted (decayed counts included)."""
        return float(sum(c.sum() for c in self.counts))

    @classmethod
    def total(cls, parts: Sequence[RowCounts]) -> RowCounts:
        """The row by row sum of ``parts`` (all with the same tables)."""
        if not parts:
            raise ValueError("no counts to sum")
        for p in parts:
            if p.num_tables != parts[0].num_tables:
                raise ValueError(f"counts of {p.num_tables} tables cannot be merged into {parts[0].num_tables}")
        nonempty = [p for p in parts if any(i.size for i in p.ids)]
        if len(nonempty) <= 1:
            return nonempty[0] if nonempty else parts[0]
        parts = nonempty
        summed = [
            sum_counts(np.concatenate([p.ids[t] for p in parts]), np.concatenate([p.counts[t] for p in parts]))
            for t in range(parts[0].num_tables)
        ]
        return RowCounts(tuple(i for i, _ in summed), tuple(c for _, c in summed))

    def without(self, tables) -> RowCounts:
        """These counts with ``tables`` (indices) counted as never looked up."""
        empty = RowCounts.empty(self.num_tables)
        pick = lambda t: empty if t in tables else self
        return RowCounts(
            tuple(pick(t).ids[t] for t in range(self.num_tables)),
            tuple(pick(t).counts[t] for t in range(self.num_tables)),
        )

    def plus(self, new: RowCounts) -> RowCounts:
        """``self + new``, row by row."""
        return RowCounts.total([self, new])

    def decayed(self, factor: float, new: RowCounts) -> RowCounts:
        """``factor * self + new``, row by row: the running statistics a refresh keeps."""
        if not 0.0 <= factor <= 1.0:
            raise ValueError(f"decay factor must be in [0, 1], got {factor}")
        old = RowCounts(self.ids, tuple(c * factor for c in self.counts))
        out = old.plus(new)
        keep = [c > 0 for c in out.counts]  # a factor of 0 forgets the old rows entirely
        return RowCounts(
            tuple(i[k] for i, k in zip(out.ids, keep, strict=True)),
            tuple(c[k] for c, k in zip(out.counts, keep, strict=True)),
        )

    def _flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(table, id, count) of every counted row, in (table, id) order."""
        table = np.concatenate(
            [np.full(c.size, t, np.int64) for t, c in enumerate(self.counts)] or [np.zeros(0, np.int64)]
        )
        return (
            table,
            np.concatenate(self.ids or (np.zeros(0, np.int64),)),
            np.concatenate(self.counts or (np.zeros(0),)),
        )

    @staticmethod
    def _chosen(weight: np.ndarray, k: int) -> np.ndarray:
        """Indices, ascending, of the ``k`` largest of ``weight``; of equal ones at the cut, the
        first (entries are in (table, id) order, so ties go to the smaller table, then id)."""
        k = max(0, min(k, weight.size))
        if k in (0, weight.size):
            return np.arange(k)
        threshold = np.sort(weight)[weight.size - k]  # np.partition crawls on many equal counts
        above = weight > threshold
        tied = np.flatnonzero(weight == threshold)[: k - int(above.sum())]
        above[tied] = True
        return np.flatnonzero(above)

    def _top(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(table, id, count) of the ``k`` most looked-up rows over all tables, most frequent
        first; ties go to the smaller table, then the smaller id."""
        table, ids, weight = self._flat()
        chosen = self._chosen(weight, k)
        table, ids, weight = table[chosen], ids[chosen], weight[chosen]
        order = np.lexsort((ids, table, -weight))
        return table[order], ids[order], weight[order]

    def ranked(self) -> tuple[np.ndarray, np.ndarray]:
        """Every counted row, most frequent first (ties: smaller table, then smaller id), as
        (table int64 [n], id int64 [n])."""
        table, ids, _ = self._top(sum(c.size for c in self.counts))
        return table, ids

    def top_rows(self, k: int) -> list[np.ndarray]:
        """The ``k`` most looked-up rows over all tables, as one array of ids per table (the
        first rows of :meth:`ranked`; a table's share is its :meth:`most_frequent` rows)."""
        table, ids, _ = self._top(k)
        return [np.sort(ids[table == t]) for t in range(self.num_tables)]

    def truncated(self, k: int) -> RowCounts:
        """Only the ``k`` most looked-up rows' counts: bounds the memory of running statistics."""
        if sum(c.size for c in self.counts) <= k:
            return self
        table, ids, weight = self._flat()
        chosen = self._chosen(weight, k)  # ascending: each table's rows stay sorted
        table, ids, weight = table[chosen], ids[chosen], weight[chosen]
        return RowCounts(
            tuple(ids[table == t] for t in range(self.num_tables)),
            tuple(weight[table == t] for t in range(self.num_tables)),
        )

    def to_json(self) -> dict:
        """Lists of ids and counts per table (floats round-trip exactly through JSON)."""
        return {"ids": [i.tolist() for i in self.ids], "counts": [c.tolist() for c in self.counts]}

    @classmethod
    def from_json(cls, raw: dict) -> RowCounts:
        return cls(
            tuple(np.asarray(i, np.int64) for i in raw["ids"]), tuple(np.asarray(c, np.float64) for c in raw["counts"])
        )

    def most_frequent(self, table: int, k: int) -> np.ndarray:
        """The ``k`` most looked-up rows of ``table`` (fewer if fewer were seen), most frequent
        first; ties go to the smaller id, so the choice is deterministic."""
        ids, counts = self.ids[table], self.counts[table]
        order = np.lexsort((ids, -counts))[: max(k, 0)]
        return ids[order]

    def table_hit_rates(self, hot: Sequence[np.ndarray]) -> tuple[float, ...]:
        """Per table, the share of its counted lookups that fall on its hot rows."""
        return tuple(
            float(c[np.isin(i, h)].sum() / c.sum()) if c.sum() else 0.0
            for i, c, h in zip(self.ids, self.counts, hot, strict=True)
        )

    def hit_rate(self, hot: Sequence[np.ndarray]) -> float:
        """The share of counted lookups that fall on the given hot rows (one array per table)."""
        total = self.lookups()
        if total == 0:
            return 0.0
        hits = sum(c[np.isin(i, h)].sum() for i, c, h in zip(self.ids, self.counts, hot, strict=True))
        return float(hits / total)
