"""Host memory of this process: current and peak resident set size (Linux ``/proc``), and how
the C library's allocator is asked to treat it (huge pages; freed buffers kept for reuse).

On simulated CPU devices every device buffer is host memory, so the process's peak RSS is the
memory of the whole mesh: what the plan's bytes are compared with.
"""

from __future__ import annotations

import ctypes
import resource
from pathlib import Path

_STATUS = Path("/proc/self/status")


def _status_kib(field: str, path: Path = _STATUS) -> int | None:
    """A ``Field:  N kB`` line of a /proc file, in KiB (None where unreadable or absent)."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def available_bytes() -> int | None:
    """Memory the kernel says can be allocated without swapping (``MemAvailable``: free memory
    plus the page cache it can drop); None where /proc/meminfo does not say."""
    kib = _status_kib("MemAvailable", Path("/proc/meminfo"))
    return None if kib is None else kib * 1024


def rss_bytes() -> int:
    """Resident set size now."""
    kib = _status_kib("VmRSS")
    return (kib if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def peak_rss_bytes() -> int:
    """Peak resident set size since the process started or :func:`reset_peak_rss`."""
    kib = _status_kib("VmHWM")
    return (kib if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reset_peak_rss() -> bool:
    """Start a new peak from the current RSS (Linux: writing 5 to /proc/self/clear_refs);
    False where the kernel does not allow it (then peaks include earlier phases)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------- transparent huge pages
# Embedding lookups and sparse updates touch rows scattered over gigabytes of tables. With 4 KiB
# pages nearly every row costs a TLB miss and a page walk; with 2 MiB transparent huge pages the
# same gather ran 2.5x faster here and the whole c2 step about 1.25x (BENCHMARKS.md). Most
# kernels ship THP in "madvise" mode, so memory gets huge pages only when asked for, and XLA's
# CPU allocator does not ask. glibc's malloc asks for every large allocation when started with
# this tunable; tunables are read once at process start, hence a restart of the CLI.
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
HUGE_PAGES_OPT_OUT = "DLRM_JAX_HUGE_PAGES"  # set to 0 to keep the kernel's default pages
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_environment(environ: dict[str, str]) -> dict[str, str] | None:
    """``environ`` plus the glibc tunable that asks for huge pages, or None when a restart
    would change nothing: already set, opted out, THP not in madvise mode, or not Linux."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if environ.get(HUGE_PAGES_OPT_OUT, "1") == "0" or "glibc.malloc.hugetlb" in tunables:
        return None
    try:
        if "[madvise]" not in _THP_MODE.read_text():  # "always": every process has them already
            return None
    except OSError:
        return None
    return dict(environ, GLIBC_TUNABLES=f"{tunables}:{HUGE_PAGES_TUNABLE}" if tunables else HUGE_PAGES_TUNABLE)


def huge_page_bytes() -> int:
    """Bytes of this process's memory on transparent huge pages (0 where unknown)."""
    return (_status_kib("AnonHugePages", Path("/proc/self/smaps_rollup")) or 0) * 1024


# ---------------------------------------------------------------- freed buffers kept for reuse
# glibc hands a freed block of 128 KiB or more back to the kernel (munmap, or a trim of the
# heap's top), so the next step's buffers of the same size are fresh pages: each 4 KiB page
# faults and is zeroed again. A batch of 65,536 rows is a few buffers of megabytes each, and a
# step frees and allocates dozens (every output and temporary of the CPU programs, the readers'
# batches): here 3,000-4,000 faults and 7-11 ms of kernel time per synthetic batch, more than
# making it took. Raising both thresholds keeps freed blocks in the process for the next
# allocation, as TCMalloc and jemalloc do. Blocks over 32 MiB (glibc's ceiling for the mmap
# threshold on 64-bit) are still mapped afresh each time.
# Threads other than the main one (every simulated device's) allocate from arenas of heaps of
# at most 64 MiB, and glibc unmaps a heap left empty by a free unless more than the top pad
# would remain: the trim threshold does not hold it. A step whose buffers outgrew one heap
# then mapped the next afresh every step: on 8 simulated devices, the dynamic step at 8,192
# went between about 10 and 4,700-12,000 faults a step as its scratch moved by 0.1 MB, and
# ran 8-17% slower in the second. A top pad of a whole heap keeps every heap. Its cost beside
# huge pages is compile time where faulting a huge page in is slow (the 2-core VM: the stream
# config's step 30 -> 45 s, its extra kernel time zeroing huge pages); set later than the
# compile, the steps faulted again (146 a step), and one arena (M_ARENA_MAX 1) ran them 2x slower.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # mallopt parameters, <malloc.h>
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30  # freed memory a heap keeps before it is returned to the kernel
TOP_PAD_BYTES = 64 << 20  # an arena's heap at most: none is unmapped for being empty


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed buffers up to 32 MiB, and its threads' heaps, for reuse
    instead of returning them to the kernel (see above); for the whole process, from now on.
    False where the C library is not glibc (nothing changed). :func:`dlrm_jax.train_and_evaluate`
    and the ``dlrm-jax`` program call it."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mmap threshold first: setting it also ends glibc's dynamic adjustment of both
    return all(
        mallopt(param, value)
        for param, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
            (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
            (_M_TOP_PAD, TOP_PAD_BYTES),
        )
    )
