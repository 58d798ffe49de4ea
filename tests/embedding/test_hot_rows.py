"""Hot rows replicated on every device, against the plain single-device reference.

The reference knows nothing of hot rows: one table per feature, the textbook optimizer on the
full-table gradient. With some rows hot (and the hot set switched mid-run), the collection must
give the same forward vectors, tables and optimizer state: every strategy, one-hot and bags,
each optimizer, 1 to 8 devices. A refresh must not change the logical state by a single bit.
"""

import dataclasses
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlrm_jax.data.sources.synthetic import SyntheticSource
from dlrm_jax.embedding.hot.counts import RowCounts
from dlrm_jax.embedding.hot.index import hot_keys
from dlrm_jax.embedding.plan.embedding_plan import HotPlan
from dlrm_jax.train.wiring import plan_from_config
from tests.embedding.reference_checks import CARDS, build, check_against_reference, logical, strategy_overrides
from tests.helpers import QUIET, examples

ROWS = [50, 9, 120, 7, 33]
BAGS = "data.bag_sizes=[3, 1, 4, 2, 2]"


def with_hot(cfg, devices, capacity):
    return dataclasses.replace(plan_from_config(cfg, devices), hot=HotPlan(capacity))


def frequent_keys(cfg, capacity, skip=0):
    """The rows most looked up in the first batches (so the hot path is taken), plus each
    table's last row (a table edge), ``skip`` of the most frequent left out."""
    counts = RowCounts.from_batches([SyntheticSource(cfg).train_batch(i).ids for i in range(3)], cfg.bag_sizes)
    per = capacity // len(ROWS) - 1
    rows = [np.union1d(counts.most_frequent(t, per + skip)[skip:], [ROWS[t] - 1]) for t in range(len(ROWS))]
    return hot_keys(rows, capacity)


# In CI, a cover of every strategy and row layout, every device count, each optimizer with one-hot
# ids, bags the requester pools and bags the owners pool; the hot set changes before steps 2 and 4.
# DLRM_JAX_FULL_MATRIX=1 runs the whole cross product (252 cases, 30-50 minutes on 2 cores).
COVER = [
    ("replicated", 2, "sgd", "bags"),
    ("table", 1, "rowwise_adagrad", "bags"),
    ("row", 8, "rowwise_adagrad", "onehot"),
    ("row_cyclic", 4, "sgd", "bags"),
    ("column", 8, "adagrad", "bags"),
    ("column", 2, "rowwise_adagrad", "onehot"),
    ("auto", 4, "rowwise_adagrad", "pooled"),
    ("mixed", 8, "adagrad", "pooled"),
    ("mixed_hosts", 8, "sgd", "pooled"),
    ("row_two_levels", 8, "adagrad", "bags"),  # the cold ids in two levels, 2 hosts of 4
]
CASES = COVER
if os.environ.get("DLRM_JAX_FULL_MATRIX") == "1":
    CASES = list(
        itertools.product(
            ["replicated", "table", "row", "row_cyclic", "column", "auto", "mixed"],
            [1, 2, 4, 8],
            ["sgd", "adagrad", "rowwise_adagrad"],
            ["onehot", "bags", "pooled"],
        )
    )


