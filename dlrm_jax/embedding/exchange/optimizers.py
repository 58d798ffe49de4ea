"""Sparse optimizers: pure functions that update only the rows a batch looked up.

Each takes the fused table [R, D], its state, the batch's lookups (rows ``R`` or more =
padding, dropped; see :mod:`~dlrm_jax.embedding.exchange.row_grads`) and the gradients they
point at, and returns the new table and state. No full-table gradient and no gradient row per
lookup is formed: each distinct row's gradient is summed in a fixed order and the optimizer
applied to it once, so every optimizer equals its dense counterpart applied to the summed
gradient, with the same bits on every run.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dlrm_jax.embedding.exchange import row_update_kernel
from dlrm_jax.embedding.exchange.row_grads import Lookups, buffer_row_sums, sum_by_row


class RowStep(NamedTuple):
    """One optimizer's arithmetic on rows given their summed gradients, shared by the XLA
    update and the fused kernel: ``fn(w, state, g, lr, mean_sq) -> (out, state)`` on [k, W]
    rows, ``w`` float32 (None unless ``reads_table``), ``state`` those rows of each state array,
    ``mean_sq`` [k] each row's mean squared gradient over its whole width (row-wise Adagrad on
    column slices; else None); ``out`` is what to add to the rows (``adds``) or the new rows."""

    fn: Callable
    adds: bool = True
    reads_table: bool = False


class SparseOptimizer(NamedTuple):
    """``init(table) -> state``; ``update(table, state, lookups, grads, lr) -> (table, state)``
    with ``lookups`` a :class:`~dlrm_jax.embedding.exchange.row_grads.Lookups` (or a bare [n]
    array of rows, one gradient row each) and ``grads`` the vectors it points at; ``apply``:
    the same for distinct ascending rows (or None: every row in order), each with its summed
    gradient.

    The state is a dict of arrays whose leading axis is the table's row axis, so it can be
    sharded exactly like the table. ``needs_whole_rows``: the update depends on each row's
    gradient over all its columns (row-wise Adagrad), so a column slice must be given that
    statistic as ``update(..., row_mean_sq=[n])``. ``exact_sums``: gradients are summed by
    :func:`~dlrm_jax.embedding.exchange.sums.exact_segment_sum` (the same bits in any order,
    for a backend whose scatter-adds are float atomics); the exchange's own sums follow.
    ``kernel``: ``update`` runs the fused kernel
    (:func:`~dlrm_jax.embedding.exchange.row_update_kernel.fused_row_update`: sums and update
    in one pass, the same bits every run) where it applies.
    """

    init: Callable[[jax.Array], dict[str, jax.Array]]
    step: RowStep
    needs_whole_rows: bool = False
    exact_sums: bool = False
    kernel: bool = False
    kernel_programs: int = 0  # the row kernel's most programs (fused_row_update's ``programs``)
    # The state of rows whose weights ``table`` were set from elsewhere (a fresh row from its
    # shared row), at rate ``lr``, where the weights follow from the state (FTRL); None: ``init``.
    starts_at: Callable[[jax.Array, jax.Array], dict[str, jax.Array]] | None = None

    def state_for(self, table, lr) -> dict[str, jax.Array]:
        """The initial state of rows that hold ``table`` (their next step at rate ``lr`` keeps
        those weights where the gradient is 0): ``init``'s, unless the weights follow from the
        state (FTRL, whose initial state means weights of 0)."""
        return self.init(table) if self.starts_at is None else self.starts_at(table, lr)

    def update(self, table, state, lookups, grads, lr, row_mean_sq=None):
        """Each distinct row's gradient summed in a fixed order, then the optimizer applied to
        it once. ``row_mean_sq`` [n] (row-wise Adagrad on column slices): per lookup, its
        row's mean squared gradient over the whole width (every lookup of a row carries it).
        ``grads`` float32, or bfloat16 as the model gave it: each lookup's gradient is made
        float32 before it is added (in the kernels; ``row_grads.weighted_addends``)."""
        if self.kernel and row_update_kernel.applies(table, grads):
            return row_update_kernel.fused_row_update(
                self.step, table, state, lookups, grads, lr, row_mean_sq, programs=self.kernel_programs
            )
        r = sum_by_row(lookups, grads, table.shape[0], self.exact_sums)
        mean_sq = None if row_mean_sq is None else r.sorted.max_by_row(row_mean_sq)
        return self.apply(table, state, r.rows, r.grads, lr, mean_sq)

    def apply(self, table, state, rows, g, lr, mean_sq=None):
        """The step for distinct ascending ``rows`` [k] (or None: every row) and their summed
        gradients ``g`` [k, W]: each row and its state read and written once."""
        w = _get(table, rows).astype(jnp.float32) if self.step.reads_table else None
        out, new = self.step.fn(w, {k: _get(v, rows) for k, v in state.items()}, g.astype(jnp.float32), lr, mean_sq)
        table = _add_rows(table, rows, out) if self.step.adds else _set(table, rows, out)
        return table, {k: _set(state[k], rows, new[k]) for k in state}

    def row_sums(self, lookups: Lookups | jax.Array, grads: jax.Array, num_rows: int) -> jax.Array:
        """[num_rows, W]: every row's summed gradient as this optimizer's updates sum them
        (:func:`~dlrm_jax.embedding.exchange.row_grads.buffer_row_sums`); for exchange buffers."""
        return buffer_row_sums(lookups, grads, num_rows, self.exact_sums)


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


def sgd(exact_sums: bool = False, kernel: bool = False) -> SparseOptimizer:
    """table[r] -= lr * g."""

    def step(w, state, g, lr, mean_sq):
        return -lr * g, state

    return SparseOptimizer(lambda table: {}, RowStep(step), exact_sums=exact_sums, kernel=kernel)


def adagrad(
    eps: float = 1e-8, initial_accumulator: float = 0.0, exact_sums: bool = False, kernel: bool = False
) -> SparseOptimizer:
    """Per-element Adagrad: acc[r] += g^2; table[r] -= lr * g / (sqrt(acc[r]) + eps)."""

    def init(table):
        return {"accumulator": jnp.full(table.shape, initial_accumulator, jnp.float32)}

    def step(w, state, g, lr, mean_sq):
        acc = state["accumulator"] + g * g
        return -lr * g / (jnp.sqrt(acc) + eps), {"accumulator": acc}

    return SparseOptimizer(init, RowStep(step), exact_sums=exact_sums, kernel=kernel)


def rowwise_adagrad(
    eps: float = 1e-8, initial_accumulator: float = 0.0, exact_sums: bool = False, kernel: bool = False
) -> SparseOptimizer:
    """Row-wise Adagrad (FBGEMM/TorchRec): one accumulator per row, acc[r] += mean(g^2).

    The mean is over the row's whole width. A column slice passes ``row_mean_sq`` (every slice
    of a row gets the same value, so the slices' accumulators stay equal); otherwise it is the
    mean over the gradient's own columns.
    """

    def init(table):
        return {"accumulator": jnp.full(table.shape[:1], initial_accumulator, jnp.float32)}

    def step(w, state, g, lr, mean_sq):
        acc = state["accumulator"] + (jnp.mean(g * g, -1) if mean_sq is None else mean_sq)
        return -lr * g / (jnp.sqrt(acc)[:, None] + eps), {"accumulator": acc}

    return SparseOptimizer(init, RowStep(step), needs_whole_rows=True, exact_sums=exact_sums, kernel=kernel)


def ftrl(
    l1: float = 0.0,
    l2: float = 0.0,
    beta: float = 0.0,
    initial_n: float = 0.1,
    exact_sums: bool = False,
    kernel: bool = False,
) -> SparseOptimizer:
    """FTRL-Proximal (McMahan et al. 2013) per element, the wide part's optimizer in Wide&Deep:
    n' = n + g^2; z' = z + g - (sqrt(n') - sqrt(n)) / lr * w;
    w' = -(z' - sign(z') l1) / ((beta + sqrt(n')) / lr + l2) where |z'| > l1, else 0.

    The weights follow from (z, n) alone, so a table starts at zero; ``initial_n`` (TensorFlow's
    ``initial_accumulator_value``, 0.1) keeps the first step's denominator away from zero.
    """

    def init(table):
        return {"z": jnp.zeros(table.shape, jnp.float32), "n": jnp.full(table.shape, initial_n, jnp.float32)}

    def step(w, state, g, lr, mean_sq):
        n, z = state["n"], state["z"]
        n_new = n + g * g
        z_new = z + g - (jnp.sqrt(n_new) - jnp.sqrt(n)) / lr * w
        shrunk = z_new - jnp.sign(z_new) * l1
        # (padding rows read n = 0 and are dropped; the guard keeps their division finite)
        w_new = jnp.where(jnp.abs(z_new) > l1, -shrunk / jnp.maximum((beta + jnp.sqrt(n_new)) / lr + l2, 1e-30), 0.0)
        return w_new, {"z": z_new, "n": n_new}

    def starts_at(w, lr):  # n's initial value, and the z whose weight is w: w = -(z - sign(z) l1) / d
        d = (beta + jnp.sqrt(jnp.float32(initial_n))) / lr + l2
        w = w.astype(jnp.float32)
        return {"z": -w * d - jnp.sign(w) * l1, "n": jnp.full(w.shape, initial_n, jnp.float32)}

    return SparseOptimizer(
        init, RowStep(step, adds=False, reads_table=True), exact_sums=exact_sums, kernel=kernel, starts_at=starts_at
    )


# Keyed by the names of choices.SPARSE_OPTIMIZER_KINDS, which say what the planner counts of each.
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


def sparse_optimizer_taking(name: str, settings: dict) -> SparseOptimizer:
    """The sparse optimizer ``name`` given those of ``settings`` its constructor takes (a
    config's settings for every optimizer: Adagrad's ``eps`` and ``initial_accumulator``,
    FTRL's ``l1`` and ``l2``, ``exact_sums``, ``kernel``), so no caller chooses by name."""
    if name not in SPARSE_OPTIMIZERS:
        raise ValueError(f"no sparse optimizer {name!r}: one of {', '.join(SPARSE_OPTIMIZERS)}")
    taken = inspect.signature(SPARSE_OPTIMIZERS[name]).parameters
    return SPARSE_OPTIMIZERS[name](**{k: v for k, v in settings.items() if k in taken})
