"""``dlrm-jax preprocess criteo``: Criteo TSV days -> the sharded binary layout, on every core.

The input is cut into tasks (:func:`criteo_tasks`): byte ranges of about ``block_bytes`` of a
plain file (a task owns the lines that start inside its range), or a whole gzipped file, read
as a stream. Worker processes of :mod:`dlrm_jax.data.preprocessing.prep_driver` parse the tasks' blocks of
text with pyarrow's CSV reader (C++), hex fields to integers with a few uint64 operations per
column. A block the fast reader cannot prove valid (a parse error, a character no valid line
has, a label that is not 0/1, an integer of over 18 digits) is parsed again line by line with
:func:`~dlrm_jax.data.sources.criteo.parse_lines`, which says what is wrong with each bad line: the
rows kept and the errors are those of the strict parser, whatever the number of workers.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from dlrm_jax.data.preprocessing.prep_driver import Options, default_workers, write_dataset
from dlrm_jax.data.preprocessing.preprocess import (
    Chunk,
    PreprocessReport,
    SkipLog,
    Task,
    check_arguments,
    is_gzip,
    open_input,
)
from dlrm_jax.data.sources.criteo import NUM_CATEGORICAL, NUM_DENSE, CriteoFormatError, parse_lines
from dlrm_jax.data.sources.synthetic import normalise_dense
from dlrm_jax.files import as_paths

_NAMES = ["label", *(f"I{k}" for k in range(1, 14)), *(f"C{k}" for k in range(1, 27))]
_TYPES = {
    "label": pa.binary(),
    **{f"I{k}": pa.int64() for k in range(1, 14)},
    **{f"C{k}": pa.binary() for k in range(1, 27)},
}
_READ = pacsv.ReadOptions(column_names=_NAMES, block_size=2 << 20, use_threads=False)
_PARSE = pacsv.ParseOptions(delimiter="\t", quote_char=False, ignore_empty_lines=False)
_CONVERT = pacsv.ConvertOptions(column_types=_TYPES, strings_can_be_null=False)
_VALID_BYTES = b"0123456789abcdefABCDEF\t\r\n-"  # every byte of a valid line is one of these
_INT_LIMIT = 10**18  # 18 digits at most, as the strict parser allows
_OVER_18_DIGITS = re.compile(rb"[0-9]{19}")  # no valid field has so many (hex ones: 16 at most)


def criteo_tasks(paths: list[str], block_bytes: int) -> list[Task]:
    """Byte ranges of about ``block_bytes`` for plain files, one task per gzipped file."""
    tasks = []
    for path in paths:
        if is_gzip(path):
            tasks.append(Task(path, 0, -1))
            continue
        with open(path, "rb") as f:
            size = f.seek(0, 2)
        tasks += [Task(path, s, min(s + block_bytes, size)) for s in range(0, max(size, 1), block_bytes)]
    return tasks


def _owned_text(task: Task) -> bytes:
    """The lines that start in the task's byte range, whole."""
    with open(task.path, "rb") as f:
        if task.start:
            f.seek(task.start - 1)
            f.readline()  # the line that started before the range belongs to the previous task
        begin = f.tell()
        text = f.read(max(task.end - begin, 0))
        if text and not text.endswith(b"\n") and f.tell() >= task.end:
            text += f.readline()  # finish the last line that starts inside the range
    return text


def _blocks(task: Task, block_bytes: int) -> Iterator[bytes]:
    """The task's text in blocks of whole lines."""
    if task.end >= 0:
        yield _owned_text(task)
        return
    with open_input(task.path, CriteoFormatError) as (_, f):  # a damaged stream: one line naming the file
        rest = b""
        while data := f.read(block_bytes):
            data = rest + data
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                rest = data
                continue
            rest = data[cut:]
            yield data[:cut]
        if rest:
            yield rest


class CriteoParser:
    """Picklable: turns a :class:`Task` into :class:`~dlrm_jax.data.preprocessing.preprocess.Chunk` s."""

    num_dense, num_features, error = NUM_DENSE, NUM_CATEGORICAL, CriteoFormatError

    def __init__(self, block_bytes: int = 64 << 20):
        self.block_bytes = block_bytes

    def tasks(self, paths: list[str]) -> list[Task]:
        return criteo_tasks(paths, self.block_bytes)

    def parse(self, task: Task, log: SkipLog) -> Iterator[Chunk]:
        """Chunks of the task's valid lines; bad ones go to ``log`` with line numbers counted
        from the task's first line (1-based)."""
        lineno = 1
        for text in _blocks(task, self.block_bytes):
            chunk = parse_block(text)
            if chunk is None:  # the strict path, which names what is wrong
                raw = _lines(text)
                p = parse_lines(raw)
                for bad in p.bad:
                    log.record(task.path, lineno + bad.index, bad)
                chunk = Chunk(
                    len(raw), p.values, p.empty, p.labels.astype(np.float32), normalise_dense(p.counts, p.missing)
                )
            lineno += chunk.lines
            yield chunk


