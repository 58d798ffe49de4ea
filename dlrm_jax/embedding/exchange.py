"""The sparse exchange between the data-parallel batch layout and the table owners.

Per sharded group, inside one ``jax.shard_map`` over the mesh's ``devices`` axis, each device:

forward   route its ids to owners -> deduplicate per owner -> all_to_all of row ids (fixed
          capacity C per owner) -> owners gather rows from their local shard -> all_to_all of
          vectors back -> each slot picks its vector.
backward  the same buckets -> gradients of duplicate slots summed into their bucket place ->
          all_to_all of row ids and gradients to owners -> the owner applies the sparse
          optimizer to its shard (merging what several devices sent for one row).

Overflow: when any device has more distinct requests for one owner than C, every device
(the decision is a pmax, so all agree) runs the same exchange with the worst-case capacity
instead. Nothing is dropped, and the step reports that it happened.

Replicated groups need no all-to-all: lookups are local, and the update gathers the whole
batch's rows and gradients to every device, which then applies the same update.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from dlrm_jax.embedding.layout import Group
from dlrm_jax.embedding.optimizers import SparseOptimizer, merge_duplicates
from dlrm_jax.embedding.routing import (
    bucket,
    rank_by_owner,
    route,
    scatter_to_buckets,
    send_buffer,
    slot_index,
)
from dlrm_jax.parallel.mesh import AXIS


def _route_and_bucket(g: Group, ids_local_bs: jax.Array):
    vids = ids_local_bs[:, g.vslot_slot]  # [B_l, V]
    owner, row, valid = route(vids, jnp.asarray(g.vslot_kind), jnp.asarray(g.vslot_device),
                              jnp.asarray(g.vslot_offset), jnp.asarray(g.vslot_block), g.num_devices)
    b = bucket(owner, row, valid, g.num_devices, g.local_rows)
    overflow = lax.pmax(jnp.max(b.counts), AXIS)
    return vids.shape, b, overflow


def _all_to_all(x):
    return lax.all_to_all(x, AXIS, 0, 0)


def _at_capacity(exchange, most, capacity: int, worst: int, *operands):
    """``exchange(*operands, cap=capacity)``, or at the worst-case capacity when some device has
    more requests for one owner; ``most`` is a pmax, so every device takes the same branch."""
    return lax.cond(most > capacity, partial(exchange, cap=worst), partial(exchange, cap=capacity), *operands)


def _update_on_owners(mesh, exchange, capacity: int, worst: int):
    """``f(table, slots, route, grads, lr) -> (table, slots)`` running an update exchange per
    device; ``route`` is (requests, busiest count) as the forward returned it."""

    def local(table_local, slots_local, route_local, grads_local, lr):
        requests, most = route_local
        return _at_capacity(exchange, most[0], capacity, worst, table_local, slots_local, requests, grads_local, lr)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(AXIS), P(AXIS), P(AXIS), P(AXIS), P()),
                         out_specs=(P(AXIS), P(AXIS)))


def busiest_owner_requests(g: Group, mesh):
    """``f(ids [B, S]) -> int32 []``: the most distinct rows one device asks of one owner."""

    def local(ids_local):
        return _route_and_bucket(g, ids_local)[2][None]

    fn = jax.shard_map(local, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    return lambda ids_bs: fn(ids_bs)[0]


def sharded_forward(g: Group, mesh, capacity: int, local_batch: int, wire_dtype):
    """``f(table [N*R, W], ids [B, S]) -> (vectors [B, V, W] float32, overflowed bool [])``."""
    worst = g.max_capacity(local_batch)

    def exchange(table_local, b, cap, shape):
        recv_rows = _all_to_all(send_buffer(b, cap, g.num_devices, g.local_rows))
        vectors = table_local.at[recv_rows].get(mode="fill", fill_value=0).astype(wire_dtype)
        replies = _all_to_all(vectors)  # [N, C, W]: from each owner, in my request order
        owner, rank, usable = slot_index(b, cap)
        out = replies[owner, rank].astype(jnp.float32) * usable[:, None]
        return out.reshape(*shape, g.width)

    def local(table_local, ids_local):
        shape, b, most = _route_and_bucket(g, ids_local)
        over = most > capacity
        out = _at_capacity(partial(exchange, shape=shape), most, capacity, worst, table_local, b)
        return out, over[None], (b, most[None])

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=(P(AXIS), P(AXIS), P(AXIS)))

    def forward(table, ids_bs):
        """-> (vectors, overflowed, route): the route (buckets, busiest count) is the backward's
        residual, so the ids are not routed and sorted a second time."""
        out, over, route_ = fn(table, ids_bs)
        return out, over[0], route_

    return forward


def sharded_update(g: Group, mesh, capacity: int, local_batch: int, wire_dtype,
                   optimizer: SparseOptimizer, dim: int):
    """``f(table, slots, route, grads [B, V, W], lr) -> (table, slots)``, sparse, on owners;
    ``route`` is what the forward returned. ``dim``: the tables' full width (for statistics
    over whole rows of column slices)."""
    worst = g.max_capacity(local_batch)
    whole_rows = optimizer.needs_whole_rows and g.has_column_slices

    def exchange(table_local, slots_local, b, grads, lr, cap):
        recv_rows = _all_to_all(send_buffer(b, cap, g.num_devices, g.local_rows))
        owner, rank, usable = slot_index(b, cap)
        dest = jnp.where(usable, owner, g.num_devices)  # unusable -> dropped by the scatter
        sums = jnp.zeros((g.num_devices, cap, g.width), jnp.float32)
        sums = sums.at[dest, rank].add(grads.reshape(-1, g.width).astype(jnp.float32), mode="drop")
        recv_grads = _all_to_all(sums.astype(wire_dtype)).astype(jnp.float32)
        extra = {}
        if whole_rows:
            extra["row_mean_sq"] = _whole_row_mean_sq(g, recv_rows, recv_grads, owner, rank, usable, dest,
                                                      grads.shape[0]) / dim
        return optimizer.update(table_local, slots_local, recv_rows.reshape(-1),
                                recv_grads.reshape(-1, g.width), lr, **extra)

    return _update_on_owners(mesh, exchange, capacity, worst)


def _whole_row_mean_sq(g: Group, recv_rows, recv_grads, owner, rank, usable, dest, local_batch: int):
    """Per received request [N * C]: the sum over all columns of its row's squared gradient,
    summed over every device, although each owner holds only a column slice.

    Owners square-sum their slice of each row's merged gradient and reply along the forward's
    buckets; each requester adds the replies of a row's slices (the virtual slots of one batch
    slot and table) and sends the total back to every slice owner: two all-to-alls of scalars.
    """
    rows = recv_rows.reshape(-1)
    _, merged, inv = merge_duplicates(rows, recv_grads.reshape(-1, g.width), g.local_rows, return_inverse=True)
    partial = jnp.sum(merged * merged, -1)[inv].reshape(g.num_devices, -1)  # [N, C] for each source
    reply = _all_to_all(partial)  # [N, C]: for my requests, at each owner's rank
    per_vslot = jnp.where(usable, reply[owner, rank], 0.0).reshape(local_batch, g.num_vslots)
    # virtual slots reading the same (batch slot, table): the slices of one row
    row_of_vslot = np.unique(np.stack([g.vslot_slot, g.vslot_table]), axis=1, return_inverse=True)[1].reshape(-1)
    total = jax.ops.segment_sum(per_vslot.T, jnp.asarray(row_of_vslot), int(row_of_vslot.max()) + 1).T
    back = jnp.zeros(partial.shape, jnp.float32).at[dest, rank].set(total[:, row_of_vslot].reshape(-1), mode="drop")
    return _all_to_all(back).reshape(-1)


def replicated_forward(g: Group):
    """``f(table [R, W], ids [B, S]) -> vectors [B, V, W]``: a local gather on every device."""

    def forward(table, ids_bs):
        vids = ids_bs[:, g.vslot_slot]
        rows = jnp.where(vids == -1, g.local_rows, vids + jnp.asarray(g.vslot_offset))
        return table.at[rows].get(mode="fill", fill_value=0).astype(jnp.float32)

    return forward


def replicated_update(g: Group, mesh, optimizer: SparseOptimizer):
    """Every device gathers the batch's rows and gradients and applies the same update.

    Moves B*V*(W+1) values per device rather than an all-reduce of the R x W table.
    """

    def local(table, slots, ids_local, grads_local, lr):
        vids = ids_local[:, g.vslot_slot]
        rows = jnp.where(vids == -1, g.local_rows, vids + jnp.asarray(g.vslot_offset)).reshape(-1)
        rows = lax.all_gather(rows, AXIS, tiled=True)
        grads = lax.all_gather(grads_local.reshape(-1, g.width), AXIS, tiled=True)
        return optimizer.update(table, slots, rows, grads, lr)

    # check_vma off: every device applies the same gathered update, so outputs are replicated.
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS), P()),
                         out_specs=(P(), P()), check_vma=False)


# ---------------------------------------------------------------- partial pooling at owners


def _route_all(g: Group, ids_local_bs: jax.Array, weights_local_bs: jax.Array):
    """Every valid request (no dedupe) ranked per owner, with the segment (sample, virtual
    feature) it pools into and its pooling weight; plus the busiest owner's count (pmax)."""
    b_local = ids_local_bs.shape[0]
    vids = ids_local_bs[:, g.vslot_slot]
    owner, row, valid = route(vids, jnp.asarray(g.vslot_kind), jnp.asarray(g.vslot_device),
                              jnp.asarray(g.vslot_offset), jnp.asarray(g.vslot_block), g.num_devices)
    owner, row, valid = owner.reshape(-1), row.reshape(-1), valid.reshape(-1)
    rank, counts = rank_by_owner(owner, valid, g.num_devices)
    seg = (jnp.arange(b_local)[:, None] * len(g.vtables) + jnp.asarray(g.vslot_vfeature)[None, :]).reshape(-1)
    weight = weights_local_bs[:, g.vslot_slot].reshape(-1)
    return (owner, row, rank, valid, seg.astype(jnp.int32), weight), lax.pmax(jnp.max(counts), AXIS)


