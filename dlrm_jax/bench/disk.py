"""What a disk allows: 4 KiB random reads at queue depth 1 and 32, as fio measures them.

``bench tiers`` runs this on the tier directory's device before its cases, so that the tier's
own read rate can be held against the disk's: a file of its own (``size`` bytes of random
data, fsynced), read with ``O_DIRECT`` (no page cache: every read reaches the device) at
random 4 KiB-aligned offsets by ``depth`` threads, each with one read in flight, for
``seconds``. Where ``O_DIRECT`` is refused (tmpfs, some overlay filesystems) the reads go
through the page cache after ``POSIX_FADV_DONTNEED`` and the result says so.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path

import numpy as np

BLOCK = 4096
WRITE_BYTES = 8 << 20


def _write_probe_file(path: Path, size: int) -> None:
    block = np.random.default_rng(0).integers(0, 256, WRITE_BYTES, np.uint8).tobytes()
    with open(path, "wb") as f:
        for start in range(0, size, WRITE_BYTES):
            f.write(block[: min(WRITE_BYTES, size - start)])
        f.flush()
        os.fsync(f.fileno())


def _open_uncached(path: Path) -> tuple[int, bool]:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT), True
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return fd, False


def _random_reads(fd: int, blocks: int, depth: int, seconds: float) -> tuple[int, float]:
    """(reads done, wall seconds) with ``depth`` threads reading one block at a time."""
    counts = [0] * depth
    stop = time.perf_counter() + seconds

    def reader(k: int) -> None:
        buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
        offsets = np.random.default_rng(k).integers(0, blocks, 1 << 16) * BLOCK
        n = 0
        while time.perf_counter() < stop:
            for off in offsets[n % len(offsets) : n % len(offsets) + 64].tolist():
                os.preadv(fd, [buf], off)
            n += 64
        counts[k] = n
        buf.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=reader, args=(k,)) for k in range(depth)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts), time.perf_counter() - t0


def probe_disk(directory: Path, size: int = 1 << 30, seconds: float = 3.0, depths=(1, 32)) -> dict:
    """Random 4 KiB read rates of the device holding ``directory``: {"disk_iops_qd<d>": reads
    per second, "disk_latency_us_qd<d>": mean latency, "disk_probe": how}."""
    path = Path(directory) / f".disk-probe-{os.getpid()}.bin"
    try:
        _write_probe_file(path, size)
        fd, direct = _open_uncached(path)
        try:
            out = {
                "disk_probe": f"{size >> 20} MiB file, 4 KiB random reads, {'O_DIRECT' if direct else 'page cache dropped'}, {seconds:g} s per depth"
            }
            for depth in depths:
                done, wall = _random_reads(fd, size // BLOCK, depth, seconds)
                out[f"disk_iops_qd{depth}"] = done / wall
                out[f"disk_latency_us_qd{depth}"] = 1e6 * wall * depth / max(done, 1)
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return out
