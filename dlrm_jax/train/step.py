"""The jitted train and eval steps, and the train state they carry.

One train step: embedding lookup -> dense DLRM forward and loss -> gradients w.r.t. the dense
parameters and the looked-up vectors -> optax update of the dense part and sparse update of the
tables. The state is donated, the batch is sharded over every device (``batch_spec``: the
mesh's ``data`` and ``model`` axes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlrm_jax.config import ConfigError
from dlrm_jax.data.batch import Batch
from dlrm_jax.data.packed import HostPacked, Packed, PackedLayout, unpacked
from dlrm_jax.embedding.exchange.collection import EmbeddingCollection, EmbeddingState
from dlrm_jax.embedding.exchange.host_tables import HostTables
from dlrm_jax.embedding.hot.index import hot_keys
from dlrm_jax.embedding.hot.schedule import HotSchedule
from dlrm_jax.embedding.tiers.device_fill import fill_caches
from dlrm_jax.model.dlrm import bce_loss
from dlrm_jax.model.mlp_parallel import (
    PipelinePlan,
    TensorLayout,
    check_tensor_widths,
    tensor_param_specs,
)
from dlrm_jax.model.wide import WideInputs, WidePart, WideState, wide_logits
from dlrm_jax.observe.trace import PHASE_SCOPES
from dlrm_jax.parallel.mesh import MODEL_AXIS, batch_spec


class TrainState(NamedTuple):
    """Everything a checkpoint holds; a pytree of arrays.

    step: int32 []; params: the dense model's parameters (nested dict, replicated);
    opt_state: optax state of the dense part; emb: tables and sparse optimizer state;
    wide: the wide part of Wide&Deep (:class:`~dlrm_jax.model.wide.WideState`), else empty.
    """

    step: jax.Array
    params: dict
    opt_state: optax.OptState
    emb: EmbeddingState
    wide: WideState | dict = {}  # noqa: RUF012 - never mutated: an empty pytree node


class CacheIO(NamedTuple):
    """A tiered train step's device-cache traffic (embedding/tiers/device_fill.py): the rows
    this step fills into its groups' caches, and the rows the previous program evicted (their
    slots are free once this step has read them)."""

    fills: dict
    prev: dict


@dataclass(frozen=True)
class StepSpec:
    """What the steps are built from, made at the edge from a config (``wiring.step_spec``):
    ``dense(rngs)``: the dense model (``wiring.ModelEntry.dense``), ``wide``: a wide part whose
    logits are added (None: none), ``tx`` and ``schedule``: the dense optimizer and its learning
    rate per step, ``emb_lr_scale``: the tables' learning rate over the dense part's, ``seed``:
    of the parameters and the tables, ``batch_size``: the global batch, ``bag_sizes`` and
    ``num_dense``: the batch's shape, ``mlp_parallel`` and ``microbatches``: the dense layers'
    layout over a model group's devices."""

    dense: Callable[[nnx.Rngs], nnx.Module]
    wide: WidePart | None
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    emb_lr_scale: float
    seed: int
    batch_size: int
    bag_sizes: tuple[int, ...]
    num_dense: int
    mlp_parallel: str = "data"
    microbatches: int = 1


