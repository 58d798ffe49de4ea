"""A batch's fill programs: the rows the planner chose for the device caches, as each program's fill arrays.

The planner (:mod:`~dlrm_jax.embedding.tiers.cache_planner`) decides, batch by batch, which rows
enter which slots; :class:`FillPrograms` turns those decisions into the fixed shape fill arrays of
each program (:mod:`~dlrm_jax.embedding.tiers.device_fill`), reads the incoming rows from the DRAM
cache or the tier (read ahead on the planner thread), and writes the rows each program evicts back.

Pipelining: the rows a program evicts reach the host only after it ran. The next program is
dispatched before that (the host waits for program t-1 only after dispatching t), so a row
evicted by t-1 and needed again by t is *forwarded*: t takes it from t-1's eviction output on
the device. Every other row's newest copy is on the host by then. A batch that needs more fills
on one device than ``fill_rows`` runs extra fill-only programs first, synchronously (rare).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from dlrm_jax.embedding.tiers.cache_planner import Fills, TableCache
from dlrm_jax.embedding.tiers.device_fill import CacheRows, GroupFill
from dlrm_jax.embedding.tiers.format import numpy_dtype


@dataclass
class FillProgram:
    """The fill arrays of one program (numpy) and where its evictions go."""

    fills: dict[str, GroupFill]
    # Per (table, piece): (evicted rows [k], device [k], entry [k]) in the program's arrays.
    evictions: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)


class FillPrograms:
    """The fills half of :class:`~dlrm_jax.embedding.tiers.tables.TieredTables`, which sets up
    the state it works on: the plan, the device view's groups and each tiered table's pieces in
    them, the DRAM caches (``host``), the read-ahead, and which rows each cache slot holds."""

    def new_caches(self) -> dict[int, TableCache]:
        """Empty device-cache planners, one per tiered table (for the planner thread)."""
        self._evicted_log.clear()
        self._coming.clear()
        self._planned = self.consumed = 0
        for host in self.host.values():  # a new stream: marks of the old one's batches go
            host.needed_by[:] = -1
            host.next_batch = 0
        self.read_ahead.restart()
        return {t: TableCache(self.plan.tables[t], self.n) for t in self.tables}

    def read_ahead_for(self, fills: dict[int, Fills]):
        """(Planner thread.) Start reading the rows a planned batch will fill that neither cache
        is likely to hold by its step: not in DRAM now, and not evicted from the device caches
        by a batch whose evictions have not reached DRAM yet. Returns the reads' future for
        :meth:`programs` (None: nothing to read)."""
        if self.store.mapped:
            return None  # the page cache holds the tier: a gather at the step costs less
        i = self._planned
        self._planned += 1
        while self._evicted_log and self._evicted_log[0][0] < self.consumed - 2:
            self._evicted_log.popleft()
        wanted = {}
        for t, f in fills.items():
            if not len(f):
                continue
            skip = self.host[t].expect(f.row, i)  # held in DRAM, and kept there until batch i
            recent = [e[t] for _, e in self._evicted_log if t in e]
            if recent:
                coming = np.isin(f.row, np.concatenate(recent)) & ~skip
                if coming.any():  # in DRAM after a write-back: marked expected then
                    self._coming.append((i, t, f.row[coming]))
                skip |= coming
            if not skip.all():
                wanted[self.names[t]] = f.row[~skip]
        self._evicted_log.append((i, {t: f.evicted[f.evicted >= 0] for t, f in fills.items() if len(f)}))
        return self.read_ahead.submit(wanted) if wanted else None

    def programs(self, fills: dict[int, Fills], reads=None) -> list[FillProgram]:
        """The fill programs for one batch: extra fill-only ones when the fills overflow the
        capacity on some device (the rows split into chunks, every piece of a row in the same
        chunk), then the step's. Incoming rows come from DRAM, the rows ``reads`` (from
        :meth:`read_ahead_for`) staged, or the tier; rows the pending program evicts are
        forwarded."""
        staged = self.read_ahead.take(reads)
        self.consumed += 1
        for host in self.host.values():  # this batch's rows are its hits: kept by get itself
            host.next_batch = self.consumed
        for f in fills.values():
            self.stats["rows_requested"] += f.requested
        rounds = self._rounds(fills)
        if rounds <= 1:
            return [self._program(fills, staged)]
        self.drain()  # rare: several programs, nothing forwarded between them
        program_of = self._program_of(fills)
        # (a table with no fills this batch, all hits or hot, has no entries to place)
        rounds = 1 + max((int(r.max()) for r in program_of.values() if len(r)), default=0)
        self.stats["fill_rounds"] += rounds - 1
        chunks = [{t: f.take(program_of[t] == k) if len(f) else f for t, f in fills.items()} for k in range(rounds)]
        return [self._program(c, staged) for c in chunks]

    def _program_of(self, fills: dict[int, Fills]) -> dict[int, np.ndarray]:
        """Each fill entry's program, for fills that overflow one program: a device's entries in
        a group fill its programs in order, ``fill_rows`` of the group each, table after table;
        a row with pieces in several places (columns on several devices) goes into one program
        on all of them, the first where each has room for the rest of its table's rows there.
        (Cutting each table's fills into as many slices as the busiest device needed left a
        device with a row of every table in every slice: never within ``fill_rows`` below the
        tables' count, and the loop looking for enough slices never ended.)"""
        placed: dict[tuple[str, int], int] = defaultdict(int)  # (group, device) -> entries placed
        out = {}
        for t, f in fills.items():
            out[t] = program = np.zeros(len(f), np.int64)
            spaces = np.unique(f.space) if len(f) else ()
            streams: dict[tuple, list[np.ndarray]] = defaultdict(list)  # the places a row takes -> rows
            for s in spaces:
                places = tuple(sorted((p.group, int(s) if p.device < 0 else p.device) for p in self.pieces[t]))
                streams[places].append(np.flatnonzero(f.space == s))
            for places, parts in streams.items():
                at = np.sort(np.concatenate(parts))
                per = {c: places.count(c) for c in set(places)}  # a row's pieces in each place
                fits = min(self.fill_rows[g] // k for (g, _), k in per.items())
                if fits < 1:
                    raise ValueError(
                        f"embedding.tier.fill_rows={min(self.fill_rows.values())}: a row of table "
                        f"{self.names[t]} has {max(per.values())} pieces in one group on one device; "
                        f"fill at least that many rows a program"
                    )
                if len(places) == 1:  # one place, a piece a row: the rows fill its programs in order
                    start = placed[places[0]]
                    program[at] = (start + np.arange(len(at))) // self.fill_rows[places[0][0]]
                    placed[places[0]] = start + len(at)
                    continue
                first = max(-(-placed[c] // self.fill_rows[c[0]]) for c in per)  # a program all have room in
                program[at] = first + np.arange(len(at)) // fits
                last, in_last = first + (len(at) - 1) // fits, (len(at) - 1) % fits + 1
                for c, k in per.items():
                    placed[c] = last * self.fill_rows[c[0]] + k * in_last
        return out

    def _program(self, fills: dict[int, Fills], staged: dict | None = None) -> FillProgram:
        per_group = {name: [] for name in self.tiered_groups()}
        for t, f in fills.items():
            if not len(f):
                continue
            self.held[t][f.space, f.slot] = f.row
            at = self._pending_index(t, f.row)  # where the pending program evicts each row, or -1
            fresh = at < 0
            full = {k: np.zeros((len(f), *v.shape[1:]), v.dtype) for k, v in self.host[t].data.items()}
            if fresh.any():
                got = self.host[t].get(f.row[fresh], (staged or {}).get(self.names[t]))
                for k in full:
                    full[k][fresh] = got[k]
            self.stats["rows_filled"] += len(f)
            self.stats["rows_forwarded"] += int((~fresh).sum())
            self.stats["rows_evicted"] += int((f.evicted >= 0).sum())
            for j, p in enumerate(self.pieces[t]):
                w = self.groups[p.group].width
                dev = f.space if p.device < 0 else np.full(len(f), p.device)
                fwd = np.full(len(f), -1, np.int64)
                if not fresh.all():
                    fwd[~fresh] = self.pending[1].evictions[(t, j)][2][at[~fresh]]
                cols = slice(p.col_start, p.col_start + w)
                slots = {k: v[:, cols] if v.ndim == 2 else v for k, v in full.items() if k != "values"}
                per_group[p.group].append(
                    (t, j, dev, p.local_offset + f.slot, full["values"][:, cols], slots, fwd, f.evicted)
                )
        program = FillProgram({})
        for name, entries in per_group.items():
            self._group_arrays(name, entries, program)
        return program

    def _group_arrays(self, name: str, entries, program: FillProgram) -> None:
        """One group's fill arrays [N, F, ...]: each device's entries in order."""
        g, cap = self.groups[name], self.fill_rows[name]
        rows = np.full((self.n, cap), g.local_rows, np.int32)
        fwd = np.full((self.n, cap), -1, np.int32)
        values = np.zeros((self.n, cap, g.width), numpy_dtype(self.plan.dtype))
        slot_arrays = {
            k: np.zeros((self.n, cap, *(s if not s else (g.width,))), np.float32)
            for k, (s, _) in self.per_row_slots.items()
        }
        if not entries:
            program.fills[name] = GroupFill(rows, fwd, CacheRows(values, slot_arrays))
            return
        # Entries go to each device's next free positions, in order: all of them at once.
        dev = np.concatenate([e[2] for e in entries])
        order = np.argsort(dev, kind="stable")
        counts = np.bincount(dev, minlength=self.n)
        pos = np.empty(len(dev), np.int64)
        pos[order] = np.arange(len(dev)) - np.repeat(np.cumsum(counts) - counts, counts)
        rows[dev, pos] = np.concatenate([e[3] for e in entries])
        fwd[dev, pos] = np.concatenate([e[6] for e in entries])
        values[dev, pos] = np.concatenate([e[4] for e in entries])
        for k in slot_arrays:
            slot_arrays[k][dev, pos] = np.concatenate([e[5][k] for e in entries])
        at = 0
        for t, j, d, _, _, _, _, evicted in entries:
            e, was = pos[at : at + len(d)], evicted >= 0
            program.evictions[(t, j)] = (evicted[was], d[was], e[was])
            at += len(d)
        program.fills[name] = GroupFill(rows, fwd, CacheRows(values, slot_arrays))

    def _rounds(self, fills: dict[int, Fills]) -> int:
        """Programs these fills need: the most entries a device gets in a group over the
        group's capacity (rounded up)."""
        most = 0
        for name in self.tiered_groups():
            count = np.zeros(self.n, np.int64)
            for t, f in fills.items():
                for p in self.pieces[t]:
                    if p.group == name:
                        if p.device < 0:
                            count += np.bincount(f.space, minlength=self.n)
                        else:
                            count[p.device] += len(f)
            most = max(most, math.ceil(count.max() / self.fill_rows[name]))
        return most

    def _pending_index(self, t: int, rows: np.ndarray) -> np.ndarray:
        """For each row, its index among table ``t``'s rows the pending program evicts (the
        same order for every piece), or -1."""
        out = np.full(len(rows), -1, np.int64)
        if self.pending is None or (t, 0) not in self.pending[1].evictions:
            return out
        evicted = self.pending[1].evictions[(t, 0)][0]
        if not evicted.size:
            return out
        order = np.argsort(evicted)
        pos = np.searchsorted(evicted, rows, sorter=order)
        pos = np.minimum(pos, len(evicted) - 1)
        found = evicted[order[pos]] == rows
        out[found] = order[pos[found]]
        return out

    def empty_evictions(self) -> dict[str, CacheRows]:
        """Zero 'previous evictions' for a program with nothing to forward (numpy)."""
        out = {}
        for name in self.tiered_groups():
            g, cap = self.groups[name], self.fill_rows[name]
            out[name] = CacheRows(
                np.zeros((self.n, cap, g.width), numpy_dtype(self.plan.dtype)),
                {
                    k: np.zeros((self.n, cap, *(s if not s else (g.width,))), np.float32)
                    for k, (s, _) in self.per_row_slots.items()
                },
            )
        return out

    def dispatched(self, program: FillProgram, evicted: dict) -> None:
        """``program`` was dispatched and will evict into ``evicted`` (device arrays): write
        back what the program before it evicted (waits for that one), keep this one pending."""
        self.drain()
        self.pending = (evicted, program)

    def drain(self) -> None:
        """Write the pending program's evictions back to the DRAM caches (waits for it)."""
        if self.pending is None:
            return
        evicted, program = self.pending
        self.pending = None
        if not program.evictions:
            return
        host = {
            name: (np.asarray(c.values), {k: np.asarray(v) for k, v in c.slots.items()}) for name, c in evicted.items()
        }
        self._put_pieces(program.evictions, host)

    def _put_pieces(self, where: dict, host: dict) -> None:
        """Whole rows from per-piece (rows, device, entry) positions of ``host`` arrays
        {group: (values, slots)}, into the DRAM caches."""
        for t in self.tables:
            parts = [(j, where[(t, j)]) for j in range(len(self.pieces[t])) if (t, j) in where]
            if not parts:
                continue
            rows = parts[0][1][0]
            values, slots = [], defaultdict(list)
            for j, (_, dev, entry) in parts:
                vals, sl = host[self.pieces[t][j].group]
                values.append(vals[dev, entry])
                for k, v in sl.items():
                    slots[k].append(v[dev, entry])
            full = {"values": np.concatenate(values, axis=1)}
            for k, (shape, _) in self.per_row_slots.items():
                full[k] = np.concatenate(slots[k], axis=1) if shape else slots[k][0]
            self.host[t].put(rows, full)
            for i, table, expected in list(self._coming):  # (the planner only appends meanwhile)
                if table == t and i >= self.consumed:
                    self.host[t].expect(expected, i)
        while self._coming and self._coming[0][0] < self.consumed:  # batches taken already
            self._coming.popleft()
