"""Sparse optimizers: pure functions that update only the rows a batch looked up.

Each takes the fused table [R, D], its state, the looked-up rows [n] (``R`` or more = padding,
dropped) and their gradients [n, D], and returns the new table and state. No full-table gradient
is ever formed. Duplicate rows are merged first where the update is not linear in the gradient
(Adagrad), so every optimizer equals its dense counterpart applied to the summed gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dlrm_jax.embedding.exchange import sums


class SparseOptimizer(NamedTuple):
    """``init(table) -> state``; ``update(table, state, rows_n, grads_nd, lr) -> (table, state)``;
    ``apply``: the same for rows known to be distinct (or None: every row in order), each with
    its summed gradient (no merge).

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

    def segment_sum(self, data: jax.Array, segment_ids: jax.Array, num_segments: int) -> jax.Array:
        """The gradient sum by row that this optimizer's updates use."""
        return sums.segment_sum(data, segment_ids, num_segments, self.exact_sums)


def merge_duplicates(
    rows_n: jax.Array, grads_nd: jax.Array, pad_row: int, return_inverse: bool = False, exact: bool = False
):
    """Unique rows [n] (padded with ``pad_row``) and the summed gradient of each [n, D]
    (and, if asked, each input's index into the unique rows [n]); ``exact``: see
    :func:`~dlrm_jax.embedding.exchange.sums.exact_segment_sum`."""
    n = rows_n.shape[0]
    uniq, inv = jnp.unique(rows_n, size=n, fill_value=pad_row, return_inverse=True)
    inv = inv.reshape(-1)
    summed = sums.segment_sum(grads_nd, inv, n, exact)
    return (uniq, summed, inv) if return_inverse else (uniq, summed)


# ``apply`` takes distinct rows, or None for every row in order (the hot group: one dense
# elementwise update instead of a gather and a scatter of all its rows).


def _get(array, rows):
    return array if rows is None else array.at[rows].get(mode="fill", fill_value=0)


def _set(array, rows, values):
    values = values.astype(array.dtype)  # rounded once, here (a float32 scatter into bfloat16 warns)
    return values if rows is None else array.at[rows].set(values, mode="drop")


def _add_rows(table, unique_rows, delta_f32):
    """table[r] += delta for distinct rows, computed in float32 and rounded once to storage."""
    if table.dtype == jnp.float32 and unique_rows is not None:
        return table.at[unique_rows].add(delta_f32, mode="drop")
    return _set(table, unique_rows, _get(table, unique_rows).astype(jnp.float32) + delta_f32)


def sgd(exact_sums: bool = False) -> SparseOptimizer:
    """table[r] -= lr * g, duplicates summed by the scatter-add itself (unless exact sums)."""

    def init(table):
        return {}

    def apply(table, state, rows_n, grads_nd, lr):
        return _add_rows(table, rows_n, -lr * grads_nd.astype(jnp.float32)), state

    def update(table, state, rows_n, grads_nd, lr):
        # Merge first for narrow tables (one rounding per row, not one per duplicate) and for
        # exact sums (atomics adding duplicates straight into the table round in any order).
        if table.dtype != jnp.float32 or exact_sums:
            rows_n, grads_nd = merge_duplicates(rows_n, grads_nd, table.shape[0], exact=exact_sums)
        return apply(table, state, rows_n, grads_nd, lr)

    return SparseOptimizer(init, update, apply, exact_sums=exact_sums)


def adagrad(eps: float = 1e-8, initial_accumulator: float = 0.0, exact_sums: bool = False) -> SparseOptimizer:
    """Per-element Adagrad: acc[r] += g^2; table[r] -= lr * g / (sqrt(acc[r]) + eps)."""

    def init(table):
        return {"accumulator": jnp.full(table.shape, initial_accumulator, jnp.float32)}

    def apply(table, state, uniq, g, lr):
        acc = _get(state["accumulator"], uniq) + g * g
        step = -lr * g / (jnp.sqrt(acc) + eps)
        return _add_rows(table, uniq, step), {"accumulator": _set(state["accumulator"], uniq, acc)}

    def update(table, state, rows_n, grads_nd, lr):
        return apply(table, state, *merge_duplicates(rows_n, grads_nd, table.shape[0], exact=exact_sums), lr)

    return SparseOptimizer(init, update, apply, exact_sums=exact_sums)


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

    def update(table, state, rows_n, grads_nd, lr, row_mean_sq=None):
        uniq, g, inv = merge_duplicates(rows_n, grads_nd, table.shape[0], return_inverse=True, exact=exact_sums)
        if row_mean_sq is not None:  # duplicates carry the same value; empty (padding) segments give 0
            row_mean_sq = jnp.maximum(jax.ops.segment_max(row_mean_sq, inv, num_segments=rows_n.shape[0]), 0.0)
        return apply(table, state, uniq, g, lr, row_mean_sq)

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

    def update(table, state, rows_n, grads_nd, lr):
        return apply(table, state, *merge_duplicates(rows_n, grads_nd, table.shape[0], exact=exact_sums), lr)

    return SparseOptimizer(init, update, apply, exact_sums=exact_sums)


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
