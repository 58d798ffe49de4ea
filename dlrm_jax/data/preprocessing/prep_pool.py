"""The worker processes of :mod:`dlrm_jax.data.preprocessing.prep_driver`: how many, how they
are started, and that none outlives the driver."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager

from dlrm_jax.stopping import die_with_parent


@contextmanager
def worker_pool(workers: int) -> Iterator[Callable]:
    """``map(fn, *iterables)`` over worker processes, results in order (in-process for 1)."""
    if workers <= 1:
        yield map
        return
    method = "forkserver" if "jax" in sys.modules else "fork"  # never fork a started runtime
    # None outlives us: each asks for SIGKILL when its parent ends (us, or the fork server,
    # which ends with us), and takes it at once where we ended before it asked.
    context, owner = multiprocessing.get_context(method), os.getpid()
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=die_with_parent, initargs=(signal.SIGKILL, None, owner)
    ) as ex:
        try:
            yield lambda fn, *its: ex.map(fn, *its, chunksize=1)
        except BaseException:
            ex.shutdown(wait=True, cancel_futures=True)
            raise


def default_workers() -> int:
    """One worker per core this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
