"""The sparse exchange between the data-parallel batch layout and the table owners.

Per sharded group, inside one ``jax.shard_map`` over the mesh's ``devices`` axis, each device:

forward   route its ids to owners -> deduplicate per owner -> all_to_all of row ids (fixed
          capacity C per owner) -> owners gather rows from their local shard -> all_to_all of
          vectors back -> each slot picks its vector.
backward  the same buckets -> gradients of duplicate slots summed into their bucket place ->
          all_to_all of row ids and gradients to owners -> the owner applies the sparse
          optimizer to its shard (merging what several devices sent for one row).

Overflow: when any device has more distinct requests for one owner than C (the decision is a
pmax, so all agree), the exchange runs in rounds at the same capacity instead, each round a
window of every owner's rows that all devices agree on (see ``routing``). Nothing is dropped,
no buffer is larger than C, a row is updated once per step, and the step reports that it
happened.

Replicated groups need no all-to-all: lookups are local, and the update gathers the whole
batch's rows and gradients to every device, which then applies the same update.

Replicas over hosts (embedding.sync=host_replicas, ``replicas`` the hosts axis): every host
holds the tables, split over its own devices, and runs this exchange among them only. The
updates keep the replicas equal: each owner gathers what its counterparts on the other hosts
received (an all-gather over ``replicas``, the only cross-host embedding traffic) and applies
the whole batch's gradients, and the decisions to run in rounds, and their windows, are agreed
over every host.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from dlrm_jax.embedding.layout import Group, take_columns
from dlrm_jax.embedding.optimizers import SparseOptimizer, merge_duplicates
from dlrm_jax.embedding.routing import (
    Buckets,
    Window,
    bucket,
    next_round_limit,
    rank_by_owner,
    requests_below,
    route,
    scatter_to_buckets,
    send_buffer,
    slot_index,
)
from dlrm_jax.parallel.mesh import AXIS


def _route_and_bucket(g: Group, ids_local_bs: jax.Array):
    vids = take_columns(ids_local_bs, g.vslot_slot)  # [B_l, V]
    owner, row, valid = route(vids, jnp.asarray(g.vslot_kind), jnp.asarray(g.vslot_device),
                              jnp.asarray(g.vslot_offset), jnp.asarray(g.vslot_block), g.num_devices)
    b = bucket(owner, row, valid, g.num_devices, g.local_rows)
    overflow = lax.pmax(jnp.max(b.counts), AXIS)
    return vids.shape, b, overflow


def _all_to_all(x):
    return lax.all_to_all(x, AXIS, 0, 0)


ROUNDS_SCOPE = "exchange_rounds"  # names the overflow-only ops in the compiled program


def _if_overflow(over, on_overflow, otherwise, *operands):
    """``lax.cond`` on ``over`` (a pmax-derived flag, so every device takes the same branch);
    the overflow branch's ops are named ``ROUNDS_SCOPE``."""

    def named(*args):
        with jax.named_scope(ROUNDS_SCOPE):
            return on_overflow(*args)

    return lax.cond(over, named, otherwise, *operands)


def _agreed(replicas: str | None):
    """The axes every decision of an update is agreed over: the devices, and the hosts when
    the tables have replicas there."""
    return AXIS if replicas is None else (replicas, *AXIS)


def _gather_replicas(x, replicas: str | None):
    """What every replica's owner received, in host order (unchanged without replicas)."""
    return x if replicas is None else lax.all_gather(x, replicas, tiled=True)


