"""Which rows of a preprocessed dataset are held out for validation, decided between the scan
and the vocabulary phases of :mod:`dlrm_jax.data.preprocessing.prep_driver`:

- **tail**: the last ``val_fraction`` of valid rows in input order (Criteo's days are in time
  order, so the tail is the latest);
- **files**: whole ``--val-input`` files (MLPerf's ``day_23``);
- **time**: the last ``val_fraction`` of rows by a column the schema names (``split_by``): the
  rows whose time is after a threshold T, and of the rows at T exactly the later ones in input
  order (MovieLens' ``ratings.dat`` is sorted by user, not time). T is the time of the first
  val row in (time, input order): every val row's time is >= T, every train row's <= T.

For a time split the scan saves each part's times as sortable int64 keys (:func:`time_keys`)
and their sorted copy; T is found by :func:`_kth_key` in a few rounds over the parts, each
reading every part's sorted keys once through ``mmap`` and counting 1024 candidate thresholds
(memory: a part at a time). The val rows of every split keep input order; the driver places
the train rows by their rank in input order (shuffled, or not).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import numpy as np

from dlrm_jax.data.shards import split_sizes

_CANDIDATES = 1024  # thresholds counted per round of the search
_SIGN_OFF = np.int64(0x7FFFFFFFFFFFFFFF)


class SplitKind(StrEnum):
    TAIL = "tail"
    FILES = "files"
    TIME = "time"


def time_keys(times: np.ndarray) -> np.ndarray:
    """float64 [n] finite times -> int64 [n] keys in the same order (the float's bits, with
    the magnitude bits of negative numbers flipped). :func:`key_time` inverts it."""
    bits = (np.asarray(times, np.float64) + 0.0).view(np.int64)  # + 0.0: -0.0 becomes 0.0
    return bits ^ ((bits >> 63) & _SIGN_OFF)


def key_time(key: int) -> float:
    return float(key_times(np.array([key], np.int64))[0])


def key_times(keys: np.ndarray) -> np.ndarray:
    """int64 [n] keys -> float64 [n] times (:func:`time_keys` inverted)."""
    bits = np.asarray(keys, np.int64)
    return (bits ^ ((bits >> 63) & _SIGN_OFF)).view(np.float64)


def keys_file(work: Path, part: str, sorted_: bool = False) -> Path:
    return work / f"{part}.{'tkeys_sorted' if sorted_ else 'tkeys'}.npy"


@dataclass(frozen=True)
class PartSplit:
    """Which rows of one part are val, and how many train and val rows come before it."""

    rows: int
    train_before: int
    val_before: int
    train: int  # the part's train rows: without a threshold, the first ``train`` rows
    threshold: int | None = None  # the key of time T: keys < T train, > T val
    ties_train: int = 0  # of the part's rows at T, the first ties_train (input order) are train

    def val_mask(self, work: Path, part: str) -> np.ndarray:
        """bool [rows]: the part's val rows."""
        if self.threshold is None:
            return np.arange(self.rows) >= self.train
        keys = np.load(keys_file(work, part))
        at = keys == self.threshold
        return (keys > self.threshold) | (at & (np.cumsum(at) > self.ties_train))

    def places(self, val: np.ndarray) -> np.ndarray:
        """int64 [rows]: each row's rank in its split, in input order."""
        train_rank = self.train_before + np.cumsum(~val) - 1
        return np.where(val, self.val_before + np.cumsum(val) - 1, train_rank)


@dataclass(frozen=True)
class SplitPlan:
    kind: SplitKind
    n_train: int
    n_val: int
    parts: tuple[PartSplit, ...]
    column: str | None = None  # time: the schema's split_by column
    threshold: float | None = None  # time: T
    val_fraction: float = 0.0

    def describe(self) -> str:
        """One line for the preprocess summary."""
        if self.kind is SplitKind.FILES:
            return "val split: the --val-input files"
        share = f"the last {self.val_fraction:.4g} of rows"
        if not self.val_fraction:  # (it said 'the last 0 of rows in input order')
            return "val split: none (--val-fraction 0): every row trains"
        if not self.n_val:  # said here, not first by train's refusal
            return f"val split: EMPTY: {self.val_fraction:.4g} of {self.n_train:,} rows rounds to none; give a larger --val-fraction"
        if self.kind is SplitKind.TAIL or not self.n_val:
            return f"val split: {share} in input order"
        return f"val split: {share} by {self.column} (from {self.column} {self.threshold:.17g}; ties: later lines)"

    def meta(self) -> dict:
        return {"split": self.kind.value, "split_by": self.column, "split_threshold": self.threshold}


