"""The on-disk layout of a preprocessed dataset (format 2): splits cut into shards of bounded
size, each a folder that can be written, copied to the host that reads it, and checked alone.

::

    PATH/meta.json                       format_version 2, num_dense, cardinalities, bag_sizes,
                                         train_rows, val_rows, shard_rows, shards {train, val}:
                                         rows per shard, shuffled, shuffle_seed, inputs, ...
    PATH/{train,val}/NNNNN/dense.npy     float32 [rows, num_dense]  normalised dense features
    PATH/{train,val}/NNNNN/ids.npy       int32   [rows, S]          ids; S = sum(bag_sizes)
    PATH/{train,val}/NNNNN/labels.npy    float32 [rows]             0 or 1
    PATH/{train,val}/NNNNN/raw.npy       uint64  [rows, F]          each feature's 64-bit value, 0
                                         where missing (``raw_values`` in meta: ``preprocess
                                         --raw-values``; dynamic tables map these)
    PATH/{train,val}/NNNNN/shard.json    rows and the CRC-32 of each file
    PATH/vocab/feature_{f}.npy           uint64 [K_f, 2]: (value, count) per id (vocabularies:
                                         of ids 1..K_f; hashing: of ids 0..K_f-1, the value
                                         being the hashed one)
    PATH/side_files/schema.yaml,         a tabular dataset's schema and join files (meta's
    PATH/side_files/joins/NAME/FILE      ``side_files``), copied as preprocessing read them
    PATH/train/id_counts.npz             ids_{f}, counts_{f}: the most frequent ids of feature f
                                         and their counts over the rows values were counted on
                                         (meta's vocab_from: train or all rows; one-hot only)

Train rows are in shuffled order when ``shuffled`` (a global shuffle at preprocessing); val
rows keep input order. Written by :mod:`dlrm_jax.data.preprocessing.prep_driver`, read by
:mod:`dlrm_jax.data.sources.binary`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dlrm_jax.files import FolderLock, add_sampled, check_dir, json_text
from dlrm_jax.wording import said

FORMAT_VERSION = 2
META_FILE = "meta.json"
SHARD_FILE = "shard.json"
ID_COUNTS_FILE = "id_counts.npz"
SPLITS = ("train", "val")
VOCAB_DIR = "vocab"  # a vocabulary per feature: VOCAB_DIR/feature_{f}.npy
SIDE_FILES = "side_files"  # a tabular dataset's schema and join files, as preprocessing read them
# everything a preprocessed dataset's folder holds (what --overwrite may replace)
DATASET_ENTRIES = frozenset((META_FILE, *SPLITS, VOCAB_DIR, SIDE_FILES))
ARRAY_DTYPES = {"dense": np.float32, "ids": np.int32, "labels": np.float32}
RAW_DTYPES = {"raw": np.uint64}  # a shard's raw values, when the dataset keeps them
HISTOGRAM_IDS = 1 << 20  # ids kept per feature in id_counts.npz: far more than any hot set
_META_KEYS = ("num_dense", "cardinalities", "bag_sizes", "train_rows", "val_rows", "shards")


class BinaryFormatError(ValueError):
    """A preprocessed dataset that cannot be used; the message names the offending file."""


def shard_name(index: int) -> str:
    return f"{index:05d}"


def split_sizes(n: int, val_fraction: float) -> tuple[int, int]:
    """(train, val) sizes of n rows when the last ``val_fraction`` of them are held out."""
    n_val = min(n, int(n * val_fraction + 0.5))
    return n - n_val, n_val


def read_meta(path: str | Path) -> dict:
    """The parsed ``PATH/meta.json`` of a preprocessed dataset, checked for version and keys."""
    file = Path(path) / META_FILE
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError:
        raise BinaryFormatError(f"{file}: not found; is {path} the output of `dlrm-jax preprocess`?") from None
    except (OSError, ValueError) as e:
        raise BinaryFormatError(f"{file}: cannot be read as JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        found = meta.get("format_version") if isinstance(meta, dict) else None
        raise BinaryFormatError(
            f"{file}: format_version {found!r} is not supported (expected {FORMAT_VERSION}); preprocess the data again"
        )
    missing = [k for k in _META_KEYS if k not in meta]
    if missing:
        raise BinaryFormatError(f"{file}: missing key(s) {', '.join(missing)}")
    return meta


def dataset_identity(path: str | Path) -> dict:
    """What a run records of the dataset at ``path`` to know it again: its folder, its split
    sizes, a digest of its ``meta.json`` (``meta_sha256``; the record's only digest before
    ``content_sha256``) and :func:`content_digest`."""
    meta = read_meta(path)
    digest = hashlib.sha256((Path(path) / META_FILE).read_bytes()).hexdigest()
    return {
        "path": str(Path(path).absolute()),
        "meta_sha256": digest,
        "content_sha256": content_digest(path),
        "train_rows": int(meta["train_rows"]),
        "val_rows": int(meta["val_rows"]),
    }


# meta.json's keys that name files outside the dataset: their folders are not the data
_PATH_KEYS = ("inputs", "val_inputs", "schema", "joins")


def _file_names(value):
    """The paths in ``value`` (a path, or lists and dicts of them) without their folders."""
    if isinstance(value, dict):
        return {k: _file_names(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_file_names(v) for v in value]
    return Path(value).name if isinstance(value, str) else value


def content_digest(path: str | Path, shards: bool = True) -> str:
    """A digest of what the dataset at ``path`` holds, wherever it and its inputs lie: its
    ``meta.json`` with the inputs' folders left out, every shard's ``shard.json`` (the CRC-32
    of each of its files) and each vocabulary's and side file's size and ends (the raw values
    its ids stand for: two inputs that differ only in their values can give equal shards). The same data
    preprocessed again the same way, from anywhere, has the same digest; reading it costs
    kilobytes, not the data. ``shards=False``: without the shards' checksums (hosts that each
    hold the shards they read agree on the rest)."""
    root = Path(path)
    meta = json.loads((root / META_FILE).read_text())
    # (header_columns: what preprocessing read of its inputs' headers, recorded since 2026-12-07;
    # the same data preprocessed before it is the same data)
    kept = {k: _file_names(v) if k in _PATH_KEYS else v for k, v in meta.items() if k != "header_columns"}
    h = hashlib.sha256(json.dumps(kept, sort_keys=True).encode())
    for split in SPLITS if shards else ():
        for index in range(len(meta["shards"][split])):
            try:
                h.update((root / split / shard_name(index) / SHARD_FILE).read_bytes())
            except OSError:  # (a host holding its own shards only; a damaged one: the source names it)
                h.update(f"absent {split}/{index}".encode())
    for folder in (root / VOCAB_DIR, root / SIDE_FILES):  # (the side files: a tabular schema and its joins)
        for file in sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else ():
            h.update(str(file.relative_to(root)).encode())
            add_sampled(h, file)
    return h.hexdigest()


def write_shard(folder: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write one shard's arrays (those of ``ARRAY_DTYPES``, and raw values when given), then its
    shard.json (rows, CRC-32 per file) last."""
    folder.mkdir(parents=True)
    crcs = {}
    for name in [*ARRAY_DTYPES, *(k for k in RAW_DTYPES if k in arrays)]:
        a = np.ascontiguousarray(arrays[name])
        np.save(folder / f"{name}.npy", a)
        crcs[name] = zlib.crc32(a.data)
    rows = len(arrays["labels"])
    (folder / SHARD_FILE).write_text(json_text({"rows": rows, "crc32": crcs}) + "\n")


