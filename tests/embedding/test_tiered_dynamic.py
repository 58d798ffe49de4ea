"""Tiered dynamic tables (raw ids resolved by host maps, rows in the disk tier behind device
caches far smaller than the working set) against the same dynamic tables on the devices:
every step's loss and map counts equal, and after 40 steps the tables, optimizer state and
maps equal, bit for bit, on 1 to 8 devices, with evictions and admissions every few steps."""

import jax
import numpy as np
import pytest

from dlrm_jax.data.batch import RawBatch
from dlrm_jax.data.sources.synthetic import SyntheticSource
from dlrm_jax.embedding.dynamic import host_maps
from dlrm_jax.embedding.dynamic.idmap import home_rows
from dlrm_jax.embedding.hot.index import hot_keys
from dlrm_jax.embedding.tiers import hot as tier_hot
from dlrm_jax.embedding.tiers import setup as tier_setup
from dlrm_jax.embedding.tiers import tables
from dlrm_jax.embedding.tiers.tables import TieredTables
from dlrm_jax.ids import PAD_ID, raw_columns
from dlrm_jax.parallel.mesh import make_mesh
from dlrm_jax.train.build import build
from dlrm_jax.train.tier_runner import TierRunner

STEPS = 40
HOT_CAPACITY = 48
DYNAMIC = (0, 2)
COMMON = [
    "data.cardinalities=[3000, 400, 10000, 70]",
    "train.batch_size=64",
    "train.learning_rate=0.1",
    "train.seed=5",
    "data.bag_sizes=[2, 1, 3, 1]",
    "embedding.sharding=row",
    "embedding.table_ids=[cat_0=dynamic, cat_2=dynamic]",
    "embedding.dynamic.rows=0.05",
    "embedding.dynamic.vshards=8",
    "embedding.dynamic.probes=3",
    "embedding.dynamic.half_life=4",
    "embedding.dynamic.sketch_width=64",
]
TIERED = ["embedding.tier.device_cache_fraction=0.2", "embedding.tier.host_cache_fraction=0.1"]


def raw_batch(source, step: int) -> RawBatch:
    """The synthetic batch with raw 64-bit ids for the dynamic features (high words set, so
    both halves of an id matter)."""
    b = source.train_batch(step)
    starts = np.cumsum([0, 2, 1, 3, 1])
    cols = np.concatenate([np.arange(starts[t], starts[t + 1]) for t in DYNAMIC])
    ids = b.ids[:, cols].astype(np.int64)
    values = np.where(ids == PAD_ID, 0, ids + (np.int64(7) << 35) * (cols[None, :] + 1))
    return RawBatch(b.dense, b.ids, b.labels, raw_columns(values))


def hot_set(plan) -> np.ndarray:
    """Hot keys holding a seventh of table 0's rows and a twenty-first of table 2's: rows the
    maps give to new ids every few steps."""
    rows = [np.arange(0, t.spec.rows, {0: 7, 2: 21}.get(i, t.spec.rows + 1)) for i, t in enumerate(plan.tables)]
    return hot_keys(rows, HOT_CAPACITY)


def run(cfg, devices, root=None):
    """Per step (loss, map counts); then per table (values, optimizer state) and the maps, and
    (tiered) how many hot rows the host maps gave to new ids."""
    source = SyntheticSource(cfg)
    plan, fns = build(cfg, make_mesh(devices), source, log=lambda *a: None)
    state, per_step = fns.init_state(hot=False), []
    if not plan.tiered_tables:
        if plan.hot_rows:
            state = state._replace(emb=fns.collection.refresh(state.emb, hot_set(plan)))
        for i in range(STEPS):
            state, out, _ = fns.train_step(state, fns.device_batch(raw_batch(source, i)))
            per_step.append((np.asarray(out["loss"]), np.asarray(out["id_map_counts"])))
        values, slots = fns.collection.logical_tables(state.emb)
        maps = {t: jax.device_get(m) for t, m in zip(DYNAMIC, fns.dynamic.by_table(state.maps).values(), strict=True)}
        return per_step, list(values), list(slots), maps, plan, {}
    tiered = TieredTables(
        plan,
        fns.collection.groups,
        fns.collection.optimizer,
        root,
        fns.embedding_key(),
        log=lambda *a: None,
        maps=fns.tiered_maps,
    )
    tiered.restore(0)
    runner = TierRunner(fns, tiered, cfg.embedding.tier.lookahead)
    hot_given = 0
    if plan.hot_rows:
        state = state._replace(emb=tier_hot.refresh(fns.collection, tiered, state.emb, hot_set(plan)))
        runner.use_hot(hot_set(plan))
    for item in runner.planned(lambda i: raw_batch(source, i), range(STEPS)):
        hot_given += 0 if item.fresh_hot is None else int(item.fresh_hot[:, 0].sum())
        state, out = runner.train(state, item.batch, item.fills, item.reads, item)
        counts = out["host_id_map_counts"]
        if "id_map_counts" in out:
            counts = counts + np.asarray(out["id_map_counts"])
        per_step.append((np.asarray(out["loss"]), counts))
    tiered.sync_to_host(state.emb.tables, state.emb.slots, state.emb.hot)
    values, slots = (list(x) for x in fns.collection.logical_tables(state.emb))
    for t in plan.tiered_tables:
        got = tiered.host[t].get(np.arange(plan.tables[t].spec.rows))
        values[t], slots[t] = got.pop("values"), got
    maps = tiered.maps.maps_at(STEPS)
    if fns.dynamic is not None:
        maps |= {t: jax.device_get(fns.dynamic.by_table(state.maps)[f"cat_{t}"]) for t in fns.dynamic.maps}
    stats = dict(tiered.stats) | {"hot_given": hot_given}
    tiered.close()
    return per_step, values, slots, maps, plan, stats


