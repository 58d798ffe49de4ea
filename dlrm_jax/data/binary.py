"""The ``data.source=binary`` loader: memory-mapped ``.npy`` arrays written by ``preprocess``.

On-disk layout (written by :func:`dlrm_jax.data.preprocess.write_dataset` for
``preprocess criteo`` and ``preprocess tabular``)::

    PATH/meta.json                 format_version, num_dense, cardinalities, train_rows, ...
    PATH/{train,val}/dense.npy     float32 [n, num_dense]  normalised dense features
    PATH/{train,val}/ids.npy       int32   [n, F]          table-local ids, one per feature
    PATH/{train,val}/labels.npy    float32 [n]             0 or 1
    PATH/vocab/feature_{f}.npy     uint64  [K_f, 2]        (value, count) of id 1..K_f: Criteo's
                                                           hex number, or a tabular text's
                                                           hash (vocabulary mode only)
    PATH/train/id_counts.npz       ids_{f} int64, counts_{f} int64: how often each id of
                                   feature f occurs in the train split (its HISTOGRAM_IDS
                                   most frequent ids), for choosing hot rows without a pass

Every batch is a pure function of (seed, step, process): a resumed run reads exactly the data
an uninterrupted one read, and each process reads only its own rows of the global batch.

A dataset without dense features (num_dense 0, e.g. a tabular schema of categoricals only) is
read as one all-zero dense column (:func:`model_num_dense`): the model's bottom MLP and its
checkpoints need a non-empty dense input, and a zero input leaves the math unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dlrm_jax.data.batch import Batch, check_ids, process_slice

FORMAT_VERSION = 1
META_FILE = "meta.json"
ID_COUNTS_FILE = "id_counts.npz"
SPLITS = ("train", "val")
ARRAY_DTYPES = {"dense": np.float32, "ids": np.int32, "labels": np.float32}
_META_KEYS = ("num_dense", "cardinalities", "train_rows", "val_rows")


class BinaryFormatError(ValueError):
    """A preprocessed dataset that cannot be used; the message names the offending file."""


def read_meta(path: str | Path) -> dict:
    """The parsed ``PATH/meta.json`` of a preprocessed dataset, checked for version and keys."""
    file = Path(path) / META_FILE
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError:
        raise BinaryFormatError(
            f"{file}: not found; is {path} the output of `dlrm-jax preprocess`?"
        ) from None
    except (OSError, ValueError) as e:
        raise BinaryFormatError(f"{file}: cannot be read as JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        found = meta.get("format_version") if isinstance(meta, dict) else None
        raise BinaryFormatError(
            f"{file}: format_version {found!r} is not supported (expected {FORMAT_VERSION}); "
            f"preprocess the data again"
        )
    missing = [k for k in _META_KEYS if k not in meta]
    if missing:
        raise BinaryFormatError(f"{file}: missing key(s) {', '.join(missing)}")
    return meta


def model_num_dense(stored: int) -> int:
    """The dense width the model is built for, given a dataset's ``num_dense``."""
    return max(stored, 1)


def check_output_target(output: str | Path) -> None:
    """Refuse to replace anything at ``output`` but an earlier preprocessed dataset."""
    out = Path(output)
    if out.exists() and not (out / META_FILE).exists() and (out.is_file() or any(out.iterdir())):
        raise FileExistsError(f"{out}: exists and is not a preprocessed dataset; not replacing it")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_temporaries(output: str | Path) -> list[Path]:
    """Remove ``.NAME.tmp-PID`` / ``.NAME.old-PID`` folders beside ``output`` left by a writer
    that was killed (its PID is no longer running); returns what was removed."""
    out = Path(output)
    removed = []
    for p in out.parent.glob(f".{out.name}.*-*") if out.parent.exists() else ():
        kind, _, pid = p.name[len(out.name) + 2 :].partition("-")
        if kind in ("tmp", "old") and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


HISTOGRAM_IDS = 1 << 20  # ids kept per feature in id_counts.npz: far more than any hot set