def _send_requests(g: Group, req, cap: int):
    """All-to-all of (row, segment, weight) per request: what each owner must pool, for whom."""
    owner, row, rank, valid, seg, weight = req
    usable = valid & (rank < cap)
    put = partial(scatter_to_buckets, owner, rank, usable, capacity=cap, num_devices=g.num_devices)
    return (_all_to_all(put(row, fill=jnp.int32(g.local_rows))), _all_to_all(put(seg, fill=jnp.int32(0))),
            _all_to_all(put(weight, fill=jnp.float32(0))))


def pooled_forward(g: Group, mesh, capacity: int, local_batch: int, wire_dtype):
    """``f(table, ids [B, S], weights [B, S]) -> (pooled [B, F', W], overflowed [])``.

    Owners pool what they hold of every (sample, virtual feature) and send partial sums back;
    the requester adds the N partial sums: a reduce-scatter through an all-to-all. Moves
    B_local x F' vectors per owner instead of one per requested row: fewer bytes for large bags.
    """
    worst = g.max_capacity(local_batch)
    n_seg = local_batch * len(g.vtables)

    def exchange(table_local, req, cap):
        rows, segs, weights = _send_requests(g, req, cap)  # [N, C] from each source
        vectors = table_local.at[rows].get(mode="fill", fill_value=0).astype(jnp.float32) * weights[..., None]
        target = (jnp.arange(g.num_devices)[:, None] * n_seg + segs).reshape(-1)
        partial_sums = jax.ops.segment_sum(vectors.reshape(-1, g.width), target, g.num_devices * n_seg)
        back = _all_to_all(partial_sums.reshape(g.num_devices, n_seg, g.width).astype(wire_dtype))
        return back.astype(jnp.float32).sum(0).reshape(local_batch, len(g.vtables), g.width)

    def local(table_local, ids_local, weights_local):
        req, most = _route_all(g, ids_local, weights_local)
        over = most > capacity
        out = _at_capacity(exchange, most, capacity, worst, table_local, req)
        return out, over[None], (req, most[None])

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(AXIS), P(AXIS), P(AXIS)),
                       out_specs=(P(AXIS), P(AXIS), P(AXIS)))

    def forward(table, ids_bs, weights_bs):
        """-> (pooled, overflowed, route): the route is the backward's residual."""
        out, over, route_ = fn(table, ids_bs, weights_bs)
        return out, over[0], route_

    return forward


