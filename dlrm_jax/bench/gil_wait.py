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
    """``probe.idle()`` (the OS's own latency over ``idle_s``, nothing else wanting the GIL),
    then ``probe.start()`` and ``probe.stop()`` around the work, or ``with GilWait() as
    probe: <work>`` for all three; ``probe.result()``: each wake-up's lateness in ms (mean and
    percentiles), ``busy`` while the work ran and ``idle`` before. The probe takes a little of
    the GIL and a core itself (on the 2-core VM, 10-15% of synthetic batches' rate): time the
    work's throughput outside it."""

    def __init__(self, nap_s: float = NAP_S, idle_s: float = 0.3):
        self.nap_s, self.idle_s = nap_s, idle_s
        self._idle: list[float] = []
        self._busy: list[float] = []
        self._thread: threading.Thread | None = None

    def _run(self, out: list[float]) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_lateness, args=(self._stop, self.nap_s, out), name="gil-wait", daemon=True
        )
        self._thread.start()

    def idle(self) -> None:
        self._run(self._idle)
        time.sleep(self.idle_s)
        self.stop()

    def start(self) -> None:
        self._run(self._busy)

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def __enter__(self) -> GilWait:
        self.idle()
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def result(self) -> dict:
        return {"nap_ms": 1e3 * self.nap_s, "busy": _summary(self._busy), "idle": _summary(self._idle)}