def plan_split(
    parts: Sequence[tuple[str, int, int]], work: Path, val_fraction: float, by_files: bool, column: str | None
) -> SplitPlan:
    """The split of ``parts`` ((name, rows, 1 if from a --val-input file else 0), in input
    order): whole files with ``by_files``, else by ``column``'s times when the format has one
    (saved by the scan), else the tail."""
    rows = [n for _, n, _ in parts]
    if by_files:
        n_train = sum(n for _, n, s in parts if s == 0)
        train = [n if s == 0 else 0 for _, n, s in parts]
        return _plan(SplitKind.FILES, rows, train, n_train, sum(rows) - n_train)
    n_train, n_val = split_sizes(sum(rows), val_fraction)
    if column is None or not n_val:
        firsts = np.cumsum([0, *rows[:-1]])
        train = np.clip(n_train - firsts, 0, rows).tolist()
        kind = SplitKind.TAIL if column is None else SplitKind.TIME
        return _plan(kind, rows, train, n_train, n_val, column=column, val_fraction=val_fraction)
    names = [name for name, _, _ in parts]
    t = _kth_key([keys_file(work, p, sorted_=True) for p in names], n_train + 1)  # the first val row's
    below, at = _counts_at(t, [keys_file(work, p, sorted_=True) for p in names])
    ties_left, ties = n_train - sum(below), []
    for k in at:
        ties.append(min(k, ties_left))
        ties_left -= ties[-1]
    train = [b + k for b, k in zip(below, ties, strict=True)]
    return _plan(SplitKind.TIME, rows, train, n_train, n_val, column, t, ties, val_fraction)


def _plan(
    kind: SplitKind,
    rows: list[int],
    train: list[int],
    n_train: int,
    n_val: int,
    column=None,
    threshold: int | None = None,
    ties=None,
    val_fraction: float = 0.0,
) -> SplitPlan:
    """A plan from each part's number of train rows (the first ones when ``threshold`` is
    None)."""
    out, tb, vb = [], 0, 0
    for p, (n, k) in enumerate(zip(rows, train, strict=True)):
        out.append(PartSplit(n, tb, vb, k, threshold, ties[p] if ties else 0))
        tb, vb = tb + k, vb + n - k
    assert (tb, vb) == (n_train, n_val), (tb, vb, n_train, n_val)
    time = None if threshold is None else key_time(threshold)
    return SplitPlan(kind, n_train, n_val, tuple(out), column, time, val_fraction)


def _kth_key(files: list[Path], k: int) -> int:
    """The k-th smallest key (1-based) over the sorted ``files``: the smallest T with at
    least k keys <= T."""
    ends = [keys[[0, -1]] for keys in (np.load(f, mmap_mode="r") for f in files) if keys.size]
    lo, hi = min(int(e[0]) for e in ends), max(int(e[1]) for e in ends)
    while lo < hi:  # T in [lo, hi]; each round narrows it ~1024-fold
        step = max(1, (hi - lo) // _CANDIDATES)
        cands = np.array(sorted({*range(lo, hi, step), hi}), np.int64)
        at_most = np.zeros(len(cands), np.int64)
        for f in files:
            at_most += np.searchsorted(np.load(f, mmap_mode="r"), cands, side="right")
        j = int(np.searchsorted(at_most, k))  # the first candidate with k keys at or below it
        lo, hi = (int(cands[j - 1]) + 1 if j else lo), int(cands[j])
    return lo


def _counts_at(t: int, files: list[Path]) -> tuple[list[int], list[int]]:
    """Per file: keys < t, keys == t."""
    below, at = [], []
    for f in files:
        keys = np.load(f, mmap_mode="r")
        lo, hi = np.searchsorted(keys, t, side="left"), np.searchsorted(keys, t, side="right")
        below.append(int(lo))
        at.append(int(hi - lo))
    return below, at
