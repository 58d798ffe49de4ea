"""Sums of gradients by row: the plain scatter-add, or an exact one that no order can change.

On a GPU, ``jax.ops.segment_sum`` is a scatter-add done with float atomics: duplicates of one
row are added in whatever order the threads arrive, so two runs from the same seed drift apart
in the last bits and then further. XLA's own remedy (``--xla_gpu_exclude_nondeterministic_ops``
or ``--xla_gpu_deterministic_ops``) sorts and scans every scatter; measured on one H100 it makes
the MLPerf-shaped step 50x slower (BENCHMARKS.md).

:func:`exact_segment_sum` keeps the fast atomic scatter and makes its result independent of the
order instead. Each segment gets a power-of-two scale from its largest magnitude and its
count, chosen so that every scaled addend splits into two integers (a high part and the
rounded remainder) whose sums stay below 2**24 in magnitude: float32 adds such integers
exactly, and exact addition is associative. Both parts travel in one scatter. What is lost is
the remainder's rounding: about 2**-(46 - 2 log2(count)) of the largest addend, far less than a
float32 summation loses, and nothing for a segment with one addend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Sums of `count` integers stay under 2**24, the exact-integer range of float32: a lone addend
# is scaled to at most 2**24 (kept whole); with `count` >= 2 each high part is at most
# 2**23 / 2**ceil(log2 count) and each remainder part 2**(22 - ceil(log2 count)), plus 1/2 each
# from rounding.
MAX_EXACT_ADDENDS = (1 << 24) - 1


def exact_segment_sum(
    data: jax.Array, segment_ids: jax.Array, num_segments: int, indices_are_sorted: bool = False
) -> jax.Array:
    """``segment_sum(data [n, ...], segment_ids [n], num_segments)`` in float32, bit-identical
    for any order of the addends (so any order of a GPU's atomics).

    Each segment has one scale for all its element positions (one per row of gradients: cheap
    to find and to apply). With ``2**e`` bounding the segment's largest magnitude and
    ``k = ceil(log2(count))``, the sum is off the exact one by at most ``count * 2**(e - 47 +
    2k)`` before its final rounding to float32; a segment with one addend keeps every element
    within ``2**-23`` of its largest exactly. Ids outside ``[0, num_segments)`` are dropped, as
    by ``jax.ops.segment_sum``.
    """
    n = data.shape[0]
    if n > MAX_EXACT_ADDENDS:
        raise ValueError(f"exact_segment_sum: {n} addends exceed the {MAX_EXACT_ADDENDS} it can sum exactly")
    data = data.astype(jnp.float32)
    addend_max = jnp.max(jnp.abs(data.reshape(n, -1)), axis=1)
    # Maxima and integer counts come out the same in any order, so the scales do too.
    seg_max = jax.ops.segment_max(addend_max, segment_ids, num_segments, indices_are_sorted=indices_are_sorted)
    count = jax.ops.segment_sum(
        jnp.ones(n, jnp.int32), segment_ids, num_segments, indices_are_sorted=indices_are_sorted
    )
    ceil_log2_count = 32 - jax.lax.clz(jnp.maximum(count, 1) - 1)
    remainder_bits = 23 - ceil_log2_count
    _, max_exponent = jnp.frexp(jnp.maximum(seg_max, 0.0))  # |x| < 2**max_exponent
    shift = 24 - max_exponent - ceil_log2_count - (count > 1)
    safe_ids = jnp.clip(segment_ids, 0, num_segments - 1)  # out-of-range ids are dropped below
    per_addend = (n,) + (1,) * (data.ndim - 1)
    scaled = jnp.ldexp(data, shift[safe_ids].reshape(per_addend))
    high = jnp.round(scaled)
    low = jnp.round(jnp.ldexp(scaled - high, remainder_bits[safe_ids].reshape(per_addend)))  # exact difference
    sums = jax.ops.segment_sum(
        jnp.stack([high, low], axis=1), segment_ids, num_segments, indices_are_sorted=indices_are_sorted
    )
    per_segment = (num_segments,) + (1,) * (data.ndim - 1)
    return jnp.ldexp(sums[:, 0], -shift.reshape(per_segment)) + jnp.ldexp(
        sums[:, 1], -(shift + remainder_bits).reshape(per_segment)
    )


def segment_sum(
    data: jax.Array, segment_ids: jax.Array, num_segments: int, exact: bool, indices_are_sorted: bool = False
) -> jax.Array:
    """Gradient sums by segment in float32: :func:`exact_segment_sum` or the plain scatter-add
    (``indices_are_sorted``: the ids are non-decreasing, a promise XLA may use)."""
    if exact:
        return exact_segment_sum(data, segment_ids, num_segments, indices_are_sorted)
    return jax.ops.segment_sum(
        data.astype(jnp.float32), segment_ids, num_segments, indices_are_sorted=indices_are_sorted
    )
