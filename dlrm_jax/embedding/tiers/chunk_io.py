"""Row reads and writes on the tier's chunk files: coalesced ``pread``/``pwrite`` calls, many in flight.

A chunk file holds ``chunk_rows`` rows of one field back to back (:mod:`.format`), so the rows a
call needs are byte ranges. Rows of one chunk closer than ``gap_bytes`` apart are read in one
request (a page read for one row holds its neighbours, and frequency-ordered vocabularies put the
rows used together side by side); writes join only adjacent rows. The requests are split over a
pool of ``threads`` threads, each issuing its share one after another, so about ``threads`` are
in flight at the device at once: a disk that serves 15k random reads a second one at a time
serves eight times that with 32 queued (BENCHMARKS.md, disk figures).

Each file is opened once (the fds stay open, least recently used closed past ``max_open``) with
``POSIX_FADV_RANDOM``: the kernel's readahead would otherwise turn each small read into tens of
pages the tier never asked for. Reads go through the page cache; a short read (a chunk file cut
short after it was opened) is a :class:`TierError` naming the file and the rows.

Threads: several threads may call at once (a reader, a writer, the dispatching thread), each
with its own open files; their requests share one pool.
"""

from __future__ import annotations

import os
import resource
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from dlrm_jax.embedding.tiers.format import TierError, os_error
from dlrm_jax.observe.threads import name_os_thread

IO_THREADS = 32
GAP_BYTES = 4096
# Requests per thread at least for a call made ahead of its need: a call of a few hundred mostly
# hits the page cache or is small, where waking 32 threads costs more than the reads (tables
# that fit in RAM: 53 ms a step). A caller waiting on its rows asks for every request in flight.
MIN_PER_THREAD = 256


@dataclass
class IOStats:
    """Requests and bytes since the store was opened (one ``pread`` or ``pwrite`` each)."""

    reads: int = 0
    read_bytes: int = 0
    writes: int = 0
    write_bytes: int = 0


def plan_runs(rows: np.ndarray, chunk_rows: int, limit: int) -> tuple[np.ndarray, ...]:
    """Requests for sorted table ``rows`` (repeats allowed): runs of rows within one chunk, a
    new run where the next row is more than ``limit`` rows past the previous one (1: only
    adjacent rows join). Returns per run its chunk, first row in the chunk and length in rows,
    and per row its index in the runs' rows laid back to back."""
    if not len(rows):
        z = np.zeros(0, np.int64)
        return z, z, z, z
    chunk = rows // chunk_rows
    breaks = np.flatnonzero((np.diff(chunk) != 0) | (np.diff(rows) > limit)) + 1
    starts = np.concatenate([[0], breaks]).astype(np.int64)
    ends = np.append(starts[1:], len(rows))
    first, lengths = rows[starts], rows[ends - 1] - rows[starts] + 1
    base = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    run_of = np.repeat(np.arange(len(starts)), ends - starts)
    return chunk[starts], first - chunk[starts] * chunk_rows, lengths, base[run_of] + rows - first[run_of]


@dataclass
class Requests:
    """The runs of :func:`plan_runs` on one field's chunk files, as arrays: per run its file
    (an index into ``paths``), byte offset in the file, bytes, and start in ``buffer`` (the
    runs' bytes back to back), and its first table row (for errors). Arrays, not a tuple per
    run: a step of the tier larger than RAM reads about 7,000 runs."""

    paths: list[str]
    file: np.ndarray
    offset: np.ndarray
    nbytes: np.ndarray
    start: np.ndarray
    first_row: np.ndarray
    row_bytes: int
    buffer: memoryview
    table: str = ""

    def __len__(self) -> int:
        return len(self.file)

    def rows(self, i: int) -> str:
        """Run ``i``'s rows, for an error message."""
        first = int(self.first_row[i])
        last = first + int(self.nbytes[i]) // self.row_bytes - 1
        span = f"row {first}" if first == last else f"rows {first}..{last}"
        return f"{self.table} {span}" if self.table else span


def requests(
    directory: str,
    suffix: str,
    chunks,
    firsts,
    lengths,
    row_bytes: int,
    chunk_rows: int,
    buffer: memoryview,
    table: str = "",
) -> Requests:
    """The runs of :func:`plan_runs` as :class:`Requests` on the chunk files of ``directory``
    (of ``table``), their bytes back to back in ``buffer``."""
    files, file = np.unique(np.asarray(chunks, np.int64), return_inverse=True)
    nbytes = np.asarray(lengths, np.int64) * row_bytes
    return Requests(
        [f"{directory}/c.{c}{suffix}" for c in files.tolist()],
        file.reshape(-1),
        np.asarray(firsts, np.int64) * row_bytes,
        nbytes,
        np.cumsum(nbytes) - nbytes,
        np.asarray(chunks, np.int64) * chunk_rows + firsts,
        row_bytes,
        buffer,
        table,
    )


