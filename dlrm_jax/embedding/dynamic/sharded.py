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
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from dlrm_jax.embedding.dynamic.idmap import STATS, IdMap, MapSpec, Resolved, resolve, shard_of
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
    (``idmap.resolve``). One table of :func:`sharded_resolve_many`."""
    return sharded_resolve_many([spec], mesh, [m], [(hi, lo, valid)], step, learn)[0]


def sharded_resolve_many(
    specs: list[MapSpec], mesh: jax.sharding.Mesh, maps: list[IdMap], ids: list[tuple], step, learn: bool = True
) -> list[Resolved]:
    """:func:`sharded_resolve` of several tables in one program: their ids gathered in one
    all-gather and their rows met in one max. Each device resolves only the gathered ids of
    its own shards, moved to the front of a buffer of ``own_capacity`` (so its sort and its
    placement work on about B/n ids, not B); a batch with more ids of one device's shards than
    that (one id repeated throughout, say) resolves all B there instead, with the same result."""
    n = map_devices(mesh)
    for spec in specs:
        check_split(spec, n)
    sizes = [hi.size // n for hi, _, _ in ids]  # each table's ids per device

    def local(maps, his, los, valids, step):
        me = lax.axis_index(AXIS)
        flat = lambda xs: jnp.concatenate([x.reshape(-1) for x in xs])
        every = [lax.all_gather(flat(xs), AXIS, tiled=True) for xs in (his, los, valids)]
        out, rows, at = [], [], 0
        for spec, m, size in zip(specs, maps, sizes, strict=True):
            per = spec.vshards // n
            ghi, glo, gval = (x.reshape(n, -1)[:, at : at + size].reshape(-1) for x in every)
            got = _resolve_own(spec, m, ghi, glo, gval, step, me * per, learn, n)
            out.append(got)
            rows.append(jnp.where(got.rows >= 0, got.rows + me * per * spec.slots, -1).reshape(n, size))
            at += size
        met = lax.pmax(jnp.concatenate(rows, axis=1), AXIS)[me]  # [sum of sizes]: this device's ids
        mine = [met[a : a + size] for a, size in zip(np.cumsum([0, *sizes[:-1]]), sizes, strict=True)]
        # one collective for every table's counts (a psum each would be 6 per table)
        summed = lax.psum(jnp.stack([jnp.stack([o.stats[k] for k in STATS]) for o in out]), AXIS)
        stats = [dict(zip(STATS, summed[j], strict=True)) for j in range(len(out))]
        return mine, [o.map for o in out], [o.fresh for o in out], stats

    map_spec = IdMap(*(P(AXIS),) * 6)
    k = len(specs)
    mine, new_maps, fresh, stats = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=([map_spec] * k, [P(AXIS)] * k, [P(AXIS)] * k, [P(AXIS)] * k, P()),
        out_specs=([P(AXIS)] * k, [map_spec] * k, [P(AXIS)] * k, [P()] * k),
    )(list(maps), *([x[j] for x in ids] for j in range(3)), step)
    return [
        Resolved(r.reshape(hi.shape), m, f, st)
        for r, m, f, st, (hi, _, _) in zip(mine, new_maps, fresh, stats, ids, strict=True)
    ]


def own_capacity(total: int, devices: int) -> int:
    """Ids of one device's shards a resolution holds at most before resolving the whole gathered
    batch there: twice a fair share and some (hashing spreads ids evenly; a repeated id does not)."""
    return total if devices == 1 else min(total, 2 * -(-total // devices) + 64)


def _resolve_own(spec: MapSpec, m: IdMap, hi, lo, valid, step, first_shard, learn: bool, devices: int) -> Resolved:
    """``idmap.resolve`` of the ids of this device's shards among the gathered ``hi``/``lo``/
    ``valid`` [N]: compacted to :func:`own_capacity` when they fit (the result does not depend
    on where in the batch an id stands), else over all N."""
    total, cap = hi.shape[0], own_capacity(hi.shape[0], devices)
    if cap == total:
        return resolve(spec, m, hi, lo, valid, step, first_shard, learn)
    shards = m.used.shape[0] // spec.slots
    local = shard_of(spec, hi, lo) - first_shard
    own = valid & (local >= 0) & (local < shards)
    at = jnp.where(own, jnp.cumsum(own, dtype=jnp.int32) - 1, cap)

    def compacted():
        put = lambda x, fill: jnp.full(cap, fill, x.dtype).at[at].set(x, mode="drop")
        out = resolve(spec, m, put(hi, 0), put(lo, 0), put(own, False), step, first_shard, learn)
        return out._replace(rows=jnp.where(own, out.rows[jnp.minimum(at, cap - 1)], -1))

    return lax.cond(jnp.sum(own) <= cap, compacted, lambda: resolve(spec, m, hi, lo, valid, step, first_shard, learn))


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