def _lines(text: bytes) -> list[bytes]:
    """``text``'s lines, each with its ``\n``, split at ``\n`` alone, as the text sources read
    them (``bytes.splitlines`` split at a lone ``\r`` too: two lines a stray one joined were
    kept as rows, and the lines after it were named one too far on)."""
    parts = text.split(b"\n")
    lines = [p + b"\n" for p in parts[:-1]]
    return [*lines, parts[-1]] if parts[-1] else lines


def parse_block(text: bytes) -> Chunk | None:
    """A block of whole Criteo lines parsed by pyarrow, or None unless every line is valid."""
    if not text or text.translate(None, _VALID_BYTES):
        return None
    if _OVER_18_DIGITS.search(text):  # (pyarrow reads 0000000000000000000005 as 5: the strict rule refuses it)
        return None
    try:
        table = pacsv.read_csv(pa.py_buffer(text), _READ, _PARSE, _CONVERT).combine_chunks()
    except (pa.ArrowInvalid, ValueError):
        return None
    n = table.num_rows
    if n != text.count(b"\n") + (not text.endswith(b"\n")):
        return None
    cols = [c.chunk(0) if c.num_chunks else pa.array([], c.type) for c in table.columns]
    labels, dense = _labels(cols[0]), _dense(cols[1 : 1 + NUM_DENSE])
    # feature-major: every step after this reads one feature's column at a time
    values, empty = np.zeros((NUM_CATEGORICAL, n), np.uint64), np.zeros((NUM_CATEGORICAL, n), bool)
    if labels is None or dense is None:
        return None
    for f, col in enumerate(cols[1 + NUM_DENSE :]):
        if not _hex(col, values[f], empty[f]):
            return None
    return Chunk(n, values.T, empty.T, labels, dense)


