"""The whole train step (dense model, exchange, sparse update) against one device, step by step.

Why step by step: a ReLU network's loss is not a smooth function of its parameters. Two runs
whose reductions add in another order differ in the last bit, and once a pre-activation of one
sample lies within that bit of zero (measured: -2.2e-8 against +3.0e-8 at step 4 of the default
config, seed 3) the ReLU passes a gradient in one run and not in the other: ~1e-5 apart in the
top layer after one step and ~1e-4 in the loss twenty steps on. Which pairs of runs this hits
depends on the seed, not on the exchange: over seeds 0-6, replicated tables on 2 against 8
devices (no exchange at all) drift to 6e-6, row-wise on 8 to 6.6e-5, row-wise on 2 not at all.
Free-running trajectories therefore cannot hold an exchange to float32 rounding.

So every one of 40 steps starts both programs from the same state (the reference's, re-laid
out for the plan under test) on the same batch, and the next states must agree to rounding: a
form that goes wrong at step 28 (a bucket that overflows there, a row first seen there) fails
at step 28. The embedding exchange on its own is held to a float64 reference for 40 steps in
test_embedding.py.
"""

import jax
import numpy as np
import pytest

from dlrm_jax.data.sources.synthetic import SyntheticSource
from dlrm_jax.embedding.exchange.relayout import relayout
from dlrm_jax.embedding.hot.index import hot_keys
from dlrm_jax.parallel.mesh import make_mesh
from dlrm_jax.train.build import build
from dlrm_jax.train.step import TrainState

STEPS = 40


def by_table(steps, state: TrainState) -> TrainState:
    """``state`` with its dynamic tables' maps each its own (the same on any device count)."""
    return state._replace(maps=steps.dynamic.by_table(state.maps)) if steps.dynamic else state


def transfer(src_plan, state: TrainState, dst) -> TrainState:
    """``state`` (of ``src_plan``'s steps, maps by table) on ``dst``'s mesh and plan, values
    unchanged."""
    host = jax.tree.map(np.asarray, state)
    put = lambda tree, sharding: jax.tree.map(jax.device_put, tree, sharding)
    s = dst.state_sharding
    return TrainState(
        put(host.step, s.step),
        put(host.params, s.params),
        put(host.opt_state, s.opt_state),
        relayout(src_plan, host.emb, dst.collection),
        put(host.parts, s.parts),
        dst.dynamic.joined(put(host.maps, dst.dynamic.maps_sharding(by_table=True))) if dst.dynamic else {},
    )


def logical(steps, state: TrainState):
    tables, slots = steps.collection.logical_tables(state.emb)
    maps = steps.dynamic.by_table(state.maps) if steps.dynamic else {}
    leaves = jax.tree.leaves((state.params, state.opt_state, tables, slots, maps, state.parts))  # parts: replicated
    return [np.asarray(x) for x in leaves]


CASES = [
    ("row", 2, "sgd", False),
    ("table", 2, "sgd", True),
    ("row", 4, "rowwise_adagrad", False),
    ("column", 4, "sgd", True),
    ("row", 8, "adagrad", True),
    ("auto", 8, "rowwise_adagrad", False),
    ("host_row", 8, "sgd", True),  # 2 hosts of 4 (HOSTS below)
    ("host_column", 4, "rowwise_adagrad", True),  # 2 hosts of 2
]
HOSTS = {"host_row": ["cluster.devices_per_host=4"], "host_column": ["cluster.devices_per_host=2"]}


