"""Dynamic tables over a collection (embedding/exchange/dynamic_tables.py): raw ids resolved,
fresh rows reset, then the collection's lookup and update. On 2, 4 and 8 devices every step
equals one device's for 40 steps (pooled vectors, tables, optimizer state, maps, counts),
through evictions, admissions and resets; a fresh row starts as its id's own vector."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlrm_jax.embedding.dynamic.idmap import STATS, MapSpec, split_ids
from dlrm_jax.embedding.exchange.collection import EmbeddingCollection
from dlrm_jax.embedding.exchange.dynamic_tables import DynamicTables
from dlrm_jax.embedding.exchange.optimizers import sparse_optimizer
from dlrm_jax.embedding.plan.embedding_plan import HotPlan
from dlrm_jax.embedding.plan.layout import build_groups, group_capacity
from dlrm_jax.embedding.plan.planner import plan_embeddings
from dlrm_jax.embedding.plan.specs import TableSpec
from dlrm_jax.parallel.mesh import make_mesh

SPECS = [TableSpec("user", 64, 8, 2), TableSpec("item", 40, 8, 1)]
MAP = MapSpec(rows=64, vshards=8, probes=3, policy="lfu", half_life=4, admit=2, sketch_depth=2, sketch_width=16)
BATCH = 16


def tables(devices: int, optimizer: str, new_rows: str = "initializer", control_flow: str = "auto"):
    plan = plan_embeddings(SPECS, "row", devices, optimizer, BATCH)
    coll = EmbeddingCollection(plan, make_mesh(devices), sparse_optimizer(optimizer))
    return coll, DynamicTables(coll, {0: MAP._replace(control_flow=control_flow)}, new_rows)


def stream(steps: int, seed: int = 0, batch: int = BATCH):
    """Raw user ids from a population drifting past the table's rows, item ids, targets."""
    rng = np.random.default_rng(seed)
    for step in range(steps):
        born = (np.arange(step * 5, step * 5 + 90, dtype=np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        users = born[np.minimum(rng.zipf(1.4, size=(batch, 2)) - 1, len(born) - 1)]
        valid = rng.random((batch, 2)) > 0.1
        items = rng.integers(0, 40, (batch, 1), dtype=np.int32)
        yield users, valid, items, rng.normal(size=(batch, 2, 8)).astype(np.float32)


def run(
    devices: int,
    optimizer: str,
    steps: int,
    reset_chunk=10**6,
    control_flow="auto",
    new_rows="initializer",
    by_shard=True,
):
    coll, dyn = tables(devices, optimizer, new_rows, control_flow)
    dyn.reset_chunk = reset_chunk  # (the default: every reset writes all its entries in one chunk)
    dyn.shared_by_shard = by_shard
    key = jax.random.key(3)
    emb, maps = coll.init(key), dyn.init_maps()

    @jax.jit
    def step(emb, maps, hi, lo, valid, items, target, step_no):
        ids = jnp.concatenate([jnp.zeros((BATCH, 2), jnp.int32), items], axis=1)
        emb, maps, ids, stats, *_ = dyn.resolve(emb, maps, {0: (hi, lo, valid)}, ids, step_no, key)
        pooled, res = coll.lookup(emb, ids)
        grad = 2.0 * (pooled - target) / BATCH
        return coll.apply_gradients(emb, res, grad, jnp.float32(0.1)), maps, pooled, stats[0]

    put = lambda x: jax.device_put(x, coll.batch_sharding)
    for t, (users, valid, items, target) in enumerate(stream(steps)):
        hi, lo = split_ids(users)
        emb, maps, pooled, stats = step(emb, maps, put(hi), put(lo), put(valid), put(items), put(target), t)
        values, slots = coll.logical_tables(emb)
        yield (
            np.asarray(pooled),
            [np.asarray(v) for v in values],
            [{k: np.asarray(x) for k, x in s.items()} for s in slots],
            [np.asarray(a) for a in dyn.by_table(maps)["user"]],
            {k: int(stats[k]) for k in STATS},
        )


@pytest.mark.slow  # 8-16 s each on 2 cores
@pytest.mark.parametrize(
    ("devices", "optimizer", "control_flow"),
    [(2, "rowwise_adagrad", "auto"), (4, "sgd", "prefixes"), (8, "rowwise_adagrad", "auto")],
)
def test_dynamic_tables_train_as_on_one_device_step_by_step(devices, optimizer, control_flow):
    counts = dict.fromkeys(STATS, 0)
    # the sharded run resets its fresh rows 2 at a time (many chunks a step), the one-device
    # run all of them in one chunk; on 4 devices its maps are written at once (``prefixes``)
    sharded = run(devices, optimizer, 40, reset_chunk=2, control_flow=control_flow)
    for t, (got, want) in enumerate(zip(sharded, run(1, optimizer, 40), strict=True)):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6, err_msg=f"pooled, step {t}")
        for a, b in zip(got[1], want[1], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"table, step {t}")
        for a, b in zip(got[2], want[2], strict=True):
            for k in a:
                np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=f"{k}, step {t}")
        for a, b in zip(got[3], want[3], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"map, step {t}")
        assert got[4] == want[4], t
        counts = {k: counts[k] + want[4][k] for k in STATS}
    assert counts["evicted"] > 20 and counts["admitted"] > 40 and counts["held_back"], counts