# (devices, policy, admission, lookahead, which dynamic tables are tiered, hot rows, new rows)
CASES = [
    (1, "lfu", 2, 0, "cat_0=tiered, cat_2=tiered", False, "initializer"),
    (2, "lru", 0, 2, "cat_0=tiered, cat_2=tiered", True, "shared"),
    (4, "lfu", 2, 3, "cat_2=tiered", False, "shared"),
    (8, "lru", 2, 1, "cat_0=tiered, cat_1=tiered, cat_2=tiered", True, "initializer"),
]


@pytest.mark.parametrize(
    "devices,policy,admit,lookahead,storage,hot,new_rows",
    CASES,
    ids=[f"{d}dev-{p}-admit{a}-ahead{k}{'-hot' if h else ''}-{n}" for d, p, a, k, _, h, n in CASES],
)
def test_tiered_dynamic_tables_equal_device_ones_every_step(
    tiny, tmp_path, monkeypatch, devices, policy, admit, lookahead, storage, hot, new_rows
):
    """A step that resolved, placed or reset one id differently on the tiered side fails at
    that step (its loss or its counts), not only at the end. With hot rows, a seventh of the
    dynamic tables' rows are hot (they never take a cache slot), and the maps give some of
    them to new ids. With ``new_rows=shared`` a fresh row starts from its shard's shared row,
    which the host placed in the step's caches (or found hot), wherever the tiers held it."""
    if lookahead:
        monkeypatch.setattr(tables, "MAPPED_SHARE", 0.0)  # read the tier ahead, as a large one is
    # Caches sized by the ids' home rows alone, smaller than a run sizes them (its ids' own rows
    # and their shards' shared rows, twice): 40 steps of these small batches then evict from
    # them, and still fit each batch.
    homes_only = lambda cache, spec, blocks: max(
        int(np.bincount(cache.space_of(np.unique(home_rows(spec, b[b != PAD_ID]))), minlength=cache.num_spaces).max())
        for b in blocks
    )
    monkeypatch.setattr(tier_setup, "_dynamic_need", homes_only)
    common = [*COMMON, f"embedding.dynamic.policy={policy}", f"embedding.dynamic.admit={admit}"]
    common += [f"embedding.dynamic.new_rows={new_rows}"]
    common += [f"mesh.devices={devices}", f"embedding.tier.lookahead={lookahead}"]
    if hot:
        common += [f"embedding.hot.rows={HOT_CAPACITY}", "embedding.hot.refresh_every=0"]
    want = run(tiny(*common), devices)
    got = run(tiny(*common, *TIERED, f"embedding.table_storage=[{storage}]"), devices, tmp_path / "tier")
    assert set(got[4].tiered_tables) >= {2}
    for step, ((loss, counts), (loss_ref, counts_ref)) in enumerate(zip(got[0], want[0], strict=True)):
        np.testing.assert_array_equal(counts, counts_ref, err_msg=f"map counts of step {step}")
        np.testing.assert_array_equal(loss, loss_ref, err_msg=f"loss of step {step}")
    lookups, found, admitted, evicted, held_back, _ = np.sum([c for _, c in want[0]], axis=0)
    assert evicted > 0 and admitted > evicted and 0 < found < lookups
    assert (held_back > 0) == (admit > 1)
    assert got[5]["rows_evicted"] > 10, got[5]  # the device caches were smaller than the tables
    assert (got[5]["hot_given"] > 5) == hot, got[5]
    for t in range(4):
        np.testing.assert_array_equal(np.asarray(got[1][t], np.float32), np.asarray(want[1][t]), err_msg=f"table {t}")
        for k in want[2][t]:
            np.testing.assert_array_equal(np.asarray(got[2][t][k]), np.asarray(want[2][t][k]), err_msg=f"{t} {k}")
    for t in DYNAMIC:
        for f, a, b in zip(want[3][t]._fields, got[3][t], want[3][t], strict=True):
            np.testing.assert_array_equal(np.asarray(a).reshape(-1), np.asarray(b).reshape(-1), err_msg=f"map {t} {f}")


