"""Host memory of this process: current and peak resident set size (Linux ``/proc``).

On simulated CPU devices every device buffer is host memory, so the process's peak RSS is the
memory of the whole mesh: what the plan's bytes are compared with.
"""

from __future__ import annotations

import resource
from pathlib import Path

_STATUS = Path("/proc/self/status")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
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
