"""Checking the disk tier's rows against their checksums (:data:`~.format.CHECKSUMS`).

Every read checks the rows it returns (:func:`check_rows`), a restore checks every row of the
snapshot it restores (:func:`verify_arrays`), an export every row it writes
(:func:`verified_rows`): damaged rows are a :class:`RowsDamaged` error naming the chunk file,
the table and the first rows, never values a step trains on. A table without a checksum array
(a store made before them) is not checked.

Threads: :func:`verify_arrays` checks chunks on a few threads of its own (numpy's sums and the
reads release the GIL); the rest runs on the caller's thread.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from dlrm_jax.embedding.tiers.format import CHECKSUMS, ArrayLayout, TierError, row_checksums
from dlrm_jax.wording import run_dir_flag

VERIFY_THREADS = min(8, os.cpu_count() or 1)
SHOWN_ROWS = 3  # rows an error names; it counts the others


class RowsDamaged(TierError):
    """Rows of a chunk file do not match their checksums: the file changed after the tier wrote it."""


def mismatched(arrays: dict[str, ArrayLayout], got: dict[str, np.ndarray], rows: np.ndarray) -> np.ndarray | None:
    """bool [n, fields]: which of table ``rows`` [n] do not match their checksums, per field in
    name order (``got``: every array's rows as bytes, uint8 [n, row_bytes]); None when the
    table has no checksums."""
    if CHECKSUMS not in arrays:
        return None
    stored = got[CHECKSUMS].view("<u8")  # [n, fields]
    fields = sorted(f for f in arrays if f != CHECKSUMS)
    return np.stack([row_checksums(got[f], rows) != stored[:, j] for j, f in enumerate(fields)], axis=1)


def damage(
    directory: Path, table: str, arrays: dict[str, ArrayLayout], bad: np.ndarray, rows: np.ndarray
) -> RowsDamaged:
    """The error for ``bad`` (from :func:`mismatched`) of ``rows``: the first damaged field's
    chunk file under ``directory`` (a table's folder) and its first rows."""
    fields = sorted(f for f in arrays if f != CHECKSUMS)
    j = int(np.flatnonzero(bad.any(axis=0))[0])
    array = arrays[fields[j]]
    damaged = np.unique(rows[bad[:, j]])
    chunk = int(damaged[0]) // array.chunk_rows
    in_chunk = damaged[damaged // array.chunk_rows == chunk]
    shown = ", ".join(map(str, in_chunk[:SHOWN_ROWS].tolist()))
    more = f" and {len(in_chunk) - SHOWN_ROWS} more" if len(in_chunk) > SHOWN_ROWS else ""
    which = (
        f"row {shown} of table {table} does not match its checksum"
        if len(in_chunk) == 1
        else (f"rows {shown}{more} of table {table} do not match their checksums")
    )
    return RowsDamaged(
        Path(directory) / fields[j] / array.chunk_name(chunk), f"{which}: the file changed after the tier wrote it"
    )


def check_rows(directory: Path, table: str, arrays: dict[str, ArrayLayout], got: dict, rows: np.ndarray) -> None:
    """Raises :class:`RowsDamaged` unless every row of ``got`` (see :func:`mismatched`) matches."""
    bad = mismatched(arrays, got, rows)
    if bad is not None and bad.any():
        raise damage(directory, table, arrays, bad, rows)


def verified_rows(directory: Path, table: str, arrays: dict[str, ArrayLayout], start: int, stop: int) -> dict:
    """Every array's rows ``start:stop`` (within one chunk) under ``directory`` (a table's
    folder), read from the chunk files and checked: {name: uint8 [stop - start, row_bytes]}."""
    geometry = next(iter(arrays.values()))
    chunk, first = divmod(start, geometry.chunk_rows)
    got = {}
    for name, array in arrays.items():
        path = Path(directory) / name / array.chunk_name(chunk)
        count = (stop - start) * array.row_bytes
        try:
            data = np.fromfile(path, np.uint8, count, offset=first * array.row_bytes)
        except OSError as e:
            raise TierError(path, e.strerror or str(e), e.errno) from None
        if data.size != count:
            raise TierError(path, f"short read: {data.size} of {count} bytes (rows {start}..{stop - 1})")
        got[name] = data.reshape(stop - start, array.row_bytes)
    check_rows(directory, table, arrays, got, np.arange(start, stop))
    return got


def verify_arrays(base: Path, arrays: dict[str, dict[str, ArrayLayout]], slice_bytes: int = 8 << 20) -> None:
    """Reads and checks every row of every table under ``base`` (a snapshot's folder), slices
    of at most ``slice_bytes`` of a field on :data:`VERIFY_THREADS` threads; raises the first
    damage found. Memory: a slice per thread."""
    todo = []
    for table, fields in arrays.items():
        if CHECKSUMS not in fields:
            continue
        geometry = fields[CHECKSUMS]
        step = max(1, min(geometry.chunk_rows, slice_bytes // max(a.row_bytes for a in fields.values())))
        for chunk_start in range(0, geometry.rows, geometry.chunk_rows):
            chunk_stop = min(chunk_start + geometry.chunk_rows, geometry.rows)
            todo += [(table, s, min(s + step, chunk_stop)) for s in range(chunk_start, chunk_stop, step)]
    pool = ThreadPoolExecutor(VERIFY_THREADS, thread_name_prefix="tier-verify")
    try:
        for _ in pool.map(lambda t: verified_rows(Path(base) / t[0], t[0], arrays[t[0]], t[1], t[2]), todo):
            pass
    finally:
        pool.shutdown(cancel_futures=True)  # the first damage is enough


def advice(root: Path, path: Path, steps: list[int], resuming: bool) -> str:
    """What to do about the damaged file ``path`` under a store's ``root`` with snapshots
    ``steps``: which other snapshots hold this same file (hard links of it: damaged alike) and,
    when ``resuming`` (found in ``work/``), what re-running does."""
    parts = path.relative_to(root).parts
    found = int(parts[1]) if parts[0] == "snapshots" else None
    rel = Path(*parts[2:] if found is not None else parts[1:])
    try:
        same = [s for s in steps if s == found or os.path.samefile(root / "snapshots" / str(s) / rel, path)]
    except OSError:
        same = []
    if steps and same == steps:
        return (
            f"every snapshot of the disk tier (steps {', '.join(map(str, steps))}) holds this same file, so none "
            f"has an intact copy and no checkpoint of these tables can be resumed; start afresh with a new {run_dir_flag()}"
        )
    others = [s for s in same if s != found]
    listed = ", ".join(map(str, others))
    held = f"step {listed}: its snapshot holds" if len(others) == 1 else f"steps {listed}: their snapshots hold"
    if resuming:
        also = f" (not {held} this same file)" if others else ""
        return f"re-running resumes from the newest checkpoint whose disk-tier snapshot is intact{also}"
    return f"{held} this same file" if others else ""
