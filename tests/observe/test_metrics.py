"""Exact AUC against a brute-force pair count, ties included; logloss."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm_jax.observe.metrics import log_loss, log_loss_of_logits, roc_auc
from tests.helpers import examples


def brute_auc(labels, scores):
    pos = scores[labels == 1]
    neg = scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return wins / (len(pos) * len(neg))


@settings(max_examples=examples(60))
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


# ---------------------------------------------------------------- metrics.jsonl
def test_a_full_disk_leaves_no_torn_line_and_names_file_and_step(tmp_path, monkeypatch):
    import errno
    import json
    import os

    import pytest

    from dlrm_jax.observe.metrics import MetricsWriter

    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write({"event": "train", "step": 1, "loss": 0.5})
    real_write = os.write

    def half_then_full(fd, data):  # the disk fills in the middle of the line
        if len(data) > 8:
            real_write(fd, bytes(data[:8]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError, match=f"step 2's metrics to {path}: no space left on device"):
        writer.write({"event": "train", "step": 2, "loss": 0.4})
    monkeypatch.undo()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1]
    writer.write({"event": "train", "step": 2, "loss": 0.4})  # space freed: the run goes on
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_a_torn_last_line_is_dropped_with_a_warning_and_a_damaged_one_named(tmp_path):
    import json

    import pytest

    from dlrm_jax.observe.metrics import MetricsWriter

    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"event": "train", "step": s, "wall_s": float(s)}) for s in (1, 2, 3)]
    path.write_text("\n".join(good) + '\n{"event": "train", "step": 4, "lo')
    said = []
    MetricsWriter(path).truncate_after(2, said.append)
    assert path.read_text().splitlines() == good[:2]
    assert said and "metrics.jsonl:4: dropped a torn last line" in said[0]

    path.write_text(good[0] + "\n{broken\n" + good[2] + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl:2: not a JSON event"):
        MetricsWriter(path).truncate_after(3, said.append)
    assert path.read_text() == good[0] + "\n{broken\n" + good[2] + "\n"  # nothing lost


def test_scores_that_say_nothing_and_arguments_the_other_way_round_are_not_an_auc():
    """A NaN score sorted as the highest (AUC 1.0 for these 4 rows); scores given as the labels
    were read as labels (NaN, without a word); lengths that differ were an IndexError."""
    y = np.array([0, 1, 1, 0])
    assert np.isnan(roc_auc(y, np.array([0.1, np.nan, 0.8, 0.3])))
    with pytest.raises(ValueError, match=r"labels must be 0 or 1: 0.1 at index 0 \(labels first, then scores\)"):
        roc_auc(np.array([0.1, 0.9, 0.8, 0.3]), y)
    with pytest.raises(ValueError, match="labels must be 0 or 1: 0.9 at index 1"):
        log_loss(np.array([0, 0.9]), np.array([0.2, 0.3]))
    with pytest.raises(ValueError, match="4 labels and 3 scores"):
        roc_auc(y, np.array([0.1, 0.2, 0.3]))
    assert roc_auc(y.astype(bool), np.array([0.1, 0.9, 0.8, 0.3])) == 1.0


def test_log_loss_of_logits_is_the_training_loss_and_needs_no_clipping():
    y = np.array([1.0, 0.0, 1.0, 0.0])
    z = np.array([2.0, -1.0, -0.5, 0.25])
    p = 1 / (1 + np.exp(-z))
    assert abs(log_loss_of_logits(y, z) - log_loss(y, p)) < 1e-12
    # confident and right: a loss of about e^-40 each, not clipped at 1e-7; wrong: about 40
    assert log_loss_of_logits(np.array([1.0, 0.0]), np.array([40.0, -40.0])) < 1e-17
    assert abs(log_loss_of_logits(np.array([0.0]), np.array([40.0])) - 40.0) < 1e-12
    # Infinite logits (a blown-up state scored): inf where wrong, 0 where right. Before: NaN both.
    assert log_loss_of_logits(np.array([0.0, 1.0]), np.array([np.inf, 0.0])) == np.inf
    assert log_loss_of_logits(np.array([1.0, 0.0]), np.array([np.inf, 0.0])) == np.log(2) / 2
    with pytest.raises(ValueError, match="labels first, then logits"):
        log_loss_of_logits(np.array([0.5]), np.array([1.0]))