class StepFunctions:
    """Builds the model, the initial state and the compiled steps for one config and mesh.

    ``train_step(state, batch, cache=None) -> (state, metrics, evicted)`` whatever the features:
    ``cache`` (a :class:`CacheIO`) is given exactly when tiered tables fill device caches, and
    ``evicted`` is then the rows this step pushed out (empty otherwise). ``eval_step(state,
    batch[, host_pooled])`` returns probabilities.
    """

    def __init__(
        self,
        spec: StepSpec,
        mesh: jax.sharding.Mesh,
        collection: EmbeddingCollection | HostTables,
        hot: HotSchedule | None = None,
        cache_groups: tuple[str, ...] = (),
    ):
        """``hot``: when the plan replicates hot rows, the schedule that knows which (the
        initial state starts with its current rows). ``cache_groups``: the groups holding
        device caches of tiered tables (``collection.tiered_tables``); the train step then
        takes each program's fills and the previous program's evictions and returns its own
        (embedding/tiers/device_fill.py)."""
        self.spec, self.mesh, self.collection, self.hot = spec, mesh, collection, hot
        self.cache_groups, self.tiered_tables = cache_groups, collection.tiered_tables
        model = spec.dense(nnx.Rngs(0))
        self.graphdef, params = nnx.split(model, nnx.Param)
        self._dense_layout(spec, mesh, model, nnx.to_pure_dict(params))
        self.schedule, self.tx, self.emb_lr_scale, self.wide = spec.schedule, spec.tx, spec.emb_lr_scale, spec.wide
        self.replicated = NamedSharding(mesh, P())
        self.batch_sharding = NamedSharding(mesh, batch_spec(mesh))
        self.state_sharding = self._state_sharding()
        self.saved_sharding = self._state_sharding(saved_form=True)
        b = self.batch_sharding
        # A tiered run's cache fills, as a program of their own (the tier runner's first fills).
        self.fill_step = jax.jit(
            self._fill_step,
            in_shardings=(self.state_sharding.emb, b, b),
            out_shardings=(self.state_sharding.emb, b),
            donate_argnums=0,
        )
        # The pipeline's packed parameters to and from the checkpoints' layout (checkpoint_form).
        self._unpack = jax.jit(
            lambda p, o: (self.pipeline.unpack(p), self._map_params(self.pipeline.unpack, o)),
            out_shardings=(self.saved_sharding.params, self.saved_sharding.opt_state),
        )
        if cache_groups:
            self.train_step = jax.jit(
                self._train_step,
                in_shardings=(self.state_sharding, b, CacheIO(b, b)),
                out_shardings=(self.state_sharding, self.replicated, b),
                donate_argnums=0,
            )
            self.eval_step = jax.jit(self._eval_step, in_shardings=(self.state_sharding, b, b), out_shardings=b)
        else:
            self.train_step = jax.jit(
                self._train_step,
                in_shardings=(self.state_sharding, self.batch_sharding),
                out_shardings=(self.state_sharding, self.replicated, self.batch_sharding),
                donate_argnums=0,
            )
            self.eval_step = jax.jit(
                self._eval_step,
                in_shardings=(self.state_sharding, self.batch_sharding),
                out_shardings=self.batch_sharding,
            )
        # Compiled on first use (a state about to be checkpointed); tiered runs pass the batch
        # with the cache ids its train step used, whose rows the caches still hold.
        self.state_check = jax.jit(
            self._state_check, in_shardings=(self.state_sharding, self.batch_sharding), out_shardings=self.replicated
        )

    def _dense_layout(self, spec: StepSpec, mesh, model, params: dict) -> None:
        """model.mlp_parallel: the tensor layout or the pipeline plan (model/mlp_parallel.py)."""
        self.tensor = self.pipeline = None
        groups = mesh.shape[MODEL_AXIS]
        if spec.mlp_parallel == "tensor":
            check_tensor_widths(params, groups)
            self.tensor = TensorLayout(mesh)
        elif spec.mlp_parallel == "pipeline":
            rows = spec.batch_size // (mesh.size // groups)
            if rows % spec.microbatches:
                raise ConfigError(
                    f"model.microbatches={spec.microbatches} must divide the {rows} rows of a "
                    f"model group (train.batch_size / (devices / mesh.model))"
                )
            self.pipeline = PipelinePlan(model, params, groups, spec.microbatches)

    # ------------------------------------------------------------ state
    def _dense_init(self):
        model = self.spec.dense(nnx.Rngs(self.spec.seed))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        if self.pipeline is not None:
            params = self.pipeline.pack(params)
        return params, self.tx.init(params)

    def _state_sharding(self, saved_form: bool = False) -> TrainState:
        """The state's shardings; ``saved_form``: of the form checkpoints hold
        (:meth:`checkpoint_form`), the pipeline's parameters unpacked."""
        params, opt = jax.eval_shape(self._dense_init)
        if self.pipeline is not None:
            split = NamedSharding(self.mesh, P(MODEL_AXIS))
            params_sharding = jax.tree.map(lambda _: split, params)
            if saved_form:
                params = jax.eval_shape(self.pipeline.unpack, params)
                opt = jax.eval_shape(lambda o: self._map_params(self.pipeline.unpack, o), opt)
                params_sharding = jax.tree.map(lambda _: self.replicated, params)
        elif self.tensor is not None:
            params_sharding = jax.tree.map(
                lambda spec: NamedSharding(self.mesh, spec),
                tensor_param_specs(params),
                is_leaf=lambda x: isinstance(x, P),
            )
        else:
            params_sharding = jax.tree.map(lambda _: self.replicated, params)
        params_def = jax.tree.structure(params)
        # Optimizer state: the subtrees shaped like the parameters are laid out like them.
        opt_sharding = jax.tree.map(
            lambda sub: params_sharding if jax.tree.structure(sub) == params_def else self.replicated,
            opt,
            is_leaf=lambda sub: jax.tree.structure(sub) == params_def,
        )
        emb = self.collection.state_sharding()
        wide = self.wide.state_sharding() if self.wide else {}
        return TrainState(self.replicated, params_sharding, opt_sharding, emb, wide)

    def _map_params(self, fn, tree):
        """``fn`` applied to every subtree of ``tree`` shaped like the (packed) parameters."""
        return map_like(fn, tree, jax.tree.structure(self.state_sharding.params))

    def checkpoint_form(self, state: TrainState) -> TrainState:
        """The state as checkpoints hold it: every mode's dense parameters in one layout (the
        pipeline's packed stages unpacked), so a checkpoint restores under any model.mlp_parallel."""
        if self.pipeline is None:
            return state
        params, opt = self._unpack(state.params, state.opt_state)
        return state._replace(params=params, opt_state=opt)

    def from_checkpoint_form(self, state: TrainState) -> TrainState:
        """Inverse of :meth:`checkpoint_form`."""
        if self.pipeline is None:
            return state
        saved = jax.tree.structure(self.saved_sharding.params)
        params, opt = jax.jit(
            lambda p, o: (self.pipeline.pack(p), map_like(self.pipeline.pack, o, saved)),
            out_shardings=(self.state_sharding.params, self.state_sharding.opt_state),
        )(state.params, state.opt_state)
        return state._replace(params=params, opt_state=opt)

    def init_state(self, hot: bool = True) -> TrainState:
        """The initial state, created on the mesh with its final shardings; ``hot=False``:
        the hot set left empty (tiered runs fill it through their ``TierRunner``)."""
        params, opt = jax.jit(
            self._dense_init, out_shardings=(self.state_sharding.params, self.state_sharding.opt_state)
        )()
        emb = self.collection.init(self.embedding_key())
        if self.hot is not None and hot:
            emb = self.collection.refresh(emb, self.hot_keys())
        step = jax.device_put(jnp.zeros((), jnp.int32), self.replicated)
        return TrainState(step, params, opt, emb, self.wide.init() if self.wide else {})

    def hot_keys(self) -> np.ndarray:
        """The hot set the schedule's statistics now rank hottest (``hot.index.hot_keys``)."""
        return hot_keys(self.hot.current_rows(), self.hot.capacity)

    def embedding_key(self) -> jax.Array:
        """The key every table's initial values derive from (tiered tables' too)."""
        return jax.random.fold_in(jax.random.key(self.spec.seed), 1)

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state as checkpoints hold it
        (:meth:`checkpoint_form`), for restoring a checkpoint onto this mesh."""
        shapes = jax.eval_shape(lambda: self.checkpoint_form(self.init_state()))
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.saved_sharding
        )

    def device_batch(self, batch: Batch | HostPacked) -> Batch | Packed:
        """This process's numpy slice -> one global array per field, sharded over the mesh (one
        call for the three: a single process puts them in one batched transfer); a packed one
        -> one array of bytes the train step unpacks (:mod:`dlrm_jax.data.packed`)."""
        if isinstance(batch, HostPacked):
            return Packed(jax.make_array_from_process_local_data(self.batch_sharding, batch.buf), batch.layout)
        return Batch(*jax.make_array_from_process_local_data(self.batch_sharding, tuple(batch)))

    def packed_layout(self) -> PackedLayout:
        """How this process's slice of a batch is packed: a shard per local device."""
        shards = len(self.batch_sharding.addressable_devices)
        local = self.spec.batch_size // jax.process_count()
        return PackedLayout(shards, local // shards, sum(self.spec.bag_sizes), self.spec.num_dense)

    # ------------------------------------------------------------ steps
    def _forward(self, params, pooled_bfd, batch: Batch, wide: WideInputs | None = None):
        if self.pipeline is not None:
            logits = self.pipeline.logits(self.mesh, params, batch.dense, pooled_bfd)
        else:
            logits = nnx.merge(self.graphdef, params)(batch.dense, pooled_bfd, self.tensor)
        return logits if wide is None else logits + wide_logits(wide, batch.dense)

    def _fill_step(self, emb: EmbeddingState, fills: dict, prev: dict):
        groups = {g.name: g for g in self.collection.groups}
        tables, slots, evicted = fill_caches(groups, self.mesh, emb.tables, emb.slots, fills, prev)
        return emb._replace(tables=tables, slots=slots), evicted

    def _train_step(self, state: TrainState, batch: Batch, cache: CacheIO | None = None):
        """(state, metrics, evicted): ``evicted`` is empty unless the step fills device caches."""
        evicted, batch = {}, unpacked(batch, self.mesh, self.batch_sharding.spec)
        if self.cache_groups:  # the device caches take this batch's rows first
            with jax.named_scope(PHASE_SCOPES["cache_fill"]):
                emb, evicted = self._fill_step(state.emb, cache.fills, cache.prev)
            state = state._replace(emb=emb)
        # The named scopes mark the phases in the compiled program's metadata (dlrm-jax profile).
        with jax.named_scope(PHASE_SCOPES["exchange_forward"]):
            pooled_bfd, res = self.collection.lookup(state.emb, batch.ids)
            wide, wide_res = self.wide.lookup(state.wide, batch.ids) if self.wide else (None, None)

        def loss_fn(params, pooled_bfd, wide):
            return jnp.mean(bce_loss(self._forward(params, pooled_bfd, batch, wide), batch.labels))

        with jax.named_scope(PHASE_SCOPES["dense"]):
            loss, (grad_params, grad_bfd, grad_wide) = jax.value_and_grad(loss_fn, argnums=(0, 1, 2))(
                state.params, pooled_bfd, wide
            )
        with jax.named_scope(PHASE_SCOPES["dense_optimizer"]):
            updates, opt_state = self.tx.update(grad_params, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        with jax.named_scope(PHASE_SCOPES["sparse_update"]):
            emb_lr = self.schedule(state.step) * self.emb_lr_scale
            emb = self.collection.apply_gradients(state.emb, res, grad_bfd, emb_lr)
            new_wide = self.wide.apply_gradients(state.wide, wide_res, grad_wide) if self.wide else state.wide
        metrics = {"loss": loss, "exchange_overflows": res.overflow}
        if res.hot_counts is not None:
            metrics["hot_counts"] = res.hot_counts
        new_state = TrainState(state.step + 1, params, opt_state, emb, new_wide)
        return new_state, metrics, evicted

    def _state_check(self, state: TrainState, batch: Batch) -> tuple[jax.Array, jax.Array]:
        """(mean loss of ``state`` on ``batch``, whether every float of ``state`` is finite),
        replicated scalars; nothing trained. A train step reports the loss of the state it
        starts from, so its own update shows only here (or in the next step's loss)."""
        batch = unpacked(batch, self.mesh, self.batch_sharding.spec)
        pooled_bfd, _ = self.collection.lookup(state.emb, batch.ids)
        wide = self.wide.lookup(state.wide, batch.ids)[0] if self.wide else None
        loss = jnp.mean(bce_loss(self._forward(state.params, pooled_bfd, batch, wide), batch.labels))
        floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.inexact)]
        return loss, jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in floats]))

    def _eval_step(self, state: TrainState, batch: Batch, host_pooled: jax.Array | None = None) -> jax.Array:
        """``host_pooled``: with tiered tables, their features' pooled vectors read on the
        host (the batch's ids of those tables are padding here). Per host: each host looks up
        its rows in its own tables of ``state`` (``evaluate`` passes the hosts' average)."""
        pooled_bfd, _ = self.collection.lookup(state.emb, batch.ids)
        if host_pooled is not None:
            pooled_bfd = pooled_bfd + host_pooled
        wide = self.wide.lookup(state.wide, batch.ids)[0] if self.wide else None
        return jax.nn.sigmoid(self._forward(state.params, pooled_bfd, batch, wide))


def map_like(fn, tree, treedef):
    """``fn`` applied to every subtree of ``tree`` with structure ``treedef`` (an optimizer
    state's copies of the parameters), other leaves kept."""
    like = lambda sub: jax.tree.structure(sub) == treedef
    return jax.tree.map(lambda sub: fn(sub) if like(sub) else sub, tree, is_leaf=like)
