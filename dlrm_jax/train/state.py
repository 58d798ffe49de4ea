"""The train state and its layout on the mesh: what a checkpoint holds, where each array lives,
how a fresh state is made, and the form checkpoints keep (the pipeline's packed stages
unpacked, so a checkpoint restores under any ``model.mlp_parallel``)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlrm_jax.embedding.dynamic.idmap import IdMap
from dlrm_jax.embedding.exchange.collection import EmbeddingCollection, EmbeddingState
from dlrm_jax.embedding.exchange.dynamic_tables import CachedDynamicTables, DynamicTables
from dlrm_jax.embedding.exchange.host_tables import HostTables
from dlrm_jax.embedding.hot.index import hot_keys
from dlrm_jax.embedding.hot.schedule import HotSchedule
from dlrm_jax.model.mlp_parallel import (
    PipelinePlan,
    TensorLayout,
    check_microbatches,
    tensor_param_specs,
)
from dlrm_jax.parallel.mesh import MODEL_AXIS
from dlrm_jax.train.spec import CORE_FIELDS, MAPS, StepSpec


class TrainState(NamedTuple):
    """Everything a checkpoint holds; a pytree of arrays.

    step: int32 []; params: the dense model's parameters (nested dict, replicated);
    opt_state: optax state of the dense part; emb: tables and sparse optimizer state;
    parts: each extra sparse part's state by its name (:mod:`dlrm_jax.model.parts`;
    Wide&Deep's ``wide``: :class:`~dlrm_jax.model.wide.WideState`), else empty; maps: the
    dynamic tables' id maps by table name (:class:`~dlrm_jax.embedding.dynamic.idmap.IdMap`),
    else empty.
    """

    step: jax.Array
    params: dict
    opt_state: optax.OptState
    emb: EmbeddingState
    parts: dict = {}  # noqa: RUF012 - never mutated: an empty pytree node
    maps: dict = {}  # noqa: RUF012 - the same

    def saved_tree(self) -> dict:
        """The tree checkpoints hold: the parts beside the state's own fields, each under its
        name (a Wide&Deep checkpoint's ``wide`` is where it always was), and the id maps, when
        there are any, under ``maps`` (each a dict of its arrays)."""
        maps = {MAPS: {k: m._asdict() for k, m in self.maps.items()}} if self.maps else {}
        return {**{k: getattr(self, k) for k in CORE_FIELDS}, **self.parts, **maps}

    @classmethod
    def from_saved_tree(cls, tree: dict) -> TrainState:
        """Inverse of :meth:`saved_tree`."""
        maps = {k: IdMap(**m) for k, m in tree.get(MAPS, {}).items()}
        parts = {k: v for k, v in tree.items() if k not in (*CORE_FIELDS, MAPS)}
        return cls(**{k: tree[k] for k in CORE_FIELDS}, parts=parts, maps=maps)


class StateLayout:
    """The train state of one :class:`~dlrm_jax.train.spec.StepSpec` on one mesh: the dense
    model's layout (``tensor``, ``pipeline``: model.mlp_parallel), the state's shardings as it
    trains (``sharding``) and as checkpoints hold it (``saved_sharding``), a fresh state
    (:meth:`init`) and the checkpoint form."""

    def __init__(
        self,
        spec: StepSpec,
        mesh: jax.sharding.Mesh,
        collection: EmbeddingCollection | HostTables,
        hot: HotSchedule | None = None,
    ):
        self.spec, self.mesh, self.collection, self.hot = spec, mesh, collection, hot
        self.tx, self.parts = spec.tx, spec.parts
        # Dynamic tables: on the devices, their maps in the state; tiered, their maps on the
        # host (the tier's, embedding/dynamic/host_maps.py) and their fresh cache slots reset here.
        tiered = collection.tiered_tables
        device_maps = {t: s for t, s in spec.maps.items() if t not in tiered}
        self.tiered_maps = {t: s for t, s in sorted(spec.maps.items()) if t in tiered}
        # (the extra parts read the rows; else only the lookup, which can reuse the maps' route)
        only_lookups = not spec.parts
        self.dynamic = DynamicTables(collection, device_maps, spec.new_rows, only_lookups) if device_maps else None
        self.cached_dynamic = (
            CachedDynamicTables(collection, self.tiered_maps, spec.new_rows) if self.tiered_maps else None
        )
        # Shapes only: a model built with values here compiled one random draw per layer shape.
        model = nnx.eval_shape(lambda: spec.dense(nnx.Rngs(0)))
        self.graphdef, params = nnx.split(model, nnx.Param)
        # what the model reads the pooled vectors in (a model of one's own that says nothing: float32)
        self.pooled_dtype = jnp.dtype(getattr(model, "pooled_dtype", jnp.float32))
        self._dense_layout(spec, mesh, model, nnx.to_pure_dict(params))
        self.replicated = NamedSharding(mesh, P())
        self.sharding = self._sharding()
        self.saved_sharding = self._sharding(saved_form=True)
        # The pipeline's packed parameters to the checkpoints' layout (checkpoint_form).
        self._unpack = jax.jit(
            lambda p, o: (self.pipeline.unpack(p), self._map_params(self.pipeline.unpack, o)),
            out_shardings=(self.saved_sharding.params, self.saved_sharding.opt_state),
        )

    def _dense_layout(self, spec: StepSpec, mesh, model, params: dict) -> None:
        """model.mlp_parallel: the tensor layout or the pipeline plan (model/mlp_parallel.py)."""
        self.tensor = self.pipeline = None
        groups = mesh.shape[MODEL_AXIS]
        if spec.mlp_parallel == "tensor":
            self.tensor = TensorLayout(mesh)
        elif spec.mlp_parallel == "pipeline":
            check_microbatches(spec.batch_size, mesh.size, groups, spec.microbatches)
            self.pipeline = PipelinePlan(model, params, groups, spec.microbatches)

    def _dense_init(self):
        model = self.spec.dense(nnx.Rngs(self.spec.seed))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        if self.pipeline is not None:
            params = self.pipeline.pack(params)
        return params, self.tx.init(params)

    def _sharding(self, saved_form: bool = False) -> TrainState:
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
        parts = {name: part.state_sharding() for name, part in self.parts.items()}
        maps = self.dynamic.maps_sharding(by_table=saved_form) if self.dynamic else {}
        return TrainState(self.replicated, params_sharding, opt_sharding, emb, parts, maps)

    def _map_params(self, fn, tree):
        """``fn`` applied to every subtree of ``tree`` shaped like the (packed) parameters."""
        return map_like(fn, tree, jax.tree.structure(self.sharding.params))

    def checkpoint_form(self, state: TrainState) -> dict:
        """The state as checkpoints hold it (:meth:`TrainState.saved_tree`): every mode's dense
        parameters in one layout (the pipeline's packed stages unpacked), so a checkpoint
        restores under any model.mlp_parallel; dynamic tables' maps each its own, so that they
        restore onto any device count."""
        if self.pipeline is not None:
            params, opt = self._unpack(state.params, state.opt_state)
            state = state._replace(params=params, opt_state=opt)
        if self.dynamic is not None and state.maps:
            state = state._replace(maps=self.dynamic.by_table(state.maps))
        return state.saved_tree()

    def from_checkpoint_form(self, saved: dict) -> TrainState:
        """Inverse of :meth:`checkpoint_form`."""
        state = TrainState.from_saved_tree(saved)
        if self.dynamic is not None and state.maps:
            state = state._replace(maps=self.dynamic.joined(state.maps))
        if self.pipeline is None:
            return state
        saved = jax.tree.structure(self.saved_sharding.params)
        params, opt = jax.jit(
            lambda p, o: (self.pipeline.pack(p), map_like(self.pipeline.pack, o, saved)),
            out_shardings=(self.sharding.params, self.sharding.opt_state),
        )(state.params, state.opt_state)
        return state._replace(params=params, opt_state=opt)

    def init(self, hot: bool = True) -> TrainState:
        """The initial state, created on the mesh with its final shardings; ``hot=False``:
        the hot set left empty (tiered runs fill it through their ``TierRunner``)."""
        params, opt = jax.jit(self._dense_init, out_shardings=(self.sharding.params, self.sharding.opt_state))()
        emb = self.collection.init(self.embedding_key())
        if self.hot is not None and hot:
            emb = self.collection.refresh(emb, self.hot_keys())
        step = jax.device_put(jnp.zeros((), jnp.int32), self.replicated)
        parts = {name: part.init() for name, part in self.parts.items()}
        return TrainState(step, params, opt, emb, parts, self.dynamic.init_maps() if self.dynamic else {})

    def hot_keys(self) -> np.ndarray:
        """The hot set the schedule's statistics now rank hottest (``hot.index.hot_keys``)."""
        return hot_keys(self.hot.current_rows(), self.hot.capacity)

    def embedding_key(self) -> jax.Array:
        """The key every table's initial values derive from (tiered tables' too)."""
        return jax.random.fold_in(jax.random.key(self.spec.seed), 1)

    def abstract(self) -> dict:
        """Shapes, dtypes and shardings of the state as checkpoints hold it
        (:meth:`checkpoint_form`), for restoring a checkpoint onto this mesh."""
        shapes = jax.eval_shape(lambda: self.checkpoint_form(self.init()))
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.saved_sharding.saved_tree()
        )


def map_like(fn, tree, treedef):
    """``fn`` applied to every subtree of ``tree`` with structure ``treedef`` (an optimizer
    state's copies of the parameters), other leaves kept."""
    like = lambda sub: jax.tree.structure(sub) == treedef
    return jax.tree.map(lambda sub: fn(sub) if like(sub) else sub, tree, is_leaf=like)
