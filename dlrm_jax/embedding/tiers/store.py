"""The disk tier of tiered embedding storage: tables too large for device memory, on local disk.

Every field of every table (values, optimizer state) is an uncompressed zarr3 array under
``root/work/<table>/<field>/``. Each chunk file of such an array is the raw C-order bytes of
``chunk_rows`` rows (edge chunks too are full size), so per-step scattered row reads and writes are
byte ranges of the chunk files, issued as coalesced ``pread``/``pwrite`` requests many at a time
(:mod:`.chunk_io`): through tensorstore they are 5-60x slower, and through memory maps one page
fault (with the kernel's readahead) at a time.
tensorstore creates, bulk-loads and exports the arrays; the host DRAM cache and the device caches
in front of this tier call :meth:`TierStore.read` and :meth:`TierStore.write`.

Crash safety is copy-on-write against hard-linked snapshots (:mod:`.snapshots`: the files on disk,
snapshots, restores, recovery). A working chunk file with more than one link is shared with a
snapshot: the first write to it copies it with ordinary file I/O (so a full disk is an error),
fsyncs the copy and renames it over the working name.

Every row written is written with its checksums and every row read is checked against them
(:mod:`.integrity`); a restore checks every row of the snapshot first, so a damaged snapshot
is refused before it replaces ``work/``.

Threads: a reader thread, a write-back thread and the dispatching thread may share one store.
Writes, snapshots, restores and exports take the store's lock, one at a time; reads take no
lock and may run beside a write (restores and closes need none in flight), so a read may see a
row half written: rows that fail their check are read again under the lock before they count
as damaged (a read ahead then drops them as stale, :meth:`TierStore.writes_since`). Each call's
requests run on the store's I/O threads. Every write is numbered (``write_seq``) and the rows it wrote are kept
until :meth:`TierStore.forget_writes`, so a read made ahead of time can tell which of its rows
a later write made stale (:meth:`TierStore.writes_since`).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections import deque
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from dlrm_jax.embedding.tiers.chunk_io import MIN_PER_THREAD, ChunkFiles, IOStats, plan_runs, requests
from dlrm_jax.embedding.tiers.format import (
    CHECKSUMS,
    COPY_BUFFER_BYTES,
    ArrayLayout,
    FieldSpec,
    RowInit,
    TierError,
    TierTables,
    as_bytes,
    checked_values,
    os_error,
    table_checksums,
)
from dlrm_jax.embedding.tiers.integrity import RowsDamaged, advice, damage, mismatched, verify_arrays
from dlrm_jax.embedding.tiers.snapshots import (
    build_work,
    checked_arrays,
    checked_snapshot,
    export_arrays,
    fsync,
    keep_only,
    link_snapshot,
    recover,
    snapshot_steps,
    swap_in_work,
    work_from_newest_snapshot,
)


def _copy_file(src: Path, dst: Path) -> None:
    """Copies with read/write, not mmap or reflink, and fsyncs: a full disk raises OSError here."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout, COPY_BUFFER_BYTES)
        fout.flush()
        os.fsync(fout.fileno())


