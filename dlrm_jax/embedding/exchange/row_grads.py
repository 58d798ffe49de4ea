"""A batch's gradient by table row, summed in a fixed order straight from the pooled gradients.

A lookup reads one row into one pooled vector with one weight, so its gradient is that vector's
gradient times the weight. Forming that row per lookup (14M rows of 128 floats a step for
DLRM-DCNv2) and adding duplicates with a scatter (float atomics on a GPU: contended, and in
any order) costs more than the model's MLPs. Instead the lookups are described by
:class:`Lookups` (row, source vector, weight), sorted by row once (stable: ties keep the
lookups' order), and each distinct row's gradient is the sum of its lookups' sources in that
order: the same bits on every run. The optimizer then touches each distinct row once (scatters
with ``unique_indices``: no two writes to one row, so no atomics into a table or its state).

:func:`sum_by_row` is the XLA form (the CPU path and the reference); the fused GPU kernel
(``row_update_kernel``) computes the same sums inside the optimizer's update. An exchange
buffer's sums (:func:`buffer_row_sums`) skip the sort on CPU, where a scatter-add already adds
in the lookups' order.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dlrm_jax.embedding.exchange import sums
from dlrm_jax.sorting import sort_with_order


class Lookups(NamedTuple):
    """What a batch read from a table: lookup ``i`` read row ``rows[i]`` (at or past the table's
    end: padding, dropped) into the vector ``sources[i]`` of the gradients it comes with, with
    pooling weight ``weights[i]``. ``sources=None``: lookup ``i``'s gradient is row ``i`` of
    the gradients (already one per lookup, e.g. per-request sums received from an exchange);
    ``weights=None``: every weight is 1."""

    rows: jax.Array
    sources: jax.Array | None = None
    weights: jax.Array | None = None

    @classmethod
    def of(cls, lookups: Lookups | jax.Array) -> Lookups:
        """``lookups`` as :class:`Lookups` (a bare array of rows: one gradient per row)."""
        return lookups if isinstance(lookups, Lookups) else cls(lookups)

    @classmethod
    def of_bags(
        cls, rows: jax.Array, slot_vector: np.ndarray, vectors: int, weights: jax.Array | None = None
    ) -> Lookups:
        """The lookups of bags: ``rows`` [..., S] per sample (any leading axes), slot ``s``
        pooled into vector ``slot_vector[s]`` of its sample's ``vectors`` (the gradients:
        [samples * vectors, W]); ``weights`` [..., S] or None."""
        samples = rows.size // rows.shape[-1]
        sources = np.arange(samples, dtype=np.int32)[:, None] * vectors + np.asarray(slot_vector, np.int32)[None, :]
        return cls(rows.reshape(-1), jnp.asarray(sources.reshape(-1)), None if weights is None else weights.reshape(-1))


class SortedLookups(NamedTuple):
    """:class:`Lookups` sorted by row. ``rows`` [n]: the distinct rows ascending, then
    ``num_rows + position`` for the unused places (every entry distinct and sorted, so scatters
    may promise both; those past the end are dropped); ``order`` [n]: the lookups in row order;
    ``segment`` [n]: the place of the row of ``order``'s lookups (non-decreasing); ``starts``
    [n + 1]: where each place's lookups begin in ``order`` (``starts[k + 1] - starts[k]`` of
    them; 0 for unused places)."""

    rows: jax.Array
    order: jax.Array
    segment: jax.Array
    starts: jax.Array

    def inverse(self) -> jax.Array:
        """[n]: each lookup's (in its original order) place among :attr:`rows`."""
        return jnp.zeros_like(self.segment).at[self.order].set(self.segment, unique_indices=True)

    def max_by_row(self, per_lookup: jax.Array) -> jax.Array:
        """[n] per lookup -> per place in :attr:`rows`: the largest over the row's lookups
        (0 where no lookup, and never below 0)."""
        n = self.segment.shape[0]
        top = jax.ops.segment_max(per_lookup[self.order], self.segment, n, indices_are_sorted=True)
        return jnp.maximum(top, 0.0)


class RowSums(NamedTuple):
    """Each distinct row's summed gradient: ``grads`` [n, W] float32 at the places of
    ``sorted.rows``."""

    sorted: SortedLookups
    grads: jax.Array

    @property
    def rows(self) -> jax.Array:
        return self.sorted.rows

    def squares_per_lookup(self) -> jax.Array:
        """[n]: for each lookup (in its original order), its row's summed gradient squared,
        summed over the columns given."""
        return jnp.sum(self.grads * self.grads, -1)[self.sorted.inverse()]


