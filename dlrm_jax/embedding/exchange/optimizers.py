"""Sparse optimizers: pure functions that update only the rows a batch looked up.

Each takes the fused table [R, D], its state, the batch's lookups (rows ``R`` or more =
padding, dropped; see :mod:`~dlrm_jax.embedding.exchange.row_grads`) and the gradients they
point at, and returns the new table and state. No full-table gradient and no gradient row per
lookup is formed: each distinct row's gradient is summed in a fixed order and the optimizer
applied to it once, so every optimizer equals its dense counterpart applied to the summed
gradient, with the same bits on every run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dlrm_jax.embedding.exchange.row_grads import Lookups, dense_row_sums, sum_by_row


class SparseOptimizer(NamedTuple):
    """``init(table) -> state``; ``update(table, state, lookups, grads, lr) -> (table, state)``
    with ``lookups`` a :class:`~dlrm_jax.embedding.exchange.row_grads.Lookups` (or a bare [n]
    array of rows, one gradient row each) and ``grads`` the vectors it points at; ``apply``:
    the same for distinct ascending rows (or None: every row in order), each with its summed
    gradient.

    The state is a dict of arrays whose leading axis is the table's row axis, so it can be
    sharded exactly like the table. ``needs_whole_rows``: the update depends on each row's
    gradient over all its columns (row-wise Adagrad), so a column slice must be given that
    statistic as ``update(..., row_mean_sq=[n])``. ``exact_sums``: duplicates' gradients are
    summed by :func:`~dlrm_jax.embedding.exchange.sums.exact_segment_sum`, so the update is the same bits in any order (GPU
    atomics); the exchange's own gradient sums follow the same choice.
    """

    init: Callable[[jax.Array], dict[str, jax.Array]]
    update: Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
    apply: Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
    needs_whole_rows: bool = False
    exact_sums: bool = False

    def row_sums(self, lookups: Lookups | jax.Array, grads: jax.Array, num_rows: int) -> jax.Array:
        """[num_rows, W]: every row's summed gradient as this optimizer's updates sum them
        (:func:`~dlrm_jax.embedding.exchange.row_grads.dense_row_sums`); for exchange buffers
        and small tables all-reduced whole."""
        return dense_row_sums(lookups, grads, num_rows, self.exact_sums)


# ``apply`` takes distinct rows in ascending order (``RowSums.rows``: its scatters promise XLA
# unique, sorted indices, so none adds into a row twice), or None for every row in order (the
# hot group: one dense elementwise update instead of a gather and a scatter of all its rows).


def _get(array, rows):
    return array if rows is None else array.at[rows].get(mode="fill", fill_value=0, indices_are_sorted=True)


def _set(array, rows, values):
    values = values.astype(array.dtype)  # rounded once, here (a float32 scatter into bfloat16 warns)
    if rows is None:
        return values
    return array.at[rows].set(values, mode="drop", unique_indices=True, indices_are_sorted=True)


def _add_rows(table, rows, delta_f32):
    """table[r] += delta for distinct rows, computed in float32 and rounded once to storage."""
    if table.dtype == jnp.float32 and rows is not None:
        return table.at[rows].add(delta_f32, mode="drop", unique_indices=True, indices_are_sorted=True)
    return _set(table, rows, _get(table, rows).astype(jnp.float32) + delta_f32)


def _by_row(apply, exact_sums: bool):
    """``update`` from ``apply``: each distinct row's summed gradient, then ``apply`` once."""

    def update(table, state, lookups, grads, lr):
        r = sum_by_row(lookups, grads, table.shape[0], exact_sums)
        return apply(table, state, r.rows, r.grads, lr)

    return update


def sgd(exact_sums: bool = False) -> SparseOptimizer:
    """table[r] -= lr * g."""

    def init(table):
        return {}

    def apply(table, state, rows, g, lr):
        return _add_rows(table, rows, -lr * g.astype(jnp.float32)), state

    return SparseOptimizer(init, _by_row(apply, exact_sums), apply, exact_sums=exact_sums)


def adagrad(eps: float = 1e-8, initial_accumulator: float = 0.0, exact_sums: bool = False) -> SparseOptimizer:
    """Per-element Adagrad: acc[r] += g^2; table[r] -= lr * g / (sqrt(acc[r]) + eps)."""

    def init(table):
        return {"accumulator": jnp.full(table.shape, initial_accumulator, jnp.float32)}

    def apply(table, state, uniq, g, lr):
        acc = _get(state["accumulator"], uniq) + g * g
        step = -lr * g / (jnp.sqrt(acc) + eps)
        return _add_rows(table, uniq, step), {"accumulator": _set(state["accumulator"], uniq, acc)}

    return SparseOptimizer(init, _by_row(apply, exact_sums), apply, exact_sums=exact_sums)