class ArrayFile(NamedTuple):
    """Where a shard's ``.npy`` array lies in its file: read rows with :meth:`read_into`."""

    path: Path
    offset: int  # bytes of the .npy header
    row_bytes: int
    shape: tuple[int, ...]
    dtype: np.dtype

    def read_into(self, fd: int, out: np.ndarray, first_row: int) -> None:
        """``len(out)`` rows from ``first_row`` into ``out`` (C-contiguous), one ``pread``
        (the page cache copies straight into the batch; nothing is mapped into the process)."""
        view, want = memoryview(out.reshape(-1).view(np.uint8)), out.nbytes
        got = os.preadv(fd, [view], self.offset + first_row * self.row_bytes)
        while got < want:  # short reads: continue where the last one stopped
            step = os.preadv(fd, [view[got:]], self.offset + first_row * self.row_bytes + got)
            if step == 0:
                raise BinaryFormatError(f"{self.path}: ends before row {first_row + len(out)} (truncated)")
            got += step


def open_shard(folder: Path, rows: int, widths: dict[str, int]) -> dict[str, ArrayFile]:
    """One shard's arrays as :class:`ArrayFile` s, checked for shape and dtype (``widths``:
    dense, ids, and raw when its raw values are read) from their headers."""
    arrays = {}
    for name, dtype in (ARRAY_DTYPES | {k: d for k, d in RAW_DTYPES.items() if k in widths}).items():
        file = folder / f"{name}.npy"
        try:
            with open(file, "rb") as f:
                major, _ = np.lib.format.read_magic(f)
                header = {1: np.lib.format.read_array_header_1_0, 2: np.lib.format.read_array_header_2_0}
                if major not in header:
                    raise ValueError(f".npy format version {major} is not read here")
                shape, fortran, found = header[major](f)
                offset = f.tell()
        except (OSError, ValueError) as e:
            raise BinaryFormatError(f"{file}: cannot be read as a .npy array ({e})") from None
        want = (rows, widths[name]) if name in widths else (rows,)
        if shape != want or found != dtype or fortran:
            raise BinaryFormatError(
                f"{file}: expected {np.dtype(dtype).name} {list(want)} (from "
                f"meta.json and the config), found {found.name} {list(shape)}"
            )
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * found.itemsize
        size = file.stat().st_size
        if size < offset + rows * row_bytes:  # a truncated file: its header still says every row
            raise BinaryFormatError(
                f"{file}: truncated: {size:,} bytes, its {rows:,} rows need "
                f"{offset + rows * row_bytes:,}; preprocess the data again"
            )
        arrays[name] = ArrayFile(file, offset, row_bytes, shape, found)
    return arrays


