"""The id map sharded with its table: each device holds whole virtual shards (a block of the
map's rows), and one batch's raw ids are resolved to rows inside one program.

Every device gathers the batch's ids, resolves those of its own shards (``idmap.resolve``
with its first shard) and the rows meet in a max over the devices (an id has one owner; every
other device says -1). The map on n devices is the one-device map cut in n blocks, step by
step (idmap's layout), so a run's ids reach the same rows on any device count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from dlrm_jax.embedding.dynamic.idmap import STATS, IdMap, MapSpec, Resolved, resolve
from dlrm_jax.parallel.mesh import AXIS


def map_devices(mesh: jax.sharding.Mesh) -> int:
    """The devices a table's map is split over: every device of the mesh's (data, model) axes."""
    return mesh.shape[AXIS[0]] * mesh.shape[AXIS[1]]


def check_split(spec: MapSpec, devices: int) -> None:
    """Each device holds whole shards: ``spec.vshards`` must be a multiple of the devices."""
    if spec.vshards % devices:
        raise ValueError(f"a map of {spec.vshards} shards cannot be split over {devices} devices in whole shards")


def sharded_resolve(
    spec: MapSpec, mesh: jax.sharding.Mesh, m: IdMap, hi, lo, valid, step, learn: bool = True
) -> Resolved:
    """The batch's ids ``hi``/``lo``/``valid`` ([B, ...], sharded over the batch axis) through the
    map ``m`` (its arrays sharded over the devices by rows, the sketch by shards) at ``step``:
    rows [B, ...] sharded like the ids, the map after the batch, the fresh rows sharded like
    the map's, and the counts summed over the devices. ``learn=False``: the map read only
    (``idmap.resolve``)."""
    n = map_devices(mesh)
    check_split(spec, n)
    per = spec.vshards // n

    def local(m, hi, lo, valid, step):
        me = lax.axis_index(AXIS)
        every = [lax.all_gather(x.reshape(-1), AXIS, tiled=True) for x in (hi, lo, valid)]
        out = resolve(spec, m, *every, step, me * per, learn)
        rows = lax.pmax(jnp.where(out.rows >= 0, out.rows + me * per * spec.slots, -1), AXIS)
        mine = lax.dynamic_slice_in_dim(rows, me * hi.size, hi.size).reshape(hi.shape)
        return mine, out.map, out.fresh, {k: lax.psum(out.stats[k], AXIS) for k in STATS}

    specs = IdMap(*(P(AXIS),) * 6)
    rows, new_map, fresh, stats = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(specs, P(AXIS), P(AXIS), P(AXIS), P()),
        out_specs=(P(AXIS), specs, P(AXIS), P()),
    )(m, hi, lo, valid, step)
    return Resolved(rows, new_map, fresh, stats)
