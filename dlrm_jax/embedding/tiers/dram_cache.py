"""The host DRAM cache of one tiered table, in front of its disk tier.

Rows (values and optimizer state, every field of the tier) live in preallocated numpy arrays
of ``capacity`` slots; a direct-mapped index (int32 per table row, 4 bytes against the row's
hundreds in the tier) finds them without per-row Python. Rows that miss are taken from, in
order: the write-behind queue (evicted, not on the disk yet), rows the read-ahead thread
staged for this step (when no later write made them stale), and last the tier itself in one
batched call (a wait on the disk, counted); all are kept. Rows written back from the devices
are kept dirty and reach the tier when evicted (queued to the write-behind thread when there
is one) or flushed (a checkpoint flushes). Eviction takes the slots with the lowest score: the last use for ``lru``
and ``tinylfu``, the number of uses (last use breaking ties) for ``lfu``; one ``argpartition``
per batch of misses; a full cache evicts an eighth of its rows at once, so that selection is
paid once per many steps.

``tinylfu`` adds frequency admission (Einziger, Friedman and Manes, *TinyLFU: A Highly
Efficient Cache Admission Policy*): a row that misses enters the cache only once a sketch of
recent requests has seen it ``ADMIT_AFTER`` times, so rows asked for once do not push out rows
asked for often. Rows not admitted are served and, when dirty, written straight to the tier.

Only the thread that dispatches the steps calls it (the planner thread only peeks at
``slot_of`` to guess which rows to read ahead).
"""

from __future__ import annotations

import time

import numpy as np

from dlrm_jax.choices import DramPolicy
from dlrm_jax.embedding.tiers.format import numpy_dtype
from dlrm_jax.embedding.tiers.store import TierStore
from dlrm_jax.embedding.tiers.tier_io import Staged, WriteBehind

EVICT_FRACTION = 8  # a full cache frees capacity // EVICT_FRACTION slots at a time
ADMIT_AFTER = 2  # tinylfu: requests a missed row needs in the sketch's memory to be admitted


