"""The embedding collection: lookups and sparse updates of every table, following a plan.

Used inside the jitted train step as two calls around the dense model's autodiff:

    pooled_bfd, res = collection.lookup(state, ids_bs)             # forward
    ... gradient of the loss w.r.t. pooled_bfd ...
    state = collection.apply_gradients(state, res, grad_bfd, lr)   # sparse update on owners

``examples/two_tower.py`` shows the whole pattern in a model of the user's own.

The tables are never differentiated as arrays: gradients flow to the looked-up vectors only,
travel back through the exchange, and the sparse optimizer turns them into row updates.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlrm_jax.embedding.exchange.columns import segment_sum_axis1, take_columns
from dlrm_jax.embedding.exchange.forms import FormRequest, build_form
from dlrm_jax.embedding.exchange.hot_rows import HotRows, HotState, overlay
from dlrm_jax.embedding.exchange.initializer import init_group
from dlrm_jax.embedding.exchange.optimizers import SparseOptimizer, sparse_optimizer
from dlrm_jax.embedding.exchange.routing import route
from dlrm_jax.embedding.exchange.wire import Wire
from dlrm_jax.embedding.hot.index import hot_index
from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan
from dlrm_jax.embedding.plan.layout import (
    Group,
    VirtualTable,
    build_groups,
)
from dlrm_jax.embedding.plan.part_kinds import exchange_parts
from dlrm_jax.embedding.plan.specs import Pooling
from dlrm_jax.ids import PAD_ID
from dlrm_jax.parallel.mesh import (
    AXIS,
    HOST_AXIS,
    batch_spec,
    devices_per_host,
    host_local_mesh,
)


class EmbeddingState(NamedTuple):
    """Fused arrays and their optimizer state, keyed by group name, and the hot rows.

    tables[g]: [rows, width] (sharded groups: rows split over ``devices``, replicated: whole on
    every device); slots[g]: the sparse optimizer's dict of arrays with the same row axis;
    hot: the replicated hot group (:class:`~dlrm_jax.embedding.exchange.hot_rows.HotState`), or None
    when the plan replicates no hot rows.
    """

    tables: dict[str, jax.Array]
    slots: dict[str, dict[str, jax.Array]]
    hot: HotState | None = None


class LookupResiduals(NamedTuple):
    """What the backward pass needs from the forward lookup.

    ids_bs: int32 [B, S] the batch's cold ids (hot ones are PAD_ID); weights_bs: float32 [B, S]
    pooling weight of each slot (0 for padding, 1/bag length for mean pooling); overflow: int32
    [] parts whose exchange ran in rounds this step; routes: per exchange form (the
    collection's ``forms``), what its update needs from its forward (routing and buckets,
    requests received; fixed shapes), so nothing is routed twice; hot_bs: int32
    [B, S] each slot's hot row (-1 when cold), hot_counts: int32 [2] hot lookups and all
    lookups of the batch (both None without hot rows).
    """

    ids_bs: jax.Array
    weights_bs: jax.Array
    overflow: jax.Array
    routes: tuple
    hot_bs: jax.Array | None = None
    hot_counts: jax.Array | None = None


class EmbeddingCollection:
    """Every table of a plan, fused into groups, on a mesh: sharded lookups and sparse updates.

    A model of your own uses it inside its own ``jax.jit`` step::

        plan = dlrm_jax.plan_embeddings(specs, "row", 8, "adagrad", global_batch)
        tables = dlrm_jax.EmbeddingCollection(plan, dlrm_jax.make_mesh(8))
        emb = tables.init(jax.random.key(0))        # EmbeddingState, sharded as the plan says

        def step(params, emb, ids_bs):              # ids_bs: int32 [B, S], tables.batch_sharding
            pooled_bfd, res = tables.lookup(emb, ids_bs)
            loss, (g_params, g_bfd) = jax.value_and_grad(loss_fn, (0, 1))(params, pooled_bfd)
            emb = tables.apply_gradients(emb, res, g_bfd, lr)
            ...

    The tables are never differentiated as arrays: the loss's gradient w.r.t. the looked-up
    vectors goes back to the rows' owners, where the sparse optimizer updates those rows only.
    """

    def __init__(
        self,
        plan: EmbeddingPlan,
        mesh: jax.sharding.Mesh,
        optimizer: SparseOptimizer | None = None,
        tiered_tables: tuple[int, ...] = (),
        agree_over: str | None = None,
    ):
        """``plan``: the tables as the devices hold them (a tiered plan's ``device_view``,
        whose ``tiered_tables`` name the tables held as caches). ``optimizer``: the sparse
        optimizer (:func:`~dlrm_jax.embedding.exchange.optimizers.sparse_optimizer`); by default the one
        the plan names (``plan.optimizer``) with its default settings. A (hosts, data, model)
        ``mesh`` gives one host's collection: the plan is one host's, and its lookups and updates
        run inside ``parallel.mesh.over_hosts`` on the host's devices
        (:class:`~dlrm_jax.embedding.exchange.host_tables.HostTables` wraps it so).
        ``agree_over``: a mesh axis along which copies of the tables are kept equal, every
        update applying the gradients of every copy (embedding.sync=host_replicas: the hosts)."""
        self.tiered_tables = tuple(tiered_tables)
        optimizer = sparse_optimizer(plan.optimizer) if optimizer is None else optimizer
        specs = tuple(t.spec for t in plan.tables)
        if len({s.dim for s in specs}) != 1:
            raise ValueError(f"all tables must share one width, got {sorted({s.dim for s in specs})}")
        if devices_per_host(mesh) != plan.num_devices:  # (a per-host mesh has a "hosts" axis beside it)
            raise ValueError(f"the plan is for {plan.num_devices} devices, the mesh has {devices_per_host(mesh)}")
        self.plan, self.mesh, self.optimizer, self.specs = plan, mesh, optimizer, specs
        self.agree_over = agree_over
        exchange_mesh = host_local_mesh(mesh) if HOST_AXIS in mesh.shape else mesh
        self.dim = specs[0].dim
        self.groups = build_groups(plan)
        self.local_batch = plan.local_batch
        self.slot_feature = np.repeat(np.arange(len(specs)), [s.bag_size for s in specs]).astype(np.int32)
        self.one_hot = all(s.bag_size == 1 for s in specs)
        self.mean_pooling = np.array([s.pooling == Pooling.MEAN for s in specs])
        self.storage_dtype = jnp.dtype(plan.dtype)
        wire = Wire(plan.exchange_dtype)
        self.forms = [
            build_form(FormRequest(plan, part, exchange_mesh, wire, optimizer, self.dim, agree_over))
            for part in exchange_parts(plan, self.groups)
        ]
        # Flattened [F * D] column each form's output column fills -> inverse.
        filled = np.concatenate([f.cols for f in self.forms])
        assert sorted(filled.tolist()) == list(range(len(specs) * self.dim)), "plan leaves columns uncovered"
        self.assembly = np.argsort(filled).astype(np.int32)
        slot_table = np.repeat(np.arange(len(specs)), [s.bag_size for s in specs]).astype(np.int32)
        self.hot = (
            HotRows(
                plan.hot_rows,
                self.dim,
                self.groups,
                mesh,
                optimizer,
                slot_table,
                self.slot_feature,
                self.one_hot,
                self.tiered_tables,
            )
            if plan.hot_rows
            else None
        )
        self._refresh = None
        self._to_logical = None  # (compiled at the first call, its outputs' shardings from their shapes)

    # ------------------------------------------------------------ state
    @property
    def batch_sharding(self) -> NamedSharding:
        """Where the batch's arrays live: their leading (batch) axis split over every device of
        the mesh. ``lookup``'s ids and its pooled output, and the gradient passed to
        ``apply_gradients``, are laid out so (``jax.device_put(ids, tables.batch_sharding)``)."""
        return NamedSharding(self.mesh, batch_spec(self.mesh))

    def state_sharding(self) -> EmbeddingState:
        """The :class:`EmbeddingState` of :meth:`init`, as shardings (a pytree of
        ``NamedSharding``): for ``jax.jit``'s ``in_shardings``/``out_shardings``."""
        abstract = jax.eval_shape(self._init, jax.random.key(0))
        spec = {g.name: NamedSharding(self.mesh, P() if g.replicated else P(AXIS)) for g in self.groups}
        replicated = NamedSharding(self.mesh, P())
        return EmbeddingState(
            {k: spec[k] for k in abstract.tables},
            {k: jax.tree.map(lambda _, k=k: spec[k], v) for k, v in abstract.slots.items()},
            jax.tree.map(lambda _: replicated, abstract.hot),
        )

    def _init(self, key: jax.Array) -> EmbeddingState:
        # Every element is a function of (key, table, row, column), computed where it lives:
        # no device ever holds a whole logical table, and a table's values do not depend on the plan.
        rows = tuple(s.rows for s in self.specs)
        tables = {g.name: init_group(g, rows, key, self.storage_dtype) for g in self.groups}
        hot = self.hot.init(self.storage_dtype) if self.hot else None
        return EmbeddingState(tables, {name: self.optimizer.init(arr) for name, arr in tables.items()}, hot)

    def init(self, key: jax.Array) -> EmbeddingState:
        """Tables created directly on the mesh with their final sharding (the hot set empty:
        :meth:`refresh` chooses its rows)."""
        return jax.jit(self._init, out_shardings=self.state_sharding())(key)

    def refresh(self, state: EmbeddingState, keys: np.ndarray, index_keys: np.ndarray | None = None) -> EmbeddingState:
        """The state with the hot set ``keys`` (int32 [2, H], ``hot.index.hot_keys``): the rows
        hot until now written back to their owners, the new ones gathered, exactly. Donates
        ``state``; one compiled program for every refresh. Tiered tables' hot rows are left
        zero (``embedding/tiers/hot.py`` moves them); ``index_keys``: the pairs the step looks
        up (``hot.index.hot_step_keys``), when they differ from ``keys``."""
        if self.hot is None:
            raise ValueError("this plan replicates no hot rows (embedding.hot.rows=0)")
        if self._refresh is None:
            sharding = self.state_sharding()

            def refresh(state, keys, index, seeds):
                return EmbeddingState(*self.hot.refresh(state.tables, state.slots, state.hot, keys, index, seeds))

            replicated = NamedSharding(self.mesh, P())
            self._refresh = jax.jit(
                refresh,
                in_shardings=(sharding, replicated, replicated, replicated),
                out_shardings=sharding,
                donate_argnums=0,
            )
        keys = np.asarray(keys, np.int32)
        return self._refresh(state, keys, *hot_index(keys if index_keys is None else index_keys))

    def logical_tables(self, state: EmbeddingState) -> tuple[list[jax.Array], list[dict[str, jax.Array]]]:
        """Per table, its [rows, D] values and optimizer state, whatever the plan.

        One compiled program: run op by op, the gathers, concatenations and hot-row scatters
        over every group and table put dozens of multi-device programs in flight at once, and
        XLA:CPU's launch slots then starve a running program's collective of its last devices
        (the process aborts, as the dispatch limit in train/loop.py explains). Each comes split
        over the devices, by rows, or by columns where its rows do not divide among them:
        replicated, every device held every whole table, and an export of tables sharded
        because no device holds them all ran out of memory (8 simulated devices, 768 MB of
        tables: 16.5 GiB)."""
        if self._to_logical is None:
            fn = lambda state: to_logical(self.plan, self.groups, state)  # noqa: E731
            shapes = jax.eval_shape(fn, state)
            self._to_logical = jax.jit(fn, out_shardings=jax.tree.map(self._split, shapes))
        return self._to_logical(state)

    def _split(self, shape: jax.ShapeDtypeStruct) -> NamedSharding:
        n = math.prod(self.mesh.shape[a] for a in AXIS)  # (the devices P(AXIS) splits over)
        if shape.ndim and shape.shape[0] % n == 0:
            return NamedSharding(self.mesh, P(AXIS))
        if shape.ndim > 1 and shape.shape[1] % n == 0:
            return NamedSharding(self.mesh, P(None, AXIS))
        return NamedSharding(self.mesh, P())

    # ------------------------------------------------------------ what a training loop asks of any tables
    # (HostTables, per-host tables around a collection, answers them otherwise)
    table_copies = 1  # copies of the tables that apply every update (host replicas: the hosts)
    host_sets = 0  # hosts holding a set of the tables each (HostTables); 0: one set over the mesh
    sync_every = 0  # steps between the hosts' averages of their tables (HostTables); 0: none

    def after_step(self, state: EmbeddingState, step: int) -> EmbeddingState:
        """What a training loop applies to the tables after step ``step``: nothing here."""
        return state

    def step_metrics(self, state: EmbeddingState) -> dict[str, jax.Array]:
        """Scalars a training loop logs about the tables: none here."""
        return {}

    def model_tables(self, state: EmbeddingState) -> EmbeddingState:
        """The tables the trained model is, for evaluation and export: ``state`` itself here."""
        return state

    # ------------------------------------------------------------ forward
    def lookup(
        self, state: EmbeddingState, ids_bs: jax.Array, routed: dict | None = None
    ) -> tuple[jax.Array, LookupResiduals]:
        """ids_bs int32 [B, S] (batch-sharded) -> pooled vectors float32 [B, F, D] (batch-sharded)
        and the residuals :meth:`apply_gradients` needs.

        F: the plan's tables in order, one feature each; S: their bag sizes summed, each table's
        slots after the previous table's, holding row numbers of that table (0 .. rows - 1;
        ``PAD_ID`` = -1 marks an empty slot of a bag). B: the plan's ``global_batch``, which the
        exchange's buffers are sized for. ``routed``: {group name: how the id maps' resolution
        sent its requests already} (``DynamicTables.resolve``), reused by its form."""
        if ids_bs.ndim != 2 or ids_bs.shape[1] != len(self.slot_feature):
            raise ValueError(
                f"ids must have shape [batch, {len(self.slot_feature)}] (the tables' bag sizes summed, "
                f"each table's slots after the previous one's), got {list(ids_bs.shape)}"
            )
        weights_bs = self._pool_weights(ids_bs)  # hot ids count in a bag's mean too
        hot_bs = hot_pooled = hot_counts = None
        if self.hot:
            hot_bs, ids_bs, hot_pooled, hot_counts = self.hot.lookup(state.hot, ids_bs, weights_bs)
        outputs, overflow, residuals = [], jnp.zeros((), jnp.int32), []
        for form in self.forms:
            given = {} if not routed or form.group.name not in routed else {"routed": routed[form.group.name]}
            out, residual, over = form.forward(state.tables[form.group.name], ids_bs, weights_bs, **given)
            outputs.append(out)
            residuals.append(residual)
            overflow = overflow + over
        flat = take_columns(jnp.concatenate(outputs, axis=1), self.assembly)
        pooled = flat.reshape(-1, len(self.specs), self.dim)
        if self.hot:
            pooled = pooled + hot_pooled
        return pooled, LookupResiduals(ids_bs, weights_bs, overflow, tuple(residuals), hot_bs, hot_counts)

    def _pool_weights(self, ids_bs: jax.Array) -> jax.Array:
        valid_bs = (ids_bs != PAD_ID).astype(jnp.float32)
        if self.one_hot or not self.mean_pooling.any():
            return valid_bs
        count_bf = segment_sum_axis1(valid_bs, self.slot_feature, len(self.specs))
        denom_bs = jnp.where(
            self.mean_pooling[self.slot_feature], jnp.maximum(count_bf[:, self.slot_feature], 1.0), 1.0
        )
        return valid_bs / denom_bs

    # ------------------------------------------------------------ backward + update
    def apply_gradients(
        self, state: EmbeddingState, res: LookupResiduals, grad_bfd: jax.Array, lr: jax.Array
    ) -> EmbeddingState:
        """Sparse update of the looked-up rows from the gradient w.r.t. the pooled vectors.

        ``res``: :meth:`lookup`'s residuals of the same step; ``grad_bfd`` [B, F, D]
        (batch-sharded): the loss's gradient w.r.t. ``lookup``'s output, float32 or the
        dtype the model read it in (its values, exactly: bfloat16 gives the same bits as its
        float32 copy); ``lr``: the sparse optimizer's learning rate (a scalar, may be traced).
        Only the looked-up rows change."""
        flat = grad_bfd.reshape(grad_bfd.shape[0], -1)
        # float32 from the start, but for forms that read it as it comes (ExchangeForm's
        # ``reads_any_float``: the fused kernels read it where it lies)
        wide = flat.astype(jnp.float32)
        tables, slots = dict(state.tables), dict(state.slots)
        for form, residual in zip(self.forms, res.routes, strict=True):
            name = form.group.name  # (two parts of one array update it in turn)
            grad = flat if getattr(form, "reads_any_float", False) else wide
            tables[name], slots[name] = form.update(
                tables[name], slots[name], residual, take_columns(grad, form.cols), lr
            )
        hot = (
            self.hot.update(state.hot, res.hot_bs, res.weights_bs, wide.reshape(grad_bfd.shape), lr)
            if self.hot
            else None
        )
        return EmbeddingState(tables, slots, hot)