def _in_rounds(g: Group, b: Buckets, capacity: int, over, one_round, carry, agree=AXIS):
    """``one_round(carry, window) -> carry`` until every request is sent: one trip with all of
    each owner's requests when nothing overflowed, else over the agreed rounds (see routing).

    Always a while loop, even for one trip: a ``lax.cond`` whose branch holds a loop that
    updates the table makes XLA copy the whole table shard; a loop whose body holds conds
    updates it in place. The limits are pmins over ``agree``, so every device runs the same rounds."""

    def agreed_limit(done, finished):
        def proposals():
            return lax.pmin(next_round_limit(b, done, capacity, g.local_rows), agree)

        everything = jnp.full(g.num_devices, g.local_rows, jnp.int32)
        return _if_overflow(over & ~finished, proposals, lambda: everything)

    def body(state):
        done, limit, carry, _ = state
        end = requests_below(b, limit, g.local_rows)
        carry = one_round(carry, Window(done, end))
        finished = jnp.all(limit == g.local_rows)
        return end, agreed_limit(end, finished), carry, finished

    done = _varying(jnp.zeros(g.num_devices, jnp.int32))
    start = (done, agreed_limit(done, jnp.bool_(False)), jax.tree.map(lambda x: _varying(x, agree), carry),
             jnp.bool_(False))
    return lax.while_loop(lambda s: ~s[3], body, start)[2]


def _varying(x, axes=AXIS):
    """``x`` typed as differing per device (a loop carry that the body makes device-specific)
    of ``axes`` (the devices; with replicas, the hosts too: what every replica gathered)."""
    missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
    return lax.pcast(x, missing, to="varying") if missing else x


def _update_on_owners(mesh, update):
    """``f(table, slots, route, grads, lr) -> (table, slots)`` running ``update(table_local,
    slots_local, requests, grads_local, lr, over)`` per device; ``route`` is (requests, busiest
    count) as the forward returned it."""

    def local(table_local, slots_local, route_local, grads_local, lr):
        requests, most = route_local
        return update(table_local, slots_local, requests, grads_local, lr, most[0])

    return jax.shard_map(local, mesh=mesh, in_specs=(P(AXIS), P(AXIS), P(AXIS), P(AXIS), P()),
                         out_specs=(P(AXIS), P(AXIS)))


def busiest_owner_requests(g: Group, mesh):
    """``f(ids [B, S]) -> int32 []``: the most distinct rows one device asks of one owner."""

    def local(ids_local):
        return _route_and_bucket(g, ids_local)[2][None]

    fn = jax.shard_map(local, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    return lambda ids_bs: fn(ids_bs)[0]


def _lookup_exchange(g: Group, capacity: int, wire_dtype):
    """``f(table_local, b, window) -> (vectors [n, W] float32, usable [n])``: one exchange of
    the window's requests; a request outside the window gets usable False."""

    def exchange(table_local, b, window):
        recv_rows = _all_to_all(send_buffer(b, window, capacity, g.num_devices, g.local_rows))
        vectors = table_local.at[recv_rows].get(mode="fill", fill_value=0).astype(wire_dtype)
        replies = _all_to_all(vectors)  # [N, C, W]: from each owner, in my request order
        owner, place, usable = slot_index(b, window)
        return replies[owner, place].astype(jnp.float32), usable

    return exchange


def _lookup(g: Group, capacity: int, wire_dtype):
    """``f(table_local, b, over) -> vectors [n, W]`` of every request, in one exchange or rounds."""
    exchange = _lookup_exchange(g, capacity, wire_dtype)

    def lookup(table_local, b, over):
        def one_round(acc, window):
            out, usable = exchange(table_local, b, window)
            return jnp.where(usable[:, None], out, acc)

        return _in_rounds(g, b, capacity, over, one_round, jnp.zeros((b.slot_valid.shape[0], g.width), jnp.float32))

    return lookup


def sharded_forward(g: Group, mesh, capacity: int, wire_dtype):
    """``f(table [N*R, W], ids [B, S]) -> (vectors [B, V, W] float32, overflowed bool [])``."""
    lookup = _lookup(g, capacity, wire_dtype)

    def local(table_local, ids_local):
        shape, b, most = _route_and_bucket(g, ids_local)
        out = lookup(table_local, b, most > capacity).reshape(*shape, g.width)
        return out, (most > capacity)[None], (b, most[None])

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=(P(AXIS), P(AXIS), P(AXIS)))

    def forward(table, ids_bs):
        """-> (vectors, overflowed, route): the route (buckets, busiest count) is the backward's
        residual, so the ids are not routed and sorted a second time."""
        out, over, route_ = fn(table, ids_bs)
        return out, over[0], route_

    return forward