@pytest.mark.parametrize(
    "strategy,devices,optimizer,bags",
    CASES,
    ids=[f"{s}-{d}dev-{o}-{'bags' if b else 'onehot'}" for s, d, o, b in CASES],
)
def test_every_step_matches_one_device(tiny, strategy, devices, optimizer, bags):
    common = [
        "train.batch_size=64",
        "train.optimizer=sgd",
        "train.learning_rate=0.1",
        "embedding.learning_rate=0.1",
        f"embedding.optimizer={optimizer}",
        "train.seed=3",
        *(["data.bag_sizes=[3, 1, 4, 2]", "data.pooling=mean"] if bags else []),
    ]
    ref_cfg = tiny(*common, "mesh.devices=1", "embedding.sharding=replicated")
    cfg = tiny(*common, f"mesh.devices={devices}", f"embedding.sharding={strategy}", *HOSTS.get(strategy, []))
    source = SyntheticSource(ref_cfg)
    ref_plan, ref = build(ref_cfg, make_mesh(1), source)
    plan, steps = build(cfg, make_mesh(devices), source)
    if strategy != "auto":
        assert {t.strategy.value for t in plan.tables} == {strategy}
    state = ref.init_state()
    for step in range(STEPS):
        batch = source.train_batch(step)
        other = transfer(ref_plan, by_table(ref, state), steps)
        state, ref_metrics, _ = ref.train_step(state, ref.device_batch(batch))
        other, metrics, _ = steps.train_step(other, steps.device_batch(batch))
        assert int(metrics["exchange_overflows"]) == 0 or steps.collection.plan.num_devices > 1
        np.testing.assert_allclose(
            float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-6, err_msg=f"loss at step {step}"
        )
        for got, want in zip(logical(steps, other), logical(ref, state), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=f"state after step {step}")


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_fused_dot_pairs_every_step_match_one_device_with_xlas(tiny, devices):
    """``model.dot_pairs=fused`` (the pairs and their gradient by Pallas kernels, interpreted
    here, split over the batch's devices) against XLA's pairs on one device, step by step: ten
    tables (eleven vectors a sample: two row blocks, the last reaching past the pairs)."""
    common = [
        "train.batch_size=64",
        "train.learning_rate=0.1",
        "embedding.optimizer=rowwise_adagrad",
        "train.seed=4",
        "data.cardinalities=[300, 40, 1000, 7, 50, 90, 3, 120, 64, 500]",
    ]
    ref_cfg = tiny(*common, "mesh.devices=1", "embedding.sharding=replicated", "model.dot_pairs=xla")
    cfg = tiny(*common, f"mesh.devices={devices}", "model.dot_pairs=fused")
    source = SyntheticSource(ref_cfg)
    ref_plan, ref = build(ref_cfg, make_mesh(1), source)
    _, steps = build(cfg, make_mesh(devices), source)
    assert nnx_attr(steps, "dot_pairs") == "fused" and nnx_attr(ref, "dot_pairs") == "xla"
    state = ref.init_state()
    for step in range(STEPS):
        batch = source.train_batch(step)
        other = transfer(ref_plan, state, steps)
        state, ref_metrics, _ = ref.train_step(state, ref.device_batch(batch))
        other, metrics, _ = steps.train_step(other, steps.device_batch(batch))
        np.testing.assert_allclose(
            float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-6, err_msg=f"step {step}"
        )
        for got, want in zip(logical(steps, other), logical(ref, state), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=f"state after step {step}")


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_fused_cross_layers_every_step_match_one_device_with_xlas(tiny, devices):
    """``model.cross_layers=fused`` (each low-rank cross layer's second product with its
    elementwise work in one Pallas kernel, interpreted here, split over the batch's devices)
    step by step from one device's state with XLA's layers: DLRM-DCNv2's form at a small width
    (11 vectors of 16, rank 16; 16 samples a device on 8, the kernel's least tile). Against XLA's
    layers on the same devices and against one device, to the sharded step's own tolerance:
    XLA's layers on 2 to 8 devices differ from one device by up to 4e-5 in the cross weights
    (their gradients summed across devices in another order, with cancellation), and the
    kernel's product, summed in its own order, moves the same sums by as much; a wrong term
    in the kernel moves them by tenths at the first step."""
    common = [
        "train.batch_size=128",
        "train.learning_rate=0.05",
        "train.seed=5",
        "model.interaction=dcn",
        "model.dcn_layers=3",
        "model.dcn_rank=16",
        "model.embedding_dim=16",
        "model.bottom_mlp=[16, 16]",
        "data.cardinalities=[300, 40, 1000, 7, 50, 90, 3, 120, 64, 500]",
    ]
    ref_cfg = tiny(*common, "mesh.devices=1", "embedding.sharding=replicated", "model.cross_layers=xla")
    source = SyntheticSource(ref_cfg)
    ref_plan, ref = build(ref_cfg, make_mesh(1), source)
    forms = {}
    for form in ("xla", "fused"):
        _, forms[form] = build(
            tiny(*common, f"mesh.devices={devices}", f"model.cross_layers={form}"), make_mesh(devices), source
        )
        assert nnx_attr(forms[form], "cross").layers_form == form
    state = ref.init_state()
    for step in range(STEPS):
        batch = source.train_batch(step)
        got = {}
        for form, steps in forms.items():
            other, metrics, _ = steps.train_step(transfer(ref_plan, state, steps), steps.device_batch(batch))
            got[form] = (float(metrics["loss"]), [np.asarray(x) for x in logical(steps, other)])
        state, ref_metrics, _ = ref.train_step(state, ref.device_batch(batch))
        (loss, fused), (xla_loss, xla) = got["fused"], got["xla"]
        np.testing.assert_allclose(loss, xla_loss, rtol=1e-6, err_msg=f"step {step}")
        np.testing.assert_allclose(loss, float(ref_metrics["loss"]), rtol=1e-6, err_msg=f"step {step}")
        for f, x, want in zip(fused, xla, logical(ref, state), strict=True):
            np.testing.assert_allclose(f, x, rtol=1e-4, atol=1e-4, err_msg=f"against XLA's layers after step {step}")
            np.testing.assert_allclose(f, want, rtol=1e-4, atol=1e-4, err_msg=f"against one device after step {step}")


