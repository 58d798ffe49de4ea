"""Tiered tables against the same tables on the devices: equal losses, tables and optimizer
state after 20 steps, with device caches far smaller than the working set (evictions every
step), the DRAM caches smaller still, every optimizer, one-hot and bags, 1 to 8 devices."""

import numpy as np
import pytest

from dlrm_jax.data.synthetic import SyntheticSource
from dlrm_jax.embedding.tiered import TieredTables
from dlrm_jax.parallel.mesh import make_mesh
from dlrm_jax.train.tier_runner import TierRunner
from dlrm_jax.train.trainer import build

STEPS = 20
BASE = ["data.cardinalities=[3000, 400, 10000, 70]", "train.batch_size=32"]
TIERED = ["embedding.table_storage=[cat_0=tiered, cat_2=tiered]", "embedding.tier.device_cache_fraction=0.03",
          "embedding.tier.host_cache_fraction=0.02"]
BAGS = ["data.bag_sizes=[3, 1, 4, 2]", "data.pooling=mean"]


def train(cfg, devices, root=None, steps=STEPS):
    """(losses, per-table values, per-table optimizer state, plan, stats) after ``steps``."""
    source = SyntheticSource(cfg)
    plan, fns = build(cfg, make_mesh(devices), source, log=lambda *a: None)
    state = fns.init_state()
    losses, stats = [], {}
    if not plan.tiered_tables:
        for i in range(steps):
            state, out = fns.train_step(state, fns.device_batch(source.train_batch(i)))
            losses.append(np.asarray(out["loss"]))
        values, slots = fns.collection.logical_tables(state.emb)
        return losses, values, slots, plan, stats
    tiered = TieredTables(plan, fns.collection.groups, fns.collection.optimizer, root, fns.embedding_key(),
                          log=lambda *a: None)
    runner = TierRunner(fns, tiered, cfg.embedding.tier.lookahead)
    for batch, fills in runner.planned(source.train_batch, range(steps)):
        state, out = runner.train(state, batch, fills)
        losses.append(np.asarray(out["loss"]))
    tiered.sync_to_host(state.emb.tables, state.emb.slots)
    values, slots = fns.collection.logical_tables(state.emb)
    values, slots = list(values), list(slots)
    for t in plan.tiered_tables:
        got = tiered.host[t].get(np.arange(plan.tables[t].spec.rows))
        values[t], slots[t] = got.pop("values"), got
    stats = dict(tiered.stats)
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
# and a fill capacity of 4 rows (most steps overflow it and fill in extra rounds).
CASES = [("row", 8, "rowwise_adagrad", "onehot", 0, 0), ("row", 8, "adagrad", "ids", 2, 0),
         ("table", 1, "sgd", "ids", 0, 0), ("table", 8, "rowwise_adagrad", "pooled", 3, 4),
         ("column", 8, "adagrad", "onehot", 1, 0), ("row_cyclic", 4, "sgd", "pooled", 2, 0)]


@pytest.mark.parametrize("strategy,devices,optimizer,bags,lookahead,fill_rows", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_tiered_equals_all_in_device(tiny, tmp_path, strategy, devices, optimizer, bags, lookahead, fill_rows):
    sharding = {"row_cyclic": ["embedding.sharding=row", "embedding.row_layout=cyclic"]}.get(
        strategy, [f"embedding.sharding={strategy}"])
    extra = [] if bags == "onehot" else [*BAGS, f"embedding.bag_exchange={bags}"]
    common = [*BASE, *sharding, *extra, f"embedding.optimizer={optimizer}", f"embedding.tier.lookahead={lookahead}",
              f"embedding.tier.fill_rows={fill_rows}"]
    reference = train(tiny(*common), devices)
    tiered = train(tiny(*common, *TIERED), devices, tmp_path / "tier")
    assert tiered[3].tiered_tables == (0, 2)
    stats = tiered[4]
    assert stats["rows_evicted"] > 5 * STEPS  # the caches were far too small for the run
    if lookahead == 0:
        assert stats["rows_forwarded"] > 0  # rows evicted by one step and re-read by the next
    if fill_rows:
        assert stats.get("fill_rounds", 0) > STEPS  # overflowing fills ran in extra rounds
    assert_same_training(reference, tiered)


def test_trainer_resumes_tiered_runs_bitwise_and_matches_device(tiny, tmp_path):
    """Through train_and_evaluate: a tiered run cut after its step-4 checkpoint and resumed
    (the tier restored to its snapshot, caches cold) equals the uninterrupted run, and both
    equal the all-in-device run, loss by loss and in the final AUC."""
    from test_train import QUIET, losses

    from dlrm_jax.train.trainer import train_and_evaluate

    common = [*BASE, "mesh.devices=8", "embedding.sharding=row", "train.log_every=1", "train.eval_every=4"]
    tiered = [*common, *TIERED, "train.checkpoint_every=4"]
    device = train_and_evaluate(tiny(*common, "train.steps=8"), tmp_path / "device", **QUIET)
    whole = train_and_evaluate(tiny(*tiered, "train.steps=8"), tmp_path / "whole", **QUIET)
    train_and_evaluate(tiny(*tiered, "train.steps=4"), tmp_path / "cut", **QUIET)
    resumed = train_and_evaluate(tiny(*tiered, "train.steps=8"), tmp_path / "cut", **QUIET)
    assert losses(tmp_path / "cut") == losses(tmp_path / "whole") == losses(tmp_path / "device")
    assert (resumed.auc, resumed.logloss) == (whole.auc, whole.logloss) == (device.auc, device.logloss)
    assert sorted(p.name for p in (tmp_path / "cut" / "tier" / "snapshots").iterdir()) == ["4", "8"]
