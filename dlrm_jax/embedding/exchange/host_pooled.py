"""The row-within-host pooled form: a table split by rows over the devices of one host, its
bags pooled where the rows are, and the partial sums added inside the host, so one vector per
(sample, table) crosses hosts each way: what the exchange's lower bound counts, with no
capacity to overflow and no owner that sizes everyone's buckets.

It runs on the mesh's devices seen as (``hosts``, ``local``): H hosts of G devices, in the
order the batch is split in. Collectives over ``hosts`` join the devices of the same local
index on every host (the network between hosts); collectives over ``local`` stay inside a host.
Per part (the row-within-host pieces of one fused array), one ``jax.shard_map``:

forward   requester (h', k) sends host h the ids of its samples' bags of h's tables
          ([B_l, K], all_to_all over hosts, to (h, k)) -> the host's devices all-gather them
          ([G, H, B_l, K]: every requester's) -> each device pools its own rows of every bag
          (others count zero) -> the partial sums are reduce-scattered over the host: device
          (h, k) gets the sums for the requesters of local index k ([H, B_l, J, W]) -> back to
          them (all_to_all over hosts).
backward  each (sample, piece) gradient goes to (h, k) (all_to_all over hosts) -> all-gathered
          within the host -> each device gives every position it owns its piece's gradient
          times the position's weight and applies the sparse optimizer to those rows.

The column-within-host form (:class:`HostColumnsForm`) is the same trip with the table split
by columns instead: every device of the host holds one slice of every row, so each pools all of
every bag for its columns (no device's work is wasted on rows it does not hold), and each
slice goes straight to its requester by one all_to_all over every device instead of a
reduce-scatter (each carries 1/G of a vector, not a whole partial sum).

With row-wise Adagrad a column slice's update needs its row's squared gradient over the whole
width: the host's devices hold the same rows at the same positions, so they add their slices'
squares with one all-reduce within the host, of the distinct rows only (a measured capacity,
``layout.whole_rows_capacity``; a step with more runs further rounds of that size, agreed by
every device and reported as an overflow, so nothing is dropped).

Vectors and gradients travel at the wire precision; partial sums are added in float32. The
layout is :func:`~dlrm_jax.embedding.plan.layout.pooled_layout` with hosts as owners.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from dlrm_jax.embedding.exchange.common import checks_varying, if_overflow
from dlrm_jax.embedding.exchange.pooled import PooledForm
from dlrm_jax.embedding.exchange.row_grads import sum_by_row
from dlrm_jax.embedding.plan.layout import whole_rows_capacity
from dlrm_jax.ids import PAD_ID

HOSTS, LOCAL = "hosts", "local"
_BATCH = P((HOSTS, LOCAL))


def host_mesh(mesh, hosts: int) -> Mesh:
    """``mesh``'s devices as (``hosts``, ``local``), in the order the batch is split over them."""
    devices = np.asarray(mesh.devices).reshape(hosts, -1)
    return Mesh(devices, (HOSTS, LOCAL), axis_types=(AxisType.Auto,) * 2)


def _over_hosts(x):
    return lax.all_to_all(x, HOSTS, 0, 0)


def _within_host(x):
    return lax.all_gather(x, LOCAL, axis=0)


class _HostForm(PooledForm):
    """What both forms within hosts share: the (hosts, local) mesh, and the requests every
    device of a host receives."""

    def __init__(self, plan, part, mesh, wire, optimizer, dim):
        super().__init__(plan, part, mesh, wire, optimizer, dim)
        self.hosts, self.host_devices = self.layout.owners, self.group.num_devices // self.layout.owners
        self.mesh = host_mesh(mesh, self.hosts)

    def _host_requests(self, ids_local, weights_local):
        """This device's [B_l, S] ids and weights -> every requester's for this host, as
        every device of the host sees them: ids int32 and weights float32 [G, H, B_l, K]."""
        ids = _within_host(_over_hosts(self._requests(ids_local, PAD_ID)))
        weights = _within_host(_over_hosts(self._requests(weights_local, 0.0))) if self.mean else None
        return ids, self._weights(ids, weights)

    def _forward(self, local, table, ids_bs, weights_bs):
        fn = jax.shard_map(local, mesh=self.mesh, in_specs=(_BATCH, _BATCH, _BATCH), out_specs=(_BATCH, _BATCH))
        out, residual = fn(table, ids_bs, weights_bs)
        return out, residual, jnp.zeros((), jnp.int32)