def test_host_maps_run_on_the_first_device_when_the_cpu_backend_is_left_out(monkeypatch):
    """JAX_PLATFORMS=cuda leaves no CPU backend: the host maps go to the first device instead."""
    real = jax.devices

    def devices(backend=None):
        if backend == "cpu":
            raise RuntimeError("Unknown backend cpu. Available backends are ['cuda']")
        return real(backend)

    monkeypatch.setattr(jax, "devices", devices)
    assert host_maps.host_device() == real()[0]


def test_the_host_maps_read_and_write_a_batch_without_copying_the_maps():
    """The host maps hold every shard of every tiered dynamic table, so a copy of them costs
    the tables' size, not the batch's: neither program of a batch (read: the resolution and
    the rows it overwrites, kept to undo; write: in place) copies a map array (they had copied
    every one twice a batch: the rows read, then written in place in one program). And the
    maps as of each step, undone from the journal, equal a map that stopped there."""
    import re

    from dlrm_jax.embedding.dynamic.idmap import MapSpec

    spec = MapSpec(8 * 8191, 8, 4, "lfu", half_life=2, admit=2, sketch_depth=2, sketch_width=64)
    maps, n = host_maps.HostMaps({3: spec}), 1024
    rng = np.random.default_rng(0)
    batches = [rng.zipf(1.3, n).astype(np.uint32) for _ in range(4)]
    args = lambda ids: maps._ids(np.zeros(n, np.int32), np.zeros(n, np.uint32), ids, np.ones(n, bool))
    read = maps._learn.lower(maps._map, *args(batches[0]), np.int32(0)).compile().as_text()
    out, sketch, *_ = maps._learn(maps._map, *args(batches[0]), np.int32(0))
    write = maps._write.lower(maps._map, sketch, out.writes, np.int32(0)).compile().as_text()
    for text in (read, write):
        assert not re.findall(r"= \w+\[65528\]\{0\} copy\(", text)
    maps = host_maps.HostMaps({3: spec})
    as_of = {}  # each step's maps as they stood (nothing undone)
    for step, ids in enumerate(batches):
        as_of[step] = maps.maps_at(step)[3]
        maps.learn(step, np.zeros(n, np.int32), np.zeros(n, np.uint32), ids, np.ones(n, bool))
    for step in range(len(batches)):  # and after every batch, undone
        for a, b in zip(maps.maps_at(step)[3], as_of[step], strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(step))


@pytest.mark.slow
def test_a_fresh_rows_start_from_its_shared_row_has_the_same_bits_tiered_and_on_the_devices(tmp_path):
    """``new_rows=shared``: the devices' step started fresh rows from the shards' shared rows
    gathered once, the tiered one from where the host placed them; compiled as users compile
    (LLVM's optimisations on, which the suite's other runs turn off), XLA contracted the
    start's product and sum into one fused multiply-add in one program and not the other, so 14
    rows of cat_3 started 1 ulp apart and every later step drifted. The start is now exact,
    rounded once whatever the fusion."""
    import json
    import subprocess
    import sys

    import tensorstore as ts

    from tests.child_env import child_env

    env = child_env()
    env.pop("XLA_FLAGS")  # (the tests' compile flags turn off the contraction)
    keys = ["mesh.devices=2", "train.steps=2", "train.log_every=1", "embedding.dynamic.rows=0.1"]
    keys += ["embedding.optimizer=sgd", "embedding.learning_rate=1e-30"]  # (the tables hold the starts)
    for name, more in (("device", []), ("tiered", ["embedding.storage=tiered"])):
        sets = [a for k in keys + more for a in ("--set", k)]
        for argv in (
            ["train", "--config", "smoke+stream", *sets, "--run-dir", str(tmp_path / name)],
            ["export", "--run-dir", str(tmp_path / name), "--output", str(tmp_path / f"{name}-tables")],
        ):
            r = subprocess.run(
                [sys.executable, "-m", "dlrm_jax", *argv], capture_output=True, text=True, env=env, timeout=300
            )
            assert r.returncode == 0, r.stderr[-2000:]
    losses = lambda name: [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").open()]
    assert losses("tiered") == losses("device")
    read = lambda name, t: ts.open(
        {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / f"{name}-tables" / t / "values")}}
    )
    for t in ("cat_0", "cat_1", "cat_2", "cat_3"):
        got, want = (read(n, t).result().read().result() for n in ("tiered", "device"))
        np.testing.assert_array_equal(got, want, err_msg=t)
