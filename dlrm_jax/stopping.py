"""SIGINT and SIGTERM outside the training loop (loading, compiling, restoring): one line and
exit status 128 + signal, where SIGTERM's default action would end the process without a word.

The handler raises :class:`Stopped` where the main thread happens to be. Python swallows an
exception raised inside a garbage-collection or ``__del__`` callback (JAX runs one at every
collection), so the stop is also kept here, and honoured at the next :func:`raise_if_stopped`:
the training loop's start, and the command's end.
"""

from __future__ import annotations

import signal
import sys
import threading

__all__ = ["Stopped", "stop_on_signals", "raise_if_stopped"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_pending: int | None = None


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM outside the training loop (whose own handlers finish the step and save)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop(signum, frame):
    global _pending
    _pending = signum
    raise Stopped(signum)


def raise_if_stopped() -> None:
    """Raise :class:`Stopped` if a signal arrived and its exception was swallowed on the way."""
    if _pending is not None:
        raise Stopped(_pending)


def stop_on_signals():
    """Install the handlers; returns the function that puts the old ones (and the old
    ``sys.unraisablehook``) back. A no-op off the main thread, where handlers cannot be set."""
    global _pending
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    _pending = None
    old = {sig: signal.signal(sig, _stop) for sig in _SIGNALS}
    old_hook = sys.unraisablehook

    def unraisable(info):  # "Exception ignored in ...": the stop is pending, not lost; say nothing
        if not isinstance(info.exc_value, Stopped):
            old_hook(info)

    sys.unraisablehook = unraisable

    def restore():
        global _pending
        for sig, handler in old.items():
            signal.signal(sig, handler)
        sys.unraisablehook = old_hook
        _pending = None

    return restore
