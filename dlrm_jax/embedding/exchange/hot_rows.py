"""Hot rows inside the step: one more fused array, on every device, for the most looked-up rows.

The plan's hot group (``plan.hot``) holds H rows of any tables as ``[H, D]`` on every device,
the sparse optimizer's state beside them, and their keys (``hot.index.hot_keys``: sorted
(table, id) pairs). H is fixed when the step compiles; which rows are hot is state.

lookup    ``hot.index.split_hot`` splits the batch's ids into hot rows and cold ids (a hash index
          of the keys, two gathers). Cold ids take their tables' exchange (a hot id never
          enters a bucket); hot rows are a local gather.
update    each device sums its hot rows' gradients; their sum over devices is a reduction in
          the partitioned program, whose all-reduce XLA merges with the dense gradients' (the
          step's collectives are the same with and without hot rows); every replica applies
          the same dense optimizer update to its copy: the replicas never drift apart.
refresh   a program of its own, run at a step boundary: the hot copies are written back to
          their owners (values and optimizer state), then the new hot rows are gathered from
          theirs. Only the keys' contents change, so the step never recompiles.

While a row is hot its owner's copy is stale: a logical table is its owners' rows overridden by
the hot copies (:func:`overlay`). Every program here is dispatched by the caller's thread, the
one that dispatches the train step (see ``train/trainer.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from dlrm_jax.embedding.exchange.columns import segment_sum_axis1
from dlrm_jax.embedding.exchange.optimizers import SparseOptimizer
from dlrm_jax.embedding.exchange.routing import route
from dlrm_jax.embedding.exchange.row_grads import Lookups, dense_row_sums
from dlrm_jax.embedding.hot.index import HOT_BUCKET, HOT_PAD, hot_index_buckets, split_hot
from dlrm_jax.embedding.plan.layout import Group, VirtualTable, is_identity
from dlrm_jax.parallel.mesh import AXIS


class HotState(NamedTuple):
    """values [H, D] (table storage dtype), slots: the sparse optimizer's state with the same
    row axis, keys int32 [2, H] (``hot.index.hot_keys``), and the step's hash index of them:
    index int32 [buckets, HOT_BUCKET, 3], seeds int32 [2] (``hot.index.hot_index``); all
    replicated on every device."""

    values: jax.Array
    slots: dict[str, jax.Array]
    keys: jax.Array
    index: jax.Array
    seeds: jax.Array


class HotRows:
    """The hot group of a plan: its state, its part of the step, and the refresh program."""

    def __init__(
        self,
        capacity: int,
        dim: int,
        groups: list[Group],
        mesh,
        optimizer: SparseOptimizer,
        slot_table: np.ndarray,
        slot_feature: np.ndarray,
        one_hot: bool,
        host_tables=frozenset(),
    ):
        """``host_tables``: tables whose rows the groups do not hold (tiered tables: their
        groups hold caches); the refresh program leaves their hot rows to the caller."""
        self.capacity, self.dim, self.groups, self.mesh = capacity, dim, groups, mesh
        self.host_tables = frozenset(host_tables)
        self.optimizer, self.one_hot = optimizer, one_hot
        self.slot_table, self.slot_feature = slot_table, slot_feature
        self.num_features = int(slot_feature.max()) + 1

    # ------------------------------------------------------------ state
    def init(self, dtype) -> HotState:
        """An empty hot set: every key HOT_PAD, values zero (``refresh`` fills it)."""
        values = jnp.zeros((self.capacity, self.dim), dtype)
        index = jnp.full((hot_index_buckets(self.capacity), HOT_BUCKET, 3), HOT_PAD, jnp.int32).at[..., 2].set(-1)
        return HotState(
            values,
            self.optimizer.init(values),
            jnp.full((2, self.capacity), HOT_PAD, jnp.int32),
            index,
            jnp.zeros(2, jnp.int32),
        )

    # ------------------------------------------------------------ step
    def lookup(self, hot: HotState, ids_bs: jax.Array, weights_bs: jax.Array):
        """-> (hot_bs int32 [B, S]: each slot's hot row, -1 when cold; cold ids [B, S]: hot ones
        replaced by PAD_ID; pooled float32 [B, F, D]: the hot vectors, weighted and pooled per
        feature; counts float32 [2]: hot lookups and all lookups of the global batch, exact
        below 2**24)."""

        def local(values, index, seeds, ids, weights):
            hot_bs, cold_bs = split_hot(ids, jnp.asarray(self.slot_table), index, seeds)
            vectors = values.at[self._safe(hot_bs)].get(mode="fill", fill_value=0).astype(jnp.float32)
            weighted = vectors * weights[..., None]
            pooled = (
                weighted
                if self.one_hot and is_identity(self.slot_feature)
                else segment_sum_axis1(weighted, self.slot_feature, self.num_features)
            )
            counts = jnp.stack([jnp.sum(hot_bs >= 0), jnp.sum(weights > 0)]).astype(jnp.float32)
            return hot_bs, cold_bs, pooled, counts[None]

        hot_bs, cold_bs, pooled, counts = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(P(), P(), P(), P(AXIS), P(AXIS)),
            out_specs=(P(AXIS),) * 4,
        )(hot.values, hot.index, hot.seeds, ids_bs, weights_bs)
        return hot_bs, cold_bs, pooled, self._sum_over_devices(counts)

    def update(
        self, hot: HotState, hot_bs: jax.Array, weights_bs: jax.Array, grad_bfd: jax.Array, lr: jax.Array
    ) -> HotState:
        """Every replica applies the optimizer to the hot rows' gradients summed over the
        global batch (rows not looked up get a zero gradient: an unchanged row)."""

        def local(hot_bs, weights, grad_bfd):
            lookups = Lookups.of_bags(self._safe(hot_bs), self.slot_feature, self.num_features, weights)
            sums = dense_row_sums(lookups, grad_bfd.reshape(-1, self.dim), self.capacity, self.optimizer.exact_sums)
            return sums[None]

        partial_sums = jax.shard_map(local, mesh=self.mesh, in_specs=(P(AXIS),) * 3, out_specs=P(AXIS))(
            hot_bs, weights_bs, grad_bfd
        )
        sums = self._sum_over_devices(partial_sums)
        values, slots = self.optimizer.apply(hot.values, hot.slots, None, sums, lr)
        return hot._replace(values=values, slots=slots)

    def _sum_over_devices(self, per_device: jax.Array) -> jax.Array:
        """[N, ...] one slice per device -> their sum, replicated. Written as a plain reduction
        rather than a psum inside shard_map: the partitioner's all-reduce is one that XLA's
        combiner merges with the dense gradients' (one rendezvous a step instead of three; on
        simulated CPU devices each costs milliseconds of waiting, BENCHMARKS.md)."""
        total = jnp.sum(per_device, axis=0)
        return lax.with_sharding_constraint(total, jax.sharding.NamedSharding(self.mesh, P()))

    def _safe(self, hot_bs):
        """-1 (cold) -> H, out of range: dropped by scatters, filled by gathers."""
        return jnp.where(hot_bs < 0, self.capacity, hot_bs)

    # ------------------------------------------------------------ refresh
    def refresh(
        self, tables: dict, slots: dict, hot: HotState, new_keys: jax.Array, index: jax.Array, seeds: jax.Array
    ):
        """-> (tables, slots, hot): the old hot rows written back to their owners, exactly,
        then the rows of ``new_keys`` gathered from theirs (``index``, ``seeds``: their
        ``hot.index.hot_index``). A row in both sets keeps its values and state bit for bit."""
        names = [g.name for g in self.groups]
        specs = tuple(P() if g.replicated else P(AXIS) for g in self.groups)

        def local(tables, slots, hot, new_keys, index, seeds):
            me = lax.axis_index(AXIS)
            tables, slots = dict(zip(names, tables, strict=True)), dict(zip(names, slots, strict=True))
            for g in self.groups:
                tables[g.name], slots[g.name] = _write_back(g, tables[g.name], slots[g.name], hot, me, self.host_tables)
            values = jnp.zeros((self.capacity, self.dim), jnp.float32)
            state = {k: jnp.zeros(v.shape, v.dtype) for k, v in hot.slots.items()}
            for g in self.groups:
                values, state = _gather(g, tables[g.name], slots[g.name], new_keys, me, values, state, self.host_tables)
            values, state = lax.psum((values, state), AXIS)  # one device holds each piece
            new_hot = HotState(values.astype(hot.values.dtype), state, new_keys, index, seeds)
            return tuple(tables[n] for n in names), tuple(slots[n] for n in names), new_hot

        hot_spec = HotState(P(), P(), P(), P(), P())
        fn = jax.shard_map(
            local, mesh=self.mesh, in_specs=(specs, specs, hot_spec, P(), P(), P()), out_specs=(specs, specs, hot_spec)
        )
        t, s, new_hot = fn(tuple(tables[n] for n in names), tuple(slots[n] for n in names), hot, new_keys, index, seeds)
        return dict(zip(names, t, strict=True)), dict(zip(names, s, strict=True)), new_hot


def _held_here(g: Group, vt: VirtualTable, keys, me, gather: bool):
    """Rows of this device's shard of ``g`` holding the keys' rows of ``vt`` [H] (out of range
    where it holds none), and the mask. A replicated group: every device holds them; for a
    gather only device 0 answers, so the psum counts each row once."""
    is_vt = keys[0] == vt.table
    ids = jnp.where(is_vt, keys[1], 0)
    if g.replicated:
        mine = is_vt & (me == 0) if gather else is_vt
        return jnp.where(mine, vt.offset + ids, g.local_rows), mine
    owner, row, _ = route(ids, vt.kind, vt.device, vt.offset, vt.block, g.num_devices)
    mine = is_vt & (owner == me)
    return jnp.where(mine, row, g.local_rows), mine


def _columns(vt: VirtualTable, g: Group) -> slice:
    return slice(vt.col_start, vt.col_start + g.width)


def _write_back(g: Group, table, slots, hot: HotState, me, skip):
    for vt in (v for v in g.vtables if v.table not in skip):
        rows, _ = _held_here(g, vt, hot.keys, me, gather=False)
        cols = _columns(vt, g)
        table = table.at[rows].set(hot.values[:, cols].astype(table.dtype), mode="drop")
        # Per-element state takes the slice's columns; per-row state is the same in every slice.
        slots = {
            k: v.at[rows].set(hot.slots[k][:, cols] if v.ndim == 2 else hot.slots[k], mode="drop")
            for k, v in slots.items()
        }
    return table, slots


def _gather(g: Group, table, slots, keys, me, values, state, skip):
    for vt in (v for v in g.vtables if v.table not in skip):
        rows, mine = _held_here(g, vt, keys, me, gather=True)
        cols = _columns(vt, g)
        got = table.at[rows].get(mode="fill", fill_value=0).astype(jnp.float32)
        values = values.at[:, cols].add(jnp.where(mine[:, None], got, 0.0))
        for k, v in slots.items():
            got = v.at[rows].get(mode="fill", fill_value=0)
            if v.ndim == 2:
                state[k] = state[k].at[:, cols].add(jnp.where(mine[:, None], got, 0))
            elif vt.col_start == 0:  # per-row state: taken from the first slice only
                state[k] = state[k] + jnp.where(mine, got, 0)
    return values, state


def overlay(tables: list, opt: list, hot: HotState) -> tuple[list, list]:
    """Logical tables (per table [R, D] values and optimizer state) with the hot copies put
    over their owners' stale rows."""
    values = hot.values.astype(jnp.float32)
    out_t, out_o = [], []
    for t, (table, state) in enumerate(zip(tables, opt, strict=True)):
        rows = jnp.where(hot.keys[0] == t, hot.keys[1], table.shape[0])
        out_t.append(table.at[rows].set(values, mode="drop"))
        out_o.append({k: v.at[rows].set(hot.slots[k], mode="drop") for k, v in state.items()})
    return out_t, out_o
