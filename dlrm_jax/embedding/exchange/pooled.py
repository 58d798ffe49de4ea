"""The pooled form for bags: each device sends an owner every (row, weight) of its samples, and
the owner returns each sample's partial pooled sum, so vectors travel once per sample and
owner rather than once per distinct row."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from dlrm_jax.embedding.exchange.common import (
    agreed,
    all_to_all,
    busiest_of_replicas,
    gather_replicas,
    gradients_to_owners,
    if_overflow,
    in_rounds,
    lookup_exchange,
    owner_update_round,
    update_on_owners,
    varying,
)
from dlrm_jax.embedding.exchange.optimizers import SparseOptimizer
from dlrm_jax.embedding.exchange.routing import (
    Buckets,
    bucket,
    rank_by_owner,
    route,
    scatter_to_buckets,
)
from dlrm_jax.embedding.plan.layout import Group, take_columns
from dlrm_jax.parallel.mesh import AXIS


def _route_all(g: Group, ids_local_bs: jax.Array, weights_local_bs: jax.Array):
    """Every valid request (no dedupe) ranked per owner, with the segment (sample, virtual
    feature) it pools into and its pooling weight; plus the busiest owner's count (pmax)."""
    b_local = ids_local_bs.shape[0]
    vids = take_columns(ids_local_bs, g.vslot_slot)
    owner, row, valid = route(vids, jnp.asarray(g.vslot_kind), jnp.asarray(g.vslot_device),
                              jnp.asarray(g.vslot_offset), jnp.asarray(g.vslot_block), g.num_devices)
    owner, row, valid = owner.reshape(-1), row.reshape(-1), valid.reshape(-1)
    rank, counts = rank_by_owner(owner, valid, g.num_devices)
    seg = (jnp.arange(b_local)[:, None] * len(g.vtables) + jnp.asarray(g.vslot_vfeature)[None, :]).reshape(-1)
    weight = take_columns(weights_local_bs, g.vslot_slot).reshape(-1)
    return (owner, row, rank, valid, seg.astype(jnp.int32), weight), lax.pmax(jnp.max(counts), AXIS)


def _send_requests(g: Group, req, cap: int):
    """All-to-all of (row, segment, weight) per request: what each owner must pool, for whom."""
    owner, row, rank, valid, seg, weight = req
    usable = valid & (rank < cap)
    put = partial(scatter_to_buckets, owner, rank, usable, capacity=cap, num_devices=g.num_devices)
    return (all_to_all(put(row, fill=jnp.int32(g.local_rows))), all_to_all(put(seg, fill=jnp.int32(0))),
            all_to_all(put(weight, fill=jnp.float32(0))))


def _buckets_if_overflow(g: Group, req, over) -> Buckets:
    """The pooled route's requests as distinct (owner, row) buckets when the rounds need them
    (a sort, skipped otherwise: zeros of the same shapes)."""
    owner, row, _, valid, _, _ = req
    n = owner.shape[0]

    def distinct():
        return bucket(owner, row, valid, g.num_devices, g.local_rows)

    def unused():
        ints, flags = jnp.zeros(n, jnp.int32), jnp.zeros(n, bool)
        return jax.tree.map(varying, Buckets(ints, ints, ints, flags, ints, ints, flags,
                                              jnp.zeros(g.num_devices, jnp.int32)))

    return if_overflow(over, distinct, unused)


