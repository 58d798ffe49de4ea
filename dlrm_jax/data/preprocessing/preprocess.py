"""What every ``dlrm-jax preprocess`` shares: the bad-line policy, vocabularies, the parsed
:class:`Chunk` and the report.

A format module (:mod:`~dlrm_jax.data.preprocessing.criteo_preprocess`, :mod:`~dlrm_jax.data.preprocessing.tabular`)
parses its input into :class:`Chunk` s of categorical *values* (uint64: Criteo's hex numbers,
hashes of text fields); :mod:`~dlrm_jax.data.preprocessing.prep_driver` counts them, assigns ids, splits,
shuffles and writes shards.
"""

from __future__ import annotations

import contextlib
import gzip
import sys
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

VOCAB_FROM = ("train", "all")  # the rows whose values are counted into ids: train rows, or all


class DataFormatError(ValueError):
    """A malformed input line; the message starts with ``path:lineno:`` (1-based)."""


class BadLine(NamedTuple):
    index: int  # position of the line in its chunk
    kind: str  # the reason counted in reports: "field count", "label", ...
    message: str


@dataclass
class SkipLog:
    """Malformed lines: raised at once (as ``error``), or (skip mode) counted by kind with a
    few examples."""

    skip: bool
    error: type[ValueError] = DataFormatError
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
            raise self.error(where)
        self.by_reason[bad.kind] += 1
        if len(self.examples) < 10:
            self.examples.append(where)


_OTHER_COMPRESSION = {  # magic bytes -> (the format, the command that decompresses it)
    b"BZh": ("bzip2", "bunzip2 -k"),
    b"\xfd7zXZ\x00": ("xz", "unxz -k"),
    b"\x28\xb5\x2f\xfd": ("zstd", "unzstd"),
    b"PK\x03\x04": ("zip", "unzip"),
}


def is_gzip(path: str | Path) -> bool:
    """Whether a file starts with the gzip magic bytes (Criteo Terabyte days, Avazu ship gzipped).
    A file compressed otherwise is refused (DataFormatError): read as text, its first line was
    'expected 40 tab-separated fields, found 1', and skipping bad lines left 'no training rows'."""
    with open(path, "rb") as f:
        head = f.read(6)
    for magic, (kind, tool) in _OTHER_COMPRESSION.items():
        if head.startswith(magic):
            raise DataFormatError(
                f"{path}: compressed with {kind}; only plain text and gzip are read: decompress it first "
                f"({tool} {path}) or gzip it"
            )
    return head[:2] == b"\x1f\x8b"


@contextlib.contextmanager
def open_input(path: str | Path, error: type[Exception] = DataFormatError) -> Iterator[tuple]:
    """``(raw, f)``: the input file on disk and its bytes, decompressed as a stream when it is
    gzipped (``raw.tell()`` counts the bytes read from disk). A truncated or damaged gzip
    stream, found while reading inside the ``with``, is one ``error`` naming the file."""
    with open(path, "rb") as raw:
        if not is_gzip(path):
            yield raw, raw
            return
        try:
            with gzip.open(raw) as f:
                yield raw, f
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise error(f"{path}: truncated or damaged gzip file ({e})") from None


def byte_progress(paths: Sequence[str], desc: str, progress: bool) -> tqdm:
    """A tqdm bar over the bytes of ``paths`` on disk (compressed size for gzipped files), on a
    terminal only: redirected into a log, its redraws would be one endless line of frames."""
    total = sum(Path(p).stat().st_size for p in paths)
    shown = progress and sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr, disable=not shown)


def hash_ids(values: np.ndarray, rows: Sequence[int] | int) -> np.ndarray:
    """uint64 [n, F] values -> int32 [n, F] ids ``value % rows[f]`` (empty is 0 -> 0)."""
    return (values % np.asarray(rows, dtype=np.uint64)).astype(np.int32)


MISSING_ID, OOV_ID = 0, 1  # vocabulary mode: a missing value; a value out of the vocabulary


