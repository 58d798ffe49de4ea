"""The two-level ids form: a host's distinct requests merged before they cross hosts.

The flat ids form (``sharded``) sends each owner one bucket from every device, each as large
as the busiest (requester, owner) pair's; on many devices each device asks each owner for a
few rows, and the busiest pair of N^2 is far above the mean (criteo_kaggle on 512 devices:
4.25 distinct rows a pair on average, buckets of 23-33). Here a device's requests first meet
the requests of its host's other devices, so what crosses hosts is the host's distinct rows
per owner (G times the mean, with a much smaller spread), in one bucket per pair of hosts.

On the mesh's devices seen as (``hosts``, ``local``) (``host_pooled.host_mesh``), owner
o = (h_o, k_o). Per part, requester (h, k):

forward   route its ids and deduplicate; stage 1: every distinct (owner, row) goes to its relay
          (h, k_o), the device of its own host with the owner's local index ([G, C1] (host,
          row) pairs, all_to_all over ``local``) -> the relay merges its host's requests per
          owner host; stage 2: [H, C2] rows to the owners (all_to_all over ``hosts``, to
          (h_o, k_o)) -> the owners gather the rows -> back to the relays -> each relay
          answers its host's requests -> back to the requesters -> each slot picks its vector.
backward  each slot's gradient summed into its stage-1 place -> relays -> summed into their
          stage-2 places (a row's gradient from the whole host, once) -> owners, which apply
          the sparse optimizer (merging what several hosts sent for one row). The owners keep
          the rows they were sent in the forward.

Capacities C1 and C2 are measured like the flat form's (``capacity.measure_capacities``).
When a step has more requests than either holds (a pmax: every device agrees), it runs the
flat form instead, with its own capacity and rounds, so nothing is dropped and the step
reports an overflow. Vectors and gradients travel at the wire precision; sums are float32.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from dlrm_jax.embedding.exchange.common import checks_varying, if_overflow, route_and_bucket, route_group
from dlrm_jax.embedding.exchange.host_pooled import HOSTS, LOCAL, host_mesh
from dlrm_jax.embedding.exchange.routing import bucket, scatter_to_buckets
from dlrm_jax.embedding.exchange.row_grads import Lookups
from dlrm_jax.embedding.exchange.sharded import IdsForm, sharded_forward, sharded_update
from dlrm_jax.embedding.exchange.wire import Wire
from dlrm_jax.embedding.plan.layout import ExchangePart
from dlrm_jax.parallel.mesh import AXIS

_BATCH = P((HOSTS, LOCAL))


class TwoLevelRoute(NamedTuple):
    """Where one step's requests go (per device, fixed shapes; the update's residual too).

    slot_dest [n]: each slot's stage-1 place k_o * C1 + rank, G * C1 when it has none;
    relay_dest [G * C1]: at the relay, each received request's stage-2 place h_o * C2 +
    rank, H * C2 when none; owner_rows [H * C2]: at the owner, the rows each relay sent
    (``local_rows``: none); over [1]: some bucket overflowed (agreed); most [2]: the fullest
    stage-1 and stage-2 buckets (agreed)."""

    slot_dest: jax.Array
    relay_dest: jax.Array
    owner_rows: jax.Array
    over: jax.Array
    most: jax.Array


def _to_local(x):
    return lax.all_to_all(x, LOCAL, 0, 0)


def _to_hosts(x):
    return lax.all_to_all(x, HOSTS, 0, 0)


def stage_counts(owner, row, valid, hosts: int, host_devices: int, local_rows: int):
    """A requester's distinct (owner, row) requests sorted by (owner's local index, owner's
    host, row): the :class:`~dlrm_jax.embedding.exchange.routing.Buckets` of that order (its
    owners are local index * hosts + host), each distinct request's rank among those to
    owners of the same local index (its stage-1 place), and each slot's."""
    key = (owner % host_devices) * hosts + owner // host_devices
    b = bucket(key, row, valid, hosts * host_devices, local_rows)
    starts = jnp.cumsum(b.counts) - b.counts

    def rank(owner_key, within):  # the place among the same local index's requests
        return starts[owner_key] + within - starts[(owner_key // hosts) * hosts]

    return b, rank(b.unique_owner, b.unique_rank), rank(b.slot_owner, b.slot_rank)


class HostIdsForm(IdsForm):
    """One ids part's lookup and update in two levels (see the module docstring); the flat
    form's interface, residual (route, ids, weights)."""

    def __init__(self, part: ExchangePart, mesh, capacities, wire: Wire, optimizer, dim: int, hosts: int):
        # (Not IdsForm.__init__: its forward and update are this class's methods.)
        g = self.group = part.group
        if hosts < 2 or g.num_devices % hosts:
            raise ValueError(f"ids in two levels need hosts that tile the {g.num_devices} devices, not {hosts}")
        self.cols, self.one_hot = g.vfeature_cols.reshape(-1), False
        self.capacity, self.c1, self.c2 = capacities  # one level (overflow), stage 1, stage 2
        self.hosts, self.host_devices = hosts, g.num_devices // hosts
        self.mesh, self.host_mesh = mesh, host_mesh(mesh, hosts)
        self.wire, self.optimizer, self.dim = wire, optimizer, dim
        self._flat_route = jax.shard_map(
            lambda ids: (lambda _, b, most: (b, most[None], None))(*route_and_bucket(g, ids)),
            mesh=mesh,
            in_specs=P(AXIS),
            out_specs=P(AXIS),
        )
        self._route = jax.shard_map(self._route_local, mesh=self.host_mesh, in_specs=_BATCH, out_specs=_BATCH)

    # ------------------------------------------------------------ routing (both levels)
    def _route_local(self, ids_local):
        g, H, G, c1, c2 = self.group, self.hosts, self.host_devices, self.c1, self.c2
        owner, row, valid = route_group(g, ids_local)
        b, rank1, slot_rank = stage_counts(owner, row, valid, H, G, g.local_rows)
        # Stage 1: each distinct request's (owner host, row) to its relay, by local index.
        fits = b.unique_valid & (rank1 < c1)
        k_of, h_of = b.unique_owner // H, b.unique_owner % H
        send = jnp.stack(
            [
                scatter_to_buckets(k_of, rank1, fits, h_of, c1, G, jnp.int32(H)),
                scatter_to_buckets(k_of, rank1, fits, b.unique_row, c1, G, jnp.int32(g.local_rows)),
            ],
            axis=1,
        )  # [G, 2, C1]
        usable = b.slot_valid & (slot_rank < c1)
        slot_dest = jnp.where(usable, (b.slot_owner // H) * c1 + slot_rank, G * c1)
        # Stage 2, at the relay: the host's requests merged per owner host.
        recv = _to_local(send)  # [G requesters, 2, C1]
        hosts_of, rows_of = recv[:, 0].reshape(-1), recv[:, 1].reshape(-1)
        b2 = bucket(hosts_of, rows_of, hosts_of < H, H, g.local_rows)
        fits2 = b2.unique_valid & (b2.unique_rank < c2)
        send2 = scatter_to_buckets(b2.unique_owner, b2.unique_rank, fits2, b2.unique_row, c2, H, g.local_rows)
        usable2 = b2.slot_valid & (b2.slot_rank < c2)
        relay_dest = jnp.where(usable2, b2.slot_owner * c2 + b2.slot_rank, H * c2)
        most = lax.pmax(jnp.stack([jnp.max(b.counts.reshape(G, H).sum(1)), jnp.max(b2.counts)]), (HOSTS, LOCAL))
        over = (most[0] > c1) | (most[1] > c2)
        owner_rows = _to_hosts(send2).reshape(-1)  # [H relays * C2] at the owner
        return TwoLevelRoute(slot_dest, relay_dest, owner_rows, over[None], most)

    # ------------------------------------------------------------ forward
    def _two_level_lookup(self, table_local, r: TwoLevelRoute):
        g, H, G = self.group, self.hosts, self.host_devices
        vectors = table_local.at[r.owner_rows].get(mode="fill", fill_value=0).reshape(H, self.c2, g.width)
        at_relay = self.wire.send(vectors, _to_hosts).reshape(H * self.c2, g.width)
        answers = jnp.concatenate([at_relay, jnp.zeros((1, g.width), at_relay.dtype)])[r.relay_dest]
        back = self.wire.send(answers.reshape(G, self.c1, g.width), _to_local).reshape(G * self.c1, g.width)
        return jnp.concatenate([back, jnp.zeros((1, g.width), back.dtype)])[r.slot_dest]  # [n, W]

    def _forward(self, table, ids_bs):
        """-> (vectors [B, V, W], overflowed [] bool, residual)."""
        g = self.group
        r = self._route(ids_bs)
        lookup = jax.shard_map(
            lambda t, rr: self._two_level_lookup(t, rr).reshape(-1, g.num_vslots, g.width),
            mesh=self.host_mesh,
            in_specs=(_BATCH, _BATCH),
            out_specs=_BATCH,
        )
        flat = sharded_forward(g, self.mesh, self.capacity, self.wire)
        over = r.over[0]
        vectors = if_overflow(over, lambda: flat(table, ids_bs)[0], lambda: lookup(table, r))
        return vectors, over, (r, ids_bs)

    # ------------------------------------------------------------ backward + update
    def _two_level_update(self, table_local, slots_local, r: TwoLevelRoute, grads_local, lr):
        g, H, G, opt = self.group, self.hosts, self.host_devices, self.optimizer
        grads, weights = grads_local  # the pooled outputs' gradients, the slots' weights
        lookups = Lookups.of_bags(r.slot_dest.reshape(weights.shape), g.vslot_vfeature, grads.shape[1], weights)
        sums1 = opt.row_sums(lookups, grads.reshape(-1, g.width), G * self.c1).reshape(G, self.c1, g.width)
        at_relay = self.wire.send(sums1, _to_local).reshape(G * self.c1, g.width)
        sums2 = opt.row_sums(r.relay_dest, at_relay, H * self.c2).reshape(H, self.c2, g.width)
        at_owner = self.wire.send(sums2, _to_hosts).reshape(H * self.c2, g.width)
        return opt.update(table_local, slots_local, r.owner_rows, at_owner, lr)

    def _update(self, table, slots, residual, grads, lr):
        r, ids_bs = residual
        update = jax.shard_map(
            self._two_level_update,
            mesh=self.host_mesh,
            in_specs=(_BATCH, _BATCH, _BATCH, _BATCH, P()),
            out_specs=(_BATCH, _BATCH),
            check_vma=checks_varying(self.optimizer),
        )
        flat = sharded_update(self.group, self.mesh, self.capacity, self.wire, self.optimizer, self.dim)
        return if_overflow(
            r.over[0],
            lambda: flat(table, slots, self._flat_route(ids_bs), grads, lr),
            lambda: update(table, slots, r, grads, lr),
        )
