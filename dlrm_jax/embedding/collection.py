"""The embedding collection: lookups and sparse updates of every table, following a plan.

Used inside the jitted train step as two calls around the dense model's autodiff:

    pooled_bfd, res = collection.lookup(state, ids_bs)       # forward
    ... grads of the loss w.r.t. pooled_bfd ...
    state = collection.apply_gradients(state, res, grad_bfd, lr)   # sparse update

The tables are never differentiated as arrays: gradients flow to the looked-up vectors only, and
the sparse optimizer turns them into row updates.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlrm_jax.data.batch import PAD_ID
from dlrm_jax.embedding.optimizers import SparseOptimizer
from dlrm_jax.embedding.plan import EmbeddingPlan, Strategy
from dlrm_jax.embedding.specs import Pooling, SlotLayout
from dlrm_jax.parallel.mesh import AXIS

GROUP = "replicated"


class EmbeddingState(NamedTuple):
    """Fused tables and their optimizer state, keyed by group name.

    tables[g]: float32 [R_g, D]; slots[g]: the sparse optimizer's dict of per-row arrays.
    """

    tables: dict[str, jax.Array]
    slots: dict[str, dict[str, jax.Array]]


class LookupResiduals(NamedTuple):
    """What the backward pass needs from the forward lookup.

    rows_bs: int32 [B, S] fused row of each slot (R = padding); weights_bs: float32 [B, S]
    pooling weight of each slot (0 for padding, 1/bag length for mean pooling).
    """

    rows_bs: jax.Array
    weights_bs: jax.Array


class EmbeddingCollection:
    """Every table of a plan, fused into one array per group, on a mesh."""

    def __init__(self, plan: EmbeddingPlan, mesh: jax.sharding.Mesh, optimizer: SparseOptimizer):
        specs = tuple(t.spec for t in plan.tables)
        if any(t.strategy != Strategy.REPLICATED for t in plan.tables):
            raise NotImplementedError("only replicated tables are built in this version")
        if len({s.dim for s in specs}) != 1:
            raise ValueError(f"all tables must share one width, got {sorted({s.dim for s in specs})}")
        self.plan, self.mesh, self.optimizer = plan, mesh, optimizer
        self.specs = specs
        self.layout = SlotLayout.build(specs)
        self.dim = specs[0].dim
        self.mean_pooling = jnp.array([s.pooling == Pooling.MEAN for s in specs])

    # ------------------------------------------------------------ state
    def state_sharding(self) -> EmbeddingState:
        rep = NamedSharding(self.mesh, P())
        abstract = jax.eval_shape(self._init, jax.random.key(0))
        return jax.tree.map(lambda _: rep, abstract)

    def _init(self, key: jax.Array) -> EmbeddingState:
        # DLRM's initialiser: U(-1/sqrt(rows), 1/sqrt(rows)), each table from its own key so a
        # table's values do not depend on which other tables share its fused array.
        table = jnp.concatenate([
            jax.random.uniform(jax.random.fold_in(key, t), (s.rows, self.dim), jnp.float32,
                               -1.0 / s.rows**0.5, 1.0 / s.rows**0.5)
            for t, s in enumerate(self.specs)
        ])
        return EmbeddingState({GROUP: table}, {GROUP: self.optimizer.init(table)})

    def init(self, key: jax.Array) -> EmbeddingState:
        """Tables created directly on the mesh with their final sharding."""
        return jax.jit(self._init, out_shardings=self.state_sharding())(key)

    # ------------------------------------------------------------ forward
    def lookup(self, state: EmbeddingState, ids_bs: jax.Array) -> tuple[jax.Array, LookupResiduals]:
        """ids_bs int32 [B, S] (batch-sharded) -> pooled vectors float32 [B, F, D] (batch-sharded)."""
        rows_bs = self.layout.fused_rows(ids_bs)
        weights_bs = self._pool_weights(ids_bs)
        vectors_bsd = state.tables[GROUP].at[rows_bs].get(mode="fill", fill_value=0.0)
        pooled_bfd = self._pool(vectors_bsd.astype(jnp.float32) * weights_bs[..., None])
        return pooled_bfd, LookupResiduals(rows_bs, weights_bs)

    def _pool_weights(self, ids_bs: jax.Array) -> jax.Array:
        valid_bs = (ids_bs != PAD_ID).astype(jnp.float32)
        if self.layout.one_hot:
            return valid_bs
        feature = jnp.asarray(self.layout.slot_feature)
        count_bf = jax.ops.segment_sum(valid_bs.T, feature, len(self.specs)).T
        denom_bs = jnp.where(self.mean_pooling[feature], jnp.maximum(count_bf[:, feature], 1.0), 1.0)
        return valid_bs / denom_bs

    def _pool(self, weighted_bsd: jax.Array) -> jax.Array:
        if self.layout.one_hot:
            return weighted_bsd
        feature = jnp.asarray(self.layout.slot_feature)
        summed_sbd = jax.ops.segment_sum(jnp.swapaxes(weighted_bsd, 0, 1), feature, len(self.specs))
        return jnp.swapaxes(summed_sbd, 0, 1)

    # ------------------------------------------------------------ backward + update
    def apply_gradients(self, state: EmbeddingState, res: LookupResiduals, grad_bfd: jax.Array,
                        lr: jax.Array) -> EmbeddingState:
        """Sparse update of the looked-up rows from the gradient w.r.t. the pooled vectors."""
        feature = jnp.asarray(self.layout.slot_feature)
        grad_bsd = grad_bfd[:, feature, :] * res.weights_bs[..., None]
        rows_n = res.rows_bs.reshape(-1)
        grads_nd = grad_bsd.reshape(-1, self.dim)
        table, slots = self._replicated_update(state.tables[GROUP], state.slots[GROUP],
                                               rows_n, grads_nd, lr)
        return EmbeddingState({GROUP: table}, {GROUP: slots})

    def _replicated_update(self, table, slots, rows_n, grads_nd, lr):
        """Every device gathers the whole batch's rows and gradients and applies the same update.

        Moves B*S*(D+1) values per device instead of an all-reduce of the R x D table.
        """

        def update(table, slots, rows_n, grads_nd, lr):
            rows_n = lax.all_gather(rows_n, AXIS, tiled=True)
            grads_nd = lax.all_gather(grads_nd, AXIS, tiled=True)
            return self.optimizer.update(table, slots, rows_n, grads_nd, lr)

        return jax.shard_map(
            update, mesh=self.mesh,
            in_specs=(P(), P(), P(AXIS), P(AXIS), P()), out_specs=(P(), P()),
            check_vma=False,  # every device applies the same gathered update: replicated by construction
        )(table, slots, rows_n, grads_nd, lr)
