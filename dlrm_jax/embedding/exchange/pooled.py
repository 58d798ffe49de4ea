"""The pooled form: every bag of a table-wise table or column slice goes whole to its owner,
which pools it, so one vector per (sample, piece) comes back and one gradient goes out: what
the exchange's lower bound counts, with no capacity to overflow.

Per part (the fixed-owner pieces of one fused array), inside one ``jax.shard_map``:

forward   each device sends owner o the ids of its samples' bags of o's pieces ([B_l, K] per
          owner, K the buffer's positions, PAD_ID where a bag is shorter or o has fewer
          ids), and their pooling weights when a table pools by mean (sum pooling needs only
          the ids) -> o gathers the rows and sums each piece's positions: [B_l, J, W] per
          requester -> all_to_all back -> each (sample, piece) picks its vector.
backward  each (sample, piece) gradient goes to its owner ([B_l, J, W] per owner) -> the owner
          gives every position its piece's gradient times the position's weight and applies
          the sparse optimizer to those rows (merging a row's duplicates, as every form does).
          Row-wise Adagrad on column slices needs each row's squared gradient over its whole
          width: each slice owner returns its part per position, the requester adds the
          slices and sends the totals back (two all_to_alls of one float per position).

The positions' layout is static (``plan.layout.pooled_layout``): piece j of every owner sits
at the same positions, so pooling is a static slice on every device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from dlrm_jax.embedding.exchange.common import (
    all_to_all,
    checks_varying,
    gather_lookups_over,
    gather_over,
    own_squares,
)
from dlrm_jax.embedding.exchange.optimizers import SparseOptimizer
from dlrm_jax.embedding.exchange.row_grads import Lookups
from dlrm_jax.embedding.exchange.wire import Wire
from dlrm_jax.embedding.plan.layout import ExchangePart, PooledLayout, pooled_layout, pools_by_mean
from dlrm_jax.ids import PAD_ID
from dlrm_jax.parallel.mesh import AXIS


class PooledForm:
    """One pooled part's lookup and update (see the module docstring). ``cols``: the columns
    of the [B, F * D] pooled output it fills, in the order of its output's columns."""

    def __init__(
        self,
        plan,
        part: ExchangePart,
        mesh,
        wire: Wire,
        optimizer: SparseOptimizer,
        dim: int,
        agree_over: str | None = None,
    ):
        g = self.group = part.group
        self.layout: PooledLayout = pooled_layout(plan, g)
        self.mesh, self.wire, self.optimizer, self.dim, self.agree_over = mesh, wire, optimizer, dim, agree_over
        self.cols = g.vfeature_cols.reshape(-1)
        self.mean = pools_by_mean(plan, g)
        self.whole_rows = optimizer.needs_whole_rows and g.has_column_slices

    # ------------------------------------------------------------ shared pieces
    def _requests(self, x_local, fill):
        """[B_l, S] per-slot values -> [O, B_l, K]: what this device sends each owner (a
        position that carries no slot reads the appended ``fill`` column)."""
        s = x_local.shape[1]
        padded = jnp.concatenate([x_local, jnp.full((x_local.shape[0], 1), fill, x_local.dtype)], axis=1)
        index = np.where(self.layout.send_slot < 0, s, self.layout.send_slot).reshape(-1)
        return padded[:, index].reshape(x_local.shape[0], self.layout.owners, -1).transpose(1, 0, 2)

    def _local_rows(self, recv_ids):
        """Rows of this owner's shard for the received ids (PAD -> past the end: dropped)."""
        offset = jnp.asarray(self.layout.row_offset)[lax.axis_index(AXIS)]
        return jnp.where(recv_ids == PAD_ID, self.group.local_rows, recv_ids + offset).astype(jnp.int32)

    def _weights(self, recv_ids, recv_weights):
        return recv_weights if self.mean else (recv_ids != PAD_ID).astype(jnp.float32)

    def _pool(self, weighted):
        """[..., K, W] weighted rows at the request positions -> [..., J, W]: each piece's sum."""
        starts = self.layout.starts
        return jnp.stack(
            [jnp.sum(weighted[..., a:b, :], axis=-2) for a, b in zip(starts[:-1], starts[1:], strict=True)], axis=-2
        )

    def _to_owners(self, grad_local, width: int):
        """[B_l, V' * width] gradient of this device's outputs -> [O, B_l, J, width]: what goes
        to each owner for each piece (zero where an owner has no such piece)."""
        lay, b_l = self.layout, grad_local.shape[0]
        per_vt = grad_local.reshape(b_l, -1, width)
        padded = jnp.concatenate([per_vt, jnp.zeros((b_l, 1, width), per_vt.dtype)], axis=1)
        return padded[:, lay.send_index].reshape(b_l, lay.owners, lay.pieces, width).transpose(1, 0, 2, 3)

    # ------------------------------------------------------------ forward
    def forward(self, table, ids_bs, weights_bs):
        """``(table [N*R, W], ids [B, S], weights [B, S]) -> (pooled [B, V'*W] float32,
        residual, overflowed int32 [] (never))``."""
        lay, g = self.layout, self.group

        def local(table_local, ids_local, weights_local):
            recv_ids = all_to_all(self._requests(ids_local, PAD_ID))  # [N, B_l, K] from each requester
            recv_w = all_to_all(self._requests(weights_local, 0.0)) if self.mean else recv_ids
            weights = self._weights(recv_ids, recv_w)
            vectors = table_local.at[self._local_rows(recv_ids)].get(mode="fill", fill_value=0)
            pooled = self._pool(vectors.astype(jnp.float32) * weights[..., None])  # [N, B_l, J, W]
            back = self.wire.send(pooled, all_to_all)  # [N owners, B_l, J, W]
            flat = back.transpose(1, 0, 2, 3).reshape(back.shape[1], -1, g.width)  # [B_l, N*J, W]
            out = flat[:, lay.reply_index].reshape(flat.shape[0], -1)
            return out, (recv_ids, weights)

        fn = jax.shard_map(local, mesh=self.mesh, in_specs=(P(AXIS), P(AXIS), P(AXIS)), out_specs=(P(AXIS), P(AXIS)))
        out, residual = fn(table, ids_bs, weights_bs)
        return out, residual, jnp.zeros((), jnp.int32)

    # ------------------------------------------------------------ backward + update
    def update(self, table, slots, residual, grad_bc, lr):
        """``grad_bc`` [B, V'*W]: the loss's gradient w.r.t. :meth:`forward`'s output."""
        g, opt, agree_over = self.group, self.optimizer, self.agree_over

        def local(table_local, slots_local, residual_local, grad_local, lr):
            recv_ids, weights = residual_local
            recv = self.wire.send(self._to_owners(grad_local, g.width), all_to_all)  # [N requesters, B_l, J, W]
            lookups = self._lookups(self._local_rows(recv_ids), weights)
            every = gather_lookups_over(lookups, recv.reshape(-1, g.width), agree_over)
            if not self.whole_rows:
                return opt.update(table_local, slots_local, *every, lr)
            row_mean_sq = gather_over(self._row_mean_sq(every, lookups.rows.shape[0], recv_ids.shape), agree_over)
            return opt.update(table_local, slots_local, *every, lr, row_mean_sq=row_mean_sq)

        fn = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(P(AXIS), P(AXIS), P(AXIS), P(AXIS), P()),
            out_specs=(P(AXIS), P(AXIS)),
            check_vma=checks_varying(opt),
        )
        return fn(table, slots, residual, grad_bc, lr)

    def _lookups(self, rows, weights) -> Lookups:
        """The received positions [..., K] as lookups of the received gradients [..., J, W]:
        position (..., k) takes piece ``k_piece[k]``'s gradient of its bag, times its weight
        (1 without means: an empty position's row is past the end, dropped)."""
        return Lookups.of_bags(rows, self.layout.k_piece, self.layout.pieces, weights if self.mean else None)

    def _row_mean_sq(self, every, own: int, shape):
        """Per received position [N*B_l*K]: its row's summed gradient squared, over the row's
        whole width (every column slice's owner adds its part), divided by the width.
        ``every``: (lookups, gradients) of every replica, of which this one's ``own`` lookups
        are its block."""
        lay, g, agree_over = self.layout, self.group, self.agree_over
        sq = own_squares(every, g.local_rows, own, agree_over, self.optimizer.exact_sums)
        partial = all_to_all(sq.reshape(shape))  # [N owners, B_l, K]: back to the requesters
        # Requester: a slot's total is the sum over the owners it went to (one per slice).
        b_l, slots = shape[1], int(lay.send_slot.max()) + 1
        flat = partial.transpose(1, 0, 2).reshape(b_l, -1)  # [B_l, N*K]
        slot_of = np.where(lay.send_slot < 0, slots, lay.send_slot).reshape(-1)
        total = jax.ops.segment_sum(flat.T, jnp.asarray(slot_of), slots + 1).T  # [B_l, S + 1]
        back = total[:, slot_of].reshape(b_l, g.num_devices, -1).transpose(1, 0, 2)
        return all_to_all(back).reshape(-1) / self.dim
