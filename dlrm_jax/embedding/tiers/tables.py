"""The host side of tiered tables: the disk tier, DRAM caches, and the fills of the device caches.

The devices run the plan's device view (:meth:`EmbeddingPlan.device_view`): a tiered table is
a table of cache slots there. The planner (:mod:`~dlrm_jax.embedding.tiers.cache_planner`) decides,
batch by batch, which rows enter which slots; this module turns those decisions into the fixed
shape fill arrays of each program (:mod:`~dlrm_jax.embedding.tiers.device_fill`), reads the incoming
rows from the DRAM cache or the tier, and writes the rows each program evicts back.

Pipelining: the rows a program evicts reach the host only after it ran. The next program is
dispatched before that (the host waits for program t-1 only after dispatching t), so a row
evicted by t-1 and needed again by t is *forwarded*: t takes it from t-1's eviction output on
the device. Every other row's newest copy is on the host by then. A batch that needs more fills
on one device than ``fill_rows`` runs extra fill-only programs first, synchronously (rare).

Checkpoints (:meth:`TieredTables.checkpoint`): the device caches' rows are copied to the DRAM
caches, the DRAM caches flushed, and the tier snapshotted under the step (copy-on-write, see
:mod:`~dlrm_jax.embedding.tiers.store`): the snapshot holds the whole logical tables at that
step, so the device caches can start empty on resume. The numbers do not depend on which slot
holds a row (the exchange orders requests by position, not by id value), so a resumed run with
cold caches follows the same trajectory bit for bit.
"""

from __future__ import annotations

import collections
import math
import shutil
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlrm_jax.embedding.exchange.initializer import init_table_rows
from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan, Strategy
from dlrm_jax.embedding.tiers.cache_planner import Fills, TableCache
from dlrm_jax.embedding.tiers.device_fill import CacheRows, GroupFill, read_rows
from dlrm_jax.embedding.tiers.dram_cache import HostCache
from dlrm_jax.embedding.tiers.format import default_chunk_rows, numpy_dtype
from dlrm_jax.embedding.tiers.store import TierStore
from dlrm_jax.embedding.tiers.tier_io import ReadAhead, WriteBehind
from dlrm_jax.hostmem import available_bytes
from dlrm_jax.ids import PAD_ID
from dlrm_jax.parallel.mesh import AXIS

MAPPED_SHARE = 0.25  # a tier up to this share of the memory available is read through memory maps


@dataclass
class _Piece:
    """One column slice of a tiered table in a device-view group."""

    group: str
    local_offset: int
    col_start: int
    device: int  # the owner of a table/column-wise piece; -1: the space's device (row-wise)


@dataclass
class _Program:
    """The fill arrays of one program (numpy) and where its evictions go."""

    fills: dict[str, GroupFill]
    # Per (table, piece): (evicted rows [k], device [k], entry [k]) in the program's arrays.
    evictions: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)


