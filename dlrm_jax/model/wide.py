"""The wide part of Wide&Deep (``model.kind: wide_deep``): a linear model over the categorical
ids and the dense features, added to the deep part's logit.

Each categorical feature has a table of one weight per id, held whole on every device (a plan
of ``replicated`` tables): lookups are local gathers, so the wide part never enters the
all-to-all, and each step's sparse update all-gathers the batch's ids and gradients so every
device applies the same update (B*F values moved, never a table-sized all-reduce). It has its
own optimizer (``model.wide.optimizer``: FTRL-Proximal by default, as in the Wide&Deep paper)
and constant learning rate, for the tables and for the dense features' weights and bias alike.
The weights start at zero: the model starts as the deep part alone.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlrm_jax.embedding.exchange.collection import (
    EmbeddingCollection,
    EmbeddingState,
    LookupResiduals,
)
from dlrm_jax.embedding.exchange.optimizers import SparseOptimizer
from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan
from dlrm_jax.model.parts import PartInputs


class WideState(NamedTuple):
    """tables: one weight per id of every feature and its optimizer state (replicated);
    linear: float32 [num_dense + 1, 1], the dense features' weights then the bias;
    linear_slots: its optimizer state."""

    tables: EmbeddingState
    linear: jax.Array
    linear_slots: dict


def wide_logits(inputs: PartInputs, dense_bd: jax.Array) -> jax.Array:
    """float32 [B]: the ids' summed weights (``inputs.pooled``, [B, F, 1]) plus the dense
    features' linear term and the bias (``inputs.weights``: ``linear``)."""
    w = inputs.weights[:, 0]
    return jnp.sum(inputs.pooled, axis=(1, 2)) + dense_bd.astype(jnp.float32) @ w[:-1] + w[-1]


class WidePart:
    """The wide part's plan, tables and optimizer on a mesh (one process or several): a
    :class:`~dlrm_jax.model.parts.SparsePart`, registered by Wide&Deep under the name ``wide``."""

    def __init__(
        self,
        plan: EmbeddingPlan,
        optimizer: SparseOptimizer,
        num_dense: int,
        learning_rate: float,
        mesh: jax.sharding.Mesh,
    ):
        """``plan``: the wide tables replicated on every device (``planner.wide_plan``);
        ``learning_rate``: the linear term's."""
        self.plan, self.optimizer = plan, optimizer
        self.collection = EmbeddingCollection(self.plan, mesh, self.optimizer)
        self.num_dense, self.learning_rate = num_dense, learning_rate
        self.replicated = NamedSharding(mesh, P())

    def state_sharding(self) -> WideState:
        linear = jax.eval_shape(self._linear_init)
        return WideState(
            self.collection.state_sharding(), self.replicated, jax.tree.map(lambda _: self.replicated, linear[1])
        )

    def _linear_init(self):
        linear = jnp.zeros((self.num_dense + 1, 1), jnp.float32)
        return linear, self.optimizer.init(linear)

    def init(self) -> WideState:
        """Zero weights (and the optimizer's initial state), on the mesh."""
        tables = self.collection.init(jax.random.key(0))
        sharding = self.state_sharding()
        tables = jax.jit(
            lambda e: e._replace(tables=jax.tree.map(jnp.zeros_like, e.tables)),
            out_shardings=sharding.tables,
            donate_argnums=0,
        )(tables)
        linear, slots = jax.jit(self._linear_init, out_shardings=(sharding.linear, sharding.linear_slots))()
        return WideState(tables, linear, slots)

    def lookup(self, state: WideState, ids_bs: jax.Array) -> tuple[PartInputs, LookupResiduals]:
        """The batch's pooled weights (local gathers) and what the update needs."""
        pooled, res = self.collection.lookup(state.tables, ids_bs)
        return PartInputs(pooled, state.linear), res

    def apply_gradients(self, state: WideState, res: LookupResiduals, grads: PartInputs) -> WideState:
        """The wide optimizer's step on the looked-up ids' weights and on the linear weights."""
        lr = jnp.float32(self.learning_rate)
        tables = self.collection.apply_gradients(state.tables, res, grads.pooled, lr)
        linear, slots = self.optimizer.apply(state.linear, state.linear_slots, None, grads.weights, lr)
        return WideState(tables, linear, slots)

    def logits(self, inputs: PartInputs, dense_bd: jax.Array) -> jax.Array:
        return wide_logits(inputs, dense_bd)

    def tables(self, state: WideState) -> EmbeddingState:
        return state.tables

    def with_tables(self, state: WideState, tables: EmbeddingState) -> WideState:
        return state._replace(tables=tables)

    def dense_arrays(self, state: WideState) -> dict[str, jax.Array]:
        return {"values": state.linear, **state.linear_slots}