def _gradients_to_owners(g: Group, capacity: int, wire_dtype, optimizer: SparseOptimizer):
    """``f(b, grads [n, W], window) -> (rows [N*C], grads [N*C, W] float32, where)``: each owner
    receives the window's rows and, per row, the sum of this device's gradients for it;
    ``where`` = (dest, place, usable) of each request in the [N, C] buffers."""

    def send(b, grads, window):
        recv_rows = _all_to_all(send_buffer(b, window, capacity, g.num_devices, g.local_rows))
        owner, place, usable = slot_index(b, window)
        dest = jnp.where(usable, owner, g.num_devices)  # unusable -> dropped by the scatter
        slot = dest * capacity + place  # dest == N (unusable) lands past the end: dropped
        sums = optimizer.segment_sum(grads, slot, g.num_devices * capacity)
        sums = sums.reshape(g.num_devices, capacity, g.width)
        recv_grads = _all_to_all(sums.astype(wire_dtype)).astype(jnp.float32)
        return recv_rows.reshape(-1), recv_grads.reshape(-1, g.width), (dest, place, usable)

    return send


def _owner_update_round(send, optimizer: SparseOptimizer, b: Buckets, grads, lr, replicas=None):
    """``one_round(state, window) -> state``: the window's rows and summed gradients go to their
    owners (and every replica's), which apply the optimizer."""

    def one_round(state, window):
        rows, recv_grads, _ = send(b, grads, window)
        return optimizer.update(*state, _gather_replicas(rows, replicas), _gather_replicas(recv_grads, replicas), lr)

    return one_round


def _sparse_update(g: Group, capacity: int, wire_dtype, optimizer: SparseOptimizer, dim: int, replicas=None):
    """``f(table_local, slots_local, b, grads [n, W], lr, over) -> (table, slots)``: the owners
    apply the optimizer to the rows requested, in one exchange or rounds.

    ``dim``: the tables' full width (for statistics over whole rows of column slices). Those
    need every slice's squared sum of a row before its update: in one exchange they travel
    with it; in rounds a first pass of rounds gathers them all."""
    send = _gradients_to_owners(g, capacity, wire_dtype, optimizer)
    whole_rows = optimizer.needs_whole_rows and g.has_column_slices

    agree = _agreed(replicas)

    def update(table_local, slots_local, b, grads, lr, over):
        if not whole_rows:
            one_round = _owner_update_round(send, optimizer, b, grads, lr, replicas)
            return _in_rounds(g, b, capacity, over, one_round, (table_local, slots_local), agree)

        def sq_round(acc, window):
            rows, recv_grads, (_, place, usable) = send(b, grads, window)
            every = _gather_replicas(rows, replicas), _gather_replicas(recv_grads, replicas)
            partial = _all_to_all(_slice_sq_sums(g, *every, rows.shape[0], replicas))
            return jnp.where(usable, partial[b.slot_owner, place], acc)

        zeros = jnp.zeros(grads.shape[:1], jnp.float32)
        totals = _if_overflow(over, lambda: _row_totals(g, _in_rounds(g, b, capacity, over, sq_round, zeros, agree)),
                              lambda: _varying(zeros, agree))

        def one_round(state, window):
            rows, recv_grads, where = send(b, grads, window)
            every = _gather_replicas(rows, replicas), _gather_replicas(recv_grads, replicas)  # once, for both uses

            def from_this_exchange():
                partial = _all_to_all(_slice_sq_sums(g, *every, rows.shape[0], replicas))
                return _row_totals(g, jnp.where(where[2], partial[b.slot_owner, where[1]], 0.0))

            row_totals = _if_overflow(over, lambda: totals, from_this_exchange)
            row_mean_sq = _gather_replicas(_to_owners(g, capacity, row_totals, where), replicas) / dim
            return optimizer.update(*state, *every, lr, row_mean_sq=row_mean_sq)

        return _in_rounds(g, b, capacity, over, one_round, (table_local, slots_local), agree)

    return update


