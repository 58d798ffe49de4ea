"""Criteo Kaggle/Terabyte TSV: strict parsing, ``preprocess_criteo`` into the binary layout of
:mod:`dlrm_jax.data.binary`, and :class:`CriteoTSVSource`, which trains straight from small TSVs.

A line is ``label \\t I1..I13 \\t C1..C26``: label 0/1, integer features (empty = missing, may be
negative), categorical features as hex strings (empty = missing). Lines are checked with one
compiled regular expression and converted a chunk at a time with numpy; only lines that fail
the check take the slow path that says what is wrong with them.
"""

from __future__ import annotations

import gzip
import itertools
import re
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from dlrm_jax.data import binary
from dlrm_jax.data.batch import Batch, process_slice
from dlrm_jax.data.synthetic import RawSamples, normalise_dense

NUM_DENSE, NUM_CATEGORICAL = 13, 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_CATEGORICAL
_INT = rb"(?:-?[0-9]{1,18})?"  # empty or an integer of at most 18 digits: always fits int64
_HEX = rb"[0-9a-fA-F]{0,16}"  # held as uint64 (Criteo's values have 8 digits)
_VALID = re.compile(rb"[01](?:\t%s){13}(?:\t%s){26}\r?\n?" % (_INT, _HEX))
_NIBBLE = np.zeros(256, dtype=np.uint8)  # ASCII code -> hex digit value
for _d in "0123456789abcdef":
    _NIBBLE[ord(_d)] = _NIBBLE[ord(_d.upper())] = int(_d, 16)


class CriteoFormatError(ValueError):
    """A malformed line; the message starts with ``path:lineno:`` (1-based)."""


class BadLine(NamedTuple):
    index: int  # position in the list given to parse_lines
    kind: str  # the reason counted in reports: "field count", "label", ...
    message: str


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


def hash_ids(values: np.ndarray, rows: Sequence[int] | int) -> np.ndarray:
    """uint64 [n, F] hex values -> int32 [n, F] ids ``value % rows[f]`` (empty is 0 -> 0)."""
    return (values % np.asarray(rows, dtype=np.uint64)).astype(np.int32)


