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
from jax import lax

from dlrm_jax.embedding.plan.layout import KIND_BLOCK, KIND_CYCLIC
from dlrm_jax.hashing import mix32
from dlrm_jax.ids import PAD_ID


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


def bucket(owner, row, valid, num_devices: int, local_rows: int) -> Buckets:
    """Deduplicate requests and give each distinct one a rank within its owner's bucket.

    Sorting by (owner, row) groups requests by owner, so a request's rank is its index minus
    the index of the owner's first request. The two keys are sorted together rather than
    combined into ``owner * local_rows + row``, which would overflow int32 on large meshes
    (64 owners of 40M-row shards)."""
    o = jnp.where(valid, owner, num_devices).reshape(-1).astype(jnp.int32)  # padding sorts last
    r = jnp.where(valid, row, 0).reshape(-1).astype(jnp.int32)
    n = o.shape[0]
    so, sr, perm = lax.sort((o, r, jnp.arange(n, dtype=jnp.int32)), num_keys=2)
    first = jnp.concatenate([jnp.ones(1, bool), (so[1:] != so[:-1]) | (sr[1:] != sr[:-1])])
    distinct = jnp.cumsum(first.astype(jnp.int32)) - 1  # each sorted request's distinct index
    u_owner = jnp.full(n, num_devices, jnp.int32).at[distinct].set(so)
    u_row = jnp.full(n, local_rows, jnp.int32).at[distinct].set(sr)
    u_valid = u_owner < num_devices
    starts = jnp.searchsorted(u_owner, jnp.arange(num_devices + 1, dtype=jnp.int32)).astype(jnp.int32)
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
    """int32 [N]: how many of this device's requests to each owner are for rows below
    ``limit[owner]``: the end of the round that ``limit`` closes."""
    below = b.unique_valid & (b.unique_row < limit[b.unique_owner])
    return jax.ops.segment_sum(below.astype(jnp.int32), b.unique_owner, b.counts.shape[0])


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
# holds and never enters a bucket. The hot set is kept two ways, both of fixed size, so a
# refresh changes their contents and never recompiles the step:
# - keys int32 [2, H]: (table, id) pairs sorted, padded with (HOT_PAD, HOT_PAD); a pair's
#   place is its row in the replicated hot table (what a refresh reads and writes back);
# - an index for the step: a two-choice bucketed hash of the pairs (cuckoo hashing), built on
#   the host. A lookup reads the two candidate buckets of an id, two gathers, where a binary
#   search over the keys would take log2(H) dependent gathers, each a kernel of its own (on
#   simulated CPU devices the search alone cost more than the exchange it saves). The hash
#   mixes table and id as two 32-bit words, so tables of billions of rows never overflow.
HOT_PAD = 2**31 - 1
HOT_BUCKET = 4  # entries per bucket; an entry is (table, id, hot row)
_SEED_TRIES = 16


def hot_keys(rows_per_table, capacity: int) -> np.ndarray:
    """The hot set as the step reads it: int32 [2, capacity], (table, id) pairs sorted, then
    (HOT_PAD, HOT_PAD). ``rows_per_table``: one array of distinct row ids per table."""
    tables = np.concatenate([np.full(len(r), t, np.int64) for t, r in enumerate(rows_per_table)] or [[]])
    ids = np.concatenate([np.asarray(r, np.int64) for r in rows_per_table] or [[]])
    if tables.size > capacity:
        raise ValueError(f"{tables.size} hot rows do not fit the hot capacity {capacity}")
    order = np.lexsort((ids, tables))
    out = np.full((2, capacity), HOT_PAD, np.int32)
    out[0, : tables.size], out[1, : tables.size] = tables[order], ids[order]
    return out


def hot_rows_per_table(keys: np.ndarray, num_tables: int) -> list[np.ndarray]:
    """The inverse of :func:`hot_keys`: per table, its hot row ids (ascending)."""
    keys = np.asarray(keys)
    return [keys[1, keys[0] == t].astype(np.int64) for t in range(num_tables)]


