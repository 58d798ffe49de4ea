"""The hashes the package mixes bits with, defined once: ``mix32`` (on the host and in traced
programs alike) and ``mix64`` (host numpy). Synthetic data, the keyed shuffle, tabular
preprocessing's hashed values, table initialisation and the hot-row index all build on them,
so each must give the same bits everywhere (their golden files and tests hold that)."""

from __future__ import annotations

import numpy as np


def mix32(x, xp=np):
    """Wellons' lowbias32 on uint32, written against an array namespace ``xp`` (numpy or
    ``jax.numpy``): a bijection in which every input bit moves every output bit, exact in numpy
    and in XLA."""
    x = x ^ (x >> 16)
    x = x * xp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * xp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a well-mixed 64-bit hash of each element (a new uint64 array)."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x