class HostPooledForm(_HostForm):
    """One row-within-host part's lookup and update (see the module docstring)."""

    def _owned(self, ids):
        """For every position of the gathered requests [G, H, B_l, K]: the row of this
        device's shard holding it, past the end when another device of the host holds it."""
        host, me = lax.axis_index(HOSTS), lax.axis_index(LOCAL)
        block = jnp.asarray(self.layout.block)[host]
        offset = jnp.asarray(self.layout.row_offset)[host]
        safe = jnp.where(ids == PAD_ID, 0, ids)
        mine = (ids != PAD_ID) & (safe // block == me)
        return jnp.where(mine, offset + safe % block, self.group.local_rows).astype(jnp.int32)

    # ------------------------------------------------------------ forward
    def forward(self, table, ids_bs, weights_bs):
        """``(table [N*R, W], ids [B, S], weights [B, S]) -> (pooled [B, V'*W] float32,
        residual, overflowed int32 [] (never))``."""
        lay, g = self.layout, self.group

        def local(table_local, ids_local, weights_local):
            ids, weights = self._host_requests(ids_local, weights_local)  # [G, H, B_l, K]
            rows = self._owned(ids)
            vectors = table_local.at[rows].get(mode="fill", fill_value=0)
            partial = self._pool(vectors.astype(jnp.float32) * weights[..., None])  # [G, H, B_l, J, W]
            summed = lax.psum_scatter(partial, LOCAL, scatter_dimension=0)  # [H, B_l, J, W]: local index = mine
            back = self.wire.send(summed, _over_hosts)  # [H owner hosts, B_l, J, W]
            flat = back.transpose(1, 0, 2, 3).reshape(back.shape[1], -1, g.width)
            return flat[:, lay.reply_index].reshape(flat.shape[0], -1), (rows, weights)

        return self._forward(local, table, ids_bs, weights_bs)

    # ------------------------------------------------------------ backward + update
    def update(self, table, slots, residual, grad_bc, lr):
        """``grad_bc`` [B, V'*W]: the loss's gradient w.r.t. :meth:`forward`'s output."""
        g, opt = self.group, self.optimizer

        def local(table_local, slots_local, residual_local, grad_local, lr):
            rows, weights = residual_local
            every = self.wire.send(self._to_owners(grad_local, g.width), lambda x: _within_host(_over_hosts(x)))
            return opt.update(table_local, slots_local, self._lookups(rows, weights), every.reshape(-1, g.width), lr)

        fn = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(_BATCH, _BATCH, _BATCH, _BATCH, P()),
            out_specs=(_BATCH, _BATCH),
            check_vma=checks_varying(opt),
        )
        return fn(table, slots, residual, grad_bc, lr)


def _slices_to_requesters(x):
    """[G requesters' local index, H requester hosts, B_l, J, c] of this device's slice -> at the
    requester: [H owner hosts, B_l, J, G slices, c]. One all_to_all over every device: each
    slice crosses once (within a host or between hosts), where a trip within the host and then
    between hosts would carry every slice twice."""
    g, h = x.shape[:2]
    x = lax.all_to_all(x.swapaxes(0, 1).reshape(h * g, *x.shape[2:]), (HOSTS, LOCAL), 0, 0)
    return x.reshape(h, g, *x.shape[1:]).transpose(0, 2, 3, 1, 4)  # (devices are host-major)


def _slices_to_owners(x):
    """The inverse: [H owner hosts, B_l, J, G slices, c] at the requester -> at each slice's
    owner: [G requesters' local index, H requester hosts, B_l, J, c]."""
    h, g = x.shape[0], x.shape[3]
    x = x.transpose(0, 3, 1, 2, 4).reshape(h * g, *x.shape[1:3], x.shape[4])
    x = lax.all_to_all(x, (HOSTS, LOCAL), 0, 0)  # [N requesters (host-major), B_l, J, c]
    return x.reshape(h, g, *x.shape[1:]).swapaxes(0, 1)


