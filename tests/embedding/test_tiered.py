"""Tiered tables against the same tables on the devices: equal losses, tables and optimizer
state after 20 steps, with device caches far smaller than the working set (evictions every
step), the DRAM caches smaller still, every optimizer, one-hot and bags, 1 to 8 devices."""

import json
import re

import jax
import numpy as np
import pytest
import tensorstore as ts

from dlrm_jax.data.sources.synthetic import SyntheticSource
from dlrm_jax.embedding.tiers import tables
from dlrm_jax.embedding.tiers.tables import TieredTables
from dlrm_jax.parallel.mesh import make_mesh
from dlrm_jax.train.build import build
from dlrm_jax.train.tier_runner import TierRunner
from tests.child_env import COMPILE_FLAGS, child_env
from tests.embedding.tiered_configs import BASE, TIERED

STEPS = 20
BAGS = ["data.bag_sizes=[3, 1, 4, 2]", "data.pooling=mean"]


def train(cfg, devices, root=None, steps=STEPS):
    """(losses, per-table values, per-table optimizer state, plan, stats) after ``steps``."""
    source = SyntheticSource(cfg)
    plan, fns = build(cfg, make_mesh(devices), source, log=lambda *a: None)
    state = fns.init_state()
    losses, stats = [], {}
    if not plan.tiered_tables:
        for i in range(steps):
            state, out, _ = fns.train_step(state, fns.device_batch(source.train_batch(i)))
            losses.append(np.asarray(out["loss"]))
        values, slots = fns.collection.logical_tables(state.emb)
        return losses, values, slots, plan, stats
    tiered = TieredTables(
        plan, fns.collection.groups, fns.collection.optimizer, root, fns.embedding_key(), log=lambda *a: None
    )
    runner = TierRunner(fns, tiered, cfg.embedding.tier.lookahead)
    for item in runner.planned(source.train_batch, range(steps)):
        state, out = runner.train(state, item.batch, item.fills, item.reads)
        losses.append(np.asarray(out["loss"]))
    tiered.sync_to_host(state.emb.tables, state.emb.slots)
    values, slots = fns.collection.logical_tables(state.emb)
    values, slots = list(values), list(slots)
    for t in plan.tiered_tables:
        got = tiered.host[t].get(np.arange(plan.tables[t].spec.rows))
        values[t], slots[t] = got.pop("values"), got
    stats = dict(tiered.stats) | {
        "rows_read_ahead": sum(h.rows_read_ahead for h in tiered.host.values()),
        "mapped": tiered.store.mapped,
    }
    tiered.close()
    return losses, values, slots, plan, stats


def assert_same_training(a, b):
    np.testing.assert_array_equal(np.array(a[0]), np.array(b[0]))
    for t, (x, y) in enumerate(zip(a[1], b[1], strict=True)):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), err_msg=f"table {t}")
        for k in a[2][t]:
            np.testing.assert_array_equal(np.asarray(a[2][t][k]), np.asarray(b[2][t][k]), err_msg=f"table {t} {k}")


# A cover: each optimizer, one-hot and both bag exchanges, row (block and cyclic), table and
# column sharding, 1, 4 and 8 devices, lookahead 0 (every re-read row is forwarded) and more,
# and fill capacities of 4 rows and 1 (most steps overflow them and fill in extra rounds).
CASES = [
    ("row", 8, "rowwise_adagrad", "onehot", 0, 0),
    ("row", 8, "adagrad", "ids", 2, 0),
    ("table", 1, "sgd", "ids", 0, 0),
    ("table", 8, "rowwise_adagrad", "pooled", 3, 4),
    ("column", 8, "adagrad", "onehot", 1, 1),  # a row in one program on every device its columns are
    ("row_cyclic", 4, "sgd", "pooled", 2, 0),
    ("host_column", 8, "rowwise_adagrad", "pooled", 2, 0),  # 4 hosts of 2
]


