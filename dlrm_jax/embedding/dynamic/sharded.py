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


def map_bytes_per_device(spec: MapSpec, devices: int) -> int:
    """One device's bytes of a map split over ``devices``: its rows' keys, flags, recency and
    counts, and its shards' admission sketches."""
    return (spec.rows * spec.bytes_per_row() + spec.sketch_bytes()) // devices


def gathered_bytes_per_device(ids_per_step: int) -> int:
    """Bytes a device receives a step gathering the batch's raw ids of a table (``ids_per_step``
    over the whole batch: high and low words and the padding flag), and the rows' max back."""
    return ids_per_step * (4 + 4 + 1 + 4)


def maps_report(specs: dict[str, MapSpec], bags: dict[str, int], devices: int, batch: int) -> str:
    """The plan report's line on dynamic tables: their maps' memory and the raw ids' traffic."""
    memory = sum(map_bytes_per_device(s, devices) for s in specs.values())
    wire = sum(gathered_bytes_per_device(batch * bags[name]) for name in specs)
    per_row = {s.bytes_per_row() for s in specs.values()}
    return (
        f"Dynamic tables ({', '.join(specs)}): id maps {memory / 2**20:,.2f} MiB a device "
        f"({'/'.join(map(str, sorted(per_row)))} B a row, sketches apart; counted in embedding.memory_budget_gb), "
        f"raw ids gathered {wire / 2**10:,.1f} KiB a step per device"
    )