def sharded_update(g: Group, mesh, capacity: int, wire_dtype, optimizer: SparseOptimizer, dim: int,
                   replicas: str | None = None):
    """``f(table, slots, route, grads [B, V, W], lr) -> (table, slots)``, sparse, on owners;
    ``route`` is what the forward returned. ``dim``: the tables' full width (for statistics
    over whole rows of column slices). ``replicas``: the axis the tables are replicated over
    (hosts), whose gradients every replica applies."""
    update = _sparse_update(g, capacity, wire_dtype, optimizer, dim, replicas)

    def on_owners(table_local, slots_local, b, grads, lr, most):
        over = _busiest_of_replicas(most, replicas) > capacity
        return update(table_local, slots_local, b, grads.reshape(-1, g.width), lr, over)

    return _update_on_owners(mesh, on_owners)


def _busiest_of_replicas(most, replicas: str | None):
    """The forward's busiest-owner count (agreed over the devices) agreed over the replicas
    too, so every host's update takes the same branch."""
    return most if replicas is None else lax.pmax(most, replicas)


def _slice_sq_sums(g: Group, every_rows, every_grads, own: int, replicas: str | None = None):
    """Owner side, per received request [N, C]: the squared sum over this owner's columns of the
    request's row's gradient, merged over every device (of every replica) that sent it.
    ``every_*``: what this owner and its replicas received (:func:`_gather_replicas`), of which
    this owner's ``own`` requests are its replica's block."""
    _, merged, inv = merge_duplicates(every_rows, every_grads, g.local_rows, return_inverse=True)
    sq = jnp.sum(merged * merged, -1)[inv]
    if replicas is not None:  # this replica's own requests
        sq = lax.dynamic_slice_in_dim(sq, lax.axis_index(replicas) * own, own)
    return sq.reshape(g.num_devices, -1)


def _row_totals(g: Group, per_slot):
    """Requester side: per request [n], the sum of the replies for all column slices of its row
    (the virtual slots reading the same batch slot and table), i.e. over the row's whole width."""
    row_of_vslot = np.unique(np.stack([g.vslot_slot, g.vslot_table]), axis=1, return_inverse=True)[1].reshape(-1)
    per_vslot = per_slot.reshape(-1, g.num_vslots)
    total = jax.ops.segment_sum(per_vslot.T, jnp.asarray(row_of_vslot), int(row_of_vslot.max()) + 1).T
    return total[:, row_of_vslot].reshape(-1)


def _to_owners(g: Group, capacity: int, values, where):
    """Per request [n] -> what each owner received at the same places [N*C] (all-to-all)."""
    dest, place, _ = where
    buf = jnp.zeros((g.num_devices, capacity), jnp.float32).at[dest, place].set(values, mode="drop")
    return _all_to_all(buf).reshape(-1)


def replicated_forward(g: Group):
    """``f(table [R, W], ids [B, S]) -> vectors [B, V, W]``: a local gather on every device."""

    def forward(table, ids_bs):
        vids = take_columns(ids_bs, g.vslot_slot)
        rows = jnp.where(vids == -1, g.local_rows, vids + jnp.asarray(g.vslot_offset))
        return table.at[rows].get(mode="fill", fill_value=0).astype(jnp.float32)

    return forward


def replicated_update(g: Group, mesh, optimizer: SparseOptimizer, replicas: str | None = None):
    """Every device gathers the batch's rows and gradients (of every replica's batch) and
    applies the same update.

    Moves B*V*(W+1) values per device rather than an all-reduce of the R x W table.
    """
    every = _agreed(replicas)

    def local(table, slots, ids_local, grads_local, lr):
        vids = take_columns(ids_local, g.vslot_slot)
        rows = jnp.where(vids == -1, g.local_rows, vids + jnp.asarray(g.vslot_offset)).reshape(-1)
        rows = lax.all_gather(rows, every, tiled=True)
        grads = lax.all_gather(grads_local.reshape(-1, g.width), every, tiled=True)
        return optimizer.update(table, slots, rows, grads, lr)

    # check_vma off: every device applies the same gathered update, so outputs are replicated.
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS), P()),
                         out_specs=(P(), P()), check_vma=False)


# ---------------------------------------------------------------- partial pooling at owners


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
    return (_all_to_all(put(row, fill=jnp.int32(g.local_rows))), _all_to_all(put(seg, fill=jnp.int32(0))),
            _all_to_all(put(weight, fill=jnp.float32(0))))