@pytest.mark.parametrize(
    "strategy,devices,optimizer,bags,lookahead,fill_rows", CASES, ids=["-".join(map(str, c)) for c in CASES]
)
def test_tiered_equals_all_in_device(
    tiny, tmp_path, monkeypatch, strategy, devices, optimizer, bags, lookahead, fill_rows
):
    """Lookahead 0 reads the tier through memory maps (these small tiers fit the page cache);
    with lookahead the tier is read as a larger one is: requests, read ahead."""
    if lookahead:
        monkeypatch.setattr(tables, "MAPPED_SHARE", 0.0)
    sharding = {
        "row_cyclic": ["embedding.sharding=row", "embedding.row_layout=cyclic"],
        "host_column": ["embedding.sharding=host_column", "cluster.devices_per_host=2"],
    }.get(strategy, [f"embedding.sharding={strategy}"])
    extra = [] if bags == "onehot" else [*BAGS, f"embedding.bag_exchange={bags}"]
    common = [
        *BASE,
        *sharding,
        *extra,
        f"embedding.optimizer={optimizer}",
        f"embedding.tier.lookahead={lookahead}",
        f"embedding.tier.fill_rows={fill_rows}",
    ]
    reference = train(tiny(*common), devices)
    tiered = train(tiny(*common, *TIERED), devices, tmp_path / "tier")
    assert tiered[3].tiered_tables == (0, 2)
    if strategy == "host_column":
        assert {t.strategy.value for t in tiered[3].tables} == {"host_column"}
    stats = tiered[4]
    assert stats["rows_evicted"] > 5 * STEPS  # the caches were far too small for the run
    assert stats["mapped"] == (lookahead == 0)
    if lookahead == 0:
        assert stats["rows_forwarded"] > 0  # rows evicted by one step and re-read by the next
    else:
        assert stats["rows_read_ahead"] > 0  # the disk tier was read ahead, those reads used
    if fill_rows:
        assert stats.get("fill_rounds", 0) > STEPS  # overflowing fills ran in extra rounds
    assert_same_training(reference, tiered)


def test_the_step_fills_device_caches_in_place(tiny, tmp_path):
    """The compiled train step writes the device caches where they are: no copy of a cache
    (values or optimizer state), which on CPU cost more than the step itself."""
    cfg = tiny(*BASE, "embedding.sharding=row", "embedding.optimizer=rowwise_adagrad", *TIERED)
    source = SyntheticSource(cfg)
    plan, fns = build(cfg, make_mesh(2), source, log=lambda *a: None)
    tiered = TieredTables(
        plan, fns.collection.groups, fns.collection.optimizer, tmp_path, fns.embedding_key(), log=lambda *a: None
    )
    runner = TierRunner(fns, tiered, 0)
    state = fns.init_state()
    for item in runner.planned(source.train_batch, range(2)):
        state, _ = runner.train(state, item.batch, item.fills, item.reads)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    hlo = fns.train_step.lower(shapes, *runner.step_input_shapes()).compile().as_text()
    tiered.close()
    caches = [g.name for g in fns.collection.groups if g.name in tiered.tiered_groups()]
    assert caches
    for name in caches:
        rows = state.emb.tables[name].shape[0] // 2  # one device's
        copies = re.findall(rf"= f32\[{rows}(,\d+)?\]\S* copy\(", hlo)
        assert not copies, f"{name}: the step copies its cache {len(copies)} times"


@pytest.mark.slow
def test_trainer_resumes_tiered_runs_bitwise_and_matches_device(tiny, tmp_path):
    """Through train_and_evaluate: a tiered run cut after its step-4 checkpoint and resumed
    (the tier restored to its snapshot, caches cold) equals the uninterrupted run, and both
    equal the all-in-device run, loss by loss and in the final AUC."""
    from dlrm_jax.train.trainer import train_and_evaluate
    from tests.helpers import QUIET, losses

    common = [*BASE, "mesh.devices=8", "embedding.sharding=row", "train.log_every=1", "train.eval_every=4"]
    tiered = [*common, *TIERED, "train.checkpoint_every=4"]
    device = train_and_evaluate(tiny(*common, "train.steps=8"), tmp_path / "device", **QUIET)
    whole = train_and_evaluate(tiny(*tiered, "train.steps=8"), tmp_path / "whole", **QUIET)
    train_and_evaluate(tiny(*tiered, "train.steps=4"), tmp_path / "cut", **QUIET)
    resumed = train_and_evaluate(tiny(*tiered, "train.steps=8"), tmp_path / "cut", **QUIET)
    assert losses(tmp_path / "cut") == losses(tmp_path / "whole") == losses(tmp_path / "device")
    assert (resumed.auc, resumed.logloss) == (whole.auc, whole.logloss) == (device.auc, device.logloss)
    assert sorted(p.name for p in (tmp_path / "cut" / "tier" / "snapshots").iterdir()) == ["4", "8"]
    report = (tmp_path / "whole" / "plan.txt").read_text()
    assert "Tiered tables" in report and "cat_0" in report.split("Tiered tables")[1] and "DRAM hits" in report
    event = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").open()][-1]
    assert 0 < event["device_hit_rate"] < 1 and event["rows_evicted"] > 0 and event["h2d_bytes_per_step"] > 0
    from dlrm_jax.train.saved_run import evaluate_run

    assert evaluate_run(tmp_path / "whole", **QUIET).auc == whole.auc  # from the tier's snapshot, read-only
    # Exported, the tiered run's tables are the device run's, field by field.
    from dlrm_jax.train.export import export_run

    for name in ("device", "whole"):
        assert export_run(tmp_path / name, tmp_path / f"export_{name}", **QUIET) == 8
    read = lambda *p: (
        ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path.joinpath(*p))}})
        .result()
        .read()
        .result()
    )
    for table in ("cat_0", "cat_1", "cat_2", "cat_3"):
        for field in ("values", "accumulator"):
            np.testing.assert_array_equal(read("export_whole", table, field), read("export_device", table, field))


