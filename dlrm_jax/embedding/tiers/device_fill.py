"""Filling device caches inside the jitted step: rows in, the rows they replace out.

Per sharded group holding tiered tables, every device gets ``capacity`` fill entries: a local
row of its shard (``rows``; padding = ``local_rows``, out of range, dropped), the values and
optimizer state to put there, and ``forward``: -1, or the index of an entry of the *previous*
fill whose evicted row this entry is. A row evicted by one program and needed by the next is
still on its way to the host; the device takes it from the previous program's eviction output
instead (the same bits), so the host never has to wait for that write-back.

The program reads what the rows held before writing (the evictions, returned for write-back),
then writes. Everything is local to each device: no collective.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dlrm_jax.embedding.plan.layout import Group
from dlrm_jax.parallel.mesh import AXIS


class CacheRows(NamedTuple):
    """Rows of one group's caches, per device: values [N, F, W] and optimizer state
    {name: [N, F, ...]} (batch-sharded over the leading axis)."""

    values: jax.Array
    slots: dict


class GroupFill(NamedTuple):
    """One program's fill of one group: rows int32 [N, F] (local rows; padding =
    local_rows), forward int32 [N, F] (-1 or an entry of the previous program's
    evictions), and the incoming rows."""

    rows: jax.Array
    forward: jax.Array
    incoming: CacheRows


def fill_group(g: Group, mesh: jax.sharding.Mesh):
    """(table, slots, GroupFill, previous evictions CacheRows) -> (table, slots, evictions)."""

    def local(table, slots, fill: GroupFill, prev: CacheRows):
        rows, fwd = fill.rows[0], fill.forward[0]
        use_prev = fwd >= 0
        src = jnp.where(use_prev, fwd, 0)

        def swap(arr, incoming, previous):
            mask = use_prev.reshape(-1, *([1] * (incoming.ndim - 2)))
            new = jnp.where(mask, previous[0][src], incoming[0]).astype(arr.dtype)
            old = arr.at[rows].get(mode="fill", fill_value=0)
            # The same rows, but written only after they were read: with the write depending
            # on the read, XLA updates the cache in place instead of copying all of it (twice)
            # each step. (Padding rows are dropped either way.)
            kept = (rows < arr.shape[0]).reshape(mask.shape)
            return arr.at[rows].set(jnp.where(kept, new, old), mode="drop"), old[None]

        table, old_values = swap(table, fill.incoming.values, prev.values)
        new_slots, old_slots = {}, {}
        for k in slots:
            new_slots[k], old_slots[k] = swap(slots[k], fill.incoming.slots[k], prev.slots[k])
        return table, new_slots, CacheRows(old_values, old_slots)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(AXIS), P(AXIS), P(AXIS), P(AXIS)),
        out_specs=(P(AXIS), P(AXIS), P(AXIS)),
        check_vma=False,
    )


def fill_caches(groups: dict, mesh: jax.sharding.Mesh, tables: dict, slots: dict, fills: dict, prev: dict):
    """Apply one program's fills {group: GroupFill} to the state's group arrays: (tables,
    slots, evictions {group: CacheRows}); groups without fills are untouched."""
    tables, slots, evicted = dict(tables), dict(slots), {}
    for name, fill in fills.items():
        tables[name], slots[name], evicted[name] = fill_group(groups[name], mesh)(
            tables[name], slots[name], fill, prev[name]
        )
    return tables, slots, evicted


def read_rows(mesh: jax.sharding.Mesh, table: jax.Array, slots: dict, rows: jax.Array) -> CacheRows:
    """Local rows int32 [N, K] of each device's shard (out of range: zeros) -> CacheRows
    [N, K, ...]: cache rows read back without a collective (rows becoming hot)."""

    def local(table, slots, rows):
        take = lambda a: a.at[rows[0]].get(mode="fill", fill_value=0)[None]
        return CacheRows(take(table), {k: take(v) for k, v in slots.items()})

    return jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P(AXIS), P(AXIS), P(AXIS)), out_specs=P(AXIS), check_vma=False)
    )(table, slots, rows)
