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
import numpy as np

from dlrm_jax.data.batch import PAD_ID

KIND_FIXED = 0  # the owner is a fixed device (table-wise, column slice, or replicated)
KIND_BLOCK = 1  # row-wise, contiguous blocks: owner = id // block
KIND_CYCLIC = 2  # row-wise, cyclic: owner = id % N


def route(ids, kind, device, offset, block, num_devices: int):
    """Owner device and row inside the owner's local shard of every id.

    ids: int32 [..., V] table-local ids (PAD_ID allowed); kind, device, offset, block: int32 [V]
    static per virtual slot. Returns owner [..., V], local row [..., V], valid bool [..., V].
    """
    valid = ids != PAD_ID
    safe = jnp.where(valid, ids, 0)
    owner = jnp.where(kind == KIND_BLOCK, safe // block,
                      jnp.where(kind == KIND_CYCLIC, safe % num_devices, device))
    within = jnp.where(kind == KIND_BLOCK, safe % block,
                       jnp.where(kind == KIND_CYCLIC, safe // num_devices, safe))
    return owner.astype(jnp.int32), (offset + within).astype(jnp.int32), valid


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


def bucket(owner, row, valid, num_devices: int, local_rows: int) -> Buckets:
    """Deduplicate requests and give each distinct one a rank within its owner's bucket.

    Sorting the key ``owner * local_rows + row`` groups requests by owner, so a request's rank
    is its index minus the index of the owner's first request.
    """
    sentinel = num_devices * local_rows
    key = jnp.where(valid, owner * local_rows + row, sentinel).reshape(-1)
    n = key.shape[0]
    uniq, inv = jnp.unique(key, size=n, fill_value=sentinel, return_inverse=True)
    inv = inv.reshape(-1)
    starts = jnp.searchsorted(uniq, jnp.arange(num_devices + 1, dtype=key.dtype) * local_rows)
    u_valid = uniq < sentinel
    u_owner = jnp.where(u_valid, uniq // local_rows, 0).astype(jnp.int32)
    u_rank = (jnp.arange(n) - starts[u_owner]).astype(jnp.int32)
    return Buckets(u_owner, (uniq % local_rows).astype(jnp.int32), u_rank, u_valid,
                   u_owner[inv], u_rank[inv], valid.reshape(-1), jnp.diff(starts).astype(jnp.int32))


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
    return scatter_to_buckets(b.unique_owner, place, fits, b.unique_row, capacity, num_devices,
                              jnp.int32(pad_row))


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
    """int32 [N]: how many of this device's requests to each owner are for rows below
    ``limit[owner]``: the end of the round that ``limit`` closes."""
    n_owners = b.counts.shape[0]
    key = jnp.where(b.unique_valid, b.unique_owner * local_rows + b.unique_row, n_owners * local_rows)
    below = jnp.searchsorted(key, jnp.arange(n_owners, dtype=key.dtype) * local_rows + limit)
    return (below - _owner_starts(b)).astype(jnp.int32)


def rank_by_owner(owner, valid, num_devices: int):
    """Every request ranked among the requests to the same owner, in input order (no dedupe).

    owner, valid: [n]. Returns rank int32 [n] and counts int32 [N] of valid requests per owner.
    """
    key = jnp.where(valid, owner, num_devices)
    n = key.shape[0]
    order = jnp.argsort(key, stable=True)
    starts = jnp.searchsorted(key[order], jnp.arange(num_devices + 1, dtype=key.dtype))
    rank_sorted = jnp.arange(n) - starts[jnp.minimum(key[order], num_devices)]
    rank = jnp.zeros(n, jnp.int32).at[order].set(rank_sorted.astype(jnp.int32))
    return rank, jnp.diff(starts).astype(jnp.int32)


def scatter_to_buckets(owner, rank, usable, values, capacity: int, num_devices: int, fill):
    """[N, C] buffer with ``values[i]`` at (owner[i], rank[i]) for usable requests, else ``fill``."""
    dest = jnp.where(usable, owner, num_devices)  # out of bounds -> dropped
    buf = jnp.full((num_devices, capacity), fill, values.dtype)
    return buf.at[dest, rank].set(values, mode="drop")


# ---------------------------------------------------------------- hot rows
# Which ids are hot is decided here too: a hot id is answered by the replica every device
# holds and never enters a bucket. The hot rows of a group are kept as (table, id) pairs sorted
# lexicographically, padded at the end with (HOT_PAD, HOT_PAD); a row's place in that order is
# its row in the replicated hot table. The search runs in the step on replicated arrays of fixed
# size, so a refresh only changes their contents (no recompilation), and it compares pairs,
# not table offset + id, so tables of billions of rows do not overflow int32.
HOT_PAD = 2**31 - 1


def hot_keys(rows_per_table, capacity: int) -> np.ndarray:
    """The hot set as the step reads it: int32 [2, capacity], (table, id) pairs sorted, then
    (HOT_PAD, HOT_PAD). ``rows_per_table``: one array of distinct row ids per table."""
    tables = np.concatenate([np.full(len(r), t, np.int64) for t, r in enumerate(rows_per_table)] or [[]])
    ids = np.concatenate([np.asarray(r, np.int64) for r in rows_per_table] or [[]])
    if tables.size > capacity:
        raise ValueError(f"{tables.size} hot rows do not fit the hot capacity {capacity}")
    order = np.lexsort((ids, tables))
    out = np.full((2, capacity), HOT_PAD, np.int32)
    out[0, :tables.size], out[1, :tables.size] = tables[order], ids[order]
    return out


def hot_rows_per_table(keys: np.ndarray, num_tables: int) -> list[np.ndarray]:
    """The inverse of :func:`hot_keys`: per table, its hot row ids (ascending)."""
    keys = np.asarray(keys)
    return [keys[1, keys[0] == t].astype(np.int64) for t in range(num_tables)]


def split_hot(ids, table, hot_tables, hot_ids):
    """Split looked-up ids into hot rows and cold ids.

    ids: int32 [..., V] table-local ids (PAD_ID allowed); table: int32 [V], the table of each
    virtual slot; hot_tables, hot_ids: int32 [K] the hot (table, id) pairs, sorted, padded with
    HOT_PAD. Returns hot_row int32 [..., V] (the pair's index in the hot arrays, -1 when cold or
    padding) and cold_ids int32 [..., V] (ids with the hot ones replaced by PAD_ID).
    """
    k = hot_ids.shape[0]
    t = jnp.broadcast_to(table, ids.shape)
    if k == 0:
        return jnp.full(ids.shape, -1, jnp.int32), ids
    # Lower bound of (t, id) by binary search with a fixed number of halvings.
    lo = jnp.zeros(ids.shape, jnp.int32)
    hi = jnp.full(ids.shape, k, jnp.int32)
    for _ in range(max(1, k.bit_length())):
        mid = (lo + hi) // 2
        mt, mi = hot_tables[jnp.minimum(mid, k - 1)], hot_ids[jnp.minimum(mid, k - 1)]
        below = (mid < hi) & ((mt < t) | ((mt == t) & (mi < ids)))
        lo = jnp.where(below, mid + 1, lo)
        hi = jnp.where(below, hi, mid)
    at = jnp.minimum(lo, k - 1)
    hot = (ids != PAD_ID) & (lo < k) & (hot_tables[at] == t) & (hot_ids[at] == ids)
    return jnp.where(hot, lo, -1).astype(jnp.int32), jnp.where(hot, PAD_ID, ids).astype(jnp.int32)
