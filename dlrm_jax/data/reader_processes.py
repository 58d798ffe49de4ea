"""Batches read and checked in worker processes, so that reading holds none of the training
process's GIL (``data.reader_processes``).

Why: a reader thread holds the training process's GIL for about 1 ms of each batch of 65,536
criteo_kaggle rows (py-spy on the 2-core VM, one reader: its Python around some 50 ``pread``s,
the checks' numpy calls, the placing), and the dispatching thread, which gives the GIL up at
every step's dispatch and loss read, waits for whichever reader holds it to let it go
(:mod:`dlrm_jax.bench.gil_wait`); more readers hold it more often, and contend for it among
themselves. In a worker process the reading and checking run under that process's own GIL;
the training process's reader thread only sends a step number, waits on a pipe (no GIL), copies
the batch out of shared memory (numpy: no GIL) and places it.

Each worker has a shared-memory buffer of one packed batch (:mod:`dlrm_jax.data.packed`) that
it reads a step into, in place, with the source's ``train_batch_into``, the same code the
threads run. A reader thread takes an idle worker, asks for its step, copies the batch into a
buffer of its own and gives the worker back: a batch handed on (to the devices, to hot-row
counting) is never one a worker writes into again. An error in a worker (a damaged shard, its
message naming the file and row) is raised in the training process at its step, and the worker
goes on serving; a worker that died is reported with its exit code. Workers are started with
a fresh interpreter (a forked copy of a process running XLA's threads can deadlock) and ignore the stop
signals, which the training process handles (it finishes the step, saves, then ends them);
a worker whose training process died sees its socket close and exits. They are started as
``python -m dlrm_jax.data.reader_processes`` with this process's ``sys.path`` and a socket,
not by ``multiprocessing``'s ``spawn``, which runs the parent's main script again in each (not
there to run from ``python -`` or a notebook's kernel; a user's script without a ``__main__``
guard would start training again).
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from dlrm_jax.data.batch import faster_path
from dlrm_jax.data.host_buffers import HostBuffers
from dlrm_jax.data.packed import HostPacked, PackedLayout, reading_layout

JOIN_S = 10.0  # a worker's time to exit after being asked, before it is terminated


def _serve(conn: Connection) -> None:
    """A worker's loop: first (source, layout, shared buffer's name); then a step number in,
    that batch written into the shared buffer, ``("ok", None)`` or ``("error", exception)``
    out; None (or a closed socket) ends it."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    try:
        source, layout, shm_name = conn.recv()
    except (EOFError, OSError):
        return
    shm = _attach(shm_name)
    buf = np.ndarray((layout.shards, layout.shard_bytes), np.uint8, buffer=shm.buf)
    views = layout.views(buf)
    try:
        while (step := conn.recv()) is not None:
            try:
                source.train_batch_into(step, views)
            except Exception as e:  # the training process raises it at its step
                try:
                    conn.send(("error", e))
                except Exception:  # an exception that does not pickle: its words
                    conn.send(("error", RuntimeError(f"{type(e).__name__}: {e}")))
                continue
            conn.send(("ok", None))
    except (EOFError, OSError):  # the training process is gone
        pass
    finally:
        del views, buf
        shm.close()


def _attach(name: str) -> SharedMemory:
    """The training process's shared buffer, which it alone frees (a worker's own resource
    tracker would free it, and warn, when the worker ends)."""
    try:
        return SharedMemory(name, track=False)  # Python 3.13 onward
    except TypeError:
        from multiprocessing import resource_tracker

        shm = SharedMemory(name)
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 - what track=False does
        return shm


def _exit(code: int | None) -> str:
    """How a process ended, in words: a signal by name (-9: SIGKILL, as the kernel's
    out-of-memory killer sends)."""
    if code is None:
        return "still running, not answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}" + (", perhaps by the kernel for want of memory" if -code == signal.SIGKILL else "")
    return f"exit code {code}"


@dataclass
class _Worker:
    process: subprocess.Popen
    conn: Connection
    shm: SharedMemory
    batch: np.ndarray | None  # the shared buffer, [shards, shard_bytes] uint8


class ProcessReaders:
    """``step -> HostPacked`` (what :func:`~dlrm_jax.data.packed.packed_reader` gives) read by
    ``workers`` worker processes (see the module docstring), for sources that read in place
    (``train_batch_into``: the binary source). Safe to call from several threads at once (each
    call takes an idle worker, waiting for one); each batch copied out into a buffer of
    ``buffers`` (:mod:`dlrm_jax.data.host_buffers`), else a new one. Call :meth:`close` (or use
    as a context manager) to end the workers and free their buffers."""

    def __init__(self, source, layout: PackedLayout, workers: int, buffers: HostBuffers | None = None):
        if faster_path(source, "train_batch_into") is None:
            raise ValueError(
                f"data.reader_processes: {type(source).__name__} cannot read a batch in place "
                "(train_batch_into); only the binary source reads in worker processes"
            )
        self.layout, self._buffers = reading_layout(source, layout), buffers
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._workers: list[_Worker] = []
        size = self.layout.shards * self.layout.shard_bytes
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            for k in range(max(1, workers)):
                shm = SharedMemory(create=True, size=max(1, size))
                batch = np.ndarray((self.layout.shards, self.layout.shard_bytes), np.uint8, buffer=shm.buf)
                mine, theirs = socket.socketpair()
                process = subprocess.Popen(
                    [sys.executable, "-m", __name__, str(theirs.fileno()), f"input-{k}"],
                    pass_fds=(theirs.fileno(),),
                    env=env,
                    stdin=subprocess.DEVNULL,
                )
                theirs.close()
                conn = Connection(mine.detach())
                self._workers.append(_Worker(process, conn, shm, batch))
                conn.send((source, self.layout, shm.name))
                self._idle.put(self._workers[-1])
        except BaseException:
            self.close()
            raise

    def __call__(self, step: int) -> HostPacked:
        worker = self._idle.get()
        try:
            try:  # (a worker already gone breaks the send; one that dies while reading, the receive)
                worker.conn.send(step)
                kind, got = worker.conn.recv()
            except (EOFError, OSError):
                try:
                    code = worker.process.wait(1.0)
                except subprocess.TimeoutExpired:
                    code = None
                # (an OSError: the commands give it as one line, not a traceback)
                raise ChildProcessError(
                    f"input reader process {worker.process.pid} ended ({_exit(code)}) while reading "
                    f"training step {step}; run the same command to resume from the last checkpoint"
                ) from None
            if kind == "error":
                raise got
            buf = self.layout.empty(self._buffers)
            np.copyto(buf, worker.batch)  # (out of the shared buffer before the worker reads again)
            return HostPacked(buf, self.layout)
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        for w in self._workers:
            try:
                w.process.wait(JOIN_S)
            except subprocess.TimeoutExpired:
                w.process.kill()
                w.process.wait(JOIN_S)
            w.conn.close()
            w.batch = None  # (the buffer's one view here: then it can close)
            w.shm.close()
            try:
                w.shm.unlink()
            except FileNotFoundError:
                pass
        self._workers = []

    def __enter__(self) -> ProcessReaders:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":  # a worker: python -m dlrm_jax.data.reader_processes FD NAME
    _serve(Connection(int(sys.argv[1])))