def pooled_update(g: Group, mesh, capacity: int, local_batch: int, wire_dtype, optimizer: SparseOptimizer):
    """``f(table, slots, route, grads [B, F', W], lr) -> (table, slots)``: every owner gets each
    device's pooled gradients (all-gather) and scatters them to the rows it pooled."""
    worst = g.max_capacity(local_batch)

    def exchange(table_local, slots_local, req, grads_local, lr, cap):
        rows, segs, weights = _send_requests(g, req, cap)
        every = lax.all_gather(grads_local.reshape(-1, g.width).astype(wire_dtype), AXIS)  # [N, B_l F', W]
        grads = every[jnp.arange(g.num_devices)[:, None], segs].astype(jnp.float32) * weights[..., None]
        return optimizer.update(table_local, slots_local, rows.reshape(-1), grads.reshape(-1, g.width), lr)

    return _update_on_owners(mesh, exchange, capacity, worst)


def busiest_owner_all_requests(g: Group, mesh):
    """``f(ids [B, S]) -> int32 []``: the most requests (duplicates included) one device sends
    one owner: the statistic the pooled exchange's buckets are sized for."""

    def local(ids_local):
        return _route_all(g, ids_local, jnp.ones(ids_local.shape, jnp.float32))[1][None]

    fn = jax.shard_map(local, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    return lambda ids_bs: fn(ids_bs)[0]