def hot_index_buckets(capacity: int) -> int:
    """Buckets of the hot index: a power of two with room for twice the capacity (a load of
    at most one half, where two-choice insertion almost never needs to move an entry)."""
    need = max(2, -(-2 * capacity // HOT_BUCKET))
    return 1 << (need - 1).bit_length()


def _bucket(table, ids, seed, buckets: int, xp):
    """The bucket of each (table, id) under one seed (same bits on host and device)."""
    h = mix32(mix32(table.astype(xp.uint32) ^ seed.astype(xp.uint32), xp) ^ ids.astype(xp.uint32), xp)
    return (h & xp.uint32(buckets - 1)).astype(xp.int32)


def hot_index(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The step's index of a hot set: (int32 [buckets, HOT_BUCKET, 3] entries (table, id, row),
    empty ones (HOT_PAD, HOT_PAD, -1); int32 [2] the two seeds). Each pair sits in one of its
    two buckets; deterministic for given keys."""
    keys = np.asarray(keys)
    n = int(np.sum(keys[0] != HOT_PAD))
    buckets = hot_index_buckets(keys.shape[1])
    table, ids = keys[0, :n].astype(np.int64), keys[1, :n].astype(np.int64)
    for attempt in range(_SEED_TRIES):
        seeds = np.array([0x2545F491 + 2 * attempt, 0x9E3779B9 + 2 * attempt], np.uint32)
        choices = np.stack([_bucket(table, ids, s, buckets, np) for s in seeds], axis=1)  # [n, 2]
        entries = _place(choices, buckets)
        if entries is not None:
            index = np.full((buckets, HOT_BUCKET, 3), HOT_PAD, np.int32)
            index[..., 2] = -1
            b, e = np.divmod(entries, HOT_BUCKET)
            index[b, e] = np.stack([table, ids, np.arange(n)], axis=1)
            return index, seeds.view(np.int32)
    raise RuntimeError(f"no hash seeds place {n} hot rows in {buckets} buckets")  # not seen at load 1/2


def _place(choices: np.ndarray, buckets: int) -> np.ndarray | None:
    """Entry (bucket * HOT_BUCKET + place) of each key, or None when cuckoo insertion fails.
    Most keys are placed at once (first choice, then second, in key order); the rest by
    moving entries to their other bucket, a bounded number of times."""
    n = choices.shape[0]
    where = np.full(n, -1, np.int64)
    fill = np.zeros(buckets, np.int64)
    for c in (0, 1):
        left = np.flatnonzero(where < 0)
        b = choices[left, c]
        order = np.argsort(b, kind="stable")
        first = np.searchsorted(b[order], b[order], side="left")
        rank = np.empty(len(left), np.int64)
        rank[order] = np.arange(len(left)) - first + fill[b[order]]
        fits = rank < HOT_BUCKET
        where[left[fits]] = b[fits] * HOT_BUCKET + rank[fits]
        np.add.at(fill, b[fits], 1)
    owner = np.full(buckets * HOT_BUCKET, -1, np.int64)
    owner[where[where >= 0]] = np.flatnonzero(where >= 0)
    rng = np.random.default_rng(0)
    for key in np.flatnonzero(where < 0):
        for _ in range(500):
            for b in choices[key]:
                free = np.flatnonzero(owner[b * HOT_BUCKET : (b + 1) * HOT_BUCKET] < 0)
                if free.size:
                    where[key] = b * HOT_BUCKET + free[0]
                    owner[where[key]] = key
                    break
            if where[key] >= 0:
                break
            slot = int(choices[key, rng.integers(2)]) * HOT_BUCKET + int(rng.integers(HOT_BUCKET))
            evicted = owner[slot]  # moves out; the key takes its place, then it is re-inserted
            owner[slot], where[key], where[evicted] = key, slot, -1
            key = evicted
        else:
            return None
    return where


def split_hot(ids, table, index, seeds):
    """Split looked-up ids into hot rows and cold ids.

    ids: int32 [..., V] table-local ids (PAD_ID allowed); table: int32 [V], the table of each
    virtual slot; index, seeds: :func:`hot_index` of the hot set. Returns hot_row int32
    [..., V] (the row in the hot arrays, -1 when cold or padding) and cold_ids int32 [..., V]
    (ids with the hot ones replaced by PAD_ID).
    """
    t = jnp.broadcast_to(table, ids.shape)
    buckets = index.shape[0]
    found = jnp.full(ids.shape, -1, jnp.int32)
    for seed in (seeds[0], seeds[1]):
        entries = index[_bucket(t, ids, seed, buckets, jnp)]  # [..., V, HOT_BUCKET, 3]
        match = (entries[..., 0] == t[..., None]) & (entries[..., 1] == ids[..., None])
        found = jnp.maximum(found, jnp.max(jnp.where(match, entries[..., 2], -1), axis=-1))
    hot = (ids != PAD_ID) & (found >= 0)
    return jnp.where(hot, found, -1).astype(jnp.int32), jnp.where(hot, PAD_ID, ids).astype(jnp.int32)


# Hot rows of tiered tables. The step never sees such a table's logical ids, only cache ids in
# [0, V) (V: the device view's rows), which change as rows move in and out of the caches. So a
# hot row of a tiered table is split on the host, by the planner that remaps the batch: it
# becomes the step id V + p, p its row in the hot arrays, and the step's hash index holds that
# pair instead of the logical one (:func:`hot_step_keys`); ``split_hot`` then needs no change.
def hot_step_keys(keys: np.ndarray, view_rows: dict[int, int]) -> np.ndarray:
    """The pairs the step's hot index is built from: ``keys`` with each tiered table's id
    (``view_rows``: tiered table -> V) replaced by V + its row in the hot arrays."""
    out = np.array(keys, np.int32, copy=True)
    for t, v in view_rows.items():
        at = np.flatnonzero(out[0] == t)
        out[1, at] = v + at
    return out


def tiered_hot_maps(keys: np.ndarray, view_rows: dict[int, int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per tiered table with hot rows: (its hot ids, ascending; their step ids)."""
    keys, step = np.asarray(keys), hot_step_keys(keys, view_rows)
    return {
        t: (keys[1, at].astype(np.int64), step[1, at]) for t in view_rows if (at := np.flatnonzero(keys[0] == t)).size
    }


def split_hot_host(ids: np.ndarray, hot: tuple[np.ndarray, np.ndarray] | None) -> tuple[np.ndarray, np.ndarray]:
    """One tiered table's ids (any shape, PAD_ID allowed) -> (hot mask, step ids of the hot
    ones; other entries undefined). ``hot``: the table's :func:`tiered_hot_maps` entry."""
    if hot is None or not hot[0].size:
        return np.zeros(ids.shape, bool), np.zeros(ids.shape, np.int32)
    rows, step = hot
    pos = np.minimum(np.searchsorted(rows, ids), rows.size - 1)
    is_hot = (rows[pos] == ids) & (ids != PAD_ID)
    return is_hot, step[pos]