class TieredTables:
    """Disk tier + DRAM caches + device-cache bookkeeping for the tiered tables of ``plan``.

    ``groups``: the device view's groups (``EmbeddingCollection.groups``); ``slot_fields``:
    the sparse optimizer's state per row, {name: (per-row shape of a width-W slice as a
    function of W, dtype)} as :func:`optimizer_fields` gives it.
    """

    def __init__(
        self,
        plan: EmbeddingPlan,
        groups,
        optimizer,
        root: Path,
        key: jax.Array,
        chunk_bytes: int = 64 << 20,
        log=print,
        snapshot: int | None = None,
    ):
        """``snapshot``: open that snapshot read-only (evaluating a run's checkpoint) instead
        of the working store."""
        self.plan, self.n, self.dim = plan, plan.num_devices, plan.tables[0].spec.dim
        self.tables = plan.tiered_tables
        self.names = {t: plan.tables[t].spec.name for t in self.tables}
        self.per_row_slots = optimizer_fields(optimizer, self.dim)
        fields = {"values": ((self.dim,), plan.dtype)} | {
            k: (shape, "float32") for k, (shape, _) in self.per_row_slots.items()
        }
        specs = {self.names[t]: (plan.tables[t].spec.rows, fields) for t in self.tables}
        root = Path(root)
        self._create = lambda: TierStore.create(
            root,
            specs,
            self._initial_rows(key, optimizer),
            default_chunk_rows(row_bytes, chunk_bytes),
        )
        row_bytes = sum(4 * math.prod(s) for s, _ in fields.values())
        if snapshot is not None:
            self.store = TierStore.open_snapshot(root, specs, snapshot)
        elif TierStore.exists(root):
            self.store = TierStore.open(root, specs)
        else:
            log(f"creating the disk tier of {len(self.tables)} tables in {root}")
            self.store = self._create()
            self.store.snapshot(0)  # the initial tables: where a run without checkpoints starts
        tier = plan.tier
        # A tier the page cache can hold is read through memory maps, and not read ahead.
        available = available_bytes()
        tier_bytes = sum(plan.tables[t].spec.rows for t in self.tables) * row_bytes
        self.store.mapped = available is not None and tier_bytes <= MAPPED_SHARE * available
        # Evictions are written behind the step when the disk is slow to take them; a tier in
        # the page cache takes them at once, cheaper than handing them to a thread.
        self.writer = None if self.store.read_only or self.store.mapped else WriteBehind(self.store)
        self.read_ahead = ReadAhead(self.store)
        self.host = {
            t: HostCache(self.store, self.names[t], tier.host_rows[t], tier.policy, self.writer) for t in self.tables
        }
        # Planner thread: rows each planned batch evicts from the device caches, kept until the
        # DRAM caches hold them (two batches after the dispatching thread took that batch).
        self._evicted_log: collections.deque[tuple[int, dict[int, np.ndarray]]] = collections.deque()
        self._planned = 0
        self.consumed = 0  # batches the dispatching thread took (read by the planner thread)
        self.groups = {g.name: g for g in groups}
        self.pieces: dict[int, list[_Piece]] = defaultdict(list)
        for g in groups:
            for vt in g.vtables:
                if vt.table in self.tables:
                    row_wise = plan.tables[vt.table].strategy == Strategy.ROW
                    self.pieces[vt.table].append(_Piece(g.name, vt.offset, vt.col_start, -1 if row_wise else vt.device))
        self.fill_rows = {name: tier.fill_capacity(name) for name in self.tiered_groups()}
        self.held = {
            t: np.full((plan.tables[t].spaces(self.n), plan.tables[t].cache_rows), -1, np.int64) for t in self.tables
        }
        self.pending: tuple[dict, _Program] | None = None  # the last program's evictions (device)
        self._snapshotted: list[int] = []  # this run's checkpoint snapshots, oldest first
        self.stats = defaultdict(int)

    def _initial_rows(self, key, optimizer):
        plan = self.plan
        index = {self.names[t]: t for t in self.tables}

        def init(name, start, stop):
            t = index[name]
            values = init_table_rows(key, t, plan.tables[t].spec.rows, start, stop, self.dim, plan.dtype)
            slots = optimizer.init(values)
            return {"values": np.asarray(values)} | {k: np.asarray(v) for k, v in slots.items()}

        return init

    def tiered_groups(self) -> list[str]:
        return sorted({p.group for t in self.tables for p in self.pieces[t]})

    def new_caches(self) -> dict[int, TableCache]:
        """Empty device-cache planners, one per tiered table (for the planner thread)."""
        self._evicted_log.clear()
        self._planned = self.consumed = 0
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
            skip = self.host[t].slot_of[f.row] >= 0  # a peek: the dispatching thread owns DRAM
            recent = [e[t] for _, e in self._evicted_log if t in e]
            if recent:
                skip |= np.isin(f.row, np.concatenate(recent))
            if not skip.all():
                wanted[self.names[t]] = f.row[~skip]
        self._evicted_log.append((i, {t: f.evicted[f.evicted >= 0] for t, f in fills.items() if len(f)}))
        return self.read_ahead.submit(wanted) if wanted else None

    # ------------------------------------------------------------ fills
    def programs(self, fills: dict[int, Fills], reads=None) -> list[_Program]:
        """The fill programs for one batch: extra fill-only ones when the fills overflow the
        capacity on some device (the rows split into chunks, every piece of a row in the same
        chunk), then the step's. Incoming rows come from DRAM, the rows ``reads`` (from
        :meth:`read_ahead_for`) staged, or the tier; rows the pending program evicts are
        forwarded."""
        staged = self.read_ahead.take(reads)
        self.consumed += 1
        for f in fills.values():
            self.stats["rows_requested"] += f.requested
        rounds = self._rounds(fills)
        if rounds <= 1:
            return [self._program(fills, staged)]
        self.drain()  # rare: several programs, nothing forwarded between them
        while True:
            chunks = [{t: f.part(k, rounds) for t, f in fills.items()} for k in range(rounds)]
            if all(self._rounds(c) <= 1 for c in chunks):
                break
            rounds += 1
        self.stats["fill_rounds"] += rounds - 1
        return [self._program(c, staged) for c in chunks]

    def _program(self, fills: dict[int, Fills], staged: dict | None = None) -> _Program:
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
        program = _Program({})
        for name, entries in per_group.items():
            self._group_arrays(name, entries, program)
        return program

    def _group_arrays(self, name: str, entries, program: _Program) -> None:
        """One group's fill arrays [N, F, ...]: each device's entries in order."""
        g, cap = self.groups[name], self.fill_rows[name]
        rows = np.full((self.n, cap), g.local_rows, np.int32)
        fwd = np.full((self.n, cap), -1, np.int32)
        values = np.zeros((self.n, cap, g.width), numpy_dtype(self.plan.dtype))
        slot_arrays = {
            k: np.zeros((self.n, cap, *(s if not s else (g.width,))), np.float32)
            for k, (s, _) in self.per_row_slots.items()
        }
        used = np.zeros(self.n, np.int64)
        for t, j, dev, lrow, vals, slots, forward, evicted in entries:
            e = np.empty(len(dev), np.int64)
            for d in np.unique(dev):  # entries go to each device's next free positions
                mine = dev == d
                e[mine] = used[d] + np.arange(int(mine.sum()))
                used[d] += int(mine.sum())
            rows[dev, e], fwd[dev, e], values[dev, e] = lrow, forward, vals
            for k in slot_arrays:
                slot_arrays[k][dev, e] = slots[k]
            was = evicted >= 0
            program.evictions[(t, j)] = (evicted[was], dev[was], e[was])
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

    def dispatched(self, program: _Program, evicted: dict) -> None:
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

    # ------------------------------------------------------------ checkpoints and evaluation
    def sync_to_host(self, emb_tables: dict, emb_slots: dict, hot=None) -> None:
        """Copy every row the device caches hold, and the tiered tables' hot rows (``hot``:
        the state's ``HotState``), into the DRAM caches (the caches keep them)."""
        self.drain()
        host = {}
        for name in self.tiered_groups():
            g = self.groups[name]
            host[name] = (
                np.asarray(emb_tables[name]).reshape(self.n, g.local_rows, -1),
                {k: np.asarray(v).reshape(self.n, g.local_rows, *v.shape[1:]) for k, v in emb_slots[name].items()},
            )
        where = {}
        for t in self.tables:
            space, slot = np.nonzero(self.held[t] >= 0)
            where.update(self._held_pieces(t, space, slot))
        self._put_pieces(where, host)
        if hot is not None and not self.store.read_only:  # a snapshot view already has them
            self.put_hot_rows(hot)

    def _held_pieces(self, t: int, space: np.ndarray, slot: np.ndarray) -> dict:
        """(rows, device, local row) per piece of table ``t`` for cache positions (space, slot)."""
        rows = self.held[t][space, slot]
        return {
            (t, j): (rows, space if p.device < 0 else np.full(len(space), p.device), p.local_offset + slot)
            for j, p in enumerate(self.pieces[t])
        }

    def put_hot_rows(self, hot) -> None:
        """The tiered tables' rows in the hot copies ``hot`` (a ``HotState``) -> DRAM caches."""
        keys = np.asarray(hot.keys)
        if not np.isin(keys[0], self.tables).any():
            return
        values = np.asarray(hot.values)
        slots = {k: np.asarray(v) for k, v in hot.slots.items()}
        for t in self.tables:
            at = np.flatnonzero(keys[0] == t)
            if at.size:
                self.host[t].put(
                    keys[1, at].astype(np.int64), {"values": values[at]} | {k: v[at] for k, v in slots.items()}
                )

    def take_from_devices(self, mesh, emb_tables: dict, emb_slots: dict, rows: dict[int, np.ndarray]) -> None:
        """Rows of tiered tables (``rows``: table -> ids) leave the device caches for the
        DRAM caches: the cached ones are read back, their slots freed (the planner's caches
        must drop them too). Call with nothing pending on the devices."""
        self.drain()
        where = {}
        for t, ids in rows.items():
            space, slot = np.nonzero(np.isin(self.held[t], ids))
            if space.size:
                where.update(self._held_pieces(t, space, slot))
                self.held[t][space, slot] = -1
        if not where:
            return
        # Per group, each device's local rows to read, padded to a power of two (few compiles).
        wanted = {name: [[] for _ in range(self.n)] for name in self.tiered_groups()}
        entry = {}
        for (t, j), (_, dev, local) in where.items():
            per_dev = wanted[self.pieces[t][j].group]
            e = np.empty(len(dev), np.int64)
            for i, (d, r) in enumerate(zip(dev.tolist(), local.tolist(), strict=True)):
                e[i] = len(per_dev[d])
                per_dev[d].append(r)
            entry[(t, j)] = e
        host = {}
        for name, per_dev in wanted.items():
            k = 1 << max(0, max(len(r) for r in per_dev) - 1).bit_length()
            idx = np.full((self.n, k), self.groups[name].local_rows, np.int32)
            for d, r in enumerate(per_dev):
                idx[d, : len(r)] = r
            got = read_rows(mesh, emb_tables[name], emb_slots[name], jax.device_put(idx, NamedSharding(mesh, P(AXIS))))
            host[name] = (np.asarray(got.values), {key: np.asarray(v) for key, v in got.slots.items()})
        self._put_pieces({key: (rows_, dev, entry[key]) for key, (rows_, dev, _) in where.items()}, host)

    def checkpoint(self, step: int, emb_tables: dict, emb_slots: dict, saved: list[int], keep: int, hot=None) -> None:
        """Make the tier hold the tables as of ``step`` durably (a snapshot named ``step``;
        hot rows included, so the snapshot is the whole logical tables).
        Snapshots of the checkpoints in ``saved`` and of this run's last ``keep`` checkpoints
        (the newest may still be committing in the background) stay; older ones go."""
        self.sync_to_host(emb_tables, emb_slots, hot)
        for h in self.host.values():
            h.flush()
        if self.writer is not None:
            self.writer.drain()
        self.store.snapshot(step)
        self._snapshotted = [*self._snapshotted[-(keep - 1) :], step] if keep > 1 else [step]
        self.store.keep_snapshots(sorted(set(saved) | set(self._snapshotted)))

    def restore(self, step: int) -> None:
        """Resume from the snapshot of ``step`` (0: the initial tables): the tier as it was,
        every cache empty. A snapshot that is missing is an error naming the folder."""
        if self.writer is not None:
            self.writer.discard()
        if step == 0 and 0 not in self.store.snapshots():  # a run restarted from scratch: tables anew
            root = self.store.root
            self.store.close()
            for name in ("work", "snapshots"):
                shutil.rmtree(root / name, ignore_errors=True)
            mapped, self.store = self.store.mapped, self._create()
            self.store.mapped = mapped
            self.store.snapshot(0)
            for user in (self.writer, self.read_ahead, *self.host.values()):
                if user is not None:
                    user.store = self.store
        if step not in self.store.snapshots():
            raise FileNotFoundError(
                f"{self.store.root / 'snapshots' / str(step)}: the disk tier has no snapshot of "
                f"step {step} (snapshots: {self.store.snapshots()}); the tier does not belong "
                f"to this checkpoint"
            )
        self.pending = None
        self.store.restore(step)
        for h in self.host.values():
            h.drop()
        for held in self.held.values():
            held[:] = -1

    def host_pooled(self, ids: np.ndarray, slot_table: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """float32 [B, F, D]: the pooled vectors of the tiered features of a batch, read on
        the host (after :meth:`sync_to_host`); zeros for the other features."""
        out = np.zeros((ids.shape[0], len(self.plan.tables), self.dim), np.float32)
        for t in self.tables:
            cols = np.flatnonzero(slot_table == t)
            sub = ids[:, cols]
            valid = sub != PAD_ID
            rows, inverse = np.unique(sub[valid], return_inverse=True)
            vals = self.host[t].get(rows.astype(np.int64))["values"].astype(np.float32)
            vec = np.zeros((*sub.shape, self.dim), np.float32)
            vec[valid] = vals[inverse]
            out[:, t] = (vec * weights[:, cols, None]).sum(axis=1)
        return out

    def close(self) -> None:
        """Stops the I/O threads (queued writes are written first) and closes the store."""
        try:
            if self.writer is not None:
                self.writer.close()
        finally:
            self.read_ahead.close()
            self.store.close()


def optimizer_fields(optimizer, dim: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """The sparse optimizer's state per table row: {name: (per-row shape, dtype)}."""
    shapes = jax.eval_shape(optimizer.init, jax.ShapeDtypeStruct((2, dim), jnp.float32))
    return {k: (tuple(v.shape[1:]), str(v.dtype)) for k, v in shapes.items()}
