"""Raw ids of tiered dynamic tables to rows on the host, before the device caches are planned.

The planner thread turns each batch's raw ids of these tables into rows through the tier's
host maps (:class:`~dlrm_jax.embedding.dynamic.host_maps.HostMaps`), so the cache planner and
the fills see rows as for any tiered table. The rows the maps gave to new ids must start
again in the step that first reads them for their new id; once the batch's rows are cache
slots, :meth:`TieredIds.fresh_slots` says which slot of which device each one is (a fresh row
is one the batch looks up, so the batch's own cache ids give it).

All numpy; the maps' program runs on the host's CPU.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dlrm_jax.data.batch import Batch, RawBatch
from dlrm_jax.embedding.dynamic.host_maps import HostMaps, HostResolved
from dlrm_jax.embedding.dynamic.idmap import shared_row_of
from dlrm_jax.embedding.dynamic.sharded import FreshRows
from dlrm_jax.ids import PAD_ID


class HostIds(NamedTuple):
    """One batch's tiered dynamic ids resolved: the maps' answer and, per fresh row, the flat
    position (in the order :meth:`TieredIds.host_ids` lays the ids out) of one id it was given
    to. With ``new_rows="shared"``: ``extra`` int32 [K, S], lines of ids holding the fresh rows'
    shards' shared rows (each in its table's first slot, the rest padding) for the cache
    planner to place with the batch, and ``line``, each fresh row's line there."""

    resolved: HostResolved
    positions: np.ndarray
    extra: np.ndarray | None = None
    line: np.ndarray | None = None

    def planned_ids(self, ids: np.ndarray) -> np.ndarray:
        """What the cache planner places for the batch whose ids these are: them and the extra lines."""
        return ids if self.extra is None else np.concatenate([ids, self.extra])


