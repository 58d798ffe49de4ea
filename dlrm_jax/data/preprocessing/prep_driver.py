"""The parallel driver every ``dlrm-jax preprocess`` runs: parse, count, assign ids, shuffle,
write shards; the output bytes do not depend on the number of workers.

A format supplies a picklable *parser* (:class:`~dlrm_jax.data.preprocessing.criteo_preprocess.CriteoParser`,
:class:`~dlrm_jax.data.preprocessing.tabular.TabularParser`): ``tasks(paths)`` cuts the input into units of
work and ``parse(task, log)`` turns one into :class:`~dlrm_jax.data.preprocessing.preprocess.Chunk` s. Four
phases follow, each a pool of worker processes (:mod:`~dlrm_jax.data.preprocessing.prep_pool`;
``workers=1`` runs them in this process) over the units of :mod:`~dlrm_jax.data.preprocessing.prep_phases`:

1. **scan** (per task): parse; per chunk ("part") and feature, dictionary-encode the values
   (after ``% max_ind_range`` when hashing) and save the part's codes, dense and labels, and
   its sorted distinct values with their counts, under the work folder; and, when the format
   splits by time, the rows' times as sortable keys (and their sorted copy).
   The val split is then decided (:mod:`dlrm_jax.data.preprocessing.prep_split`): the tail, whole files,
   or the latest rows by time; with ``vocab_from="train"`` each part holding val rows counts
   its train rows' values again (a bincount of its codes).
2. **vocabulary** (per feature): merge the parts' distinct values and their counts (over the
   train rows, or all rows with ``vocab_from="all"``) in value-range buckets (memory bounded
   by the bucket, not the input), then number them: by decreasing count (vocabularies; rare,
   missing values are id 0, rare and never-counted ones share id 1) or, when hashing, by
   hashed value, so a table has as many rows as the counted rows have distinct hashed values
   (``min(N, distinct)``); values seen only in val rows then share one more row, the last.
3. **place** (per part): codes to ids (a gather through the part's own dictionary), MLPerf
   multi-hot bags if asked, and each row's place: the train row of rank ``g`` (in input
   order) goes to position ``perm(g)`` of the train split (a
   :class:`~dlrm_jax.data.shuffle.KeyedPermutation` of the shuffle seed), val rows keep
   their order; rows are grouped by destination shard.
4. **shards** (per shard): gather the shard's rows from every part, in place order, and write
   the shard (:func:`~dlrm_jax.data.shards.write_shard`); memory is one shard per worker.

Everything is written under a temporary folder renamed into place at the end
(:class:`~dlrm_jax.data.shards.DatasetDir`): a failure or a kill leaves no half dataset.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from dlrm_jax.data import shards
from dlrm_jax.data.preprocessing.multihot import MultiHotRule, rule_name
from dlrm_jax.data.preprocessing.prep_phases import (
    EXAMPLES,
    Placement,
    assemble_shard,
    merge_feature,
    place_part,
    scan_task,
    train_counts,
)
from dlrm_jax.data.preprocessing.prep_pool import default_workers, worker_pool
from dlrm_jax.data.preprocessing.prep_split import plan_split
from dlrm_jax.data.preprocessing.preprocess import PreprocessReport, byte_progress, check_input_files
from dlrm_jax.files import check_each_once, file_key
from dlrm_jax.wording import said

__all__ = ["Options", "default_workers", "write_dataset"]  # default_workers: re-exported for the formats


@dataclass(frozen=True)
class Options:
    """How ids, splits, shuffling and shards are made (see ``dlrm-jax preprocess --help``)."""

    max_ind_range: int = 0
    min_count: int = 1
    vocab_from: str = "train"  # VOCAB_FROM: the rows whose values are counted (val-only ones: id 0)
    val_fraction: float = 0.1
    shuffle_seed: int | None = 0  # None: train rows keep input order
    shard_mb: float = 1024.0
    workers: int = 1
    multi_hot: tuple[int, ...] | None = None  # bag sizes of MLPerf's multi-hot rule
    raw_values: bool = False  # each shard keeps every feature's 64-bit value too (raw.npy)
    window_seconds: float = 0.0  # time windows of the train rows by the format's time column (0: by input file)
    skip_bad_lines: bool = False
    progress: bool = True


def write_dataset(
    parser,
    inputs: Sequence[str],
    output: str | Path,
    opts: Options,
    val_inputs: Sequence[str] = (),
    meta: Callable[[dict, Path], dict] = lambda extra, root: {},
    overwrite: bool = False,
) -> PreprocessReport:
    """Preprocess ``inputs`` (and ``val_inputs``, whole files for the val split) with
    ``parser`` into the sharded layout of :mod:`dlrm_jax.data.shards` at ``output``. A full
    disk is one line naming the output and the space it takes (nothing is left behind); a
    validation file that is also an input (every later AUC would score training rows), a
    missing input and a non-empty output (an earlier dataset: unless ``overwrite``) are
    refused before any work. ``meta(extra, root)``: the parser's own meta.json keys, given
    its workers' summed ``extra``, with the dataset's folder as written (it may put files there)."""
    check_input_files(inputs, val_inputs)
    _check_disjoint(inputs, val_inputs)
    if opts.raw_values and opts.multi_hot:  # the rule's extra ids are drawn, and have no values
        raise ValueError("--raw-values and --multi-hot: multi-hot bags' drawn ids have no raw values; choose one")
    if opts.max_ind_range and opts.min_count > 1:  # (hashed ids keep every value: it did nothing, and meta.json said 5)
        raise ValueError(
            f"--min-count {opts.min_count} and --max-ind-range {opts.max_ind_range}: --min-count leaves rare values "
            f"out of a vocabulary, and --max-ind-range hashes every value instead of building one; choose one"
        )
    if opts.window_seconds:  # windows of a time column, of rows kept in input order
        timed = getattr(parser, "split_by", None)
        need = None if timed else "a time column (a tabular schema's split_by)"
        need = need or ("--no-shuffle (windows of rows in input order)" if opts.shuffle_seed is not None else None)
        if need:
            raise ValueError(f"--window-seconds {opts.window_seconds:g}: needs {need}")
    shards.check_output_target(output, overwrite)
    try:
        return _write_dataset(parser, inputs, output, opts, val_inputs, meta, overwrite)
    except OSError as e:
        # numpy's writes say a full disk in words, with no errno (its fallocate check, or a short write)
        told = "Not enough free space to write" in str(e)
        if e.errno != errno.ENOSPC and not told and " requested and " not in str(e):
            raise  # not a full disk: its own message, which names its file
        existing = next(p for p in Path(output).absolute().parents if p.exists())
        free = shutil.disk_usage(existing).free
        need = 2 * sum(os.path.getsize(p) for p in [*inputs, *val_inputs] if os.path.isfile(p))
        # numpy's short writes carry no errno nor file: a full disk had less left, when it failed,
        # than the write asked for (the space now, the work files gone, said nothing of it)
        short = re.search(r"(\d+) requested and (\d+) written", str(e))
        then = getattr(e, "free_at_failure", None)
        full = short is not None and then is not None and then < int(short[1]) - int(short[2]) + 2**20
        if e.errno != errno.ENOSPC and not told and not full and free >= need:
            raise OSError(
                f"{output}: a write stopped short while preprocessing ({e}) with {free / 2**20:,.0f} MiB free: "
                f"a limit on file sizes (ulimit -f) or a disk quota?; nothing was written"
            ) from None
        raise OSError(
            f"{output}: no space left on device while preprocessing ({free / 2**20:,.0f} MiB free; "
            f"the shards and work files take about 2x the input, {need / 2**20:,.0f} MiB here"
            f"{', and more with --raw-values' if opts.raw_values else ''}): "
            f"free space or choose another {said('--output', 'output')}; nothing was written"
        ) from None


def _check_disjoint(inputs: Sequence[str], val_inputs: Sequence[str]) -> None:
    """Every input file once: not twice in a list, not both trained on and held out."""
    check_each_once(list(inputs), "--input")
    check_each_once(list(val_inputs), "--val-input")
    train = {file_key(p): p for p in inputs}
    for p in val_inputs:
        if file_key(p) in train:
            raise ValueError(
                f"--val-input {p}: also an --input ({train[file_key(p)]}): its rows would be trained on and "
                f"then scored as held out; give the validation file(s) only once, to --val-input"
            )


def _file_state(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _check_unchanged(as_found: dict[str, tuple[int, int]]) -> None:
    """Refuses inputs that changed while they were read (a file still being written or copied):
    the dataset would hold some of each version (before: 18,998 rows of a file that had 60,000
    lines, then 20,000, and no error)."""
    for path, (size, mtime) in as_found.items():
        now = _file_state(path)
        if now != (size, mtime):
            raise ValueError(
                f"{path}: changed while it was read ({size:,} bytes, now {now[0]:,}); preprocess it again once "
                f"it is written whole"
            )


def _write_dataset(
    parser,
    inputs: Sequence[str],
    output: str | Path,
    opts: Options,
    val_inputs: Sequence[str],
    meta: Callable[[dict], dict],
    overwrite: bool,
) -> PreprocessReport:
    t0, seconds = time.perf_counter(), {}
    paths, val_paths = [str(p) for p in inputs], [str(p) for p in val_inputs]
    as_found = {p: _file_state(p) for p in paths + val_paths}
    tasks = [(t, 0) for t in parser.tasks(paths)] + [(t, 1) for t in parser.tasks(val_paths)]
    with shards.DatasetDir(output, overwrite) as out, worker_pool(opts.workers) as pmap:
        work = out.root / ".work"
        work.mkdir()
        results = _scan_all(pmap, parser, tasks, work, opts, paths + val_paths)
        _check_unchanged(as_found)
        seconds["scan"] = time.perf_counter() - t0
        parts = [(name, rows, split) for r, (_, split) in zip(results, tasks, strict=True) for name, rows in r["parts"]]
        valid = sum(rows for _, rows, _ in parts)
        plan = plan_split(parts, work, opts.val_fraction, bool(val_paths), getattr(parser, "split_by", None))
        n_train, n_val = plan.n_train, plan.n_val
        if n_train == 0:
            raise ValueError(f"{', '.join(paths)}: no training rows ({valid} valid lines)")
        names, F = [name for name, _, _ in parts], parser.num_features
        count_files, counted_rows = [f"{name}.dict.npz" for name in names], valid
        if opts.vocab_from == "train" and n_val:  # parts holding val rows count their train rows
            mixed = [k for k, s in enumerate(plan.parts) if s.train < s.rows]
            counts_of = partial(train_counts, work=work, features=F)  # what every part shares, bound once
            for k, file in zip(
                mixed, pmap(counts_of, [names[k] for k in mixed], [plan.parts[k] for k in mixed]), strict=True
            ):
                count_files[k] = file
            counted_rows = n_train
        (out.root / shards.VOCAB_DIR).mkdir()
        merge = partial(
            merge_feature,
            parts=names,
            count_files=count_files,
            work=work,
            out=out.root,
            max_ind_range=opts.max_ind_range,
            min_count=opts.min_count,
            vocab_from=opts.vocab_from,
            rows=counted_rows,
        )
        cards = list(pmap(merge, range(F)))
        if opts.multi_hot:
            MultiHotRule(cards, opts.multi_hot).save(work / "multihot")
        seconds["vocabulary"] = time.perf_counter() - t0 - seconds["scan"]
        bags = tuple(opts.multi_hot) if opts.multi_hot else (1,) * parser.num_features
        row_bytes = 4 * (parser.num_dense + sum(bags) + 1) + 8 * parser.num_features * opts.raw_values
        where = Placement(n_train, n_val, max(1, int(opts.shard_mb * 2**20) // row_bytes), opts.shuffle_seed)
        place = partial(
            place_part,
            work=work,
            multi_hot=bool(opts.multi_hot),
            where=where,
            features=F,
            window_seconds=opts.window_seconds,
        )
        placed = list(pmap(place, names, plan.parts))
        counts = np.stack([c for c, _ in placed])
        part_paths = [task.path for r, (task, _) in zip(results, tasks, strict=True) for _ in r["parts"]]
        windows = _windows(opts, parser, paths, part_paths, plan, [w for _, w in placed])
        flat = counts.reshape(len(names), -1)  # a part's rows are sorted by (split, shard)
        starts = (np.cumsum(flat, axis=1) - flat).reshape(counts.shape)
        jobs = [(s, k, rows) for s in (0, 1) for k, rows in enumerate(where.shards(s))]
        for split in (0, 1):
            (out.root / shards.SPLITS[split]).mkdir()
        assemble = partial(assemble_shard, parts=names, starts=starts, counts=counts, work=work, root=out.root)
        list(pmap(assemble, *zip(*jobs, strict=True)))
        seconds["write"] = time.perf_counter() - t0 - seconds["scan"] - seconds["vocabulary"]
        hists = [np.load(work / f"hist_{f}.npz") for f in range(parser.num_features)]
        if not opts.multi_hot:  # bags' other ids are not counted: hot planning counts batches instead
            np.savez(
                out.root / shards.SPLITS[0] / shards.ID_COUNTS_FILE,
                **{f"ids_{f}": h["ids"] for f, h in enumerate(hists)},
                **{f"counts_{f}": h["counts"] for f, h in enumerate(hists)},
            )
        by_reason = sum((Counter(r["by_reason"]) for r in results), Counter())
        extra = _sum_extra(r["extra"] for r in results)
        out.commit(
            {
                "num_dense": parser.num_dense,
                "cardinalities": cards,
                "bag_sizes": list(bags),
                "train_rows": n_train,
                "val_rows": n_val,
                "shard_rows": where.shard_rows,
                "shards": {"train": where.shards(0), "val": where.shards(1)},
                "shuffled": opts.shuffle_seed is not None,
                "shuffle_seed": opts.shuffle_seed,
                "max_ind_range": opts.max_ind_range,
                "min_count": opts.min_count,
                "vocab_from": opts.vocab_from,
                "raw_values": opts.raw_values,
                # the bags' rule, drawn again from its seed where raw values are scored
                **({"multi_hot": rule_name()} if opts.multi_hot else {}),
                **({"windows": windows} if windows else {}),
                "val_fraction": 0.0 if val_paths else opts.val_fraction,
                **plan.meta(),
                "inputs": [str(Path(p).resolve()) for p in paths],
                "val_inputs": [str(Path(p).resolve()) for p in val_paths],
                "lines_read": sum(r["lines"] for r in results),
                "skipped": by_reason.total(),
                "skipped_by_reason": dict(by_reason),
                **meta(extra, out.root),  # (it may copy files into the dataset: the side files a schema joins)
            }
        )
    seconds["total"] = time.perf_counter() - t0
    return PreprocessReport(
        sum(r["lines"] for r in results),
        n_train,
        n_val,
        by_reason.total(),
        dict(by_reason),
        tuple(_examples(results, tasks)),
        tuple(cards),
        str(output),
        seconds,
        plan.describe(),
        opts.vocab_from,
    )


def _windows(opts: Options, parser, paths: list[str], part_paths: list[str], plan, placed: list) -> dict | None:
    """The train split's time windows when its rows keep input order: the row each starts at,
    and a label: each input file (Criteo's days), or with ``window_seconds`` each span of that
    many seconds of the format's time column (rows must then come in time order)."""
    if opts.shuffle_seed is not None:
        return None
    if not opts.window_seconds:
        rows = dict.fromkeys(paths, 0)
        for path, part in zip(part_paths, plan.parts, strict=True):
            if path in rows:
                rows[path] += part.train
        kept = [(p, n) for p, n in rows.items() if n]
        starts = np.cumsum([0] + [n for _, n in kept[:-1]]).tolist()
        return {"by": "input", "starts": starts, "labels": [Path(p).name for p, _ in kept]}
    first: dict[int, int] = {}
    last, last_path = None, None
    for path, w in zip(part_paths, placed, strict=True):
        if w is None or not len(w.windows):
            continue
        if not w.in_order or (last is not None and w.windows[0] < last):
            where = "within the file" if not w.in_order else f"earlier than rows of {last_path} before them"
            raise ValueError(
                f"{path}: rows are not in {parser.split_by} order ({where}); --window-seconds cuts "
                f"windows of time-ordered rows: sort the input by {parser.split_by}, or leave it out to "
                f"window by input file"
            )
        for win, rank in zip(w.windows.tolist(), w.first_rank.tolist(), strict=True):
            first[win] = min(rank, first.get(win, rank))
        last, last_path = int(w.windows[-1]), path
    order = sorted(first)
    return {
        "by": "seconds",
        "column": parser.split_by,
        "seconds": opts.window_seconds,
        "starts": [first[w] for w in order],
        "labels": [w * opts.window_seconds for w in order],
    }


def _scan_all(pmap, parser, tasks, work: Path, opts: Options, paths: list[str]) -> list[dict]:
    """Phase 1 over every task, in order; the first bad line (strict mode) raises, numbered
    in its file, whatever the number of workers."""
    strict, results, lines_before = not opts.skip_bad_lines, [], Counter()
    sizes = [(t.end - t.start) if t.end >= 0 else Path(t.path).stat().st_size for t, _ in tasks]
    n = len(tasks)
    with byte_progress(paths, "scan", opts.progress) as bar:
        scan = partial(
            scan_task, parser, work=work, max_ind_range=opts.max_ind_range, strict=strict, raw_values=opts.raw_values
        )
        scanned = pmap(scan, [t for t, _ in tasks], range(n))
        for (task, _), size, r in zip(tasks, sizes, scanned, strict=True):
            r["first_line"] = lines_before[task.path]
            if strict and r["bad"]:
                lineno, _, message = r["bad"][0]
                raise parser.error(f"{task.path}:{r['first_line'] + lineno}: {message}")
            lines_before[task.path] += r["lines"]
            results.append(r)
            bar.update(size)
    return results


def _examples(results: list[dict], tasks) -> Iterable[str]:
    """The first few skipped lines as ``path:line: reason``, in input order."""
    found = (
        f"{task.path}:{r['first_line'] + lineno}: {message}"
        for r, (task, _) in zip(results, tasks, strict=True)
        for lineno, _, message in r["bad"]
    )
    return list(found)[:EXAMPLES]


def _sum_extra(extras: Iterable[dict]) -> dict:
    """Per-task counters a parser reports (e.g. tabular join misses), added up."""
    total: dict = {}
    for extra in extras:
        for key, counts in extra.items():
            acc = total.setdefault(key, {})
            for name, count in counts.items():
                acc[name] = acc.get(name, 0) + count
    return total
