"""The host-side batch every data source yields, and the protocol sources follow."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple, Protocol

import numpy as np

from dlrm_jax.ids import PAD_ID  # an empty slot of a multi-hot bag (re-exported)


class Batch(NamedTuple):
    """This process's slice of one global batch (host numpy arrays).

    dense:  float32 [B, num_dense]  already normalised (log1p of clipped counts for Criteo)
    ids:    int32   [B, S]  table-local row ids; S = sum of per-feature bag sizes, features laid
                            out one after another; PAD_ID marks an empty bag slot
    labels: float32 [B]     0 or 1
    """

    dense: np.ndarray
    ids: np.ndarray
    labels: np.ndarray

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])


class RawBatch(NamedTuple):
    """A :class:`Batch` with the raw 64-bit ids of its dynamic tables' features beside it
    (``embedding.ids=dynamic``), from a source that has them (Criteo text's values):

    raw:    uint32  [B, 2, R]  as ``dlrm_jax.ids.raw_columns`` lays them out; the dynamic
                               features' slots of ``ids`` are placeholders (PAD_ID: empty)

    A source without raw ids yields plain Batches: the dynamic features' ids serve as raw ids."""

    dense: np.ndarray
    ids: np.ndarray
    labels: np.ndarray
    raw: np.ndarray

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])


def take(batch: Batch | RawBatch, rows) -> Batch | RawBatch:
    """The batch of rows ``rows`` (an index or slice of the batch axis) of each field."""
    return type(batch)(*(x[rows] for x in batch))


def padded(batch: Batch | RawBatch, n: int) -> Batch | RawBatch:
    """The batch with zero rows appended up to ``n`` rows."""
    pad = lambda x: np.concatenate([x, np.zeros((n - len(x), *x.shape[1:]), x.dtype)]) if len(x) < n else x
    return type(batch)(*(pad(x) for x in batch))


def faster_path(source, name: str):
    """``source``'s method ``name``, a faster way to what its ``train_batch`` gives
    (``device_batches``: made on the devices; ``train_batch_into``: read in place;
    ``train_ids``: the ids alone), or None: where it has none, or where a subclass overrides
    ``train_batch`` below the class that defines ``name`` (a user's source derived from
    :class:`~dlrm_jax.data.sources.synthetic.SyntheticSource` changing its batches: training
    took the parent's fast path and never called the change)."""
    method = getattr(source, name, None)
    if method is None:
        return None
    mro = type(source).__mro__
    owner = next((c for c in mro if name in vars(c)), None)  # (None: set on the instance)
    batches = next((c for c in mro if "train_batch" in vars(c)), None)
    if owner is not None and batches is not None and batches is not owner and issubclass(batches, owner):
        return None
    return method


def check_source(source) -> None:
    """A TypeError naming what a source must have, before any work (a generator of batches
    failed after planning began: "'generator' object has no attribute 'skip_report'")."""
    if source is None:
        return
    missing = [m for m in ("train_batch", "eval_batches") if not callable(getattr(source, m, None))]
    if missing:
        raise TypeError(
            f"source: a {type(source).__name__} has no {' or '.join(missing)}(); a data source answers "
            f"train_batch(step) and eval_batches() (dlrm_jax.ArraySource serves numpy arrays)"
        )


def train_ids(source, step: int) -> np.ndarray:
    """``source.train_ids(step)`` where it is true to ``train_batch`` (:func:`faster_path`),
    else ``train_batch(step).ids``: a source of one's own needs only ``train_batch``."""
    ids = faster_path(source, "train_ids")
    return ids(step) if ids is not None else source.train_batch(step).ids


class DataSource(Protocol):
    """Deterministic batches: the same (step, process) always gives the same data."""

    def train_batch(self, step: int) -> Batch:
        """This process's slice of global training batch ``step``."""
        ...

    def train_ids(self, step: int) -> np.ndarray:
        """``train_batch(step).ids`` alone (the planner and the hot-row statistics read no
        more; a source may make them without the rest). Optional: without it they read
        ``train_batch`` (:func:`train_ids`)."""
        ...

    def eval_batches(self) -> Iterator[Batch]:
        """This process's slices of the held-out batches, the same every call. A source that
        can read them by index also has ``eval_batch_count()`` and ``eval_batch(i)`` (safe from
        several threads): evaluation then reads them with ``data.readers`` threads instead of
        one (:func:`dlrm_jax.train.evaluate.held_out`)."""
        ...

    def skip_report(self) -> str:
        """One line on malformed input skipped under data.skip_bad_lines ('' if none)."""
        ...


def process_slice(global_batch: int, process_index: int, process_count: int) -> slice:
    """The rows of a global batch that one process feeds to its devices."""
    if global_batch % process_count:
        raise ValueError(f"train.batch_size={global_batch} must be divisible by the {process_count} processes")
    per = global_batch // process_count
    return slice(process_index * per, (process_index + 1) * per)


def check_ids(ids: np.ndarray, table_rows: tuple[int, ...], bag_sizes: tuple[int, ...], where: str) -> None:
    """Raise naming the feature when an id is out of its table's range."""
    start = 0
    for f, (rows, bag) in enumerate(zip(table_rows, bag_sizes, strict=True)):
        block = ids[:, start : start + bag]
        bad = (block < PAD_ID) | (block >= rows)
        if bad.any():
            row = int(np.argwhere(bad)[0][0])
            value = int(block[bad][0])
            raise ValueError(
                f"{where}: feature {f} (table cat_{f}, {rows} rows) has id {value} out of range in batch row {row}"
            )
        start += bag
