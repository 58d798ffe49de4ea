"""The id map sharded with its table: each device holds whole virtual shards (a block of the
map's rows), and one batch's raw ids are resolved to rows inside one program.

Each device sends its ids of every dynamic table to their owners (an id's owner holds its
shard, chosen by a hash of it) in one all-to-all; each owner resolves what it received in one
pass (``resolve.resolve_fused`` with its first shards) and sends the rows back in another (or
keeps them, where only the lookups that reuse the route read them: ``rows_later``), so a
device's work and traffic follow its own ids. Where that saves nothing (one or two devices) or
some device has more distinct ids of one owner than the largest buffer holds, every device
gathers the whole batch's ids instead, resolves those of its own shards, and the
rows meet in a max (an id has one owner; every other device says -1). The map on n devices is
the one-device map cut in n blocks, step by step (idmap's layout), so a run's ids reach the
same rows on any device count, by either path.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from dlrm_jax.embedding.dynamic.distinct import distinct_ids
from dlrm_jax.embedding.dynamic.idmap import STATS, IdMap, MapSpec, Resolved, id_hash, on_platform
from dlrm_jax.embedding.dynamic.map_writes import write_map
from dlrm_jax.embedding.dynamic.resolve import Maps, resolve_fused
from dlrm_jax.embedding.dynamic.sizing import own_capacity, route_capacities
from dlrm_jax.embedding.dynamic.table_passes import resolve_in_passes, table_passes
from dlrm_jax.few_segments import few_segment_sum
from dlrm_jax.parallel.mesh import AXIS, varying
from dlrm_jax.sorting import first_places, sort_with_order


def map_devices(mesh: jax.sharding.Mesh) -> int:
    """The devices a table's map is split over: every device of the mesh's (data, model) axes."""
    return mesh.shape[AXIS[0]] * mesh.shape[AXIS[1]]


def check_split(spec: MapSpec, devices: int) -> None:
    """Each device holds whole shards: ``spec.vshards`` must be a multiple of the devices."""
    if spec.vshards % devices:
        # (shard counts are powers of two: a device count that is not one cannot hold whole shards)
        other = "" if devices & (devices - 1) == 0 else "; dynamic tables need a power-of-two device count"
        raise ValueError(
            f"a map of {spec.vshards} shards cannot be split over {devices} devices in whole shards{other}"
        )


class FreshRows(NamedTuple):
    """The rows a batch gave to new ids, [devices * N] sharded over the devices (each device's
    N entries are its own rows, first, then padding): each entry's table-local row on its
    device (-1: padding), its table (index into the specs) and its id's high and low words."""

    rows: jax.Array
    table: jax.Array
    hi: jax.Array
    lo: jax.Array
    # tiered tables with new_rows=shared: where the host placed each entry's shard's shared
    # row this step: its cache slot on the entry's device (>= 0) or -2 - its hot slot
    shared: jax.Array | None = None


class Route(NamedTuple):
    """How a routed resolution sent each device's distinct ids to their owners, for the
    exchange of the tables' rows to send the same requests again without sorting or sending
    them (``exchange.sharded``'s forward). Per device, sharded over the devices (N: a device's
    ids; S: the largest routing buffer), except the first two, alike on every device:

    used: bool [] the step took a routed path (gathered: the other fields mean nothing);
    busiest: int32 [] the most distinct ids one device sent one owner;
    owner, rank: int32 [N] each distinct id's owner (the devices' count: padding) and its
    place among this device's ids for that owner; index: int32 [N] each id's distinct number
    (N: padding); received: int32 [devices * S] at this owner, the row in its group's local
    array (``offsets``) of each id each device sent it, at its sender's place (-1: none)."""

    used: jax.Array
    busiest: jax.Array
    owner: jax.Array
    rank: jax.Array
    index: jax.Array
    received: jax.Array