@pytest.mark.parametrize("strategy,devices,optimizer,bags", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_hot_rows_match_reference_across_refreshes(tiny, strategy, devices, optimizer, bags):
    extra = {
        "onehot": [],
        "bags": [BAGS, "data.pooling=mean", "embedding.bag_exchange=ids"],
        "pooled": [BAGS, "data.pooling=mean", "embedding.bag_exchange=pooled"],
    }[bags]
    two_levels = strategy == "row_two_levels"
    overrides = ["embedding.sharding=row", "cluster.devices_per_host=4"] if two_levels else strategy_overrides(strategy)
    cfg = tiny(f"embedding.optimizer={optimizer}", "train.batch_size=32", CARDS, *extra, *overrides)
    first, second = frequent_keys(cfg, 20), frequent_keys(cfg, 20, skip=2)
    plan = dataclasses.replace(with_hot(cfg, devices, 20), ids_hosts=2 if two_levels else 1)
    coll, state = check_against_reference(cfg, devices, plan=plan, hot_keys=first, refresh={2: second, 4: first})
    assert two_levels == any(type(f).__name__ == "HostIdsForm" for f in coll.forms)
    _, res = jax.jit(coll.lookup)(state, jnp.asarray(SyntheticSource(cfg).train_batch(0).ids))
    hits, lookups = np.asarray(res.hot_counts).tolist()
    assert 0.2 * lookups < hits < lookups  # both paths carry lookups
    pooled = any(type(f).__name__ == "PooledForm" for f in coll.forms)
    fixed = any(t.strategy.value in ("table", "column") for t in coll.plan.tables)
    assert pooled == (bags == "pooled" and fixed)


@pytest.mark.parametrize("which", ["empty", "every_row"])
def test_hot_set_empty_or_whole_tables(tiny, which):
    """No row hot (every key padding), or every row of every table hot (the exchange idle)."""
    cfg = tiny("embedding.optimizer=rowwise_adagrad", "embedding.sharding=row", "train.batch_size=32", CARDS, BAGS)
    capacity = sum(ROWS)
    rows = [np.arange(r) for r in ROWS] if which == "every_row" else [np.zeros(0, int)] * len(ROWS)
    coll, state = check_against_reference(
        cfg, 4, steps=3, plan=with_hot(cfg, 4, capacity), hot_keys=hot_keys(rows, capacity)
    )
    _, res = jax.jit(coll.lookup)(state, jnp.asarray(SyntheticSource(cfg).train_batch(0).ids))
    hits, lookups = np.asarray(res.hot_counts).tolist()
    assert hits == (lookups if which == "every_row" else 0)


@pytest.fixture(scope="module")
def trained_collection():
    """Row-wise (block) tables with column-sliced and replicated ones beside them, row-wise
    Adagrad, on 4 devices, after a few steps: every kind of owner a hot row can come from."""
    from tests.helpers import tiny_config

    cfg = tiny_config(
        "embedding.optimizer=rowwise_adagrad",
        "embedding.sharding=row",
        "train.batch_size=32",
        CARDS,
        BAGS,
        "embedding.table_sharding=[cat_1=replicated, cat_2=column]",
    )
    coll = build(cfg, 4, with_hot(cfg, 4, 12))
    state = coll.init(jax.random.key(0))
    lookup, update = jax.jit(coll.lookup), jax.jit(coll.apply_gradients)
    source = SyntheticSource(cfg)
    for step in range(3):
        state = coll.refresh(state, frequent_keys(cfg, 12, skip=step))
        pooled, res = lookup(state, jnp.asarray(source.train_batch(step).ids))
        state = update(state, res, jnp.ones_like(pooled) * 0.1, jnp.float32(0.05))
    return coll, state


edge_ids = st.lists(
    st.tuples(st.integers(0, len(ROWS) - 1), st.sampled_from(["first", "last", "any"]), st.integers(0, 10**6)),
    max_size=12,
)


@settings(max_examples=examples(25), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(picks=edge_ids)
def test_refresh_leaves_every_table_bit_for_bit(trained_collection, picks):
    """Any hot set (table edges, duplicates across picks, fewer rows than the capacity): the
    logical tables and optimizer state after a refresh are bitwise those before, and the hot
    copies hold exactly their rows."""
    coll, state = trained_collection
    rows = [set() for _ in ROWS]
    for t, where, r in picks:
        rows[t].add({"first": 0, "last": ROWS[t] - 1, "any": r % ROWS[t]}[where])
    keys = hot_keys([np.array(sorted(r), np.int64) for r in rows], 12)
    before_t, before_a = logical(coll, state)
    state = coll.refresh(jax.tree.map(jnp.copy, state), keys)
    after_t, after_a = logical(coll, state)
    np.testing.assert_array_equal(after_t, before_t)
    np.testing.assert_array_equal(after_a, before_a)
    offsets = np.concatenate([[0], np.cumsum(ROWS)[:-1]])
    n = sum(len(r) for r in rows)
    flat = offsets[keys[0, :n]] + keys[1, :n]
    np.testing.assert_array_equal(np.asarray(state.hot.values)[:n], before_t[flat])
    np.testing.assert_array_equal(np.asarray(state.hot.slots["accumulator"])[:n], before_a[flat])
    assert not np.asarray(state.hot.values)[n:].any()


# ---------------------------------------------------------------- through the trainer


def restored(cfg, run_dir):
    """(steps, state) of a run dir's newest checkpoint, built as training builds it."""
    from dlrm_jax.data.sources import make_source
    from dlrm_jax.parallel.mesh import make_mesh
    from dlrm_jax.train.build import build
    from dlrm_jax.train.checkpoint import Checkpoints
    from dlrm_jax.train.restore import restore_state

    _, steps = build(cfg, make_mesh(cfg.mesh.devices), make_source(cfg), **QUIET)
    return steps, restore_state(steps, Checkpoints(run_dir / "checkpoints", 3), **QUIET)


def hot_run(tiny, *extra):
    return tiny(
        "train.log_every=1",
        "embedding.sharding=row",
        "data.id_layout=frequency_ordered",
        CARDS,
        "embedding.hot.rows=24",
        "embedding.hot.stats_batches=2",
        "embedding.hot.refresh_every=3",
        *extra,
    )


@pytest.mark.slow
def test_resume_across_refreshes_and_restore_elsewhere(tiny, tmp_path):
    """Refreshes after steps 3, 6, 9, each from the counts of the two batches before it; the
    run is cut after step 5, inside the window of the refresh at 6 (batch 4 counted before
    the cut, batch 5 after). Every loss, the final tables, hot set and counts: bit for bit.
    And against a run that replicates nothing: the same losses to float32 rounding."""
    from dlrm_jax.train.trainer import train_and_evaluate
    from tests.helpers import losses

    cfg = hot_run(tiny, "mesh.devices=8", "train.steps=10", "train.checkpoint_every=5")
    whole = train_and_evaluate(cfg, tmp_path / "whole", **QUIET)
    train_and_evaluate(
        hot_run(tiny, "mesh.devices=8", "train.steps=10", "embedding.hot.rows=0"), tmp_path / "cold", **QUIET
    )
    np.testing.assert_allclose(losses(tmp_path / "whole"), losses(tmp_path / "cold"), rtol=1e-5)
    train_and_evaluate(hot_run(tiny, "mesh.devices=8", "train.steps=5"), tmp_path / "cut", **QUIET)
    resumed = train_and_evaluate(cfg, tmp_path / "cut", **QUIET)
    assert losses(tmp_path / "cut") == losses(tmp_path / "whole")
    assert (resumed.auc, resumed.logloss) == (whole.auc, whole.logloss)
    (steps_a, a), (steps_b, b) = restored(cfg, tmp_path / "whole"), restored(cfg, tmp_path / "cut")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert steps_a.hot.to_json() == steps_b.hot.to_json()
    from dlrm_jax.data.sources import make_source
    from dlrm_jax.train.hot_setup import initial_counts

    first = hot_keys(initial_counts(make_source(cfg), cfg.embedding.hot.stats_batches, cfg.bag_sizes).top_rows(24), 24)
    assert not np.array_equal(np.asarray(a.emb.hot.keys), first)  # the refreshes did move the set
    events = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < e["hot_hit_rate"] < 1 and e["allreduce_bytes"] > 0 and e["a2a_bytes"] > 0 for e in events)

    # The same checkpoint restored onto 2 devices without hot rows, and onto 4 with 8 (then
    # trained on): the logical tables and optimizer state are bitwise the saved ones.
    want = steps_a.collection.logical_tables(a.emb)
    from dlrm_jax.embedding.exchange.relayout import tables_on_host  # (what exports read: hot rows from their copies)

    for t, values, opt in tables_on_host(steps_a.collection, a.emb):
        np.testing.assert_array_equal(values, np.asarray(want[0][t]))
        for k, v in opt.items():
            np.testing.assert_array_equal(v, np.asarray(want[1][t][k]))
    for devices, rows in ((2, 0), (4, 8)):
        other = hot_run(tiny, f"mesh.devices={devices}", "train.steps=10", f"embedding.hot.rows={rows}")
        steps, state = restored(other, tmp_path / "whole")
        assert steps.collection.plan.hot_rows == rows
        got = steps.collection.logical_tables(state.emb)
        for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    more = train_and_evaluate(
        dataclasses.replace(other, train=dataclasses.replace(other.train, steps=12)), tmp_path / "whole", **QUIET
    )
    assert more.step == 12