@pytest.mark.parametrize("control_flow", ["one_path", "prefixes"])
def test_one_gpus_straight_form_trains_as_the_branches_do(control_flow):
    """On one GPU the fresh rows are reset all at once and the resolution keeps to one path
    (``chunks.by_platform``), or to one switch among sizes (``prefixes``); forced here on CPU,
    40 steps equal the branches' resetting 2 rows a chunk: pooled vectors, tables, state, maps
    and counts, bit for bit."""
    branches = list(run(1, "rowwise_adagrad", 40, reset_chunk=2, control_flow="branches"))
    for t, (got, want) in enumerate(
        zip(run(1, "rowwise_adagrad", 40, control_flow=control_flow), branches, strict=True)
    ):
        np.testing.assert_array_equal(got[0], want[0], err_msg=f"pooled, step {t}")
        for a, b in zip(got[1] + got[3], want[1] + want[3], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"table or map, step {t}")
        for a, b in zip(got[2], want[2], strict=True):
            for k in a:
                np.testing.assert_array_equal(a[k], b[k], err_msg=f"{k}, step {t}")
        assert got[4] == want[4], t


def test_the_gpus_straight_form_on_four_devices_trains_as_the_branches_do():
    """The GPUs' form on 4 devices (each device's ids deduplicated by sorting and numbered in
    sorted order, routed to their owners, resolved there; forced here on CPU): 12 steps equal
    the branches' (hash-table dedup, first-occurrence order), bit for bit."""
    branches = list(run(4, "rowwise_adagrad", 12, reset_chunk=2, control_flow="branches"))
    for t, (got, want) in enumerate(zip(run(4, "rowwise_adagrad", 12, control_flow="one_path"), branches, strict=True)):
        np.testing.assert_array_equal(got[0], want[0], err_msg=f"pooled, step {t}")
        for a, b in zip(got[1] + got[3], want[1] + want[3], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"table or map, step {t}")
        assert got[4] == want[4], t


@pytest.mark.slow
def test_a_fresh_row_starts_as_its_ids_own_vector_and_state():
    """The same id placed in different rows (other maps, other device counts) starts alike;
    its optimizer state starts as the optimizer's initial state."""
    starts = []
    for devices in (1, 4):
        coll, dyn = tables(devices, "rowwise_adagrad")
        key = jax.random.key(3)
        emb, maps = coll.init(key), dyn.init_maps()
        emb = emb._replace(slots=jax.tree.map(lambda s: s + 1.0, emb.slots))  # not the initial state
        hi, lo = split_ids(np.array([[7, 7]] * BATCH, np.uint64))
        ids = jnp.zeros((BATCH, 3), jnp.int32)
        put = lambda x: jax.device_put(x, coll.batch_sharding)  # noqa: B023
        emb, maps, ids, *_ = jax.jit(functools.partial(dyn.resolve, step=0, key=key))(
            emb, maps, {0: (put(hi), put(lo), put(np.ones((BATCH, 2), bool)))}, put(ids)
        )
        row = int(ids[0, 0])
        values, slots = coll.logical_tables(emb)
        starts.append(np.asarray(values[0])[row])
        assert float(np.asarray(slots[0]["accumulator"])[row]) == 0.0
        assert float(np.asarray(slots[0]["accumulator"])[(row + 1) % 64]) == 1.0  # others untouched
    np.testing.assert_array_equal(starts[0], starts[1])
    assert np.all(np.abs(starts[0]) <= 1 / 8) and np.any(starts[0])


