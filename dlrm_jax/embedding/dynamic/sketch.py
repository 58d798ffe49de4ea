"""The count-min sketches of a resolution (``resolve``): the batch's absent ids counted on their
owners' shards, every id's estimate (admission compares it with ``admit``), and the counters
halving where a table's half life ends (TinyLFU's reset)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from dlrm_jax.chunks import by_chunks, by_platform, padded_chunks
from dlrm_jax.embedding.dynamic.idmap import _SKETCH_SEEDS, Maps
from dlrm_jax.hashing import mix32

_TAKEN = np.iinfo(np.int32).max  # an estimate above any count: a counter the table does not have


def count_absent(maps: Maps, sketch, utab, h, local, absent, occurrences, step, chunk: int, age=True):
    """The sketches after the batch's absent ids are counted (and aged, with ``age``, where a
    table's half life ends at ``step``), every id's estimate, and the counters added to (flat;
    the sketch's size: none); the ids' counters ``chunk`` ids at a time (:func:`by_chunks`)."""
    specs = maps.specs
    per_table = lambda values: jnp.asarray(np.asarray(values), jnp.int32)
    dims = maps.sketch_dims
    sizes = [n * d * w for n, (d, w) in zip(maps.shards, dims, strict=True)]
    half = np.array([s.half_life if s.counts else 0 for s in specs])
    if half.any():  # every counter of a table halves at each multiple of its half life
        hl = per_table(np.maximum(half, 1))
        age = (per_table(half) > 0) & (step > 0) & (step % hl == 0) & age
        if len({s.half_life for s in specs if s.counts}) == 1:  # (a run's tables share one)
            # one shift for all: the counters of tables that do not count are never added to
            halve = lambda sk: sk >> jnp.max(age.astype(jnp.int32))
        else:  # each counter its table's: the table found by comparing with their starts, not
            # by ``jnp.repeat`` (a prefix sum over the sketches: 5 kernels a step on GPUs)
            starts = maps.sketch_starts.astype(np.int32)
            table_of = jnp.searchsorted(starts, lax.iota(jnp.int32, sum(sizes)), side="right", method="compare_all")
            halve = lambda sk: sk >> age.astype(jnp.int32)[table_of - 1]
        # a pass over the sketches only when one ages (on GPUs every step: a shift by 0 where none does)
        sketch = by_platform(
            lambda: lax.cond(jnp.any(age), halve, lambda sk: sk, sketch), lambda: halve(sketch), maps.control_flow
        )
    depth_n = max(d for d, _ in dims)
    size = sketch.shape[0]

    def counters(utab, h, local):  # [U, depth]: each id's counters, and which of them its table has
        depth, width = per_table([d for d, _ in dims])[utab], per_table([w for _, w in dims])[utab]
        d = jnp.arange(depth_n)
        cols = jnp.stack([mix32(h ^ jnp.uint32(s), jnp) for s in _SKETCH_SEEDS[:depth_n]], 1)
        cols = (cols % width.astype(jnp.uint32)[:, None]).astype(jnp.int32)
        at = (
            per_table(maps.sketch_starts)[utab][:, None] + (local[:, None] * depth[:, None] + d) * width[:, None] + cols
        )
        return at, d[None, :] < depth[:, None]

    def add(sketch, utab, h, local, absent, occurrences):
        at, rows_d = counters(utab, h, local)
        added = jnp.where(absent[:, None] & rows_d, at, size)
        return sketch.at[added].add(occurrences[:, None], mode="drop"), added

    def estimate(utab, h, local):
        at, rows_d = counters(utab, h, local)
        return jnp.min(jnp.where(rows_d, sketch[jnp.clip(at, 0, size - 1)], _TAKEN), axis=1)

    ids = (utab, h, local, absent, occurrences)
    if chunk == utab.shape[0]:
        sketch, added = add(sketch, *ids)
    else:  # a chunk at a time (the sums are the same in any order; padding is not absent)
        sketch, added = lax.scan(lambda sk, a: add(sk, *a), sketch, [padded_chunks(chunk, x) for x in ids])
        added = added.reshape(-1, depth_n)[: utab.shape[0]]
    return sketch, by_chunks(chunk, estimate, *ids[:3]), added.reshape(-1)
