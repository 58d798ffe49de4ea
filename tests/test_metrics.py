"""Exact AUC against a brute-force pair count, ties included; logloss."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm_jax.train.metrics import log_loss, roc_auc


def brute_auc(labels, scores):
    pos = scores[labels == 1]
    neg = scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return wins / (len(pos) * len(neg))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 6)), min_size=2, max_size=60))
def test_auc_equals_pair_count_with_ties(pairs):
    labels = np.array([p[0] for p in pairs])
    scores = np.array([p[1] for p in pairs], np.float64) / 6.0
    if labels.min() == labels.max():
        assert np.isnan(roc_auc(labels, scores))
        return
    assert abs(roc_auc(labels, scores) - brute_auc(labels, scores)) < 1e-12


def test_auc_extremes():
    y = np.array([0, 0, 1, 1])
    assert roc_auc(y, np.array([0.1, 0.2, 0.8, 0.9])) == 1.0
    assert roc_auc(y, np.array([0.9, 0.8, 0.2, 0.1])) == 0.0
    assert roc_auc(y, np.full(4, 0.5)) == 0.5


def test_log_loss():
    y = np.array([1.0, 0.0])
    p = np.array([0.8, 0.3])
    assert abs(log_loss(y, p) - (-(np.log(0.8) + np.log(0.7)) / 2)) < 1e-12
    assert np.isfinite(log_loss(y, np.array([0.0, 1.0])))  # clipped, not inf