def _binary_parts(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """int64 [n+1] offsets and uint8 [...] data of a binary array."""
    offsets = np.frombuffer(col.buffers()[1], np.int32, len(col) + 1, col.offset * 4).astype(np.int64)
    return offsets, np.frombuffer(col.buffers()[2], np.uint8)


def _labels(col: pa.Array) -> np.ndarray | None:
    offsets, data = _binary_parts(col)
    text = data[offsets[0] : offsets[-1]]
    if len(text) != len(col) or ((text != ord("0")) & (text != ord("1"))).any():
        return None
    return (text == ord("1")).astype(np.float32)


# log1p of the small counts, as normalise_dense computes it (float64, then float32)
_LOG1P = np.log1p(np.arange(1 << 16, dtype=np.float64)).astype(np.float32)


def _dense(cols: list[pa.Array]) -> np.ndarray | None:
    """float32 [n, 13] ``normalise_dense`` of the integer columns (None: over 18 digits)."""
    n = len(cols[0])
    counts = np.empty((n, len(cols)), np.int64)
    for k, col in enumerate(cols):
        counts[:, k] = np.frombuffer(col.buffers()[1], np.int64, n, col.offset * 8)
        if col.null_count:  # missing: 0, like a negative count
            valid = np.unpackbits(np.frombuffer(col.buffers()[0], np.uint8), count=col.offset + n, bitorder="little")[
                col.offset :
            ]
            counts[valid == 0, k] = 0
    if (counts.max(initial=0) >= _INT_LIMIT) or (counts.min(initial=0) <= -_INT_LIMIT):
        return None
    np.maximum(counts, 0, out=counts)
    small = counts < len(_LOG1P)
    if small.all():
        return _LOG1P[counts]
    dense = np.log1p(counts.astype(np.float64)).astype(np.float32)
    return np.where(small, _LOG1P[np.where(small, counts, 0)], dense)


_LOW4 = np.uint64(0x0F0F0F0F0F0F0F0F)
_LETTER = np.uint64(0x0101010101010101)


def _nibbles_to_int(words: np.ndarray) -> np.ndarray:
    """uint64 words of 8 ASCII hex digits (big-endian) -> their uint64 values (< 2**32)."""
    x = (words & _LOW4) + np.uint64(9) * ((words >> np.uint64(6)) & _LETTER)  # digit per byte
    x = (x | (x >> np.uint64(4))) & np.uint64(0x00FF00FF00FF00FF)
    x = (x | (x >> np.uint64(8))) & np.uint64(0x0000FFFF0000FFFF)
    return (x | (x >> np.uint64(16))) & np.uint64(0xFFFFFFFF)


def _hex(col: pa.Array, values: np.ndarray, empty: np.ndarray) -> bool:
    """Fill uint64 [n] ``values`` and bool [n] ``empty`` from a column of hex strings; False
    if a value is not hex."""
    offsets, data = _binary_parts(col)
    lengths = np.diff(offsets)
    text = data[offsets[0] : offsets[-1]]
    if lengths.max(initial=0) > 16 or (text == ord("-")).any():
        return False
    np.equal(lengths, 0, out=empty)
    if ((lengths == 8) | empty).all():  # Criteo's: 8 digits, contiguous after the empty ones
        values[~empty] = _nibbles_to_int(text.view(">u8").astype(np.uint64))
        return True
    padded = np.full((len(col), 16), ord("0"), np.uint8)  # right-aligned in 16 digits
    pos = np.arange(16)[None, :] - (16 - lengths)[:, None]  # index into each string
    inside = pos >= 0
    padded[inside] = data[(offsets[:-1, None] + pos)[inside]]
    words = padded.view(">u8").astype(np.uint64)  # [n, 2]: high and low 8 digits
    values[:] = (_nibbles_to_int(words[:, 0]) << np.uint64(32)) | _nibbles_to_int(words[:, 1])
    return True


def preprocess_criteo(
    inputs: list[str],
    output: str,
    *,
    val_inputs: list[str] = (),
    max_ind_range: int = 0,
    min_count: int = 1,
    vocab_from: str = "train",
    val_fraction: float = 0.1,
    shuffle_seed: int | None = 0,
    shard_mb: float = 1024.0,
    multi_hot: tuple[int, ...] | None = None,
    workers: int = 0,
    block_mb: float = 64.0,
    skip_bad_lines: bool = False,
    raw_values: bool = False,
    window_seconds: float = 0.0,
    progress: bool = True,
    overwrite: bool = False,
) -> PreprocessReport:
    """Criteo TSV days (plain or .gz) -> the sharded layout of :mod:`dlrm_jax.data.shards`.

    Ids: with ``max_ind_range`` N > 0, ``int(hex, 16) % N`` numbered by hashed value, so
    feature f gets ``min(N, distinct hashed values)`` rows (MLPerf's contiguous ids); else a
    frequency-ordered vocabulary (id 0: missing values; id 1: values seen fewer than
    ``min_count`` times, out of the vocabulary). Values are counted on the train rows
    (``vocab_from="train"``: a value seen only in val rows is out of the vocabulary, id 1 or,
    when hashing, a last row of its own; never a missing one) or on all rows (``"all"``, as
    MLPerf's reference numbers day_23's values too). Val split: the files ``val_inputs``
    (MLPerf: ``day_23``) or else the last ``val_fraction`` of valid lines. Train rows are shuffled globally with ``shuffle_seed``
    (None keeps input order). ``multi_hot``: bag sizes for MLPerf DLRM-DCNv2's multi-hot rule
    (:mod:`dlrm_jax.data.preprocessing.multihot`). ``workers`` processes (0: one per core) parse blocks of
    ``block_mb`` MB; the output is the same for any number of workers. ``raw_values``: each
    shard keeps every feature's value too (``int(hex, 16)``, 0 where missing; raw.npy), which
    dynamic tables (``embedding.ids=dynamic``) map instead of the ids. With ``shuffle_seed=None``
    meta.json records each input file (a day) as a window of the train rows, for progressive
    validation (``train.progressive_window: data``). An ``output`` that
    holds a dataset already is replaced only with ``overwrite``.
    """
    inputs, val_inputs = as_paths(inputs), as_paths(val_inputs)
    check_arguments("preprocess_criteo", inputs, max_ind_range, min_count, val_fraction, 1, vocab_from)
    if multi_hot and len(multi_hot) != NUM_CATEGORICAL:
        raise ValueError(f"preprocess_criteo: multi_hot needs {NUM_CATEGORICAL} bag sizes, got {len(multi_hot)}")
    opts = Options(
        max_ind_range=max_ind_range,
        min_count=min_count,
        vocab_from=vocab_from,
        val_fraction=val_fraction,
        shuffle_seed=shuffle_seed,
        shard_mb=shard_mb,
        workers=workers or default_workers(),
        multi_hot=tuple(multi_hot) if multi_hot else None,
        skip_bad_lines=skip_bad_lines,
        raw_values=raw_values,
        window_seconds=window_seconds,
        progress=progress,
    )
    return write_dataset(CriteoParser(int(block_mb * 2**20)), inputs, output, opts, val_inputs, overwrite=overwrite)
