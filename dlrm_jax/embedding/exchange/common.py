"""What the exchange's forms share: routing and bucketing a device's ids, the all-to-all, running in
rounds when a bucket overflows (agreed by every device), copies of the tables on other hosts
that agree (``agree_over``: their axis), and where the
owners apply their update. The forms themselves: ``sharded``, ``pooled``, ``replicated``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from dlrm_jax.choices import ControlFlow
from dlrm_jax.chunks import by_platform
from dlrm_jax.embedding.exchange.columns import take_columns
from dlrm_jax.embedding.exchange.optimizers import SparseOptimizer
from dlrm_jax.embedding.exchange.routing import (
    Buckets,
    Window,
    bucket,
    next_round_limit,
    requests_below,
    route,
    send_buffer,
    slot_index,
)
from dlrm_jax.embedding.exchange.row_grads import Lookups, sum_by_row
from dlrm_jax.embedding.exchange.wire import Wire
from dlrm_jax.embedding.plan.layout import Group
from dlrm_jax.parallel.mesh import AXIS, varying


def route_group(g: Group, ids_local_bs: jax.Array):
    """A device's ids [B_l, S] -> owner, row, valid [B_l, V] of each of the group's virtual slots."""
    vids = take_columns(ids_local_bs, g.vslot_slot)  # [B_l, V]
    return route(
        vids,
        jnp.asarray(g.vslot_kind),
        jnp.asarray(g.vslot_device),
        jnp.asarray(g.vslot_offset),
        jnp.asarray(g.vslot_block),
        g.num_devices,
    )


def route_and_bucket(g: Group, ids_local_bs: jax.Array):
    owner, row, valid = route_group(g, ids_local_bs)
    b = bucket(owner, row, valid, g.num_devices, g.local_rows)
    overflow = lax.pmax(jnp.max(b.counts), AXIS)
    return owner.shape, b, overflow


def all_to_all(x):
    return lax.all_to_all(x, AXIS, 0, 0)


ROUNDS_SCOPE = "exchange_rounds"  # names the overflow-only ops in the compiled program
RESOLUTION_SCOPE = "id_resolution"  # names the dynamic tables' resolution of raw ids (one path a step)
# names the lookup's forms that reuse the id maps' routing: a step takes one of them or the plain
# form beside them, as the resolution went (both are in the program)
ROUTED_SCOPE = "routed_lookup"


def if_overflow(over, on_overflow, otherwise, *operands):
    """``lax.cond`` on ``over`` (a pmax-derived flag, so every device takes the same branch);
    the overflow branch's ops are named ``ROUNDS_SCOPE``."""

    def named(*args):
        with jax.named_scope(ROUNDS_SCOPE):
            return on_overflow(*args)

    return lax.cond(over, named, otherwise, *operands)


def agreed(agree_over: str | None):
    """The axes every decision of an update is agreed over: the devices, and the hosts when
    the tables have copies that agree over ``agree_over``."""
    return AXIS if agree_over is None else (agree_over, *AXIS)


def gather_over(x, agree_over: str | None):
    """What every copy's owner received along ``agree_over``, in host order (unchanged without one)."""
    return x if agree_over is None else lax.all_gather(x, agree_over, tiled=True)


def gather_lookups_over(lookups: Lookups, grads, agree_over: str | None):
    """:func:`gather_over` for lookups and the gradients they point at. The sources are
    the same on every replica (a static layout), so they are not sent: each replica's copy is
    shifted to its block of the gathered gradients."""
    if agree_over is None:
        return lookups, grads
    sources = lookups.sources
    if sources is not None:
        blocks = jnp.arange(lax.axis_size(agree_over), dtype=jnp.int32)[:, None] * grads.shape[0]
        sources = (sources[None, :] + blocks).reshape(-1)
    weights = None if lookups.weights is None else gather_over(lookups.weights, agree_over)
    return Lookups(gather_over(lookups.rows, agree_over), sources, weights), gather_over(grads, agree_over)


# How ``in_rounds`` takes its first trip: ``auto`` by platform (:func:`~dlrm_jax.chunks.by_platform`),
# ``one_path`` the GPUs' form everywhere (tests hold it against the reference on CPUs).
ROUNDS_FORM = ControlFlow.AUTO