class _OpenFiles:
    """One thread's open chunk files: path -> (fd, writable, generation of the path when opened)."""

    def __init__(self):
        self.fds: OrderedDict[str, tuple[int, bool, int]] = OrderedDict()
        self.maps: OrderedDict[tuple[str, bool], tuple[np.ndarray, int]] = OrderedDict()  # (path, writable)
        self.generation = 0  # ChunkFiles.generation these were checked against

    def close(self) -> None:
        for fd, _, _ in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self.maps.clear()

    def __del__(self):
        # A store dropped without close() (a serving model reloaded and let go): its
        # descriptors go with it (each reload kept one a chunk file open for good).
        try:
            self.close()
        except Exception:  # (at interpreter exit, or a descriptor closed elsewhere)
            pass


class ChunkFiles:
    """Open chunk files of one store, and the thread pool that reads and writes them.

    Each calling thread has its own open files (a reader thread's read never uses a
    descriptor another thread closes). A file replaced under its path (a copy-on-write) or all
    files (a snapshot, a restore) are marked by :meth:`replaced`; each thread reopens them at
    its next request for them."""

    def __init__(self, threads: int | None = None, gap_bytes: int = GAP_BYTES, max_open: int | None = None):
        self.threads, self.gap_bytes = threads or IO_THREADS, gap_bytes
        # Per calling thread (a reader, a writer, the dispatcher, a few more): an eighth of the
        # process's descriptor limit each, at most 4096 (a 30 GiB tier of 64 MiB chunks: ~1,000).
        self.max_open = max_open or max(64, min(4096, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 8))
        self._local = threading.local()
        self._every: list[_OpenFiles] = []
        self._lock = threading.Lock()
        self.generation = 0  # bumped when every file may have been replaced
        self._path_generation: dict[str, int] = {}  # bumped when that file was replaced
        self._pool: ThreadPoolExecutor | None = None
        self.stats = IOStats()

    # -- file descriptors ----------------------------------------------------------------------
    def _open_files(self) -> _OpenFiles:
        mine = getattr(self._local, "files", None)
        if mine is None:
            mine = self._local.files = _OpenFiles()
            with self._lock:
                self._every.append(mine)
        if mine.generation != self.generation:
            mine.close()
            mine.generation = self.generation
        return mine

    def _fd(self, files: _OpenFiles, path: str, writable: bool) -> int:
        generation = self._path_generation.get(path, 0)
        held = files.fds.get(path)
        if held is not None and (held[1] or not writable) and held[2] == generation:
            files.fds.move_to_end(path)
            return held[0]
        if held is not None:
            os.close(files.fds.pop(path)[0])
        try:
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        except OSError as e:
            raise os_error(path, e) from None
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        files.fds[path] = (fd, writable, generation)
        while len(files.fds) > self.max_open:
            os.close(files.fds.popitem(last=False)[1][0])
        return fd

    def _mapped(self, path: str, chunk_rows: int, row_bytes: int, writable: bool) -> np.ndarray:
        """This thread's memory map of a chunk file as uint8 [chunk_rows, row_bytes]."""
        files = self._open_files()
        key, generation = (path, writable), self._path_generation.get(path, 0)
        held = files.maps.get(key)
        if held is None or held[1] != generation:
            try:
                rows = np.memmap(path, np.uint8, "r+" if writable else "r", shape=(chunk_rows, row_bytes))
            except (OSError, ValueError) as e:
                raise TierError(path, str(e)) from None
            files.maps[key] = held = (rows.view(np.ndarray), generation)
            while len(files.maps) > self.max_open:
                files.maps.popitem(last=False)
        files.maps.move_to_end(key)
        return held[0]

    def gather(self, path: str, chunk_rows: int, row_bytes: int, offsets: np.ndarray) -> np.ndarray:
        """Rows at ``offsets`` of one chunk file (uint8 [n, row_bytes]) through a memory map of
        it: one gather in C, for a tier the page cache holds (a page not there is read on this
        thread, one fault at a time)."""
        with self._lock:
            self.stats.reads += 1
            self.stats.read_bytes += len(offsets) * row_bytes
        return self._mapped(path, chunk_rows, row_bytes, False)[offsets]

    def gather_rows(self, directory: str, suffix: str, chunk_rows: int, row_bytes: int, rows: np.ndarray) -> np.ndarray:
        """Sorted table ``rows`` of one array's chunk files ``directory/c.<i><suffix>`` through
        memory maps (:meth:`gather`, a chunk at a time): uint8 [n, row_bytes]."""
        out = np.empty((len(rows), row_bytes), np.uint8)
        chunk = rows // chunk_rows
        bounds = [0, *(np.flatnonzero(np.diff(chunk)) + 1).tolist(), len(rows)]
        for s, e in zip(bounds[:-1], bounds[1:], strict=True):
            if s < e:
                c = int(chunk[s])
                out[s:e] = self.gather(f"{directory}/c.{c}{suffix}", chunk_rows, row_bytes, rows[s:e] - c * chunk_rows)
        return out

    def scatter(self, path: str, chunk_rows: int, row_bytes: int, offsets: np.ndarray, data: np.ndarray) -> None:
        """Rows ``data`` (uint8 [n, row_bytes]) to ``offsets`` of one chunk file through a
        shared memory map (the page cache; a snapshot's fsync makes them durable)."""
        with self._lock:
            self.stats.writes += 1
            self.stats.write_bytes += data.nbytes
        self._mapped(path, chunk_rows, row_bytes, True)[offsets] = data

    def scatter_rows(
        self, directory: str, suffix: str, chunk_rows: int, row_bytes: int, rows: np.ndarray, data: np.ndarray
    ) -> None:
        """:meth:`scatter` of sorted table ``rows`` (``data``: uint8 [n, row_bytes]) over one
        array's chunk files ``directory/c.<i><suffix>``, a chunk at a time."""
        chunk = rows // chunk_rows
        bounds = [0, *(np.flatnonzero(np.diff(chunk)) + 1).tolist(), len(rows)]
        for s, e in zip(bounds[:-1], bounds[1:], strict=True):
            if s < e:
                c = int(chunk[s])
                self.scatter(f"{directory}/c.{c}{suffix}", chunk_rows, row_bytes, rows[s:e] - c * chunk_rows, data[s:e])

    def replaced(self, path: str | None = None) -> None:
        """``path`` (None: every file) was replaced: each thread reopens it before its next use."""
        with self._lock:
            if path is None:
                self.generation += 1
            else:
                self._path_generation[path] = self._path_generation.get(path, 0) + 1

    def close(self) -> None:
        """Closes every thread's files and the pool (no request may be in flight)."""
        with self._lock:
            for files in self._every:
                files.close()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    # -- requests ------------------------------------------------------------------------------
    def run(self, batches: list[Requests], write: bool, per_thread: int = MIN_PER_THREAD) -> None:
        """Issue every run of ``batches`` (from :func:`requests`) with up to ``threads`` in
        flight, each thread given ``per_thread`` requests at least (1: as many in flight as
        there are requests, for a caller that waits on them); the first error is raised (a
        TierError naming the file and the rows) once every request finished."""
        batches = [b for b in batches if len(b)]
        if not batches:
            return
        files = self._open_files()
        fds, offsets, views, where = [], [], [], []
        for k, b in enumerate(batches):  # one descriptor look-up per file, not per run
            fd_of = np.array([self._fd(files, path, write) for path in b.paths], np.int64)
            fds += fd_of[b.file].tolist()
            offsets += b.offset.tolist()
            views += [b.buffer[s : s + n] for s, n in zip(b.start.tolist(), b.nbytes.tolist(), strict=True)]
            where += [k] * len(b)
        n, nbytes = len(fds), sum(int(b.nbytes.sum()) for b in batches)
        with self._lock:
            if write:
                self.stats.writes += n
                self.stats.write_bytes += nbytes
            else:
                self.stats.reads += n
                self.stats.read_bytes += nbytes
        parts = min(self.threads, -(-n // per_thread))
        bounds = [n * k // parts for k in range(parts + 1)]
        call = os.pwritev if write else os.preadv
        doing = "write" if write else "read"

        def named(i: int) -> tuple[str, str]:
            """Request ``i``'s file and rows (for an error)."""
            b = batches[where[i]]
            run = i - sum(len(x) for x in batches[: where[i]])
            return b.paths[b.file[run]], b.rows(run)

        def issue(k: int) -> TierError | None:
            for i in range(bounds[k], bounds[k + 1]):
                view = views[i]
                try:
                    done = call(fds[i], [view], offsets[i])
                except OSError as e:
                    path, rows = named(i)
                    return os_error(path, e, f" ({doing}ing {rows})")
                if done != view.nbytes:
                    path, rows = named(i)
                    return TierError(
                        path, f"short {doing}: {done} of {view.nbytes} bytes at offset {offsets[i]} ({rows})"
                    )
            return None

        if parts == 1:
            errors = [issue(0)]
        else:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(
                        self.threads, thread_name_prefix="tier-io", initializer=name_os_thread
                    )
            errors = list(self._pool.map(issue, range(parts)))
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise error
