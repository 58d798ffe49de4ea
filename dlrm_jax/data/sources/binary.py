"""The ``data.source=binary`` loader: memory-mapped shards written by ``dlrm-jax preprocess``
(layout in :mod:`dlrm_jax.data.shards`).

**Which rows a process reads.** Shuffled, process p of P owns the contiguous rows
``[p*M/P, (p+1)*M/P)`` of the M train rows (so with many shards it opens about 1/P of them)
and cycles over them: its *stream*. In order (``data.shuffle=false``), global batch s is the
split's rows ``[s*B, (s+1)*B)`` (cycling), each process reading its slice of them: the
processes together train the rows in the order they were written (time order, as
progressive validation needs), whatever their number. Every batch is a pure function of
(seed, step, process): a resumed run reads exactly what an uninterrupted one read, and the
P processes' rows are disjoint and together cover the split.

**Shuffling (``data.shuffle``).** The dataset was shuffled globally when it was preprocessed;
at training time each epoch e turns a process's stream by a keyed offset, cuts it into blocks
of ``data.shuffle_block`` rows (at most 1/64 of the stream, so small data still has 64 blocks
to shuffle), and visits the blocks in the order of a keyed bijection of (seed, e, p)
(:class:`~dlrm_jax.data.shuffle.KeyedPermutation`), the last partial block last: the blocks
hold other rows every epoch, and come in another order. Every row is read exactly once per
epoch, memory does not grow with the dataset, and a batch is a few large contiguous reads
(B / block_rows + 3 of them). Without shuffling, the stream is read in order.

A dataset without dense features (num_dense 0) is read as one all-zero dense column
(:func:`model_num_dense`): the bottom MLP needs a non-empty input, and zeros change nothing.

**Raw values.** A dataset preprocessed with ``--raw-values`` keeps each feature's 64-bit value
beside its id; with dynamic tables (``embedding.ids=dynamic``) batches carry their features'
values (:class:`~dlrm_jax.data.batch.RawBatch`) and the tables map those. The packed feed
reads a row's values whole, straight into the buffer (:attr:`BinarySource.raw_layout`), and the
step picks the dynamic features' on the device. Without raw values the dynamic tables map the
dataset's ids.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dlrm_jax.data.batch import PAD_ID, Batch, RawBatch, process_slice
from dlrm_jax.data.shards import (
    ARRAY_DTYPES,
    ID_COUNTS_FILE,
    META_FILE,
    RAW_DTYPES,
    SPLITS,
    BinaryFormatError,
    read_meta,
    shard_name,
)
from dlrm_jax.data.shuffle import KeyedPermutation
from dlrm_jax.data.sources.split_files import SplitFiles, runs_of
from dlrm_jax.hashing import mix64
from dlrm_jax.ids import raw_columns

MIN_BLOCKS = 64  # a stream is cut into at least this many blocks to shuffle (or single rows)
PLACES_CHUNK = 4096  # blocks whose shuffled places are computed together (256 steps of 65,536 in blocks of 4,096)
CHECK_ROWS = 256  # rows whose ids one comparison spans (see IdRanges)
PLACES_KEPT = 8  # chunks of places kept (an epoch's boundary needs two epochs' chunks)

__all__ = ["BinaryFormatError", "BinarySource", "read_meta", "model_num_dense"]


def model_num_dense(stored: int) -> int:
    """The dense width the model is built for, given a dataset's ``num_dense``."""
    return max(stored, 1)


def train_positions(step: int, batch: int, rows: slice) -> np.ndarray:
    """int64 [rows]: positions in the endless training sequence of this process's slice."""
    return step * batch + np.arange(rows.start, rows.stop, dtype=np.int64)