class HostColumnsForm(_HostForm):
    """One column-within-host part's lookup and update (see the module docstring). The part's
    virtual tables are column slices, one per device of a host; ``layout`` has one piece per
    table (its first slice), its position at every device of the host."""

    def __init__(self, plan, part, mesh, wire, optimizer, dim):
        super().__init__(plan, part, mesh, wire, optimizer, dim)
        lay, g = self.layout, self.group
        # Each output column [V' * Ws] -> its place in a sample's [H * J * W] vectors
        # (W = host_devices slices of Ws, in slice order), and the piece of each table.
        piece = {vt.table: int(lay.reply_index[i]) for i, vt in enumerate(v for v in g.vtables if v.col_start == 0)}
        full = self.host_devices * g.width
        self.reply_cols = np.concatenate(
            [piece[vt.table] * full + vt.col_start + np.arange(g.width) for vt in g.vtables]
        ).astype(np.int32)
        self.whole_rows = optimizer.needs_whole_rows and self.host_devices > 1
        self.rows_capacity = whole_rows_capacity(plan, part.group)

    def _rows(self, ids):
        offset = jnp.asarray(self.layout.row_offset)[lax.axis_index(HOSTS)]
        return jnp.where(ids == PAD_ID, self.group.local_rows, ids + offset).astype(jnp.int32)

    # ------------------------------------------------------------ forward
    def forward(self, table, ids_bs, weights_bs):
        """``(table [N*R, Ws], ids [B, S], weights [B, S]) -> (pooled [B, V'*Ws] float32,
        residual, overflowed int32 [] (never))``."""

        def local(table_local, ids_local, weights_local):
            ids, weights = self._host_requests(ids_local, weights_local)  # [G, H, B_l, K]
            rows = self._rows(ids)
            vectors = table_local.at[rows].get(mode="fill", fill_value=0)
            pooled = self._pool(vectors.astype(jnp.float32) * weights[..., None])  # [G, H, B_l, J, Ws]: my columns
            back = self.wire.send(pooled, _slices_to_requesters)  # [H, B_l, J, G, Ws]
            flat = back.transpose(1, 0, 2, 3, 4).reshape(back.shape[1], -1)  # [B_l, H * J * W]
            return flat[:, self.reply_cols], (rows, weights, *self._distinct(rows))

        if not self.whole_rows:
            return self._forward(local, table, ids_bs, weights_bs)
        out, residual, _ = self._forward(local, table, ids_bs, weights_bs)
        return out, residual, jnp.max(residual[3]).astype(jnp.int32)

    def _distinct(self, rows):
        """With whole-row statistics: each position's index among the distinct rows the host
        was asked for [n] (sorted, so the real rows come first), and whether more of them than
        the capacity were asked of any host ([1], agreed by every device). Else nothing."""
        if not self.whole_rows:
            return ()
        n, pad = rows.size, self.group.local_rows
        uniq, inv = jnp.unique(rows.reshape(-1), size=n, fill_value=pad, return_inverse=True)
        most = lax.pmax(jnp.sum(uniq < pad), (HOSTS, LOCAL))
        return inv.reshape(-1), (most > self.rows_capacity)[None], most[None]

    # ------------------------------------------------------------ backward + update
    def update(self, table, slots, residual, grad_bc, lr):
        """``grad_bc`` [B, V'*Ws]: the loss's gradient w.r.t. :meth:`forward`'s output."""
        lay, g, opt = self.layout, self.group, self.optimizer
        vectors = self.hosts * lay.pieces * self.host_devices * g.width

        def local(table_local, slots_local, residual_local, grad_local, lr):
            rows, weights, *distinct = residual_local
            b_l = grad_local.shape[0]
            full = jnp.zeros((b_l, vectors), grad_local.dtype).at[:, self.reply_cols].set(grad_local)
            full = full.reshape(b_l, self.hosts, lay.pieces, self.host_devices, g.width).transpose(1, 0, 2, 3, 4)
            every = self.wire.send(full, _slices_to_owners)  # [G, H, B_l, J, Ws]
            lookups, grads = self._lookups(rows, weights), every.reshape(-1, g.width)
            if not self.whole_rows:
                return opt.update(table_local, slots_local, lookups, grads, lr)
            # The host's devices hold the slices of the same rows at the same positions: a
            # row's squared gradient over its whole width is a sum over the host.
            inv, over, most = distinct
            merged = sum_by_row(lookups, grads, g.local_rows, opt.exact_sums).grads  # by distinct row, sorted
            sq = self._host_sums(jnp.sum(merged * merged, -1), over[0], most[0])[inv] / self.dim
            return opt.update(table_local, slots_local, lookups, grads, lr, row_mean_sq=sq)

        fn = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(_BATCH, _BATCH, _BATCH, _BATCH, P()),
            out_specs=(_BATCH, _BATCH),
            check_vma=checks_varying(opt),
        )
        return fn(table, slots, residual, grad_bc, lr)

    def _host_sums(self, sq, over, most):
        """[n] squared sums of this device's slices by distinct row (the real rows first) ->
        the host's totals: the first ``rows_capacity`` in one all-reduce within the host, the
        rest (when any host was asked for more distinct rows) in further rounds as large."""
        c, n = self.rows_capacity, sq.shape[0]
        if c >= n:
            return lax.psum(sq, LOCAL)
        total = jnp.zeros_like(sq).at[:c].set(lax.psum(sq[:c], LOCAL))
        rounds = -(-n // c)
        padded = jnp.pad(sq, (0, rounds * c - n))

        def more(total):
            def one_round(i, acc):
                window = lax.psum(lax.dynamic_slice_in_dim(padded, i * c, c), LOCAL)
                return lax.dynamic_update_slice_in_dim(acc, window, i * c, 0)

            acc = jnp.pad(total, (0, rounds * c - n))
            return lax.fori_loop(1, (most + c - 1) // c, one_round, acc)[:n]

        return if_overflow(over, more, lambda total: total, total)
