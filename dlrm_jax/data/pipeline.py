"""The input pipeline: batches read, checked and copied to the devices ahead of the step, off
the dispatching thread; and :func:`background`, which runs a stateful producer (the tiered
tables' cache planner) in one thread ahead of its consumer.

Threads and what they own: ``readers`` worker threads each take whole steps: read the host
batch (numpy, which releases the GIL while it copies) and, when a ``to_device`` is given, put
it on the devices (``jax.make_array_from_process_local_data``: a host-to-device transfer, never
a program with collectives). The thread that iterates (the trainer's dispatching thread) only
takes finished steps in order, so its cost per step is a queue pop; it keeps at most ``max(depth, readers)``
steps in flight, which bounds host and device memory. Each step is a pure function of its
index, so the order in which threads finish changes nothing.

Grain (the JAX ecosystem's loader) was measured against this for the binary source's batches
(``dlrm-jax bench input``, BENCHMARKS.md): a batch here is a handful of large contiguous
copies, so per-record loaders add work without adding parallelism.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

from dlrm_jax.observe.threads import name_os_thread
from dlrm_jax.parallel.launch import cores_of_this_process

T = TypeVar("T")
D = TypeVar("D")

MAX_AUTO_READERS = 16  # past this, more threads only queue on the GIL for their Python parts


def input_readers(readers: int | str, cores: int | None = None) -> int:
    """``data.readers`` as a number of threads: ``auto`` is this process's cores
    (:func:`~dlrm_jax.parallel.launch.cores_of_this_process`) less two, one for the
    dispatching thread and one for XLA's own, between 2 and ``MAX_AUTO_READERS``."""
    if readers != "auto":
        return int(readers)
    cores = cores_of_this_process() if cores is None else cores
    return max(2, min(MAX_AUTO_READERS, cores - 2))


@dataclass
class InputTimes:
    """Seconds spent per phase, summed over the steps taken since the last :meth:`take`."""

    read_s: float = 0.0  # reader threads: reading and checking host batches
    to_device_s: float = 0.0  # reader threads: host-to-device copies
    wait_s: float = 0.0  # the iterating thread, blocked on a step not ready yet
    steps: int = 0

    def take(self) -> dict[str, float]:
        """Milliseconds per step of each phase since the last call (then reset)."""
        n = max(self.steps, 1)
        out = {
            "input_read_ms": 1e3 * self.read_s / n,
            "input_h2d_ms": 1e3 * self.to_device_s / n,
            "input_wait_ms": 1e3 * self.wait_s / n,
        }
        self.read_s = self.to_device_s = self.wait_s = 0.0
        self.steps = 0
        return out


@dataclass(frozen=True)
class Prepared(Generic[T, D]):
    """One step's input: the host batch (hot-row counting reads its ids) and its device form
    (None without ``to_device``)."""

    step: int
    host: T
    device: D | None


class InputPipeline(Generic[T, D]):
    """Iterates :class:`Prepared` steps ``steps`` in order, made ``max(depth, readers)`` steps
    ahead by ``readers`` threads (see the module docstring). Use as a context manager, or call
    :meth:`close`: pending steps are cancelled and the threads joined."""

    def __init__(
        self,
        read: Callable[[int], T],
        steps: range,
        *,
        to_device: Callable[[T], D] | None = None,
        readers: int | str = "auto",
        depth: int = 4,
    ):
        self._read, self._to_device, self._steps = read, to_device, iter(steps)
        self.readers = max(1, input_readers(readers))
        self._pool = ThreadPoolExecutor(self.readers, thread_name_prefix="input", initializer=name_os_thread)
        self._pending: deque[Future] = deque()
        self._depth = max(1, depth, self.readers)  # fewer steps in flight would leave readers idle
        self.times = InputTimes()
        self._fill()

    def _prepare(self, step: int) -> tuple[Prepared, float, float]:
        t0 = time.perf_counter()
        host = self._read(step)
        t1 = time.perf_counter()
        device = self._to_device(host) if self._to_device is not None else None
        return Prepared(step, host, device), t1 - t0, time.perf_counter() - t1

    def _fill(self) -> None:
        while len(self._pending) < self._depth:
            step = next(self._steps, None)
            if step is None:
                return
            self._pending.append(self._pool.submit(self._prepare, step))

    def __iter__(self) -> Iterator[Prepared]:
        return self

    def __next__(self) -> Prepared:
        if not self._pending:
            raise StopIteration
        t0 = time.perf_counter()
        prepared, read_s, h2d_s = self._pending.popleft().result()  # a reader's error is raised here
        self.times.wait_s += time.perf_counter() - t0
        self.times.read_s, self.times.to_device_s = self.times.read_s + read_s, self.times.to_device_s + h2d_s
        self.times.steps += 1
        self._fill()
        return prepared

    def close(self) -> None:
        for f in self._pending:
            f.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> InputPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def dispatched_ahead(make: Callable[[int], D], steps: range, depth: int = 4) -> Iterator[Prepared]:
    """:class:`Prepared` steps whose input ``make(step)`` builds on the devices (a jitted
    generator: the synthetic source), called ``depth`` steps ahead on this thread: dispatch is
    asynchronous, so the devices generate while earlier steps train. Programs are dispatched
    from the caller's thread only, in step order."""
    pending: deque[Prepared] = deque()
    it = iter(steps)
    while True:
        while len(pending) < max(1, depth) and (step := next(it, None)) is not None:
            pending.append(Prepared(step, None, make(step)))
        if not pending:
            return
        yield pending.popleft()


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
