"""The disk tier's file format: uncompressed zarr3 arrays whose chunk files are raw rows.

Each field of a tiered table is a zarr3 array [rows, *shape] in chunks of [chunk_rows, *shape]
with only the ``bytes`` codec, so a chunk file is the C-order bytes of its rows (edge chunks
full size) and can be memory-mapped. tensorstore creates, validates, bulk-loads and exports
them; exported tables are ordinary zstd-compressed zarr3 arrays. :mod:`~dlrm_jax.embedding.tiers.store` builds the
crash-safe store on top.

Row checksums: each table has one more array of the same geometry, ``<table>/row-checksums``,
uint64 [rows, fields]: column j holds :func:`row_checksums` of row r of the j-th field in name
order, i.e. ``sum_i w_i * k_i + (r + 1) * K`` mod 2**64 over the row's little-endian 32-bit
words w_i (the row's bytes zero-padded to whole words), with ``k_i`` the odd splitmix64 value
of i + 1 and K = 0x9E3779B97F4A7C15. Any change of one word changes it (k_i is odd), a row
moved to another row's place does too (the row term), and an all-zero chunk with all-zero
checksums does not pass. It is a vectorised numpy sum, ~1.4 GB/s on one core: against
random damage, not an adversary. Written with every row, checked on every read
(:mod:`.integrity`). Stores made before checksums have no such array: their rows are read
unchecked (:meth:`~dlrm_jax.embedding.tiers.store.TierStore.unverified_tables`).
"""

from __future__ import annotations

import errno
import functools
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import tensorstore as ts

FieldSpec = tuple[tuple[int, ...], str]  # (per-row shape, numpy dtype name), e.g. ((16,), "float32")
TierTables = dict[str, tuple[int, dict[str, FieldSpec]]]  # table -> (rows, {field: FieldSpec})
RowInit = Callable[[str, int, int], dict[str, np.ndarray]]  # (table, start, stop) -> rows [stop-start]

CHUNK_BYTES = 4 * 2**20
COPY_BUFFER_BYTES = 2**20
# Chunk keys "c.<i>.0": one directory per array, so a snapshot creates and fsyncs a directory
# per array, not one per chunk as the default "/" separator would.
CHUNK_KEY_ENCODING = {"name": "default", "configuration": {"separator": "."}}
CHECKSUMS = "row-checksums"  # the checksum array beside a table's fields (never a field name: a hyphen)
_ROW_TERM = np.uint64(0x9E3779B97F4A7C15)
_BLOCK_WORDS = 1 << 17  # words summed per block: a 1 MiB uint64 temporary, in cache


class TierError(OSError):
    """A tier file is missing, truncated, foreign, or could not be written; says which file."""

    def __init__(self, path: Path, what: str, code: int | None = None):
        super().__init__(f"{path}: {what}")
        self.errno, self.path, self.what = code, Path(path), what


def os_error(path: Path, e: OSError, doing: str = "") -> TierError:
    what = "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
    return TierError(path, what + doing, e.errno)


# Exported tables are ordinary compressed zarr3 arrays (the tier's own are raw: rows are byte ranges).
EXPORT_CODECS = [
    {"name": "bytes", "configuration": {"endian": "little"}},
    {"name": "zstd", "configuration": {"level": 3}},
]


def export_array(path: Path, values: np.ndarray, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Write ``values`` [rows, ...] as a compressed zarr3 array at ``path``, as
    :meth:`TierStore.export` writes tiered tables (for tables that live on the devices)."""
    row_bytes = max(1, values[:1].nbytes)
    dtype = "bfloat16" if values.dtype == numpy_dtype("bfloat16") else values.dtype.name
    array = ArrayLayout(
        values.shape[0],
        min(values.shape[0], default_chunk_rows(row_bytes, chunk_bytes)),
        tuple(values.shape[1:]),
        dtype,
    )
    open_array(Path(path).absolute(), array, create=True, codecs=EXPORT_CODECS)[...].write(values).result()


def default_chunk_rows(row_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """The largest power of two of rows of ``row_bytes`` that fits in ``chunk_bytes`` (at least 1)."""
    return 1 << max(0, (chunk_bytes // max(1, row_bytes)).bit_length() - 1)


def numpy_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


@dataclass(frozen=True)
class ArrayLayout:
    """The geometry of one field's zarr3 array: [rows, *shape] in chunks of [chunk_rows, *shape]."""

    rows: int
    chunk_rows: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def np_dtype(self) -> np.dtype:
        return numpy_dtype(self.dtype)

    @property
    def chunks(self) -> int:
        return math.ceil(self.rows / self.chunk_rows)

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape) * self.np_dtype.itemsize

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_rows * self.row_bytes

    def chunk_name(self, chunk: int) -> str:
        return ".".join(["c", str(chunk)] + ["0"] * len(self.shape))

    def metadata(self, codecs: list[dict] | None = None) -> dict:
        return {
            "shape": [self.rows, *self.shape],
            "data_type": self.dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [self.chunk_rows, *self.shape]}},
            "chunk_key_encoding": CHUNK_KEY_ENCODING,
            "codecs": codecs or [{"name": "bytes", "configuration": {"endian": "little"}}],
        }


def open_array(
    path: Path,
    array: ArrayLayout,
    create: bool = False,
    codecs: list[dict] | None = None,
    context: ts.Context | None = None,
) -> ts.TensorStore:
    # (normalised: tensorstore's file driver refuses a path with ".." in it, as a user's
    # --output ../models/x or --run-dir ../runs/x gives)
    where = os.path.abspath(path)
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": where}, "metadata": array.metadata(codecs)}
    if create:  # every chunk file must exist, fill-valued ones included: rows are read by offset
        spec |= {"create": True, "store_data_equal_to_fill_value": True}
    else:
        spec["open"] = True
    try:
        return ts.open(spec, context=context).result()
    except ValueError as e:
        raise TierError(path, str(e).split(" [tensorstore_spec=")[0]) from None


