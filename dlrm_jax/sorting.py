"""A stable sort of non-negative int32 (or any uint32) keys that also gives the order: the one
sort the exchange's bucketing and the sparse update run over a batch's lookups, and the id
maps' routing of a batch's distinct ids to their owners (a layer below both).

When a key and its position fit in 32 bits together (key < ``bound`` and n positions), they are
packed into one uint32 (key in the high bits, position in the low) and sorted alone: the packed
values are distinct, so the sort is stable by construction, and a lone array sorts several
times faster than keys with a payload (XLA:CPU's comparator sort of two operands took about
0.8 us a lookup on 8 simulated devices; GPUs sort keys alone faster too).

Larger keys on CPU are sorted a digit at a time, least significant first, each digit packed
with the place it holds in the order so far (a radix sort whose passes are such lone sorts):
two passes of 26,624 keys below 2^18 took 2.7 ms on one CPU device against 7.3 ms for the keys
with their positions as a payload (the exchange's bucketing of the dynamic step on 8 simulated
devices had taken 36 ms a device as a sort of three arrays). Other platforms sort the keys with their positions as a payload in one
sort (XLA:GPU gives a sort of a key and one payload to a radix sort of its own).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

# Fewer key bits than this a pass, and the passes (each a sort and two gathers) cost more than
# one sort with a payload.
_LEAST_DIGIT = 8


def packs(bound: int, n: int) -> bool:
    """Whether keys below ``bound`` and ``n`` positions fit in 32 bits together."""
    return bound * (1 << _position_bits(n)) <= 1 << 32


def _position_bits(n: int) -> int:
    return max(n - 1, 1).bit_length()


def sort_with_order(key: jax.Array, bound: int) -> tuple[jax.Array, jax.Array]:
    """(the keys sorted, as ``key``; the positions in that order, int32 [n]): a stable sort of
    ``key`` (int32 or uint32 [n], every value in [0, ``bound``); ``bound`` at most 2^32)."""
    n = key.shape[0]
    shift = _position_bits(n)
    if packs(bound, n):
        position = lax.iota(jnp.uint32, n)
        packed = jnp.sort((key.astype(jnp.uint32) << shift) | position)
        return (packed >> shift).astype(key.dtype), (packed & jnp.uint32((1 << shift) - 1)).astype(jnp.int32)
    if 32 - shift < _LEAST_DIGIT:
        return sort_with_payload(key)
    by_digits = functools.partial(_by_digits, bits=max(bound - 1, 1).bit_length(), shift=shift)
    return lax.platform_dependent(key, cpu=by_digits, default=sort_with_payload)


def sort_with_payload(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`sort_with_order` as one sort of the keys with their positions as a payload."""
    return tuple(lax.sort((key, lax.iota(jnp.int32, key.shape[0])), num_keys=1, is_stable=True))


def _by_digits(key: jax.Array, bits: int, shift: int) -> tuple[jax.Array, jax.Array]:
    """A least-significant-digit radix sort of ``key`` (values below 2^``bits``) whose passes
    sort one uint32 each: a digit of ``32 - shift`` bits above the place each key holds in the
    order of the passes before (so each pass is stable, and the whole is)."""
    n = key.shape[0]
    digit = 32 - shift
    place = lax.iota(jnp.uint32, n)
    order = None
    for low in range(0, bits, digit):
        k = key if order is None else key[order]
        d = (k.astype(jnp.uint32) >> low) & jnp.uint32((1 << digit) - 1)
        taken = (jnp.sort((d << shift) | place) & jnp.uint32((1 << shift) - 1)).astype(jnp.int32)
        order = taken if order is None else order[taken]
    return key[order], order


def first_places(sorted_key: jax.Array, count: int) -> jax.Array:
    """int32 [count]: where each key 0..count-1 first is (or would be) in ``sorted_key`` (int32
    [n], ascending): every key compared with every query in one operation, where a binary search
    loops about log2(n) times over three or four (count is small: the devices and one)."""
    return jnp.searchsorted(sorted_key, lax.iota(sorted_key.dtype, count), method="compare_all").astype(jnp.int32)
