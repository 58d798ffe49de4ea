"""A data source over numpy arrays in memory: a notebook's own data, without preprocessing.

``ArraySource(train, val, batch_size)`` takes ``(dense, ids, labels)`` arrays for each split
(shapes as :class:`~dlrm_jax.data.batch.Batch` documents), and for dynamic tables optionally a
fourth, their features' raw 64-bit ids [n, R], and serves them as every source does:
batch ``step`` is a pure function of (seed, step, process), each epoch visits the train rows in
a new order (a keyed bijection of seed and epoch, per row: no permutation is held), every row
once an epoch, and evaluation reads the val split once, in order, the last batch partial.
Values are checked once, up front: labels 0 or 1, ids within ``table_rows``, finite dense values.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from dlrm_jax.data.batch import Batch, RawBatch, check_ids, process_slice, take
from dlrm_jax.data.shuffle import KeyedPermutation
from dlrm_jax.ids import integer_ids, raw_columns


class ArraySource:
    """The :class:`~dlrm_jax.data.batch.DataSource` of in-memory arrays. ``train`` and ``val``:
    each a tuple ``(dense [n, num_dense] float32, ids [n, sum(bag_sizes)] int32 (-1: an empty
    slot of a bag), labels [n] of 0/1)``, and for dynamic tables a fourth, their raw 64-bit ids;
    ``table_rows`` / ``bag_sizes``: the tables the ids index (a config's ``cfg.table_rows``,
    ``cfg.bag_sizes``); ``seed``, ``eval_batches`` (0: the whole val split) and ``shuffle``
    (False: the rows in the order given, as for time-ordered training): the config's
    ``train.seed``, ``train.eval_batches`` and ``data.shuffle`` unless given (it scored the
    whole split, and shuffled by seed 0, whatever the config said). Shuffling, epochs and the checks are the
    module docstring's::

        source = dlrm_jax.ArraySource((dense, ids, labels), (vd, vi, vl), cfg.train.batch_size,
                                      table_rows=cfg.table_rows, bag_sizes=cfg.bag_sizes)
        dlrm_jax.train_and_evaluate(cfg, "runs/mine", source=source)"""

    def __init__(
        self,
        train: Sequence[np.ndarray],
        val: Sequence[np.ndarray],
        batch_size: int,
        *,
        table_rows: Sequence[int],
        bag_sizes: Sequence[int],
        seed: int | None = None,
        shuffle: bool | None = None,
        eval_batches: int | None = None,
        process_index: int = 0,
        process_count: int = 1,
    ):
        self.train = _checked(train, "train", table_rows, bag_sizes)
        self.val = _checked(val, "val", table_rows, bag_sizes)
        self.num_train, self.num_val = self.train.size, self.val.size
        if self.num_train < batch_size:
            raise ValueError(f"ArraySource: {self.num_train} train rows, fewer than one batch of {batch_size}")
        self._given = (seed, eval_batches, shuffle)  # None: the config's (check_config)
        self._batch, self._seed, self._eval_batches = batch_size, seed or 0, eval_batches or 0
        self._shuffle = True if shuffle is None else shuffle
        self._table_rows, self._bag_sizes = tuple(int(r) for r in table_rows), tuple(int(b) for b in bag_sizes)
        self._rows = process_slice(batch_size, process_index, process_count)
        self._perm: tuple[int, KeyedPermutation] | None = None

    def skip_report(self) -> str:
        return ""

    def check_config(self, cfg, evaluates: bool | None = None) -> None:
        """A ValueError, before any work, where the arrays do not fit ``cfg``: tables, bags,
        dense columns or batch size other than the config's (ids past a 1,000-row table trained
        without a word, or failed deep in the planner), an empty val split where the run
        evaluates (``evaluates``; default: whether ``cfg`` does), raw ids that do not fit its
        dynamic tables (their columns are those tables' bag slots, in table order) or given with
        no table dynamic (they would be ignored). Takes the config's ``train.seed``,
        ``train.eval_batches`` and ``data.shuffle`` where they were not given. ``train_and_evaluate`` and
        ``evaluate_run`` call it."""
        self._check_shapes(cfg)
        self._seed = cfg.train.seed if self._given[0] is None else self._given[0]
        self._eval_batches = cfg.train.eval_batches if self._given[1] is None else self._given[1]
        self._shuffle = cfg.data.shuffle if self._given[2] is None else self._given[2]
        self._perm = None  # (drawn with the seed)
        if self.num_val == 0 and (cfg.train.evaluates if evaluates is None else evaluates):
            raise ValueError(
                "ArraySource: the val split is empty, and the run evaluates (train.eval_every=-1 trains without)"
            )
        want = sum(cfg.bag_sizes[t] for t in cfg.dynamic_tables)
        names = ", ".join(f"cat_{t}" for t in cfg.dynamic_tables)
        given = [
            name
            for name, split in (("train", self.train), ("val", self.val))
            if getattr(split, "raw", None) is not None
        ]
        if len(given) == 1 and self.num_val:  # (the other's ids were read as raw ids: another table's rows)
            other = "val" if given == ["train"] else "train"
            raise ValueError(
                f"ArraySource: raw ids given for {given[0]} and not for {other}; give both splits' dynamic "
                "tables their raw ids (a fourth array), or neither"
            )
        for name, split in (("train", self.train), ("val", self.val)):
            raw = getattr(split, "raw", None)
            if raw is None:
                continue
            if not cfg.dynamic_tables:
                raise ValueError(
                    f"ArraySource {name}: raw ids given, and no table is dynamic (embedding.ids, "
                    f"embedding.table_ids): they would be ignored"
                )
            if raw.shape[2] != want:
                raise ValueError(
                    f"ArraySource {name}: raw ids have {raw.shape[2]} columns; the dynamic tables ({names}) take "
                    f"{want} (their bags' slots, in table order)"
                )

    def _check_shapes(self, cfg) -> None:
        """The arrays' tables, bags, dense columns and batch against ``cfg``'s."""
        for name, given, want, key in (
            ("table_rows", self._table_rows, tuple(cfg.table_rows), "data.cardinalities, capped by data.max_rows"),
            ("bag_sizes", self._bag_sizes, tuple(cfg.bag_sizes), "data.bag_sizes"),
        ):
            if len(given) != len(want):
                raise ValueError(f"ArraySource {name}: {len(given)} tables, the config {len(want)} ({key})")
            for t, (a, b) in enumerate(zip(given, want, strict=True)):
                if a != b:
                    raise ValueError(f"ArraySource {name}: cat_{t} has {a:,} here, {b:,} in the config ({key})")
        for what, given, want, key in (
            ("dense columns", self.train.dense.shape[1], cfg.data.num_dense, "data.num_dense"),
            ("rows a batch", self._batch, cfg.train.batch_size, "train.batch_size"),
        ):
            if given != want:
                raise ValueError(f"ArraySource: {given:,} {what}, the config's {key}={want:,}")

    def train_batch(self, step: int) -> Batch:
        positions = step * self._batch + np.arange(self._rows.start, self._rows.stop, dtype=np.int64)
        epoch, within = np.divmod(positions, self.num_train)
        rows = within.copy()
        if self._shuffle:
            for e in np.unique(epoch):
                at = epoch == e
                rows[at] = self._permutation(int(e))(within[at])
        return take(self.train, rows)

    def _permutation(self, epoch: int) -> KeyedPermutation:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, KeyedPermutation(self.num_train, [self._seed, epoch, 0xA77A]))
        return self._perm[1]

    def eval_batches(self) -> Iterator[Batch]:
        count = -(-self.num_val // self._batch)
        for b in range(min(count, self._eval_batches) if self._eval_batches else count):
            lo = b * self._batch
            rows = np.arange(lo + self._rows.start, min(lo + self._rows.stop, self.num_val))
            yield take(self.val, rows)


def _checked(split, name: str, table_rows, bag_sizes) -> Batch | RawBatch:
    """(dense, ids, labels[, raw]) checked; ``raw``: the dynamic features' raw ids, int64 or
    uint64 [n, R] (as :func:`dlrm_jax.ids.raw_columns` takes them)."""
    if not isinstance(split, tuple | list) or len(split) not in (3, 4):
        raise ValueError(f"ArraySource {name}: expected (dense, ids, labels) or (dense, ids, labels, raw)")
    dense, ids, labels = (np.asarray(x) for x in split[:3])
    ids = integer_ids(ids, f"ArraySource {name}")
    raw = raw_columns(split[3]) if len(split) == 4 else None
    if raw is not None and raw.shape[0] != labels.shape[0]:
        raise ValueError(f"ArraySource {name}: raw ids have {raw.shape[0]} rows, the labels {labels.shape[0]}")
    n = labels.shape[0]
    if dense.ndim != 2 or ids.ndim != 2 or labels.ndim != 1 or dense.shape[0] != n or ids.shape[0] != n:
        raise ValueError(
            f"ArraySource {name}: expected dense [n, D], ids [n, S], labels [n]; got "
            f"{list(dense.shape)}, {list(ids.shape)}, {list(labels.shape)}"
        )
    if ids.shape[1] != sum(bag_sizes):
        raise ValueError(f"ArraySource {name}: ids have {ids.shape[1]} columns, the tables' bags {sum(bag_sizes)}")
    with np.errstate(over="ignore"):  # (1e300 passed as float64, then trained as inf)
        dense32 = dense.astype(np.float32)
    if not np.isfinite(dense32).all():
        row = int(np.argwhere(~np.isfinite(dense32))[0][0])
        big = np.isfinite(dense[row]).all()
        raise ValueError(f"ArraySource {name}: dense row {row} is not finite{' as float32' if big else ''}")
    if not ((labels == 0) | (labels == 1)).all():
        raise ValueError(
            f"ArraySource {name}: label of row {int(np.flatnonzero((labels != 0) & (labels != 1))[0])} is not 0 or 1"
        )
    check_ids(ids, tuple(table_rows), tuple(bag_sizes), f"ArraySource {name}")
    fields = dense32, ids.astype(np.int32), labels.astype(np.float32)
    return Batch(*fields) if raw is None else RawBatch(*fields, raw)
