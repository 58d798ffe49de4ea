"""The id map sharded with its table (embedding/dynamic/sharded.py) equals one map on one
device, batch by batch, on 1, 2, 4 and 8 devices: rows, fresh rows, every array of the map and
the counts, through evictions and admissions."""

import collections
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlrm_jax.embedding.dynamic.idmap import STATS, IdMap, MapSpec, init_map, shard_of, split_ids
from dlrm_jax.embedding.dynamic.resolve import resolve
from dlrm_jax.embedding.dynamic.sharded import (
    fuse_maps,
    sharded_resolve,
    sharded_resolve_fused,
    sharded_resolve_many,
    split_maps,
)
from dlrm_jax.embedding.dynamic.sizing import (
    own_capacity,
    resolution_bytes_per_device,
    resolution_paths,
    route_capacities,
)
from dlrm_jax.embedding.dynamic.table_passes import pass_places, table_passes
from dlrm_jax.parallel.mesh import AXIS, make_mesh

SPEC = MapSpec(rows=8 * 6, vshards=8, probes=3, policy="lfu", half_life=2, admit=2, sketch_depth=2, sketch_width=8)


def stream(steps: int, batch: int, bag: int, seed: int = 0):
    """Batches of 64-bit ids, from a population drifting past the map's rows (new ids born,
    old ones fading), with padding."""
    rng = np.random.default_rng(seed)
    for step in range(steps):
        born = np.arange(step * 7, step * 7 + 60, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        ids = born[np.minimum(rng.zipf(1.3, size=(batch, bag)) - 1, len(born) - 1)]
        yield ids, rng.random((batch, bag)) > 0.1


@pytest.mark.slow  # 3-6 s each on 2 cores
@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_the_sharded_map_equals_one_map_step_by_step(devices):
    mesh = make_mesh(devices)
    on = lambda spec: NamedSharding(mesh, spec)
    sharded = jax.jit(functools.partial(sharded_resolve, SPEC, mesh))
    one = jax.jit(functools.partial(resolve, SPEC))
    m_sharded = jax.device_put(init_map(SPEC), IdMap(*(on(P(AXIS)),) * 6))
    m_one = init_map(SPEC)
    seen = dict.fromkeys(STATS, 0)
    for step, (ids, valid) in enumerate(stream(12, 16, 3)):
        hi, lo = split_ids(ids)
        got = sharded(m_sharded, *(jax.device_put(x, on(P(AXIS))) for x in (hi, lo, valid)), step)
        want = one(
            m_one, jnp.asarray(hi.reshape(-1)), jnp.asarray(lo.reshape(-1)), jnp.asarray(valid.reshape(-1)), step
        )
        m_sharded, m_one = got.map, want.map
        np.testing.assert_array_equal(np.asarray(got.rows).reshape(-1), np.asarray(want.rows), err_msg=f"step {step}")
        np.testing.assert_array_equal(np.asarray(got.fresh), np.asarray(want.fresh))
        for a, b in zip(got.map, want.map, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert {k: int(got.stats[k]) for k in STATS} == {k: int(want.stats[k]) for k in STATS}
        seen = {k: seen[k] + int(want.stats[k]) for k in STATS}
    assert seen["evicted"] and seen["admitted"] and seen["held_back"] and seen["found"]  # all of it happened


def test_a_map_that_does_not_split_in_whole_shards_is_refused():
    with pytest.raises(ValueError, match="6 shards cannot be split over 4 devices"):
        sharded_resolve(MapSpec(rows=12, vshards=6), make_mesh(4), None, None, None, None, 0)


PATHS = {  # each batch's path: a buffer of the routed one, or the gathered one (see the test)
    "spread": "routed in 96",
    "one id throughout": "routed in 96",
    "100 ids of device 0 on one owner": "routed in 192",
    "256 ids of device 0 on one owner": "gathered, compacted",
    "every id on one owner": "gathered, in passes of tables",
}


@pytest.mark.parametrize("skew", list(PATHS))
def test_each_device_resolves_its_own_ids_routed_compacted_or_all_of_them(skew):
    """Several tables in one resolution (sharded_resolve_many) on 8 devices, every path equal to
    one map on one device. Each device has 2 x 256 ids; it sends its distinct ids to their
    owners in the least buffer (96 or 192 places an owner) that holds every device's for
    one owner, so a repeated id costs one place. A device with more distinct ids for one
    owner than 192 makes every device gather the batch instead, each resolving its own ids in
    a buffer of 1,088 (compacted), or a table's ids at a time where one device owns more (step 2
    ages the sketches: they must halve once, not once a pass)."""
    mesh, devices, batch = make_mesh(8), 8, 2048
    cap, sends = own_capacity(2 * batch, devices), route_capacities(2 * batch // devices, devices)
    assert cap == 1088 and sends == [96, 192]
    specs = [SPEC, MapSpec(rows=8 * 40, vshards=8, probes=4, policy="lru")]
    on = NamedSharding(mesh, P(AXIS))
    maps = [jax.device_put(init_map(s), IdMap(*(on,) * 6)) for s in specs]
    one_maps = [init_map(s) for s in specs]
    rng = np.random.default_rng(3)
    run = jax.jit(functools.partial(sharded_resolve_many, specs, mesh))
    one = jax.jit(resolve, static_argnums=0)  # (each case's program: the compile memo shares it)
    pool = np.arange(1, 200_000, dtype=np.uint64)
    on_owner_0 = pool[shard_of(SPEC, *split_ids(pool), np) == 0]  # both maps: a shard a device
    for step in range(3):
        ids = rng.integers(0, 2**63, (batch, 2), dtype=np.int64).astype(np.uint64) % np.uint64(5000)
        fresh = rng.permutation(on_owner_0)
        if skew == "one id throughout":
            ids[: batch * 7 // 8] = np.uint64(77)
        elif skew == "100 ids of device 0 on one owner":
            ids[:50] = fresh[:100].reshape(50, 2)
        elif skew == "256 ids of device 0 on one owner":
            ids[:128] = fresh[:256].reshape(-1, 2)
        elif skew == "every id on one owner":
            ids[:] = fresh[: 2 * batch].reshape(-1, 2)
        valid = rng.random((batch, 2)) > 0.05
        hi, lo = split_ids(ids)
        owner = np.where(valid, shard_of(SPEC, hi, lo, np), devices)
        pairs = {(i // (batch // devices), int(owner[i, t]), t, int(ids[i, t])) for i in range(batch) for t in range(2)}
        most = max(
            collections.Counter((d, o) for d, o, _, _ in pairs if o < devices).values()
        )  # distinct, one device, one owner
        own = np.bincount(owner.reshape(-1), minlength=devices + 1)[:devices].max()
        fits = [k for k in sends if most <= k]
        path = (
            f"routed in {fits[0]}" if fits else "gathered, compacted" if own <= cap else "gathered, in passes of tables"
        )
        assert path == PATHS[skew], (most, own)
        tables = [tuple(jax.device_put(x[:, t : t + 1], on) for x in (hi, lo, valid)) for t in range(2)]
        got = run(maps, tables, step)
        for t, (spec, out) in enumerate(zip(specs, got, strict=True)):
            want = one(spec, one_maps[t], *(jnp.asarray(x[:, t]) for x in (hi, lo, valid)), step)
            one_maps[t] = want.map
            np.testing.assert_array_equal(
                np.asarray(out.rows).reshape(-1), np.asarray(want.rows), err_msg=f"{t} {step}"
            )
            for a, b in zip(out.map, want.map, strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert {k: int(out.stats[k]) for k in STATS} == {k: int(want.stats[k]) for k in STATS}
        maps = [o.map for o in got]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.integers(1, 3), st.integers(1, 200))
def test_table_passes_hold_each_place_once_whole_tables_and_no_more_than_their_bound(bags, rows, bound):
    """A batch's places (``rows`` rows of every table's ``bags`` columns side by side) in passes:
    each place in one pass, each table's places all in one, in table order, and no pass
    longer than the bound or, where one table alone exceeds it, that table."""
    tables = np.tile(np.repeat(np.arange(len(bags)), bags), rows)
    n, width = tables.size, sum(bags)
    passes = table_passes(tuple(bags), rows, bound)
    size = int(passes[:, 1].max()) * rows
    places = [pass_places(first, columns, rows, width, size, np) for first, columns in passes]
    real = np.concatenate([p[p < n] for p in places])
    assert sorted(real.tolist()) == list(range(n))
    held = [tables[p[p < n]] for p in places]
    assert all(h.size for h in held)
    assert sum(len(set(h.tolist())) for h in held) == len(bags)  # no table split over two passes
    assert [min(h) for h in held] == sorted(min(h) for h in held)
    assert all(h.size <= max(bound, rows * max(bags)) for h in held)


def compiled_bytes_are_the_plans(hlo: str, ids: int, devices: int, rows_back: bool) -> None:
    """The plan's least and most bytes of the routed resolution of ``ids`` ids a step
    (``resolution_bytes_per_device``) and each path's bytes as training's events count them are
    what the compiled program ``hlo`` sends: its all-to-alls in its least and largest buffers
    (each buffer's pair compiled in a branch of its own; the gathered path has none), and the
    gathered path's all-gather."""
    from dlrm_jax.bench.common import hlo_collective_bytes

    sent = hlo_collective_bytes(hlo, devices)
    sends = route_capacities(ids // devices, devices)
    branch = lambda k: (devices - 1) * k * (16 + 4 * rows_back)
    assert len(sends) >= 2 and sent["all-to-all"] == sum(map(branch, sends))
    assert resolution_bytes_per_device(ids, devices, rows_back) == (branch(sends[0]), branch(sends[-1]))
    paths = resolution_paths(ids, devices, rows_back)  # the routed buffers, then the gathered fallback
    assert [p["all-to-all"] for p in paths[:-1]] == [branch(k) for k in sends]
    assert paths[-1]["all-gather"] == sent["all-gather"]


def test_the_plans_resolution_bytes_are_the_compiled_programs_without_rows_back():
    """``compiled_bytes_are_the_plans`` where the rows stay on their owners (``rows_later``, for
    lookups that reuse the route); with the rows sent back, in the next test's program."""
    mesh, devices, batch, bags = make_mesh(8), 8, 1024, (1, 3)
    specs = [SPEC, MapSpec(rows=8 * 40, vshards=8, probes=4, policy="lru")]
    on = NamedSharding(mesh, P(AXIS))
    fused = jax.device_put(fuse_maps(specs, devices, [init_map(s) for s in specs]), IdMap(*(on,) * 6))
    words = lambda b: (np.zeros((batch, b), np.uint32), np.ones((batch, b), np.uint32), np.ones((batch, b), bool))
    ids = [tuple(jax.device_put(x, on) for x in words(b)) for b in bags]
    offsets = (0, specs[0].rows // devices)
    resolve_ = lambda m, ids, step: sharded_resolve_fused(specs, mesh, m, ids, step, True, None, offsets, True)
    hlo = jax.jit(resolve_).lower(fused, ids, 0).compile().as_text()
    compiled_bytes_are_the_plans(hlo, batch * sum(bags), devices, rows_back=False)


def test_a_resolution_traces_the_form_of_its_devices_platform_only(monkeypatch):
    """The resolution's data-dependent work has a form per platform (``chunks.by_platform``);
    where the devices are known it traces theirs alone (``chunks.form_for_platform``), not every
    platform's through ``lax.platform_dependent`` (half the stream config's 8 s of tracing on
    CPU). The CPU form's loops are there: the placement's rounds and the dedup's."""
    asked = []
    both = jax.lax.platform_dependent

    def record(*args, **kwargs):
        asked.append(sys._getframe(1).f_code.co_filename)
        return both(*args, **kwargs)

    monkeypatch.setattr(jax.lax, "platform_dependent", record)
    mesh, devices, batch = make_mesh(8), 8, 256
    specs = [SPEC, MapSpec(rows=8 * 40, vshards=8, probes=4, policy="lru")]
    on = NamedSharding(mesh, P(AXIS))
    fused = jax.device_put(fuse_maps(specs, devices, [init_map(s) for s in specs]), IdMap(*(on,) * 6))
    words = lambda b: (np.zeros((batch, b), np.uint32), np.ones((batch, b), np.uint32), np.ones((batch, b), bool))
    ids = [tuple(jax.device_put(x, on) for x in words(b)) for b in (1, 3)]
    offsets = (0, specs[0].rows // devices)
    resolve_ = lambda m, ids, step: sharded_resolve_fused(specs, mesh, m, ids, step, True, None, offsets)
    jaxpr = str(jax.jit(resolve_).trace(fused, ids, 0).jaxpr)
    assert not [f for f in asked if f.endswith("chunks.py")], asked
    assert "while" in jaxpr


@pytest.mark.slow  # 25-40 s on 2 cores, most of it compiling (the bytes check shares the compile)
def test_a_routed_path_holds_every_distinct_id_in_its_prefix_of_places():
    """A routed path works on the n x buffer places that can hold a device's distinct ids, not
    on all of its ids: at 2,048 ids a device on 8 devices the buffer of 192 an owner gives
    1,536 places. Batches with more than 768 distinct ids a device (past a buffer of 96's
    places) take it; rows, maps and counts equal one map's, and the route the lookups reuse
    names each id's row at its owner. The program sends the plan's bytes, the rows sent back
    (``compiled_bytes_are_the_plans``)."""
    mesh, n, batch = make_mesh(8), 8, 8192
    specs = [SPEC, MapSpec(rows=8 * 40, vshards=8, probes=4, policy="lru")]
    assert route_capacities(2 * batch // n, n) == [96, 192, 576]
    on = NamedSharding(mesh, P(AXIS))
    fused = jax.device_put(fuse_maps(specs, n, [init_map(s) for s in specs]), IdMap(*(on,) * 6))
    one_maps = [init_map(s) for s in specs]
    offsets = (0, specs[0].rows // n)  # each table's block in one local array of both
    run = jax.jit(lambda m, ids, step: sharded_resolve_fused(specs, mesh, m, ids, step, True, None, offsets))
    one = jax.jit(resolve, static_argnums=0)
    rng = np.random.default_rng(5)
    for step in range(2):
        ids = rng.integers(1, 600, (batch, 2)).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        valid = rng.random((batch, 2)) > 0.05
        hi, lo = split_ids(ids)
        tables = [tuple(jax.device_put(x[:, t : t + 1], on) for x in (hi, lo, valid)) for t in range(2)]
        if step == 0:  # (the program the steps run: the compile memo keeps it)
            compiled_bytes_are_the_plans(run.lower(fused, tables, step).compile().as_text(), 2 * batch, n, True)
        distinct = max(
            len({(t, int(ids[i, t])) for i in range(d * 1024, (d + 1) * 1024) for t in range(2) if valid[i, t]})
            for d in range(n)
        )
        assert 8 * 96 < distinct <= 8 * 192, distinct
        rows, fused, _, stats, path, route = run(fused, tables, step)
        assert int(path) == 1 and bool(route.used)  # routed, in 192
        for t, spec in enumerate(specs):
            want = one(spec, one_maps[t], *(jnp.asarray(x[:, t]) for x in (hi, lo, valid)), step)
            one_maps[t] = want.map
            np.testing.assert_array_equal(np.asarray(rows[t]).reshape(-1), np.asarray(want.rows), err_msg=f"{t} {step}")
            assert dict(zip(STATS, np.asarray(stats[t]).tolist(), strict=True)) == {
                k: int(want.stats[k]) for k in STATS
            }
        for got, want in zip(split_maps(specs, n, fused), one_maps, strict=True):
            for a, b in zip(got, want, strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        # the route: each lookup's distinct id, its owner, its place there, and what that owner
        # received at the place: the id's row in its local array
        per = 2 * batch // n
        index, owner, rank = (np.asarray(x).reshape(n, -1) for x in (route.index, route.owner, route.rank))
        received = np.asarray(route.received).reshape(n, n, -1)  # [owner, sender, place]
        got_rows = np.stack([np.asarray(r).reshape(-1) for r in rows], 1).reshape(n, per)
        for d in range(n):
            j = np.flatnonzero(valid.reshape(n, per)[d])
            u = index[d, j]
            table = j % 2
            block = np.array([s.rows // n for s in specs])[table]
            np.testing.assert_array_equal(owner[d, u], got_rows[d, j] // block)
            np.testing.assert_array_equal(
                received[owner[d, u], d, rank[d, u]], got_rows[d, j] % block + np.array(offsets)[table]
            )
