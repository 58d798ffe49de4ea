"""When a run counts lookups and refreshes its hot rows, and the statistics it keeps between
refreshes (:class:`HotSchedule`); the counting itself is :mod:`~dlrm_jax.embedding.hot.counts`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from dlrm_jax.embedding.hot.counts import RowCounts
from dlrm_jax.observe.threads import name_os_thread


class HotSchedule:
    """When training counts lookups and refreshes the hot set, and the counts it keeps.

    With ``refresh_every`` = R > 0, the ``window`` batches before every R-th step are counted
    into the running statistics; after step kR the hot set becomes the ``capacity`` most
    counted rows, and the counts are multiplied by ``decay`` (older traffic fades). The
    statistics are truncated to the max(16 x capacity, 4096) most counted rows at each refresh, so they stay
    small enough to travel with every checkpoint (:meth:`to_json`), which a resumed run needs
    to choose the same rows. Host-side only: the caller runs the refresh program.

    Counting runs on ``threads`` threads of its own (:meth:`add` only queues the batch), so the
    thread that dispatches steps pays for a refresh's sum and choice alone. The window's counts
    are whole numbers, so the order they are summed in cannot change a bit. ``gather`` turns this
    process's window into the global one (an all-gather in a multi-process run, where each
    process counts only its own rows); it is called from the caller's thread, at a refresh and
    in :meth:`to_json`, in the same order on every process.
    """

    def __init__(
        self,
        capacity: int,
        bag_sizes: Sequence[int],
        counts: RowCounts,
        *,
        window: int,
        refresh_every: int,
        decay: float,
        gather: Callable[[RowCounts], RowCounts] = lambda c: c,
        threads: int = 1,
    ):
        self.capacity, self.bag_sizes = capacity, tuple(bag_sizes)
        self.window, self.refresh_every, self.decay = window, refresh_every, decay
        self.keep = max(16 * capacity, 4096)
        self.counts = counts.truncated(self.keep)
        self._gather = gather
        self._carried = RowCounts.empty(counts.num_tables)  # a resumed window's global counts
        self._local = RowCounts.empty(counts.num_tables)  # this process's counts since then
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []  # each batch's counts, being counted

    def counts_batch(self, step: int) -> bool:
        """Whether batch ``step`` (0-based: the one trained in step ``step + 1``) is counted."""
        r = self.refresh_every
        return bool(r) and step % r >= r - min(self.window, r)

    def add(self, ids) -> None:
        """Count one batch's ids (int [B, S] as in Batch, or anything ``np.asarray`` reads, such
        as a device array's local rows) on the counting thread."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="hot-count", initializer=name_os_thread)
        self._pending.append(self._pool.submit(lambda: RowCounts.from_batches([np.asarray(ids)], self.bag_sizes)))

    def _window_counts(self) -> RowCounts:
        """The global counts of the window so far (waits for the counting thread)."""
        counted = [f.result() for f in self._pending]  # a counting error is raised here
        self._pending.clear()
        self._local = RowCounts.total([self._local, *counted])
        return self._carried.plus(self._gather(self._local))

    def refresh_due(self, steps_done: int) -> bool:
        return bool(self.refresh_every) and steps_done % self.refresh_every == 0

    def current_rows(self) -> list[np.ndarray]:
        """Per table, the rows the statistics rank hottest (at most ``capacity`` in all): the
        counts as of the last refresh (a run's first rows), without this window's counts, so
        it is host arithmetic alone (no all-gather; callable while tracing)."""
        return self.counts.decayed(1.0, self._carried).top_rows(self.capacity)

    def refresh(self) -> list[np.ndarray]:
        """The next hot set (:meth:`current_rows`), then the counts decayed and truncated."""
        counts = self.counts.decayed(1.0, self._window_counts())
        rows = counts.top_rows(self.capacity)
        self.counts = counts.decayed(self.decay, RowCounts.empty(counts.num_tables)).truncated(self.keep)
        self._carried = self._local = RowCounts.empty(counts.num_tables)
        return rows

    def to_json(self) -> dict:
        return {**self.counts.to_json(), "window": self._window_counts().to_json()}

    def load_json(self, raw: dict) -> None:
        self.counts = RowCounts.from_json(raw)
        empty = RowCounts.empty(self.counts.num_tables)
        self._carried = RowCounts.from_json(raw["window"]) if "window" in raw else empty
        self._local = empty

    def close(self) -> None:
        """Stops the counting thread (pending counts are finished first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