class ValueCounter:
    """Per-feature (value, count) tables. Chunk tables are merged only once they outgrow the
    merged table, so features with millions of values cost amortised O(N log N). With
    ``keep``, a merge keeps only the ``keep`` most counted values of a feature (memory stays
    bounded; a value dropped early loses what it had counted)."""

    def __init__(self, features: int, dtype, keep: int = 0):
        self._merged = [(np.zeros(0, dtype), np.zeros(0, np.int64))] * features
        self._pending: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(features)]
        self._keep = keep

    def add(self, values: np.ndarray, empty: np.ndarray) -> None:
        """values [n, F], empty bool [n, F] (not counted)."""
        for f, pending in enumerate(self._pending):
            pending.append(np.unique(values[~empty[:, f], f], return_counts=True))
            if sum(len(v) for v, _ in pending) > max(len(self._merged[f][0]), 1 << 20):
                self._merge(f)

    def _merge(self, f: int) -> None:
        parts = [self._merged[f], *self._pending[f]]
        vals, inverse = np.unique(np.concatenate([v for v, _ in parts]), return_inverse=True)
        counts = np.zeros(len(vals), np.int64)
        np.add.at(counts, inverse, np.concatenate([c for _, c in parts]))
        if self._keep and len(vals) > self._keep:
            top = np.sort(np.lexsort((vals, -counts))[: self._keep])
            vals, counts = vals[top], counts[top]
        self._merged[f], self._pending[f] = (vals, counts), []

    @property
    def features(self) -> int:
        return len(self._merged)

    def table(self, f: int) -> tuple[np.ndarray, np.ndarray]:
        """[V] distinct values (ascending) and int64 [V] their counts."""
        self._merge(f)
        return self._merged[f]


