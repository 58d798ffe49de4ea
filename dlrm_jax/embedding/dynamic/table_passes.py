"""A large batch of ids resolved a few tables at a time, so its scratch is bounded.

A resolution's work per id (its dedup, probes, counts and placement) needs arrays as long as
the ids it resolves at once. Tables do not meet in a resolution: an id's probes, sketch
counters and contests for a slot are all its own table's (``resolve``'s layout), and so are
its counts. So a batch resolved table group by table group, each group's ids in a pass of its
own, reaches the map, rows and counts that one pass over all of them does, exactly, while its
arrays hold one group's ids. The groups are fixed at trace time: an id's table is known from
its place in the batch (its column: :func:`table_passes`), so no pass can overflow whatever
the ids are.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from dlrm_jax.embedding.dynamic.idmap import STATS, IdMap
from dlrm_jax.embedding.dynamic.map_writes import MapWrites
from dlrm_jax.embedding.dynamic.resolve import Fused, Maps, resolve_fused
from dlrm_jax.parallel.mesh import varying


def table_passes(bags: tuple[int, ...], rows: int, bound: int) -> np.ndarray:
    """A batch of ``rows`` rows of every table's ``bags`` columns side by side, in passes of
    whole tables in table order, each holding at most ``bound`` ids or one table's: int32
    [passes, 2], each pass's first column and its columns (:func:`pass_places`)."""
    size = max(bound, rows * max(bags, default=1))
    passes, first, columns = [], 0, 0
    for b in bags:
        if columns and (columns + b) * rows > size:
            passes.append((first, columns))
            first, columns = first + columns, 0
        columns += b
    passes.append((first, columns))
    return np.array(passes, np.int32)


def pass_places(first, columns, rows: int, width: int, size: int, xp=jnp):
    """The places in the batch ([rows * width], row by row) of a pass's ids: ``columns``
    columns from ``first`` in every row, then ``rows * width`` (padding) up to ``size``.
    Traceable (computed, not a constant as long as the batch); ``xp=numpy``: on the host."""
    i = xp.arange(size)
    k = xp.maximum(columns, 1)
    return xp.where(i < columns * rows, (i // k) * width + first + i % k, rows * width)


def resolve_in_passes(
    maps: Maps,
    m: IdMap,
    passes: np.ndarray,
    width: int,
    table,
    hi,
    lo,
    valid,
    step,
    first_shards,
    learn: bool,
    size: int,
    chunk: int = 0,
) -> Fused:
    """``resolve.resolve_fused`` of the ids ``table``/``hi``/``lo``/``valid`` ([N], rows of
    ``width`` ids) with ``write=False``, one pass of :func:`table_passes` (``passes``) at a time: the same rows
    ([N]), sketch, counts and map writes, its arrays one pass long. The writes and the fresh
    rows come in ``size`` entries (those that write a row first, then padding; ``size`` at
    least the map's rows here or N). The sketches age once, in the first pass. Inside
    ``shard_map`` (its carries are typed as differing by device)."""
    n, rows_here = hi.shape[0], m.used.shape[0]
    size_of_pass = int(np.max(passes[:, 1])) * (n // width)

    def appended(acc, count, parts, keep):
        """``parts``' kept entries after the first ``count`` of ``acc`` (each array [size])."""
        to = jnp.where(keep, count + jnp.cumsum(keep, dtype=jnp.int32) - 1, size)
        acc = [a.at[to].set(p, mode="drop") for a, p in zip(acc, parts, strict=True)]
        return acc, count + jnp.sum(keep, dtype=jnp.int32)

    def one(carry, pass_):
        sketch, rows, writes, fresh, stats = carry
        index, first, columns = pass_
        places = pass_places(first, columns, n // width, width, size_of_pass)
        ok = places < n
        pick = lambda x: x[jnp.minimum(places, n - 1)]
        # (a rare path: compiled for the pass's whole size only, ``prefixes=False``)
        out = resolve_fused(
            maps, m._replace(sketch=sketch), pick(table), pick(hi), pick(lo), pick(valid) & ok, step,
            first_shards, learn, None, False, chunk, age=index == 0, prefixes=False,
        )  # fmt: skip
        rows = rows.at[jnp.where(ok, places, n)].set(out.rows, mode="drop")
        w = out.writes
        kept = (w.at < rows_here) | (w.seen_at < rows_here)
        parts, count = appended(list(writes[:5]), writes.count, list(w[:5]), kept)
        writes = MapWrites(*parts, count)
        fresh_parts = (out.fresh_rows, out.fresh_table, out.fresh_hi, out.fresh_lo)
        fresh_to, fresh_count = appended(list(fresh[:4]), fresh[4], list(fresh_parts), out.fresh_rows >= 0)
        return (out.map.sketch, rows, writes, (*fresh_to, fresh_count), stats + out.stats), None

    full = lambda fill, dtype: varying(jnp.full(size, fill, dtype))
    zero = varying(jnp.int32(0))
    writes = MapWrites(
        full(rows_here, jnp.int32), full(rows_here, jnp.int32), full(0, jnp.int32), full(0, jnp.uint32),
        full(0, jnp.uint32), zero,
    )  # fmt: skip
    fresh = (full(-1, jnp.int32), full(0, jnp.int32), full(0, jnp.uint32), full(0, jnp.uint32), zero)
    stats = varying(jnp.zeros((len(maps.specs), len(STATS)), jnp.int32))
    carry = (m.sketch, varying(jnp.full(n, -1, jnp.int32)), writes, fresh, stats)
    sketch, rows, writes, fresh, stats = lax.scan(one, carry, (jnp.arange(len(passes)), *jnp.asarray(passes).T))[0]
    none = jnp.zeros(0, jnp.int32)
    return Fused(rows, m._replace(sketch=sketch), *fresh[:4], stats, none, none, writes)