def eval_count(num_val: int, batch: int, max_batches: int) -> int:
    """Global eval batches of ``batch`` val rows (the last may be partial), at most
    ``max_batches`` (0 = all)."""
    total = -(-num_val // batch)
    return min(total, max_batches) if max_batches else total


def eval_rows(num_val: int, batch: int, rows: slice, i: int) -> np.ndarray:
    """int64 [<= rows]: this process's ``rows`` of global eval batch ``i``, possibly empty."""
    lo, hi = (min(i * batch + r, num_val) for r in (rows.start, rows.stop))
    return np.arange(lo, hi, dtype=np.int64)


class IdRanges:
    """Each id column's valid values: ``[0, rows)`` of its table, and ``PAD_ID`` too in a
    multi-hot bag's columns."""

    def __init__(self, table_rows: tuple[int, ...], bag_sizes: tuple[int, ...]):
        self.upper = np.repeat(np.asarray(table_rows, np.int64), bag_sizes)  # per id column
        self.lower = np.where(np.repeat(bag_sizes, bag_sizes) > 1, PAD_ID, 0).astype(np.int32)
        self._span = (self.upper - self.lower).astype(np.uint32)
        self._shifts = bool(self.lower.any())
        # the same, CHECK_ROWS rows side by side: a comparison broadcast over one row's few
        # columns runs 3x slower than one over this many
        self._lower_rows = np.tile(self.lower.view(np.uint32), CHECK_ROWS)
        self._span_rows = np.tile(self._span, CHECK_ROWS)

    def hold(self, ids: np.ndarray) -> bool:
        """Whether every id of ``ids`` (int32 ``[..., n, columns]``, each row block
        C-contiguous) is valid: ``ids - lower`` as uint32 (negatives wrap) is below the span."""
        u = ids.view(np.uint32)
        n = u.shape[-2]
        whole = n - n % CHECK_ROWS
        lead = u.shape[:-2]
        for part, lower, span in (
            (u[..., :whole, :].reshape(*lead, -1, self._span_rows.shape[0]), self._lower_rows, self._span_rows),
            (u[..., whole:, :], self.lower.view(np.uint32), self._span),
        ):
            shifted = part - lower if self._shifts else part
            if (shifted >= span).any():
                return False
        return True

    def first_bad(self, ids: np.ndarray) -> tuple[int, ...]:
        """The index (``[..., row, column]``) of the first invalid id (when :meth:`hold` is False)."""
        return tuple(int(i) for i in np.argwhere((ids < self.lower) | (ids >= self.upper))[0])


def check_windows(meta: dict, root: Path) -> None:
    """A BinaryFormatError unless the dataset at ``root`` (its ``meta``) recorded windows in
    order (``train.progressive_window=data``)."""
    if not meta.get("windows") or meta.get("shuffled", True):
        raise BinaryFormatError(
            f"{Path(root) / META_FILE}: records no windows (train.progressive_window=data): preprocess "
            f"the data with --no-shuffle"
        )


class BinarySource:
    """The :class:`~dlrm_jax.data.batch.DataSource` for ``data.source=binary`` (see the module
    docstring for which rows each process reads and how epochs are shuffled)."""

    def __init__(self, cfg, process_index: int = 0, process_count: int = 1):
        self.root = Path(cfg.data.path)
        self.meta = read_meta(self.root)
        cards = tuple(int(c) for c in self.meta["cardinalities"])
        bags = tuple(int(b) for b in self.meta["bag_sizes"])
        stored_dense = int(self.meta["num_dense"])
        if (model_num_dense(stored_dense), len(cards), bags) != (
            cfg.data.num_dense,
            cfg.num_features,
            tuple(cfg.bag_sizes),
        ):
            raise BinaryFormatError(
                f"{self.root / META_FILE}: the data has {stored_dense} dense and {len(cards)} categorical "
                f"features with bags {list(bags)}, the config data.num_dense={cfg.data.num_dense}, "
                f"{cfg.num_features} data.cardinalities and data.bag_sizes={list(cfg.bag_sizes)}"
            )
        given = tuple(int(c) for c in cfg.data.cardinalities)
        smaller = [f for f, (a, b) in enumerate(zip(cards, given, strict=True)) if b < a]
        if smaller:  # its ids would be folded into fewer rows than it has, without a word
            f = smaller[0]
            raise BinaryFormatError(
                f"{self.root / META_FILE}: table cat_{f} has {cards[f]:,} values there, {given[f]:,} in the "
                f"config's data.cardinalities: binary data's configs take the dataset's (dlrm_jax.resolve_data_config"
                f"(cfg) gives them; train_and_evaluate and the commands do it)"
            )
        widths = {"dense": stored_dense, "ids": sum(bags)}
        self._dynamic = list(cfg.dynamic_tables) if self.meta.get("raw_values") else []  # their values are read
        if self._dynamic:
            widths["raw"] = len(cards)
        self._zero_dense = stored_dense == 0  # fed as one all-zero column
        self._stored_dense = stored_dense
        self.num_train, self.num_val = int(self.meta["train_rows"]), int(self.meta["val_rows"])
        for split, rows in (("train", self.num_train), ("val", self.num_val)):
            held = sum(int(n) for n in self.meta["shards"][split])
            if held != rows:
                raise BinaryFormatError(
                    f"{self.root / 'meta.json'}: says {rows:,} {split} rows, and its {split} shards "
                    f"hold {held:,}; the dataset is damaged or edited: preprocess it again"
                )
        if self.num_train == 0:
            raise BinaryFormatError(f"{self.root / 'train'}: the train split is empty")
        self._lo = self.num_train * process_index // process_count if cfg.data.shuffle else 0
        self._hi = self.num_train * (process_index + 1) // process_count if cfg.data.shuffle else self.num_train
        if self._hi == self._lo:
            raise BinaryFormatError(f"{self.root}: {self.num_train} train rows for {process_count} processes")
        self.train = SplitFiles(self.root, "train", self.meta["shards"]["train"], widths, self._lo, self._hi)
        self.val = SplitFiles(self.root, "val", self.meta["shards"]["val"], widths, 0, self.num_val)
        self._batch, self._process = cfg.train.batch_size, process_index
        self._rows = process_slice(self._batch, process_index, process_count)
        self._seed, self._shuffle = cfg.train.seed, cfg.data.shuffle
        self._block = max(1, min(cfg.data.shuffle_block, (self._hi - self._lo) // MIN_BLOCKS))
        self._eval_batches = cfg.train.eval_batches
        self._table_rows, self._bag_sizes = cfg.table_rows, tuple(cfg.bag_sizes)
        # ids are checked against the dataset's own sizes, before any cap folds them (a cap hid
        # a damaged id: it was folded into the table first)
        self._cards = cards
        self._id_ranges = IdRanges(cards, self._bag_sizes)
        self._keep_places()
        # Features whose stored ids exceed the table (data.max_rows cap) are hashed into it.
        self._hashed = [f for f, (c, r) in enumerate(zip(cards, cfg.table_rows, strict=True)) if c > r]

    @property
    def raw_layout(self) -> tuple[int, tuple[int, ...]] | None:
        """(values per row, the dynamic features' columns among them) when batches carry raw
        values (:func:`dlrm_jax.data.packed.packed_reader`), else None."""
        return (len(self._table_rows), tuple(self._dynamic)) if self._dynamic else None

    def window_steps(self, steps: int) -> list[tuple[int, str]]:
        """(first step, label) of each of the dataset's windows met in ``steps`` steps, in order
        (``train.progressive_window=data``): the windows preprocessing recorded (input files, or
        spans of a time column), a batch belonging to the window of its first row; the windows
        come round again each epoch."""
        first, window = self._window_starts(steps)
        held = first < steps
        labels = self.meta["windows"]["labels"]
        # (a time in full: Unix seconds read 1.49401e+09 in %g)
        by, column = self.meta["windows"]["by"], self.meta["windows"].get("column")
        text = (lambda x: str(x)) if by == "input" else (lambda x: f"{column} {x:.15g}")
        return [(int(s), text(labels[w])) for s, w in zip(first[held], window[held], strict=True)]

    def window_end(self, steps: int) -> int | None:
        """The step the window under way at step ``steps - 1`` ends at (the next window's first
        step, at or past ``steps``): a run that stops inside a window scores all of it, as the
        run that goes on does. None where the windows never change (a dataset of one window)."""
        first, _ = self._window_starts(steps)
        after = first[first >= steps]
        return int(after[0]) if after.size else None

    def _window_starts(self, steps: int) -> tuple[np.ndarray, np.ndarray]:
        """Each window's first step (and which window it is) from step 0 to at least an epoch
        past ``steps``."""
        check_windows(self.meta, self.root)
        if self._shuffle:
            raise BinaryFormatError(
                f"{self.root}: train.progressive_window=data reads the train rows in order (data.shuffle=false)"
            )
        # Each window's start in the endless stream, epoch after epoch (work per window, not per
        # step); its first step is the first whose first row is at or past it.
        starts, m, b = np.asarray(self.meta["windows"]["starts"], np.int64), self.num_train, self._batch
        epochs = -(-steps * b // m) + 2
        first = -(-(np.arange(epochs)[:, None] * m + starts).ravel() // b)
        window = np.tile(np.arange(len(starts)), epochs)
        held = np.append(first[1:] != first[:-1], True)  # of starts before one step's first row, the last
        first, window = first[held], window[held]
        new = np.append(True, window[1:] != window[:-1])  # a window that follows itself goes on
        return first[new], window[new]

    def close(self) -> None:
        """Closes the shard files the reads hold open (a source collected closes them too)."""
        self.train.close()
        self.val.close()

    def skip_report(self) -> str:
        """What preprocessing skipped to make this dataset, in one line ('' if nothing)."""
        skipped = int(self.meta.get("skipped", 0))
        if not skipped:
            return ""
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.meta.get("skipped_by_reason", {}).items()))
        return f"{self.root}: preprocessing skipped {skipped} malformed line(s) ({reasons})"

    def id_histograms(self) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """Per feature, the most frequent ids (int64, distinct) and how often each occurs,
        mapped into the tables as batches are (``data.max_rows`` hashing); None when the
        dataset has none (multi-hot data: hot planning counts batches instead)."""
        path = self.root / SPLITS[0] / ID_COUNTS_FILE
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
    def train_runs(self, step: int) -> list[tuple[int, int]]:
        """(first train-split row, length) of the contiguous pieces of this process's slice
        of batch ``step``, in batch order: about B / (processes * block) + 2 of them."""
        per, m, k = self._rows.stop - self._rows.start, self._hi - self._lo, self._block
        if not self._shuffle:  # the split in order: this process's slice of rows [step*B, (step+1)*B)
            runs, start = [], (step * self._batch + self._rows.start) % m
            while per:
                take = min(per, m - start)
                runs.append((self._lo + start, take))
                start, per = 0, per - take
            return runs
        full = m // k  # blocks past ``full`` (the partial tail) keep their place
        pieces, pos, end = [], step * per, (step + 1) * per  # (epoch, block, offset, length)
        while pos < end:
            epoch, within = divmod(pos, m)
            block, offset = divmod(within, k)
            take = min(end - pos, (k - offset) if block < full else m - within)
            pieces.append((epoch, block, offset, take))
            pos += take
        runs = []
        for e, b, o, n in pieces:  # a run that passes the stream's end goes on from its start
            place = self._block_place(e, b, full) if self._shuffle and b < full else b
            start = (place * k + o + (self._turn(e, m) if self._shuffle else 0)) % m
            first = min(n, m - start)
            runs.append((self._lo + start, first))
            if first < n:
                runs.append((self._lo, n - first))
        return runs

    def __getstate__(self) -> dict:  # picklable (reader processes, data.reader_processes)
        state = dict(self.__dict__)
        del state["_chunk_places"], state["_turn"]  # caches of bound methods: made again
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._keep_places()

    def _keep_places(self) -> None:
        """The shuffle's block places (a chunk of ``PLACES_CHUNK`` blocks per permutation) and
        each epoch's turn, computed once and kept for the last few chunks and epochs: a step's
        few blocks would otherwise cost a permutation's rounds every step, on the reader
        threads' GIL (``lru_cache`` is safe for the readers to share)."""
        self._chunk_places = functools.lru_cache(PLACES_KEPT)(self._places_of_chunk)
        self._turn = functools.lru_cache(PLACES_KEPT)(self._turn_of)

    def _block_place(self, epoch: int, block: int, blocks: int) -> int:
        """Where block ``block`` of epoch ``epoch`` is read from: the epoch's keyed permutation
        of its ``blocks`` whole blocks."""
        chunk, at = divmod(block, PLACES_CHUNK)
        return int(self._chunk_places(epoch, chunk, blocks)[at])

    def _places_of_chunk(self, epoch: int, chunk: int, blocks: int) -> np.ndarray:
        perm = KeyedPermutation(max(blocks, 1), [self._seed, epoch, self._process])
        return perm(np.arange(chunk * PLACES_CHUNK, min((chunk + 1) * PLACES_CHUNK, blocks), dtype=np.int64))

    def _turn_of(self, epoch: int, m: int) -> int:
        """The keyed offset epoch ``epoch`` turns this process's stream by."""
        return int(mix64(np.array([self._seed, epoch, self._process, 0x5EED], np.uint64)).sum() % np.uint64(m))

    def train_rows(self, step: int) -> np.ndarray:
        """int64 [B/processes]: the train-split rows of this process's slice of batch ``step``."""
        return np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in self.train_runs(step)])

    def train_ids(self, step: int) -> np.ndarray:
        return self.train_batch(step).ids

    def train_batch(self, step: int) -> Batch | RawBatch:
        runs = self.train_runs(step)
        return self._batch_of(self.train, runs, f"training step {step}")

    # ---------------------------------------------------------------- evaluation
    def eval_batch_count(self) -> int:
        """Global batches of B in the val split (the last may be partial), ``train.eval_batches``
        of them (0 = the whole split)."""
        return eval_count(self.num_val, self._batch, self._eval_batches)

    def eval_batch(self, i: int) -> Batch | RawBatch:
        """This process's slice of eval batch ``i`` (any order, from any thread)."""
        rows = eval_rows(self.num_val, self._batch, self._rows, i)
        return self._batch_of(self.val, runs_of(rows), f"evaluation batch {i}")

    def eval_batches(self) -> Iterator[Batch]:
        """The val split in order: :meth:`eval_batch` of each."""
        return map(self.eval_batch, range(self.eval_batch_count()))

    # ---------------------------------------------------------------- reading
    def _batch_of(self, split: SplitFiles, runs: list[tuple[int, int]], what: str) -> Batch | RawBatch:
        """Read ``runs`` of a split into a new batch, map ids into the tables and check every value."""
        n = sum(length for _, length in runs)
        widths = {
            "dense": (model_num_dense(self._stored_dense),),
            "ids": (sum(self._bag_sizes),),
            "labels": (),
            "raw": (len(self._table_rows),),
        }
        dtypes = ARRAY_DTYPES | (RAW_DTYPES if self._dynamic else {})
        whole = {k: np.empty((1, n, *widths[k]), d) for k, d in dtypes.items()}
        self._read_checked(split, runs, what, whole)
        batch = Batch(whole["dense"][0], whole["ids"][0], whole["labels"][0])
        return RawBatch(*batch, raw_columns(whole["raw"][0][:, self._dynamic])) if self._dynamic else batch

    def train_batch_into(self, step: int, fields: dict[str, np.ndarray]) -> None:
        """``train_batch(step)`` written in place: ``fields`` maps each field to a
        ``[pieces, rows, ...]`` array whose pieces hold consecutive rows of the batch (a packed
        buffer's shards, :mod:`dlrm_jax.data.packed`)."""
        self._read_checked(self.train, self.train_runs(step), f"training step {step}", fields)

    def _read_checked(self, split: SplitFiles, runs: list[tuple[int, int]], what: str, fields: dict) -> None:
        """Read ``runs`` into ``fields`` (``[pieces, rows, ...]`` each), map ids into the tables
        and check every value, each check one pass over all pieces; an error names the file and
        the split's row."""
        read = dict(fields)
        if self._zero_dense:  # read as one all-zero column
            fields["dense"][...] = 0
            del read["dense"]
        split.read_into(runs, [{k: v[j] for k, v in read.items()} for j in range(len(fields["labels"]))])
        dense, ids, labels = fields["dense"], fields["ids"], fields["labels"]
        rows = labels.shape[1]

        def row(piece_and_row) -> int:  # the split's row of the batch's row
            at = int(piece_and_row[0]) * rows + int(piece_and_row[1])
            return int(np.concatenate([np.arange(s, s + n) for s, n in runs])[at])

        if not self._zero_dense and not np.isfinite(dense).all():
            j, r, c = np.argwhere(~np.isfinite(dense))[0]
            raise BinaryFormatError(
                f"{self._file_of(split, row((j, r)), 'dense')}: row {row((j, r))} of the "
                f"{split.name} split has a non-finite value {dense[j, r, c]} in column "
                f"{int(c)} (read for {what})"
            )
        if not ((labels == 0) | (labels == 1)).all():  # a click label is 0 or 1; 5.0 would train on
            j, r = np.argwhere((labels != 0) & (labels != 1))[0]
            raise BinaryFormatError(
                f"{self._file_of(split, row((j, r)), 'labels')}: row {row((j, r))} of the "
                f"{split.name} split has label {labels[j, r]}, not 0 or 1 (read for {what})"
            )
        if not self._id_ranges.hold(ids):
            j, r, c = self._id_ranges.first_bad(ids)
            f = int(np.searchsorted(np.cumsum(self._bag_sizes), c, side="right"))
            raise BinaryFormatError(
                f"{self._file_of(split, row((j, r)), 'ids')}: row {row((j, r))} of the "
                f"{split.name} split: feature {f} (table cat_{f}, {self._cards[f]} values in the "
                f"dataset) has id {int(ids[j, r, c])} out of range (read for {what})"
            )
        self._cap_ids(ids)

    def _file_of(self, split: SplitFiles, row: int, name: str) -> Path:
        k = int(np.searchsorted(split.starts, row, side="right") - 1)
        return self.root / split.name / shard_name(k) / f"{name}.npy"

    def _cap_ids(self, ids: np.ndarray) -> None:
        """In place: id % table_rows for the hashed features, padding slots left alone."""
        starts = np.concatenate([[0], np.cumsum(self._bag_sizes)])
        for f in self._hashed:
            block = ids[..., starts[f] : starts[f + 1]]
            rows = self._table_rows[f]
            block[...] = np.where(block >= 0, block % rows, block)
