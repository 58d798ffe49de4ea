"""Device caches of tiered tables: which logical row sits in which cache slot, planned on the host.

A tiered table's devices hold ``cache_rows`` slots per owner. The step never sees logical row
ids of such a table, only *cache ids*: :meth:`EmbeddingPlan.device_view` gives it a table of
slots routed like the original (row-wise: ``cache_rows`` per owner, same block or cyclic
layout), so a cache id reaches the device that owns the logical row it stands for, and the
exchange, its deduplication and the sparse optimizer run unchanged. Owners of a row-wise
table each cache rows of their own block (one *space* of slots per owner); the column slices
of a table cache the same rows, so such a table has one space.

Planning a batch (:meth:`TableCache.plan`): each distinct row already cached keeps its slot;
the others take free slots, then the least recently used. Rows are marked used when their batch
enters the lookahead window, and a row that a batch of the window needs is not evicted while
any other candidate is left, so with a cache that holds the window a planned-ahead batch finds
its rows in place. A batch whose distinct rows of one space exceed the cache is refused.

All of this is plain Python and numpy, run by the planner thread; no JAX here.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np

from dlrm_jax.data.batch import PAD_ID
from dlrm_jax.embedding.plan import RowLayout, Strategy, TablePlan


class CacheTooSmall(ValueError):
    """One batch needs more distinct rows of a space than its device cache has slots."""


@dataclass(frozen=True)
class Fills:
    """Rows entering one table's device caches for one batch, aligned arrays [m].

    space, slot: where each goes; row: the logical row; evicted: the row the slot held until
    now (-1: the slot was free)."""

    space: np.ndarray
    slot: np.ndarray
    row: np.ndarray
    evicted: np.ndarray
    requested: int = 0  # distinct rows the batch looked up (cached or not)

    @staticmethod
    def empty(requested: int = 0) -> Fills:
        z = np.zeros(0, np.int64)
        return Fills(z, z, z, z, requested)

    def __len__(self) -> int:
        return int(self.row.shape[0])


class TableCache:
    """The slot maps of one tiered table's device caches (every space), with LRU order."""

    def __init__(self, table: TablePlan, num_devices: int):
        if not table.tiered:
            raise ValueError(f"table {table.spec.name} is not tiered")
        self.name, self.rows, self.capacity = table.spec.name, table.spec.rows, table.cache_rows
        self.num_devices = num_devices
        self.num_spaces = table.spaces(num_devices)
        self.row_wise = table.strategy == Strategy.ROW
        self.cyclic = table.row_layout == RowLayout.CYCLIC
        self.block = table.rows_per_device(num_devices) if not self.row_wise else -(-self.rows // num_devices)
        # Per space: row -> slot in least- to most-recently-used order, and the free slots.
        self._lru = [collections.OrderedDict() for _ in range(self.num_spaces)]
        self._free = [list(range(self.capacity - 1, -1, -1)) for _ in range(self.num_spaces)]
        # Per space: how many batches of the lookahead window need each row.
        self._needed = [collections.Counter() for _ in range(self.num_spaces)]

    # ------------------------------------------------------------ ids
    def space_of(self, rows: np.ndarray) -> np.ndarray:
        """The owner space of logical rows (the row's owner device for row-wise tables)."""
        if not self.row_wise:
            return np.zeros_like(rows)
        return rows % self.num_devices if self.cyclic else rows // self.block

    def cache_ids(self, space: np.ndarray, slot: np.ndarray) -> np.ndarray:
        """The id the step uses for the row in (space, slot): the device view's routing of
        it lands on the space's owner, at local row ``slot`` of the table's cache."""
        if not self.row_wise:
            return slot
        return slot * self.num_devices + space if self.cyclic else space * self.capacity + slot

    def _split(self, ids: np.ndarray) -> list[list[int]]:
        """Distinct valid rows of ``ids`` per space, as Python lists."""
        rows = np.unique(ids[ids != PAD_ID]).astype(np.int64)
        if rows.size and (rows[0] < 0 or rows[-1] >= self.rows):
            bad = rows[0] if rows[0] < 0 else rows[-1]
            raise ValueError(f"table {self.name}: id {bad} outside [0, {self.rows})")
        space = self.space_of(rows)
        return [rows[space == s].tolist() for s in range(self.num_spaces)]

    # ------------------------------------------------------------ the lookahead window
    def enter_window(self, ids: np.ndarray) -> None:
        """A batch entered the lookahead window: its cached rows become the most recently
        used, and all its rows are protected until it leaves."""
        for s, rows in enumerate(self._split(ids)):
            lru, needed = self._lru[s], self._needed[s]
            needed.update(rows)
            for r in rows:
                if r in lru:
                    lru.move_to_end(r)

    def leave_window(self, ids: np.ndarray) -> None:
        for s, rows in enumerate(self._split(ids)):
            needed = self._needed[s]
            needed.subtract(rows)
            for r in rows:
                if needed[r] <= 0:
                    del needed[r]

    # ------------------------------------------------------------ planning
    def plan(self, ids: np.ndarray) -> tuple[np.ndarray, Fills]:
        """Cache ids for a batch's ids of this table (PAD_ID stays PAD_ID; any shape), and the
        rows to fill before the step. Call after ``leave_window`` of this batch (if it was in
        the window) so that only later batches protect rows."""
        per_space = self._split(ids)
        fills = []
        for s, rows in enumerate(per_space):
            if len(rows) > self.capacity:
                raise CacheTooSmall(
                    f"table {self.name}: a batch needs {len(rows)} distinct rows on "
                    f"{'device ' + str(s) if self.row_wise else 'its devices'}, the device cache holds "
                    f"{self.capacity} (embedding.tier.device_cache_rows / device_cache_fraction)")
            fills.append(self._plan_space(s, rows))
        remapped = np.full(ids.shape, PAD_ID, np.int32)
        valid = ids != PAD_ID
        rows = ids[valid].astype(np.int64)
        space = self.space_of(rows)
        slot = np.empty_like(rows)
        for s in range(self.num_spaces):
            mine = space == s
            if mine.any():
                lru = self._lru[s]
                slot[mine] = np.fromiter(map(lru.__getitem__, rows[mine].tolist()), np.int64, int(mine.sum()))
        remapped[valid] = self.cache_ids(space, slot)
        done = [f for f in fills if len(f)]
        requested = sum(len(r) for r in per_space)
        if not done:
            return remapped, Fills.empty(requested)
        return remapped, Fills(*(np.concatenate([getattr(f, k) for f in done]) for k in ("space", "slot", "row", "evicted")),
                               requested)

    def _plan_space(self, s: int, rows: list[int]) -> Fills:
        lru, free, needed = self._lru[s], self._free[s], self._needed[s]
        missing = []
        for r in rows:
            if r in lru:
                lru.move_to_end(r)  # used now
            else:
                missing.append(r)
        if not missing:
            return Fills.empty()
        current = set(rows)
        slots, evicted = [], []
        for r in missing:
            if free:
                slots.append(free.pop())
                evicted.append(-1)
                lru[r] = slots[-1]
                continue
            # Least recently used first; rows a windowed batch needs are passed over while
            # others remain (then taken in the same order: the window is bigger than the cache).
            victim = None
            for old in lru:
                if old in current:
                    break  # this batch's rows are the most recent: nothing unneeded is left
                if old not in needed:
                    victim = old
                    break
            if victim is None:
                victim = next(old for old in lru if old not in current)
            slots.append(lru.pop(victim))
            evicted.append(victim)
            lru[r] = slots[-1]
        n = len(missing)
        return Fills(np.full(n, s, np.int64), np.asarray(slots, np.int64), np.asarray(missing, np.int64),
                     np.asarray(evicted, np.int64))

    # ------------------------------------------------------------ inspection
    def occupancy(self) -> int:
        return sum(len(lru) for lru in self._lru)

    def cached(self) -> list[dict[int, int]]:
        """Per space: {row: slot} of the rows cached now."""
        return [dict(lru) for lru in self._lru]


def plan_stream(caches: dict[int, TableCache], slot_table: np.ndarray, batches, lookahead: int):
    """For each ids array [B, S] of ``batches`` in order: (ids, cache ids [B, S] with every
    tiered table's ids replaced, {table: Fills}). ``caches``: tiered table index -> its
    cache; ``slot_table``: the table of each batch slot. Batch t is planned with batches
    t+1 .. t+lookahead in the window (read ahead from ``batches``)."""
    cols = {t: np.flatnonzero(slot_table == t) for t in caches}
    window, it = collections.deque(), iter(batches)

    def enter(ids):
        window.append(ids)
        for t, cache in caches.items():
            cache.enter_window(ids[:, cols[t]])

    for ids in it:
        enter(ids)
        if len(window) > lookahead:
            break
    while window:
        ids = window.popleft()
        for t, cache in caches.items():
            cache.leave_window(ids[:, cols[t]])
        remapped, fills = ids.copy(), {}
        for t, cache in caches.items():
            remapped[:, cols[t]], fills[t] = cache.plan(ids[:, cols[t]])
        yield ids, remapped, fills
        nxt = next(it, None)
        if nxt is not None:
            enter(nxt)
