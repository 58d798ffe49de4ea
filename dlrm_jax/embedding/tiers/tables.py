"""A run's tiered tables on the host: their disk tier and DRAM caches, checkpoints, restores and reads for evaluation.

The devices run the plan's device view (:meth:`EmbeddingPlan.device_view`): a tiered table is
a table of cache slots there. :class:`TieredTables` sets up a run's disk tier and DRAM caches and
which rows each device-cache slot holds; the batch-by-batch fills of the device caches are
:mod:`~dlrm_jax.embedding.tiers.fill_programs`.

Checkpoints (:meth:`TieredTables.checkpoint`): the device caches' rows are copied to the DRAM
caches, the DRAM caches flushed, and the tier snapshotted under the step (copy-on-write, see
:mod:`~dlrm_jax.embedding.tiers.snapshots`): the snapshot holds the whole logical tables at that
step, so the device caches can start empty on resume. The numbers do not depend on which slot
holds a row (the exchange orders requests by position, not by id value), so a resumed run with
cold caches follows the same trajectory bit for bit.
"""

from __future__ import annotations

import collections
import math
import shutil
import zipfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlrm_jax.embedding.dynamic.host_maps import HostMaps
from dlrm_jax.embedding.dynamic.idmap import IdMap, MapSpec
from dlrm_jax.embedding.exchange.initializer import init_table_rows
from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan, Strategy
from dlrm_jax.embedding.tiers.device_fill import read_rows
from dlrm_jax.embedding.tiers.dram_cache import HostCache
from dlrm_jax.embedding.tiers.fill_programs import FillProgram, FillPrograms
from dlrm_jax.embedding.tiers.format import TierError, default_chunk_rows
from dlrm_jax.embedding.tiers.owner import record_owner, tier_owner
from dlrm_jax.embedding.tiers.snapshots import snapshot_steps
from dlrm_jax.embedding.tiers.store import TierStore
from dlrm_jax.embedding.tiers.tier_io import ReadAhead, WriteBehind
from dlrm_jax.files import FolderLock, make_dir, written_whole
from dlrm_jax.hostmem import available_bytes
from dlrm_jax.ids import PAD_ID
from dlrm_jax.parallel.mesh import AXIS
from dlrm_jax.wording import setting

MAPS_FILE = "id_maps.npz"  # a snapshot's host id maps (tiered dynamic tables)
MAPPED_SHARE = 0.25  # a tier up to this share of the memory available is read through memory maps


@dataclass
class _Piece:
    """One column slice of a tiered table in a device-view group."""

    group: str
    local_offset: int
    col_start: int
    device: int  # the owner of a table/column-wise piece; -1: the space's device (row-wise)


def _open_work(root: Path, specs, log) -> TierStore:
    """The working store at ``root``. Working files that are missing or damaged (untrusted after
    a crash anyway: a run restores a snapshot over them) are linked again from the newest
    snapshot whose files are whole, as when ``work/`` is gone (the restore then skips a
    checkpoint whose snapshot is damaged); where none is, the newest's damaged file is named."""
    try:
        return TierStore.open(root, specs)
    except TierError as e:
        work, steps = Path(root).absolute() / "work", snapshot_steps(Path(root).absolute())
        if work not in e.path.parents or not steps:
            raise
        first = e
    for step in reversed(steps):
        shutil.rmtree(work)
        TierStore.rebuild_work(root, step)
        try:
            store = TierStore.open(root, specs)
        except TierError as e:
            if work not in e.path.parents:
                raise
            continue
        log(f"warning: {first}; the disk tier's working files are made again from its snapshot of step {step}")
        return store
    snapshot = work.parent / "snapshots" / str(steps[-1]) / first.path.relative_to(work)
    raise TierError(
        snapshot, f"{first.what} (every snapshot's files are damaged; this one is the newest's)", first.errno
    )


