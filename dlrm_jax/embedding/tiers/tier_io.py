"""The disk tier's traffic off the dispatching thread: reads made ahead, writes made behind.

:class:`ReadAhead`: the planner thread knows, ``lookahead`` batches before a step, which rows
enter the device caches. Those that neither cache is likely to hold are read by one reader
thread, batch after batch in order (each batch's reads coalesced and many in flight, see
:mod:`.chunk_io`), into :class:`Staged` rows that wait outside the DRAM cache: they evict
nothing until their step takes them. A staged row is only used if no write reached the disk
after its read began (:meth:`TierStore.writes_since`); otherwise the newer copy is taken from
where it is (the DRAM cache, a write still queued, or the disk again).

:class:`WriteBehind`: rows the DRAM cache evicts dirty are queued and written by one writer
thread in the order they were evicted, a batch per eviction, sorted by row. Until its write
is done a queued row is found here (:meth:`WriteBehind.pending`), never read from the disk.

An error on either thread (a file that cannot be read, a full disk) is raised to the
dispatching thread at its next call, naming the file and the rows.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from dlrm_jax.embedding.tiers.store import TierStore
from dlrm_jax.observe.threads import name_os_thread


@dataclass(frozen=True)
class Staged:
    """Rows of one table read ahead: sorted distinct ``rows``, their fields, and the store's
    ``write_seq`` when the read began."""

    rows: np.ndarray
    values: dict[str, np.ndarray]
    seq: int

    def take(self, store: TierStore, table: str, rows: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Which of ``rows`` this holds, still current, and their fields in ``rows`` order."""
        if not len(self.rows) or not len(rows):
            return np.zeros(len(rows), bool), {}
        at = np.minimum(np.searchsorted(self.rows, rows), len(self.rows) - 1)
        have = self.rows[at] == rows
        for written in store.writes_since(table, self.seq):  # sorted rows of each later write
            at_w = np.minimum(np.searchsorted(written, rows), len(written) - 1)
            have &= written[at_w] != rows
        return have, {k: v[at[have]] for k, v in self.values.items()}


class ReadAhead:
    """One reader thread reading the tier for batches planned ahead, in the order submitted."""

    def __init__(self, store: TierStore):
        self.store = store
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tier-read-ahead", initializer=name_os_thread)
        self._submitted = self._taken = 0  # each written by one thread only (planner, dispatcher)
        self.wait_s = 0.0  # the dispatching thread's wait for reads still in flight

    def submit(self, wanted: dict[str, np.ndarray]) -> Future:
        """Reads ``wanted`` ({table: rows}) on the reader thread: a future of {table: Staged}."""
        self._submitted += 1  # before the read can begin: see forget_writes
        return self._reader.submit(self._read, {t: np.unique(np.asarray(r, np.int64)) for t, r in wanted.items()})

    def restart(self) -> None:
        """A new stream of planned batches: reads of an abandoned one are never taken."""
        self._submitted = self._taken = 0

    def take(self, reads: Future | None) -> dict[str, Staged]:
        """A step's staged rows (waiting for its reads if they are still in flight); then the
        store forgets the writes no read still in flight can have missed."""
        floor = self.store.write_seq  # read before the idle check: a read begun after it sees this
        staged = {}
        if reads is not None:
            t0 = time.perf_counter()
            staged = reads.result()
            self.wait_s += time.perf_counter() - t0
            self._taken += 1
        if staged:
            self.store.forget_writes(min(s.seq for s in staged.values()))  # later reads began later
        elif self._taken == self._submitted:
            self.store.forget_writes(floor)
        return staged

    def _read(self, wanted: dict[str, np.ndarray]) -> dict[str, Staged]:
        wanted = {t: rows for t, rows in wanted.items() if len(rows)}
        if not wanted:
            return {}
        got, seq = self.store.read_many(wanted)  # every table's requests in flight together
        return {t: Staged(rows, got[t], seq) for t, rows in wanted.items()}

    def close(self) -> None:
        self._reader.shutdown(cancel_futures=True)


class WriteBehind:
    """Rows evicted dirty from the DRAM caches, written to the tier by one thread, in order."""

    def __init__(self, store: TierStore):
        self.store = store
        self._queue: deque[tuple[str, np.ndarray, dict[str, np.ndarray]]] = deque()
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self.rows_written = 0
        self._thread = threading.Thread(target=self._run, name="tier-write-behind", daemon=True)
        self._thread.start()

    def put(self, table: str, rows: np.ndarray, values: dict[str, np.ndarray]) -> None:
        """Queue distinct ``rows`` of ``table`` (sorted here) with their fields (copies kept)."""
        self._raise()
        order = np.argsort(rows, kind="stable")
        entry = (table, np.asarray(rows, np.int64)[order], {k: np.array(v[order]) for k, v in values.items()})
        with self._cond:
            self._queue.append(entry)
            self._cond.notify_all()

    def pending(self, table: str, rows: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Which of ``rows`` are queued (not written yet), and their newest queued fields."""
        self._raise()
        have = np.zeros(len(rows), bool)
        out: dict[str, np.ndarray] = {}
        with self._cond:
            entries = [e for e in self._queue if e[0] == table]
        for _, queued, values in reversed(entries):  # newest first
            todo = np.flatnonzero(~have)
            if not todo.size:
                break
            at = np.minimum(np.searchsorted(queued, rows[todo]), len(queued) - 1)
            found = queued[at] == rows[todo]
            if not found.any():
                continue
            if not out:
                out = {k: np.empty((len(rows), *v.shape[1:]), v.dtype) for k, v in values.items()}
            for k, v in values.items():
                out[k][todo[found]] = v[at[found]]
            have[todo[found]] = True
        return have, {k: v[have] for k, v in out.items()}

    def drain(self) -> None:
        """Wait until every queued row is written (raises the writer's error, if any)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._queue or self._error is not None)
        self._raise()

    def discard(self) -> None:
        """Drop what is queued (the tier is about to be restored to a snapshot)."""
        with self._cond:
            while len(self._queue) > 1:  # the oldest may be being written: wait for it
                self._queue.pop()
            self._cond.wait_for(lambda: not self._queue or self._error is not None)
            self._error = None

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        try:
            self.drain()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._thread.join()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                table, rows, values = self._queue[0]  # stays findable until written
            try:
                self.store.write(table, rows, values)
            except BaseException as e:  # raised to the dispatching thread at its next call
                with self._cond:
                    self._error = e
                    self._queue.clear()
                    self._cond.notify_all()
                continue
            with self._cond:
                self._queue.popleft()
                self.rows_written += len(rows)
                self._cond.notify_all()