def in_rounds(
    g: Group, b: Buckets, capacity: int, over, one_round, carry, agree=AXIS, first_trip: bool = True, trip=None
):
    """``one_round(carry, window) -> carry`` until every request is sent: one trip with all of
    each owner's requests when nothing overflowed, else over the agreed rounds (see routing).

    On GPUs (``first_trip``) that one trip runs before the loop, outside it, with all the
    requests where nothing overflowed (the common case: the loop then runs no round) and none
    after an overflow (the loop's rounds send them all): there the host drives a loop round by
    round (its body's kernels launched as command buffers, its collectives one by one) and
    reads its predicate each round, so the whole update of a row-wise table ran so every step
    (compiled for one H200, criteo_kaggle's row-wise tables: its 35 kernels in the loop, and 6
    host reads a step where nothing overflowed, 2 now; see ``bench.hlo_kernels``).
    On CPUs the loop takes every trip (the trip outside it cost 2-6% of a row-wise step on 8
    simulated devices). Callers that run only after an overflow pass ``first_trip=False``.
    ``trip``: ``one_round`` for that trip before the loop where it can do with less (it sends
    everything or nothing: what it would ask after an overflow it knows, with no cond).

    Never a ``lax.cond`` around the loop: one whose branch holds a loop that updates the table
    makes XLA copy the whole table shard; a loop whose body holds conds updates it in place.
    The limits are pmins over ``agree``, so every device runs the same rounds."""

    everything = jnp.full(g.num_devices, g.local_rows, jnp.int32)

    def agreed_limit(done):
        def proposals():
            return lax.pmin(next_round_limit(b, done, capacity, g.local_rows), agree)

        return if_overflow(over, proposals, lambda: everything)

    def body(state):  # a round: its limits agreed from what was sent, then its requests
        done, carry, _ = state
        limit = agreed_limit(done)
        end = requests_below(b, limit, g.local_rows)
        return end, one_round(carry, Window(done, end)), varying(jnp.all(limit == g.local_rows))

    def rounds(state):
        return lax.while_loop(lambda s: ~s[2], body, state)[1]

    done = varying(jnp.zeros(g.num_devices, jnp.int32))
    start = (done, jax.tree.map(lambda x: varying(x, agree), carry), varying(jnp.bool_(False)))

    def trip_first():
        limit = jnp.where(over, 0, everything)  # everything, or nothing after an overflow
        end = requests_below(b, limit, g.local_rows)
        state = (end, (trip or one_round)(start[1], Window(done, end)), varying(~over))
        with jax.named_scope(ROUNDS_SCOPE):  # (the loop runs a round only after an overflow)
            return rounds(state)

    return by_platform(lambda: rounds(start), trip_first, ROUNDS_FORM) if first_trip else rounds(start)


def checks_varying(optimizer: SparseOptimizer) -> bool:
    """``check_vma`` for a ``shard_map`` whose body runs ``optimizer.update``: off with the fused
    kernels, whose interpreter (every backend but GPUs) does not carry shard_map's varying
    axes through a kernel; the tests hold that update against the reference instead."""
    return not optimizer.kernel


def update_on_owners(mesh, update, optimizer: SparseOptimizer):
    """``f(table, slots, route, grads, lr) -> (table, slots)`` running ``update(table_local,
    slots_local, requests, grads_local, lr, over, recv_rows)`` per device; ``route`` is
    (requests, busiest count, rows the owner received or None) as the forward returned it."""

    def local(table_local, slots_local, route_local, grads_local, lr):
        requests, most, recv_rows = route_local
        return update(table_local, slots_local, requests, grads_local, lr, most[0], recv_rows)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(AXIS), P(AXIS), P(AXIS), P(AXIS), P()),
        out_specs=(P(AXIS), P(AXIS)),
        check_vma=checks_varying(optimizer),
    )


