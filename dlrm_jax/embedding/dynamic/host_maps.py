"""Id maps held on the host: the maps of dynamic tables whose rows live in the disk tier.

A tiered table's step sees cache slots, not rows, and the planner thread must know each
batch's rows ``lookahead`` batches before its step to fill the device caches. So a tiered
dynamic table's map is resolved on the host, batch by batch in the planner thread, by the same
program as on the devices (:func:`~dlrm_jax.embedding.dynamic.resolve.resolve_fused`, every
shard at once, compiled for the host's CPU), so its rows are the rows the devices' map would
give, bit for bit (the map on n devices is the one-device map cut in blocks).

Resolving ahead puts the map ahead of the train state. Each batch keeps what it overwrote
(the map rows and sketch counters it wrote, or the whole sketch on a step where the sketches
age), so the maps as of any step of the window (checkpoints, evaluation) are the current
maps with the newer batches undone: O(ids) kept a batch, O(map) only when asked.
"""

from __future__ import annotations

import collections
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dlrm_jax.embedding.dynamic.idmap import IdMap, MapSpec, init_map, on_platform
from dlrm_jax.embedding.dynamic.map_writes import write_map
from dlrm_jax.embedding.dynamic.resolve import Maps, resolve_fused
from dlrm_jax.embedding.dynamic.sharded import fuse_maps, split_maps


class HostResolved(NamedTuple):
    """One batch of ids through the host maps (numpy): ``rows`` int32 [N], each id's row of its
    table (-1: padding); the rows given to new ids: ``fresh_rows`` int32 [F], with their
    ``fresh_table`` (index into the maps' tables) and ids (``fresh_hi``/``fresh_lo``);
    ``stats`` int64 [tables, len(STATS)]."""

    rows: np.ndarray
    fresh_rows: np.ndarray
    fresh_table: np.ndarray
    fresh_hi: np.ndarray
    fresh_lo: np.ndarray
    stats: np.ndarray


class _Undo(NamedTuple):
    """What batch ``batch`` overwrote: the map rows ``rows`` (their old fields), the sketch
    counters ``counters`` (their old values), or the whole old ``sketch`` (a step that ages it)."""

    batch: int
    rows: np.ndarray
    old: tuple
    counters: np.ndarray
    old_counters: np.ndarray
    sketch: np.ndarray | None


def _learn(layout: Maps, m: IdMap, table, hi, lo, valid, step):
    """One batch through the maps ``m``, read and not written: (the resolution, whose
    ``writes`` :func:`_write` makes; the sketch after it; the map rows and the sketch counters
    it overwrites, as they are). Its own program: a program that reads a map's rows and then
    writes that map in place has XLA copy the map whole, twice (read after, the rows cost two
    copies of every map array a batch: 1.15 GB at 33.8M rows, most of a batch's time)."""
    out = resolve_fused(
        layout, m, table, hi, lo, valid, step, jnp.zeros(len(layout.specs), jnp.int32), True, write=False, counters=True
    )
    at = jnp.clip(out.touched, 0, m.used.shape[0] - 1)
    old = tuple(f[at] for f in m[:5])
    old_counters = m.sketch[jnp.clip(out.sketch_touched, 0, m.sketch.shape[0] - 1)]
    return out._replace(map=None), out.map.sketch, old, old_counters


def _write(m: IdMap, sketch, writes, step) -> IdMap:
    """The maps ``m`` with a batch's ``writes`` and its ``sketch`` (:func:`_learn`'s), in place."""
    return write_map(m._replace(sketch=sketch), writes, step)


def _read(layout: Maps, m: IdMap, table, hi, lo, valid, step):
    return resolve_fused(layout, m, table, hi, lo, valid, step, jnp.zeros(len(layout.specs), jnp.int32), False).rows