def check_array(path: Path, array: ArrayLayout) -> None:
    """Raises TierError unless ``path`` holds ``array``'s zarr.json and every full-size chunk file."""
    meta = read_zarr_json(path)
    expected = array.metadata()
    for key in ("shape", "data_type", "chunk_grid"):
        if meta.get(key) != expected[key]:
            raise TierError(
                path / "zarr.json",
                f"{key} is {json.dumps(meta.get(key))}, expected {json.dumps(expected[key])} (a foreign array)",
            )
    codecs = meta.get("codecs", [])
    raw = (
        len(codecs) == 1
        and codecs[0].get("name") == "bytes"
        and codecs[0].get("configuration", {}).get("endian", "little") == "little"
    )
    if not raw or meta.get("chunk_key_encoding") != CHUNK_KEY_ENCODING:
        raise TierError(path / "zarr.json", "not raw little-endian chunks with '.' chunk keys")
    for chunk in range(array.chunks):
        file = path / array.chunk_name(chunk)
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise TierError(file, "missing") from None
        if size != array.chunk_bytes:
            what = "truncated" if size < array.chunk_bytes else "too large"
            raise TierError(file, f"{what} ({size} of {array.chunk_bytes} bytes)")


def read_zarr_json(path: Path) -> dict:
    file = path / "zarr.json"
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError:
        raise TierError(file, "missing") from None
    except (ValueError, UnicodeDecodeError):
        raise TierError(file, "not JSON") from None
    if not isinstance(meta, dict) or meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        raise TierError(file, "not a zarr3 array")
    return meta


def checked_values(table: str, field: str, array: ArrayLayout, values: dict, n: int) -> np.ndarray:
    if field not in values:
        raise ValueError(f"no values for field {field!r} of table {table!r}")
    v = np.asarray(values[field], array.np_dtype)
    if v.shape != (n, *array.shape):
        raise ValueError(f"{table}/{field}: values of shape {v.shape}, expected {(n, *array.shape)}")
    return v


def bulk_load(path: Path, table: str, fields: dict[str, ArrayLayout], init: RowInit) -> None:
    """Creates the table's arrays under ``path`` (``fields``: with :data:`CHECKSUMS`, their
    checksums are written too) and writes ``init``'s rows one chunk at a time."""
    no_sync = ts.Context({"file_io_sync": False})  # the caller fsyncs each file once instead
    stores = {f: open_array(path / f, a, create=True, context=no_sync) for f, a in fields.items()}
    geometry = next(iter(fields.values()))
    for start in range(0, geometry.rows, geometry.chunk_rows):
        stop = min(start + geometry.chunk_rows, geometry.rows)
        given = init(table, start, stop)
        values = {f: checked_values(table, f, a, given, stop - start) for f, a in fields.items() if f != CHECKSUMS}
        if CHECKSUMS in fields:
            values[CHECKSUMS] = table_checksums(values, np.arange(start, stop))
        pending = [stores[f][start:stop].write(v) for f, v in values.items()]
        for p in pending:
            p.result()


def saved_chunk_rows(meta: dict) -> int:
    """The rows per chunk a zarr.json declares (0 if it declares none)."""
    try:
        return int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
    except (KeyError, IndexError, TypeError, ValueError):
        return 0


def checksum_layout(fields: dict[str, ArrayLayout]) -> ArrayLayout:
    """The :data:`CHECKSUMS` array of a table with ``fields``: a uint64 per row and field."""
    geometry = next(iter(fields.values()))
    return ArrayLayout(geometry.rows, geometry.chunk_rows, (len(fields),), "uint64")


def table_checksums(values: dict[str, np.ndarray], rows: np.ndarray) -> np.ndarray:
    """uint64 [n, fields]: the checksums of table ``rows`` [n] whose fields hold ``values``
    ({field: [n, *shape]}, every field of the table), columns in field-name order."""
    return np.stack([row_checksums(as_bytes(values[f]), rows) for f in sorted(values)], axis=1)


def as_bytes(values: np.ndarray) -> np.ndarray:
    """uint8 [n, row_bytes]: the rows' bytes as the chunk files hold them."""
    values = np.ascontiguousarray(values)
    return values.reshape(-1).view(np.uint8).reshape(len(values), values.itemsize * math.prod(values.shape[1:]))


@functools.cache
def _multipliers(words: int) -> np.ndarray:
    """k_1..k_words: splitmix64 of 1..words, made odd (an odd k makes every change of word i show)."""
    z = np.arange(1, words + 1, dtype=np.uint64) * _ROW_TERM
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) | np.uint64(1)


def row_checksums(data: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """uint64 [n]: the checksum of each row's bytes ``data`` (uint8 [n, row_bytes]) as table
    row ``rows`` [n] (see the module docstring), in blocks of rows that stay in cache."""
    n, nbytes = data.shape
    if nbytes % 4:
        data = np.concatenate([data, np.zeros((n, 4 - nbytes % 4), np.uint8)], axis=1)
    words = np.ascontiguousarray(data).view("<u4")
    k = _multipliers(words.shape[1])
    out = (np.asarray(rows).astype(np.uint64) + np.uint64(1)) * _ROW_TERM
    block = max(1, _BLOCK_WORDS // words.shape[1])
    scratch = np.empty((min(block, n), words.shape[1]), np.uint64)
    for s in range(0, n, block):
        part = scratch[: len(words[s : s + block])]
        np.multiply(words[s : s + block], k, out=part)
        out[s : s + block] += part.sum(axis=1, dtype=np.uint64)
    return out