def pooled_forward(g: Group, mesh, capacity: int, local_batch: int, wire_dtype):
    """``f(table, ids [B, S], weights [B, S]) -> (pooled [B, F', W], overflowed [])``.

    Owners pool what they hold of every (sample, virtual feature) and send partial sums back;
    the requester adds the N partial sums: a reduce-scatter through an all-to-all. Moves
    B_local x F' vectors per owner instead of one per requested row: fewer bytes for large bags.
    On overflow, the rows come back in rounds (as for unpooled groups) and the requester pools.
    """
    n_seg = local_batch * len(g.vtables)
    out_shape = (local_batch, len(g.vtables), g.width)
    exchange = lookup_exchange(g, capacity, wire_dtype)

    def pooled_at_owners(table_local, req):
        rows, segs, weights = _send_requests(g, req, capacity)  # [N, C] from each source
        vectors = table_local.at[rows].get(mode="fill", fill_value=0).astype(jnp.float32) * weights[..., None]
        target = (jnp.arange(g.num_devices)[:, None] * n_seg + segs).reshape(-1)
        partial_sums = jax.ops.segment_sum(vectors.reshape(-1, g.width), target, g.num_devices * n_seg)
        back = all_to_all(partial_sums.reshape(g.num_devices, n_seg, g.width).astype(wire_dtype))
        return back.astype(jnp.float32).sum(0).reshape(out_shape)

    def local(table_local, ids_local, weights_local):
        req, most = _route_all(g, ids_local, weights_local)
        over = most > capacity
        b = _buckets_if_overflow(g, req, over)
        _, _, _, _, seg, weight = req

        def one_round(acc, window):
            def rows_then_pool():
                out, usable = exchange(table_local, b, window)
                pooled = jax.ops.segment_sum(out * (weight * usable)[:, None], seg, n_seg)
                return acc + pooled.reshape(out_shape)

            return if_overflow(over, rows_then_pool, lambda: pooled_at_owners(table_local, req))

        out = in_rounds(g, b, capacity, over, one_round, jnp.zeros(out_shape, jnp.float32))
        return out, over[None], (req, most[None])

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(AXIS), P(AXIS), P(AXIS)),
                       out_specs=(P(AXIS), P(AXIS), P(AXIS)))

    def forward(table, ids_bs, weights_bs):
        """-> (pooled, overflowed, route): the route is the backward's residual."""
        out, over, route_ = fn(table, ids_bs, weights_bs)
        return out, over[0], route_

    return forward


def pooled_update(g: Group, mesh, capacity: int, wire_dtype, optimizer: SparseOptimizer,
                  replicas: str | None = None):
    """``f(table, slots, route, grads [B, F', W], lr) -> (table, slots)``: every owner gets each
    device's pooled gradients (all-gather) and scatters them to the rows it pooled. On overflow,
    each request's gradient (its weight x its bag's) goes to the owners in rounds instead.
    ``replicas``: as :func:`sharded_update`."""
    send = gradients_to_owners(g, capacity, wire_dtype, optimizer)
    agree = agreed(replicas)

    def at_owners(state, req, grads_local, lr):
        rows, segs, weights = _send_requests(g, req, capacity)
        every = lax.all_gather(grads_local.reshape(-1, g.width).astype(wire_dtype), AXIS)  # [N, B_l F', W]
        grads = every[jnp.arange(g.num_devices)[:, None], segs].astype(jnp.float32) * weights[..., None]
        return optimizer.update(*state, gather_replicas(rows.reshape(-1), replicas),
                                gather_replicas(grads.reshape(-1, g.width), replicas), lr)

    def update(table_local, slots_local, req, grads_local, lr, most):
        over = busiest_of_replicas(most, replicas) > capacity
        b = _buckets_if_overflow(g, req, over)
        _, _, _, _, seg, weight = req

        def one_round(state, window):
            def by_rows(state):
                per_request = grads_local.reshape(-1, g.width)[seg].astype(jnp.float32) * weight[:, None]
                return owner_update_round(send, optimizer, b, per_request, lr, replicas)(state, window)

            return if_overflow(over, by_rows, lambda s: at_owners(s, req, grads_local, lr), state)

        return in_rounds(g, b, capacity, over, one_round, (table_local, slots_local), agree)

    return update_on_owners(mesh, update)


def busiest_owner_all_requests(g: Group, mesh):
    """``f(ids [B, S]) -> int32 []``: the most requests (duplicates included) one device sends
    one owner: the statistic the pooled exchange's buckets are sized for."""

    def local(ids_local):
        return _route_all(g, ids_local, jnp.ones(ids_local.shape, jnp.float32))[1][None]

    fn = jax.shard_map(local, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    return lambda ids_bs: fn(ids_bs)[0]
