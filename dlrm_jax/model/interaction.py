"""Feature interactions of DLRM: pairwise dot products (``dot``) or concatenation (``cat``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def dot_interaction(bottom_bd: jax.Array, emb_bfd: jax.Array) -> jax.Array:
    """DLRM's dot interaction.

    Stacks the bottom-MLP output with the F embedding vectors into T [B, F+1, D], takes all
    pairwise dot products T T^T, keeps the strictly lower triangle ((F+1)F/2 values, pairs i > j
    in row-major order) and concatenates it after the bottom output: [B, D + (F+1)F/2].
    """
    t = jnp.concatenate([bottom_bd[:, None, :], emb_bfd.astype(bottom_bd.dtype)], axis=1)
    z = jnp.einsum("bid,bjd->bij", t, t)
    rows, cols = np.tril_indices(t.shape[1], k=-1)
    return jnp.concatenate([bottom_bd, z[:, rows, cols]], axis=1)


def cat_interaction(bottom_bd: jax.Array, emb_bfd: jax.Array) -> jax.Array:
    """Concatenation of the bottom output and every embedding vector: [B, D * (F+1)]."""
    b = bottom_bd.shape[0]
    return jnp.concatenate([bottom_bd, emb_bfd.astype(bottom_bd.dtype).reshape(b, -1)], axis=1)


INTERACTIONS = {"dot": dot_interaction, "cat": cat_interaction}


def interaction_width(kind: str, num_features: int, dim: int) -> int:
    """Width of the interaction output for F embedding features of width D."""
    if kind == "dot":
        return dim + (num_features + 1) * num_features // 2
    if kind == "cat":
        return dim * (num_features + 1)
    raise ValueError(f"unknown interaction {kind!r}; allowed: {', '.join(INTERACTIONS)}")