@pytest.mark.slow
def test_hot_rows_of_tiered_tables_match_device_run_and_resume(tiny, tmp_path):
    """Hot rows compose with tiered tables: hot rows of tiered tables stay in the replicated
    hot arrays (never in a cache slot), refreshes move them between the hot copies and the
    caches/tier exactly. Losses, AUC and exported tables equal the all-in-device run with the
    same hot rows; a run cut at its step-5 checkpoint and resumed (across refreshes at steps
    3, 6, 9, with lookahead) equals both."""
    from dlrm_jax.train.export import export_run
    from dlrm_jax.train.trainer import train_and_evaluate
    from tests.helpers import QUIET, losses

    common = [
        *BASE,
        "mesh.devices=8",
        "embedding.sharding=row",
        "embedding.hot.rows=48",
        "embedding.hot.refresh_every=3",
        "embedding.hot.stats_batches=2",
        "embedding.tier.lookahead=2",
        "train.log_every=1",
        "train.eval_every=5",
        "train.checkpoint_every=5",
    ]
    tiered = [*common, *TIERED]
    device = train_and_evaluate(tiny(*common, "train.steps=10"), tmp_path / "device", **QUIET)
    train_and_evaluate(tiny(*tiered, "train.steps=5"), tmp_path / "cut", **QUIET)
    resumed = train_and_evaluate(tiny(*tiered, "train.steps=10"), tmp_path / "cut", **QUIET)
    assert losses(tmp_path / "cut") == losses(tmp_path / "device")
    assert (resumed.auc, resumed.logloss) == (device.auc, device.logloss)
    report = (tmp_path / "cut" / "plan.txt").read_text()
    plan_lines = report.split("Tiered tables")[0].splitlines()  # table, ..., hot rows, hit rate
    hot_of = {line.split()[0]: int(line.split()[-2]) for line in plan_lines if line.startswith("cat_")}
    assert hot_of["cat_0"] > 0 and hot_of["cat_2"] > 0  # tiered tables have hot rows
    events = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").open()]
    assert all(e["hot_hit_rate"] > 0.2 for e in events)
    read = lambda *p: (
        ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path.joinpath(*p))}})
        .result()
        .read()
        .result()
    )
    for name in ("device", "cut"):
        assert export_run(tmp_path / name, tmp_path / f"export_{name}", **QUIET) == 10
    for table in ("cat_0", "cat_1", "cat_2", "cat_3"):
        for field in ("values", "accumulator"):
            np.testing.assert_array_equal(read("export_cut", table, field), read("export_device", table, field))


def test_a_run_that_stops_while_the_planner_waits_for_a_refresh_ends(tiny, tmp_path):
    """An early stop at step 2 with the planner, 3 batches ahead, waiting at step 3's hot-row
    refresh: the run never exited after its checkpoint (nothing released the planner, and the
    loop's end joined its thread forever), nor after a stop signal or divergence alike."""
    import threading

    from dlrm_jax.train.trainer import train_and_evaluate
    from tests.helpers import QUIET

    cfg = tiny(
        *BASE,
        *TIERED,
        "mesh.devices=2",
        "embedding.sharding=row",
        "embedding.hot.rows=16",
        "embedding.hot.refresh_every=3",
        "embedding.hot.stats_batches=2",
        "embedding.tier.lookahead=3",
        "train.steps=30",
        "train.eval_every=2",
        "train.target_auc=0.01",
    )
    done = []
    run = threading.Thread(target=lambda: done.append(train_and_evaluate(cfg, tmp_path / "run", **QUIET)), daemon=True)
    run.start()
    run.join(240)
    assert not run.is_alive(), "the run did not end after its early stop"
    assert done[0].step == 2 and "target_auc" in done[0].stop_reason