def rowwise_adagrad(eps: float = 1e-8, initial_accumulator: float = 0.0, exact_sums: bool = False) -> SparseOptimizer:
    """Row-wise Adagrad (FBGEMM/TorchRec): one accumulator per row, acc[r] += mean(g^2).

    The mean is over the row's whole width. A column slice passes ``row_mean_sq`` [n]: for each
    input row, the mean over all columns of its summed gradient squared (every slice of a row
    gets the same value, so the slices' accumulators stay equal).
    """

    def init(table):
        return {"accumulator": jnp.full(table.shape[:1], initial_accumulator, jnp.float32)}

    def apply(table, state, uniq, g, lr, row_mean_sq=None):
        """``row_mean_sq`` [n]: per distinct row, the whole row's mean squared gradient (column
        slices); by default the mean over ``g``'s own columns."""
        mean_sq = jnp.mean(g * g, -1) if row_mean_sq is None else row_mean_sq
        acc = _get(state["accumulator"], uniq) + mean_sq
        step = -lr * g / (jnp.sqrt(acc)[:, None] + eps)
        return _add_rows(table, uniq, step), {"accumulator": _set(state["accumulator"], uniq, acc)}

    def update(table, state, lookups, grads, lr, row_mean_sq=None):
        """``row_mean_sq`` [n]: per lookup, its row's (every lookup of a row carries the same)."""
        r = sum_by_row(lookups, grads, table.shape[0], exact_sums)
        return apply(table, state, r.rows, r.grads, lr, None if row_mean_sq is None else r.max_by_row(row_mean_sq))

    return SparseOptimizer(init, update, apply, needs_whole_rows=True, exact_sums=exact_sums)


def ftrl(
    l1: float = 0.0, l2: float = 0.0, beta: float = 0.0, initial_accumulator: float = 0.1, exact_sums: bool = False
) -> SparseOptimizer:
    """FTRL-Proximal (McMahan et al. 2013) per element, the wide part's optimizer in Wide&Deep:
    n' = n + g^2; z' = z + g - (sqrt(n') - sqrt(n)) / lr * w;
    w' = -(z' - sign(z') l1) / ((beta + sqrt(n')) / lr + l2) where |z'| > l1, else 0.

    The weights follow from (z, n) alone, so a table starts at zero; ``initial_accumulator``
    (TensorFlow's default 0.1) keeps the first step's denominator away from zero.
    """

    def init(table):
        return {"z": jnp.zeros(table.shape, jnp.float32), "n": jnp.full(table.shape, initial_accumulator, jnp.float32)}

    def apply(table, state, uniq, g, lr):
        w = _get(table, uniq).astype(jnp.float32)
        n, z = _get(state["n"], uniq), _get(state["z"], uniq)
        n_new = n + g * g
        z_new = z + g - (jnp.sqrt(n_new) - jnp.sqrt(n)) / lr * w
        shrunk = z_new - jnp.sign(z_new) * l1
        # (padding rows read n = 0 and are dropped; the guard keeps their division finite)
        w_new = jnp.where(jnp.abs(z_new) > l1, -shrunk / jnp.maximum((beta + jnp.sqrt(n_new)) / lr + l2, 1e-30), 0.0)
        return _set(table, uniq, w_new), {"z": _set(state["z"], uniq, z_new), "n": _set(state["n"], uniq, n_new)}

    return SparseOptimizer(init, _by_row(apply, exact_sums), apply, exact_sums=exact_sums)


SPARSE_OPTIMIZERS = {"sgd": sgd, "adagrad": adagrad, "rowwise_adagrad": rowwise_adagrad, "ftrl": ftrl}


def sparse_optimizer(name: str, **settings) -> SparseOptimizer:
    """The sparse optimizer ``name`` (``sgd``, ``adagrad``, ``rowwise_adagrad``, ``ftrl``), e.g.
    ``sparse_optimizer("adagrad", eps=1e-8, initial_accumulator=0.1)``; ``settings`` are its
    constructor's keywords (``exact_sums=True``: order-independent gradient sums).

    Give it the name the plan was made for (``plan_embeddings(..., optimizer=name)`` counts its
    state's bytes); ``EmbeddingCollection(plan, mesh)`` alone uses that name's defaults."""
    if name not in SPARSE_OPTIMIZERS:
        raise ValueError(f"no sparse optimizer {name!r}: one of {', '.join(SPARSE_OPTIMIZERS)}")
    return SPARSE_OPTIMIZERS[name](**settings)