class TierStore:
    """All tiered tables of a run under one directory, crash-safe by copy-on-write snapshots.

    ``tables`` (:data:`~dlrm_jax.embedding.tiers.format.TierTables`) maps each table to its
    rows and fields (per-row shape, dtype). Rows are read and written by index; a snapshot
    keeps the tables as they are at a step (hard links: only chunks written after it are
    copied), and a read-only view reads one while training goes on::

        tables = {"cat_0": (1_000_000, {"weight": ((16,), "float32")})}
        init = lambda table, start, stop: {"weight": np.zeros((stop - start, 16), np.float32)}
        store = dlrm_jax.TierStore.create("tier", tables, init)
        store.write("cat_0", np.array([3, 7]), {"weight": np.ones((2, 16), np.float32)})
        store.snapshot(1)
        store.read("cat_0", np.array([3, 4]))["weight"]  # [2, 16]: ones, then zeros
        view = dlrm_jax.TierStore.open_snapshot("tier", tables, 1)

    A training run's tier is made and driven for it (``embedding.storage=tiered``;
    docs/tiered-tables.md). Memory: open file descriptors of recently used chunk files, and
    each call's rows; nothing proportional to a table's rows.
    """

    def __init__(self, root: Path, arrays: dict[str, dict[str, ArrayLayout]]):
        self.root = Path(root).absolute()
        self._arrays = arrays
        self._files = ChunkFiles()
        self._lock = threading.RLock()  # writes, snapshots, restores, exports: one at a time
        self._log_lock = threading.Lock()  # write_seq and the log of written rows
        self.write_seq = 0  # writes made through this store
        # Reads through memory maps instead of requests: for a tier the page cache holds, where
        # a gather costs far less than a request per row (the owner decides; off by default).
        self.mapped = False
        self._written: dict[str, deque[tuple[int, np.ndarray]]] = {t: deque() for t in arrays}  # (seq, sorted rows)
        self._private: set[tuple[str, str, int]] = set()  # chunks known to have one link: writable
        self._dirty: set[tuple[str, str, int]] = set()  # chunks written since the last snapshot
        self._base = "work"  # or snapshots/<step> for a read-only view

    # -- opening -------------------------------------------------------------------------------

    @classmethod
    def open_snapshot(cls, root: Path, tables: TierTables, step: int) -> TierStore:
        """A read-only view of snapshot ``step`` (evaluating or exporting a run that may be
        training): nothing under ``root`` is changed or read but the snapshot. (It recovered
        what a crash interrupted first, as a writer does: the snapshot a training run was
        making, its ``<step>.tmp``, was removed under it, and the run committed a checkpoint
        whose snapshot lacked files.)"""
        root, base = Path(root).absolute(), Path("snapshots") / str(step)
        if not (root / base).is_dir():
            raise TierError(root / base, "missing: no such snapshot")
        store = cls(root, checked_arrays(root / base, tables))
        store._base = str(base)
        return store

    @classmethod
    def create(cls, root: Path, tables: TierTables, init: RowInit, chunk_rows: int | None = None) -> TierStore:
        """Creates the arrays and fills them with ``init(table, start, stop)``, one chunk at a time.

        ``chunk_rows`` defaults to about CHUNK_BYTES of the widest field; a table shorter than a
        chunk is one exact-size chunk. Refuses a root that already holds a store or snapshots."""
        return cls.open(build_work(root, tables, init, chunk_rows), tables)

    @property
    def read_only(self) -> bool:
        """A snapshot or directory view (:meth:`open_snapshot`, :meth:`open_directory`)."""
        return self._base != "work"

    @staticmethod
    def exists(root: Path) -> bool:
        """Whether ``root`` holds a store: its working files, or a restore's swap that a crash
        interrupted (no ``work/`` until :meth:`open` finishes it). Changes nothing: another
        run may be writing there (only the tier's writer, under its lock, recovers)."""
        root = Path(root).absolute()
        return (root / "work").is_dir() or (root / "work.old").is_dir()

    @staticmethod
    def rebuild_work(root: Path, step: int | None = None) -> int | None:
        """When ``root/work`` is gone but snapshots are there: ``work/`` made again from the
        newest snapshot (or ``step``'s; hard links, as a restore makes it: the copy-on-write
        keeps the snapshot whole); returns its step, or None when there is nothing to rebuild from."""
        return work_from_newest_snapshot(Path(root).absolute(), step)

    @classmethod
    def open(cls, root: Path, tables: TierTables) -> TierStore:
        """Opens the store at ``root`` to write it, after finishing or undoing what a crash
        interrupted there and checking every array's metadata and chunk files. For the tier's
        one writer (``tiers.tables`` holds its lock); readers use :meth:`open_snapshot`."""
        root = Path(root).absolute()
        if root.is_dir():
            recover(root)
        work = root / "work"
        if not work.is_dir():
            raise TierError(work, "missing: no tier store here")
        return cls(root, checked_arrays(work, tables))

    @classmethod
    def open_directory(cls, directory: Path, tables: TierTables) -> TierStore:
        """A read-only view of raw arrays ``directory/<table>/<field>`` outside any store (a
        serving artifact's tables): no snapshots, nothing written."""
        directory = Path(directory).absolute()
        store = cls(directory, checked_arrays(directory, tables))
        store._base = "."
        return store

    # -- rows ----------------------------------------------------------------------------------

    def rows(self, table: str) -> int:
        return next(iter(self._arrays[table].values())).rows

    def fields(self, table: str) -> dict[str, FieldSpec]:
        return {f: (a.shape, a.dtype) for f, a in self._arrays[table].items() if f != CHECKSUMS}

    def unverified_tables(self) -> list[str]:
        """Tables without row checksums (a store made before them): their reads are not checked."""
        return [t for t, arrays in self._arrays.items() if CHECKSUMS not in arrays]

    def chunk_rows(self, table: str) -> int:
        return next(iter(self._arrays[table].values())).chunk_rows

    def read(self, table: str, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Rows int64 [n], any order, repeats allowed -> {field: copies [n, *shape]}.

        Every field's rows are read in one batch of coalesced requests, all in flight at once
        (:mod:`.chunk_io`): the caller (a step) waits on them; a failed or short read is a
        TierError naming the file and rows."""
        return self.read_many({table: rows}, per_thread=1)[0][table]

    def read_many(
        self, wanted: dict[str, np.ndarray], per_thread: int = MIN_PER_THREAD
    ) -> tuple[dict[str, dict[str, np.ndarray]], int]:
        """Rows of several tables ({table: rows}) in one batch of requests: ({table: {field:
        copies}}, ``write_seq`` as the reads saw it). ``per_thread``: requests each I/O thread
        takes at least (:meth:`ChunkFiles.run`)."""
        seq = self.write_seq  # first: a write done before this has replaced files for us to see
        out = {}
        for table, (rows, order, got) in self._read_sorted(wanted, per_thread).items():
            self._check(table, rows, got)
            out[table] = {}
            for field, array in self._arrays[table].items():
                if field != CHECKSUMS:
                    values = np.empty((len(rows), *array.shape), array.np_dtype)
                    values[order] = got[field].view(array.np_dtype).reshape(len(rows), *array.shape)
                    out[table][field] = values
        return out, seq

    def _read_sorted(self, wanted: dict[str, np.ndarray], per_thread: int) -> dict:
        """{table: (its rows sorted, their order in ``wanted``, {array: bytes uint8 [n,
        row_bytes]})}: every array's rows, checksums included, in one batch of requests (or
        through memory maps when ``mapped``)."""
        out, placed, todo = {}, [], []
        for table, rows in wanted.items():
            rows = self._checked_rows(table, rows)
            order = np.argsort(rows, kind="stable")
            rows = rows[order]
            out[table] = (rows, order, {})
            for name, array in self._arrays[table].items():
                directory, suffix = self._directory(table, name)
                if self.mapped:
                    got = self._files.gather_rows(directory, suffix, array.chunk_rows, array.row_bytes, rows)
                    out[table][2][name] = got
                    continue
                rb = array.row_bytes
                chunks, firsts, lengths, index = plan_runs(rows, array.chunk_rows, 1 + self._files.gap_bytes // rb)
                scratch = np.empty((int(lengths.sum()), rb), np.uint8)
                buffer = memoryview(scratch).cast("B")
                todo.append(requests(directory, suffix, chunks, firsts, lengths, rb, array.chunk_rows, buffer, table))
                placed.append((out[table][2], name, scratch, index))
        self._files.run(todo, write=False, per_thread=per_thread)
        for got, name, scratch, index in placed:
            got[name] = scratch[index]
        return out

    def _check(self, table: str, rows: np.ndarray, got: dict[str, np.ndarray]) -> None:
        """Rows of ``got`` that fail their checksums are read again with no write beside the
        read (a write in flight may have torn them); fixed in ``got`` if they pass then, else
        a :class:`RowsDamaged` that says what to do."""
        bad = mismatched(self._arrays[table], got, rows)
        if bad is None or not bad.any():
            return
        redo = bad.any(axis=1)
        again = np.unique(rows[redo])
        with self._lock:
            _, _, fresh = self._read_sorted({table: again}, per_thread=1)[table]
        still = mismatched(self._arrays[table], fresh, again)
        if still.any():
            raise self._advised(damage(self.root / self._base / table, table, self._arrays[table], still, again))
        at = np.searchsorted(again, rows[redo])
        for name, v in got.items():
            v[redo] = fresh[name][at]

    def write(self, table: str, rows: np.ndarray, values: dict[str, np.ndarray]) -> None:
        """Writes distinct rows [n] of every field (``values[field]``: [n, *shape]; some of
        them only in a store without checksums), with their checksums.

        Chunks shared with a snapshot are all copied before any row is written: if a copy fails
        (TierError, e.g. ENOSPC) the store's contents are unchanged. Adjacent rows are written
        in one request, many requests in flight (``mapped``: through memory maps)."""
        if self.read_only:
            raise TierError(self.root / self._base, "a snapshot view is read-only")
        rows = self._checked_rows(table, rows)
        arrays = self._arrays[table]
        values = {f: checked_values(table, f, arrays[f], values, len(rows)) for f in values}
        if CHECKSUMS in arrays:
            missing = sorted(arrays.keys() - values.keys() - {CHECKSUMS})
            if missing:
                raise ValueError(f"{table}: write() needs every field (their checksums cover them all): no {missing}")
            values[CHECKSUMS] = table_checksums(values, rows)
        if len(np.unique(rows)) != len(rows):
            raise ValueError(f"{table}: write() needs distinct rows")
        order = np.argsort(rows)
        sorted_rows = rows[order]
        with self._lock:
            touched = {f: np.unique(sorted_rows // arrays[f].chunk_rows).tolist() for f in values}
            for field, chunks in touched.items():
                for chunk in chunks:  # every copy first: a full disk changes nothing
                    self._make_private((table, field, chunk))
            todo = []
            for field, v in values.items():
                array, (directory, suffix), data = arrays[field], self._directory(table, field), as_bytes(v[order])
                if self.mapped:  # through shared memory maps (the page cache; a snapshot's fsync makes them durable)
                    self._files.scatter_rows(directory, suffix, array.chunk_rows, array.row_bytes, sorted_rows, data)
                else:
                    chunks, firsts, lengths, _ = plan_runs(sorted_rows, array.chunk_rows, 1)
                    buffer = memoryview(data.reshape(-1))
                    rb, cr = array.row_bytes, array.chunk_rows
                    todo.append(requests(directory, suffix, chunks, firsts, lengths, rb, cr, buffer, table))
                self._dirty.update((table, field, c) for c in touched[field])
            self._files.run(todo, write=True)
            with self._log_lock:
                self.write_seq += 1
                self._written[table].append((self.write_seq, sorted_rows))

    def writes_since(self, table: str, seq: int) -> list[np.ndarray]:
        """Sorted rows of ``table`` of each write after the one numbered ``seq`` (``write_seq``
        when a read began): that read may hold older contents of them."""
        with self._log_lock:
            return [rows for s, rows in self._written[table] if s > seq]

    def forget_writes(self, through: int) -> None:
        """No read that began at write ``through`` or earlier is still to be checked."""
        with self._log_lock:
            for log in self._written.values():
                while log and log[0][0] <= through:
                    log.popleft()

    @property
    def io_stats(self) -> IOStats:
        """Requests and bytes read and written since the store was opened."""
        return self._files.stats

    # -- snapshots -----------------------------------------------------------------------------

    def snapshot(self, step: int) -> None:
        """Makes the current contents durable as ``snapshots/<step>/`` (replacing one of that step)."""
        with self._lock:
            self._sync_dirty()
            link_snapshot(self.root, self._arrays, step)
            self._forget_chunks()  # every working chunk is now shared with the snapshot

    def restore(self, step: int, verify: bool = True) -> None:
        """Makes ``work/`` equal snapshot ``step``, discarding writes made since; re-runnable.
        ``verify``: every row of the snapshot is checked first (a RowsDamaged changes nothing);
        the caller may skip that for a snapshot it has just made from rows it wrote."""
        with self._lock:
            source = checked_snapshot(self.root, self._arrays, step)
            if verify:
                try:
                    verify_arrays(source, self._arrays)
                except RowsDamaged as e:
                    raise self._advised(e, resuming=False) from None
            self._forget_chunks()
            self._dirty.clear()
            swap_in_work(self.root, self._arrays, source)

    def snapshots(self) -> list[int]:
        return snapshot_steps(self.root)

    def keep_snapshots(self, steps: Iterable[int]) -> None:
        """Deletes every snapshot not in ``steps`` (working chunks they shared may become private)."""
        keep_only(self.root, steps)

    def export(self, dest: Path, table: str | None = None, snapshot: int | None = None) -> None:
        """Writes the tables (or one), from ``work/`` or a snapshot, as zstd-compressed zarr3 arrays
        ``dest/<table>/<field>`` with the same chunking, one chunk at a time. Refuses existing ones."""
        with self._lock:
            export_arrays(self.root, self._arrays, Path(dest).absolute(), table, snapshot)

    def close(self) -> None:
        """Closes every chunk file and the I/O threads; only :meth:`snapshot` makes writes durable."""
        with self._lock:
            self._forget_chunks()
            self._files.close()

    def __enter__(self) -> TierStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- chunk files ---------------------------------------------------------------------------

    def _directory(self, table: str, field: str) -> tuple[str, str]:
        """The folder of a field's chunk files, and the suffix of their names after ``c.<i>``."""
        return f"{self.root / self._base / table / field}", ".0" * len(self._arrays[table][field].shape)

    def _path(self, key: tuple[str, str, int]) -> Path:
        table, field, chunk = key
        return self.root / self._base / table / field / self._arrays[table][field].chunk_name(chunk)

    def _advised(self, e: RowsDamaged, resuming: bool = True) -> RowsDamaged:
        """``e`` with :func:`~.integrity.advice` (``resuming``: found reading ``work/``)."""
        if self._base == ".":  # a directory view: no snapshots
            return e
        said = advice(self.root, e.path, self.snapshots(), resuming and not self.read_only)
        return RowsDamaged(e.path, f"{e.what}; {said}" if said else e.what)

    def _checked_rows(self, table: str, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, np.int64)
        if rows.ndim != 1:
            raise ValueError(f"{table}: rows must be 1-D, got shape {rows.shape}")
        if len(rows) and (rows.min() < 0 or rows.max() >= self.rows(table)):
            raise IndexError(f"{table}: rows outside [0, {self.rows(table)})")
        return rows

    def _make_private(self, key: tuple[str, str, int]) -> None:
        """Copies the chunk file if a snapshot shares it (more than one hard link)."""
        if key in self._private:
            return
        path = self._path(key)
        if path.stat().st_nlink > 1:
            tmp = path.with_name(path.name + ".cow")
            try:
                _copy_file(path, tmp)
                os.replace(tmp, path)
                self._files.replaced(str(path))  # every thread reopens it: the copy
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise os_error(path, e, " (copying a chunk shared with a snapshot)") from None
        self._private.add(key)

    def _sync_dirty(self) -> None:
        for key in sorted(self._dirty):
            path = self._path(key)
            try:
                fsync(path)
            except OSError as e:
                raise os_error(path, e) from None
        self._dirty.clear()

    def _forget_chunks(self) -> None:
        self._files.replaced()  # every working file may be another (restore) or shared (snapshot)
        self._private.clear()
