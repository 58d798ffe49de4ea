"""The dense part of DLRM as a Flax NNX module; embedding lookups happen outside it."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dlrm_jax.model.cross import CrossNetwork
from dlrm_jax.model.interaction import INTERACTIONS, interaction_width
from dlrm_jax.model.mlp import MLP


class DLRMDense(nnx.Module):
    """Bottom MLP over dense features, interaction with the embeddings, top MLP to a logit.

    ``interaction``: ``dot`` (DLRM), ``cat``, or ``dcn``: the concatenation through a DCNv2
    cross network of ``dcn_layers`` layers (low rank ``dcn_rank``; 0 = full), DLRM-DCNv2.
    An empty ``bottom_mlp`` passes the dense features unchanged (the deep part of Wide&Deep,
    whose wide part is :mod:`dlrm_jax.model.wide`).

    The embedding tables are not part of this module: they are sharded and updated sparsely by
    :mod:`dlrm_jax.embedding`, and enter here as already looked-up (pooled) vectors.

    ``dot_pairs``: how the dot interaction's pairs are made (``xla`` or ``fused``:
    :func:`~dlrm_jax.model.interaction.dot_interaction`); ``cross_layers``: how a low-rank cross
    layer's second product and elementwise work run (``xla`` or ``fused``:
    :class:`~dlrm_jax.model.cross.CrossNetwork`).

    ``pooled_dtype``: it reads the pooled vectors in its compute dtype (its first use of them
    casts), so the train step hands them over cast and their gradient comes back in that dtype
    (half the bytes for the sparse update to read in bfloat16).

    Call: dense_bd float32 [B, num_dense], emb_bfd [B, F, D] -> logits float32 [B]; ``tensor``
    (model.mlp_parallel=tensor) splits the MLPs' and cross network's layers over model groups
    (:mod:`dlrm_jax.model.mlp_parallel`).
    """

    def __init__(
        self,
        *,
        num_dense: int,
        num_features: int,
        embedding_dim: int,
        bottom_mlp: Sequence[int],
        top_mlp: Sequence[int],
        interaction: str,
        compute_dtype: str = "float32",
        dcn_layers: int = 3,
        dcn_rank: int = 0,
        dot_pairs: str = "xla",
        cross_layers: str = "xla",
        rngs: nnx.Rngs,
    ):
        dtype = jnp.dtype(compute_dtype)
        self.bottom = MLP(num_dense, bottom_mlp, final_relu=True, dtype=dtype, rngs=rngs)
        # An empty bottom MLP (Wide&Deep's deep part) passes the dense features as they are.
        width = interaction_width(interaction, num_features, embedding_dim, bottom_mlp[-1] if bottom_mlp else num_dense)
        self.cross = (
            CrossNetwork(width, dcn_layers, dcn_rank, dtype=dtype, layers_form=cross_layers, rngs=rngs)
            if interaction == "dcn"
            else None
        )
        self.top = MLP(width, top_mlp, final_relu=False, dtype=dtype, rngs=rngs)
        self.interaction, self.dot_pairs = interaction, dot_pairs
        self.dtype = self.pooled_dtype = dtype

    def __call__(self, dense_bd: jax.Array, emb_bfd: jax.Array, tensor=None) -> jax.Array:
        z = top_inputs(self.bottom, self.cross, self.interaction, self.dtype, dense_bd, emb_bfd, tensor, self.dot_pairs)
        return self.top(z, tensor)[:, 0].astype(jnp.float32)


def top_inputs(
    bottom: MLP,
    cross: CrossNetwork | None,
    interaction: str,
    dtype,
    dense_bd: jax.Array,
    emb_bfd: jax.Array,
    tensor=None,
    pairs: str = "xla",
) -> jax.Array:
    """Bottom MLP, interaction and cross network: the top MLP's input [B, width] (also the
    first pipeline stage's work, model/mlp_parallel.py, inside shard_map: the XLA pairs)."""
    x = bottom(dense_bd.astype(dtype), tensor)
    z = INTERACTIONS[interaction](x, emb_bfd.astype(dtype), pairs)
    return z if cross is None else cross(z, tensor)


def bce_loss(logits_b: jax.Array, labels_b: jax.Array) -> jax.Array:
    """Per-sample sigmoid binary cross-entropy, float32 [B]."""
    return optax.sigmoid_binary_cross_entropy(logits_b, labels_b)