def verify_shard(folder: str | Path) -> int:
    """Check a shard alone against its shard.json (every file's CRC-32); returns its rows."""
    folder = Path(folder)
    try:
        info = json.loads((folder / SHARD_FILE).read_text())
        rows, crcs = int(info["rows"]), info["crc32"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BinaryFormatError(
            f"{folder / SHARD_FILE}: missing or unreadable ({e}); the shard is incomplete"
        ) from None
    for name in [*ARRAY_DTYPES, *(k for k in RAW_DTYPES if k in crcs)]:
        a = np.load(folder / f"{name}.npy", mmap_mode="r")
        if len(a) != rows or zlib.crc32(np.ascontiguousarray(a).data) != crcs[name]:
            raise BinaryFormatError(f"{folder / name}.npy: does not match {SHARD_FILE} (damaged or changed)")
    return rows


def check_output_target(output: str | Path, overwrite: bool = False) -> None:
    """Refuse a non-empty ``output``: an earlier preprocessed dataset is replaced only with
    ``overwrite`` (runs trained on it would resume on other rows), anything else never, nor a
    dataset's folder that holds anything else too (replacing the folder would delete it)."""
    out = check_dir(output, "output")  # a file at it or at a parent: named, not "[Errno 20]"
    if os.path.ismount(os.path.realpath(out)):  # (written beside it and renamed into place: not over a mount)
        raise FileExistsError(
            f"{said('--output', 'output')} {out}: a mount point; preprocess into a new folder inside it, e.g. {out / 'data'}"
        )
    if not out.exists() or not any(out.iterdir()):
        return
    others = sorted(p.name for p in out.iterdir() if p.name not in DATASET_ENTRIES)
    shown = ", ".join(others[:5]) + (f" and {len(others) - 5:,} more" if len(others) > 5 else "")
    if not (out / META_FILE).exists():  # (what it holds named: a lone .DS_Store is not obvious)
        raise FileExistsError(
            f"{said('--output', 'output')} {out}: exists and is not a preprocessed dataset (it holds {shown or 'parts of one'}); "
            f"not replacing it: choose a new folder"
        )
    if others:
        raise FileExistsError(
            f"{said('--output', 'output')} {out}: holds a preprocessed dataset and files that are not its own ({shown}); "
            f"not replacing it: move them out, or choose a new folder"
        )
    if not overwrite:
        raise FileExistsError(
            f"{said('--output', 'output')} {out}: holds a preprocessed dataset already (runs trained on it would resume on "
            f"other rows if it were replaced); choose a new folder, or pass {said('--overwrite', 'overwrite=True')} to replace it"
        )


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


class DatasetDir:
    """A dataset being written in ``.NAME.tmp-PID`` beside ``output``: :meth:`commit` writes
    meta.json last and renames it into place (replacing an earlier dataset, with ``overwrite``,
    only then); an exception inside the ``with`` removes it, so ``output`` is never half
    written. An ``output`` that is a symbolic link keeps it: the dataset it points to is the one
    written (renaming the link aside and deleting it as a folder failed after the whole run)."""

    def __init__(self, output: str | Path, overwrite: bool = False):
        check_output_target(output, overwrite)
        self.output = Path(os.path.realpath(output))
        # One writer an output from its check to its commit (``.NAME.lock`` beside it): two
        # preprocess runs into one new folder each passed the check, and the second's commit
        # replaced the first's dataset, both reporting success.
        self.output.parent.mkdir(parents=True, exist_ok=True)
        self._lock = FolderLock(self.output.parent, f".{self.output.name}.lock").take(
            lambda holder: FileExistsError(
                f"{said('--output', 'output')} {output}: another preprocess is writing it ({holder}); wait for it, or choose a new folder"
            )
        )
        try:
            check_output_target(output, overwrite)  # (again, now that no other writer can commit)
            remove_stale_temporaries(self.output)
            self.root = self.output.with_name(f".{self.output.name}.tmp-{os.getpid()}")
            shutil.rmtree(self.root, ignore_errors=True)
            self.root.mkdir(parents=True)
        except BaseException:
            self._lock.release()
            raise

    def __enter__(self) -> DatasetDir:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if isinstance(exc, OSError):  # (a full disk is told from a quota by the space left when it failed)
            with contextlib.suppress(OSError, AttributeError):
                exc.free_at_failure = shutil.disk_usage(self.root).free
        if exc_type is not None:
            shutil.rmtree(self.root, ignore_errors=True)
        self._lock.release()

    def commit(self, meta: dict) -> None:
        shutil.rmtree(self.root / ".work", ignore_errors=True)
        meta = {"format_version": FORMAT_VERSION, **meta}
        (self.root / META_FILE).write_text(json_text(meta, indent=1) + "\n")
        if self.output.exists():  # an earlier dataset: replaced only now that this one is whole
            old = self.output.with_name(f".{self.output.name}.old-{os.getpid()}")
            self.output.rename(old)
            self.root.rename(self.output)
            shutil.rmtree(old)
        else:
            self.root.rename(self.output)


def load_split(path: str | Path, split: str) -> dict[str, np.ndarray]:
    """A whole split's arrays, its shards concatenated in order (small datasets, inspection);
    ``raw`` too when the dataset keeps raw values."""
    meta, root = read_meta(path), Path(path)
    dtypes = ARRAY_DTYPES | (RAW_DTYPES if meta.get("raw_values") else {})
    parts = [
        {k: np.load(root / split / shard_name(i) / f"{k}.npy") for k in dtypes}
        for i, n in enumerate(meta["shards"][split])
        if n
    ]
    if not parts:
        width = {"dense": (int(meta["num_dense"]),), "ids": (sum(meta["bag_sizes"]),), "labels": ()}
        width["raw"] = (len(meta["cardinalities"]),)
        return {k: np.zeros((0, *width[k]), d) for k, d in dtypes.items()}
    return {k: np.concatenate([p[k] for p in parts]) for k in dtypes}