def sharded_resolve(
    spec: MapSpec, mesh: jax.sharding.Mesh, m: IdMap, hi, lo, valid, step, learn: bool = True
) -> Resolved:
    """The batch's ids ``hi``/``lo``/``valid`` ([B, ...], sharded over the batch axis) through the
    map ``m`` (its arrays sharded over the devices by rows, the sketch by shards) at ``step``:
    rows [B, ...] sharded like the ids, the map after the batch, the fresh rows sharded like
    the map's, and the counts summed over the devices. ``learn=False``: the map read only
    (``resolve.resolve``). One table of :func:`sharded_resolve_many`."""
    return sharded_resolve_many([spec], mesh, [m], [(hi, lo, valid)], step, learn)[0]


def sharded_resolve_many(
    specs: list[MapSpec], mesh: jax.sharding.Mesh, maps: list[IdMap], ids: list[tuple], step, learn: bool = True
) -> list[Resolved]:
    """:func:`sharded_resolve` of several tables in one program (:func:`sharded_resolve_fused`),
    each table's fresh rows as a mask of its rows."""
    n = map_devices(mesh)
    for spec in specs:
        check_split(spec, n)
    rows, fused, fresh, stats, *_ = sharded_resolve_fused(specs, mesh, fuse_maps(specs, n, maps), ids, step, learn)
    new_maps = split_maps(specs, n, fused)

    def masks(rows, table):
        out = []
        for t, spec in enumerate(specs):
            local = spec.rows // n
            out.append(
                jnp.zeros(local, bool).at[jnp.where((table == t) & (rows >= 0), rows, local)].set(True, mode="drop")
            )
        return out

    fresh_masks = jax.shard_map(masks, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=[P(AXIS)] * len(specs))(
        fresh.rows, fresh.table
    )
    return [
        Resolved(r, m, f, dict(zip(STATS, st, strict=True)))
        for r, m, f, st in zip(rows, new_maps, fresh_masks, stats, strict=True)
    ]


def fuse_maps(specs: list[MapSpec], devices: int, maps: list[IdMap], xp=jnp) -> IdMap:
    """The tables' maps (each whole, as :func:`~dlrm_jax.embedding.dynamic.idmap.init_map`
    makes it) as one, device by device: device d's block holds every table's rows and sketch
    of device d end to end (``resolve.Maps`` of its shards), so the fused arrays split over the
    devices give each device its own. The layout depends on ``devices``: checkpoints and
    exports hold the tables' maps (:func:`split_maps`). Traceable; ``xp=numpy``: on the host."""
    per_device = lambda x: xp.asarray(x).reshape(devices, -1)
    joined = lambda xs: xp.concatenate([per_device(x) for x in xs], axis=1).reshape(-1)
    return IdMap(*(joined([getattr(m, f) for m in maps]) for f in IdMap._fields))


