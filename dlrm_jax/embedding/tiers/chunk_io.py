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

Threads: the methods may be called from any one thread at a time (the store's lock); the pool's
threads only run the requests of the call in progress.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dlrm_jax.embedding.tiers.format import TierError, os_error

IO_THREADS = 32
GAP_BYTES = 4096


@dataclass
class IOStats:
    """Requests and bytes since the store was opened (one ``pread`` or ``pwrite`` each)."""

    reads: int = 0
    read_bytes: int = 0
    writes: int = 0
    write_bytes: int = 0
    read_s: float = 0.0  # wall time of read calls


@dataclass(frozen=True)
class _Request:
    """One contiguous byte range of one chunk file, and the rows it serves."""

    path: Path
    offset: int  # bytes into the file
    buffer: memoryview  # where the bytes land (reads) or come from (writes)
    first_row: int  # the table rows it spans, for errors
    last_row: int


def spans(offsets: np.ndarray, row_bytes: int, gap_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sorted row ``offsets`` of one chunk file grouped into reads: a new read starts where the
    next row begins more than ``gap_bytes`` past the previous one's end. Returns each read's
    first row and length in rows, and each offset's read."""
    breaks = np.flatnonzero(np.diff(offsets) > 1 + gap_bytes // row_bytes) + 1
    starts = np.concatenate([[0], breaks]).astype(np.int64)
    ends = np.append(starts[1:], len(offsets))
    first = offsets[starts]
    return first, offsets[ends - 1] - first + 1, np.repeat(np.arange(len(starts)), ends - starts)


class ChunkFiles:
    """Open chunk files of one store, and the thread pool that reads and writes them."""

    def __init__(self, threads: int = IO_THREADS, gap_bytes: int = GAP_BYTES, max_open: int = 1024):
        self.threads, self.gap_bytes, self.max_open = threads, gap_bytes, max_open
        self._fds: OrderedDict[Path, tuple[int, bool]] = OrderedDict()  # path -> (fd, writable)
        self._pool: ThreadPoolExecutor | None = None
        self.stats = IOStats()

    # -- file descriptors ----------------------------------------------------------------------
    def _fd(self, path: Path, writable: bool) -> int:
        held = self._fds.get(path)
        if held is not None and (held[1] or not writable):
            self._fds.move_to_end(path)
            return held[0]
        self.forget(path)
        try:
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        except OSError as e:
            raise os_error(path, e) from None
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._fds[path] = (fd, writable)
        while len(self._fds) > self.max_open:
            os.close(self._fds.popitem(last=False)[1][0])
        return fd

    def forget(self, path: Path) -> None:
        """Close ``path`` (it is about to be replaced: a copy-on-write renames over it)."""
        held = self._fds.pop(path, None)
        if held is not None:
            os.close(held[0])

    def close_files(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def close(self) -> None:
        self.close_files()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    # -- requests ------------------------------------------------------------------------------
    @staticmethod
    def read_requests(
        path: Path, first: np.ndarray, lengths: np.ndarray, row_bytes: int, base_row: int, scratch: memoryview
    ) -> list[_Request]:
        """Requests reading ``lengths[i]`` rows from chunk row ``first[i]`` of one file, back to
        back into ``scratch`` (bytes; ``base_row``: the table row of the chunk's first)."""
        at = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * row_bytes
        return [
            _Request(path, f * row_bytes, scratch[a : a + n * row_bytes], base_row + f, base_row + f + n - 1)
            for f, n, a in zip(first.tolist(), lengths.tolist(), at.tolist(), strict=True)
        ]

    @staticmethod
    def write_requests(
        path: Path, offsets: np.ndarray, row_bytes: int, base_row: int, data: memoryview
    ) -> list[_Request]:
        """Requests writing ``data`` (the rows' bytes back to back) to sorted distinct row
        ``offsets`` of one chunk file, adjacent rows joined into one request."""
        starts = np.concatenate([[0], np.flatnonzero(np.diff(offsets) != 1) + 1]).astype(np.int64)
        ends = np.append(starts[1:], len(offsets))
        return [
            _Request(
                path,
                int(offsets[a]) * row_bytes,
                data[a * row_bytes : b * row_bytes],
                base_row + int(offsets[a]),
                base_row + int(offsets[b - 1]),
            )
            for a, b in zip(starts.tolist(), ends.tolist(), strict=True)
        ]

    def run(self, requests: list[_Request], write: bool, table: str = "") -> None:
        """Issue ``requests`` with up to ``threads`` in flight; the first error is raised (a
        TierError naming the file and the rows) once every request finished."""
        if not requests:
            return
        fds = [self._fd(r.path, write) for r in requests]
        n = len(requests)
        if write:
            self.stats.writes += n
            self.stats.write_bytes += sum(r.buffer.nbytes for r in requests)
        else:
            self.stats.reads += n
            self.stats.read_bytes += sum(r.buffer.nbytes for r in requests)
        parts = min(self.threads, n)
        bounds = [n * k // parts for k in range(parts + 1)]

        def issue(k: int) -> TierError | None:
            for i in range(bounds[k], bounds[k + 1]):
                r = requests[i]
                try:
                    done = (
                        os.pwritev(fds[i], [r.buffer], r.offset) if write else os.preadv(fds[i], [r.buffer], r.offset)
                    )
                except OSError as e:
                    return os_error(r.path, e, f" ({'writing' if write else 'reading'} {_rows(table, r)})")
                if done != r.buffer.nbytes:
                    return TierError(
                        r.path,
                        f"short {'write' if write else 'read'}: {done} of {r.buffer.nbytes} bytes at offset {r.offset} ({_rows(table, r)})",
                    )
            return None

        if parts == 1:
            errors = [issue(0)]
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tier-io")
            errors = list(self._pool.map(issue, range(parts)))
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise error


def _rows(table: str, r: _Request) -> str:
    span = f"row {r.first_row}" if r.first_row == r.last_row else f"rows {r.first_row}..{r.last_row}"
    return f"{table} {span}" if table else span