def test_with_new_rows_shared_a_fresh_row_starts_from_its_shards_shared_row():
    """``new_rows="shared"``: the id's own initial vector (on a coarser grid: its uniform on 12
    bits, the scale on 11, so the sum rounds once whatever XLA fuses) plus its shard's shared
    row (slot 0 of the shard), as it was before the step; its optimizer state as the
    optimizer's initial state."""
    starts = {}
    for new_rows in ("initializer", "shared"):
        coll, dyn = tables(4, "rowwise_adagrad", new_rows)
        key = jax.random.key(3)
        emb, maps = coll.init(key), dyn.init_maps()
        hi, lo = split_ids(np.array([[7, 7]] * BATCH, np.uint64))
        put = lambda x: jax.device_put(x, coll.batch_sharding)  # noqa: B023
        emb, maps, ids, *_ = jax.jit(functools.partial(dyn.resolve, step=0, key=key))(
            emb, maps, {0: (put(hi), put(lo), put(np.ones((BATCH, 2), bool)))}, put(jnp.zeros((BATCH, 3), jnp.int32))
        )
        row = int(ids[0, 0])
        values, slots = (np.asarray(x[0]) if not isinstance(x[0], dict) else x[0] for x in coll.logical_tables(emb))
        shared = row // MAP.slots * MAP.slots
        assert row != shared and float(np.asarray(slots["accumulator"])[row]) == 0.0
        starts[new_rows] = values[row], values[shared]
    (own, _), (warm, shared_value) = starts["initializer"], starts["shared"]
    assert np.any(shared_value)
    np.testing.assert_allclose(warm, shared_value + own, rtol=0, atol=2**-10 / MAP.rows**0.5)
    assert not np.array_equal(warm, shared_value)


@pytest.mark.parametrize("devices", [1, 4])
def test_fresh_rows_read_their_shared_rows_from_the_shards_values_as_from_the_table(devices):
    """``new_rows="shared"``: the shards' shared rows gathered once into a small array, read by
    each fresh row (``shared_by_shard``, the default), give the bits of each fresh entry
    gathering its own from the table, step by step, in chunks or at once."""
    counts = dict.fromkeys(STATS, 0)
    one, each = (
        run(devices, "rowwise_adagrad", 16, chunk, new_rows="shared", by_shard=b)
        for chunk, b in ((2, True), (10**6, False))
    )
    for t, (got, want) in enumerate(zip(one, each, strict=True)):
        np.testing.assert_array_equal(got[0], want[0], err_msg=f"pooled, step {t}")
        for a, b in zip(got[1], want[1], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"table, step {t}")
        counts = {k: counts[k] + want[4][k] for k in STATS}
    assert counts["admitted"] > 20, counts


def test_a_table_that_is_not_row_wise_in_even_blocks_is_refused():
    plan = plan_embeddings(SPECS, "table", 2, "sgd", BATCH)
    coll = EmbeddingCollection(plan, make_mesh(2), sparse_optimizer("sgd"))
    with pytest.raises(ValueError, match="table user: a dynamic table is row-wise"):
        DynamicTables(coll, {0: MAP})


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_rows_given_to_new_ids_are_reset_in_replicated_tables_on_every_device(devices):
    """A replicated collection beside the dynamic tables (Wide&Deep's weights, one per row),
    every value and optimizer state 7 at first and never trained here: after each step the
    rows ever given to a new id (the maps' changed slots) are zero with the optimizer's
    initial state, every other row is still 7, and every device holds the same."""
    coll, dyn = tables(devices, "sgd")
    dyn.reset_chunk = 2  # several chunks a step, each gathering 2 entries a device
    wide_specs = [TableSpec(f"w{t}", s.rows, 1, s.bag_size) for t, s in enumerate(SPECS)]
    wide_plan = plan_embeddings(wide_specs, "replicated", devices, "adagrad", BATCH)
    opt = sparse_optimizer("adagrad")
    wide = EmbeddingCollection(wide_plan, make_mesh(devices), opt)
    key = jax.random.key(3)
    emb, maps, state = coll.init(key), dyn.init_maps(), wide.init(key)
    sevens = lambda tree: jax.tree.map(lambda x: jnp.full_like(x, 7.0), tree)
    state = state._replace(tables=sevens(state.tables), slots=sevens(state.slots))
    initial = {k: float(np.asarray(v).reshape(-1)[0]) for k, v in opt.init(jnp.zeros((1, 1))).items()}

    @jax.jit
    def step(emb, maps, state, hi, lo, valid, step_no):
        ids = jnp.zeros((BATCH, 3), jnp.int32)
        emb, maps, _, _, fresh, *_ = dyn.resolve(emb, maps, {0: (hi, lo, valid)}, ids, step_no, key)
        return emb, maps, dyn.reset_replicated(wide, state, fresh, jnp.float32(0.1))

    put = lambda x: jax.device_put(x, coll.batch_sharding)
    ever = np.zeros(MAP.rows, bool)
    for t, (users, valid, _, _) in enumerate(stream(12)):
        before = jax.tree.map(np.asarray, dyn.by_table(maps)["user"])
        hi, lo = split_ids(users)
        emb, maps, state = step(emb, maps, state, put(hi), put(lo), put(valid), t)
        after = jax.tree.map(np.asarray, dyn.by_table(maps)["user"])
        ever |= after.used & (~before.used | (before.key_hi != after.key_hi) | (before.key_lo != after.key_lo))
        for array in jax.tree.leaves((state.tables, state.slots)):
            copies = [np.asarray(s.data) for s in array.addressable_shards]
            assert all(np.array_equal(c, copies[0]) for c in copies)
        values, slots = wide.logical_tables(state)
        np.testing.assert_array_equal(np.asarray(values[0])[:, 0], np.where(ever, 0.0, 7.0), err_msg=f"step {t}")
        np.testing.assert_array_equal(np.asarray(values[1]), 7.0)
        for name, slot in slots[0].items():
            got = np.asarray(slot).reshape(MAP.rows, -1)[:, 0]
            np.testing.assert_array_equal(got, np.where(ever, initial[name], 7.0), err_msg=f"{name}, step {t}")
    assert 20 < ever.sum() < MAP.rows