def physical_rows(g: Group, vt: VirtualTable, ids: jax.Array) -> jax.Array:
    """Rows of a group's fused array that hold a virtual table's ``ids``."""
    owner, row, _ = route(ids, vt.kind, vt.device, vt.offset, vt.block, g.num_devices)
    return row if g.replicated else owner * g.local_rows + row


def to_logical(plan: EmbeddingPlan, groups: list[Group], state: EmbeddingState):
    """Fused arrays -> per table: values float32 [rows, D] and the optimizer state dict (hot
    rows read from the hot copies, which their owners' stale rows do not reflect)."""
    values = [[None] * t.column_slices for t in plan.tables]
    slots = [[None] * t.column_slices for t in plan.tables]
    for g in groups:
        for vt in g.vtables:
            rows = physical_rows(g, vt, jnp.arange(vt.rows, dtype=jnp.int32))
            j = vt.col_start // g.width
            values[vt.table][j] = state.tables[g.name][rows].astype(jnp.float32)
            slots[vt.table][j] = {k: v[rows] for k, v in state.slots[g.name].items()}
    tables = [jnp.concatenate(parts, axis=1) for parts in values]
    opt = [
        {k: jnp.concatenate([p[k] for p in parts], axis=-1) if parts[0][k].ndim > 1 else parts[0][k] for k in parts[0]}
        for parts in slots
    ]
    return overlay(tables, opt, state.hot) if state.hot is not None else (tables, opt)