class DatasetWriter:
    """Writes the layout above into a temporary directory beside ``output``.

    Rows are appended in order, the first ``train_rows`` to train/ and the rest to val/, into
    ``.npy`` memmaps created at their final size; the train rows' ids are counted per feature
    (train/id_counts.npz). :meth:`commit` writes meta.json last and
    renames the directory into place, so a crash never leaves a half-written dataset at
    ``output``; as a context manager an exception removes the temporary directory instead.
    """

    def __init__(
        self, output: str | Path, train_rows: int, val_rows: int, num_dense: int, num_features: int
    ):
        self.output = Path(output)
        check_output_target(self.output)
        remove_stale_temporaries(self.output)
        self.root = self.output.with_name(f".{self.output.name}.tmp-{os.getpid()}")
        shutil.rmtree(self.root, ignore_errors=True)
        self.train_rows, self.pos = train_rows, 0
        self.id_counts = ValueCounter(num_features, np.int64, keep=HISTOGRAM_IDS)
        widths = {"dense": (num_dense,), "ids": (num_features,), "labels": ()}
        self.splits = []
        for split, rows in zip(SPLITS, (train_rows, val_rows), strict=True):
            (self.root / split).mkdir(parents=True)
            self.splits.append({
                name: np.lib.format.open_memmap(self.root / split / f"{name}.npy", mode="w+",
                                                dtype=dtype, shape=(rows, *widths[name]))
                for name, dtype in ARRAY_DTYPES.items()
            })  # fmt: skip

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    def append(self, dense: np.ndarray, ids: np.ndarray, labels: np.ndarray) -> None:
        """The next rows: dense float32 [n, num_dense], ids int32 [n, F], labels float32 [n]."""
        n, total = len(labels), sum(len(split["labels"]) for split in self.splits)
        if self.pos + n > total:
            raise RuntimeError(f"{self.output}: more than the {total} rows announced")
        cut = min(max(self.train_rows - self.pos, 0), n)  # rows [:cut] belong to train
        self.id_counts.add(ids[:cut].astype(np.int64), ids[:cut] < 0)
        for name, x in (("dense", dense), ("ids", ids), ("labels", labels)):
            self.splits[0][name][self.pos : self.pos + cut] = x[:cut]
            if cut < n:
                start = self.pos + cut - self.train_rows
                self.splits[1][name][start : start + n - cut] = x[cut:]
        self.pos += n

    def commit(self, meta: dict) -> None:
        """Flush, write meta.json (format_version added) and move the dataset to ``output``."""
        expected = sum(len(split["labels"]) for split in self.splits)
        if self.pos != expected:
            raise RuntimeError(f"{self.output}: {self.pos} rows written, {expected} expected")
        for a in (a for split in self.splits for a in split.values()):
            a.flush()
        self.splits = []  # drop the memmaps before renaming
        tables = [self.id_counts.table(f) for f in range(self.id_counts.features)]
        np.savez(self.root / "train" / ID_COUNTS_FILE, **{f"ids_{f}": v for f, (v, _) in enumerate(tables)},
                 **{f"counts_{f}": c for f, (_, c) in enumerate(tables)})
        meta = {"format_version": FORMAT_VERSION, **meta}
        (self.root / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
        if self.output.exists():  # an earlier dataset: replaced only now that this one is whole
            old = self.output.with_name(f".{self.output.name}.old-{os.getpid()}")
            self.output.rename(old)
            self.root.rename(self.output)
            shutil.rmtree(old)
        else:
            self.root.rename(self.output)


def _load_split(root: Path, split: str, rows: int, widths: dict[str, int]) -> dict[str, np.ndarray]:
    """Memory-map one split's arrays; shapes and dtypes must match ``rows`` and ``widths``."""
    arrays = {}
    for name, dtype in ARRAY_DTYPES.items():
        file = root / split / f"{name}.npy"
        try:
            a = np.load(file, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise BinaryFormatError(f"{file}: cannot be memory-mapped ({e})") from None
        want = (rows, widths[name]) if name in widths else (rows,)
        if a.shape != want or a.dtype != dtype:
            raise BinaryFormatError(
                f"{file}: expected {np.dtype(dtype).name} {list(want)} (from {root / META_FILE} "
                f"and the config), found {a.dtype.name} {list(a.shape)}"
            )
        arrays[name] = a
    return arrays


def split_sizes(n: int, val_fraction: float) -> tuple[int, int]:
    """(train, val) sizes of n rows when the last ``val_fraction`` of them are held out."""
    n_val = min(n, int(n * val_fraction + 0.5))
    return n - n_val, n_val


def train_positions(step: int, batch: int, rows: slice) -> np.ndarray:
    """int64 [rows]: positions in the endless training sequence of this process's slice."""
    return step * batch + np.arange(rows.start, rows.stop, dtype=np.int64)


def eval_positions(num_val: int, batch: int, rows: slice, max_batches: int) -> Iterator[np.ndarray]:
    """int64 [<= rows] per global eval batch of ``batch`` val rows (the last may be partial;
    ``max_batches`` of them, 0 = all): this process's ``rows`` of each, possibly empty."""
    total = -(-num_val // batch)
    for i in range(min(total, max_batches) if max_batches else total):
        lo, hi = (min(i * batch + r, num_val) for r in (rows.start, rows.stop))
        yield np.arange(lo, hi, dtype=np.int64)


def _gather(arrays: dict[str, np.ndarray], rows: np.ndarray) -> list[np.ndarray]:
    """[dense, ids, labels] at ``rows`` (int64 [n]) of one split: read in ascending row order
    for memmap locality, returned in ``rows`` order."""
    order = np.argsort(rows, kind="stable")
    out = []
    for name in ARRAY_DTYPES:
        x = np.empty((len(rows), *arrays[name].shape[1:]), dtype=arrays[name].dtype)
        x[order] = arrays[name][rows[order]]
        out.append(x)
    return out


class BinarySource:
    """The :class:`~dlrm_jax.data.batch.DataSource` for ``data.source=binary``.

    Training positions form an endless sequence of epochs over the train split; epoch ``e`` is
    ``default_rng([seed, e]).permutation(n_train)`` when ``data.shuffle`` (identity otherwise)
    and a global batch may straddle two epochs.
    """

    def __init__(self, cfg, process_index: int = 0, process_count: int = 1):
        self.root = Path(cfg.data.path)
        self.meta = read_meta(self.root)
        meta_file = self.root / META_FILE
        cards = tuple(int(c) for c in self.meta["cardinalities"])
        stored_dense = int(self.meta["num_dense"])
        if model_num_dense(stored_dense) != cfg.data.num_dense or len(cards) != cfg.num_features:
            raise BinaryFormatError(
                f"{meta_file}: the data has {self.meta['num_dense']} dense and {len(cards)} "
                f"categorical features, the config data.num_dense={cfg.data.num_dense} and "
                f"{cfg.num_features} data.cardinalities"
            )
        widths = {"dense": stored_dense, "ids": sum(cfg.bag_sizes)}
        self._zero_dense = stored_dense == 0  # fed as one all-zero column
        self.train = _load_split(self.root, "train", int(self.meta["train_rows"]), widths)
        self.val = _load_split(self.root, "val", int(self.meta["val_rows"]), widths)
        self.num_train = len(self.train["labels"])
        self.num_val = len(self.val["labels"])
        if self.num_train == 0:
            raise BinaryFormatError(f"{self.root / 'train'}: the train split is empty")
        self._batch = cfg.train.batch_size
        self._rows = process_slice(self._batch, process_index, process_count)
        self._seed = cfg.train.seed
        self._shuffle = cfg.data.shuffle
        self._eval_batches = cfg.train.eval_batches
        self._table_rows = cfg.table_rows
        self._bag_sizes = cfg.bag_sizes
        # Features whose stored ids exceed the table (data.max_rows cap) are hashed into it.
        self._hashed = [
            f for f, (c, r) in enumerate(zip(cards, cfg.table_rows, strict=True)) if c > r
        ]
        self._perms: dict[int, np.ndarray] = {}  # at most two epochs: a batch spans <= 2

    def skip_report(self) -> str:
        """What preprocessing skipped to make this dataset, in one line ('' if nothing)."""
        skipped = int(self.meta.get("skipped", 0))
        if not skipped:
            return ""
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.meta.get("skipped_by_reason", {}).items()))
        return f"{self.root}: preprocessing skipped {skipped} malformed line(s) ({reasons})"

    def id_histograms(self) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """Per feature, the train split's ids (int64, distinct) and how often each occurs,
        mapped into the tables as batches are (``data.max_rows`` hashing); None for a dataset
        preprocessed before histograms were written."""
        path = self.root / "train" / ID_COUNTS_FILE
        if not path.exists():
            return None
        try:
            with np.load(path) as saved:
                raw = [(saved[f"ids_{f}"], saved[f"counts_{f}"]) for f in range(len(self._table_rows))]
        except (OSError, ValueError, KeyError) as e:
            raise BinaryFormatError(f"{path}: cannot be read ({e}); preprocess the data again") from None
        out = []
        for f, (ids, counts) in enumerate(raw):
            if f in self._hashed:  # the same id % rows the batches go through
                ids, inverse = np.unique(ids % self._table_rows[f], return_inverse=True)
                counts = np.bincount(inverse, weights=counts).astype(np.int64)
            out.append((ids.astype(np.int64), counts))
        return out

    # ---------------------------------------------------------------- training
    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                del self._perms[min(self._perms)]
            perm = np.random.default_rng([self._seed, epoch]).permutation(self.num_train)
            self._perms[epoch] = perm
        return self._perms[epoch]

    def train_rows(self, step: int) -> np.ndarray:
        """int64 [B/processes]: the train-split rows of this process's slice of batch ``step``."""
        epoch, within = np.divmod(train_positions(step, self._batch, self._rows), self.num_train)
        if not self._shuffle:
            return within
        rows = np.empty_like(within)
        for e in np.unique(epoch):
            sel = epoch == e
            rows[sel] = self._permutation(int(e))[within[sel]]
        return rows

    def train_batch(self, step: int) -> Batch:
        return self._read(self.train, "train", self.train_rows(step), f"training step {step}")

    # ---------------------------------------------------------------- evaluation
    def eval_batches(self) -> Iterator[Batch]:
        """The val split in order: global batches of B (the last may be partial), this
        process's slice of each, ``train.eval_batches`` of them (0 = the whole split)."""
        ranges = eval_positions(self.num_val, self._batch, self._rows, self._eval_batches)
        for i, rows in enumerate(ranges):
            yield self._read(self.val, "val", rows, f"evaluation batch {i}")

    # ---------------------------------------------------------------- reading
    def _read(
        self, arrays: dict[str, np.ndarray], split: str, rows: np.ndarray, what: str
    ) -> Batch:
        """Gather ``rows`` of one split, map ids into the tables and check every value."""
        dense, ids, labels = _gather(arrays, rows)
        if self._zero_dense:
            dense = np.zeros((len(rows), 1), np.float32)
        bad = ~np.isfinite(dense)
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise BinaryFormatError(
                f"{self.root / split / 'dense.npy'}: row {int(rows[r])} has a non-finite "
                f"value {dense[r, c]} in column {int(c)} (read for {what})"
            )
        self._cap_ids(ids)
        check_ids(
            ids, self._table_rows, self._bag_sizes, f"{self.root / split / 'ids.npy'} ({what})"
        )
        return Batch(dense, ids, labels)

    def _cap_ids(self, ids: np.ndarray) -> None:
        """In place: id % table_rows for the hashed features, padding slots left alone."""
        starts = np.concatenate([[0], np.cumsum(self._bag_sizes)])
        for f in self._hashed:
            block = ids[:, starts[f] : starts[f + 1]]
            rows = self._table_rows[f]
            block[...] = np.where(block >= 0, block % rows, block)
