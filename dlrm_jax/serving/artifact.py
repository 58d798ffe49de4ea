"""The serving artifact's on-disk form: its layout, ``manifest.json``, table encodings and file hashes.

One folder (``dlrm-jax export --serving``)::

    manifest.json             what the model is, how raw values become ids, the step and its
                              evaluation, and a sha256 of every other file
    dense/function.jax        jax.export of (params, dense [b, num_dense], pooled [b, F, D]
                              [, wide [b, F, 1]]) -> probabilities [b], for CPU and CUDA
    dense/params.npz          the dense parameters, in the function's argument order
    tables/<table>/values     zarr3 [rows, D]: float32, bfloat16, or int8 ...
    tables/<table>/scale_offset  ... with float32 [rows, 2] per row: value = (q + 128) * scale + offset
    rules/feature_<f>.npy     a feature's vocabulary (value, count) by id, from preprocessing

Tables are uncompressed zarr3 arrays whose chunk files are raw rows, the disk tier's format
(:mod:`dlrm_jax.embedding.tiers.format`): tensorstore reads them, and a host without the memory
for a table reads its rows with coalesced `pread`s behind a row cache (:mod:`dlrm_jax.serving.tables`).
A delta (``--since STEP``) has the same layout, with ``tables/<table>/rows`` (int64 [k]) naming
the rows its values replace. Only numpy, jax and tensorstore are needed to read any of it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from dlrm_jax.embedding.tiers.format import ArrayLayout, default_chunk_rows, numpy_dtype, open_array

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
FUNCTION_FILE = "dense/function.jax"
PARAMS_FILE = "dense/params.npz"
TABLE_DTYPES = ("float32", "bfloat16", "int8")
INT8_FIELD = "scale_offset"
ROWS_FIELD = "rows"


class ArtifactError(ValueError):
    """A serving artifact is missing a file, damaged, or not one; names the file."""


def quantize_int8(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [n, D] -> int8 [n, D] and float32 [n, 2] (scale, offset) per row: the row's
    range in 256 steps (FBGEMM's row-wise 8-bit form); a constant row has scale 1."""
    lo, hi = values.min(axis=1), values.max(axis=1)
    step = ((hi - lo) / 255.0).astype(np.float32)
    scale = np.where(step > 0, step, 1.0).astype(np.float32)  # a constant row, or a range that underflows
    q = np.rint((values - lo[:, None]) / scale[:, None]) - 128.0
    return np.clip(q, -128, 127).astype(np.int8), np.stack([scale, lo], axis=1).astype(np.float32)


def dequantize_int8(q: np.ndarray, scale_offset: np.ndarray) -> np.ndarray:
    """Inverse of :func:`quantize_int8` (to float32, within half a step of the row's range)."""
    return (q.astype(np.float32) + 128.0) * scale_offset[:, :1] + scale_offset[:, 1:]


def encode_rows(values: np.ndarray, dtype: str) -> dict[str, np.ndarray]:
    """float32 rows [n, D] -> the fields a table of ``dtype`` stores them as."""
    if dtype == "int8":
        q, so = quantize_int8(values)
        return {"values": q, INT8_FIELD: so}
    return {"values": values.astype(numpy_dtype(dtype))}


def decode_rows(fields: dict[str, np.ndarray]) -> np.ndarray:
    """A table's stored fields (rows of them) -> float32 [n, D]."""
    if INT8_FIELD in fields:
        return dequantize_int8(fields["values"], fields[INT8_FIELD])
    return fields["values"].astype(np.float32)


def table_fields(rows: int, dim: int, dtype: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """The fields of a table of ``dtype``: {field: (per-row shape, numpy dtype)}."""
    if dtype == "int8":
        return {"values": ((dim,), "int8"), INT8_FIELD: ((2,), "float32")}
    return {"values": ((dim,), dtype)}


class TableWriter:
    """Writes one table of an artifact, rows in order, a chunk at a time (nothing table-sized
    in memory)."""

    def __init__(self, directory: Path, rows: int, dim: int, dtype: str, with_rows: bool = False):
        fields = dict(table_fields(rows, dim, dtype))
        if with_rows:
            fields[ROWS_FIELD] = ((), "int64")
        row_bytes = sum(int(np.prod(shape, dtype=np.int64)) * numpy_dtype(d).itemsize for shape, d in fields.values())
        most = default_chunk_rows(row_bytes)
        chunk = max(1, -(-rows // -(-rows // most)) if rows else 1)  # even chunks: the last one pads little
        self.dtype, self.rows = dtype, rows
        self.arrays = {
            f: open_array(Path(directory).absolute() / f, ArrayLayout(rows, chunk, shape, d), create=True)
            for f, (shape, d) in fields.items()
        }

    def write(self, start: int, values: np.ndarray, rows: np.ndarray | None = None) -> None:
        """float32 ``values`` [n, D] of rows ``start`` .. ``start + n`` (of a delta: table rows ``rows``)."""
        fields = encode_rows(np.asarray(values, np.float32), self.dtype)
        if rows is not None:
            fields[ROWS_FIELD] = np.asarray(rows, np.int64)
        pending = [self.arrays[f][start : start + len(values)].write(v) for f, v in fields.items()]
        for p in pending:
            p.result()


def file_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` but the manifest, by relative path."""
    out = {}
    for path in sorted(p for p in Path(root).rglob("*") if p.is_file() and p.name != MANIFEST):
        out[path.relative_to(root).as_posix()] = sha256(path)
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def write_manifest(root: Path, manifest: dict) -> None:
    """``manifest`` with every file's hash, written last (an artifact without one is unfinished)."""
    manifest = {**manifest, "files": file_hashes(root)}
    tmp = Path(root) / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.replace(Path(root) / MANIFEST)


def read_manifest(root: Path) -> dict:
    file = Path(root) / MANIFEST
    if Path(root).is_file():  # ("[Errno 20] Not a directory" before)
        raise ArtifactError(f"{root}: a file, not a serving artifact's folder (dlrm-jax export --serving writes one)")
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise ArtifactError(
            f"{file}: missing: not a serving artifact (dlrm-jax export --serving writes one), "
            f"or its export did not finish"
        ) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{file}: not JSON ({e})") from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{file}: format_version {version!r}; this dlrm_jax reads version {FORMAT_VERSION}")
    return manifest


def check_files(root: Path, manifest: dict, names: list[str] | None = None) -> None:
    """Raises ArtifactError naming the first listed file (of ``names``, default all) that is
    missing or whose sha256 differs from the manifest's."""
    files = manifest.get("files", {})
    for name in names if names is not None else list(files):
        path = Path(root) / name
        if name not in files:
            raise ArtifactError(f"{path}: not listed in {Path(root) / MANIFEST}")
        if not path.is_file():
            raise ArtifactError(f"{path}: missing")
        if sha256(path) != files[name]:
            raise ArtifactError(f"{path}: its sha256 differs from the manifest's (damaged or edited)")
