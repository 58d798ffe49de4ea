"""Background preparation of host batches so data work overlaps device work."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


def prefetch(make: Callable[[int], T], steps: range, depth: int = 2) -> Iterator[T]:
    """Yields ``make(step)`` for each step, computed ``depth`` steps ahead in a thread.

    An exception in ``make`` is raised here, at the step that caused it.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work():
        for step in steps:
            if stop.is_set():
                return
            try:
                item = (make(step), None)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                item = (None, e)
            q.put(item)
            if item[1] is not None:
                return

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        for _ in steps:
            value, error = q.get()
            if error is not None:
                raise error
            yield value
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                thread.join(0.01)
