"""A table's map from raw 64-bit ids to rows: open addressing, bounded probes, eviction by a
policy, admission after K sightings: its spec, its arrays and its hashes.

Layout. The table's rows are split into ``vshards`` virtual shards of ``slots`` rows each; an
id's shard and its home slot come from a hash of the id alone. Slot 0 of every shard is its
*shared row*: ids not (yet) given a row of their own look up and train it. An id lives in one
of the ``probes`` slots after its home (wrapping within its shard, slot 0 skipped). Everything
a batch does to one shard depends on that shard's slots and the batch's ids of that shard, so
devices that own whole shards (a row-wise table of ``vshards`` divisible by the devices) reach
exactly what one device holding every shard reaches: the map is the same on any device count.

One batch through the map, and the policies: ``resolve.py``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dlrm_jax.choices import ControlFlow, EvictionPolicy
from dlrm_jax.chunks import form_for_platform
from dlrm_jax.hashing import mix32

POLICIES = tuple(EvictionPolicy)  # lru, lfu
_SHARD_SEED, _HOME_SEED = 0x3C6EF372, 0xA54FF53A
_SKETCH_SEEDS = (0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19, 0x6A09E667, 0xBB67AE85, 0x428A2F98, 0x71374491)


# The fewest shards ``vshards=0`` chooses, whatever the table's size: a device holds whole
# shards, so a map of fewer could not split over a host's 8 GPUs (or 8 simulated CPU devices)
# and the default would stop a run on its smallest table. It depends on no device count, so a
# checkpoint keeps its tables' rows on any mesh; a small table pays 8 x (probes + 1) rows.
AUTO_MIN_SHARDS = 8


class MapSpec(NamedTuple):
    """The map of one table. ``rows``: the table's rows, ``vshards`` * slots; ``probes``: slots
    an id may live in (at most slots - 1); ``policy``: ``lru`` or ``lfu``; ``half_life``: lfu's
    steps per halving (0: no decay); ``admit``: sightings before an id gets a row (0 or 1: at
    once); ``sketch_depth`` x ``sketch_width``: the count-min sketch per shard;
    ``control_flow``: how a step takes work whose size its batch decides
    (``embedding.dynamic.control_flow``; the same results every way)."""

    rows: int
    vshards: int
    probes: int = 8
    policy: str = "lru"
    half_life: int = 0
    admit: int = 0
    sketch_depth: int = 4
    sketch_width: int = 1024
    control_flow: str = ControlFlow.AUTO

    @classmethod
    def sized(cls, values: int, rows: float = 0, vshards: int = 0, **fields) -> MapSpec:
        """The map of a table for a feature of ``values`` values: ``rows`` rows (>= 1), a
        fraction of ``values`` (< 1) or one per value (0), rounded up to whole shards;
        ``vshards`` (0: up to 256 shards, at least 4 x (probes + 1) rows each, and never fewer
        than :data:`AUTO_MIN_SHARDS`). ``fields``: the rest of MapSpec's fields."""
        want = values if not rows else (int(rows) if rows >= 1 else math.ceil(rows * values))
        probes = fields.get("probes", cls._field_defaults["probes"])
        if not vshards:
            vshards = 256
            while vshards > AUTO_MIN_SHARDS and want // vshards < 4 * (probes + 1):
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
        if self.control_flow not in tuple(ControlFlow):
            raise ValueError(f"control_flow={self.control_flow!r}: one of {', '.join(ControlFlow)}")
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


def control_flow_of(specs) -> str:
    """The form a run's dynamic step takes (``embedding.dynamic.control_flow``): every map of
    a run has the same, its first's; ``auto`` with none."""
    return next((s.control_flow for s in specs), ControlFlow.AUTO)


def on_platform(specs, platform: str) -> list[MapSpec]:
    """``specs`` for a program compiled for ``platform``: each one's form made that platform's
    (:func:`~dlrm_jax.chunks.form_for_platform`), so only its form is traced."""
    return [s._replace(control_flow=form_for_platform(s.control_flow, platform)) for s in specs]


class Maps(NamedTuple):
    """Several tables' maps held as one: table t's ``shards[t]`` shards (this device's, or all)
    at rows ``row_starts[t]`` onward of one IdMap, its sketch flattened at ``sketch_starts[t]``."""

    specs: tuple[MapSpec, ...]
    shards: tuple[int, ...]

    @property
    def control_flow(self) -> str:
        """How a step takes its data-dependent work (:func:`control_flow_of` its maps)."""
        return control_flow_of(self.specs)

    def _sizes(self, per_shard) -> np.ndarray:
        return np.array([n * per_shard(s) for s, n in zip(self.specs, self.shards, strict=True)], np.int64)

    @property
    def row_sizes(self) -> np.ndarray:
        return self._sizes(lambda s: s.slots)

    @property
    def row_starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.row_sizes)[:-1]]).astype(np.int64)

    @property
    def shard_starts(self) -> np.ndarray:
        """Each table's first shard among the shards held, numbered end to end."""
        return np.concatenate([[0], np.cumsum(self.shards)[:-1]]).astype(np.int64)

    @property
    def sketch_dims(self) -> list[tuple[int, int]]:
        return [(s.sketch_depth, s.sketch_width) if s.counts else (1, 1) for s in self.specs]

    @property
    def sketch_starts(self) -> np.ndarray:
        sizes = [n * d * w for n, (d, w) in zip(self.shards, self.sketch_dims, strict=True)]
        return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


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


def shared_row_of(rows, slots):
    """The shared row (slot 0) of the shard holding each of ``rows`` (rows of whole shards of
    ``slots`` rows each, counted from a shard's start: a table's, or one device's block)."""
    return rows // slots * slots


def home_rows(spec: MapSpec, ids: np.ndarray) -> np.ndarray:
    """Each raw id's home row (int32, numpy): the row the map gives it when nothing else asks
    for its probes. What planning measures a dynamic table's traffic by, before any map
    exists (the first batches' ids, as the owners will see them)."""
    hi, lo = split_ids(ids)
    h = id_hash(hi, lo, np)
    shard = (h % np.uint32(spec.vshards)).astype(np.int64)
    home = (mix32(h ^ np.uint32(_HOME_SEED), np) % np.uint32(spec.slots - 1)).astype(np.int64)
    return (shard * spec.slots + 1 + home).astype(np.int32)
