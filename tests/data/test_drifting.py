"""The drifting stream (data/sources/drifting.py): windows are pure functions of (seed,
window), ids are born and age out at the rate asked, distinct ids over the run outgrow the
ids alive at once, and the labels follow the known model (its AUC bounds any model's)."""

import numpy as np
import pytest

from dlrm_jax.data.sources.drifting import DriftingStream
from dlrm_jax.observe.metrics import roc_auc

STREAM = DriftingStream(features=3, windows=8, window_samples=20_000, born_per_window=2_000, lifetime=3)


def test_a_window_is_the_same_each_time_and_seeds_differ():
    a, b = STREAM.window(5), STREAM.window(5)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    other = DriftingStream(**{**STREAM.__dict__, "seed": 1}).window(5)
    assert not np.intersect1d(a.ids, other.ids).size


def test_ids_are_born_each_window_and_age_out():
    seen, new_share, alive = set(), [], []
    for t in range(STREAM.windows):
        ids = STREAM.window(t).ids
        distinct = set(np.unique(ids).tolist())
        if t:
            new_share.append(len(distinct - seen) / len(distinct))
        seen |= distinct
        alive.append(len(distinct))
        cohorts = {k for f in range(3) for c in range(t - 2) for k in STREAM.raw_id(f, c, np.arange(50)).tolist()}
        assert not cohorts & distinct  # cohorts past their lifetime never come back
    assert 0.25 < min(new_share) and max(new_share) < 0.9, new_share  # a steady share of new ids
    assert len(seen) > 2.5 * max(alive)  # the run's ids outgrow the ids alive at once


def test_labels_follow_the_known_model():
    w = STREAM.window(4)
    assert w.ids.dtype == np.uint64 and w.dense.dtype == np.float32 and w.ids.shape == (20_000, 3)
    assert 0.15 < w.labels.mean() < 0.6
    assert abs(w.labels.mean() - w.p.mean()) < 0.02
    assert 0.7 < roc_auc(w.labels, w.p) < 0.95  # the ground truth: ids and dense features matter


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="features=300"):
        DriftingStream(features=300)
    with pytest.raises(IndexError, match="window 8 of 8"):
        STREAM.window(8)
