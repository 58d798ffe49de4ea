"""Criteo-shaped synthetic data with power-law id popularity and a learnable hidden model.

Every sample is a pure function of (seed, stream, step, position in the global batch): samples
are drawn in fixed chunks of ``CHUNK`` rows, each from its own counter-based generator, so a
process that feeds rows ``lo:hi`` of a global batch draws exactly the rows it would have seen as
part of any other split of the batch, and a resumed run sees the data an uninterrupted one saw.

Labels come from a hidden logistic model over the features: a per-id score for every table
(pseudo-random, derived by hashing the id, so even a 10M-row table costs no memory), a linear
term over the dense features and pairwise products of hidden id vectors for a few feature pairs.
Frequent ids are learnable, rare ones are mostly noise: a DLRM reaches an AUC well above 0.5.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from dlrm_jax.data.batch import PAD_ID, Batch, process_slice

CHUNK = 256
TRAIN_STREAM, EVAL_STREAM, CALIBRATION_STREAM = 0, 1, 2
_HASH_PRIME = 2654435761  # multiplier of the rank -> id permutation; prime, so coprime to rows
_LATENT = 4  # width of the hidden id vectors used by the pairwise term


class RawSamples(NamedTuple):
    """Samples before normalisation, as they would appear in a Criteo TSV line.

    counts:  int64 [n, num_dense]  raw integer features; missing ones are held in ``missing``
    missing: bool  [n, num_dense]
    ids:     int32 [n, S]          table-local ids, PAD_ID for empty bag slots
    labels:  int8  [n]
    """

    counts: np.ndarray
    missing: np.ndarray
    ids: np.ndarray
    labels: np.ndarray


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a well-mixed 64-bit hash of each element."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def _hash_normal(seed: int, feature: int, ids: np.ndarray, k: int) -> np.ndarray:
    """Standard-normal values, one per (id, k), that depend only on (seed, feature, id, k)."""
    base = (ids.astype(np.uint64) * np.uint64(_LATENT * 2 + 2) + np.uint64(2 * k)) ^ np.uint64(
        (seed * 1_000_003 + feature * 7919 + 1) & 0xFFFFFFFF
    ) << np.uint64(32)
    u1 = (mix64(base) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    u2 = (mix64(base + np.uint64(1)) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)


def zipf_ids(rng: np.random.Generator, rows: int, exponent: float, size, feature: int,
             permuted: bool = True) -> np.ndarray:
    """Ids in [0, rows) whose popularity falls off as rank**-exponent (bounded power law).

    ``permuted``: popular ranks are scattered over the table by a multiplicative permutation,
    so hot ids are not simply the first rows; otherwise the id is the rank (a frequency-ordered
    vocabulary, as ``preprocess`` makes: the hot ids are the table's first rows).
    """
    u = rng.random(size)
    if exponent == 0.0:
        rank = np.floor(u * rows)
    elif abs(exponent - 1.0) < 1e-9:
        rank = np.floor(np.power(rows + 1.0, u)) - 1.0
    else:
        a = 1.0 - exponent
        rank = np.floor(np.power((np.power(rows + 1.0, a) - 1.0) * u + 1.0, 1.0 / a)) - 1.0
    rank = np.clip(rank, 0, rows - 1).astype(np.int64)
    if not permuted:
        return rank.astype(np.int32)
    return ((rank * _HASH_PRIME + feature * 104729) % rows).astype(np.int32)


class SyntheticGenerator:
    """Draws raw Criteo-shaped samples and their labels; see the module docstring."""

    def __init__(self, *, seed: int, num_dense: int, table_rows: tuple[int, ...],
                 bag_sizes: tuple[int, ...], zipf_exponent: float, positive_rate: float,
                 id_layout: str = "permuted"):
        self.seed = seed
        self.num_dense = num_dense
        self.table_rows = tuple(table_rows)
        self.bag_sizes = tuple(bag_sizes)
        self.zipf_exponent = zipf_exponent
        self.permuted = id_layout == "permuted"
        params = np.random.default_rng([seed, 7_777])
        self._count_mu = params.uniform(0.0, 4.0, num_dense)
        self._dense_w = params.normal(0.0, 0.35, num_dense)
        self._feature_w = params.uniform(0.3, 1.0, len(table_rows))
        nf = len(table_rows)
        self._pairs = [tuple(params.choice(nf, 2, replace=False)) for _ in range(min(8, nf // 2))]
        self._bias = 0.0
        self._bias = self._calibrate(positive_rate)

    # ---------------------------------------------------------------- drawing
    def _draw_chunk(self, stream: int, step: int, chunk: int) -> tuple[RawSamples, np.ndarray]:
        rng = np.random.default_rng([self.seed, stream, step, chunk])
        n = CHUNK
        counts = np.floor(np.exp(rng.normal(self._count_mu, 1.4, (n, self.num_dense)))).astype(np.int64)
        if self.num_dense > 1:  # Criteo's second integer feature can be negative
            neg = rng.random(n) < 0.05
            counts[neg, 1] = -rng.integers(1, 4, int(neg.sum()))
        missing = rng.random((n, self.num_dense)) < 0.1
        cols = []
        for f, (rows, bag) in enumerate(zip(self.table_rows, self.bag_sizes, strict=True)):
            ids = zipf_ids(rng, rows, self.zipf_exponent, (n, bag), f, self.permuted)
            if bag > 1:  # bag lengths uniform in [0, bag]; slots past the length are padding
                length = rng.integers(0, bag + 1, n)
                ids[np.arange(bag)[None, :] >= length[:, None]] = PAD_ID
            cols.append(ids)
        ids = np.concatenate(cols, axis=1)
        logits = self._logits(counts, missing, ids)
        labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logits))).astype(np.int8)
        return RawSamples(counts, missing, ids, labels), logits

    def _logits(self, counts: np.ndarray, missing: np.ndarray, ids: np.ndarray) -> np.ndarray:
        dense = normalise_dense(counts, missing)
        logit = (dense - 1.5) @ self._dense_w + self._bias
        latents = []
        start = 0
        for f, bag in enumerate(self.bag_sizes):
            block = ids[:, start : start + bag]
            valid = block != PAD_ID
            safe = np.where(valid, block, 0)
            denom = np.maximum(valid.sum(1), 1)
            score = (_hash_normal(self.seed, f, safe, 0) * valid).sum(1) / denom
            logit = logit + self._feature_w[f] * score
            z = np.stack([(_hash_normal(self.seed, f, safe, 1 + k) * valid).sum(1) / denom
                          for k in range(_LATENT)], axis=1)
            latents.append(z)
            start += bag
        for f, g in self._pairs:
            logit = logit + 0.5 * (latents[f] * latents[g]).sum(1)
        return logit

    def _calibrate(self, positive_rate: float) -> float:
        """The bias that gives the requested click-through rate, by bisection on a sample."""
        logits = np.concatenate([self._draw_chunk(CALIBRATION_STREAM, 0, c)[1] for c in range(16)])
        lo, hi = -20.0, 20.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if np.mean(1.0 / (1.0 + np.exp(-(logits + mid)))) > positive_rate:
                hi = mid
            else:
                lo = mid
        return 0.5 * (lo + hi)

    def raw(self, stream: int, step: int, lo: int, hi: int) -> RawSamples:
        """Rows ``lo:hi`` of global batch ``step`` of ``stream``, unnormalised."""
        return self._rows(stream, step, lo, hi)[0]

    def logits(self, stream: int, step: int, lo: int, hi: int) -> np.ndarray:
        """The hidden model's logits of those rows: the labels' true log-odds, so their AUC
        is the best any model can reach on these samples."""
        return self._rows(stream, step, lo, hi)[1]

    def _rows(self, stream: int, step: int, lo: int, hi: int) -> tuple[RawSamples, np.ndarray]:
        parts = [self._draw_chunk(stream, step, c) for c in range(lo // CHUNK, -(-hi // CHUNK))]
        off = lo - (lo // CHUNK) * CHUNK
        cut = lambda arrays: np.concatenate(arrays)[off : off + hi - lo]  # noqa: E731
        return RawSamples(*map(cut, zip(*(p[0] for p in parts), strict=True))), cut([p[1] for p in parts])

    def batch(self, stream: int, step: int, lo: int, hi: int) -> Batch:
        raw = self.raw(stream, step, lo, hi)
        return Batch(normalise_dense(raw.counts, raw.missing), raw.ids, raw.labels.astype(np.float32))


def normalise_dense(counts: np.ndarray, missing: np.ndarray) -> np.ndarray:
    """DLRM's dense transform: missing -> 0, negatives clipped to 0, then log1p; float32."""
    return np.log1p(np.where(missing, 0, np.maximum(counts, 0))).astype(np.float32)


class SyntheticSource:
    """The :class:`~dlrm_jax.data.batch.DataSource` for ``data.source=synthetic``."""

    def __init__(self, cfg, process_index: int = 0, process_count: int = 1):
        self.generator = SyntheticGenerator(
            seed=cfg.train.seed, num_dense=cfg.data.num_dense, table_rows=cfg.table_rows,
            bag_sizes=cfg.bag_sizes, zipf_exponent=cfg.data.zipf_exponent,
            positive_rate=cfg.data.positive_rate, id_layout=cfg.data.id_layout,
        )
        self._rows = process_slice(cfg.train.batch_size, process_index, process_count)
        self._eval_batches = cfg.train.eval_batches or 16

    def skip_report(self) -> str:
        return ""  # generated data has no malformed lines

    def train_batch(self, step: int) -> Batch:
        return self.generator.batch(TRAIN_STREAM, step, self._rows.start, self._rows.stop)

    def eval_batches(self) -> Iterator[Batch]:
        for i in range(self._eval_batches):
            yield self.generator.batch(EVAL_STREAM, i, self._rows.start, self._rows.stop)

    def eval_logits(self) -> np.ndarray:
        """The hidden model's logits for :meth:`eval_batches`' samples, in their order."""
        return np.concatenate([self.generator.logits(EVAL_STREAM, i, self._rows.start, self._rows.stop)
                               for i in range(self._eval_batches)])