class TieredIds:
    """``maps``: the tier's host maps; ``collection``: the device view's (its groups place each
    table's cache slots); ``dynamic``: every dynamic table's index (the raw columns hold their
    bags in table order); ``bag_sizes``: every feature's slots in a batch's ids. ``shared``: a
    fresh row starts from its shard's shared row (``embedding.dynamic.new_rows=shared``), so
    each step's caches hold the shared rows of the shards that gave rows out, and the device is
    told where."""

    def __init__(self, maps: HostMaps, collection, dynamic: list[int], bag_sizes, shared: bool = False):
        self.maps, self.n, self.shared = maps, collection.plan.num_devices, shared
        self.slots = np.array([s.rows // s.vshards for s in maps.specs], np.int64)  # a shard's rows
        starts = np.cumsum([0, *bag_sizes])
        self.slices = [slice(int(starts[t]), int(starts[t + 1])) for t in maps.tables]
        self.raw_cols, keep, col = {}, [], 0
        for t in sorted(dynamic):
            cols = np.arange(col, col + bag_sizes[t])
            col += bag_sizes[t]
            if t in maps.tables:
                self.raw_cols[t] = cols
            else:
                keep.append(cols)
        self.keep = np.concatenate(keep) if keep else None  # the devices' dynamic tables' raw columns
        self.block = []
        for t in maps.tables:
            (vt,) = [vt for g in collection.groups for vt in g.vtables if vt.table == t]
            self.block.append(vt.block)
        # cache ids are below a table's view rows, hot rows' step ids above (embedding/tiers/hot.py)
        self.view_rows = np.array([collection.plan.tables[t].spec.rows for t in maps.tables], np.int64)
        self.hot_rows = collection.plan.hot_rows

    def host_ids(self, batch: Batch | RawBatch, step: int, learn: bool = True) -> tuple[Batch | RawBatch, HostIds]:
        """The batch with its tiered dynamic features' ids replaced by their rows (their raw
        columns dropped), and what the maps answered. ``learn``: batch number ``step`` of
        training, through the maps in order; otherwise read as of ``step`` (evaluation)."""
        ids, raw = batch.ids, getattr(batch, "raw", None)
        table, hi, lo, valid = [], [], [], []
        for j, (t, sl) in enumerate(zip(self.maps.tables, self.slices, strict=True)):
            sub = ids[:, sl]
            valid.append((sub != PAD_ID).reshape(-1))
            table.append(np.full(sub.size, j, np.int32))
            if raw is None:  # a source without raw ids: the ids themselves (below 2**31)
                hi.append(np.zeros(sub.size, np.uint32))
                lo.append(sub.astype(np.uint32).reshape(-1))
            else:
                hi.append(raw[:, 0, self.raw_cols[t]].reshape(-1))
                lo.append(raw[:, 1, self.raw_cols[t]].reshape(-1))
        args = [np.concatenate(x) for x in (table, hi, lo, valid)]
        if learn:
            resolved = self.maps.learn(step, *args)
        else:
            rows = self.maps.read(step, *args)
            empty = np.zeros(0, np.int32)
            resolved = HostResolved(rows, empty, empty, empty.view(np.uint32), empty.view(np.uint32), None)
        out, at = ids.copy(), 0
        for sl in self.slices:
            width = sl.stop - sl.start
            rows = resolved.rows[at : at + ids.shape[0] * width].reshape(ids.shape[0], width)
            out[:, sl] = np.where(rows >= 0, rows, PAD_ID)
            at += rows.size
        if raw is None:
            new = batch._replace(ids=out)
        elif self.keep is None:
            new = Batch(batch.dense, out, batch.labels)
        else:
            new = RawBatch(batch.dense, out, batch.labels, np.ascontiguousarray(raw[:, :, self.keep]))
        host = HostIds(resolved, self._positions(args[0], resolved))
        if self.shared and resolved.fresh_rows.size:
            j = resolved.fresh_table.astype(np.int64)
            key = j << 32 | shared_row_of(resolved.fresh_rows, self.slots[j])  # (table, shared row)
            pairs, line = np.unique(key, return_inverse=True)
            extra = np.full((pairs.size, ids.shape[1]), PAD_ID, ids.dtype)
            first = np.array([sl.start for sl in self.slices])
            extra[np.arange(pairs.size), first[pairs >> 32]] = pairs & 0xFFFFFFFF
            host = host._replace(extra=extra, line=line)
        return new, host

    def _positions(self, table: np.ndarray, resolved: HostResolved) -> np.ndarray:
        """Per fresh row, the flat position of an id the batch gave it to."""
        if not resolved.fresh_rows.size:
            return np.zeros(0, np.int64)
        key = table.astype(np.int64) << 32 | (resolved.rows.astype(np.int64) & 0xFFFFFFFF)
        order = np.argsort(key, kind="stable")
        want = resolved.fresh_table.astype(np.int64) << 32 | resolved.fresh_rows.astype(np.int64)
        return order[np.searchsorted(key[order], want)]

    def fresh_slots(self, host: HostIds, remapped: np.ndarray, size: int) -> tuple[FreshRows, np.ndarray | None]:
        """The fresh rows as each device's cache slots (``remapped``: the planned ids as cache
        ids, the batch's then :attr:`HostIds.extra`'s), ``size`` entries a device (padding: row
        -1), flat over the devices; and with hot rows, those that are hot (their step ids are
        hot slots): int32 [H, 4], per hot slot whether a new id took it, its table (index into
        the maps') and the id's words ([H, 6] when ``shared``: and where its shared row is, the
        device and its cache slot there, or -1 and its hot slot)."""
        r = host.resolved
        batch = remapped.shape[0] - (0 if host.extra is None else host.extra.shape[0])
        rows = np.full((self.n, size), -1, np.int32)
        table = np.zeros((self.n, size), np.int32)
        hi, lo = np.zeros((self.n, size), np.uint32), np.zeros((self.n, size), np.uint32)
        shared = np.full((self.n, size), -1, np.int32) if self.shared else None
        hot = np.zeros((self.hot_rows, 6 if self.shared else 4), np.int32) if self.hot_rows else None
        if r.fresh_rows.size:
            widths = [sl.stop - sl.start for sl in self.slices]
            sizes = np.array([batch * w for w in widths])
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
            j = r.fresh_table.astype(np.int64)
            within = host.positions - starts[j]
            width = np.array(widths)[j]
            first = np.array([sl.start for sl in self.slices])[j]
            owner, slot = self._places(j, remapped[within // width, first + within % width])
            fresh_hi, fresh_lo = r.fresh_hi, r.fresh_lo
            base = self._places(j, remapped[batch + host.line, first]) if self.shared else None
            is_hot = owner < 0
            if is_hot.any():
                at = slot[is_hot]
                words = np.stack([fresh_hi[is_hot], fresh_lo[is_hot]], 1).view(np.int32)
                cols = [np.ones((at.size, 1), np.int32), j[is_hot, None].astype(np.int32), words]
                if base is not None:
                    cols += [base[0][is_hot, None], base[1][is_hot, None]]
                hot[at] = np.concatenate(cols, 1)
                j, owner, slot, fresh_hi, fresh_lo = (x[~is_hot] for x in (j, owner, slot, fresh_hi, fresh_lo))
                base = None if base is None else (base[0][~is_hot], base[1][~is_hot])
            if base is not None:
                away = (base[0] >= 0) & (base[0] != owner)
                if away.any():  # (a shard's rows share one device's block of cache slots)
                    raise ValueError(f"a fresh row on device {owner[away][0]} and its shared row on {base[0][away][0]}")
            order = np.argsort(owner, kind="stable")
            owner_sorted = owner[order]
            rank = np.arange(owner.size) - np.searchsorted(owner_sorted, owner_sorted)
            if rank.size and rank.max() >= size:
                raise ValueError(f"{rank.max() + 1} fresh rows on one device, room for {size}")
            place = (owner_sorted, rank)
            rows[place] = slot[order]
            table[place] = j[order]
            hi[place] = fresh_hi[order]
            lo[place] = fresh_lo[order]
            if base is not None:
                shared[place] = np.where(base[0] >= 0, base[1], -2 - base[1])[order]
        flat = (rows, table, hi, lo) + (() if shared is None else (shared,))
        return FreshRows(*(x.reshape(-1) for x in flat)), hot

    def _places(self, j: np.ndarray, cache_id: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where rows of tables ``j`` are this step, from their step ids ``cache_id``: (device,
        cache slot there), or (-1, hot slot) where they are hot."""
        hot = cache_id >= self.view_rows[j]
        block = np.array(self.block, np.int64)[j]
        device = np.where(hot, -1, cache_id // block)
        at = np.where(hot, cache_id - self.view_rows[j], cache_id % block)
        return device.astype(np.int32), at.astype(np.int32)