class FrequencySketch:
    """Approximate recent request counts of rows in O(capacity) memory: a count-min sketch of
    two rows of saturating 8-bit counters, all halved after every ``10 x capacity`` requests so
    that old popularity fades (TinyLFU's reset). Counts never fall below the truth within a
    period; hash collisions only raise them."""

    def __init__(self, capacity: int):
        width = 1 << int(np.clip(np.ceil(np.log2(2 * max(capacity, 1))), 10, 28))
        self.mask = np.uint64(width - 1)
        self.counts = np.zeros((2, width), np.uint8)
        self.period, self.seen = 10 * max(capacity, 1), 0

    def _index(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        h = rows.astype(np.uint64)  # two multiplicative hashes (wrapping uint64 products)
        return (
            ((h * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(29)) & self.mask,
            ((h * np.uint64(0xC2B2AE3D27D4EB4F)) >> np.uint64(31)) & self.mask,
        )

    def add(self, rows: np.ndarray) -> None:
        """Count one request of each of distinct ``rows``."""
        for counts, at in zip(self.counts, self._index(rows), strict=True):
            counts[at] = np.minimum(counts[at], 254) + 1
        self.seen += len(rows)
        if self.seen >= self.period:
            self.counts >>= 1
            self.seen = 0

    def estimate(self, rows: np.ndarray) -> np.ndarray:
        a, b = self._index(rows)
        return np.minimum(self.counts[0][a], self.counts[1][b])


class HostCache:
    """DRAM cache of ``table``'s rows; ``policy`` is ``lru`` or ``lfu``; ``writer``: where
    evicted dirty rows go (written at once when None)."""

    def __init__(
        self, store: TierStore, table: str, capacity: int, policy: str = "lru", writer: WriteBehind | None = None
    ):
        if policy not in tuple(DramPolicy):
            raise ValueError(f"embedding.tier.policy: {policy!r} must be one of {', '.join(DramPolicy)}")
        self.store, self.table, self.capacity, self.policy = store, table, max(1, capacity), policy
        self.writer = writer
        fields = store.fields(table)
        self.data = {k: np.zeros((self.capacity, *shape), numpy_dtype(dtype)) for k, (shape, dtype) in fields.items()}
        self.row_of = np.full(self.capacity, -1, np.int64)
        self.dirty = np.zeros(self.capacity, bool)
        self.last_use = np.full(self.capacity, -1, np.int64)
        self.uses = np.zeros(self.capacity, np.int64)
        self.slot_of = np.full(store.rows(table), -1, np.int32)
        self.sketch = FrequencySketch(self.capacity) if policy == "tinylfu" else None
        self.not_admitted = 0  # misses served without entering the cache (tinylfu)
        # Read-ahead protection: the last planned batch that expects each slot's row here (the
        # planner thread writes it when it skips reading a row DRAM holds), and the first batch
        # not run yet (the dispatching thread's). Slots a batch not run yet expects are evicted
        # last: the planner skipped their reads, so evicting them means a read at the step.
        self.needed_by = np.full(self.capacity, -1, np.int64)
        self.next_batch = 0
        self.free = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)  # taken from the end
        self.tick = 0
        self.hits = self.misses = self.tier_rows_read = self.tier_rows_written = 0
        self.rows_read_ahead = self.rows_from_queue = 0  # misses served without waiting on the disk
        self.read_wait_s = 0.0  # time waiting on the tier's reads for the rest

    def _lookup(self, rows: np.ndarray) -> np.ndarray:
        return self.slot_of[rows].astype(np.int64)

    def _touch(self, slots: np.ndarray) -> None:
        self.tick += 1
        self.last_use[slots] = self.tick
        self.uses[slots] += 1

    def get(self, rows: np.ndarray, staged: Staged | None = None) -> dict[str, np.ndarray]:
        """Every field of distinct ``rows`` (int64 [n]): copies, from DRAM or the tier
        (``staged``: rows read ahead for this call)."""
        slots = self._lookup(rows)
        hit = slots >= 0
        out = {k: np.empty((len(rows), *v.shape[1:]), v.dtype) for k, v in self.data.items()}
        for k, v in self.data.items():
            out[k][hit] = v[slots[hit]]
        self._touch(slots[hit])
        self.hits += int(hit.sum())
        if self.sketch is not None:
            self.sketch.add(rows)
        if not hit.all():
            missed = rows[~hit]
            read = self._from_tier(missed, staged)
            self.misses += len(missed)
            for k in out:
                out[k][~hit] = read[k]
            admit = self._admitted(missed)
            self._insert(missed[admit], {k: v[admit] for k, v in read.items()}, dirty=False, keep=slots[hit])
        return out

    def _admitted(self, rows: np.ndarray) -> np.ndarray:
        """Which of ``rows`` (not cached) may enter the cache: all, but with ``tinylfu`` only
        those the sketch saw often enough."""
        if self.sketch is None:
            return np.ones(len(rows), bool)
        admit = self.sketch.estimate(rows) >= ADMIT_AFTER
        self.not_admitted += int((~admit).sum())
        return admit

    def _from_tier(self, rows: np.ndarray, staged: Staged | None) -> dict[str, np.ndarray]:
        """Fields of rows DRAM does not hold: queued writes first (the newest copies), then rows
        read ahead that no later write made stale, then the disk."""
        out = {k: np.empty((len(rows), *v.shape[1:]), v.dtype) for k, v in self.data.items()}
        todo = np.ones(len(rows), bool)
        for source in (self.writer, staged):
            if source is None or not todo.any():
                continue
            at = np.flatnonzero(todo)
            if source is self.writer:
                have, got = self.writer.pending(self.table, rows[at])
                self.rows_from_queue += int(have.sum())
            else:
                have, got = staged.take(self.store, self.table, rows[at])
                self.rows_read_ahead += int(have.sum())
            for k, v in got.items():
                out[k][at[have]] = v
            todo[at[have]] = False
        if todo.any():
            t0 = time.perf_counter()
            read = self.store.read(self.table, rows[todo])
            self.read_wait_s += time.perf_counter() - t0
            self.tier_rows_read += int(todo.sum())
            for k, v in read.items():
                out[k][todo] = v
        return out

    def put(self, rows: np.ndarray, values: dict[str, np.ndarray]) -> None:
        """Newer contents of distinct ``rows`` (from a device cache): kept dirty."""
        slots = self._lookup(rows)
        hit = slots >= 0
        for k, v in self.data.items():
            v[slots[hit]] = values[k][hit]
        self.dirty[slots[hit]] = True
        self._touch(slots[hit])
        if not hit.all():
            missed = ~hit
            admit = missed.copy()
            admit[missed] = self._admitted(rows[missed])
            self._insert(rows[admit], {k: v[admit] for k, v in values.items()}, dirty=True, keep=slots[hit])
            rest = missed & ~admit  # newer than the tier and not kept here: written through
            if rest.any():
                self._write(rows[rest], {k: v[rest] for k, v in values.items()})

    def _insert(self, rows: np.ndarray, values: dict[str, np.ndarray], dirty: bool, keep: np.ndarray) -> None:
        """Keep rows not cached yet; a batch larger than the cache keeps its last rows and
        writes the rest straight through (when dirty)."""
        if not len(rows):
            return
        if len(rows) > self.capacity:
            if dirty:
                self._write(rows[: -self.capacity], {k: v[: -self.capacity] for k, v in values.items()})
            rows, values = rows[-self.capacity :], {k: v[-self.capacity :] for k, v in values.items()}
            keep = keep[:0]
        slots = self._take_free(len(rows), keep)
        for k, v in self.data.items():
            v[slots] = values[k]
        self.row_of[slots] = rows
        self.dirty[slots] = dirty
        self.uses[slots] = 0
        self._touch(slots)
        self.slot_of[rows] = slots

    def expect(self, rows: np.ndarray, batch: int) -> np.ndarray:
        """(Planner thread.) Which of ``rows`` DRAM holds now; those are marked as expected by
        planned ``batch`` (evicted last until it runs), so the planner need not read them ahead.
        A peek: a row evicted between the look and the mark is read at its step."""
        slots = self.slot_of[rows]
        held = slots >= 0
        self.needed_by[slots[held]] = batch
        return held

    def _take_free(self, n: int, keep: np.ndarray) -> np.ndarray:
        """``n`` free slots. When too few are free, the lowest-scored eighth of the cache (or
        what ``n`` needs) is evicted at once: one O(capacity) selection serves many calls."""
        if len(self.free) < n:
            self._evict(max(n - len(self.free), self.capacity // EVICT_FRACTION), keep)
        if len(self.free) < n:  # rows later batches expect, then this call's own hits
            self._evict(n - len(self.free), keep, expected=True)
        if len(self.free) < n:  # this call's own hits fill the rest: they were copied already
            self._evict(n - len(self.free), keep[:0], expected=True)
        slots, self.free = self.free[-n:], self.free[:-n]
        return slots

    def _evict(self, n: int, keep: np.ndarray, expected: bool = False) -> None:
        """Evict the ``n`` cached rows with the lowest scores (not ``keep``, and unless
        ``expected``, not rows a batch planned but not run yet expects here): dirty ones are
        written to the tier."""
        if self.policy == "lru":
            score = self.last_use.astype(np.float64)
        else:  # uses first, recency breaks ties
            score = self.uses * float(self.tick + 1) + self.last_use
        score[self.row_of < 0] = np.inf  # free already
        if not expected:
            score[self.needed_by >= self.next_batch] = np.inf
        score[keep] = np.inf
        n = min(n, int(np.isfinite(score).sum()))
        if n <= 0:
            return
        slots = np.argpartition(score, n - 1)[:n] if n < self.capacity else np.argsort(score, kind="stable")[:n]
        old = self.row_of[slots]
        flush = self.dirty[slots]
        if flush.any():
            self._write(old[flush], {k: v[slots[flush]] for k, v in self.data.items()})
        self.slot_of[old] = -1
        self.row_of[slots] = -1
        self.dirty[slots] = False
        self.free = np.concatenate([self.free, slots])

    def _write(self, rows: np.ndarray, values: dict[str, np.ndarray]) -> None:
        self.tier_rows_written += len(rows)
        if self.writer is not None:
            self.writer.put(self.table, rows, values)
            return
        order = np.argsort(rows, kind="stable")  # chunk-ordered writes
        self.store.write(self.table, rows[order], {k: v[order] for k, v in values.items()})

    def flush(self) -> None:
        """Write every dirty row to the tier; they stay cached, clean."""
        slots = np.flatnonzero(self.dirty)
        if slots.size:
            self._write(self.row_of[slots], {k: v[slots] for k, v in self.data.items()})
            self.dirty[slots] = False

    def drop(self) -> None:
        """Forget everything (after the tier was restored to a snapshot): dirty rows are lost."""
        self.needed_by[:] = -1
        self.row_of[:] = -1
        self.dirty[:] = False
        self.last_use[:] = -1
        self.uses[:] = 0
        self.slot_of[:] = -1
        self.free = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)
