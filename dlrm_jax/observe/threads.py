"""Host threads named where the operating system sees them (``top -H``, py-spy, profiler
traces), not only in Python: a trace's lines are threads by their OS names, and every Python
thread otherwise shows as its process's name."""

from __future__ import annotations

import ctypes
import sys
import threading

_PR_SET_NAME = 15  # prctl(2): the calling thread's name, at most 15 bytes
_libc = None


def name_os_thread(name: str | None = None) -> None:
    """Give the calling thread ``name`` (default: its Python name) as its OS name, cut to 15
    bytes (Linux; elsewhere nothing). Never for the main thread: its name is the process's
    (``ps``, ``pkill``)."""
    global _libc
    if not sys.platform.startswith("linux") or threading.current_thread() is threading.main_thread():
        return
    try:
        _libc = _libc or ctypes.CDLL(None, use_errno=True)
        _libc.prctl(_PR_SET_NAME, (name or threading.current_thread().name).encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: names are a convenience
        pass