def busiest_owner_requests(g: Group, mesh):
    """``f(ids [B, S]) -> int32 []``: the most distinct rows one device asks of one owner."""

    def local(ids_local):
        return route_and_bucket(g, ids_local)[2][None]

    fn = jax.shard_map(local, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    return lambda ids_bs: fn(ids_bs)[0]


def busiest_over(most, agree_over: str | None):
    """The forward's busiest-owner count (agreed over the devices) agreed over ``agree_over``
    too, so every host's update takes the same branch."""
    return most if agree_over is None else lax.pmax(most, agree_over)


def own_squares(every, num_rows: int, own: int, agree_over: str | None, exact: bool = False):
    """Per lookup of this owner [own]: the squared sum over its columns of the lookup's row's
    gradient, summed over every lookup of the row that this owner and its copies along ``agree_over`` received.
    ``every``: (lookups, gradients) of every replica (:func:`gather_over`), of which this
    owner's ``own`` lookups are its replica's block."""
    sq = sum_by_row(*every, num_rows, exact).squares_per_lookup()
    if agree_over is not None:  # this replica's own lookups
        sq = lax.dynamic_slice_in_dim(sq, lax.axis_index(agree_over) * own, own)
    return sq


def slice_sq_sums(g: Group, every_rows, every_grads, own: int, agree_over: str | None = None):
    """Owner side, per received request [N, C]: :func:`own_squares` of the requests."""
    return own_squares((every_rows, every_grads), g.local_rows, own, agree_over).reshape(g.num_devices, -1)


def row_totals(g: Group, per_slot):
    """Requester side: per request [n], the sum of the replies for all column slices of its row
    (the virtual slots reading the same batch slot and table), i.e. over the row's whole width."""
    row_of_vslot = np.unique(np.stack([g.vslot_slot, g.vslot_table]), axis=1, return_inverse=True)[1].reshape(-1)
    per_vslot = per_slot.reshape(-1, g.num_vslots)
    total = jax.ops.segment_sum(per_vslot.T, jnp.asarray(row_of_vslot), int(row_of_vslot.max()) + 1).T
    return total[:, row_of_vslot].reshape(-1)


def to_owners(g: Group, capacity: int, values, where):
    """Per request [n] -> what each owner received at the same places [N*C] (all-to-all)."""
    dest, place, _ = where
    buf = jnp.zeros((g.num_devices, capacity), jnp.float32).at[dest, place].set(values, mode="drop")
    return all_to_all(buf).reshape(-1)


def lookup_exchange(g: Group, capacity: int, wire: Wire):
    """``f(table_local, b, window, recv_rows=None) -> (vectors [n, W] float32, usable [n],
    recv_rows)``: one exchange of the window's requests; a request outside the window gets
    usable False. ``recv_rows`` int32 [N, C], the rows each device asks of this owner: given
    where they are known already (the id maps' resolution routed the same requests), so they
    are not sent; returned either way (the backward's, which then sends none)."""

    def exchange(table_local, b, window, recv_rows=None):
        if recv_rows is None:
            recv_rows = all_to_all(send_buffer(b, window, capacity, g.num_devices, g.local_rows))
        vectors = table_local.at[recv_rows].get(mode="fill", fill_value=0)
        replies = wire.send(vectors, all_to_all)  # [N, C, W]: from each owner, in my request order
        owner, place, usable = slot_index(b, window)
        return replies[owner, place], usable, recv_rows

    return exchange


def gradients_to_owners(g: Group, capacity: int, wire: Wire, optimizer: SparseOptimizer):
    """``f(b, pooled, window, known=None) -> (rows [N*C], grads [N*C, W] float32, where)``:
    each owner receives the window's rows and, per row, the sum of this device's gradients for
    it (from ``pooled`` = (gradients [B_l, V', W], slot weights [B_l, V])); ``where`` = (dest,
    place, usable) of each request in the [N, C] buffers. ``known`` = (overflowed, rows [N, C]
    the forward's one exchange received): where nothing overflowed, the row ids are not sent
    again, only the gradients. ``before_loop``: the window is everything or, after an overflow,
    nothing (``in_rounds``' trip before the loop)."""

    def send(b, pooled, window, known=None, before_loop=False):
        def ask():
            return all_to_all(send_buffer(b, window, capacity, g.num_devices, g.local_rows))

        # the rows this owner was asked for in the forward's one exchange are the same requests
        if known is None:
            recv_rows = ask()
        elif before_loop:  # asking for nothing gives padding everywhere: no cond to read on the host
            recv_rows = jnp.where(known[0], g.local_rows, known[1])
        else:
            recv_rows = if_overflow(known[0], ask, lambda: known[1])
        owner, place, usable = slot_index(b, window)
        dest = jnp.where(usable, owner, g.num_devices)  # unusable -> dropped by the scatter
        slot = dest * capacity + place  # dest == N (unusable) lands past the end: dropped
        grads, weights = pooled
        lookups = Lookups.of_bags(slot.reshape(weights.shape), g.vslot_vfeature, grads.shape[1], weights)
        sums = optimizer.row_sums(lookups, grads.reshape(-1, g.width), g.num_devices * capacity)
        sums = sums.reshape(g.num_devices, capacity, g.width)
        recv_grads = wire.send(sums, all_to_all)
        return recv_rows.reshape(-1), recv_grads.reshape(-1, g.width), (dest, place, usable)

    return send


def owner_update_round(
    send, optimizer: SparseOptimizer, b: Buckets, grads, lr, agree_over=None, known=None, before_loop=False
):
    """``one_round(state, window) -> state``: the window's rows and summed gradients go to their
    owners (and every replica's), which apply the optimizer (``known``, ``before_loop``: ``send``'s)."""

    def one_round(state, window):
        rows, recv_grads, _ = send(b, grads, window, known, before_loop)
        return optimizer.update(*state, gather_over(rows, agree_over), gather_over(recv_grads, agree_over), lr)

    return one_round