def split_maps(specs: list[MapSpec], devices: int, m: IdMap) -> list[IdMap]:
    """The inverse of :func:`fuse_maps`."""
    layout = Maps(tuple(specs), tuple(s.vshards // devices for s in specs))
    rows = np.concatenate([[0], np.cumsum(layout.row_sizes)])
    sketch = np.concatenate([layout.sketch_starts, [m.sketch.size // devices]])
    cut = lambda x, edges, t: x.reshape(devices, -1)[:, edges[t] : edges[t + 1]].reshape(-1)
    return [
        IdMap(
            *(cut(getattr(m, f), rows, t) for f in IdMap._fields[:5]),
            cut(m.sketch, sketch, t).reshape(s.vshards, *layout.sketch_dims[t]),
        )
        for t, s in enumerate(specs)
    ]


def side_by_side(ids: list[tuple]) -> tuple[tuple, tuple[int, ...]]:
    """Per-table (hi, lo, valid) [B, ...] as every table's side by side ((hi, lo, valid) [B,
    sum(bags)]) and each table's columns (``bags``)."""
    b = ids[0][0].shape[0]
    bags = tuple(x[0].size // b for x in ids)
    return tuple(jnp.concatenate([x[j].reshape(b, -1) for x in ids], axis=1) for j in range(3)), bags


def resolution_chunk(platform: str, own_ids: int) -> int:
    """How many ids' per-probe arrays a device's resolution holds at once (``resolve_fused``'s
    ``chunk``; 0: all), for ``own_ids`` a device's share of the batch. On CPUs half of them:
    larger ones (a skewed batch's buffers, the gathered batch) run in passes, so the scratch
    follows a device's share of the batch, not the global batch (on 8 simulated devices at
    8,192 it stays under glibc's 32 MiB mmap cutoff: XLA:CPU's scratch is then reused, where
    93 MiB was mapped afresh each step, 42,600 page faults). Not on GPUs, which keep their
    scratch and pay for each kernel launched: in passes, a loop restacked the passes' results
    and every placement round computed the ids' candidates again. Compiled for one H100 at
    criteo_kaggle's batch of 65,536 (``scripts/gpu_compile.py``), the lookups and placement
    took 28 kernels and 0.51 GB once and 30 kernels and 0.76 GB a round in passes, against 5
    kernels and 0.87 GB once and 15 kernels and 0.51 GB a round all at once (the same bytes
    at 1.5 rounds a step, half the kernels at any; its scratch 541 -> 610 MB)."""
    return max(own_ids // 2, 1) if platform == "cpu" else 0


def sharded_resolve_fused(
    specs: list[MapSpec],
    mesh: jax.sharding.Mesh,
    maps: IdMap,
    ids: list[tuple] | tuple,
    step,
    learn: bool = True,
    bags: tuple[int, ...] | None = None,
    offsets: tuple[int, ...] | None = None,
    rows_later: bool = False,
) -> tuple[list | jax.Array, IdMap, FreshRows, jax.Array, jax.Array, Route | None]:
    """Several tables' batches of ids (``ids``: per table (hi, lo, valid) [B, ...], sharded over
    the batch axis) through their maps (``maps``: fused, :func:`fuse_maps`, sharded over the
    devices) in one program and one pass (``resolve.resolve_fused``): routed, each device's
    distinct ids to their owners and the rows back (in the least of :func:`~dlrm_jax.embedding.dynamic.sizing.route_capacities`
    holding every device's for one owner); otherwise gathered, every table's ids in one all-gather, resolved by each device
    for its own shards and the rows met in one max. Gathered, each device resolves only its own
    shards' ids, moved to the front of a buffer of :func:`~dlrm_jax.embedding.dynamic.sizing.own_capacity` (so its sort and its
    placement work on about B/n ids, not B); a batch with more ids of one device's shards than
    that resolves them a few tables at a time (``table_passes``: its scratch stays that of a
    buffer, whatever the ids). Every path gives the same result. Returns (rows
    per table, shaped and sharded like its ids; the fused maps after the batch; the fresh
    rows; the counts, int32 [tables, len(STATS)] summed over the devices; the path taken,
    int32, an index into :func:`~dlrm_jax.embedding.dynamic.sizing.resolution_paths`; with ``offsets`` (each table's first row in
    the local array its rows live in on every device), the :class:`Route`, else None).
    ``rows_later`` (with ``offsets``): a routed path does not send the rows back (a collective
    fewer, where the lookups reuse the route: only their owners need them); its rows are
    then 0 for each id and -1 for padding, and ``exchange.routing.ids_as_routed`` gives them.

    With ``bags`` (each table's columns), ``ids`` is every table's side by side, (hi, lo, valid)
    [B, sum(bags)], and so are the rows: one array each, not one per table (each operation on
    a table's own array runs once a device on simulated devices: 26 tables' slices and writes
    were a hundred small operations a step)."""
    if bags is None:
        side, bags = side_by_side(ids)
        rows, *rest = sharded_resolve_fused(specs, mesh, maps, side, step, learn, bags, offsets, rows_later)
        edges = np.cumsum([0, *bags])
        return [rows[:, edges[t] : edges[t + 1]].reshape(x[0].shape) for t, x in enumerate(ids)], *rest
    n = map_devices(mesh)
    for spec in specs:
        check_split(spec, n)
    platform = mesh.devices.flat[0].platform
    specs = on_platform(specs, platform)  # (its form only: one form traced, not each platform's)
    layout = Maps(tuple(specs), tuple(s.vshards // n for s in specs))
    # each id's table, a device's ids taken row by row (the resolution's work does not depend
    # on the ids' order: distinct ids are found by sorting)
    per_device = np.tile(np.repeat(np.arange(len(specs), dtype=np.int32), bags), ids[0].shape[0] // n)
    total = n * per_device.size
    cap = own_capacity(total, n)
    passes = table_passes(bags, ids[0].shape[0], cap)  # (the gathered batch: every row of every device)
    per_shards = np.array([s.vshards // n for s in specs], np.int32)
    vshards = np.array([s.vshards for s in specs], np.uint32)
    slots = np.array([s.slots for s in specs], np.int32)
    sends = route_capacities(per_device.size, n)
    most_sent = max(sends, default=0)
    later = rows_later and offsets is not None

    # (the gathered path's route: nothing a lookup may use)
    def unrouted():
        sizes = () if offsets is None else (per_device.size, n * most_sent)
        return tuple(varying(jnp.zeros(k, jnp.int32)) for k in sizes)

    # Every path's writes and fresh rows in one size (a switch's branches return alike): its
    # largest batch of ids, but no more than the map's rows here (a batch writes each row once:
    # a path with more entries moves those that write to the front, ``MapWrites.fitted``).
    rows_here = int(np.sum(layout.row_sizes))
    size = min(max([n * s for s in sends] + [cap]), rows_here)
    chunk = resolution_chunk(platform, per_device.size)

    def fit(x, fill):  # the fresh rows come first: past the map's rows, only padding
        x = x[:size] if x.shape[0] >= size else jnp.concatenate([x, jnp.full(size - x.shape[0], fill, x.dtype)])
        return varying(x)  # (alike in every path's branch)

    def resolved(fused, table, hi, lo, valid, step, counts=None, prefixes=True):
        """This device's shards' ids among these resolved, the map's rows left unwritten: their
        writes and fresh rows come back in ``size`` entries (every path's alike) and ``local``
        makes them after the switch among the paths (a map written inside it was copied whole)."""
        first = lax.axis_index(AXIS) * jnp.asarray(per_shards)
        none = jnp.zeros(0, jnp.int32)  # (what the batch wrote: only a host map keeps it)
        out = resolve_fused(
            layout, fused, table, hi, lo, valid, step, first, learn, counts, False, chunk, prefixes=prefixes
        )
        return out._replace(
            touched=none,
            sketch_touched=none,
            writes=jax.tree.map(varying, out.writes.fitted(size, rows_here)),
            fresh_rows=fit(out.fresh_rows, -1),
            fresh_table=fit(out.fresh_table, 0),
            fresh_hi=fit(out.fresh_hi, 0),
            fresh_lo=fit(out.fresh_lo, 0),
        )

    def owner_of(table, hi, lo):  # each id's device: the one holding its shard
        shard = id_hash(hi, lo) % jnp.asarray(vshards)[table]
        return shard.astype(jnp.int32) // jnp.asarray(per_shards)[table]

    def gathered(fused, his, los, valids, step):
        """Every device's ids gathered by every device, each resolving its own shards' ids."""
        me = lax.axis_index(AXIS)
        # one all-gather of the ids' words and flags (each collective is a meeting of every device)
        words = jnp.stack([his.view(jnp.int32), los.view(jnp.int32), valids.astype(jnp.int32)])
        every = lax.all_gather(words, AXIS, axis=1, tiled=True)
        hi, lo, valid = every[0].view(jnp.uint32), every[1].view(jnp.uint32), every[2] > 0
        table = jnp.asarray(np.tile(per_device, n))
        first = me * jnp.asarray(per_shards)
        own = valid & (owner_of(table, hi, lo) == me)
        # Where routed paths exist this one is their fallback (a skewed batch): compiled for
        # its whole buffer only (``resolve_fused``'s prefixes: each a copy of the maps' work).
        run = lambda *a: resolved(fused, *a, step, prefixes=not sends)
        at = jnp.where(own, jnp.cumsum(own, dtype=jnp.int32) - 1, cap)

        def compacted():  # this device's ids to the front: where each place's id is, in one scatter
            src = jnp.full(cap, total, jnp.int32).at[at].set(lax.iota(jnp.int32, total), mode="drop")
            pick = lambda x: x[jnp.minimum(src, total - 1)]
            out = run(pick(table), pick(hi), pick(lo), src < total)
            return out._replace(rows=jnp.where(own, out.rows[jnp.minimum(at, cap - 1)], -1))

        def in_passes():  # more: a few tables' ids at a time (table_passes)
            args = (table, hi, lo, own, step, first, learn, size, chunk)
            return resolve_in_passes(layout, fused, passes, sum(bags), *args)

        if cap == total:  # (one or two devices: the buffer would hold the whole batch)
            out = run(table, hi, lo, valid)
        else:
            out = lax.cond(jnp.sum(own) <= cap, compacted, in_passes)
        shift = first[table] * jnp.asarray(slots)[table]  # table-local rows here -> the table's rows
        rows = jnp.where(out.rows >= 0, out.rows + shift, -1).reshape(n, -1)
        # The rows meet in a max, and the counts with them: each device's in a row of its own
        # (-1 elsewhere; counts are not negative), summed after (one collective, not two).
        counts = jnp.full((n, out.stats.size), -1, jnp.int32).at[me].set(out.stats.reshape(-1))
        met = lax.pmax(jnp.concatenate([rows, counts], axis=1), AXIS)
        fresh = (out.fresh_rows, out.fresh_table, out.fresh_hi, out.fresh_lo)
        return (
            met[me, : rows.shape[1]],
            (out.map.sketch, out.writes),
            fresh,
            jnp.sum(met[:, rows.shape[1] :], axis=0).reshape(out.stats.shape),
            unrouted(),
        )

    def routed(sent, fused, distinct, step):
        """Each device's distinct ids (``distinct``: ``distinct.distinct_ids`` of its own, with
        their owners) sent to their owners with their counts in one all-to-all (at most
        ``sent`` to each owner), resolved there, and their rows sent back in another (unless
        ``rows_later``): a device's work and traffic follow its own ids, not the batch's."""
        index, uhi, ulo, utab, occurrences, owner = distinct
        # This path runs where no device has more than ``sent`` distinct ids for one owner, so
        # none has more than n * sent in all, and they are numbered first: its sort, buffers
        # and rows work on those places, not on every id's (at stream's shape, 13,824 of 26,624).
        k = owner.shape[0]
        held = min(k, n * sent)
        uhi, ulo, utab, occurrences, owner = (x[:held] for x in (uhi, ulo, utab, occurrences, owner))
        me = lax.axis_index(AXIS)
        owner_of_id = owner
        owner, order = sort_with_order(owner, n + 1)  # by owner, then position
        first_of = first_places(owner, n + 1)
        rank = jnp.arange(owner.shape[0], dtype=jnp.int32) - first_of[owner]
        unsorted = lambda x: jnp.zeros(owner.shape[0], jnp.int32).at[order].set(x)  # of each distinct id
        words = jnp.stack([utab, uhi.view(jnp.int32), ulo.view(jnp.int32), occurrences], 1)[order]
        send = jnp.zeros((n, sent, 4), jnp.int32).at[owner, rank].set(words, mode="drop")  # padding: owner n
        got = lax.all_to_all(send, AXIS, 0, 0, tiled=True).reshape(n * sent, 4)
        got_table, got_count = got[:, 0], got[:, 3]
        words = (got[:, 1].view(jnp.uint32), got[:, 2].view(jnp.uint32), got_count > 0)
        out = resolved(fused, got_table, *words, step, got_count)
        shift = (me * jnp.asarray(per_shards) * jnp.asarray(slots))[got_table]
        answers = jnp.where(out.rows >= 0, out.rows + shift, -1).reshape(n, sent)
        if later:  # (the lookups' owners know the rows: ``received``)
            rows = jnp.where(owner_of_id < n, 0, -1)
        else:
            back = lax.all_to_all(answers, AXIS, 0, 0, tiled=True)  # this device's rows, by owner
            rows = unsorted(jnp.where(owner < n, back[jnp.minimum(owner, n - 1), jnp.minimum(rank, sent - 1)], -1))
        fresh = (out.fresh_rows, out.fresh_table, out.fresh_hi, out.fresh_lo)
        changed = (out.map.sketch, out.writes)
        route = ()
        if offsets is not None:  # each id's rank, and what this owner received, as local rows
            offset = jnp.asarray(offsets, jnp.int32)
            received = jnp.where(out.rows >= 0, offset[got_table] + out.rows, -1)
            received = jnp.full((n, most_sent), -1, jnp.int32).at[:, :sent].set(received.reshape(n, sent))
            pad = lambda x: jnp.concatenate([x, jnp.zeros(k - held, x.dtype)])  # (every path's alike)
            route = (pad(unsorted(rank)), received.reshape(-1))
        return rows[jnp.minimum(index, held - 1)], changed, fresh, lax.psum(out.stats, AXIS), route

    def local(fused, hi, lo, valid, step):
        shape = hi.shape
        hi, lo, valid = hi.reshape(-1), lo.reshape(-1), valid.reshape(-1)
        route = None
        if not sends:
            rows, changed, fresh, stats, _ = gathered(fused, hi, lo, valid, step)
            path = jnp.int32(0)
        else:  # routed, in the least buffer every device's ids fit, else gathered
            table = jnp.asarray(per_device)
            index, uhi, ulo, utab, occurrences, real = distinct_ids(
                hi, lo, valid, table, form=layout.control_flow, tables=len(layout.specs)
            )
            owner = jnp.where(real, owner_of(utab, uhi, ulo), n)
            most = lax.pmax(jnp.max(few_segment_sum(real.astype(jnp.int32), owner, n)), AXIS)
            distinct = (index, uhi, ulo, utab, occurrences, owner)
            branches = [lambda d, k=k: routed(k, fused, d, step) for k in sends]
            branches.append(lambda d: gathered(fused, hi, lo, valid, step))
            path = jnp.searchsorted(jnp.asarray(sends), most, method="compare_all").astype(
                jnp.int32
            )  # alike everywhere
            rows, changed, fresh, stats, routed_as = lax.switch(path, branches, distinct)
            rows = jnp.where(valid, rows, -1)
            if offsets is not None:
                rank, received = routed_as
                route = Route(path < len(sends), most, owner, rank, index, received)
        sketch, writes = changed
        new_map = write_map(fused._replace(sketch=sketch), writes, step, layout.control_flow) if learn else fused
        return rows.reshape(shape), new_map, fresh, stats, path, route

    map_spec = IdMap(*(P(AXIS),) * 6)
    routing = offsets is not None and bool(sends)
    rows, new_map, fresh, stats, path, route = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(map_spec, P(AXIS), P(AXIS), P(AXIS), P()),
        out_specs=(P(AXIS), map_spec, (P(AXIS),) * 4, P(), P(), Route(P(), P(), *(P(AXIS),) * 4) if routing else None),
    )(maps, *ids, step)
    return rows, new_map, FreshRows(*fresh), stats, path, route if routing else None
