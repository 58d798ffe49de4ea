"""A table's map from raw 64-bit ids to rows: open addressing, bounded probes, eviction by a
policy, admission after K sightings; pure ``jax.numpy``, one batch at a time inside a step.

Layout. The table's rows are split into ``vshards`` virtual shards of ``slots`` rows each; an
id's shard and its home slot come from a hash of the id alone. Slot 0 of every shard is its
*shared row*: ids not (yet) given a row of their own look up and train it. An id lives in one
of the ``probes`` slots after its home (wrapping within its shard, slot 0 skipped). Everything
a batch does to one shard depends on that shard's slots and the batch's ids of that shard, so
devices that own whole shards (a row-wise table of ``vshards`` divisible by the devices) reach
exactly what one device holding every shard reaches: the map is the same on any device count.

One batch (:func:`resolve`), per shard:
1. the batch's distinct ids, each with its occurrences; ids found in their probes keep their row;
2. admission (``admit`` > 1): a count-min sketch per shard counts each absent id's
   occurrences; an id is admitted once its estimate reaches ``admit`` (counts are kept after
   admission, so an evicted id that returns is admitted at once). With ``half_life``, every
   counter halves at each step that is a multiple of it (the sketch forgets, as TinyLFU's does);
3. placement in ``probes`` rounds: each admitted absent id asks for the best slot among its
   probes not taken this batch (a free slot first, in probe order; else the policy's victim),
   and where several ask for one slot the first id in (hash, low word) order gets it;
   the others ask again next round. Under ``lfu`` an id takes a held slot only when its own
   count (its sketch estimate, or without admission its occurrences in the batch) exceeds the
   victim's decayed count, so rare new ids do not push out frequent old ones (TinyLFU's
   rule). An id that gets no slot uses its shard's shared row;
4. the rows given to new ids are *fresh*: their values and optimizer state must be reset
   before the batch looks them up (the caller does it: ``Resolved.fresh``).

Policies, on integers only (so a plain Python model reaches the same bits):
``lru``: the victim is the slot seen least recently; ``lfu``: the slot with the smallest
count, each count halving every ``half_life`` steps since its id was last seen (0: never),
ties to the least recently seen. Further ties go to the earlier probe. A new id's count starts
at its count above.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dlrm_jax.choices import EvictionPolicy
from dlrm_jax.hashing import mix32

POLICIES = tuple(EvictionPolicy)  # lru, lfu
_SHARD_SEED, _HOME_SEED = 0x3C6EF372, 0xA54FF53A
_SKETCH_SEEDS = (0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19, 0x6A09E667, 0xBB67AE85, 0x428A2F98, 0x71374491)
_FREE = np.iinfo(np.int32).min  # a free slot's key: below any seen slot's
_TAKEN = np.iinfo(np.int32).max  # a slot already given out this batch


class MapSpec(NamedTuple):
    """The map of one table. ``rows``: the table's rows, ``vshards`` * slots; ``probes``: slots
    an id may live in (at most slots - 1); ``policy``: ``lru`` or ``lfu``; ``half_life``: lfu's
    steps per halving (0: no decay); ``admit``: sightings before an id gets a row (0 or 1: at
    once); ``sketch_depth`` x ``sketch_width``: the count-min sketch per shard."""

    rows: int
    vshards: int
    probes: int = 8
    policy: str = "lru"
    half_life: int = 0
    admit: int = 0
    sketch_depth: int = 4
    sketch_width: int = 1024

    @classmethod
    def sized(cls, values: int, rows: float = 0, vshards: int = 0, **fields) -> MapSpec:
        """The map of a table for a feature of ``values`` values: ``rows`` rows (>= 1), a
        fraction of ``values`` (< 1) or one per value (0), rounded up to whole shards;
        ``vshards`` (0: up to 256 shards, at least 4 x (probes + 1) rows each). ``fields``:
        the rest of MapSpec's fields."""
        want = values if not rows else (int(rows) if rows >= 1 else math.ceil(rows * values))
        probes = fields.get("probes", cls._field_defaults["probes"])
        if not vshards:
            vshards = 256
            while vshards > 1 and want // vshards < 4 * (probes + 1):
                vshards //= 2
        slots = max(-(-want // vshards), probes + 1)
        return cls(vshards * slots, vshards, **fields).check()

    @property
    def slots(self) -> int:
        return self.rows // self.vshards

    def check(self) -> MapSpec:
        if self.rows % self.vshards or self.slots < 2:
            raise ValueError(f"{self.rows} rows do not split into {self.vshards} shards of at least 2 slots")
        if not 1 <= self.probes <= self.slots - 1:
            raise ValueError(
                f"probes={self.probes}: between 1 and the {self.slots - 1} slots of a shard past its shared row"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r}: one of {', '.join(POLICIES)}")
        if self.admit > 1 and not 1 <= self.sketch_depth <= len(_SKETCH_SEEDS):
            raise ValueError(f"sketch_depth={self.sketch_depth}: between 1 and {len(_SKETCH_SEEDS)}")
        return self

    @property
    def counts(self) -> bool:
        """Whether admission counts sightings (a sketch is kept)."""
        return self.admit > 1

    def bytes_per_row(self) -> int:
        """The map's bytes per table row (key, last seen, count; the sketch apart)."""
        return 4 * 4 + 1

    def sketch_bytes(self) -> int:
        return 4 * self.vshards * self.sketch_depth * self.sketch_width if self.counts else 0


class IdMap(NamedTuple):
    """The map's arrays for the rows of some whole shards (one device's, or all): per row the
    id it holds (``key_hi``/``key_lo``, uint32), whether it holds one (``used``), the step its id
    was last seen and its count (int32); per shard the sketch, int32 [shards, depth, width]
    (1 x 1 and unused without admission)."""

    key_hi: jax.Array
    key_lo: jax.Array
    used: jax.Array
    last_seen: jax.Array
    count: jax.Array
    sketch: jax.Array


class Resolved(NamedTuple):
    """One batch through the map: ``rows`` int32 [N], each id's row among the map's rows (-1:
    padding or an id of another device's shards); ``map``: the map after the batch; ``fresh``:
    bool [rows], the rows given to a new id in this batch (reset their values and state);
    ``stats``: int32 counts (see :data:`STATS`)."""

    rows: jax.Array
    map: IdMap
    fresh: jax.Array
    stats: dict


# lookups: ids looked up (padding apart); found: of them, those whose id held a row;
# admitted: new ids given a row; evicted: of those, rows that held another id;
# held_back: distinct new ids not admitted yet; unplaced: admitted but no slot won (shared row).
STATS = ("lookups", "found", "admitted", "evicted", "held_back", "unplaced")


def init_map(spec: MapSpec, shards: int | None = None) -> IdMap:
    """An empty map of ``shards`` whole shards (default all)."""
    shards = spec.vshards if shards is None else shards
    n = shards * spec.slots
    depth, width = (
        (spec.sketch_depth, spec.sketch_width) if spec.counts else (1, 1)
    )  # (never read; no empty arrays in checkpoints)
    return IdMap(
        jnp.zeros(n, jnp.uint32),
        jnp.zeros(n, jnp.uint32),
        jnp.zeros(n, bool),
        jnp.zeros(n, jnp.int32),
        jnp.zeros(n, jnp.int32),
        jnp.zeros((shards, depth, width), jnp.int32),
    )


def id_hash(hi, lo, xp=jnp):
    """uint32 hash of 64-bit ids given as their high and low halves (numpy or traced)."""
    return mix32(lo ^ mix32(hi ^ xp.uint32(_SHARD_SEED), xp), xp)


def shard_of(spec: MapSpec, hi, lo, xp=jnp):
    """Each id's shard (all the map's numbering): where its row lives, and so its owner."""
    return (id_hash(hi, lo, xp) % xp.uint32(spec.vshards)).astype(xp.int32)


def split_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int64/uint64 ids -> (high, low) uint32 halves, as :func:`resolve` takes them."""
    u = np.asarray(ids).astype(np.uint64)
    return (u >> np.uint64(32)).astype(np.uint32), (u & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def home_rows(spec: MapSpec, ids: np.ndarray) -> np.ndarray:
    """Each raw id's home row (int32, numpy): the row the map gives it when nothing else asks
    for its probes. What planning measures a dynamic table's traffic by, before any map
    exists (the first batches' ids, as the owners will see them)."""
    hi, lo = split_ids(ids)
    h = id_hash(hi, lo, np)
    shard = (h % np.uint32(spec.vshards)).astype(np.int64)
    home = (mix32(h ^ np.uint32(_HOME_SEED), np) % np.uint32(spec.slots - 1)).astype(np.int64)
    return (shard * spec.slots + 1 + home).astype(np.int32)


def _decayed(spec: MapSpec, count, last_seen, step):
    if spec.policy != "lfu" or not spec.half_life:
        return count
    shift = jnp.minimum((step - last_seen) // spec.half_life, 31)
    return count >> shift


def _distinct(hi, lo, valid):
    """The batch's distinct valid ids in (hash, low word) order, padded to N: (each id's index
    among them, N for padding; their high and low words; occurrences; whether each distinct
    slot is real). The hash and the low word determine an id (``id_hash`` mixes the high word
    through a bijection), so the order is a total order of ids.

    Fast path: one sort of the 32-bit hashes alone (XLA sorts a lone array ~8x faster than
    keys with a payload on CPU) and each id's run found by binary search. Two distinct ids (or
    an id and padding) with one hash would share a run: when the batch has such a pair, the
    exact path sorts by (hash, low word) instead, with the same result."""
    n = hi.shape[0]
    h = id_hash(hi, lo)
    key = jnp.where(valid, h, jnp.uint32(0xFFFFFFFF))  # padding last
    sorted_key = jnp.sort(key)
    start = jnp.searchsorted(sorted_key, key, side="left").astype(jnp.int32)  # its run's first place
    rep = jnp.full(n, n, jnp.int32).at[start].min(jnp.arange(n, dtype=jnp.int32))[start]
    shared = (hi != hi[rep]) | (lo != lo[rep]) | (valid != valid[rep])

    def by_hash():
        new = jnp.concatenate([jnp.ones(1, bool), sorted_key[1:] != sorted_key[:-1]])
        place = jnp.cumsum(new, dtype=jnp.int32) - 1  # of each sorted position's run
        return jnp.where(valid, place[start], n)

    def by_hash_and_low_word():
        order = jnp.lexsort((lo, h, ~valid))
        sh, slo, sval = h[order], lo[order], valid[order]
        new = jnp.concatenate([jnp.ones(1, bool), (sh[1:] != sh[:-1]) | (slo[1:] != slo[:-1])])
        place = jnp.where(sval, jnp.cumsum(new, dtype=jnp.int32) - 1, n)
        return jnp.zeros(n, jnp.int32).at[order].set(place)

    index = lax.cond(jnp.any(shared), by_hash_and_low_word, by_hash)
    uhi = jnp.zeros(n, jnp.uint32).at[index].set(hi, mode="drop")
    ulo = jnp.zeros(n, jnp.uint32).at[index].set(lo, mode="drop")
    occurrences = jnp.zeros(n, jnp.int32).at[index].add(1, mode="drop")
    return index, uhi, ulo, occurrences, jnp.arange(n) < jnp.max(jnp.where(valid, index + 1, 0))


def resolve(spec: MapSpec, m: IdMap, hi, lo, valid, step, first_shard=0, learn: bool = True) -> Resolved:
    """The batch of ids ``hi``/``lo`` (uint32 [N]; ``valid``: bool [N], False for padding)
    through the map ``m`` of the shards ``first_shard`` onward at train step ``step``. Ids of
    other shards are left alone (row -1). ``learn=False`` (evaluation, serving): the map is
    read, not changed: an id without a row uses its shard's shared row. Traceable;
    ``first_shard`` may be traced."""
    n, slots, shards = hi.shape[0], spec.slots, m.used.shape[0] // spec.slots
    index, uhi, ulo, occurrences, real = _distinct(hi, lo, valid)
    h = id_hash(uhi, ulo)
    local = (h % jnp.uint32(spec.vshards)).astype(jnp.int32) - first_shard
    real = real & (local >= 0) & (local < shards)
    local = jnp.clip(local, 0, shards - 1)
    home = (mix32(h ^ jnp.uint32(_HOME_SEED), jnp) % jnp.uint32(slots - 1)).astype(jnp.int32)
    probe = local[:, None] * slots + 1 + (home[:, None] + jnp.arange(spec.probes)) % (slots - 1)  # [U, P]
    used, last_seen = m.used[probe], m.last_seen[probe]  # the probed slots only: work per id, not per row
    match = used & (m.key_hi[probe] == uhi[:, None]) & (m.key_lo[probe] == ulo[:, None])
    found = real & jnp.any(match, axis=1)
    found_at = jnp.argmax(match, axis=1)[:, None]
    found_row = jnp.take_along_axis(probe, found_at, axis=1)[:, 0]
    decayed = _decayed(spec, m.count[probe], last_seen, step)

    sketch, admitted, estimate = m.sketch, real if learn else found, occurrences
    if spec.counts and learn:
        if spec.half_life:  # the sketch forgets: every counter halves each half_life steps
            age = (step > 0) & (step % spec.half_life == 0)
            sketch = jnp.where(age, sketch >> 1, sketch)
        absent = real & ~found
        cols = jnp.stack(
            [mix32(h ^ jnp.uint32(s), jnp) % jnp.uint32(spec.sketch_width) for s in _SKETCH_SEEDS[: spec.sketch_depth]],
            1,
        )
        cols = cols.astype(jnp.int32)  # [U, depth]
        depth = jnp.arange(spec.sketch_depth)[None, :]
        shard_at = jnp.where(absent, local, shards)[:, None]  # found ids are not counted
        sketch = sketch.at[shard_at, depth, cols].add(occurrences[:, None], mode="drop")
        estimate = jnp.min(sketch[local[:, None], depth, cols], axis=1)
        admitted = real & (found | (estimate >= spec.admit))

    # Placement: free slots first, then the policy's victims; the first id in (hash, low word) order wins a contested slot.
    rows_n = m.used.shape[0]
    primary = jnp.where(used, last_seen if spec.policy == "lru" else decayed, _FREE)
    # lfu: a held slot is open to an id only when the id's count exceeds the slot's
    open_ = ~used | (estimate[:, None] > decayed) if spec.policy == "lfu" else jnp.ones_like(used)
    secondary = jnp.where(used, last_seen, _FREE) if spec.policy == "lfu" else jnp.zeros_like(primary)
    taken = jnp.zeros(rows_n, bool).at[jnp.where(found, found_row, rows_n)].set(True, mode="drop")
    pending = admitted & ~found
    placed = jnp.full(n, -1, jnp.int32)
    rank = jnp.arange(n, dtype=jnp.int32)  # the distinct ids' order: (hash, low word)

    def round_(carry):
        r, _, taken, placed, pending = carry
        k1 = jnp.where(taken[probe] | ~open_, _TAKEN, primary)
        best1 = jnp.min(k1, axis=1, keepdims=True)
        k2 = jnp.where(k1 == best1, secondary, _TAKEN)
        best2 = jnp.min(k2, axis=1, keepdims=True)
        pick = jnp.argmax((k1 == best1) & (k2 == best2), axis=1)
        asks = pending & (best1[:, 0] < _TAKEN)
        target = jnp.take_along_axis(probe, pick[:, None], axis=1)[:, 0]
        winner = jnp.full(rows_n, n, jnp.int32).at[jnp.where(asks, target, rows_n)].min(rank, mode="drop")
        wins = asks & (winner[target] == rank)
        placed = jnp.where(wins, target, placed)
        taken = taken.at[jnp.where(wins, target, rows_n)].set(True, mode="drop")
        return r + 1, jnp.any(asks), taken, placed, pending & ~wins

    # At most ``probes`` rounds; a round in which no id asks changes nothing, and neither would
    # any after it, so the loop ends there (most batches settle in one or two rounds).
    # (the flag and the rows derived from the batch: inside shard_map they vary by device like it)
    carry = (0, jnp.any(pending) | True, taken, jnp.where(pending, placed, placed), pending)
    _, _, taken, placed, pending = lax.while_loop(lambda c: (c[0] < spec.probes) & c[1], round_, carry)
    won = placed >= 0
    at = jnp.where(won, placed, rows_n)
    fresh = jnp.zeros(rows_n, bool).at[at].set(True, mode="drop")
    evicted = jnp.sum(won & m.used[jnp.clip(placed, 0)])

    seen_at = jnp.where(found, found_row, at)
    now = jnp.asarray(step, jnp.int32)
    kept = jnp.where(found, jnp.take_along_axis(decayed, found_at, axis=1)[:, 0], 0)
    new_map = IdMap(
        m.key_hi.at[at].set(uhi, mode="drop"),
        m.key_lo.at[at].set(ulo, mode="drop"),
        m.used.at[at].set(True, mode="drop"),
        m.last_seen.at[seen_at].set(now, mode="drop"),
        m.count.at[seen_at].set(jnp.where(found, kept + occurrences, estimate), mode="drop"),
        sketch,
    )
    if not learn:
        new_map = m
    shared = local * slots
    distinct_row = jnp.where(found, found_row, jnp.where(won, placed, jnp.where(real, shared, -1)))
    rows = jnp.where(index < n, distinct_row[jnp.clip(index, 0, n - 1)], -1)
    stats = {
        "lookups": jnp.sum(jnp.where(real, occurrences, 0)),
        "found": jnp.sum(jnp.where(found, occurrences, 0)),
        "admitted": jnp.sum(won),
        "evicted": evicted,
        "held_back": jnp.sum(real & ~admitted),
        "unplaced": jnp.sum(pending),
    }
    return Resolved(rows, new_map, fresh, stats)