@dataclass
class SkipLog:
    """Malformed lines: raised at once, or (skip mode) counted by kind with a few examples."""

    skip: bool
    by_reason: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line: how many lines were skipped and why (empty when none were)."""
        total = self.by_reason.total()
        if not total:
            return ""
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.by_reason.items()))
        return f"skipped {total} malformed line(s) ({reasons}); first: {self.examples[0]}"

    def record(self, path: str, lineno: int, bad: BadLine) -> None:
        where = f"{path}:{lineno}: {bad.message}"
        if not self.skip:
            raise CriteoFormatError(where)
        self.by_reason[bad.kind] += 1
        if len(self.examples) < 10:
            self.examples.append(where)


def is_gzip(path: str | Path) -> bool:
    """Whether a file starts with the gzip magic bytes (the Criteo Terabyte days ship gzipped)."""
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def iter_chunks(
    paths: Sequence[str], chunk_lines: int, log: SkipLog, desc: str = "", progress: bool = False
) -> Iterator[tuple[int, int, list[bytes], ParsedLines]]:
    """(file index, byte offset, raw lines, parsed) per chunk of ``chunk_lines`` lines of each
    file; bad lines go to ``log``. Gzipped files are decompressed as a stream (offsets are then
    into the decompressed text). ``progress``: a tqdm bar over the bytes read from disk."""
    total = sum(Path(p).stat().st_size for p in paths)
    bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr,
               disable=not progress)  # fmt: skip
    with bar:
        for fi, path in enumerate(paths):
            with open(path, "rb") as raw, (gzip.open(raw) if is_gzip(path) else raw) as f:
                lineno, offset, read = 1, 0, 0
                while lines := list(itertools.islice(f, chunk_lines)):
                    parsed = parse_lines(lines)
                    for bad in parsed.bad:
                        log.record(path, lineno + bad.index, bad)
                    yield fi, offset, lines, parsed
                    bar.update(raw.tell() - read)
                    read = raw.tell()
                    lineno, offset = lineno + len(lines), offset + sum(map(len, lines))


# ---------------------------------------------------------------- synthetic TSV for tests/demos


def scramble_id(v: np.ndarray) -> np.ndarray:
    """A fixed bijection of uint32 (odd multiplies, xor-shifts) so ids look like hashes."""
    x, mask = np.asarray(v).astype(np.uint64) & np.uint64(0xFFFFFFFF), np.uint64(0xFFFFFFFF)
    x = (x * np.uint64(0x9E3779B1) + np.uint64(0x7F4A7C15)) & mask
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x85EBCA77)) & mask
    return (x ^ (x >> np.uint64(13))).astype(np.uint32)


def write_criteo_tsv(path: str | Path, raw: RawSamples, missing_cat_rate: float = 0.0,
                     seed: int = 0) -> np.ndarray:  # fmt: skip
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
        if (cfg.data.num_dense, cfg.num_features, max(cfg.bag_sizes)) != (13, 26, 1):
            raise ValueError("data.source=criteo needs data.num_dense=13, 26 features, one-hot")
        self.paths = [p.strip() for p in cfg.data.path.split(",") if p.strip()]
        for p in self.paths:
            if is_gzip(p):
                raise CriteoFormatError(f"{p}: gzipped; data.source=criteo seeks into uncompressed TSV. "
                                        f"Run `dlrm-jax preprocess criteo --input {p} ...` (it reads .gz) "
                                        f"and train with data.source=binary")
        self._batch, self._table_rows = cfg.train.batch_size, cfg.table_rows
        self._rows = process_slice(self._batch, process_index, process_count)
        self._eval_batches = cfg.train.eval_batches
        self.skipped = SkipLog(skip=cfg.data.skip_bad_lines)
        files, offsets = [np.zeros(0, np.int32)], [np.zeros(0, np.int64)]
        for fi, offset, lines, parsed in iter_chunks(self.paths, 65536, self.skipped):
            starts = offset + np.cumsum([0] + [len(s) for s in lines[:-1]], dtype=np.int64)
            offsets.append(starts[parsed.rows])
            files.append(np.full(len(parsed.rows), fi, dtype=np.int32))
        self._file, self._offset = np.concatenate(files), np.concatenate(offsets)
        self.num_train, self.num_val = binary.split_sizes(len(self._offset), cfg.data.val_fraction)
        if self.num_train == 0:
            raise ValueError(f"{cfg.data.path}: no training lines ({self.num_val} valid lines)")

    def skip_report(self) -> str:
        """What ``data.skip_bad_lines`` skipped while indexing, in one line ('' if nothing)."""
        return self.skipped.summary()

    def train_batch(self, step: int) -> Batch:
        return self._read(binary.train_positions(step, self._batch, self._rows) % self.num_train)

    def eval_batches(self) -> Iterator[Batch]:
        """Held-out lines in order: global batches of B (the last may be partial), this
        process's slice of each, ``train.eval_batches`` of them (0 = all)."""
        ranges = binary.eval_positions(self.num_val, self._batch, self._rows, self._eval_batches)
        return (self._read(self.num_train + rows) for rows in ranges)

    def _read(self, positions: np.ndarray) -> Batch:
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
            raise CriteoFormatError(f"{self.paths}: changed since indexed ({p.bad[0].message})")
        dense = normalise_dense(p.counts, p.missing)
        return Batch(dense, hash_ids(p.values, self._table_rows), p.labels.astype(np.float32))


# ---------------------------------------------------------------- preprocessing to binary


class _Vocabulary:
    """One feature's values counted >= min_count get ids 1.. by decreasing count (ties: smaller
    value first); everything else (rare or missing) is id 0."""

    def __init__(self, values: np.ndarray, counts: np.ndarray, min_count: int):
        self.values = values  # uint64 [V] ascending, so searchsorted finds a value's slot
        kept = np.flatnonzero(counts >= min_count)
        order = kept[np.lexsort((values[kept], -counts[kept]))]
        self.id_of = np.zeros(len(values) + 1, np.int32)  # + 1: a slot for "not found"
        self.id_of[order] = np.arange(1, len(order) + 1, dtype=np.int32)
        self.kept = np.stack([values[order], counts[order].astype(np.uint64)], axis=1)  # [K, 2]
        self.size = 1 + len(order)  # rows of the table, id 0 included

    def lookup(self, values: np.ndarray, empty: np.ndarray) -> np.ndarray:
        """uint64 [n] values, bool [n] empty -> int32 [n] ids."""
        slot = np.searchsorted(self.values, values)
        found = (slot < len(self.values)) & ~empty
        found[found] = self.values[slot[found]] == values[found]
        return self.id_of[np.where(found, slot, len(self.values))]


@dataclass(frozen=True)
class PreprocessReport:
    lines_read: int
    train_rows: int
    val_rows: int
    skipped: int
    skipped_by_reason: dict[str, int]
    skipped_examples: tuple[str, ...]  # the first few "file:line: reason"
    cardinalities: tuple[int, ...]
    output: str

    def summary(self) -> str:
        text = (f"{self.output}: {self.train_rows} train + {self.val_rows} val rows from "
                f"{self.lines_read} lines, {self.skipped} skipped")  # fmt: skip
        if self.skipped:
            reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped_by_reason.items()))
            text += f" ({reasons})\n  " + "\n  ".join(self.skipped_examples)
        return text + f"\n  cardinalities: {list(self.cardinalities)}"


