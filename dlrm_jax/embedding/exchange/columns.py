"""Traced helpers the exchange's forms share for the plan's static column layouts: reading a
group's columns, and summing slots into segments in a fixed order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dlrm_jax.embedding.plan.layout import is_identity


def take_columns(x, index: np.ndarray):
    """``x[:, index]`` for a static ``index`` ([V] or [V, W]): the columns a group reads or
    fills. When ``index`` is every column in order (one group holding every table), a reshape:
    XLA keeps even an identity gather and fuses it into each consumer, where it costs an index
    computation per element (13% of the one-device c1 step)."""
    if index.size == x.shape[1] and is_identity(index):
        return x.reshape(x.shape[0], *index.shape, *x.shape[2:])
    return x[:, index]


def segment_sum_axis1(x: jax.Array, segments: np.ndarray, num: int) -> jax.Array:
    """Sum x [B, V, ...] over axis 1 into ``num`` segments given by the static ``segments`` [V].

    The slots are put in segment order (statically) and each segment's slice is reduced: a
    fixed summation order. ``jax.ops.segment_sum`` would be a scatter-add, whose atomics on a
    GPU add a bag's ids in any order (the pooled vectors would differ between runs)."""
    order = np.argsort(segments, kind="stable")
    x = take_columns(x, order)
    bounds = np.searchsorted(segments[order], np.arange(num + 1))
    return jnp.stack([jnp.sum(x[:, a:b], axis=1) for a, b in zip(bounds[:-1], bounds[1:], strict=True)], axis=1)
