"""Keyed permutations of ``[0, n)`` computed per element, in O(1) memory.

Both shuffles of the data path use them, so neither ever holds a permutation of the dataset:

- preprocessing's global shuffle sends train row ``g`` to position ``perm(g)`` of the shuffled
  split (:func:`dlrm_jax.data.preprocessing.prep_driver`), whatever the number of workers;
- training's block shuffle visits a process's blocks of rows in the order ``perm_e(j)`` in
  epoch ``e`` (:mod:`dlrm_jax.data.sources.binary`), so a batch is a pure function of (seed, step,
  process) and reads whole blocks.

A :class:`KeyedPermutation` is a 4-round Feistel network on the smallest even number of bits
that covers n, with cycle walking (an output >= n is permuted again until it lands in range):
a bijection of ``[0, n)`` for every key. Plain numpy on uint64; any thread may call it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dlrm_jax.hashing import mix64

_ROUNDS = 4


class KeyedPermutation:
    """A pseudo-random bijection of ``[0, n)`` chosen by ``key`` (a sequence of ints)."""

    def __init__(self, n: int, key: Sequence[int]):
        if n < 1:
            raise ValueError(f"KeyedPermutation: needs n >= 1, got {n}")
        self.n = int(n)
        half = max(1, (int(n - 1).bit_length() + 1) // 2)
        self._half, self._mask = np.uint64(half), np.uint64((1 << half) - 1)
        seed = np.uint64(0x243F6A8885A308D3)
        for k in key:  # fold the key's ints into one 64-bit seed, then one per round
            seed = mix64(np.array([seed ^ np.uint64(int(k) & (2**64 - 1))]))[0]
        self._round_keys = mix64(seed + np.arange(1, _ROUNDS + 1, dtype=np.uint64))

    def _permute_domain(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for k in self._round_keys:
            left, right = right, left ^ (mix64(right ^ k) & self._mask)
        return (left << self._half) | right

    def __call__(self, index: np.ndarray | int) -> np.ndarray:
        """int64 positions of ``index`` (int array in [0, n)) under the permutation."""
        x = np.asarray(index, dtype=np.uint64).copy()
        todo = np.arange(x.size)
        flat = x.reshape(-1)
        while todo.size:  # cycle walking: the domain is < 4n, so a few rounds at most
            flat[todo] = self._permute_domain(flat[todo])
            todo = todo[flat[todo] >= np.uint64(self.n)]
        return x.astype(np.int64)