def sort_by_row(rows: jax.Array, num_rows: int) -> SortedLookups:
    """Sort a batch's lookups by row, once: a stable sort, so a row's lookups keep their order
    and every sum over them is the same bits on every run."""
    n = rows.shape[0]
    capped = jnp.minimum(rows.astype(jnp.int32), num_rows)  # every padding row -> num_rows: one place, dropped
    position = lax.iota(jnp.int32, n)
    sorted_rows, order = sort_with_order(capped, num_rows + 1)
    first = jnp.concatenate([jnp.ones(1, bool), sorted_rows[1:] != sorted_rows[:-1]])
    segment = jnp.cumsum(first, dtype=jnp.int32) - 1
    real = first & (sorted_rows < num_rows)
    distinct = (num_rows + position).at[jnp.where(real, segment, n)].set(sorted_rows, mode="drop", unique_indices=True)
    starts = (
        jnp.full(n + 1, n, jnp.int32)
        .at[jnp.where(first, segment, n + 1)]
        .set(position, mode="drop", unique_indices=True)
    )
    return SortedLookups(distinct, order, segment, starts)


def sum_by_row(lookups: Lookups | jax.Array, grads: jax.Array, num_rows: int, exact: bool = False) -> RowSums:
    """Each distinct row's gradient: ``sum_i weights[i] * grads[sources[i]]`` over the lookups
    of that row, in their order (see the module docstring). ``exact``: the sum of
    :func:`~dlrm_jax.embedding.exchange.sums.exact_segment_sum` (the same bits in any order,
    for backends whose sums go through float atomics)."""
    lookups = Lookups.of(lookups)
    s = sort_by_row(lookups.rows, num_rows)
    addends = weighted_addends(lookups, grads, s.order)
    summed = sums.segment_sum(addends, s.segment, s.order.shape[0], exact, indices_are_sorted=True)
    return RowSums(s, summed)


def weighted_addends(lookups: Lookups, grads: jax.Array, order: jax.Array | None = None) -> jax.Array:
    """[n, W] float32: each lookup's gradient times its weight, in ``order`` (positions of the
    lookups) or as given."""
    at = lambda x: x if order is None else x[order]
    addends = (at(grads) if lookups.sources is None else grads[at(lookups.sources)]).astype(jnp.float32)
    return addends if lookups.weights is None else addends * at(lookups.weights)[:, None]


def dense_row_sums(lookups: Lookups | jax.Array, grads: jax.Array, num_rows: int, exact: bool = False) -> jax.Array:
    """[num_rows, W] float32: every row's summed gradient (0 where none), for tables small
    enough to all-reduce whole; each row written once (no scatter-add of duplicates)."""
    r = sum_by_row(lookups, grads, num_rows, exact)
    dense = jnp.zeros((num_rows, grads.shape[-1]), jnp.float32)
    return dense.at[r.rows].set(r.grads, mode="drop", unique_indices=True, indices_are_sorted=True)


def buffer_row_sums(lookups: Lookups | jax.Array, grads: jax.Array, num_rows: int, exact: bool = False) -> jax.Array:
    """:func:`dense_row_sums` of an exchange buffer's places (the gradients a device sends its
    owners): on CPU :func:`dense_sums_in_order`, the same bits without the sort. (Tables'
    dense sums, replicated and hot rows, keep the sorted form on every platform: no scatter
    with repeated indices then has a table's shape, which is how tests read a GPU's property
    from a program compiled on CPU.)"""
    return lax.platform_dependent(
        grads,
        cpu=lambda g: dense_sums_in_order(lookups, g, num_rows, exact),
        default=lambda g: dense_row_sums(lookups, g, num_rows, exact),
    )


def dense_sums_in_order(
    lookups: Lookups | jax.Array, grads: jax.Array, num_rows: int, exact: bool = False
) -> jax.Array:
    """:func:`dense_row_sums` as one scatter-add of the lookups as given. XLA:CPU adds a
    scatter's updates one after another in their order, so each row's sum is its lookups'
    in their order, the order :func:`sum_by_row`'s stable sort gives them: the same bits
    without the sort and its permutation (the dynamic step's largest sort on 8 simulated
    devices; docs/benchmarks-log.md). ``exact``: any order gives the same bits. Rows past the
    end (padding) are dropped."""
    lookups = Lookups.of(lookups)
    return sums.segment_sum(weighted_addends(lookups, grads), lookups.rows.astype(jnp.int32), num_rows, exact)
