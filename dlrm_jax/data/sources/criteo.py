"""Criteo Kaggle/Terabyte TSV: the strict line parser (what ``preprocess criteo`` falls back to,
to name what is wrong with a line), synthetic TSV for tests, and :class:`CriteoTSVSource`,
which trains straight from small TSVs (:mod:`~dlrm_jax.data.preprocessing.criteo_preprocess` makes binary
datasets).

A line is ``label \\t I1..I13 \\t C1..C26``: label 0/1, integer features (empty = missing, may be
negative), categorical features as hex strings (empty = missing). Lines are checked with one
compiled regular expression and converted a chunk at a time with numpy; only lines that fail
the check take the slow path that says what is wrong with them.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dlrm_jax.data import shards
from dlrm_jax.data.batch import Batch, RawBatch, process_slice
from dlrm_jax.data.preprocessing.preprocess import (
    BadLine,
    DataFormatError,
    SkipLog,
    byte_progress,
    hash_ids,
    is_gzip,
    open_input,
)
from dlrm_jax.data.sources import binary, check_data_path, criteo_paths
from dlrm_jax.data.sources.drifting import StreamWindow
from dlrm_jax.data.sources.synthetic import RawSamples, normalise_dense
from dlrm_jax.ids import raw_columns

NUM_DENSE, NUM_CATEGORICAL = 13, 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_CATEGORICAL
_INT = rb"(?:-?[0-9]{1,18})?"  # empty or an integer of at most 18 digits: always fits int64
_HEX = rb"[0-9a-fA-F]{0,16}"  # held as uint64 (Criteo's values have 8 digits)
_VALID = re.compile(rb"[01](?:\t%s){13}(?:\t%s){26}\r?\n?" % (_INT, _HEX))
_NIBBLE = np.zeros(256, dtype=np.uint8)  # ASCII code -> hex digit value
for _d in "0123456789abcdef":
    _NIBBLE[ord(_d)] = _NIBBLE[ord(_d.upper())] = int(_d, 16)


class CriteoFormatError(DataFormatError):
    """A malformed line; the message starts with ``path:lineno:`` (1-based)."""


class ParsedLines(NamedTuple):
    """The n valid lines of a chunk as arrays, and the others as :class:`BadLine`.

    counts:  int64  [n, 13]  integer features, 0 where missing
    missing: bool   [n, 13]
    values:  uint64 [n, 26]  categorical hex strings as integers, 0 where empty
    empty:   bool   [n, 26]
    labels:  int8   [n]
    rows:    int64  [n]      index of each valid line in the input list
    """

    counts: np.ndarray
    missing: np.ndarray
    values: np.ndarray
    empty: np.ndarray
    labels: np.ndarray
    rows: np.ndarray
    bad: list[BadLine]


def _show(value: bytes) -> str:
    text = value.decode("utf-8", "replace")
    return repr(text if len(text) <= 40 else text[:40] + "...")


def diagnose_line(line: bytes) -> tuple[str, str]:
    """(kind, message) saying why a line that failed the fast check is malformed."""
    text = line[:-1] if line.endswith(b"\n") else line
    text = text[:-1] if text.endswith(b"\r") else text
    fields = text.split(b"\t")
    if not text:
        return "empty line", "empty line"
    if len(fields) != NUM_FIELDS:
        return "field count", f"expected {NUM_FIELDS} tab-separated fields, found {len(fields)}"
    if fields[0] not in (b"0", b"1"):
        return "label", f"label is {_show(fields[0])}, expected 0 or 1"
    for k, v in enumerate(fields[1 : 1 + NUM_DENSE], 1):
        if not re.fullmatch(_INT, v):
            what = "has over 18 digits" if re.fullmatch(rb"-?[0-9]+", v) else "is not an integer"
            return "integer field", f"integer field I{k} {what}: {_show(v)}"
    for k, v in enumerate(fields[1 + NUM_DENSE :], 1):
        if not re.fullmatch(_HEX, v):
            what = "has over 16 digits" if re.fullmatch(rb"[0-9a-fA-F]+", v) else "is not hex"
            return "categorical field", f"categorical field C{k} {what}: {_show(v)}"
    return "unknown", "malformed line"  # unreachable while _VALID and the checks above agree


def _hex_to_uint64(fields: np.ndarray) -> np.ndarray:
    """bytes [n, k] of at most 16 hex digits -> uint64 [n, k], vectorised.

    The NUL-padded digits are read as a 16-digit number (so "ab" reads as 0xab00...00), then
    shifted right by 4 bits per missing digit.
    """
    digits = fields.astype("S16").view(np.uint8).reshape(*fields.shape, 16)
    nibbles = _NIBBLE[digits]
    packed = (nibbles[..., 0::2] << 4) | nibbles[..., 1::2]  # uint8 [n, k, 8], big-endian
    padded = packed.view(">u8")[..., 0].astype(np.uint64)
    shift = 4 * (16 - (digits != 0).sum(-1))
    return np.where(shift < 64, padded >> np.minimum(shift, 60).astype(np.uint64), 0)


def parse_lines(lines: Sequence[bytes | str]) -> ParsedLines:
    """Parse raw lines (with or without '\\n' / '\\r\\n'); see :class:`ParsedLines`."""
    lines = [s.encode() for s in lines] if lines and isinstance(lines[0], str) else lines
    ok = list(map(_VALID.fullmatch, lines))
    rows, bad = range(len(lines)), []
    if not all(ok):
        rows = [i for i, m in enumerate(ok) if m]
        bad = [BadLine(i, *diagnose_line(lines[i])) for i, m in enumerate(ok) if not m]
    good = [lines[i].rstrip(b"\r\n") for i in rows]  # the match proved no other \r or \n
    flat = b"\t".join(good).split(b"\t") if good else []
    table = np.array(flat, dtype=bytes).reshape(len(good), NUM_FIELDS)
    dense, cats = table[:, 1 : 1 + NUM_DENSE], table[:, 1 + NUM_DENSE :]
    missing, empty = dense == b"", cats == b""
    counts = np.where(missing, b"0", dense).astype(np.int64)
    labels = (table[:, 0] == b"1").astype(np.int8)
    rows = np.array(rows, dtype=np.int64)
    return ParsedLines(counts, missing, _hex_to_uint64(cats), empty, labels, rows, bad)


def iter_chunks(
    paths: Sequence[str], chunk_lines: int, log: SkipLog, desc: str = "", progress: bool = False
) -> Iterator[tuple[int, int, list[bytes], ParsedLines]]:
    """(file index, byte offset, raw lines, parsed) per chunk of ``chunk_lines`` lines of each
    file; bad lines go to ``log``. Gzipped files are decompressed as a stream (offsets are then
    into the decompressed text). ``progress``: a tqdm bar over the bytes read from disk."""
    with byte_progress(paths, desc, progress) as bar:
        for fi, path in enumerate(paths):
            with open_input(path, CriteoFormatError) as (raw, f):
                lineno, offset, read = 1, 0, 0
                while lines := list(itertools.islice(f, chunk_lines)):
                    parsed = parse_lines(lines)
                    for bad in parsed.bad:
                        log.record(path, lineno + bad.index, bad)
                    yield fi, offset, lines, parsed
                    bar.update(raw.tell() - read)
                    read = raw.tell()
                    lineno, offset = lineno + len(lines), offset + sum(map(len, lines))


def criteo_windows(
    paths: Sequence[str], window_samples: int, windows: int = 0, log: SkipLog | None = None
) -> list[StreamWindow]:
    """Criteo text read in the order it was written, as time windows of ``window_samples``
    lines (``windows`` of them, 0: every whole window the files hold) with the raw values of
    the categorical features (uint64, 0 where empty) and no ground truth (``p`` is None).
    ``log``: what a malformed line does (default: an error naming it; ``data.skip_bad_lines``:
    skipped, counted there)."""
    want = windows * window_samples if windows else None
    parts, got = [], 0
    for _, _, _, parsed in iter_chunks(list(paths), 65536, log or SkipLog(False, CriteoFormatError)):
        parts.append(parsed)
        got += len(parsed.rows)
        if want is not None and got >= want:
            break
    n = (min(got, want) if want else got) // window_samples * window_samples
    if not n:
        raise ValueError(f"{', '.join(paths)}: {got} lines, fewer than one window of {window_samples}")
    cat = lambda name: np.concatenate([getattr(p, name) for p in parts])[:n]
    dense, values, labels = normalise_dense(cat("counts"), cat("missing")), cat("values"), cat("labels")
    return [
        StreamWindow(
            dense[s : s + window_samples],
            values[s : s + window_samples],
            labels[s : s + window_samples].astype(np.float32),
            None,
        )
        for s in range(0, n, window_samples)
    ]


# ---------------------------------------------------------------- synthetic TSV for tests/demos


def scramble_id(v: np.ndarray) -> np.ndarray:
    """A fixed bijection of uint32 (odd multiplies, xor-shifts) so ids look like hashes."""
    x, mask = np.asarray(v).astype(np.uint64) & np.uint64(0xFFFFFFFF), np.uint64(0xFFFFFFFF)
    x = (x * np.uint64(0x9E3779B1) + np.uint64(0x7F4A7C15)) & mask
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x85EBCA77)) & mask
    return (x ^ (x >> np.uint64(13))).astype(np.uint32)


def write_criteo_tsv(path: str | Path, raw: RawSamples, missing_cat_rate: float = 0.0, seed: int = 0) -> np.ndarray:
    """Write one-hot samples as Criteo TSV lines ('\\n' endings); returns bool [n, 26], which
    categoricals were left empty (a ``missing_cat_rate`` fraction, drawn from ``seed``).

    Id v is written as ``f"{scramble_id(v):08x}"``; missing integers as empty fields.
    """
    n, width = raw.ids.shape
    if width != NUM_CATEGORICAL or raw.counts.shape[1] != NUM_DENSE or (raw.ids < 0).any():
        raise ValueError(f"write_criteo_tsv: needs one-hot samples, {NUM_DENSE} dense features")
    empty = np.random.default_rng(seed).random((n, width)) < missing_cat_rate
    cats = np.where(empty, "", np.char.mod("%08x", scramble_id(raw.ids).astype(np.int64)))
    ints = np.where(raw.missing, "", raw.counts.astype(str))
    with open(path, "w", newline="\n") as f:
        for label, i, c in zip(raw.labels.tolist(), ints.tolist(), cats.tolist(), strict=True):
            f.write("\t".join([str(label), *i, *c]) + "\n")
    return empty


# ---------------------------------------------------------------- training straight from TSV


class CriteoTSVSource:
    """The :class:`~dlrm_jax.data.batch.DataSource` for ``data.source=criteo`` (small files).

    Construction validates every line once and keeps an index (file, byte offset) of the valid
    ones, 12 bytes a line; the last ``data.val_fraction`` of them are held out. Ids are hashed:
    ``int(hex, 16) % table_rows[f]``. Training cycles over the train lines in order.
    """

    def __init__(self, cfg, process_index: int = 0, process_count: int = 1):
        check_data_path(cfg)  # Criteo's shape, and files
        self.paths = criteo_paths(cfg.data.path)
        for p in self.paths:
            if is_gzip(p):
                raise CriteoFormatError(
                    f"{p}: gzipped; data.source=criteo seeks into uncompressed TSV. "
                    f"Run `dlrm-jax preprocess criteo --input {p} ...` (it reads .gz) "
                    f"and train with data.source=binary"
                )
        self._batch, self._table_rows = cfg.train.batch_size, cfg.table_rows
        self._dynamic = list(cfg.dynamic_tables)  # their values travel whole (RawBatch.raw)
        self._rows = process_slice(self._batch, process_index, process_count)
        self._eval_batches = cfg.train.eval_batches
        self.skipped = SkipLog(cfg.data.skip_bad_lines, CriteoFormatError)
        files, offsets = [np.zeros(0, np.int32)], [np.zeros(0, np.int64)]
        for fi, offset, lines, parsed in iter_chunks(self.paths, 65536, self.skipped):
            starts = offset + np.cumsum([0] + [len(s) for s in lines[:-1]], dtype=np.int64)
            offsets.append(starts[parsed.rows])
            files.append(np.full(len(parsed.rows), fi, dtype=np.int32))
        self._file, self._offset = np.concatenate(files), np.concatenate(offsets)
        self.num_train, self.num_val = shards.split_sizes(len(self._offset), cfg.data.val_fraction)
        if self.num_train == 0:
            raise ValueError(f"{cfg.data.path}: no training lines ({self.num_val} valid lines)")

    def skip_report(self) -> str:
        """What ``data.skip_bad_lines`` skipped while indexing, in one line ('' if nothing)."""
        return self.skipped.summary()

    def train_ids(self, step: int) -> np.ndarray:
        return self.train_batch(step).ids

    def train_batch(self, step: int) -> Batch | RawBatch:
        return self._read(binary.train_positions(step, self._batch, self._rows) % self.num_train)

    def eval_batch_count(self) -> int:
        """Global batches of B held out (the last may be partial), ``train.eval_batches`` of them
        (0 = all)."""
        return binary.eval_count(self.num_val, self._batch, self._eval_batches)

    def eval_batch(self, i: int) -> Batch | RawBatch:
        """This process's slice of held-out batch ``i`` (any order, from any thread)."""
        return self._read(self.num_train + binary.eval_rows(self.num_val, self._batch, self._rows, i))

    def eval_batches(self) -> Iterator[Batch]:
        """Held-out lines in order: :meth:`eval_batch` of each."""
        return map(self.eval_batch, range(self.eval_batch_count()))

    def _read(self, positions: np.ndarray) -> Batch | RawBatch:
        """Valid lines ``positions`` (int64 [n]) as a Batch, read in file/offset order."""
        lines = [b""] * len(positions)
        with ExitStack() as stack:
            files = [stack.enter_context(open(p, "rb")) for p in self.paths]
            for i in np.lexsort((self._offset[positions], self._file[positions])):
                f = files[self._file[positions[i]]]
                f.seek(self._offset[positions[i]])
                lines[i] = f.readline()
        p = parse_lines(lines)
        if p.bad:
            at = positions[p.bad[0].index]
            raise CriteoFormatError(
                f"{self.paths[self._file[at]]}: the line at byte {int(self._offset[at]):,} changed since the run "
                f"indexed the file ({p.bad[0].message}); the file was edited while the run used it: put it back, "
                f"or start a new run"
            )
        fields = normalise_dense(p.counts, p.missing), hash_ids(p.values, self._table_rows), p.labels.astype(np.float32)
        return RawBatch(*fields, raw_columns(p.values[:, self._dynamic])) if self._dynamic else Batch(*fields)
