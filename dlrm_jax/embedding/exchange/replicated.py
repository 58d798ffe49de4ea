"""The replicated form: every device holds the tables; lookups are local, and the update gathers
the whole batch's rows and gradients to every device, which then applies the same update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from dlrm_jax.embedding.exchange.common import (
    agreed,
)
from dlrm_jax.embedding.exchange.optimizers import SparseOptimizer
from dlrm_jax.embedding.plan.layout import Group, take_columns
from dlrm_jax.parallel.mesh import AXIS


def replicated_forward(g: Group):
    """``f(table [R, W], ids [B, S]) -> vectors [B, V, W]``: a local gather on every device."""

    def forward(table, ids_bs):
        vids = take_columns(ids_bs, g.vslot_slot)
        rows = jnp.where(vids == -1, g.local_rows, vids + jnp.asarray(g.vslot_offset))
        return table.at[rows].get(mode="fill", fill_value=0).astype(jnp.float32)

    return forward


def replicated_update(g: Group, mesh, optimizer: SparseOptimizer, replicas: str | None = None):
    """Every device gathers the batch's rows and gradients (of every replica's batch) and
    applies the same update.

    Moves B*V*(W+1) values per device rather than an all-reduce of the R x W table.
    """
    every = agreed(replicas)

    def local(table, slots, ids_local, grads_local, lr):
        vids = take_columns(ids_local, g.vslot_slot)
        rows = jnp.where(vids == -1, g.local_rows, vids + jnp.asarray(g.vslot_offset)).reshape(-1)
        rows = lax.all_gather(rows, every, tiled=True)
        grads = lax.all_gather(grads_local.reshape(-1, g.width), every, tiled=True)
        return optimizer.update(table, slots, rows, grads, lr)

    # check_vma off: every device applies the same gathered update, so outputs are replicated.
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS), P()),
                         out_specs=(P(), P()), check_vma=False)