class TieredTables(FillPrograms):
    """Disk tier + DRAM caches + device-cache bookkeeping for the tiered tables of ``plan``.

    ``groups``: the device view's groups (``EmbeddingCollection.groups``); ``optimizer``: the
    sparse optimizer (``EmbeddingCollection.optimizer``), whose state per row the tier keeps
    beside the values (``optimizer_fields``).
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
        maps: dict[int, MapSpec] | None = None,
        run_dir: Path | None = None,
    ):
        """``snapshot``: open that snapshot read-only (evaluating a run's checkpoint) instead
        of the working store. ``maps``: the tiered tables that take raw ids (dynamic tables),
        {table index: MapSpec}; their id maps are held on the host (:attr:`maps`) and kept in
        each snapshot with the rows. ``run_dir``: the run this tier serves, recorded as its
        owner where this run makes it (:mod:`~dlrm_jax.embedding.tiers.owner`; the caller
        checked first that the tier is this run's)."""
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
        self._made_now = False  # a store made by this run: its snapshot 0 needs no check on restore
        self._lock = None
        if snapshot is None:  # one run writes a tier at a time (two given one path raced to make it)
            make_dir(root, "embedding.tier.path")
            self._lock = FolderLock(root).take(
                lambda holder: TierError(
                    root, f"the disk tier is in use by {holder} (embedding.tier.path); give this run a tier of its own"
                )
            )
        try:
            self.run_dir, self.owner = run_dir, tier_owner(root)
            if snapshot is not None:
                if not (root / "snapshots").is_dir():  # (the whole tier gone: its snapshot's error had no hint)
                    raise TierError(
                        root,
                        f"no disk tier there, and the checkpoint keeps tables in its snapshot {snapshot}; "
                        f"give {setting('embedding.tier.path', 'WHERE_IT_IS_NOW')} (moved?)",
                    )
                self.store = TierStore.open_snapshot(root, specs, snapshot)
            elif TierStore.exists(root):
                self.store = _open_work(root, specs, log)
                if self.owner is None:  # a tier made before owners were recorded: this run's now
                    self.owner = record_owner(root, run_dir)
            else:
                log(f"creating the disk tier of {len(self.tables)} tables in {root}")
                self._make_store()
        except BaseException:
            if self._lock is not None:  # (a notebook may try again in this process)
                self._lock.release()
            raise
        if self.store.unverified_tables():
            log(
                f"warning: the disk tier in {root} was made before row checksums: tables "
                f"{', '.join(self.store.unverified_tables())} are read unchecked (a new run dir has them)"
            )
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
        # Planner thread appends, dispatching thread reads: (batch, table, rows) the batch will
        # take from DRAM once the device caches' write-back put them there (marked expected then).
        self._coming: collections.deque[tuple[int, int, np.ndarray]] = collections.deque()
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
        self.pending: tuple[dict, FillProgram] | None = None  # the last program's evictions (device)
        self._snapshotted: list[int] = []  # this run's checkpoint snapshots, oldest first
        self.stats = defaultdict(int)
        self.maps = HostMaps(maps) if maps else None
        if self.maps is not None and snapshot is not None:
            self.maps.load(self._saved_maps(snapshot), snapshot)

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
        if self.maps is not None:
            self._save_maps(step)
        self._snapshotted = [*self._snapshotted[-(keep - 1) :], step] if keep > 1 else [step]
        self.store.keep_snapshots(sorted(set(saved) | set(self._snapshotted)))

    def keep_saved(self, saved: list[int]) -> None:
        """Once every checkpoint is committed and rotated (a run's end): only the snapshots of
        the checkpoints in ``saved`` stay (:meth:`checkpoint` kept those rotation was about to
        remove, and a run's last save left one, a copy of every chunk it changed, for good)."""
        self._snapshotted = [s for s in self._snapshotted if s in saved]
        self.store.keep_snapshots(sorted(saved))

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
            mapped = self.store.mapped
            self._make_store()
            self.store.mapped = mapped
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
        self.store.restore(step, verify=not (self._made_now and step == 0))
        for h in self.host.values():
            h.drop()
        for held in self.held.values():
            held[:] = -1
        if self.maps is not None:
            self.maps.load(self._saved_maps(step), step)

    def _make_store(self) -> None:
        """A new store, its initial tables as snapshot 0 (where a run without checkpoints
        starts), and this run recorded as its owner (a new id: no earlier checkpoint fits it)."""
        self.store = self._create()
        self.store.snapshot(0)
        self._made_now = True
        self.owner = record_owner(self.store.root, self.run_dir)

    # The host maps of a snapshot: one file in its folder (written after the rows; a snapshot
    # of step 0 has none: every map starts empty).
    def _maps_file(self, step: int) -> Path:
        return self.store.root / "snapshots" / str(step) / MAPS_FILE

    def _save_maps(self, step: int) -> None:
        path = self._maps_file(step)
        arrays = {f"{t}/{f}": v for t, m in self.maps.maps_at(step).items() for f, v in m._asdict().items()}
        with written_whole(path, "wb") as f:
            np.savez(f, **arrays)

    def _saved_maps(self, step: int) -> dict[int, IdMap]:
        path = self._maps_file(step)
        if not path.exists():
            if step == 0:
                return {}
            raise FileNotFoundError(f"{path}: missing; the disk tier's snapshot of step {step} has no id maps")
        try:
            with np.load(path) as saved:
                return {t: IdMap(*(saved[f"{t}/{f}"] for f in IdMap._fields)) for t in self.maps.tables}
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
            raise ValueError(f"{path}: damaged id maps ({e}); resume from an older checkpoint") from None

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
            if self._lock is not None:
                self._lock.release()


def optimizer_fields(optimizer, dim: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """The sparse optimizer's state per table row: {name: (per-row shape, dtype)}."""
    shapes = jax.eval_shape(optimizer.init, jax.ShapeDtypeStruct((2, dim), jnp.float32))
    return {k: (tuple(v.shape[1:]), str(v.dtype)) for k, v in shapes.items()}
