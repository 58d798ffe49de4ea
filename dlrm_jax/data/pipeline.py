"""Background preparation of host batches so data work overlaps device work."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
_DONE = object()


def background(items: Iterable[T], depth: int = 2) -> Iterator[T]:
    """Yields the items of ``items``, produced up to ``depth`` ahead in a thread.

    An exception while producing an item is raised here, where that item would have come.
    The thread runs plain Python and numpy only: it never dispatches a device program.
    """
    q: queue.Queue = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()

    def work():
        try:
            for item in items:
                if stop.is_set():
                    return
                q.put((item, None))
            q.put((_DONE, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put((None, e))

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        while True:
            value, error = q.get()
            if error is not None:
                raise error
            if value is _DONE:
                return
            yield value
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                thread.join(0.01)


def prefetch(make: Callable[[int], T], steps: range, depth: int = 2) -> Iterator[T]:
    """Yields ``make(step)`` for each step, computed ``depth`` steps ahead in a thread."""
    return background(map(make, steps), depth)
