"""Feature interactions of DLRM: pairwise dot products (``dot``) or concatenation (``cat``);
``dcn`` is the concatenation through DCNv2's cross network (:mod:`dlrm_jax.model.cross`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dlrm_jax.model import pairs_kernel
from dlrm_jax.model.work import KINDS, interaction_width  # noqa: F401 - interaction_width re-exported


def dot_interaction(bottom_bd: jax.Array, emb_bfd: jax.Array, pairs: str = "xla") -> jax.Array:
    """DLRM's dot interaction.

    Stacks the bottom-MLP output with the F embedding vectors into T [B, F+1, D], takes all
    pairwise dot products T T^T, keeps the strictly lower triangle ((F+1)F/2 values, pairs i > j
    in row-major order) and concatenates it after the bottom output: [B, D + (F+1)F/2].
    ``pairs`` (``model.dot_pairs``): ``xla`` (:func:`lower_triangle_gram`) or ``fused`` (the
    kernels of :mod:`dlrm_jax.model.pairs_kernel`); the same values to rounding.
    """
    t = jnp.concatenate([bottom_bd[:, None, :], emb_bfd.astype(bottom_bd.dtype)], axis=1)
    return jnp.concatenate([bottom_bd, PAIRS[pairs](t)], axis=1)


def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.tril_indices(n, k=-1)


@jax.custom_vjp
def lower_triangle_gram(t_bnd: jax.Array) -> jax.Array:
    """[B, N, D] -> [B, N(N-1)/2]: the dot products of vector pairs i > j (row-major).

    A batched matmul, then a gather of the pairs from the flattened [B, N*N] products. The
    gradient is written by hand: autodiff would scatter the pairs' gradient into a zeroed
    [B, N, N] array and run two batched matmuls (one per side of the product); here the
    symmetric [B, N, N] gradient is a gather of the pairs' gradient (each pair fills (i, j) and
    (j, i), the diagonal a zero), and one batched matmul by T gives dT. On CPU that took the
    interaction's backward from a quarter of the c1 step to a few percent (BENCHMARKS.md).
    """
    n = t_bnd.shape[1]
    rows, cols = _pairs(n)
    gram = jnp.einsum("bid,bjd->bij", t_bnd, t_bnd).reshape(t_bnd.shape[0], n * n)
    return jnp.take(gram, rows * n + cols, axis=1)


def _gram_forward(t_bnd):
    return lower_triangle_gram(t_bnd), t_bnd


def _gram_backward(t_bnd, d_pairs):
    b, n, _ = t_bnd.shape
    rows, cols = _pairs(n)
    source = np.zeros(n * n, np.int32)  # each place's pair (the diagonal: none, masked)
    source[rows * n + cols] = np.arange(len(rows))
    source[cols * n + rows] = np.arange(len(rows))
    off_diagonal = (np.arange(n * n) // n) != (np.arange(n * n) % n)
    # (a gather and a select in one pass: a zero column appended first was a pad of its own)
    d_gram = jnp.where(off_diagonal, jnp.take(d_pairs, source, axis=1), 0).reshape(b, n, n)  # dG + dG^T
    return (jnp.einsum("bij,bjd->bid", d_gram, t_bnd),)


lower_triangle_gram.defvjp(_gram_forward, _gram_backward)


def cat_interaction(bottom_bd: jax.Array, emb_bfd: jax.Array, pairs: str = "xla") -> jax.Array:
    """Concatenation of the bottom output [B, W] and every embedding vector: [B, W + F * D]
    (``pairs``: unused, as every interaction takes it)."""
    b = bottom_bd.shape[0]
    return jnp.concatenate([bottom_bd, emb_bfd.astype(bottom_bd.dtype).reshape(b, -1)], axis=1)


PAIRS = {"xla": lower_triangle_gram, "fused": pairs_kernel.lower_triangle_gram}  # model.dot_pairs
INTERACTIONS = {"dot": dot_interaction, "cat": cat_interaction, "dcn": cat_interaction}
assert set(INTERACTIONS) == set(KINDS)
