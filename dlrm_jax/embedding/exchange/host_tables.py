"""Per-host tables: every host keeps its own set of the tables, split over its own devices
(``embedding.sync=per_host`` or ``host_replicas``), behind the interface of the collection it
wraps, so the train step and the loop never ask which kind of tables they have.

The state carries a leading ``hosts`` axis and the batch's rows of host h are its own devices'
rows, so each host's lookups and updates run on its own devices (``over_hosts``). Per host, the
hosts' tables drift apart, each trained on its own data, and are averaged every ``sync_every``
steps (0: never); the model evaluated and exported is their average, and the loop logs how far
they drifted (``table_divergence``). Host replicas instead stay equal by construction: every
update applies every host's gradients (the collection agrees over the ``hosts`` axis), and host
0's copy is the model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlrm_jax.embedding.exchange.collection import EmbeddingCollection, EmbeddingState, LookupResiduals
from dlrm_jax.embedding.exchange.optimizers import SparseOptimizer
from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan
from dlrm_jax.parallel.mesh import HOST_AXIS, over_hosts


class HostTables:
    """One host's plan on each host of a (hosts, data, model) ``mesh``, with
    :class:`~dlrm_jax.embedding.exchange.collection.EmbeddingCollection`'s interface.
    ``replicas``: the hosts' tables are replicas kept equal (host_replicas); otherwise each
    host's own, averaged every ``sync_every`` steps (0: never)."""

    def __init__(
        self,
        plan: EmbeddingPlan,
        mesh: jax.sharding.Mesh,
        optimizer: SparseOptimizer | None = None,
        replicas: bool = False,
        sync_every: int = 0,
    ):
        if HOST_AXIS not in mesh.shape:
            raise ValueError("per-host tables need a (hosts, data, model) mesh (parallel.mesh.make_mesh(hosts=...))")
        self.inner = EmbeddingCollection(plan, mesh, optimizer, agree_over=HOST_AXIS if replicas else None)
        self.mesh, self.hosts = mesh, mesh.shape[HOST_AXIS]
        self.replicas, self.sync_every = replicas, 0 if replicas else sync_every
        self.table_copies, self.host_sets = self.hosts if replicas else 1, self.hosts
        inner = self.inner
        self.plan, self.groups, self.optimizer, self.specs = inner.plan, inner.groups, inner.optimizer, inner.specs
        self.dim, self.tiered_tables, self.hot = inner.dim, inner.tiered_tables, inner.hot
        self.slot_feature, self.forms = inner.slot_feature, inner.forms
        sharding = self.state_sharding()
        replicated = NamedSharding(mesh, P())
        self._average = jax.jit(average_over_hosts, in_shardings=(sharding,), out_shardings=sharding)
        self._sync = jax.jit(average_over_hosts, in_shardings=(sharding,), out_shardings=sharding, donate_argnums=0)
        self._divergence = jax.jit(table_divergence, in_shardings=(sharding,), out_shardings=replicated)
        self._broadcast = jax.jit(
            lambda e: jax.tree.map(lambda x: jnp.broadcast_to(x[None], (self.hosts, *x.shape)), e),
            out_shardings=sharding,
            donate_argnums=0,
        )

    # ------------------------------------------------------------ state
    @property
    def batch_sharding(self) -> NamedSharding:
        return self.inner.batch_sharding

    def state_sharding(self) -> EmbeddingState:
        """One host's state sharding with the ``hosts`` axis in front."""
        return jax.tree.map(lambda s: NamedSharding(self.mesh, P(HOST_AXIS, *s.spec)), self.inner.state_sharding())

    def init(self, key: jax.Array) -> EmbeddingState:
        """Every host starts from the same tables."""
        return self._broadcast(self.inner.init(key))

    def refresh(self, state, keys, index_keys=None):
        raise ValueError("hot rows (embedding.hot.rows) are not supported with per-host tables yet")

    def logical_tables(self, state: EmbeddingState):
        """One host's tables (``state`` without the hosts axis: a host's slice, or the
        :meth:`model_tables`' host 0), per table, as the collection gives them."""
        return self.inner.logical_tables(state)

    # ------------------------------------------------------------ the step
    def lookup(
        self, state: EmbeddingState, ids_bs: jax.Array, routed: dict | None = None
    ) -> tuple[jax.Array, LookupResiduals]:
        """(``routed`` must be empty: the id maps' routing is over the whole mesh, and each
        host's tables route their own lookups: ``DynamicTables.routed_group`` is None here.)"""
        if routed:
            raise ValueError("per-host tables route their own lookups: no routing of the id maps to reuse")
        pooled, res = over_hosts(self.inner.lookup, self.mesh)(state, self._by_host(ids_bs))
        return pooled.reshape(-1, *pooled.shape[2:]), res._replace(overflow=jnp.sum(res.overflow))

    def apply_gradients(
        self, state: EmbeddingState, res: LookupResiduals, grad_bfd: jax.Array, lr: jax.Array
    ) -> EmbeddingState:
        res = res._replace(overflow=jnp.zeros(self.hosts, jnp.int32))  # (not used by the update)
        lr_h = jnp.broadcast_to(lr, (self.hosts,))
        return over_hosts(self.inner.apply_gradients, self.mesh)(state, res, self._by_host(grad_bfd), lr_h)

    def _by_host(self, x: jax.Array) -> jax.Array:
        """[B, ...] -> [hosts, B / hosts, ...]: host h's rows are its own devices' rows."""
        return x.reshape(self.hosts, -1, *x.shape[1:])

    # ------------------------------------------------------------ what a training loop asks
    def after_step(self, state: EmbeddingState, step: int) -> EmbeddingState:
        """Every ``sync_every`` steps, the hosts' tables and optimizer state replaced by their
        average (one program of its own, donating ``state``)."""
        return self._sync(state) if self.sync_every and step % self.sync_every == 0 else state

    def step_metrics(self, state: EmbeddingState) -> dict[str, jax.Array]:
        """``table_divergence``: how far the hosts' tables have drifted apart."""
        return {"table_divergence": self._divergence(state)}

    def model_tables(self, state: EmbeddingState) -> EmbeddingState:
        """The model evaluated and exported: the hosts' average (replicas: the state itself,
        every host's copy being host 0's). Keeps the hosts axis."""
        return state if self.replicas else self._average(state)


def average_over_hosts(emb: EmbeddingState) -> EmbeddingState:
    """Every host's tables and optimizer state replaced by their mean over hosts (one
    all-reduce over the hosts axis per array)."""
    return jax.tree.map(lambda x: jnp.broadcast_to(jnp.mean(x, axis=0, keepdims=True), x.shape).astype(x.dtype), emb)


def table_divergence(emb: EmbeddingState) -> jax.Array:
    """How far the hosts' tables have drifted apart: sqrt(mean over hosts of ||T_h - T||^2)
    / ||T||, T the hosts' mean, over every table's values (the measure of Figure 4 of
    *Distributed Training of DLRM*)."""
    diff = mean_sq = jnp.float32(0)
    for table in emb.tables.values():
        x = table.astype(jnp.float32)
        # Deviations measured from host 0's copy first: equal tables give exactly 0 (a float
        # mean of H equal values need not equal them), and small drifts lose no digits.
        dev = x - x[:1]
        dev = dev - jnp.mean(dev, axis=0)
        diff += jnp.mean(jnp.sum(jnp.square(dev).reshape(x.shape[0], -1), axis=1))
        mean_sq += jnp.sum(jnp.square(jnp.mean(x, axis=0)))
    return jnp.sqrt(diff / jnp.maximum(mean_sq, 1e-30))
