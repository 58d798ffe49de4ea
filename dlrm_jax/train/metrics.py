"""Evaluation metrics computed exactly on the host, and the metrics.jsonl writer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Exact area under the ROC curve; tied scores count one half (Mann-Whitney U).

    labels: [n] in {0, 1}; scores: [n]. NaN when only one class is present.
    """
    labels = np.asarray(labels).astype(bool).ravel()
    scores = np.asarray(scores, np.float64).ravel()
    pos = int(labels.sum())
    neg = labels.size - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    # Average rank (1-based) of each run of equal scores.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], scores.size]
    avg_rank = (starts + ends + 1) / 2.0
    ranks = np.empty(scores.size)
    ranks[order] = np.repeat(avg_rank, ends - starts)
    return float((ranks[labels].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def log_loss(labels: np.ndarray, probs: np.ndarray, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities, clipped to [eps, 1 - eps]."""
    p = np.clip(np.asarray(probs, np.float64), eps, 1.0 - eps)
    y = np.asarray(labels, np.float64)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))


class MetricsWriter:
    """Appends one JSON object per event to ``metrics.jsonl`` (appending keeps resumed runs whole)."""

    def __init__(self, path: Path | None):
        self.path = path

    def truncate_after(self, step: int) -> None:
        """Drop events past ``step``: a run killed after its last checkpoint logged steps that
        the resumed run will log again."""
        if self.path is None or not self.path.exists():
            return
        lines = self.path.read_text().splitlines()
        kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
        if len(kept) != len(lines):
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(self.path)

    def write(self, event: dict) -> None:
        if self.path is None:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in event.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
