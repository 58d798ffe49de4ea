"""The jitted train and eval steps (the state they carry and its layout: ``train/state.py``).

One train step: embedding lookup -> dense DLRM forward and loss -> gradients w.r.t. the dense
parameters and the looked-up vectors -> optax update of the dense part and sparse update of the
tables. The state is donated, the batch is sharded over every device (``batch_spec``: the
mesh's ``data`` and ``model`` axes).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlrm_jax.data.batch import Batch, RawBatch
from dlrm_jax.data.packed import HostPacked, Packed, PackedLayout, unpacked
from dlrm_jax.embedding.dynamic.idmap import STATS
from dlrm_jax.embedding.dynamic.sharded import FreshRows
from dlrm_jax.embedding.exchange.collection import EmbeddingCollection, EmbeddingState
from dlrm_jax.embedding.exchange.host_tables import HostTables
from dlrm_jax.embedding.hot.schedule import HotSchedule
from dlrm_jax.embedding.tiers.device_fill import fill_caches
from dlrm_jax.model.dlrm import bce_loss
from dlrm_jax.model.parts import PartInputs
from dlrm_jax.observe.trace import PHASE_SCOPES
from dlrm_jax.parallel.mesh import batch_spec
from dlrm_jax.train.spec import StepSpec
from dlrm_jax.train.state import StateLayout, TrainState
from dlrm_jax.train.watch import read_back


class CacheIO(NamedTuple):
    """A tiered train step's device-cache traffic (embedding/tiers/device_fill.py): the rows
    this step fills into its groups' caches, and the rows the previous program evicted (their
    slots are free once this step has read them); with tiered dynamic tables, the cache slots
    the host maps gave to new ids this batch, reset after the fills."""

    fills: dict
    prev: dict
    fresh: FreshRows | None = None  # tiered dynamic tables: the cache slots given to new ids,
    fresh_hot: jax.Array | None = None  # and the hot rows given to new ids (int32 [H, 4] or [H, 6], replicated)


class StepFunctions:
    """The compiled steps of one :class:`~dlrm_jax.train.spec.StepSpec` on one mesh, and the
    state's layout there (``state``: :class:`~dlrm_jax.train.state.StateLayout`, whose
    ``init_state``, ``abstract_state``, ``checkpoint_form`` and ``from_checkpoint_form`` it
    offers as its own).

    ``train_step(state, batch, cache=None) -> (state, metrics, evicted)`` whatever the features:
    ``cache`` (a :class:`CacheIO`) is given exactly when tiered tables fill device caches, and
    ``evicted`` is then the rows this step pushed out (empty otherwise). ``eval_step(state,
    batch[, host_pooled])`` returns (probabilities, logits).
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
        self.schedule, self.tx, self.emb_lr_scale, self.parts = spec.schedule, spec.tx, spec.emb_lr_scale, spec.parts
        self.state = layout = StateLayout(spec, mesh, collection, hot)
        self.graphdef, self.tensor, self.pipeline = layout.graphdef, layout.tensor, layout.pipeline
        # The pooled vectors as the model reads them (the pipeline gathers them first: float32)
        self.pooled_dtype = jnp.dtype(jnp.float32) if self.pipeline is not None else layout.pooled_dtype
        self.state_sharding, self.saved_sharding = layout.sharding, layout.saved_sharding
        # The state as it trains, fresh and as checkpoints hold it (train/state.py).
        self.init_state, self.abstract_state = layout.init, layout.abstract
        self.checkpoint_form, self.from_checkpoint_form = layout.checkpoint_form, layout.from_checkpoint_form
        self.hot_keys, self.embedding_key = layout.hot_keys, layout.embedding_key
        self.dynamic = layout.dynamic  # the dynamic tables' id maps (embedding.ids), or None
        self.cached_dynamic, self.tiered_maps = layout.cached_dynamic, layout.tiered_maps  # tiered ones
        if self.dynamic is not None:
            self.map_rows = sum(spec.rows for spec in self.dynamic.maps.values())
            used = lambda maps: sum(jnp.sum(m.used, dtype=jnp.int32) for m in maps.values())
            self._map_used = jax.jit(used, out_shardings=NamedSharding(mesh, P()))
        self.replicated = NamedSharding(mesh, P())
        self.batch_sharding = NamedSharding(mesh, batch_spec(mesh))
        b = self.batch_sharding
        # A tiered run's cache fills, as a program of their own (the tier runner's first fills).
        self.fill_step = jax.jit(
            self._fill_step,
            in_shardings=(self.state_sharding.emb, b, b),
            out_shardings=(self.state_sharding.emb, b),
            donate_argnums=0,
        )
        if cache_groups:
            self.train_step = jax.jit(
                self._train_step,
                in_shardings=(self.state_sharding, b, CacheIO(b, b, b, self.replicated)),
                out_shardings=(self.state_sharding, self.replicated, b),
                donate_argnums=0,
            )
            self.eval_step = jax.jit(self._eval_step, in_shardings=(self.state_sharding, b, b), out_shardings=(b, b))
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
                out_shardings=(self.batch_sharding, self.batch_sharding),
            )
        # A state check scores the state with the eval step (compiled for evaluation anyway: a
        # program of its own cost every run that saved a second compile of the whole forward).
        self._check = jax.jit(self._checked, in_shardings=(self.state_sharding, b, b), out_shardings=self.replicated)
        self._unpack = jax.jit(lambda batch: unpacked(batch, mesh, b.spec), out_shardings=b)

    def map_metrics(self, state: TrainState) -> dict:
        """The dynamic tables' maps now: ``map_fill``, the share of their rows holding an id
        (replicated scalars; empty without dynamic tables). Read at log windows, not per step."""
        if self.dynamic is None:
            return {}
        return {"map_fill": self.map_used(state) / self.map_rows}

    def map_used(self, state: TrainState) -> jax.Array:
        """Rows of the devices' dynamic tables holding an id (a replicated int32)."""
        return self._map_used(state.maps)

    def device_batch(self, batch: Batch | HostPacked) -> Batch | Packed:
        """This process's numpy slice -> one global array per field, sharded over the mesh (one
        call for the three: a single process puts them in one batched transfer); a packed one
        -> one array of bytes the train step unpacks (:mod:`dlrm_jax.data.packed`)."""
        if isinstance(batch, HostPacked):
            return Packed(jax.make_array_from_process_local_data(self.batch_sharding, batch.buf), batch.layout)
        return type(batch)(*jax.make_array_from_process_local_data(self.batch_sharding, tuple(batch)))

    def packed_layout(self) -> PackedLayout:
        """How this process's slice of a batch is packed: a shard per local device."""
        shards = len(self.batch_sharding.addressable_devices)
        local = self.spec.batch_size // jax.process_count()
        return PackedLayout(shards, local // shards, sum(self.spec.bag_sizes), self.spec.num_dense)

    # ------------------------------------------------------------ steps
    def _forward(self, params, pooled_bfd, batch: Batch, parts: dict[str, PartInputs] | None = None):
        if self.pipeline is not None:
            logits = self.pipeline.logits(self.mesh, params, batch.dense, pooled_bfd)
        else:
            logits = nnx.merge(self.graphdef, params)(batch.dense, pooled_bfd, self.tensor)
        for name, inputs in (parts or {}).items():  # the extra sparse parts' logits (Wide&Deep's wide part)
            logits = logits + self.parts[name].logits(inputs, batch.dense)
        return logits

    def _part_lookups(self, state: TrainState, ids) -> tuple[dict[str, PartInputs], dict]:
        """Each extra sparse part's inputs to the loss and its residuals, by name."""
        looked = {name: part.lookup(state.parts[name], ids) for name, part in self.parts.items()}
        return {k: v[0] for k, v in looked.items()}, {k: v[1] for k, v in looked.items()}

    def _rows_of(self, state: TrainState, batch: Batch | RawBatch, learn: bool) -> tuple[TrainState, Batch, dict, dict]:
        """With dynamic tables, the batch's raw ids through their maps: (the state with the
        maps after the batch and the rows given to new ids reset, the batch with rows for
        ids, ``{"id_map_counts", "id_route"}``: the maps' counts summed over the tables, int32 in
        ``embedding.dynamic.idmap.STATS`` order, and the path the resolution took, an index into
        ``DynamicTables.resolution_paths``; how the ids were routed, for the collection's
        lookup: ``DynamicTables.resolve``'s). ``learn=False``: the maps are read only
        (evaluation). Without dynamic tables: all unchanged."""
        if self.dynamic is None:
            return state, batch, {}, {}
        raw = self.dynamic.raw_ids(batch.ids, getattr(batch, "raw", None))
        emb, maps, ids, stats, fresh, path, routed = self.dynamic.resolve(
            state.emb, state.maps, raw, batch.ids, state.step, self.embedding_key(), learn
        )
        parts = state.parts
        if learn:  # the extra parts' rows of the dynamic tables (Wide&Deep's weights) start again too
            parts = {
                name: part.with_tables(
                    parts[name],
                    self.dynamic.reset_replicated(
                        part.collection, part.tables(parts[name]), fresh, jnp.float32(part.learning_rate)
                    ),
                )
                for name, part in self.parts.items()
            }
        counts = jnp.stack([sum(s[k] for s in stats.values()) for k in STATS])
        new_state = state._replace(emb=emb, maps=maps, parts=parts)
        metrics = {"id_map_counts": counts, "id_route": path}
        return new_state, Batch(batch.dense, ids, batch.labels), metrics, routed

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
                if cache.fresh is not None:
                    emb = self.cached_dynamic.reset(emb, cache.fresh, cache.fresh_hot, self.embedding_key())
            state = state._replace(emb=emb)
        # The named scopes mark the phases in the compiled program's metadata (dlrm-jax profile).
        with jax.named_scope(PHASE_SCOPES["exchange_forward"]):
            state, batch, map_metrics, routed = self._rows_of(state, batch, learn=True)
            pooled_bfd, res = self.collection.lookup(state.emb, batch.ids, routed)
            part_inputs, part_res = self._part_lookups(state, batch.ids)

        def loss_fn(params, pooled_bfd, part_inputs):
            return jnp.mean(bce_loss(self._forward(params, pooled_bfd, batch, part_inputs), batch.labels))

        with jax.named_scope(PHASE_SCOPES["dense"]):
            # cast as the model's first use of them would: the gradient comes back in that dtype,
            # whose values it holds exactly (bfloat16: half the bytes for the update to read)
            loss, (grad_params, grad_bfd, grad_parts) = jax.value_and_grad(loss_fn, argnums=(0, 1, 2))(
                state.params, pooled_bfd.astype(self.pooled_dtype), part_inputs
            )
        with jax.named_scope(PHASE_SCOPES["dense_optimizer"]):
            updates, opt_state = self.tx.update(grad_params, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        with jax.named_scope(PHASE_SCOPES["sparse_update"]):
            emb_lr = self.schedule(state.step) * self.emb_lr_scale
            emb = self.collection.apply_gradients(state.emb, res, grad_bfd, emb_lr)
            parts = {
                name: part.apply_gradients(state.parts[name], part_res[name], grad_parts[name])
                for name, part in self.parts.items()
            }
        metrics = {"loss": loss, "exchange_overflows": res.overflow, **map_metrics}
        if res.hot_counts is not None:
            metrics["hot_counts"] = res.hot_counts
            if self.dynamic is not None:  # what hot-row statistics count: rows, not raw ids
                metrics["rows"] = batch.ids
        metrics["read_back"] = read_back(metrics)
        new_state = TrainState(state.step + 1, params, opt_state, emb, parts, state.maps)
        return new_state, metrics, evicted

    def state_check(self, state: TrainState, batch: Batch | Packed, *host_pooled) -> tuple[jax.Array, jax.Array]:
        """(mean loss of ``state`` on ``batch``, whether every float of ``state`` is finite),
        replicated scalars; nothing trained. A train step reports the loss of the state it
        starts from, so its own update shows only here (or in the next step's loss). Tiered
        runs pass the batch with the cache ids its train step used (rows the caches still hold)
        and zeros for ``host_pooled``."""
        if isinstance(batch, Packed):
            batch = self._unpack(batch)
        _, logits = self.eval_step(state, batch, *host_pooled)
        return self._check(state, logits, batch.labels)

    @staticmethod
    def _checked(state: TrainState, logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
        floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.inexact)]
        return jnp.mean(bce_loss(logits, labels)), jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in floats]))

    def _eval_step(
        self, state: TrainState, batch: Batch, host_pooled: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """``host_pooled``: with tiered tables, their features' pooled vectors read on the
        host (the batch's ids of those tables are padding here). Per host: each host looks up
        its rows in its own tables of ``state`` (``evaluate`` passes the hosts' average).
        Dynamic tables: an id without a row reads its shard's shared row."""
        state, batch, _, routed = self._rows_of(state, batch, learn=False)
        pooled_bfd, _ = self.collection.lookup(state.emb, batch.ids, routed)
        if host_pooled is not None:
            pooled_bfd = pooled_bfd + host_pooled
        logits = self._forward(state.params, pooled_bfd, batch, self._part_lookups(state, batch.ids)[0])
        return jax.nn.sigmoid(logits), logits
