"""Counter-based draws for the synthetic data (:mod:`dlrm_jax.data.sources.synthetic`): 32-bit hashes
of a row's fields and quantile tables that turn them into values, written against an array
namespace ``xp`` (numpy on the host, ``jax.numpy`` in a jitted program) with integer operations
and exactly rounded float32 multiplies only, so both evaluate them bitwise alike.
"""

from __future__ import annotations

import math
from functools import lru_cache
from statistics import NormalDist

import numpy as np

from dlrm_jax.hashing import mix32

_BIN_BITS = 10
_BINS = 1 << _BIN_BITS  # K bins per quantile table (and K more inside the last one)
_FIX = 16  # the hidden logit is an integer in units of 2**-_FIX
_BYTES_MEAN, _BYTES_STD = 510, 147.8  # sum of four uniform bytes; also std of 2 * byte - 255


def _fold(*values: int) -> np.uint32:
    """A 32-bit hash of ints (the keys of seeds, streams, tables)."""
    h = np.array([0x6A09E667], np.uint32)
    for v in values:
        h = mix32(mix32(h ^ np.uint32(v & 0xFFFFFFFF)) + np.uint32(v >> 32 & 0xFFFFFFFF))
    return h[0]


def _fields(kind: int, n: int) -> np.ndarray:
    """uint32 [n]: the constants naming ``n`` fields of one kind in a row's words."""
    return mix32(np.arange(n, dtype=np.uint32) + np.uint32(kind << 24))


def _words(xp, key_n, consts: np.ndarray):
    """uint32 [m, n]: the random words of fields ``consts`` (uint32 [m]) of rows ``key_n``.
    Field-major: XLA:CPU vectorises loops over the rows, not over a few fields."""
    return mix32(consts[:, None] ^ key_n[None, :], xp)


def _byte_sum(xp, w):
    """int32: the centred sum of a word's four bytes (near-normal, std ``_BYTES_STD``)."""
    w = (w & xp.uint32(0x00FF00FF)) + ((w >> 8) & xp.uint32(0x00FF00FF))
    return ((w & xp.uint32(0xFFFF)) + (w >> 16)).astype(xp.int32) - _BYTES_MEAN


# ---------------------------------------------------------------- quantile tables


@lru_cache(maxsize=1)
def _edges() -> np.ndarray:
    """float64 [2K]: cumulative probabilities of the bin edges (K bins, K more in the last)."""
    tail = (_BINS - 1) / _BINS + np.arange(1, _BINS + 1) / _BINS**2
    return np.concatenate([np.arange(_BINS) / _BINS, tail])


def _quantile_bins(values: np.ndarray, top: int) -> np.ndarray:
    """int32 [2, 2K - 1]: each bin's lowest value and width (its values are the integers in
    [lo, lo + width)), from ``values`` (float64 [2K - 1], the quantile function at the edges
    but the last) and ``top``, the exclusive bound of the last bin. Two rows, not pairs: a
    gather of pairs is 10x slower on XLA:CPU."""
    low = np.clip(np.floor(values), -(2**31), top - 1)
    edges = np.maximum.accumulate(np.append(low, top)).astype(np.int64)
    return np.stack([edges[:-1], np.maximum(np.diff(edges), 1)]).astype(np.int32)


def _draw(xp, bins, base, w):
    """int32: one value per word ``w`` by inverse transform through the quantile tables at
    offsets ``base`` of ``bins``: the top bits pick the bin (the next ones a sub-bin of the
    last), the bits below the value within the bin."""
    top = (w >> (32 - _BIN_BITS)).astype(xp.int32)
    sub = ((w >> (32 - 2 * _BIN_BITS)) & xp.uint32(_BINS - 1)).astype(xp.int32)
    tail = top == _BINS - 1
    i = base + xp.where(tail, _BINS - 1 + sub, top)
    lo, width = xp.take(bins[0], i), xp.take(bins[1], i)  # jnp: mode "fill", 2x faster than [i]
    rest = xp.where(tail, w << (2 * _BIN_BITS), w << _BIN_BITS)  # the unused bits, on top
    frac = (rest >> 8).astype(xp.float32) * xp.float32(2.0**-24)  # exact
    offset = xp.floor(frac * width.astype(xp.float32)).astype(xp.int32)  # one rounding: exact
    return lo + xp.minimum(offset, width - 1)