@pytest.mark.slow
def test_restore_tiered_onto_another_device_count_and_strategy(tiny, tmp_path):
    """8 devices row-wise, checkpoint, then 4 devices table-wise: the device-resident tables
    are re-laid out, the tiered ones come from the tier's snapshot with new, cold caches; the
    losses equal the same cut and restore with every table on the devices. Moving a table
    between the devices and the tier on restore is refused, naming the tables."""
    from dlrm_jax.train.trainer import train_and_evaluate
    from tests.helpers import QUIET, losses

    common = [*BASE, "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=4"]
    for name, extra in (("device", []), ("tiered", TIERED)):
        train_and_evaluate(
            tiny(*common, *extra, "mesh.devices=8", "embedding.sharding=row", "train.steps=4"), tmp_path / name, **QUIET
        )
        train_and_evaluate(
            tiny(*common, *extra, "mesh.devices=4", "embedding.sharding=table", "train.steps=8"),
            tmp_path / name,
            **QUIET,
        )
    assert len(losses(tmp_path / "tiered")) == 8
    assert losses(tmp_path / "tiered") == losses(tmp_path / "device")
    with pytest.raises(ValueError, match="keeps tables cat_0, cat_2 in the disk tier, this config none"):
        train_and_evaluate(tiny(*common, "mesh.devices=4", "train.steps=12"), tmp_path / "tiered", **QUIET)
    # the other way, refused before a tier is made (RUN_DIR/tier was made, then left behind)
    with pytest.raises(ValueError, match="keeps tables none in the disk tier, this config cat_0, cat_2"):
        train_and_evaluate(tiny(*common, *TIERED, "mesh.devices=4", "train.steps=12"), tmp_path / "device", **QUIET)
    assert not (tmp_path / "device" / "tier").exists()


KILL_MID_FLUSH = """
import os, signal
import numpy as np
from tests.helpers import tiny_config
from dlrm_jax.embedding.tiers.dram_cache import HostCache
from dlrm_jax.train.trainer import train_and_evaluate

calls = {{"n": 0}}
original = HostCache.flush

def flush_then_die(self):
    # The step-8 checkpoint: the first table flushed, half the second's dirty rows, SIGKILL.
    if max(self.store.snapshots()) == 4:
        calls["n"] += 1
        if calls["n"] == 2:
            import pathlib, time
            done = pathlib.Path({run_dir!r}) / "checkpoints" / "4"
            for _ in range(600):  # orbax commits step 4 in the background: die after it did
                if done.is_dir():
                    break
                time.sleep(0.1)
            slots = np.flatnonzero(self.dirty)[: max(1, int(self.dirty.sum()) // 2)]
            self._write(self.row_of[slots], {{k: v[slots] for k, v in self.data.items()}})
            os.kill(os.getpid(), signal.SIGKILL)
    original(self)

HostCache.flush = flush_then_die
train_and_evaluate(tiny_config(*{overrides!r}), {run_dir!r}, log=lambda *a: None)
"""


KILLED_RUN = [
    *BASE,
    *TIERED,
    "embedding.sharding=row",
    "train.log_every=1",
    "train.eval_every=0",
    "train.checkpoint_every=4",
    "train.steps=12",
]


def killed_then_resumed(tiny, tmp_path, script: str, overrides: list[str]) -> list[str]:
    """Runs ``overrides`` whole, then ``script`` (a run the script SIGKILLs in ``tmp_path /
    'killed'``), resumes that run and checks it ends bitwise as the whole one; returns the
    checkpoints the killed run left."""
    import subprocess
    import sys

    from dlrm_jax.train.trainer import train_and_evaluate
    from tests.helpers import QUIET, losses

    whole = train_and_evaluate(tiny(*overrides), tmp_path / "whole", **QUIET)
    (tmp_path / "kill.py").write_text(script)
    # The script imports tests.helpers (child_env puts the checkout on its PYTHONPATH) and runs
    # with this process's JAX settings (conftest's): this process resumes its run bitwise.
    env = child_env(drop=()) | {
        "XLA_FLAGS": f"--xla_force_host_platform_device_count=8 {COMPILE_FLAGS}",
        "JAX_PLATFORMS": "cpu",
        "JAX_DEFAULT_MATMUL_PRECISION": "highest",
    }
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "kill.py")], env=env, timeout=600, capture_output=True, text=True
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    left = sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir() if p.name.isdigit())
    resumed = train_and_evaluate(tiny(*overrides), tmp_path / "killed", **QUIET)
    assert losses(tmp_path / "killed") == losses(tmp_path / "whole")
    assert (resumed.auc, resumed.logloss) == (whole.auc, whole.logloss)
    return left


