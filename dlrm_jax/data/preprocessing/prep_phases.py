"""One unit of work of each phase of :mod:`dlrm_jax.data.preprocessing.prep_driver`, run in its
worker processes: a task scanned, a feature's vocabulary merged, a part placed, a shard
assembled. The units share nothing but the work folder: each reads the files earlier phases
left there and writes its own (``{part}.{name}.npy``, ``{part}.dict.npz``, ``sorted_{f}.npy``,
``idof_{f}.npy``, ``hist_{f}.npz``), so the output does not depend on which worker ran what.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from dlrm_jax.data import shards
from dlrm_jax.data.preprocessing.multihot import MultiHotRule
from dlrm_jax.data.preprocessing.prep_split import PartSplit, key_times, keys_file, time_keys
from dlrm_jax.data.preprocessing.preprocess import SkipLog, Vocabulary
from dlrm_jax.data.shuffle import KeyedPermutation

_BUCKET_ENTRIES = 1 << 25  # distinct-value entries merged at once per feature (memory bound)
EXAMPLES = 10  # bad lines kept per task, and reported in all


@dataclass
class _TaskLog(SkipLog):
    """A worker's bad lines, with line numbers counted from its task's first line."""

    skip: bool = True
    lines: list[tuple[int, str, str]] = field(default_factory=list)

    def record(self, path: str, lineno: int, bad) -> None:
        self.by_reason[bad.kind] += 1
        if len(self.lines) < EXAMPLES:
            self.lines.append((lineno, bad.kind, bad.message))


def _part_file(work: Path, part: str, name: str) -> Path:
    return work / f"{part}.{name}.npy"


def scan_task(parser, task, task_id: int, work: Path, max_ind_range: int, strict: bool, raw_values: bool) -> dict:
    """Phase 1 for one task: its parts saved under ``work`` (``raw_values``: the values
    themselves too, 0 where missing); what was read and skipped."""
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
        if raw_values:
            np.save(_part_file(work, part, "raw"), np.where(chunk.empty, np.uint64(0), chunk.values))
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


def train_counts(part: str, split: PartSplit, work: Path, features: int) -> str:
    """Before phase 2, for a part holding val rows (``vocab_from="train"``): the counts of its
    distinct values over its train rows only, saved beside its dictionary; returns the file."""
    codes, dicts = np.load(_part_file(work, part, "codes")), np.load(work / f"{part}.dict.npz")
    train, counts = ~split.val_mask(work, part), {}
    for f in range(features):
        c = codes[train, f]
        counts[f"c{f}"] = np.bincount(c[c >= 0], minlength=len(dicts[f"v{f}"])).astype(np.int64)
    np.savez(work / f"{part}.train.npz", **counts)
    return f"{part}.train.npz"


def merge_feature(
    f: int,
    parts: Sequence[str],
    count_files: Sequence[str],
    work: Path,
    out: Path,
    max_ind_range: int,
    min_count: int,
    vocab_from: str,
    rows: int,
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
    if max_ind_range:  # compaction: id = rank of the hashed value
        id_of, kept = _compact(values_v, counts_v, vocab_from == "train")
        size, hist_ids, hist_counts = len(kept), np.arange(len(kept), dtype=np.int64), kept[:, 1].astype(np.int64)
    else:
        vocab = Vocabulary(values_v, counts_v, min_count)
        id_of, kept, size = vocab.id_of[:-1], vocab.kept, vocab.size
        hist_ids = np.arange(size, dtype=np.int64)
        missing = rows - int(vocab.kept[:, 1].sum()) - vocab.oov_count
        hist_counts = np.concatenate([[missing, vocab.oov_count], vocab.kept[:, 1].astype(np.int64)])
    np.save(work / f"sorted_{f}.npy", values_v)
    np.save(work / f"idof_{f}.npy", id_of)
    np.save(out / shards.VOCAB_DIR / f"feature_{f}.npy", kept)
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
class Placement:
    """Where the rows of the split go: shard sizes and the shuffle of the train split."""

    n_train: int
    n_val: int
    shard_rows: int
    shuffle_seed: int | None

    def shards(self, split: int) -> list[int]:
        n = (self.n_train, self.n_val)[split]
        return [min(self.shard_rows, n - s) for s in range(0, n, self.shard_rows)]


class PartWindows(NamedTuple):
    """A part's train rows by time window (``--window-seconds``): each window it has rows in
    (int64 ``floor(time / seconds)``, ascending), the input-order rank of its first row there,
    and whether its windows never go back in input order."""

    windows: np.ndarray
    first_rank: np.ndarray
    in_order: bool


def part_windows(keys: np.ndarray, ranks: np.ndarray, seconds: float) -> PartWindows:
    """The windows of train rows with time keys ``keys`` and input-order ranks ``ranks``."""
    w = np.floor(key_times(keys) / seconds).astype(np.int64)
    order = np.argsort(ranks, kind="stable")
    w, ranks = w[order], ranks[order]
    found, first = np.unique(w, return_index=True)
    return PartWindows(found, ranks[first], bool((np.diff(w) >= 0).all()))


def place_part(
    part: str,
    split: PartSplit,
    work: Path,
    multi_hot: bool,
    where: Placement,
    features: int,
    window_seconds: float = 0.0,
) -> tuple[np.ndarray, PartWindows | None]:
    """Phase 3 for one part (``split``: which of its rows are val, and the rows before it):
    ids, then the rows sorted by (split, shard) with their positions; returns int64
    [2, shards] counts, and with ``window_seconds`` its train rows' time windows."""
    codes = np.load(_part_file(work, part, "codes"))
    dicts = np.load(work / f"{part}.dict.npz")
    ids = np.empty(codes.shape, np.int32)
    for f in range(features):
        sorted_f = np.load(work / f"sorted_{f}.npy", mmap_mode="r")
        id_of = np.load(work / f"idof_{f}.npy", mmap_mode="r")
        local = np.append(id_of[np.searchsorted(sorted_f, dicts[f"v{f}"])], 0)  # -1 (empty): id 0
        ids[:, f] = local[codes[:, f]]
    if multi_hot:  # the rule's tables were drawn once, and are shared through the page cache
        ids = MultiHotRule.load(work / "multihot").expand(ids)
    val = split.val_mask(work, part)
    pos, train = split.places(val), ~val  # each row's rank in its split, in input order
    windows = None
    if window_seconds:
        windows = part_windows(np.load(keys_file(work, part))[train], pos[train], window_seconds)
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
    if _part_file(work, part, "raw").exists():
        arrays["raw"] = np.load(_part_file(work, part, "raw"))
    for name, a in arrays.items():
        np.save(_part_file(work, part, f"out_{name}"), a[order])
    for name in ("dense", "labels", "codes", "raw", "tkeys", "tkeys_sorted"):
        _part_file(work, part, name).unlink(missing_ok=True)
    (work / f"{part}.train.npz").unlink(missing_ok=True)
    return np.bincount(key, minlength=2 * per_split).reshape(2, per_split), windows


def assemble_shard(
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
        names = (
            "dense",
            "ids",
            "labels",
            "pos",
            *(k for k in shards.RAW_DTYPES if _part_file(work, part, f"out_{k}").exists()),
        )
        got = {k: np.load(_part_file(work, part, f"out_{k}"), mmap_mode="r")[lo : lo + n] for k in names}
        if out is None:
            out = {k: np.empty((rows, *v.shape[1:]), v.dtype) for k, v in got.items() if k != "pos"}
        at = got["pos"]  # the row's place in its shard
        for k in out:
            out[k][at] = got[k]
    shards.write_shard(root / shards.SPLITS[split] / shards.shard_name(shard), out)