@pytest.mark.slow  # 15-25 s each on 2 cores
@pytest.mark.parametrize("hot", [True, False])
def test_a_lookup_sends_the_requests_as_the_maps_routed_them(hot):
    """Every table dynamic (one group of just them): the collection's lookup reuses the
    resolution's routing (no sort or send of the row ids of its own) and trains as the same
    devices routing their rows afresh, step by step over 40 steps with evictions and ids
    sharing their shard's row, with hot rows or (``hot=False``) without them and without the
    rows sent back to the devices (``only_lookups``: only the lookup reads them). The
    exchange's capacity (9) lies within the busiest owner's requests (8-12 a step): in steps
    past it the lookup routes afresh, in rounds, from the rows the owners gave; in the others
    it reuses the route (both happen, from the state the other left)."""
    devices, capacity = 8, 9
    batch = 256  # (a device's ids are routed only past a few dozen of them)
    specs = [TableSpec("user", 64, 8, 2), TableSpec("item", 64, 8, 1)]
    maps = {0: MAP, 1: MapSpec(rows=64, vshards=8, probes=2, policy="lru")}

    def run(reuse: bool):
        plan = plan_embeddings(specs, "row", devices, "rowwise_adagrad", batch)
        plan = dataclasses.replace(plan, hot=HotPlan(4)) if hot else plan
        (group,) = {g.name for g in build_groups(plan)}
        plan = dataclasses.replace(plan, capacities=((group, capacity),))
        coll = EmbeddingCollection(plan, make_mesh(devices), sparse_optimizer("rowwise_adagrad"))
        dyn = DynamicTables(coll, maps, only_lookups=reuse)
        assert dyn.routed_group is not None and dyn.rows_back == (hot or not reuse)
        (g,) = coll.groups
        assert group_capacity(plan, g) == capacity  # the busiest owner's requests above it: routed afresh
        key = jax.random.key(3)
        emb, state = coll.init(key), dyn.init_maps()
        if hot:
            emb = coll.refresh(emb, np.array([[0, 0, 1, 1], [0, 9, 0, 17]], np.int32))  # shard 0's shared row hot

        @jax.jit
        def step(emb, state, hi, lo, valid, step_no):
            ids = jnp.zeros((batch, 3), jnp.int32)
            emb, state, ids, _, _, _, routed = dyn.resolve(emb, state, (hi, lo, valid), ids, step_no, key)
            pooled, res = coll.lookup(emb, ids, routed if reuse else None)
            grad = 2.0 * (pooled - 0.5) / batch
            used = routed[dyn.routed_group]
            return coll.apply_gradients(emb, res, grad, jnp.float32(0.1)), state, pooled, used.used, used.busiest

        put = lambda x: jax.device_put(x, coll.batch_sharding)
        for t, (users, valid, items, _) in enumerate(stream(40, batch=batch)):
            raw = np.concatenate([users, items.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)], axis=1)
            hi, lo = split_ids(raw)
            valid = np.concatenate([valid, np.ones((batch, 1), bool)], axis=1)
            emb, state, pooled, used, busiest = step(emb, state, put(hi), put(lo), put(valid), t)
            values, slots = coll.logical_tables(emb)
            yield np.asarray(pooled), [np.asarray(v) for v in values], [np.asarray(s["accumulator"]) for s in slots]
            assert bool(used), t
            afresh.add(int(busiest) > capacity)

    afresh = set()
    for t, (got, want) in enumerate(zip(run(True), run(False), strict=True)):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6, err_msg=f"pooled, step {t}")
        for a, b in zip(got[1] + got[2], want[1] + want[2], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"tables, step {t}")
    assert afresh == {True, False}  # steps of both kinds
