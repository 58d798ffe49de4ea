"""Host memory of this process: current and peak resident set size (Linux ``/proc``).

On simulated CPU devices every device buffer is host memory, so the process's peak RSS is the
memory of the whole mesh: what the plan's bytes are compared with.
"""

from __future__ import annotations

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