def nnx_attr(steps, name: str):
    """An attribute of the steps' dense model (its graph's static part)."""
    from flax import nnx

    return getattr(nnx.merge(steps.graphdef, nnx.state(steps.spec.dense(nnx.Rngs(0)), nnx.Param)), name)


# Dynamic tables (embedding.table_ids): raw ids through id maps sharded with their tables, with
# evictions (tables of a fifth of their values), lru or lfu, admission after 2 sightings or at
# once (the map alone on 1, 2, 4 and 8 devices: tests/embedding/test_dynamic_sharded.py). With
# hot rows, every step's hot set holds the rows its batch gives to new ids (known from the
# reference's maps after the step) beside rows that keep theirs, so a fresh row that is hot must
# be reset in the hot copies too, or that step fails. Two cases are Wide&Deep, whose wide
# weights of a dynamic table (one per row, on every device) restart at zero with their rows.
# Two start fresh rows from their shards' shared rows (embedding.dynamic.new_rows=shared): with
# hot rows, shard 0's shared row is hot (its value is the hot copy's) and fresh hot rows take
# their shared rows' values from their owners; with Wide&Deep, the wide weights do too. In two
# cases ("every") every table is dynamic, at a batch whose ids the maps route to their owners,
# so the lookups send their requests as the maps routed them (DynamicTables.routed_group): with
# hot rows, whose lookup reads the rows, so they are sent back to the devices; without, where
# only the owners hold them (DynamicTables.resolve's rows=False).
DYNAMIC = [
    (1, "lfu", 2, True, False, "initializer", False),
    (2, "lru", 0, True, True, "initializer", False),
    (4, "lfu", 0, True, False, "shared", True),
    (8, "lru", 2, False, False, "initializer", True),
    (8, "lfu", 2, False, True, "shared", False),
]
# (the dense model by SGD: Adam's first step divides a near-zero gradient by its own size, so
# the last bit of a sum taken in another order shows at 1e-5)
WIDE_DEEP = ("model.kind=wide_deep", "model.bottom_mlp=[]", "model.interaction=cat", "train.optimizer=sgd")
HOT_CAPACITY = 48


