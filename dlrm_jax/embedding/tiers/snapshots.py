"""The files of a tier store on disk: building ``work/``, snapshots, restores, recovery after a crash, exports.

Crash safety is copy-on-write against hard-linked snapshots. :func:`link_snapshot` hard-links every
working file into ``root/snapshots/<step>/`` (built as ``<step>.tmp``, then renamed), once the store
fsynced the chunk files written since the last one. A working chunk file with more than one link is
shared with a snapshot: the store copies it before its first write to it
(:class:`~dlrm_jax.embedding.tiers.store.TierStore`). After a crash the working files are untrusted;
:func:`swap_in_work` rebuilds ``work/`` from a snapshot's links (built as ``work.tmp``, then swapped
in), and :func:`recover` finishes or undoes what a crash interrupted.

These functions take no lock: :class:`~dlrm_jax.embedding.tiers.store.TierStore` calls them under its own.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from dlrm_jax.embedding.plan.stats import fmt_bytes
from dlrm_jax.embedding.tiers.format import (
    CHECKSUMS,
    EXPORT_CODECS,
    ArrayLayout,
    RowInit,
    TierError,
    TierTables,
    bulk_load,
    check_array,
    checksum_layout,
    default_chunk_rows,
    numpy_dtype,
    open_array,
    os_error,
    read_zarr_json,
    saved_chunk_rows,
)
from dlrm_jax.embedding.tiers.integrity import verified_rows
from dlrm_jax.files import full_disk_as, make_dir
from dlrm_jax.wording import run_dir_flag

Arrays = dict[str, dict[str, ArrayLayout]]  # {table: {field: layout}}


def _naming_the_file(change: Callable) -> Callable:
    """``change`` (a snapshot or a restore) raising a TierError that names the file or folder it
    could not make, link, rename or remove, with its errno (a tier folder that is not writable:
    EACCES, EPERM, EROFS), not an OSError from deep inside it."""

    @functools.wraps(change)
    def named(root: Path, *args):
        try:
            return change(root, *args)
        except TierError:
            raise
        except OSError as e:
            raise os_error(Path(e.filename or root), e) from None

    return named


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)


def recover(root: Path) -> None:
    """Finishes or undoes what a crash interrupted: a snapshot, a restore's swap, a create."""
    for tmp in (root / "snapshots").glob("*.tmp"):
        shutil.rmtree(tmp)
    work, tmp, old = root / "work", root / "work.tmp", root / "work.old"
    if old.is_dir():
        if not work.exists():  # work.tmp was whole before work was renamed away
            os.replace(tmp if tmp.is_dir() else old, work)
        _remove(old)
    _remove(tmp)  # an interrupted build


def checked_arrays(base: Path, tables: TierTables) -> Arrays:
    """The arrays of ``tables`` under ``base``, each checked against its zarr.json and chunk
    files, with each table's :data:`CHECKSUMS` array where it has one (stores made before
    them, and serving artifacts, have none)."""
    arrays = {}
    for table, (rows, fields) in tables.items():
        chunk_rows = saved_chunk_rows(read_zarr_json(base / table / next(iter(fields))))
        arrays[table] = {
            f: ArrayLayout(rows, chunk_rows or rows, tuple(shape), dtype) for f, (shape, dtype) in fields.items()
        }
        if (base / table / CHECKSUMS).is_dir():
            arrays[table][CHECKSUMS] = checksum_layout(arrays[table])
        for field, array in arrays[table].items():
            check_array(base / table / field, array)
    return arrays


def build_work(root: Path, tables: TierTables, init: RowInit, chunk_rows: int | None) -> Path:
    """Makes ``root/work`` (:meth:`TierStore.create`): every array, filled one chunk at a time; returns ``root``."""
    root = make_dir(Path(root).absolute(), "tier path")
    recover(root)
    if (root / "work").exists():
        raise TierError(root / "work", "already holds a tier store")
    if any((root / "snapshots").glob("*")):
        raise TierError(
            root / "snapshots",
            f"holds snapshots of an earlier store whose working files ({root / 'work'}) "
            f"are gone; remove {root / 'snapshots'} to start a new store here (checkpoints that need "
            f"those snapshots cannot resume then), or use another {run_dir_flag()} or embedding.tier.path",
        )
    arrays = {}
    for table, (rows, fields) in tables.items():
        if rows < 1 or not fields or CHECKSUMS in fields:
            raise ValueError(f"table {table!r}: needs at least one row and one field, none named {CHECKSUMS}")
        widest = max(math.prod(shape) * numpy_dtype(dtype).itemsize for shape, dtype in fields.values())
        table_chunk_rows = min(chunk_rows or default_chunk_rows(widest), rows)
        arrays[table] = {
            f: ArrayLayout(rows, table_chunk_rows, tuple(shape), dtype) for f, (shape, dtype) in fields.items()
        }
        arrays[table][CHECKSUMS] = checksum_layout(arrays[table])
    build = root / "work.tmp"
    need = sum(a.rows * math.prod(a.shape) * a.np_dtype.itemsize for fields in arrays.values() for a in fields.values())
    full = lambda: (
        f"tier path {root}: no space left on device for the tiered tables' {fmt_bytes(need)}; nothing was "
        f"kept: free space there, or give the tier another disk (embedding.tier.path)"
    )
    with full_disk_as(full):
        try:
            for table, fields in arrays.items():
                bulk_load(build / table, table, fields, init)
            for path in sorted(build.rglob("*"), reverse=True):  # files before their directories
                fsync(path)
            fsync(build)
        except BaseException:
            shutil.rmtree(build, ignore_errors=True)  # (a half-built store is never taken for one)
            raise
    os.replace(build, root / "work")
    fsync(root)
    return root


