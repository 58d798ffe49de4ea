"""A thread that frees what the training loop no longer needs, so the dispatching thread does
not give up the GIL for it.

jaxlib gives up the GIL inside a ``jax.Array``'s destructor (freeing a device buffer may wait
for the programs that use it). A train step leaves a state of some fifty arrays behind (every
parameter, optimizer state and table), its batch and its metrics: freed on the dispatching
thread, that thread gave up the GIL about 54 times a step (criteo_kaggle, counted with gdb on
``PyEval_SaveThread``), and each time waited to get it back behind every input thread that
wanted it. Here it hands them, in one list a step, to a thread that drops them.
"""

from __future__ import annotations

import queue
import threading

from dlrm_jax.observe.threads import name_os_thread


class ReleaseThread:
    """:meth:`hold` what a step leaves behind; :meth:`release` once a step (from the same
    thread) hands what was held to the thread that frees it. Hand over nothing the caller may
    still reference: the last reference is what frees, wherever it is dropped. Use as a
    context manager, or :meth:`close` (joins: everything handed over is freed)."""

    def __init__(self):
        self._held: list = []
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="release", daemon=True)
        self._thread.start()

    def hold(self, *objects) -> None:
        self._held.extend(objects)

    def release(self) -> None:
        """What :meth:`hold` took since the last call, to the freeing thread."""
        if self._held:
            self._queue.put(self._held)
            self._held = []

    def _run(self) -> None:
        name_os_thread()
        while (objects := self._queue.get()) is not None:
            del objects  # the last references: their destructors run here

    def close(self) -> None:
        """Hands over what is held and ends the thread, joined, on failures too: a thread
        still freeing when the interpreter exits is cut short inside jaxlib's C++ destructor,
        and the process aborts ("FATAL: exception not rethrown", a full disk's clean one-line
        exit turned into SIGABRT)."""
        self.release()
        self._queue.put(None)
        self._thread.join()

    def __enter__(self) -> ReleaseThread:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
