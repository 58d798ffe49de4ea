"""The parallel driver every ``dlrm-jax preprocess`` runs: parse, count, assign ids, shuffle,
write shards; the output bytes do not depend on the number of workers.

A format supplies a picklable *parser* (:class:`~dlrm_jax.data.preprocessing.criteo_preprocess.CriteoParser`,
:class:`~dlrm_jax.data.preprocessing.tabular.TabularParser`): ``tasks(paths)`` cuts the input into units of
work and ``parse(task, log)`` turns one into :class:`~dlrm_jax.data.preprocessing.preprocess.Chunk` s. Four
phases follow, each a pool of worker processes (``workers=1`` runs them in this process):

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
import multiprocessing
import os
import shutil
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from dlrm_jax.data import shards
from dlrm_jax.data.preprocessing.multihot import MultiHotRule
from dlrm_jax.data.preprocessing.prep_split import PartSplit, keys_file, plan_split, time_keys
from dlrm_jax.data.preprocessing.preprocess import PreprocessReport, SkipLog, Vocabulary, byte_progress
from dlrm_jax.data.shuffle import KeyedPermutation
from dlrm_jax.stopping import die_with_parent

_BUCKET_ENTRIES = 1 << 25  # distinct-value entries merged at once per feature (memory bound)
_EXAMPLES = 10


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
    skip_bad_lines: bool = False
    progress: bool = True


@dataclass
class _TaskLog(SkipLog):
    """A worker's bad lines, with line numbers counted from its task's first line."""

    skip: bool = True
    lines: list[tuple[int, str, str]] = field(default_factory=list)

    def record(self, path: str, lineno: int, bad) -> None:
        self.by_reason[bad.kind] += 1
        if len(self.lines) < _EXAMPLES:
            self.lines.append((lineno, bad.kind, bad.message))


# ---------------------------------------------------------------- workers


@contextmanager
def _pool(workers: int) -> Iterator[Callable]:
    """``map(fn, *iterables)`` over worker processes, results in order (in-process for 1)."""
    if workers <= 1:
        yield map
        return
    method = "forkserver" if "jax" in sys.modules else "fork"  # never fork a started runtime
    with ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context(method), initializer=die_with_parent, initargs=(signal.SIGKILL,)
    ) as ex:  # none outlives us
        try:
            yield lambda fn, *its: ex.map(fn, *its, chunksize=1)
        except BaseException:
            ex.shutdown(wait=True, cancel_futures=True)
            raise


def _part_file(work: Path, part: str, name: str) -> Path:
    return work / f"{part}.{name}.npy"


def _scan(parser, task, task_id: int, work: Path, max_ind_range: int, strict: bool) -> dict:
    """Phase 1 for one task: its parts saved under ``work``; what was read and skipped."""
    log, parts, lines = _TaskLog(), [], 0
    for k, chunk in enumerate(parser.parse(task, log)):
        lines += chunk.lines
        if strict and log.lines:
            break
        part = f"p{task_id:06d}_{k:04d}"
        values = chunk.values % np.uint64(max_ind_range) if max_ind_range else chunk.values
        codes, dicts = _encode(values, None if max_ind_range else chunk.empty)
        for name, a in (("dense", chunk.dense), ("labels", chunk.labels), ("codes", codes)):
            np.save(_part_file(work, part, name), a)
        if chunk.order is not None:  # a split by time: sortable keys, and sorted for the search
            keys = time_keys(chunk.order)
            np.save(keys_file(work, part), keys)
            np.save(keys_file(work, part, sorted_=True), np.sort(keys))
        np.savez(work / f"{part}.dict.npz", **dicts)
        parts.append((part, len(chunk.labels)))
    return {
        "parts": parts,
        "lines": lines,
        "by_reason": dict(log.by_reason),
        "bad": log.lines,
        "extra": getattr(parser, "take_extra", dict)(),
    }


def _encode(values: np.ndarray, empty: np.ndarray | None) -> tuple[np.ndarray, dict]:
    """int32 [n, F] codes into each feature's sorted distinct values (-1 where ``empty``),
    and those values (``v{f}``) with their counts (``c{f}``)."""
    codes, dicts = np.full(values.shape, -1, np.int32), {}
    for f in range(values.shape[1]):
        rows = slice(None) if empty is None else ~empty[:, f]
        enc = pa.array(values[rows, f], pa.uint64()).dictionary_encode()
        distinct, index = enc.dictionary.to_numpy(), enc.indices.to_numpy()
        order = np.argsort(distinct, kind="stable")
        rank = np.empty_like(order, dtype=np.int32)
        rank[order] = np.arange(len(order), dtype=np.int32)
        codes[rows, f] = rank[index]
        dicts[f"v{f}"] = distinct[order]
        dicts[f"c{f}"] = np.bincount(index, minlength=len(distinct))[order].astype(np.int64)
    return codes, dicts


def _train_counts(part: str, split: PartSplit, work: Path, features: int) -> str:
    """Before phase 2, for a part holding val rows (``vocab_from="train"``): the counts of its
    distinct values over its train rows only, saved beside its dictionary; returns the file."""
    codes, dicts = np.load(_part_file(work, part, "codes")), np.load(work / f"{part}.dict.npz")
    train, counts = ~split.val_mask(work, part), {}
    for f in range(features):
        c = codes[train, f]
        counts[f"c{f}"] = np.bincount(c[c >= 0], minlength=len(dicts[f"v{f}"])).astype(np.int64)
    np.savez(work / f"{part}.train.npz", **counts)
    return f"{part}.train.npz"


def _merge_feature(
    f: int, parts: Sequence[str], count_files: Sequence[str], work: Path, out: Path, opts: Options, rows: int
) -> int:
    """Phase 2 for feature f: its ids (work/sorted_f: distinct values ascending, work/idof_f:
    the id of each), the vocabulary file (in ``out``) and its id histogram (work/hist_f);
    returns the table's rows. ``count_files``: per part, the file of its values' counts (c{f})
    over the counted rows, ``rows`` of them (id 0's count in vocabulary mode)."""
    dicts = [np.load(work / f"{p}.dict.npz") for p in parts]
    counted = [
        d if c == f"{p}.dict.npz" else np.load(work / c) for p, d, c in zip(parts, dicts, count_files, strict=True)
    ]
    values = [d[f"v{f}"] for d in dicts]
    total = sum(len(v) for v in values)
    samples = np.sort(np.concatenate([v[:: max(1, len(v) // 64)] for v in values] or [[]]).astype(np.uint64))
    buckets = -(-total // _BUCKET_ENTRIES)
    cuts = samples[(np.arange(1, buckets) * len(samples)) // buckets] if buckets > 1 else samples[:0]
    edges = [[0, *np.searchsorted(v, cuts).tolist(), len(v)] for v in values]
    distinct, counts = [], []
    for b in range(len(cuts) + 1):
        vals = np.concatenate([v[e[b] : e[b + 1]] for v, e in zip(values, edges, strict=True)] or [[]])
        cnts = np.concatenate([d[f"c{f}"][e[b] : e[b + 1]] for d, e in zip(counted, edges, strict=True)] or [[]])
        u, inverse = np.unique(vals.astype(np.uint64), return_inverse=True)
        distinct.append(u)
        counts.append(np.bincount(inverse, weights=cnts, minlength=len(u)).astype(np.int64))
    values_v, counts_v = np.concatenate(distinct), np.concatenate(counts)
    if opts.max_ind_range:  # compaction: id = rank of the hashed value
        id_of, kept = _compact(values_v, counts_v, opts.vocab_from == "train")
        size, hist_ids, hist_counts = len(kept), np.arange(len(kept), dtype=np.int64), kept[:, 1].astype(np.int64)
    else:
        vocab = Vocabulary(values_v, counts_v, opts.min_count)
        id_of, kept, size = vocab.id_of[:-1], vocab.kept, vocab.size
        hist_ids = np.arange(size, dtype=np.int64)
        missing = rows - int(vocab.kept[:, 1].sum()) - vocab.oov_count
        hist_counts = np.concatenate([[missing, vocab.oov_count], vocab.kept[:, 1].astype(np.int64)])
    np.save(work / f"sorted_{f}.npy", values_v)
    np.save(work / f"idof_{f}.npy", id_of)
    np.save(out / "vocab" / f"feature_{f}.npy", kept)
    top = np.sort(np.argsort(-hist_counts, kind="stable")[: shards.HISTOGRAM_IDS])
    np.savez(work / f"hist_{f}.npz", ids=hist_ids[top], counts=hist_counts[top])
    return int(max(size, 1))


def _compact(values_v: np.ndarray, counts_v: np.ndarray, counted_only: bool) -> tuple[np.ndarray, np.ndarray]:
    """Hashing mode: int32 [V] the id of each distinct hashed value (ascending), and uint64
    [K, 2] (value, count) of each id. ``counted_only``: values of count 0 (seen only in val
    rows) share one row of their own, the last (not hashed value 0's, which missing values
    take: a value the training never saw is not a missing one)."""
    seen = counts_v > 0 if counted_only else np.ones(len(values_v), bool)
    kept = np.stack([values_v[seen], counts_v[seen].astype(np.uint64)], 1)
    unseen_row = len(kept)  # the out-of-vocabulary row, when any value needs it
    id_of = np.where(seen, np.cumsum(seen) - 1, unseen_row).astype(np.int32)
    if seen.all():
        return id_of, kept
    return id_of, np.concatenate([kept, np.zeros((1, 2), np.uint64)])


@dataclass(frozen=True)
class _Placement:
    """Where the rows of the split go: shard sizes and the shuffle of the train split."""

    n_train: int
    n_val: int
    shard_rows: int
    shuffle_seed: int | None

    def shards(self, split: int) -> list[int]:
        n = (self.n_train, self.n_val)[split]
        return [min(self.shard_rows, n - s) for s in range(0, n, self.shard_rows)]


def _place(part: str, split: PartSplit, work: Path, opts: Options, where: _Placement, features: int) -> np.ndarray:
    """Phase 3 for one part (``split``: which of its rows are val, and the rows before it):
    ids, then the rows sorted by (split, shard) with their positions; returns int64
    [2, shards] counts."""
    codes = np.load(_part_file(work, part, "codes"))
    dicts = np.load(work / f"{part}.dict.npz")
    ids = np.empty(codes.shape, np.int32)
    for f in range(features):
        sorted_f = np.load(work / f"sorted_{f}.npy", mmap_mode="r")
        id_of = np.load(work / f"idof_{f}.npy", mmap_mode="r")
        local = np.append(id_of[np.searchsorted(sorted_f, dicts[f"v{f}"])], 0)  # -1 (empty): id 0
        ids[:, f] = local[codes[:, f]]
    if opts.multi_hot:  # the rule's tables were drawn once, and are shared through the page cache
        ids = MultiHotRule.load(work / "multihot").expand(ids)
    val = split.val_mask(work, part)
    pos, train = split.places(val), ~val  # each row's rank in its split, in input order
    if where.shuffle_seed is not None and train.any():
        pos[train] = KeyedPermutation(where.n_train, [where.shuffle_seed, 1])(pos[train])
    per_split = max(len(where.shards(0)), len(where.shards(1)), 1)
    shard, within = np.divmod(pos, where.shard_rows)
    key = (~train) * per_split + shard  # (split, shard), row-major
    small = np.uint16 if 2 * per_split <= 1 << 16 else np.int64  # 16 bits: a radix sort
    order = np.argsort(key.astype(small), kind="stable")
    arrays = {
        "dense": np.load(_part_file(work, part, "dense")),
        "ids": ids,
        "labels": np.load(_part_file(work, part, "labels")),
        "pos": within.astype(np.int32),
    }
    for name, a in arrays.items():
        np.save(_part_file(work, part, f"out_{name}"), a[order])
    for name in ("dense", "labels", "codes", "tkeys", "tkeys_sorted"):
        _part_file(work, part, name).unlink(missing_ok=True)
    (work / f"{part}.train.npz").unlink(missing_ok=True)
    return np.bincount(key, minlength=2 * per_split).reshape(2, per_split)


def _assemble(
    split: int,
    shard: int,
    rows: int,
    parts: Sequence[str],
    starts: np.ndarray,
    counts: np.ndarray,
    work: Path,
    root: Path,
) -> None:
    """Phase 4: shard ``shard`` of ``split`` from every part's rows for it, in place order."""
    out = None
    for p, part in enumerate(parts):
        lo, n = starts[p, split, shard], counts[p, split, shard]
        if not n:
            continue
        got = {
            k: np.load(_part_file(work, part, f"out_{k}"), mmap_mode="r")[lo : lo + n]
            for k in ("dense", "ids", "labels", "pos")
        }
        if out is None:
            out = {k: np.empty((rows, *v.shape[1:]), v.dtype) for k, v in got.items() if k != "pos"}
        at = got["pos"]  # the row's place in its shard
        for k in out:
            out[k][at] = got[k]
    shards.write_shard(root / shards.SPLITS[split] / shards.shard_name(shard), out)


# ---------------------------------------------------------------- the driver


def write_dataset(
    parser,
    inputs: Sequence[str],
    output: str | Path,
    opts: Options,
    val_inputs: Sequence[str] = (),
    meta: Callable[[dict], dict] = lambda extra: {},
) -> PreprocessReport:
    """Preprocess ``inputs`` (and ``val_inputs``, whole files for the val split) with
    ``parser`` into the sharded layout of :mod:`dlrm_jax.data.shards` at ``output``. A full
    disk is one line naming the output and the space it takes (nothing is left behind); a
    validation file that is also an input (every later AUC would score training rows) is refused."""
    _check_disjoint(inputs, val_inputs)
    try:
        return _write_dataset(parser, inputs, output, opts, val_inputs, meta)
    except OSError as e:
        free = shutil.disk_usage(Path(output).resolve().parent).free
        need = 2 * sum(os.path.getsize(p) for p in [*inputs, *val_inputs] if os.path.isfile(p))
        if e.errno != errno.ENOSPC and not (" requested and " in str(e) and free < need):
            raise  # numpy's short writes carry no errno: a full disk is told by the free space
        raise OSError(
            f"{output}: no space left on device while preprocessing ({free / 2**20:,.0f} MiB free; "
            f"the shards and work files take about 2x the input, {need / 2**20:,.0f} MiB here): "
            f"free space or choose another --output; nothing was written"
        ) from None


def _check_disjoint(inputs: Sequence[str], val_inputs: Sequence[str]) -> None:
    def key(p):
        try:
            st = os.stat(p)
            return st.st_dev, st.st_ino
        except OSError:
            return str(Path(p).resolve())

    train = {key(p): p for p in inputs}
    for p in val_inputs:
        if key(p) in train:
            raise ValueError(
                f"--val-input {p}: also an --input ({train[key(p)]}): its rows would be trained on and "
                f"then scored as held out; give the validation file(s) only once, to --val-input"
            )


def _write_dataset(
    parser,
    inputs: Sequence[str],
    output: str | Path,
    opts: Options,
    val_inputs: Sequence[str],
    meta: Callable[[dict], dict],
) -> PreprocessReport:
    t0, seconds = time.perf_counter(), {}
    paths, val_paths = [str(p) for p in inputs], [str(p) for p in val_inputs]
    tasks = [(t, 0) for t in parser.tasks(paths)] + [(t, 1) for t in parser.tasks(val_paths)]
    with shards.DatasetDir(output) as out, _pool(opts.workers) as pmap:
        work = out.root / ".work"
        work.mkdir()
        results = _scan_all(pmap, parser, tasks, work, opts, paths + val_paths)
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
            for k, file in zip(
                mixed,
                pmap(
                    _train_counts,
                    [names[k] for k in mixed],
                    [plan.parts[k] for k in mixed],
                    [work] * len(mixed),
                    [F] * len(mixed),
                ),
                strict=True,
            ):
                count_files[k] = file
            counted_rows = n_train
        (out.root / "vocab").mkdir()
        cards = list(
            pmap(
                _merge_feature,
                range(F),
                [names] * F,
                [count_files] * F,
                [work] * F,
                [out.root] * F,
                [opts] * F,
                [counted_rows] * F,
            )
        )
        if opts.multi_hot:
            MultiHotRule(cards, opts.multi_hot).save(work / "multihot")
        seconds["vocabulary"] = time.perf_counter() - t0 - seconds["scan"]
        bags = tuple(opts.multi_hot) if opts.multi_hot else (1,) * parser.num_features
        row_bytes = 4 * (parser.num_dense + sum(bags) + 1)
        where = _Placement(n_train, n_val, max(1, int(opts.shard_mb * 2**20) // row_bytes), opts.shuffle_seed)
        counts = np.stack(
            list(
                pmap(
                    _place,
                    names,
                    plan.parts,
                    [work] * len(names),
                    [opts] * len(names),
                    [where] * len(names),
                    [parser.num_features] * len(names),
                )
            )
        )
        flat = counts.reshape(len(names), -1)  # a part's rows are sorted by (split, shard)
        starts = (np.cumsum(flat, axis=1) - flat).reshape(counts.shape)
        jobs = [(s, k, rows) for s in (0, 1) for k, rows in enumerate(where.shards(s))]
        for split in (0, 1):
            (out.root / shards.SPLITS[split]).mkdir()
        same = [[x] * len(jobs) for x in (names, starts, counts, work, out.root)]
        list(pmap(_assemble, *zip(*jobs, strict=True), *same))
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
                "val_fraction": 0.0 if val_paths else opts.val_fraction,
                **plan.meta(),
                "inputs": [str(Path(p).resolve()) for p in paths],
                "val_inputs": [str(Path(p).resolve()) for p in val_paths],
                "lines_read": sum(r["lines"] for r in results),
                "skipped": by_reason.total(),
                "skipped_by_reason": dict(by_reason),
                **meta(extra),
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


def _scan_all(pmap, parser, tasks, work: Path, opts: Options, paths: list[str]) -> list[dict]:
    """Phase 1 over every task, in order; the first bad line (strict mode) raises, numbered
    in its file, whatever the number of workers."""
    strict, results, lines_before = not opts.skip_bad_lines, [], Counter()
    sizes = [(t.end - t.start) if t.end >= 0 else Path(t.path).stat().st_size for t, _ in tasks]
    n = len(tasks)
    with byte_progress(paths, "scan", opts.progress) as bar:
        scanned = pmap(
            _scan, [parser] * n, [t for t, _ in tasks], range(n), [work] * n, [opts.max_ind_range] * n, [strict] * n
        )
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
    return list(found)[:_EXAMPLES]


def _sum_extra(extras: Iterable[dict]) -> dict:
    """Per-task counters a parser reports (e.g. tabular join misses), added up."""
    total: dict = {}
    for extra in extras:
        for key, counts in extra.items():
            acc = total.setdefault(key, {})
            for name, count in counts.items():
                acc[name] = acc.get(name, 0) + count
    return total


def default_workers() -> int:
    """One worker per core this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