def _buckets_if_overflow(g: Group, req, over) -> Buckets:
    """The pooled route's requests as distinct (owner, row) buckets when the rounds need them
    (a sort, skipped otherwise: zeros of the same shapes)."""
    owner, row, _, valid, _, _ = req
    n = owner.shape[0]

    def distinct():
        return bucket(owner, row, valid, g.num_devices, g.local_rows)

    def unused():
        ints, flags = jnp.zeros(n, jnp.int32), jnp.zeros(n, bool)
        return jax.tree.map(_varying, Buckets(ints, ints, ints, flags, ints, ints, flags,
                                              jnp.zeros(g.num_devices, jnp.int32)))

    return _if_overflow(over, distinct, unused)


def pooled_forward(g: Group, mesh, capacity: int, local_batch: int, wire_dtype):
    """``f(table, ids [B, S], weights [B, S]) -> (pooled [B, F', W], overflowed [])``.

    Owners pool what they hold of every (sample, virtual feature) and send partial sums back;
    the requester adds the N partial sums: a reduce-scatter through an all-to-all. Moves
    B_local x F' vectors per owner instead of one per requested row: fewer bytes for large bags.
    On overflow, the rows come back in rounds (as for unpooled groups) and the requester pools.
    """
    n_seg = local_batch * len(g.vtables)
    out_shape = (local_batch, len(g.vtables), g.width)
    exchange = _lookup_exchange(g, capacity, wire_dtype)

    def pooled_at_owners(table_local, req):
        rows, segs, weights = _send_requests(g, req, capacity)  # [N, C] from each source
        vectors = table_local.at[rows].get(mode="fill", fill_value=0).astype(jnp.float32) * weights[..., None]
        target = (jnp.arange(g.num_devices)[:, None] * n_seg + segs).reshape(-1)
        partial_sums = jax.ops.segment_sum(vectors.reshape(-1, g.width), target, g.num_devices * n_seg)
        back = _all_to_all(partial_sums.reshape(g.num_devices, n_seg, g.width).astype(wire_dtype))
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

            return _if_overflow(over, rows_then_pool, lambda: pooled_at_owners(table_local, req))

        out = _in_rounds(g, b, capacity, over, one_round, jnp.zeros(out_shape, jnp.float32))
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
    send = _gradients_to_owners(g, capacity, wire_dtype, optimizer)
    agree = _agreed(replicas)

    def at_owners(state, req, grads_local, lr):
        rows, segs, weights = _send_requests(g, req, capacity)
        every = lax.all_gather(grads_local.reshape(-1, g.width).astype(wire_dtype), AXIS)  # [N, B_l F', W]
        grads = every[jnp.arange(g.num_devices)[:, None], segs].astype(jnp.float32) * weights[..., None]
        return optimizer.update(*state, _gather_replicas(rows.reshape(-1), replicas),
                                _gather_replicas(grads.reshape(-1, g.width), replicas), lr)

    def update(table_local, slots_local, req, grads_local, lr, most):
        over = _busiest_of_replicas(most, replicas) > capacity
        b = _buckets_if_overflow(g, req, over)
        _, _, _, _, seg, weight = req

        def one_round(state, window):
            def by_rows(state):
                per_request = grads_local.reshape(-1, g.width)[seg].astype(jnp.float32) * weight[:, None]
                return _owner_update_round(send, optimizer, b, per_request, lr, replicas)(state, window)

            return _if_overflow(over, by_rows, lambda s: at_owners(s, req, grads_local, lr), state)

        return _in_rounds(g, b, capacity, over, one_round, (table_local, slots_local), agree)

    return _update_on_owners(mesh, update)


def busiest_owner_all_requests(g: Group, mesh):
    """``f(ids [B, S]) -> int32 []``: the most requests (duplicates included) one device sends
    one owner: the statistic the pooled exchange's buckets are sized for."""

    def local(ids_local):
        return _route_all(g, ids_local, jnp.ones(ids_local.shape, jnp.float32))[1][None]

    fn = jax.shard_map(local, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    return lambda ids_bs: fn(ids_bs)[0]