class Vocabulary:
    """One feature's values counted >= min_count get ids 2.. by decreasing count (ties: smaller
    value first); a missing value is id 0 (``MISSING_ID``), and every other value, rare or
    never counted (seen only in validation rows), id 1 (``OOV_ID``): a value the training never
    saw is not taken for a missing one."""

    def __init__(self, values: np.ndarray, counts: np.ndarray, min_count: int):
        self.values = values  # uint64 [V] ascending, so searchsorted finds a value's slot
        kept = np.flatnonzero(counts >= min_count)
        order = kept[np.lexsort((values[kept], -counts[kept]))]
        self.id_of = np.full(len(values) + 1, OOV_ID, np.int32)  # + 1: a slot for "not found"
        self.id_of[order] = np.arange(2, len(order) + 2, dtype=np.int32)
        self.kept = np.stack([values[order], counts[order].astype(np.uint64)], axis=1)  # [K, 2]
        self.oov_count = int(counts.sum() - self.kept[:, 1].sum())  # counted rows of rare values
        self.size = 2 + len(order)  # rows of the table, ids 0 and 1 included

    def lookup(self, values: np.ndarray, empty: np.ndarray) -> np.ndarray:
        """uint64 [n] values, bool [n] empty -> int32 [n] ids."""
        slot = np.searchsorted(self.values, values)
        found = (slot < len(self.values)) & ~empty
        found[found] = self.values[slot[found]] == values[found]
        return np.where(empty, MISSING_ID, self.id_of[np.where(found, slot, len(self.values))]).astype(np.int32)


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
    seconds: dict[str, float] = field(default_factory=dict)  # per phase, and "total"
    split: str = ""  # how the val split was chosen, one line
    vocab_from: str = ""  # the rows whose values were counted into ids: train | all
    notes: tuple[str, ...] = ()  # what else a user should see (a join that found nothing)

    def summary(self) -> str:
        text = (
            f"{self.output}: {self.train_rows} train + {self.val_rows} val rows from "
            f"{self.lines_read} lines, {self.skipped} skipped"
        )
        if self.skipped:
            reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped_by_reason.items()))
            text += f" ({reasons})\n  " + "\n  ".join(self.skipped_examples)
        if self.split:
            text += f"\n  {self.split}"
        if self.vocab_from:
            text += "\n  ids counted on " + (
                "train rows (values seen only in val rows: out of the vocabulary)"
                if self.vocab_from == "train"
                else "all rows, train and val"
            )
        text += f"\n  cardinalities: {list(self.cardinalities)}"
        text += "".join(f"\n  {note}" for note in self.notes)
        if self.seconds:
            text += "\n  seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in self.seconds.items())
        return text


def check_arguments(
    caller: str, inputs, max_ind_range, min_count, val_fraction, chunk_lines, vocab_from: str = "train"
) -> None:
    needs = {
        "input files": len(inputs) > 0,
        "max_ind_range >= 0": max_ind_range >= 0,
        "min_count >= 1": min_count >= 1,
        "0 <= val_fraction < 1": 0 <= val_fraction < 1,
        "chunk_lines >= 1": chunk_lines >= 1,
        "vocab_from 'train' or 'all'": vocab_from in VOCAB_FROM,
    }
    for need, ok in needs.items():
        if not ok:
            raise ValueError(f"{caller}: needs {need}")


def check_input_files(inputs: Sequence[str], val_inputs: Sequence[str] = ()) -> None:
    """Every input is a file, named by its flag as given when it is not (before any work: a
    missing one found later was reported as whatever the error handling touched next)."""
    for flag, paths in (("--input", inputs), ("--val-input", val_inputs)):
        for p in map(Path, paths):
            if not p.is_file():
                where = "" if p.is_absolute() else f" (looked for {p.absolute()})"
                what = (
                    "a folder, not a file"
                    if p.is_dir()
                    else "not a regular file (a pipe or device): save it to a file, gzipped or not"
                    if p.exists()
                    else "no such file"
                )
                raise FileNotFoundError(f"{flag} {p}: {what}{where}")


class Task(NamedTuple):
    """A unit of parsing work: the lines of ``path`` that start in ``[start, end)``, or the
    whole file when ``end`` is -1 (gzipped files, files whose records may span lines)."""

    path: str
    start: int
    end: int


class Chunk(NamedTuple):
    """The valid rows of one chunk of input, before ids are assigned (F categorical features).

    lines:  int                       input lines the chunk covered, valid or not
    values: uint64  [n, F]            categorical values, 0 where empty
    empty:  bool    [n, F]            missing values (id 0)
    labels: float32 [n]               0 or 1
    dense:  float32 [n, num_dense]    normalised; None in the scan pass (not needed there)
    order:  float64 [n]               the rows' times when the format splits by time, else None
    """

    lines: int
    values: np.ndarray
    empty: np.ndarray
    labels: np.ndarray
    dense: np.ndarray | None
    order: np.ndarray | None = None
