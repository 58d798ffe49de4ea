"""Routing of looked-up ids to the devices that own their rows, and bucketing for the exchange.

This is the one home of "which device owns which id, and where it sits there". Everything is a
pure jnp function of fixed-shape arrays, usable inside ``shard_map`` on one device's slice of the
batch, and property-tested on its own.

A *virtual slot* is one (batch slot, virtual table) pair: a whole table, a column slice of one,
or one table of a row-wise group. Its routing parameters are static per virtual slot.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dlrm_jax.embedding.plan.layout import KIND_BLOCK, KIND_CYCLIC
from dlrm_jax.few_segments import few_segment_sum
from dlrm_jax.ids import PAD_ID
from dlrm_jax.sorting import first_places, sort_with_order


def route(ids, kind, device, offset, block, num_devices: int, xp=jnp):
    """Owner device and row inside the owner's local shard of every id.

    ids: int32 [..., V] table-local ids (PAD_ID allowed); kind, device, offset, block: int32 [V]
    static per virtual slot. Returns owner [..., V], local row [..., V], valid bool [..., V].
    ``xp``: jax.numpy inside programs, numpy on the host (the same routing, bit for bit).
    """
    valid = ids != PAD_ID
    safe = xp.where(valid, ids, 0)
    owner = xp.where(
        kind == KIND_BLOCK, device + safe // block, xp.where(kind == KIND_CYCLIC, safe % num_devices, device)
    )
    within = xp.where(kind == KIND_BLOCK, safe % block, xp.where(kind == KIND_CYCLIC, safe // num_devices, safe))
    return owner.astype(xp.int32), (offset + within).astype(xp.int32), valid


class Buckets(NamedTuple):
    """Unique (owner, row) requests of one device, grouped by owner.

    Over the n = B_local * V requests, flattened:
      unique_owner, unique_row, unique_rank, unique_valid: [n]  each distinct request once,
          rank = its position among the requests to the same owner (padding: valid False)
      slot_owner, slot_rank: [n]  where each original request's answer will be
      slot_valid: [n]  False for padding ids
      counts: [N]  distinct requests per owner
    """

    unique_owner: jax.Array
    unique_row: jax.Array
    unique_rank: jax.Array
    unique_valid: jax.Array
    slot_owner: jax.Array
    slot_rank: jax.Array
    slot_valid: jax.Array
    counts: jax.Array


def one_key(bound: int) -> bool:
    """Whether (owner, row) pairs below ``bound`` combined fit in one int32 key."""
    return bound <= 1 << 31


def bucket(owner, row, valid, num_devices: int, local_rows: int) -> Buckets:
    """Deduplicate requests and give each distinct one a rank within its owner's bucket.

    Sorting by (owner, row) groups requests by owner, so a request's rank is its index minus
    the index of the owner's first request. The two keys are combined into ``owner *
    local_rows + row`` where that fits in an int32 (``sorting`` sorts it fastest), else sorted
    together (64 owners of 40M-row shards would overflow int32)."""
    o = jnp.where(valid, owner, num_devices).reshape(-1).astype(jnp.int32)  # padding sorts last
    r = jnp.where(valid, row, 0).reshape(-1).astype(jnp.int32)
    n = o.shape[0]
    bound = (num_devices + 1) * local_rows
    if one_key(bound):  # (owner, row) as one key
        key, perm = sort_with_order(o * local_rows + r, bound)
        so, sr = key // local_rows, key % local_rows
    else:
        so, sr, perm = lax.sort((o, r, jnp.arange(n, dtype=jnp.int32)), num_keys=2)
    first = jnp.concatenate([jnp.ones(1, bool), (so[1:] != so[:-1]) | (sr[1:] != sr[:-1])])
    distinct = jnp.cumsum(first.astype(jnp.int32)) - 1  # each sorted request's distinct index
    u_owner = jnp.full(n, num_devices, jnp.int32).at[distinct].set(so)
    u_row = jnp.full(n, local_rows, jnp.int32).at[distinct].set(sr)
    u_valid = u_owner < num_devices
    starts = first_places(u_owner, num_devices + 1)
    u_owner = jnp.where(u_valid, u_owner, 0)
    u_rank = (jnp.arange(n) - starts[u_owner]).astype(jnp.int32)
    inv = jnp.zeros(n, jnp.int32).at[perm].set(distinct)
    return Buckets(
        u_owner,
        jnp.where(u_valid, u_row, 0),
        u_rank,
        u_valid,
        u_owner[inv],
        u_rank[inv],
        valid.reshape(-1),
        jnp.diff(starts),
    )


def buckets_as_routed(slot_valid, owner, rank, index, num_devices: int) -> Buckets:
    """:class:`Buckets` of requests some earlier exchange sent already (the id maps' resolution
    of raw ids): each distinct request's ``owner`` (``num_devices``: padding) and ``rank``
    (places 0, 1, ... per owner), and each request's distinct number ``index`` (past the end:
    padding); ``slot_valid`` bool [n]: the requests to answer (hot rows left out: a distinct
    request none of them asks for is left out too). Not sorted by row, and without rows (the
    owners know them): for one exchange of everything whose rows are not sent, never for
    rounds."""
    n = owner.shape[0]
    asked = jnp.zeros(n, bool).at[index].max(slot_valid, mode="drop")
    real = owner < num_devices
    owner = jnp.where(real, owner, 0)
    at = jnp.minimum(index, n - 1)
    counts = few_segment_sum(real.astype(jnp.int32), owner, num_devices)  # places taken per owner
    unsent = jnp.zeros_like(rank)  # (the rows: never sent, so never needed here)
    return Buckets(owner, unsent, rank, asked & real, owner[at], rank[at], slot_valid, counts)


def ids_as_routed(owner, rank, index, answered, kind, device, offset, block, num_devices: int) -> jax.Array:
    """The ids [n] of a device's requests that some earlier exchange routed
    (:func:`buckets_as_routed`'s ``owner``, ``rank`` and ``index``), from what each owner
    answered them (``answered`` int32 [N, S]: from each owner, at this device's places there,
    the local row it holds; -1: none): the inverse of :func:`route` (``kind``, ``device``,
    ``offset`` and ``block`` int32 [n], each request's slot's). PAD_ID where padding."""
    n = owner.shape[0]
    at = jnp.minimum(index, n - 1)
    o, r = owner[at], rank[at]
    got = answered[jnp.minimum(o, num_devices - 1), jnp.minimum(r, answered.shape[1] - 1)]
    row = got - offset
    ids = jnp.where(
        kind == KIND_BLOCK, (o - device) * block + row, jnp.where(kind == KIND_CYCLIC, row * num_devices + o, row)
    )
    return jnp.where((index < n) & (o < num_devices) & (got >= 0), ids, PAD_ID).astype(jnp.int32)


class Window(NamedTuple):
    """Which of one device's requests to each owner go into one exchange: the ranks
    ``first[o] <= rank < end[o]``, placed at ``rank - first[o]`` (``end - first`` <= capacity)."""

    first: jax.Array  # int32 [N]
    end: jax.Array  # int32 [N]


def _in_window(owner, rank, valid, window: Window):
    first = window.first[owner]
    return valid & (rank >= first) & (rank < window.end[owner]), rank - first


def send_buffer(b: Buckets, window: Window, capacity: int, num_devices: int, pad_row: int) -> jax.Array:
    """int32 [N, C]: row ids to request from each owner; unused places hold ``pad_row``.

    Requests outside the window are left out; the caller checks ``counts`` first.
    """
    fits, place = _in_window(b.unique_owner, b.unique_rank, b.unique_valid, window)
    return scatter_to_buckets(b.unique_owner, place, fits, b.unique_row, capacity, num_devices, jnp.int32(pad_row))


def slot_index(b: Buckets, window: Window):
    """Where each request's answer sits in an [N, C] reply: (owner, place, usable)."""
    usable, place = _in_window(b.slot_owner, b.slot_rank, b.slot_valid, window)
    return b.slot_owner, jnp.where(usable, place, 0), usable


# Rounds. When some device has more distinct requests for an owner than the capacity, the
# exchange runs in rounds, each a window of the owner's rows [previous limit, limit) that every
# device agrees on (the limit is a pmin of each device's proposal). Each device proposes the row
# of its (capacity+1)-th request still to go, so no device has more than ``capacity`` requests in
# a round, the proposing device sends exactly ``capacity`` (progress), and every row falls in
# exactly one round on every device: the owner sees all of a row's gradients at once, as a
# stateful optimizer such as Adagrad needs.


def _owner_starts(b: Buckets):
    return jnp.cumsum(b.counts) - b.counts


def next_round_limit(b: Buckets, done, capacity: int, local_rows: int):
    """int32 [N]: this device's proposal for the next round's end row at each owner, given
    ``done`` [N] requests already sent: the row of its request number ``done + capacity``, or
    ``local_rows`` (everything) when fewer remain."""
    idx = _owner_starts(b) + done + capacity
    more = done + capacity < b.counts
    row = b.unique_row[jnp.clip(idx, 0, b.unique_row.shape[0] - 1)]
    return jnp.where(more, row, local_rows).astype(jnp.int32)


def requests_below(b: Buckets, limit, local_rows: int):
    """int32 [N]: the end of the round that ``limit`` closes at each owner: one past the last
    place of this device's requests to it for rows below ``limit[owner]`` (sorted buckets hold
    those in places 0, 1, ...: their count; buckets as routed may hold places of requests
    none asks for among them, which the window's flags leave out)."""
    below = b.unique_valid & (b.unique_row < limit[b.unique_owner])
    end = jax.ops.segment_max(jnp.where(below, b.unique_rank + 1, 0), b.unique_owner, b.counts.shape[0])
    return jnp.maximum(end, 0)  # (an owner asked nothing: the segment's max is the int minimum)


def scatter_to_buckets(owner, rank, usable, values, capacity: int, num_devices: int, fill):
    """[N, C] buffer with ``values[i]`` at (owner[i], rank[i]) for usable requests, else ``fill``."""
    dest = jnp.where(usable, owner, num_devices)  # out of bounds -> dropped
    buf = jnp.full((num_devices, capacity), fill, values.dtype)
    return buf.at[dest, rank].set(values, mode="drop")