def _draw_fields(xp, bins, base, key_n, kind: int, m: int):
    """int32 [m, n]: ``_draw`` for ``m`` fields of one kind of the rows ``key_n``, field ``j``
    from the table at offset ``base[j]`` (int32 [m]) of ``bins``."""
    return _draw(xp, bins, base[:, None], _words(xp, key_n, _fields(kind, m)))


def _zipf_bins(rows: int, exponent: float) -> np.ndarray:
    """The bounded power law: rank = floor(x) - 1, x of density ~ x**-exponent on [1, rows + 1)."""
    u = _edges()[:-1]
    if exponent == 0.0:
        return _quantile_bins(u * rows, rows)
    if abs(exponent - 1.0) < 1e-9:
        return _quantile_bins(np.power(rows + 1.0, u) - 1.0, rows)
    a = 1.0 - exponent
    return _quantile_bins(np.power((np.power(rows + 1.0, a) - 1.0) * u + 1.0, 1.0 / a) - 1.0, rows)


@lru_cache(maxsize=1)
def _normal_edges() -> np.ndarray:
    """float64 [2K]: standard-normal quantiles of the edges, the open ends cut at 2**-26."""
    return np.array([NormalDist().inv_cdf(float(p)) for p in np.clip(_edges(), 2**-26, 1 - 2**-26)])


def _count_bins(mu: float) -> np.ndarray:
    """floor(exp(N(mu, 1.4)))."""
    counts = np.exp(mu + 1.4 * _normal_edges())
    return _quantile_bins(counts[:-1], int(counts[-1]) + 1)


def _noise_bins() -> np.ndarray:
    """Standard logistic noise in units of 2**-_FIX: P(noise > -l) = sigmoid(l)."""
    p = np.clip(_edges(), 2**-26, 1 - 2**-26)
    fixed = np.log(p / (1 - p)) * 2.0**_FIX
    return _quantile_bins(fixed[:-1], int(fixed[-1]) + 1)


def _permutation(rows: int, feature: int) -> tuple[int, int]:
    """(mult, shift) of the bijection id = (rank * mult + shift) % rows that scatters popular
    ranks over a table; rank * mult + shift < 2**32, and < 2**24 for tables under 800 rows."""
    mult = max(1, min((2**32 - rows) // max(rows - 1, 1), int(rows * 0.6180339887)))
    while math.gcd(mult, rows) != 1:
        mult -= 1
    return mult, feature * 104729 % rows


def _permute(xp, rank, mult, shift, rows, inv_rows):
    """int32: (rank * mult + shift) % rows without an integer division (scalar on CPUs): the
    float32 quotient is off by at most one (x / rows errs by < 800 / rows, and below 800 rows
    x < 2**24 is exact) and the integer remainder corrects it: exact below 2**30 rows."""
    x = rank.astype(xp.uint32) * mult + shift
    q = xp.floor(x.astype(xp.float32) * inv_rows).astype(xp.uint32)
    r, n = (x - q * rows).astype(xp.int32), rows.astype(xp.int32)
    r = xp.where(r < 0, r + n, r)
    return xp.where(r >= n, r - n, r)


def zipf_ids(
    rng: np.random.Generator, rows: int, exponent: float, size, feature: int, permuted: bool = True
) -> np.ndarray:
    """Ids in [0, rows) whose popularity falls off as rank**-exponent, drawn as the generator
    draws them from ``rng``'s words: the hot ids scattered over the table (``permuted``) or the
    first rows (a frequency-ordered vocabulary, as ``preprocess`` makes)."""
    words = rng.integers(0, 2**32, size, dtype=np.uint32)
    rank = _draw(np, _zipf_bins(rows, exponent), 0, words)
    if not permuted:
        return rank
    mult, shift = np.uint32(_permutation(rows, feature))
    return _permute(np, rank, mult, shift, np.uint32(rows), np.float32(1 / rows))