def snapshot_steps(root: Path) -> list[int]:
    d = root / "snapshots"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def work_from_newest_snapshot(root: Path, step: int | None = None) -> int | None:
    """:meth:`TierStore.rebuild_work`: ``work/`` linked again from the newest snapshot (or that
    of ``step``) when it is gone."""
    steps = snapshot_steps(root)
    if (root / "work").is_dir() or not steps:
        return None
    step = steps[-1] if step is None else step
    source, build = root / "snapshots" / str(step), root / "work.tmp"
    _remove(build)
    for src in sorted(source.rglob("*")):
        dst = build / src.relative_to(source)
        if src.is_dir():
            dst.mkdir(parents=True, exist_ok=True)
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError as e:
            raise os_error(dst, e) from None
    build.mkdir(exist_ok=True)
    os.replace(build, root / "work")
    fsync(root)
    return step


@_naming_the_file
def link_snapshot(root: Path, arrays: Arrays, step: int) -> None:
    """``work/``'s files hard-linked as ``snapshots/<step>/`` (replacing one of that step); the
    chunk files written since the last snapshot must be fsynced first."""
    snapshots = root / "snapshots"
    snapshots.mkdir(exist_ok=True)
    build, final = snapshots / f"{step}.tmp", snapshots / str(step)
    _remove(build)
    _link_tree(arrays, root / "work", build)
    _remove(final)
    os.replace(build, final)
    fsync(snapshots)


def checked_snapshot(root: Path, arrays: Arrays, step: int) -> Path:
    """The folder of snapshot ``step``, its arrays checked: a restore fails here before it changes anything."""
    source = root / "snapshots" / str(step)
    if not source.is_dir():
        raise TierError(source, "missing: no such snapshot")
    for table, fields in arrays.items():
        for field, array in fields.items():
            check_array(source / table / field, array)
    return source


@_naming_the_file
def swap_in_work(root: Path, arrays: Arrays, source: Path) -> None:
    """Makes ``work/`` hard links to the files of ``source`` (a snapshot); re-runnable."""
    work, build, old = root / "work", root / "work.tmp", root / "work.old"
    _remove(build)
    _remove(old)
    _link_tree(arrays, source, build)
    if work.exists():
        os.replace(work, old)
    os.replace(build, work)  # a crash between the two renames: recover finishes the swap
    fsync(root)
    _remove(old)


def keep_only(root: Path, steps: Iterable[int]) -> None:
    """Deletes every snapshot not in ``steps``."""
    keep = set(steps)
    for step in snapshot_steps(root):
        if step not in keep:
            shutil.rmtree(root / "snapshots" / str(step))


def export_arrays(root: Path, arrays: Arrays, dest: Path, table: str | None, snapshot: int | None) -> None:
    """:meth:`TierStore.export`: zstd-compressed copies of the tables' fields (or one table's),
    one chunk at a time, every row checked against its checksums first (RowsDamaged)."""
    source = root / "work" if snapshot is None else root / "snapshots" / str(snapshot)
    if not source.is_dir():
        raise TierError(source, "missing: no such snapshot")
    for name in [table] if table is not None else arrays:
        fields = arrays[name]
        for field, array in fields.items():
            check_array(source / name / field, array)
        out = {
            f: open_array(dest / name / f, a, create=True, codecs=EXPORT_CODECS)
            for f, a in fields.items()
            if f != CHECKSUMS  # not a field of the table
        }
        geometry = next(iter(fields.values()))
        for start in range(0, geometry.rows, geometry.chunk_rows):
            stop = min(start + geometry.chunk_rows, geometry.rows)
            got = verified_rows(source / name, name, fields, start, stop)  # pwrite's rows: the page cache's
            for f, dst in out.items():
                a = fields[f]
                dst[start:stop].write(got[f].view(a.np_dtype).reshape(stop - start, *a.shape)).result()


def _link_tree(arrays: Arrays, source: Path, build: Path) -> None:
    """Hard-links every file of every array from ``source`` to ``build``, fsyncing directories."""
    for table, fields in arrays.items():
        for field, array in fields.items():
            src, dst = source / table / field, build / table / field
            dst.mkdir(parents=True)
            for name in ["zarr.json", *(array.chunk_name(c) for c in range(array.chunks))]:
                try:
                    os.link(src / name, dst / name)
                except OSError as e:
                    raise os_error(dst / name, e) from None
            fsync(dst)
        fsync(build / table)
    fsync(build)
