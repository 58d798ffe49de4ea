"""The replicated forms: every device holds the tables and looks up locally. The update either
all-reduces each table's [rows, W] gradient (cheap for tables of few rows: what TorchRec calls
data-parallel tables) or gathers every device's lookups (row ids, and weights for means) and
pooled gradients to all (cheap for a batch with fewer lookups than the tables have rows);
``plan.layout.replicated_kind`` picks by bytes. Every device then applies the same update, so
the copies never drift apart."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from dlrm_jax.embedding.exchange.columns import segment_sum_axis1, take_columns
from dlrm_jax.embedding.exchange.common import agreed, gather_lookups_over
from dlrm_jax.embedding.exchange.optimizers import SparseOptimizer
from dlrm_jax.embedding.exchange.row_grads import Lookups, dense_row_sums
from dlrm_jax.embedding.plan.embedding_plan import ExchangeKind
from dlrm_jax.embedding.plan.layout import ExchangePart, Group
from dlrm_jax.parallel.mesh import AXIS


def _rows(g: Group, ids_bs):
    """Rows of the fused array for every virtual slot's id (PAD_ID -> past the end)."""
    vids = take_columns(ids_bs, g.vslot_slot)
    return jnp.where(vids == -1, g.local_rows, vids + jnp.asarray(g.vslot_offset))


class ReplicatedForm:
    """The replicated group's lookup and update with the forms' shared interface (see
    ``sharded.IdsForm``). ``mean``: some bag of the group is a mean (``pools_by_mean``), so
    the lookups' weights travel with them. It takes the gradient as the model gives it
    (``reads_any_float``): on one device the fused kernels read a bfloat16 one where it lies
    (DLRM-DCNv2 on one H100: 1.3 GB a step fewer; scripts/gpu_compile.py); each lookup's is
    made float32 before it is added, and a gathered one before the collective (its planned
    bytes)."""

    reads_any_float = True

    def __init__(
        self, part: ExchangePart, mesh, optimizer: SparseOptimizer, agree_over: str | None = None, mean: bool = True
    ):
        g = self.group = part.group
        self.cols, self.kind = g.vfeature_cols.reshape(-1), part.kind
        self.mesh, self.optimizer, self.every, self.mean = mesh, optimizer, agreed(agree_over), mean

    def forward(self, table, ids_bs, weights_bs):
        g = self.group
        vectors = table.at[_rows(g, ids_bs)].get(mode="fill", fill_value=0).astype(jnp.float32)
        weighted = vectors * take_columns(weights_bs, g.vslot_slot)[:, :, None]
        pooled = (
            weighted
            if len(g.vtables) == g.num_vslots
            else segment_sum_axis1(weighted, g.vslot_vfeature, len(g.vtables))
        )
        return pooled.reshape(pooled.shape[0], -1), (ids_bs, weights_bs), jnp.zeros((), jnp.int32)

    def _lookups(self, ids_local, weights_local) -> Lookups:
        """This device's lookups, pointing at its pooled gradients [B_l * V, W]: slot s of
        sample b read into feature ``vslot_vfeature[s]`` of b. Without means every weight is 1
        (a missing id's row is past the end: dropped)."""
        g = self.group
        weights = take_columns(weights_local, g.vslot_slot) if self.mean else None
        return Lookups.of_bags(_rows(g, ids_local), g.vslot_vfeature, len(g.vtables), weights)

    def update(self, table, slots, residual, grad_bc, lr):
        g, opt, every = self.group, self.optimizer, self.every
        ids_bs, weights_bs = residual

        def allreduce(table, slots, ids_local, weights_local, grad_local, lr):
            lookups = self._lookups(ids_local, weights_local)
            mine = dense_row_sums(lookups, grad_local.reshape(-1, g.width), g.local_rows, opt.exact_sums)
            return opt.apply(table, slots, None, lax.psum(mine, every), lr)

        def gather(table, slots, ids_local, weights_local, grad_local, lr):
            lookups = self._lookups(ids_local, weights_local)
            grads = grad_local.reshape(-1, g.width)
            if lax.axis_size(every) > 1:  # (gathered in float32, as planned; ``update`` sums in it)
                grads = grads.astype(jnp.float32)
            return opt.update(table, slots, *gather_lookups_over(lookups, grads, every), lr)

        local = allreduce if self.kind == ExchangeKind.ALLREDUCE else gather
        # check_vma off: every device applies the same summed or gathered update, so outputs are replicated.
        return jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(P(), P(), P(AXIS), P(AXIS), P(AXIS), P()),
            out_specs=(P(), P()),
            check_vma=False,
        )(table, slots, ids_bs, weights_bs, grad_bc, lr)
