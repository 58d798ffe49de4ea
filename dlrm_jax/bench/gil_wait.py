"""How long a thread that gives up the GIL waits to get it back while other threads run.

The training loop's dispatching thread gives up the GIL several times a step (dispatching the
step, waiting for a loss two steps back) and needs it back at once to dispatch the next one;
while the input pipeline's readers run, it waits for whichever of them holds the GIL to let it
go. That wait is invisible in the loop's own metrics (neither its CPU time, ``dispatch_ms``,
nor its wait for a batch, ``input_wait_ms``) and grows with the readers' share of the GIL and
their number. :class:`GilWait` measures it the way the loop meets it: a thread sleeps
``nap_s`` (a blocking call that releases the GIL, like a device wait) over and over, and each
wake-up's lateness beyond the nap is its wait for the GIL, and for a core where the threads
outnumber the cores (on a 2-core machine, two readers and the probe already do: there the two
cannot be told apart; ``sys.setswitchinterval`` did not change it), plus the OS's wake-up
latency, measured alone first, as ``idle``.
"""

from __future__ import annotations

import threading
import time

import numpy as np

NAP_S = 0.0005


def _lateness(stop: threading.Event, nap_s: float, out: list[float]) -> None:
    while True:  # (at least one wake-up, however short the work)
        t = time.perf_counter()
        time.sleep(nap_s)
        out.append(time.perf_counter() - t - nap_s)
        if stop.is_set():
            return


def _summary(late: list[float]) -> dict:
    if not late:
        return {"wakes": 0}
    ms = 1e3 * np.asarray(late)
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"wakes": len(late), "mean_ms": float(ms.mean()), "p50_ms": p50, "p90_ms": p90, "p99_ms": p99}


class GilWait:
    """``with GilWait() as probe: <work>``; then ``probe.result()``: the wake-ups' lateness in
    ms (mean and percentiles) while the work ran, and ``idle``, the same over ``idle_s``
    before it began (the OS's own latency, with no other thread wanting the GIL)."""

    def __init__(self, nap_s: float = NAP_S, idle_s: float = 0.3):
        self.nap_s, self.idle_s = nap_s, idle_s
        self._idle: list[float] = []
        self._busy: list[float] = []

    def _run(self, out: list[float], seconds: float | None = None) -> tuple[threading.Thread, threading.Event]:
        stop = threading.Event()
        thread = threading.Thread(target=_lateness, args=(stop, self.nap_s, out), name="gil-wait", daemon=True)
        thread.start()
        if seconds is not None:
            time.sleep(seconds)
            stop.set()
            thread.join()
        return thread, stop

    def __enter__(self) -> GilWait:
        self._run(self._idle, self.idle_s)
        self._thread, self._stop = self._run(self._busy)
        return self

    def restart(self) -> None:
        """Forget the wake-ups so far (the work's warm-up: from here on, its steady state)."""
        self._busy.clear()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def result(self) -> dict:
        return {"nap_ms": 1e3 * self.nap_s, "busy": _summary(self._busy), "idle": _summary(self._idle)}
