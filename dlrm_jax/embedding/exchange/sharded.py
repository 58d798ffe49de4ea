"""The ids form of the sparse exchange: distinct rows travel to the requester, which pools.

It serves row-wise tables (and table-wise ones whose plan says ``ids``). Per part, inside one
``jax.shard_map`` over every device of the mesh (its ``data`` and ``model`` axes), each device:

forward   route its ids to owners -> deduplicate per owner -> all_to_all of row ids (fixed
          capacity C per owner) -> owners gather rows from their local shard -> all_to_all of
          vectors back -> each slot picks its vector.
backward  the same buckets -> gradients of duplicate slots summed into their bucket place ->
          all_to_all of gradients to owners, which kept the row ids the forward sent them
          (sent again only after rounds) -> the owner applies the sparse optimizer to its
          shard (merging what several devices sent for one row).

Overflow: when any device has more distinct requests for one owner than C (the decision is a
pmax, so all agree), the exchange runs in rounds at the same capacity instead, each round a
window of every owner's rows that all devices agree on (see ``routing``). Nothing is dropped,
no buffer is larger than C, a row is updated once per step, and the step reports that it
happened.

Replicas over hosts (embedding.sync=host_replicas, ``agree_over`` the hosts axis): every host
holds the tables, split over its own devices, and runs this exchange among them only. The
updates keep the copies equal: each owner gathers what its counterparts on the other hosts
received (an all-gather over ``agree_over``, the only cross-host embedding traffic) and applies
the whole batch's gradients, and the decisions to run in rounds, and their windows, are agreed
over every host.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from dlrm_jax.embedding.exchange.columns import segment_sum_axis1, take_columns
from dlrm_jax.embedding.exchange.common import (
    ROUTED_SCOPE,
    agreed,
    all_to_all,
    busiest_over,
    gather_over,
    gradients_to_owners,
    if_overflow,
    in_rounds,
    lookup_exchange,
    owner_update_round,
    route_and_bucket,
    row_totals,
    slice_sq_sums,
    to_owners,
    update_on_owners,
)
from dlrm_jax.embedding.exchange.optimizers import SparseOptimizer
from dlrm_jax.embedding.exchange.routing import Window, buckets_as_routed, ids_as_routed
from dlrm_jax.embedding.plan.layout import ExchangePart, Group
from dlrm_jax.ids import PAD_ID
from dlrm_jax.parallel.mesh import AXIS, varying


def _lookup(g: Group, capacity: int, wire):
    """``f(table_local, b, over) -> (vectors [n, W], rows [N, C])`` of every request, in one
    exchange or rounds; ``rows``: those this owner was asked for in one exchange (the
    backward's, which sends no row ids), ``g.local_rows`` after rounds (unused: it asks again)."""
    exchange = lookup_exchange(g, capacity, wire)

    def lookup(table_local, b, over):
        def one_round(acc, window):
            out, usable, _ = exchange(table_local, b, window)
            return jnp.where(usable[:, None], out, acc)

        def rounds():
            acc = jnp.zeros((b.slot_valid.shape[0], g.width), jnp.float32)
            unknown = varying(jnp.full((g.num_devices, capacity), g.local_rows, jnp.int32))
            return in_rounds(g, b, capacity, over, one_round, acc, first_trip=False), unknown

        def at_once():  # nothing overflowed: one exchange of every request, no loop and no accumulator
            out, usable, rows = exchange(table_local, b, Window(jnp.zeros_like(b.counts), b.counts))
            return jnp.where(usable[:, None], out, 0.0), rows

        # (a lookup only reads the table, so a cond does not copy it, as one around an update would)
        return if_overflow(over, rounds, at_once)

    return lookup


def sharded_forward(g: Group, mesh, capacity: int, wire):
    """``f(table [N*R, W], ids [B, S], routed=None) -> (vectors [B, V, W] float32, overflowed
    bool [])``. ``routed``: how the id maps' resolution sent these requests already
    (``dynamic.sharded.Route``, the group's slots being its ids in order): used when it was
    routed in buffers within ``capacity``, so the requests are neither sorted nor sent again;
    otherwise, where it was routed, the group's ids that are not padding are taken from the
    rows its owners gave (``ids_as_routed``): the resolution may have left them unsent."""
    lookup = _lookup(g, capacity, wire)
    exchange = lookup_exchange(g, capacity, wire)

    def local(table_local, ids_local):
        shape, b, most = route_and_bucket(g, ids_local)
        out, rows = lookup(table_local, b, most > capacity)
        return out.reshape(*shape, g.width), (most > capacity)[None], (b, most[None], rows)

    def local_routed(table_local, ids_local, routed):
        @jax.named_scope(ROUTED_SCOPE)
        def as_routed():
            valid = (take_columns(ids_local, g.vslot_slot) != PAD_ID).reshape(-1)  # (hot ids are out)
            b = buckets_as_routed(valid, routed.owner, routed.rank, routed.index, g.num_devices)
            received = routed.received.reshape(g.num_devices, -1)
            sent = received.shape[1]  # (within capacity: wider places are empty when this runs)
            received = received[:, :capacity] if sent >= capacity else jnp.pad(received, ((0, 0), (0, capacity - sent)))
            out, usable, rows = exchange(
                table_local,
                b,
                Window(jnp.zeros_like(b.counts), b.counts),
                jnp.where(received >= 0, received, g.local_rows),
            )
            out = jnp.where(usable[:, None], out, 0.0).reshape(ids_local.shape[0], -1, g.width)
            return out, jnp.zeros(1, bool), (b, routed.busiest[None], rows)

        @jax.named_scope(ROUTED_SCOPE)
        def as_ids():  # a routed step's ids of these slots may be placeholders (``DynamicTables.resolve``)
            slots = lambda x: jnp.tile(jnp.asarray(x), ids_local.shape[0])
            vids = ids_as_routed(
                routed.owner,
                routed.rank,
                routed.index,
                all_to_all(routed.received.reshape(g.num_devices, -1)),  # each owner's rows, back
                *(slots(x) for x in (g.vslot_kind, g.vslot_device, g.vslot_offset, g.vslot_block)),
                g.num_devices,
            )
            held = take_columns(ids_local, g.vslot_slot)
            return ids_local.at[:, g.vslot_slot].set(jnp.where(held != PAD_ID, vids.reshape(held.shape), PAD_ID))

        def afresh():  # (one copy of the lookup in the program, whichever ids it takes)
            return local(table_local, lax.cond(routed.used, as_ids, lambda: ids_local))

        reuse = routed.used & (routed.busiest <= capacity)  # (alike on every device)
        return lax.cond(reuse, as_routed, afresh)

    specs = (P(AXIS), P(), P(AXIS))  # (the flag is alike everywhere: reading it outside needs no collective)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=specs)
    routed_spec = lambda r: type(r)(P(), P(), *(P(AXIS),) * (len(r) - 2))
    fn_routed = lambda table, ids, r: jax.shard_map(
        local_routed, mesh=mesh, in_specs=(P(AXIS), P(AXIS), routed_spec(r)), out_specs=specs
    )(table, ids, r)

    def forward(table, ids_bs, routed=None):
        """-> (vectors, overflowed, route): the route (buckets, busiest count) is the backward's
        residual, so the ids are not routed and sorted a second time."""
        out, over, route_ = fn(table, ids_bs) if routed is None else fn_routed(table, ids_bs, routed)
        return out, over[0], route_

    return forward


def _sparse_update(g: Group, capacity: int, wire, optimizer: SparseOptimizer, dim: int, agree_over=None):
    """``f(table_local, slots_local, b, pooled, lr, over) -> (table, slots)``: the owners
    apply the optimizer to the rows requested, in one exchange or rounds. ``pooled``: this
    device's (gradients [B_l, V', W] of its pooled outputs, weights [B_l, V] of its slots).

    ``dim``: the tables' full width (for statistics over whole rows of column slices). Those
    need every slice's squared sum of a row before its update: in one exchange they travel
    with it; in rounds a first pass of rounds gathers them all."""
    send = gradients_to_owners(g, capacity, wire, optimizer)
    whole_rows = optimizer.needs_whole_rows and g.has_column_slices

    agree = agreed(agree_over)

    def update(table_local, slots_local, b, grads, lr, over, recv_rows=None):
        known = None if recv_rows is None else (over, recv_rows)
        if not whole_rows:
            round_ = lambda before_loop: owner_update_round(
                send, optimizer, b, grads, lr, agree_over, known, before_loop
            )
            return in_rounds(g, b, capacity, over, round_(False), (table_local, slots_local), agree, trip=round_(True))

        def sq_round(acc, window):
            rows, recv_grads, (_, place, usable) = send(b, grads, window)
            every = gather_over(rows, agree_over), gather_over(recv_grads, agree_over)
            partial = all_to_all(slice_sq_sums(g, *every, rows.shape[0], agree_over))
            return jnp.where(usable, partial[b.slot_owner, place], acc)

        zeros = jnp.zeros(b.slot_valid.shape, jnp.float32)
        totals = if_overflow(
            over,
            lambda: row_totals(g, in_rounds(g, b, capacity, over, sq_round, zeros, agree, first_trip=False)),
            lambda: varying(zeros, agree),
        )

        def round_(before_loop):  # (before the loop: everything, or nothing after an overflow)
            def one_round(state, window):
                rows, recv_grads, where = send(b, grads, window, known, before_loop)
                every = gather_over(rows, agree_over), gather_over(recv_grads, agree_over)  # once, for both uses

                def from_this_exchange():
                    partial = all_to_all(slice_sq_sums(g, *every, rows.shape[0], agree_over))
                    return row_totals(g, jnp.where(where[2], partial[b.slot_owner, where[1]], 0.0))

                these_totals = (
                    from_this_exchange() if before_loop else if_overflow(over, lambda: totals, from_this_exchange)
                )
                row_mean_sq = gather_over(to_owners(g, capacity, these_totals, where), agree_over) / dim
                return optimizer.update(*state, *every, lr, row_mean_sq=row_mean_sq)

            return one_round

        return in_rounds(g, b, capacity, over, round_(False), (table_local, slots_local), agree, trip=round_(True))

    return update


def sharded_update(
    g: Group, mesh, capacity: int, wire, optimizer: SparseOptimizer, dim: int, agree_over: str | None = None
):
    """``f(table, slots, route, (grads [B, V', W], weights [B, V]), lr) -> (table, slots)``,
    sparse, on owners (the pooled outputs' gradients and the slots' pooling weights);
    ``route`` is what the forward returned. ``dim``: the tables' full width (for statistics
    over whole rows of column slices). ``agree_over``: the axis the tables are replicated over
    (hosts), whose gradients every replica applies."""
    update = _sparse_update(g, capacity, wire, optimizer, dim, agree_over)

    def on_owners(table_local, slots_local, b, grads, lr, most, recv_rows):
        # (not overflowed when agreed over the hosts -> not on this one either: the rows hold)
        over = busiest_over(most, agree_over) > capacity
        return update(table_local, slots_local, b, grads, lr, over, recv_rows)

    return update_on_owners(mesh, on_owners, optimizer)


class IdsForm:
    """One ids part's lookup and update with the forms' shared interface: ``forward(table,
    ids, weights) -> (pooled [B, V'*W], residual, overflowed)``, ``update(table, slots,
    residual, grad [B, V'*W], lr) -> (table, slots)``; ``cols``: the output's columns."""

    def __init__(
        self,
        part: ExchangePart,
        mesh,
        capacity: int,
        wire,
        optimizer: SparseOptimizer,
        dim: int,
        agree_over: str | None = None,
        one_hot: bool = False,
    ):
        g = self.group = part.group
        self.cols = g.vfeature_cols.reshape(-1)
        self.one_hot = one_hot
        self._forward = sharded_forward(g, mesh, capacity, wire)
        self._update = sharded_update(g, mesh, capacity, wire, optimizer, dim, agree_over)

    def forward(self, table, ids_bs, weights_bs, routed=None):
        """(``routed``: ``sharded_forward``'s: how the id maps sent these requests already.)"""
        g = self.group
        vectors, over, route_ = self._forward(table, ids_bs) if routed is None else self._forward(table, ids_bs, routed)
        weighted = vectors * take_columns(weights_bs, g.vslot_slot)[:, :, None]  # [B, V, W]
        pooled = (
            weighted
            if self.one_hot and len(g.vtables) == g.num_vslots
            else segment_sum_axis1(weighted, g.vslot_vfeature, len(g.vtables))
        )
        return pooled.reshape(pooled.shape[0], -1), (route_, weights_bs), over.astype(jnp.int32)

    def update(self, table, slots, residual, grad_bc, lr):
        g = self.group
        route_, weights_bs = residual
        pooled = grad_bc.reshape(grad_bc.shape[0], -1, g.width), take_columns(weights_bs, g.vslot_slot)
        return self._update(table, slots, route_, pooled, lr)