@pytest.mark.parametrize(
    "devices,policy,admit,hot,wide,new_rows,every",
    DYNAMIC,
    ids=[
        f"{d}dev-{p}-admit{a}{'-hot' if h else ''}{'-wide_deep' if w else ''}{'-shared' if n == 'shared' else ''}"
        f"{'-every' if e else ''}"
        for d, p, a, h, w, n, e in DYNAMIC
    ],
)
def test_dynamic_tables_every_step_match_one_device(tiny, devices, policy, admit, hot, wide, new_rows, every):
    common = [
        f"train.batch_size={128 if every else 64}",
        "train.learning_rate=0.1",
        "embedding.optimizer=rowwise_adagrad",
        "train.seed=5",
        "data.bag_sizes=[2, 1, 3, 1]",
        "embedding.ids=dynamic" if every else "embedding.table_ids=[cat_0=dynamic, cat_2=dynamic]",
        "embedding.dynamic.rows=0.2",
        "embedding.dynamic.vshards=8",
        "embedding.dynamic.probes=3",
        f"embedding.dynamic.policy={policy}",
        "embedding.dynamic.half_life=4",
        f"embedding.dynamic.admit={admit}",
        "embedding.dynamic.sketch_width=64",
        f"embedding.dynamic.new_rows={new_rows}",
        *(WIDE_DEEP if wide else ()),
    ]
    ref_cfg = tiny(*common, "mesh.devices=1")
    hot_rows = [f"embedding.hot.rows={HOT_CAPACITY}", "embedding.hot.refresh_every=0"] if hot else []
    cfg = tiny(*common, f"mesh.devices={devices}", *hot_rows)
    source = SyntheticSource(ref_cfg)
    ref_plan, ref = build(ref_cfg, make_mesh(1), source)
    plan, steps = build(cfg, make_mesh(devices), source)
    assert [ref_plan.tables[t].spec.rows for t in (0, 2)] == [64, 200]
    assert plan.hot_rows == (HOT_CAPACITY if hot else 0)
    assert (steps.dynamic.routed_group is not None) == (devices > 2)  # (dynamic tables alone in their group)
    routed = 0
    state, counts, fresh_hot, hits = ref.init_state(), np.zeros(6, np.int64), 0, 0
    for step in range(STEPS):
        batch = source.train_batch(step)
        before = by_table(ref, state)
        other = transfer(ref_plan, before, steps)
        state, ref_metrics, _ = ref.train_step(state, ref.device_batch(batch))
        if hot:
            keys, fresh = hot_set_with_new_rows(plan, steps, before, by_table(ref, state))
            other = other._replace(emb=steps.collection.refresh(other.emb, keys))
            if new_rows == "shared":
                other = with_stale_shared_rows(steps, other)
            fresh_hot += fresh
        other, metrics, _ = steps.train_step(other, steps.device_batch(batch))
        np.testing.assert_array_equal(np.asarray(metrics["id_map_counts"]), np.asarray(ref_metrics["id_map_counts"]))
        counts += np.asarray(ref_metrics["id_map_counts"])
        routed += int(metrics["id_route"]) < len(steps.dynamic.resolution_paths(cfg.train.batch_size)) - 1
        np.testing.assert_allclose(
            float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-6, err_msg=f"step {step}"
        )
        for got, want in zip(logical(steps, other), logical(ref, state), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=f"state after step {step}")
        if hot:
            hits += int(np.asarray(metrics["hot_counts"])[0])
            assert np.asarray(metrics["rows"]).shape == np.asarray(batch.ids).shape  # what refreshes count
    lookups, found, admitted, evicted, held_back, _ = counts
    assert evicted > 0 and admitted > evicted and 0 < found < lookups
    assert (held_back > 0) == (admit > 1)
    assert routed > STEPS // 2 if every else routed == 0  # (on the gathered path the lookups route afresh)
    assert (fresh_hot > 40 and hits > 0) if hot else "hot_counts" not in metrics


def with_stale_shared_rows(steps, state: TrainState) -> TrainState:
    """``state`` with the tables' own copies of row 0 of each dynamic table (shard 0's shared
    row, hot) far off: while a row is hot its value is the hot copy's, as between refreshes
    (here every step refreshes, which leaves both copies alike), so a fresh row of shard 0 must
    start from the hot copy."""
    tables = dict(state.emb.tables)
    for t in steps.dynamic.maps:
        g, vt = steps.dynamic.where[t]  # row 0 is device 0's first row of the table's block
        tables[g.name] = jax.jit(lambda a, i=vt.offset: a.at[i].add(100.0), out_shardings=tables[g.name].sharding)(
            tables[g.name]
        )
    return state._replace(emb=state.emb._replace(tables=tables))


def hot_set_with_new_rows(plan, steps, before: TrainState, after: TrainState) -> tuple[np.ndarray, int]:
    """Hot keys holding up to 10 rows of each dynamic table that the step gave to a new id (its
    maps ``before`` and ``after`` it, by table), 6 rows that kept their ids and shard 0's
    shared row (row 0), and a few rows of every other table; and how many of the step's new
    rows are hot."""
    rows = [np.unique(np.arange(0, 40, 7) % t.spec.rows) for t in plan.tables]
    fresh = 0
    for t, name in steps.dynamic.names().items():
        old, new = (jax.tree.map(np.asarray, m[name]) for m in (before.maps, after.maps))
        given = new.used & (~old.used | (old.key_hi != new.key_hi) | (old.key_lo != new.key_lo))
        rows[t] = np.union1d(np.flatnonzero(given)[:10], [0, *np.flatnonzero(new.used)[:6]])
        fresh += min(int(given.sum()), 10)
    return hot_keys(rows, HOT_CAPACITY), fresh
