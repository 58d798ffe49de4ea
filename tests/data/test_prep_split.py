"""The val split of preprocessing (:mod:`dlrm_jax.data.preprocessing.prep_split`) against plain sorting."""

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dlrm_jax.data.preprocessing.prep_split import SplitKind, key_time, keys_file, plan_split, time_keys
from dlrm_jax.data.shards import split_sizes
from tests.helpers import examples

FLOATS = st.floats(allow_nan=False, allow_infinity=False)


@settings(max_examples=examples(50))
@given(st.lists(FLOATS, max_size=40))
@example([0.0, -0.0, 5e-324, -5e-324, 1.7e308, -1.7e308, 978300760.0])
def test_time_keys_keep_the_order_of_the_times(times):
    keys = time_keys(np.array(times, np.float64))
    order = np.argsort(np.array(times) + 0.0, kind="stable")
    assert np.argsort(keys, kind="stable").tolist() == order.tolist()
    assert [key_time(k) for k in keys.tolist()] == [t + 0.0 for t in times]


@settings(max_examples=examples(60))
@given(
    times=st.lists(st.one_of(st.integers(-3, 3).map(float), FLOATS), min_size=1, max_size=80),
    cuts=st.lists(st.integers(0, 80), max_size=5),
    val_fraction=st.floats(0.0, 0.99),
)
def test_time_split_holds_out_the_latest_rows_ties_by_input_order(times, cuts, val_fraction):
    """Whatever the parts (chunks) the rows come in: val = the last rows by (time, input
    order); each row's place is its rank in its split in input order."""
    n = len(times)
    bounds = sorted({0, n, *(c for c in cuts if c < n)})
    with tempfile.TemporaryDirectory() as tmp:
        work, parts = Path(tmp), []
        for p, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            keys = time_keys(np.array(times[lo:hi]))
            np.save(keys_file(work, f"p{p}"), keys)
            np.save(keys_file(work, f"p{p}", sorted_=True), np.sort(keys))
            parts.append((f"p{p}", hi - lo, 0))
        parts.insert(1, ("empty", 0, 0))  # a chunk whose lines were all skipped
        np.save(keys_file(work, "empty"), np.zeros(0, np.int64))
        np.save(keys_file(work, "empty", sorted_=True), np.zeros(0, np.int64))
        plan = plan_split(parts, work, val_fraction, False, "t")
        val = np.concatenate([s.val_mask(work, name) for s, (name, _, _) in zip(plan.parts, parts, strict=True)])
        places = np.concatenate(
            [
                s.places(m)
                for s, m in zip(plan.parts, np.split(val, np.cumsum([r for _, r, _ in parts])[:-1]), strict=True)
            ]
        )
    n_train, n_val = split_sizes(n, val_fraction)
    latest = sorted(range(n), key=lambda i: (times[i] + 0.0, i))[n_train:]
    assert np.flatnonzero(val).tolist() == sorted(latest)
    assert (plan.kind, plan.n_train, plan.n_val) == (SplitKind.TIME, n_train, n_val)
    assert places[~val].tolist() == list(range(n_train)) and places[val].tolist() == list(range(n_val))
    if n_val:
        assert plan.threshold == times[latest[0]] + 0.0  # the first val row's time
        assert max((times[i] for i in range(n) if not val[i]), default=-np.inf) <= plan.threshold
        assert min(times[i] for i in latest) >= plan.threshold


def test_tail_and_files_splits_follow_input_order(tmp_path):
    parts = [("a", 5, 0), ("b", 4, 0), ("c", 3, 1)]
    files = plan_split(parts, tmp_path, 0.0, True, None)
    assert (files.kind, files.n_train, files.n_val) == (SplitKind.FILES, 9, 3)
    assert [s.val_mask(tmp_path, "").sum() for s in files.parts] == [0, 0, 3]
    tail = plan_split(parts, tmp_path, 0.25, False, None)  # 12 rows: the last 3 are val
    masks = [s.val_mask(tmp_path, "") for s in tail.parts]
    assert np.concatenate(masks).tolist() == [False] * 9 + [True] * 3
    assert tail.meta() == {"split": "tail", "split_by": None, "split_threshold": None}


def test_a_val_fraction_that_rounds_to_no_rows_is_said_in_the_summary(tmp_path):
    """30 lines at --val-fraction 0.01 held out nothing without a word; train then said to use
    --val-fraction, which the user had."""
    parts = [("a", 30, 0)]
    assert plan_split(parts, tmp_path, 0.1, False, None).describe() == "val split: the last 0.1 of rows in input order"
    assert (
        plan_split(parts, tmp_path, 0.0, False, None).describe()
        == "val split: none (--val-fraction 0): every row trains"
    )
    empty = plan_split(parts, tmp_path, 0.01, False, None)
    assert empty.n_val == 0
    assert empty.describe() == "val split: EMPTY: 0.01 of 30 rows rounds to none; give a larger --val-fraction"
