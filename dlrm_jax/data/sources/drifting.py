"""A synthetic stream whose ids are born, fade and age out, in time order, with its ground
truth: the data dynamic tables are judged on (issue 49; ``dlrm-jax bench stream``).

Each categorical feature's ids come in cohorts: window t gives birth to ``born_per_window``
new ids per feature. A sample's id for a feature picks a cohort by age, the newest most
likely (each window older halves a cohort's share, ``fade``), cohorts older than ``lifetime``
windows never appear again, and within a cohort a Zipf rank picks the id (a few ids popular,
most rare). Ids are raw 64-bit values (a hash of feature, cohort and rank): nothing about an id
tells a table its row. So over the run the distinct ids grow with the windows while the ids
alive at any time stay about ``features * lifetime * born_per_window``.

The label is drawn from a known model: logit = bias + the dense features' linear term + each
id's own effect (a normal draw from a hash of the id), so every sample carries its true
probability ``p`` and the best possible AUC of a window is the AUC of ``p`` (its ground truth).
Every window is a pure function of (seed, window): windows can be made in any order, on any
process, and are the same each time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from dlrm_jax.hashing import mix64

_FEATURE_BITS, _COHORT_BITS = 8, 24  # raw id: hash of (feature, cohort, rank), ranks below 2**32


class StreamWindow(NamedTuple):
    """One window of the stream, in the order it was written: dense float32 [n, num_dense],
    ids uint64 [n, features] (raw), labels float32 [n], p float32 [n] (the true probability;
    None for real data)."""

    dense: np.ndarray
    ids: np.ndarray
    labels: np.ndarray
    p: np.ndarray | None


@dataclass(frozen=True)
class DriftingStream:
    """The stream's shape and drift. ``windows`` of ``window_samples`` samples; per feature
    ``born_per_window`` new ids each window, seen for ``lifetime`` windows, each window older
    keeping ``fade`` of its cohort's share; ``zipf``: popularity skew within a cohort;
    ``effect_scale``: the spread of the ids' true effects (a larger one: ids matter more)."""

    features: int = 8
    num_dense: int = 4
    windows: int = 12
    window_samples: int = 65_536
    born_per_window: int = 20_000
    lifetime: int = 4
    fade: float = 0.5
    zipf: float = 1.15
    effect_scale: float = 0.8
    bias: float = -1.0
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.features < 2**_FEATURE_BITS:
            raise ValueError(f"features={self.features}: between 1 and {2**_FEATURE_BITS - 1}")
        if self.windows >= 2**_COHORT_BITS or self.lifetime < 1 or not 0 < self.fade <= 1:
            raise ValueError("windows below 2**24, lifetime at least 1, fade in (0, 1]")

    def raw_id(self, feature, cohort, rank) -> np.ndarray:
        """The raw id of rank ``rank`` of ``feature``'s cohort ``cohort`` (uint64)."""
        f, c, r = (np.asarray(x, np.uint64) for x in (feature, cohort, rank))
        packed = (f << np.uint64(64 - _FEATURE_BITS)) | (c << np.uint64(32)) | r
        return mix64(packed ^ np.uint64(self.seed * 0x9E3779B97F4A7C15 % 2**64))

    def effect(self, ids: np.ndarray) -> np.ndarray:
        """Each id's true effect on the logit: a normal draw from a hash of it (float64)."""
        h = mix64(ids ^ np.uint64(0xD1B54A32D192ED03))
        u1 = ((h >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0**53
        u2 = ((mix64(h) >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0**53
        return self.effect_scale * np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)

    def _weights(self) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 2**31])
        return rng.normal(0.0, 0.5, self.num_dense)

    def window(self, t: int) -> StreamWindow:
        """Window ``t`` (0-based): its samples in the order written."""
        if not 0 <= t < self.windows:
            raise IndexError(f"window {t} of {self.windows}")
        n, rng = self.window_samples, np.random.default_rng([self.seed, t])
        ages = np.arange(min(self.lifetime, t + 1))
        share = self.fade**ages / np.sum(self.fade**ages)
        age = rng.choice(len(ages), size=(n, self.features), p=share)
        rank = _zipf_ranks(rng, self.zipf, self.born_per_window, (n, self.features))
        ids = self.raw_id(np.arange(self.features)[None, :], t - age, rank)
        dense = rng.normal(size=(n, self.num_dense)).astype(np.float32)
        logit = self.bias + dense.astype(np.float64) @ self._weights() + self.effect(ids).sum(axis=1)
        p = 1.0 / (1.0 + np.exp(-logit))
        labels = (rng.random(n) < p).astype(np.float32)
        return StreamWindow(dense, ids, labels, p.astype(np.float32))


def _zipf_ranks(rng: np.random.Generator, s: float, n: int, shape) -> np.ndarray:
    """Ranks in [0, n) with P(rank k) proportional to 1 / (k + 1)**s (inverse transform)."""
    cdf = np.cumsum(1.0 / np.arange(1, n + 1) ** s)
    return np.searchsorted(cdf, rng.random(shape) * cdf[-1], side="right").astype(np.uint64)