def host_device() -> jax.Device:
    """The host's CPU as a JAX device; where the CPU backend is left out (``JAX_PLATFORMS=cuda``),
    the first device (the same results, on the accelerator)."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return jax.devices()[0]


class HostMaps:
    """The maps of ``specs`` ({table index: MapSpec}, in table order) on the host's CPU, every
    shard: :meth:`learn` each batch in order, :meth:`maps_at` any step not yet forgotten."""

    def __init__(self, specs: dict[int, MapSpec]):
        self.tables = list(specs)
        self._cpu = host_device()
        self.specs = on_platform([specs[t] for t in self.tables], self._cpu.platform)
        self.layout = Maps(tuple(self.specs), tuple(s.vshards for s in self.specs))
        self.rows = sum(s.rows for s in self.specs)
        self._learn = jax.jit(lambda m, *a: _learn(self.layout, m, *a))
        self._write = jax.jit(_write, donate_argnums=0)
        self._read = jax.jit(lambda m, *a: _read(self.layout, m, *a))
        self._lock = threading.Lock()
        self.load({}, 0)

    # ------------------------------------------------------------ state
    def load(self, maps: dict[int, IdMap], batches: int) -> None:
        """Start from ``maps`` ({table index: its whole map, numpy}; missing: empty) as of
        ``batches`` batches resolved."""
        with jax.default_device(self._cpu):  # (an empty map made on the host, not an accelerator)
            whole = [maps.get(t) or jax.device_get(init_map(s)) for t, s in zip(self.tables, self.specs, strict=True)]
        with self._lock:
            self._map = self._fused(whole)
            self._journal: collections.deque[_Undo] = collections.deque()
            self._batches = batches
            self._cached = None  # (step, maps) that :meth:`read` resolved against

    def maps_at(self, step: int) -> dict[int, IdMap]:
        """{table index: its whole map (numpy)} as of ``step`` batches resolved: the maps now,
        the batches since undone (newest first)."""
        with self._lock:
            if step > self._batches or (self._journal and step < self._journal[0].batch):
                raise ValueError(f"the host maps hold steps {self._oldest()}-{self._batches}, not {step}")
            fields = [np.array(x) for x in jax.device_get(self._map)]
            for u in reversed(self._journal):
                if u.batch < step:
                    break
                if u.sketch is not None:
                    fields[5] = u.sketch.copy()
                added = u.counters < fields[5].size
                fields[5][u.counters[added]] = u.old_counters[added]
                keep = u.rows < fields[0].size
                for f, old in zip(fields[:5], u.old, strict=True):
                    f[u.rows[keep]] = old[keep]
        tables = split_maps(self.specs, 1, IdMap(*fields))
        return dict(zip(self.tables, tables, strict=True))

    def rewind(self, step: int) -> None:
        """Back to the maps as of ``step`` (a run's batches start there), if ahead of it."""
        if step != self._batches:
            self.load(self.maps_at(step), step)

    def _oldest(self) -> int:
        return self._journal[0].batch if self._journal else self._batches

    def forget_before(self, step: int) -> None:
        """Nothing before ``step`` will be asked for again (the train state is there)."""
        with self._lock:
            while self._journal and self._journal[0].batch < step:
                self._journal.popleft()

    def used(self) -> int:
        """Rows holding an id now (the newest batch resolved)."""
        with self._lock:
            return int(jnp.sum(self._map.used, dtype=jnp.int32))

    # ------------------------------------------------------------ batches
    def learn(self, batch: int, table, hi, lo, valid) -> HostResolved:
        """Batch number ``batch`` (the next one: batches go in order) of ids ``hi``/``lo`` of
        the tables ``table`` (int32 [N], indices into the maps' tables; ``valid``: False for
        padding) through the maps, which keep what it overwrote."""
        args = self._ids(table, hi, lo, valid)
        with self._lock:
            if batch != self._batches:
                raise ValueError(f"the host maps resolve batch {self._batches} next, not {batch}")
            sketch = np.array(jax.device_get(self._map.sketch)) if self._ages(batch) else None
            out, new_sketch, old, old_counters = self._learn(self._map, *args, np.int32(batch))
            self._map = self._write(self._map, new_sketch, out.writes, np.int32(batch))
            out, old, old_counters = jax.device_get((out._replace(writes=None), old, old_counters))
            self._journal.append(_Undo(batch, out.touched, old, out.sketch_touched, old_counters, sketch))
            self._batches += 1
        given = out.fresh_rows >= 0
        return HostResolved(
            out.rows,
            out.fresh_rows[given],
            out.fresh_table[given],
            out.fresh_hi[given],
            out.fresh_lo[given],
            out.stats.astype(np.int64),
        )

    def read(self, step: int, table, hi, lo, valid) -> np.ndarray:
        """Rows of ids through the maps as of ``step``, not changing them (evaluation: an id
        without a row reads its shard's shared row)."""
        if self._cached is None or self._cached[0] != step:
            maps = self.maps_at(step)
            self._cached = (step, self._fused([maps[t] for t in self.tables]))
        return np.asarray(self._read(self._cached[1], *self._ids(table, hi, lo, valid), np.int32(step)))

    def _fused(self, whole: list[IdMap]) -> IdMap:
        """Each table's whole map (numpy) as the one the program takes, on the host device."""
        return jax.device_put(fuse_maps(self.specs, 1, whole, xp=np), self._cpu)

    def _ids(self, table, hi, lo, valid) -> tuple:
        return jax.device_put(
            (np.asarray(table, np.int32), np.asarray(hi, np.uint32), np.asarray(lo, np.uint32), np.asarray(valid)),
            self._cpu,
        )

    def _ages(self, step: int) -> bool:
        """Whether some table's sketch halves at ``step`` (resolve's ``_count``)."""
        return any(s.counts and s.half_life and step > 0 and step % s.half_life == 0 for s in self.specs)
