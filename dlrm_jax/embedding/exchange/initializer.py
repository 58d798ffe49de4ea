"""Table initialisation computed in place, shard by shard, from the physical row index.

DLRM initialises a table of R rows with U(-1/sqrt(R), 1/sqrt(R)). Drawing each logical table
whole and scattering it into the fused arrays would put every full table on every device (the
random draw is not sharded). Here every element of a fused array is a pure function of
(seed, table, logical row, column): a counter-based hash of those numbers. Each device
evaluates it only for the rows it holds (the computation is elementwise over an iota, which
XLA partitions like the output), and a table's values are the same under every plan.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from dlrm_jax.embedding.plan.layout import KIND_BLOCK, KIND_CYCLIC, Group
from dlrm_jax.hashing import mix32


def hash_uniform(seed_2: jax.Array, table: jax.Array, row: jax.Array, col: jax.Array) -> jax.Array:
    """float32 in [0, 1), one per element of the broadcast (table, row, col) uint32 arrays."""
    h = mix32(
        col.astype(jnp.uint32)
        ^ mix32(row.astype(jnp.uint32) ^ mix32(table.astype(jnp.uint32) + jnp.uint32(0x9E3779B9), jnp), jnp),
        jnp,
    )
    h = mix32(h ^ seed_2[0], jnp) ^ seed_2[1]
    return (mix32(h, jnp) >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def logical_rows(g: Group, vt_index: int, physical_row: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For physical rows of group ``g``'s array (int32 [n], jnp or numpy: plain arithmetic, so
    the result has the input's kind): the logical row of virtual table ``vt_index`` each
    holds, and whether it holds one of that table's rows at all."""
    vt = g.vtables[vt_index]
    if g.replicated:
        device, local = physical_row * 0, physical_row
    else:
        device, local = physical_row // g.local_rows, physical_row % g.local_rows
    i = local - vt.offset
    if vt.kind == KIND_BLOCK:  # (devices before the piece's first get negative rows: not held)
        logical = (device - vt.device) * vt.block + i
        held = (i >= 0) & (i < vt.block) & (logical >= 0)
    elif vt.kind == KIND_CYCLIC:
        logical = i * g.num_devices + device
        held = (i >= 0) & (i < vt.block)
    else:  # one device holds the whole table (or column slice); replicated: every device
        logical = i
        held = (i >= 0) & (i < vt.rows) & ((device == vt.device) | g.replicated)
    return logical, held & (logical < vt.rows)


def init_group(g: Group, table_rows: tuple[int, ...], key: jax.Array, dtype) -> jax.Array:
    """The fused array of group ``g`` [array_rows, width], each table's rows drawn from
    U(-1/sqrt(rows), 1/sqrt(rows)) as a function of (key, table, row, column); rows that hold
    no table row (padding) are zero."""
    rows = lax.iota(jnp.int32, g.array_rows)
    table = jnp.zeros(g.array_rows, jnp.int32)
    logical = jnp.zeros(g.array_rows, jnp.int32)
    col0 = jnp.zeros(g.array_rows, jnp.int32)
    scale = jnp.zeros(g.array_rows, jnp.float32)
    for v, vt in enumerate(g.vtables):
        lr, held = logical_rows(g, v, rows)
        table = jnp.where(held, vt.table, table)
        logical = jnp.where(held, lr, logical)
        col0 = jnp.where(held, vt.col_start, col0)
        scale = jnp.where(held, 1.0 / table_rows[vt.table] ** 0.5, scale)
    cols = col0[:, None] + lax.iota(jnp.int32, g.width)[None, :]
    u = hash_uniform(
        jax.random.key_data(key).astype(jnp.uint32).reshape(-1)[:2], table[:, None], logical[:, None], cols
    )
    return ((2.0 * u - 1.0) * scale[:, None]).astype(dtype)


def init_table_rows(key: jax.Array, table: int, table_rows: int, start: int, stop: int, dim: int, dtype) -> jax.Array:
    """Rows [start, stop) of logical table ``table`` [stop - start, dim], the same values
    :func:`init_group` gives them under any plan (a tiered table's bulk load: one compiled
    program per chunk size, the position an argument)."""
    return _table_rows(
        jax.random.key_data(key).astype(jnp.uint32).reshape(-1)[:2],
        jnp.int32(table),
        jnp.float32(1.0 / table_rows**0.5),
        jnp.int32(start),
        stop - start,
        dim,
        jnp.dtype(dtype),
    )


@functools.partial(jax.jit, static_argnums=(4, 5, 6))
def _table_rows(seed_2, table, scale, start, count: int, dim: int, dtype):
    rows = start + lax.iota(jnp.int32, count)
    cols = lax.iota(jnp.int32, dim)
    u = hash_uniform(seed_2, jnp.full((count, 1), table, jnp.int32), rows[:, None], cols[None, :])
    return ((2.0 * u - 1.0) * scale).astype(dtype)
