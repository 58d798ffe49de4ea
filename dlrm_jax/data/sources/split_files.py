"""One split of a binary dataset (:mod:`dlrm_jax.data.shards`) as one row space: its shards'
files read by ``pread`` into caller-given arrays, through a bounded set of open files."""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from pathlib import Path

import numpy as np

from dlrm_jax.data.shards import BinaryFormatError, open_shard, shard_name

_OPEN_FILES = 192  # per split: 64 shards of 3 arrays


class SplitFiles:
    """One split's shards as one row space. The shards overlapping ``[lo, hi)`` are checked
    at start; reads go through at most ``_OPEN_FILES`` open files (least recently used)."""

    def __init__(self, root: Path, split: str, sizes: list[int], widths: dict, lo: int, hi: int):
        self.root, self.name = root, split
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.shards = {
            k: open_shard(root / split / shard_name(k), n, widths)
            for k, n in enumerate(sizes)
            if n and self.starts[k] < hi and self.starts[k + 1] > lo
        }
        self._open_files()

    def _open_files(self) -> None:
        self._fds: OrderedDict[Path, int] = OrderedDict()
        self._lock = threading.Lock()  # reader threads share the open files
        # closed with the split too: a notebook's runs, each making a source, kept every file open
        weakref.finalize(self, _close_all, self._fds, self._lock)

    def close(self) -> None:
        """Closes the open files (a read after it opens them again)."""
        _close_all(self._fds, self._lock)

    def _fd(self, path: Path) -> int:
        with self._lock:
            fd = self._fds.pop(path, None)
            if fd is None:
                fd = os.open(path, os.O_RDONLY)
                while len(self._fds) >= _OPEN_FILES:
                    os.close(self._fds.popitem(last=False)[1])
            self._fds[path] = fd
            return fd

    def read(self, runs: list[tuple[int, int]]) -> dict[str, np.ndarray]:
        """The arrays at the split rows of ``runs`` ((first row, length) each), in order."""
        n = sum(length for _, length in runs)
        first = next(iter(self.shards.values()))
        out = {k: np.empty((n, *a.shape[1:]), a.dtype) for k, a in first.items()}
        self.read_into(runs, [out])
        return out

    def read_into(self, runs: list[tuple[int, int]], parts: list[dict[str, np.ndarray]]) -> None:
        """The rows of ``runs``, in order, into ``parts``: consecutive pieces of the rows,
        each a C-contiguous array per field it names (fields it does not name are not read).
        One ``pread`` per contiguous piece of a run, shard and part."""
        part, at = 0, 0
        for start, length in runs:
            while length:  # a run may cross into the next shard, or the next part
                k = int(np.searchsorted(self.starts, start, side="right")) - 1
                files = self.shards.get(k)
                if files is None:
                    raise BinaryFormatError(f"{self.root / self.name / shard_name(k)}: read but not opened")
                while at == len(next(iter(parts[part].values()))):
                    part, at = part + 1, 0
                lo = start - int(self.starts[k])
                room = len(next(iter(parts[part].values()))) - at
                take = min(length, int(self.starts[k + 1]) - start, room)
                for name, f in files.items():
                    if name in parts[part]:
                        f.read_into(self._fd(f.path), parts[part][name][at : at + take], lo)
                at, start, length = at + take, start + take, length - take

    def __getstate__(self) -> dict:  # picklable (worker processes open their own files)
        return {k: v for k, v in self.__dict__.items() if k not in ("_fds", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open_files()


def _close_all(fds: OrderedDict, lock: threading.Lock) -> None:
    """Closes a split's open files."""
    with lock:
        while fds:
            os.close(fds.popitem()[1])


def runs_of(rows: np.ndarray) -> list[tuple[int, int]]:
    """int64 [n] rows -> (first row, length) of each contiguous ascending run."""
    if not len(rows):
        return []
    cuts = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate([[0], cuts])
    lengths = np.diff(np.concatenate([starts, [len(rows)]]))
    return list(zip(rows[starts].tolist(), lengths.tolist(), strict=True))
