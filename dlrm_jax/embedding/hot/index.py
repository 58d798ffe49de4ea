"""The hot-row index: which (table, id) pairs are hot, and where each sits in the replicated hot
arrays, kept in fixed-size forms so a refresh never recompiles the step. Built on the host
(numpy) and read inside the step (``split_hot``, jnp) with the same hash, bit for bit; the
hot rows of tiered tables are split on the host instead (``hot_step_keys`` and below).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dlrm_jax.hashing import mix32
from dlrm_jax.ids import PAD_ID

# A hot id is answered by the replica every device
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