def preprocess_criteo(
    inputs: list[str],
    output: str,
    *,
    max_ind_range: int = 0,
    min_count: int = 1,
    val_fraction: float = 0.1,
    skip_bad_lines: bool = False,
    chunk_lines: int = 200_000,
    progress: bool = True,
) -> PreprocessReport:
    """Criteo TSV files -> the binary layout of :mod:`dlrm_jax.data.binary` at ``output``.

    Ids are ``int(hex, 16) % max_ind_range`` when ``max_ind_range > 0``, else vocabulary ids
    (see :class:`_Vocabulary`). The last ``val_fraction`` of valid lines form the val split.
    Two streaming passes: count lines (and values, for vocabularies), then convert and write
    through a :class:`~dlrm_jax.data.binary.DatasetWriter`, which only ever leaves a complete
    dataset at ``output``.
    """
    _check_arguments(inputs, max_ind_range, min_count, val_fraction, chunk_lines)
    binary.check_output_target(output)  # fail before a long scan, not after it
    paths, log = [str(p) for p in inputs], SkipLog(skip_bad_lines)
    counter = None if max_ind_range else binary.ValueCounter(NUM_CATEGORICAL, np.uint64)
    lines_read, valid = 0, 0
    for _, _, lines, parsed in iter_chunks(paths, chunk_lines, log, "scan", progress):
        lines_read, valid = lines_read + len(lines), valid + len(parsed.rows)
        if counter is not None:
            counter.add(parsed.values, parsed.empty)
    n_train, n_val = binary.split_sizes(valid, val_fraction)
    if n_train == 0:
        raise ValueError(f"{', '.join(paths)}: no training rows ({valid} valid lines)")
    skipped = log.by_reason.total()
    with binary.DatasetWriter(output, n_train, n_val, NUM_DENSE, NUM_CATEGORICAL) as writer:
        vocabs = None if counter is None else _save_vocabularies(writer.root, counter, min_count)
        # Bad lines were reported by the scan; the writer's row count catches a changed input.
        for _, _, _, p in iter_chunks(paths, chunk_lines, SkipLog(True), "write", progress):
            ids = hash_ids(p.values, max_ind_range) if vocabs is None else _lookup(vocabs, p)
            writer.append(normalise_dense(p.counts, p.missing), ids, p.labels.astype(np.float32))
        cards = [max_ind_range] * NUM_CATEGORICAL if vocabs is None else [v.size for v in vocabs]
        writer.commit({
            "num_dense": NUM_DENSE, "cardinalities": cards, "train_rows": n_train,
            "val_rows": n_val, "max_ind_range": max_ind_range, "min_count": min_count,
            "val_fraction": val_fraction, "inputs": [str(Path(p).resolve()) for p in paths],
            "lines_read": lines_read, "skipped": skipped, "skipped_by_reason": dict(log.by_reason),
        })  # fmt: skip
    return PreprocessReport(lines_read, n_train, n_val, skipped, dict(log.by_reason),
                            tuple(log.examples), tuple(cards), str(output))  # fmt: skip


def _check_arguments(inputs, max_ind_range, min_count, val_fraction, chunk_lines) -> None:
    needs = {"input files": len(inputs) > 0, "max_ind_range >= 0": max_ind_range >= 0,
             "min_count >= 1": min_count >= 1, "0 <= val_fraction < 1": 0 <= val_fraction < 1,
             "chunk_lines >= 1": chunk_lines >= 1}  # fmt: skip
    for need, ok in needs.items():
        if not ok:
            raise ValueError(f"preprocess_criteo: needs {need}")


def _save_vocabularies(root: Path, counter: binary.ValueCounter, min_count: int) -> list[_Vocabulary]:
    """root/vocab/feature_{f}.npy: uint64 [K_f, 2], row i = (hex value, count) of id i + 1."""
    (folder := root / "vocab").mkdir()
    vocabs = [_Vocabulary(*counter.table(f), min_count) for f in range(NUM_CATEGORICAL)]
    for f, v in enumerate(vocabs):
        np.save(folder / f"feature_{f}.npy", v.kept)
    return vocabs


def _lookup(vocabs: list[_Vocabulary], p: ParsedLines) -> np.ndarray:
    """int32 [n, 26] vocabulary ids of a parsed chunk."""
    return np.stack([v.lookup(p.values[:, f], p.empty[:, f]) for f, v in enumerate(vocabs)], 1)
