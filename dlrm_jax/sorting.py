"""A stable sort of non-negative int32 keys that also gives the order: the one sort the exchange's
bucketing and the sparse update run over a batch's lookups, and the id maps' routing of a
batch's distinct ids to their owners (a layer below both).

When a key and its position fit in 32 bits together (key < ``bound`` and n positions), they are
packed into one uint32 (key in the high bits, position in the low) and sorted alone: the packed
values are distinct, so the sort is stable by construction, and a lone array sorts several
times faster than keys with a payload (XLA:CPU's comparator sort of two operands took about
0.8 us a lookup on 8 simulated devices; GPUs sort keys alone faster too). Otherwise the keys
are sorted with their positions as a payload.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def packs(bound: int, n: int) -> bool:
    """Whether keys below ``bound`` and ``n`` positions fit in 32 bits together."""
    return bound * (1 << max(n - 1, 1).bit_length()) <= 1 << 32


def sort_with_order(key: jax.Array, bound: int) -> tuple[jax.Array, jax.Array]:
    """(the keys sorted, int32 [n]; the positions in that order, int32 [n]): a stable sort of
    ``key`` (int32 [n], every value in [0, ``bound``))."""
    n = key.shape[0]
    position = lax.iota(jnp.int32, n)
    if not packs(bound, n):
        return lax.sort((key, position), num_keys=1, is_stable=True)
    shift = max(n - 1, 1).bit_length()
    packed = jnp.sort((key.astype(jnp.uint32) << shift) | position.astype(jnp.uint32))
    return (packed >> shift).astype(jnp.int32), (packed & jnp.uint32((1 << shift) - 1)).astype(jnp.int32)
