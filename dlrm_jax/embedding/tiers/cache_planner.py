"""Device caches of tiered tables: which logical row sits in which cache slot, planned on the host.

A tiered table's devices hold ``cache_rows`` slots per owner. The step never sees logical row
ids of such a table, only *cache ids*: :meth:`EmbeddingPlan.device_view` gives it a table of
slots routed like the original (row-wise: ``cache_rows`` per owner, same block or cyclic
layout), so a cache id reaches the device that owns the logical row it stands for, and the
exchange, its deduplication and the sparse optimizer run unchanged. Owners of a row-wise
table each cache rows of their own block (one *space* of slots per owner); the column slices
of a table cache the same rows, so such a table has one space.

Planning a batch (:meth:`TableCache.plan`): each distinct row already cached keeps its slot;
the others take free slots, then the least recently used (candidates are selected an eighth of
a space at a time, oldest first, and skipped if used since: one O(capacity) selection per many
batches, where scoring every slot each batch cost 300 ms a step over 470M rows). A row that a batch of the lookahead
window needs is not evicted while any other candidate is left, so with a cache that holds the
window a planned-ahead batch finds its rows in place; the batch's own rows are never evicted.
A batch whose distinct rows of one space exceed the cache is refused.

All of this is numpy, run by the planner thread; no JAX here.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np

from dlrm_jax.embedding.hot.index import split_hot_host
from dlrm_jax.embedding.plan.embedding_plan import RowLayout, Strategy, TablePlan
from dlrm_jax.ids import PAD_ID

VICTIM_FRACTION = 8  # a space's eviction candidates are refilled an eighth of its slots at a time


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

    def take(self, which: np.ndarray) -> Fills:
        """The entries ``which`` (a mask or indices), in order (``requested`` counted in none)."""
        return Fills(self.space[which], self.slot[which], self.row[which], self.evicted[which])


class TableCache:
    """The slot maps of one tiered table's device caches (every space), with LRU order.

    Indexes are direct-mapped numpy arrays: ``slot_of`` [rows] (int32, 4 bytes per table row
    on the host, against the row's own hundreds of bytes in the tier) and per slot its row
    and last use, so a batch is planned with a few vectorised passes, no per-row Python.
    """

    def __init__(self, table: TablePlan, num_devices: int):
        if not table.tiered:
            raise ValueError(f"table {table.spec.name} is not tiered")
        self.name, self.rows, self.capacity = table.spec.name, table.spec.rows, table.cache_rows
        self.num_devices = num_devices
        self.num_spaces = table.spaces(num_devices)
        self.row_wise = table.strategy == Strategy.ROW
        self.cyclic = table.row_layout == RowLayout.CYCLIC
        self.block = -(-self.rows // num_devices)
        total = self.num_spaces * self.capacity  # global slot g = space * capacity + slot
        self.slot_of = np.full(self.rows, -1, np.int32)
        self.row_at = np.full(total, -1, np.int64)
        self.last_use = np.full(total, -1, np.int64)  # -1: free, taken first
        self.tick = 0
        self._window: collections.deque = collections.deque()  # distinct rows of windowed batches
        # Per space: eviction candidates, the least recently used slots when last selected
        # (slot ids within the space, oldest first) and their last use then; a slot used since
        # is skipped. One O(capacity) selection serves many batches (VICTIM_FRACTION).
        self._protected = np.zeros(total, bool)  # slots the window needs, marked during a _fill
        self._victims = [np.zeros(0, np.int64)] * self.num_spaces
        self._victim_use = [np.zeros(0, np.int64)] * self.num_spaces

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

    def _rows(self, ids: np.ndarray) -> np.ndarray:
        """Distinct valid rows of ``ids`` (int64, sorted); out-of-range ids are an error."""
        rows = np.unique(ids[ids != PAD_ID]).astype(np.int64)
        if rows.size and (rows[0] < 0 or rows[-1] >= self.rows):
            bad = rows[0] if rows[0] < 0 else rows[-1]
            raise ValueError(f"table {self.name}: id {bad} outside [0, {self.rows})")
        return rows

    # ------------------------------------------------------------ the lookahead window
    def enter_window(self, ids: np.ndarray) -> None:
        """A batch entered the lookahead window: its rows are protected until it leaves."""
        self._window.append(self._rows(ids))

    def leave_window(self, ids: np.ndarray) -> None:
        """The oldest batch of the window (``ids``) leaves it."""
        self._window.popleft()

    # ------------------------------------------------------------ planning
    def plan(self, ids: np.ndarray) -> tuple[np.ndarray, Fills]:
        """Cache ids for a batch's ids of this table (PAD_ID stays PAD_ID; any shape), and the
        rows to fill before the step. Call after ``leave_window`` of this batch (if it was in
        the window) so that only later batches protect rows."""
        rows = self._rows(ids)
        space = self.space_of(rows)
        per_space = np.bincount(space, minlength=self.num_spaces)
        if per_space.max(initial=0) > self.capacity:
            s = int(np.argmax(per_space))
            raise CacheTooSmall(
                f"table {self.name}: a batch needs {per_space[s]} distinct rows on "
                f"{'device ' + str(s) if self.row_wise else 'its devices'}, the device cache holds "
                f"{self.capacity} (embedding.tier.device_cache_rows / device_cache_fraction)"
            )
        self.tick += 1
        slots = self.slot_of[rows].astype(np.int64)
        hit = slots >= 0
        self.last_use[slots[hit]] = self.tick
        fills = self._fill(rows[~hit], space[~hit], slots[hit], per_space.sum())
        remapped = np.full(ids.shape, PAD_ID, np.int32)
        valid = ids != PAD_ID
        g = self.slot_of[ids[valid]].astype(np.int64)
        remapped[valid] = self.cache_ids(g // self.capacity, g % self.capacity)
        return remapped, fills

    def _fill(self, missing: np.ndarray, space: np.ndarray, current: np.ndarray, requested: int) -> Fills:
        if not missing.size:
            return Fills.empty(int(requested))
        c = self.capacity
        needed = None
        if self._window:
            needed = self.slot_of[np.concatenate(list(self._window))]
            needed = np.unique(needed[needed >= 0])
        order = np.argsort(space, kind="stable")
        missing, space = missing[order], space[order]
        chosen = np.empty(missing.size, np.int64)
        counts = np.bincount(space, minlength=self.num_spaces)
        at = 0
        if needed is not None:
            self._protected[needed] = True
        try:
            for s in np.flatnonzero(counts):
                m = int(counts[s])
                chosen[at : at + m] = s * c + self._pick(int(s), m, current)
                at += m
        finally:
            if needed is not None:
                self._protected[needed] = False
        evicted = self.row_at[chosen]
        self.slot_of[evicted[evicted >= 0]] = -1
        self.row_at[chosen] = missing
        self.slot_of[missing] = chosen
        self.last_use[chosen] = self.tick
        return Fills(space.astype(np.int64), chosen % c, missing, evicted, int(requested))

    def _pick(self, s: int, m: int, current: np.ndarray) -> np.ndarray:
        """``m`` slots of space ``s`` for new rows, least recently used first (free slots are the
        oldest), not the batch's own (``current``) and, while others are left, not those the
        lookahead window needs (marked in ``_protected``)."""
        c, base = self.capacity, s * self.capacity
        for attempt in range(3):
            queue, use = self._victims[s], self._victim_use[s]
            # A prefix of the candidates usually holds m good ones; all of them when it does not.
            n = min(len(queue), 4 * m + 64) if attempt == 0 else len(queue)
            slots = base + queue[:n]
            # Unused since chosen, not this batch's own (touched at this tick), not protected.
            valid = (self.last_use[slots] == use[:n]) & (use[:n] < self.tick) & ~self._protected[slots]
            if int(valid.sum()) >= m or attempt == 2:
                break
            if attempt == 1:  # refill: the oldest eighth of the space (or what m needs), by last use
                mine = self.last_use[base : base + c]
                k = min(c, max(2 * m, c // VICTIM_FRACTION))
                pick = np.argpartition(mine, k - 1)[:k] if k < c else np.arange(c)
                pick = pick[np.argsort(mine[pick], kind="stable")]
                self._victims[s], self._victim_use[s] = pick, mine[pick].copy()
        taken = np.flatnonzero(valid)[:m]
        if len(taken) == m:
            self._victims[s], self._victim_use[s] = queue[taken[-1] + 1 :], use[taken[-1] + 1 :]
            return queue[taken]
        # Not enough outside the window: score every slot (rare), window rows last, own never.
        score = self.last_use[base : base + c].copy()
        score[self._protected[base : base + c]] += 1 << 40
        own = current[(current >= base) & (current < base + c)] - base
        score[own] = 1 << 62
        pick = np.argpartition(score, m - 1)[:m] if m < c else np.arange(c)
        self._victims[s] = self._victim_use[s] = np.zeros(0, np.int64)
        return pick[np.argsort(score[pick], kind="stable")]

    def drop(self, rows: np.ndarray) -> None:
        """Forget ``rows`` (cached or not): their slots become free, nothing is written back
        (the caller took their contents: rows becoming hot)."""
        rows = np.asarray(rows, np.int64)
        g = self.slot_of[rows].astype(np.int64)
        g = g[g >= 0]
        self.slot_of[self.row_at[g]] = -1
        self.row_at[g] = -1
        self.last_use[g] = -1

    # ------------------------------------------------------------ inspection
    def occupancy(self) -> int:
        return int((self.row_at >= 0).sum())

    def cached(self) -> list[dict[int, int]]:
        """Per space: {row: slot} of the rows cached now."""
        out = [{} for _ in range(self.num_spaces)]
        for g in np.flatnonzero(self.row_at >= 0).tolist():
            out[g // self.capacity][int(self.row_at[g])] = g % self.capacity
        return out


def plan_stream(caches: dict[int, TableCache], slot_table: np.ndarray, batches, lookahead: int, hot=None):
    """For each ids array [B, S] of ``batches`` in order: (ids, cache ids [B, S] with every
    tiered table's ids replaced, {table: Fills}). ``caches``: tiered table index -> its
    cache; ``slot_table``: the table of each batch slot. Batch t is planned with batches
    t+1 .. t+lookahead in the window (read ahead from ``batches``). ``hot``: called with t
    when batch t is planned, its tiered tables' hot rows (``hot.index.tiered_hot_maps``):
    those never enter a cache and become their step ids."""
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
    t_batch = 0
    while window:
        ids = window.popleft()
        for t, cache in caches.items():
            cache.leave_window(ids[:, cols[t]])
        maps = hot(t_batch) if hot is not None else {}
        remapped, fills = ids.copy(), {}
        for t, cache in caches.items():
            sub = ids[:, cols[t]]
            is_hot, step_ids = split_hot_host(sub, maps.get(t))
            cache_ids, fills[t] = cache.plan(np.where(is_hot, PAD_ID, sub))
            remapped[:, cols[t]] = np.where(is_hot, step_ids, cache_ids)
        yield ids, remapped, fills
        t_batch += 1
        nxt = next(it, None)
        if nxt is not None:
            enter(nxt)