@pytest.mark.slow
def test_sigkill_mid_flush_then_resume_is_bitwise(tiny, tmp_path):
    """SIGKILL while the step-8 checkpoint flushes rows into the tier (the working files half
    written, no snapshot 8): re-running resumes from step 4 and ends bitwise as a run never
    killed."""
    overrides = [*KILLED_RUN, "mesh.devices=8"]
    script = KILL_MID_FLUSH.format(overrides=overrides, run_dir=str(tmp_path / "killed"))
    assert killed_then_resumed(tiny, tmp_path, script, overrides) == ["4"]


KILL_MID_IO = """
import os, pathlib, signal, threading
from tests.helpers import tiny_config
from dlrm_jax.embedding.tiers import chunk_io, tables
from dlrm_jax.train.trainer import train_and_evaluate

tables.MAPPED_SHARE = 0.0  # read as a tier larger than RAM is: requests, read ahead, written behind

original = chunk_io.ChunkFiles.run
checkpoints = pathlib.Path({run_dir!r}) / "checkpoints"

def run_then_die(self, batches, write, **kw):
    # On the {thread} thread, once checkpoint 4 is committed (orbax commits in the background):
    # half of this call's requests (one batch per table and field) done, the rest not, SIGKILL.
    mine = threading.current_thread().name.startswith({thread!r})
    if mine and write == {write!r} and len(batches) > 1 and (checkpoints / "4").is_dir():
        original(self, batches[: len(batches) // 2], write, **kw)
        os.kill(os.getpid(), signal.SIGKILL)
    original(self, batches, write, **kw)

chunk_io.ChunkFiles.run = run_then_die
train_and_evaluate(tiny_config(*{overrides!r}), {run_dir!r}, log=lambda *a: None)
"""


@pytest.mark.slow
@pytest.mark.parametrize("thread,write", [("tier-read-ahead", False), ("tier-write-behind", True)])
def test_sigkill_mid_read_ahead_or_write_behind_then_resume_is_bitwise(tiny, tmp_path, thread, write):
    """SIGKILL with the tier's reads made ahead, or its write-backs, half done after the step-4
    checkpoint: re-running resumes from there and ends bitwise as a run never killed."""
    overrides = [*KILLED_RUN, "mesh.devices=4", "embedding.tier.lookahead=2"]
    run_dir = str(tmp_path / "killed")
    script = KILL_MID_IO.format(overrides=overrides, run_dir=run_dir, thread=thread, write=write)
    assert "4" in killed_then_resumed(tiny, tmp_path, script, overrides)


def test_fills_that_overflow_beside_a_table_with_none_train_as_on_the_devices(tmp_path):
    """Before: where one tiered table's fills overflowed embedding.tier.fill_rows while another's
    batch needed none (hits, hot rows), the run stopped: 'zero-size array to reduction operation
    maximum which has no identity' (found by a config fuzz: bags, hot rows, a small fill_rows)."""
    from dlrm_jax.config import load_config
    from dlrm_jax.train.trainer import train_and_evaluate

    sets = [
        "train.steps=8",
        "mesh.devices=1",
        "train.batch_size=64",
        "train.progress_bar=false",
        "embedding.tier.fill_rows=2",
        "data.bag_sizes=2",
        "embedding.hot.rows=8",
        "embedding.hot.stats_batches=2",
        "embedding.hot.refresh_every=2",
    ]
    tiered = train_and_evaluate(load_config("smoke", [*sets, "embedding.storage=tiered"]), tmp_path / "a", log=None)
    devices = train_and_evaluate(load_config("smoke", sets), tmp_path / "b", log=None)
    # (to the last bits with XLA's optimizations, as a user compiles; the suite's unoptimized
    # compile orders this smoke model's sums differently in the two programs)
    np.testing.assert_allclose([tiered.loss, tiered.logloss], [devices.loss, devices.logloss], rtol=1e-6)
    assert tiered.auc == devices.auc


def test_a_tiered_plans_ids_buckets_are_the_device_plans(tiny):
    """A tiered table's cache slots go to the owner of the row each stands for: its buckets are
    measured by its rows. Before: routed through the cache's size, the rows' owners were wrong,
    buckets came out a third of the need (32 against 114) and every step overflowed."""
    from dlrm_jax.train.planning import plan_for_run

    sets = ("embedding.sharding=row", "data.cardinalities=[20000,5000,3000,50]", "train.batch_size=512")
    capacities = {}
    for storage in ("device", "tiered"):
        cfg = tiny(*sets, f"embedding.storage={storage}")
        plan = plan_for_run(cfg, 2, 1, SyntheticSource(cfg), True)
        assert bool(plan.tiered_tables) == (storage == "tiered")
        capacities[storage] = dict(plan.capacities)
    assert capacities["tiered"] == capacities["device"] and capacities["device"], capacities
