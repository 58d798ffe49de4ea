"""Hot-row statistics: sparse per-table counts, decay, the most frequent rows (hypothesis)."""

import collections
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm_jax.data.batch import PAD_ID
from dlrm_jax.embedding.hot.counts import RowCounts
from tests.helpers import examples

BAGS = [2, 1, 3]


def random_batches(seed, n_batches, batch, rows=30, pad_rate=0.3):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_batches):
        ids = rng.integers(0, rows, (batch, sum(BAGS))).astype(np.int32)
        ids[rng.random(ids.shape) < pad_rate] = PAD_ID
        out.append(ids)
    return out


def counted_by_hand(batches):
    per_table = [collections.Counter() for _ in BAGS]
    starts = np.cumsum([0, *BAGS])
    for ids in batches:
        for t in range(len(BAGS)):
            for v in ids[:, starts[t] : starts[t + 1]].reshape(-1):
                if v != PAD_ID:
                    per_table[t][int(v)] += 1
    return per_table


@settings(max_examples=examples(40))
@given(seed=st.integers(0, 2**16), n_batches=st.integers(0, 4), batch=st.integers(1, 20))
def test_counts_match_a_hand_count(seed, n_batches, batch):
    batches = random_batches(seed, n_batches, batch)
    counts = RowCounts.from_batches(batches, BAGS)
    for t, want in enumerate(counted_by_hand(batches)):
        assert dict(zip(counts.ids[t].tolist(), counts.counts[t].tolist(), strict=True)) == want
        assert np.all(np.diff(counts.ids[t]) > 0)  # sorted, distinct
    assert counts.lookups() == sum(sum(c.values()) for c in counted_by_hand(batches))


@settings(max_examples=examples(40))
@given(seed=st.integers(0, 2**16), factor=st.floats(0, 1))
def test_decay_is_factor_times_old_plus_new(seed, factor):
    old_b, new_b = random_batches(seed, 2, 8), random_batches(seed + 1, 2, 8)
    old, new = RowCounts.from_batches(old_b, BAGS), RowCounts.from_batches(new_b, BAGS)
    merged = old.decayed(factor, new)
    for t, (o, n) in enumerate(zip(counted_by_hand(old_b), counted_by_hand(new_b), strict=True)):
        want = {k: factor * o.get(k, 0) + n.get(k, 0) for k in set(o) | set(n)}
        want = {k: v for k, v in want.items() if v > 0}
        got = dict(zip(merged.ids[t].tolist(), merged.counts[t].tolist(), strict=True))
        assert got.keys() == want.keys()
        np.testing.assert_allclose([got[k] for k in sorted(got)], [want[k] for k in sorted(want)])


@settings(max_examples=examples(40))
@given(seed=st.integers(0, 2**16), k=st.integers(0, 40))
def test_most_frequent_rows_and_their_hit_rate(seed, k):
    batches = random_batches(seed, 3, 10)
    counts = RowCounts.from_batches(batches, BAGS)
    hand = counted_by_hand(batches)
    hot = [counts.most_frequent(t, k) for t in range(len(BAGS))]
    for t, rows in enumerate(hot):
        ranked = sorted(hand[t].items(), key=lambda kv: (-kv[1], kv[0]))
        assert rows.tolist() == [r for r, _ in ranked[:k]]
    total = sum(sum(c.values()) for c in hand)
    hits = sum(hand[t][int(r)] for t, rows in enumerate(hot) for r in rows)
    assert counts.hit_rate(hot) == pytest.approx(hits / total if total else 0.0)


def test_bad_decay_and_mismatched_tables_are_refused():
    a = RowCounts.empty(3)
    with pytest.raises(ValueError, match="decay factor"):
        a.decayed(1.5, a)
    with pytest.raises(ValueError, match="tables"):
        a.decayed(0.5, RowCounts.empty(2))


# ---------------------------------------------------------------- the performance model
def _engine(cfg, devices):
    from dlrm_jax.embedding.exchange.capacity import measure_capacities
    from dlrm_jax.train.wiring import plan_from_config

    plan = plan_from_config(cfg, devices)

    def measure(batches):
        return measure_capacities(plan, batches, plan.capacity_factor)

    return plan, measure


def _skewed_batches(rows, n_batches, batch, features, exponent, seed=0):
    """A frequency-ordered vocabulary: row 0 the most frequent, Zipf(exponent)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, rows + 1) ** exponent
    p /= p.sum()
    return [rng.choice(rows, size=(batch, features), p=p).astype(np.int32) for _ in range(n_batches)]


def test_model_replicates_the_hot_rows_of_a_frequency_ordered_vocabulary(tiny):
    """Row-wise block layout, hot ids at the bottom of every table: all on device 0. The model
    must replicate some, which lowers the busiest owner's bucket and the predicted time."""
    from dlrm_jax.embedding.hot.choice import choose_hot_rows

    cfg = tiny(
        "data.cardinalities=[4000, 4000]", "embedding.sharding=row", "train.batch_size=256", "embedding.optimizer=sgd"
    )
    plan, measure = _engine(cfg, 4)
    batches = _skewed_batches(4000, 4, 256, 2, 1.2)
    counts = RowCounts.from_batches(batches, [1, 1])
    best, priced = choose_hot_rows(plan, measure, counts, batches, memory_bytes=1 << 20)
    none = priced[0]
    assert none.rows == 0 and none.allreduce_bytes == 0 and none.hit_rate == 0.0
    assert best.rows > 0 and best.predicted_s < none.predicted_s
    assert max(c for _, c in best.capacities) < max(c for _, c in none.capacities)
    assert 0.0 < best.hit_rate <= 1.0 and best.memory_bytes <= 1 << 20


def test_model_never_predicts_worse_than_no_replication(tiny):
    """Uniform ids: replication saves little capacity and costs an all-reduce; whatever it
    picks is predicted no slower than nothing, and within the memory budget."""
    from dlrm_jax.embedding.hot.choice import choose_hot_rows

    cfg = tiny("data.cardinalities=[4000, 4000]", "embedding.sharding=row", "train.batch_size=256")
    plan, measure = _engine(cfg, 4)
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, 4000, (256, 2)).astype(np.int32) for _ in range(3)]
    counts = RowCounts.from_batches(batches, [1, 1])
    best, priced = choose_hot_rows(plan, measure, counts, batches, memory_bytes=64 * 1024)
    assert best.predicted_s <= priced[0].predicted_s
    assert best.memory_bytes <= 64 * 1024


@settings(max_examples=examples(30))
@given(seed=st.integers(0, 2**16), max_rows=st.integers(0, 500))
def test_candidate_sizes_follow_the_global_ranking(seed, max_rows):
    from dlrm_jax.embedding.hot.choice import candidate_sizes

    counts = RowCounts.from_batches(random_batches(seed, 3, 10, rows=200), BAGS)
    seen = [c.size for c in counts.ids]
    sizes = candidate_sizes(counts, max_rows)
    assert sizes[0] == (0,) * len(BAGS)
    totals = [sum(s) for s in sizes]
    assert totals == sorted(set(totals)) and totals[-1] == min(max_rows, sum(seen))
    for s in sizes:
        assert all(k <= n for k, n in zip(s, seen, strict=True))


@settings(max_examples=examples(60))
@given(seed=st.integers(0, 2**16), k=st.integers(0, 60), big=st.booleans())
def test_top_rows_and_truncation_follow_the_full_ranking(seed, k, big):
    """The threshold selection gives what ranking every row would, ties included (few
    distinct counts), on both counting paths (small ids: bincount; large ids: a sort)."""
    rng = np.random.default_rng(seed)
    scale = 10**9 if big else 1
    batches = [(rng.integers(0, 12, (20, sum(BAGS))) * scale).astype(np.int64) for _ in range(2)]
    counts = RowCounts.from_batches(batches, BAGS)
    hand = counted_by_hand(batches)
    ranked = sorted(((-n, t, r) for t, c in enumerate(hand) for r, n in c.items()))[:k]
    want = [sorted(r for _, tt, r in ranked if tt == t) for t in range(len(BAGS))]
    assert [rows.tolist() for rows in counts.top_rows(k)] == want
    kept = counts.truncated(k)
    for t in range(len(BAGS)):
        assert kept.ids[t].tolist() == want[t]
        assert kept.counts[t].tolist() == [hand[t][r] for r in want[t]]
    table, ids = counts.ranked()
    assert list(zip(table.tolist(), ids.tolist(), strict=True))[:k] == [(t, r) for _, t, r in ranked]


def test_counting_threads_and_a_resume_mid_window_change_no_bit():
    """The schedule counts on threads and sums the window at a refresh; saving its statistics
    in the middle of a window and loading them into a new schedule gives the same next hot
    set and counts as never stopping (whole-number window counts: order cannot matter)."""
    from dlrm_jax.embedding.hot.schedule import HotSchedule

    batches = random_batches(7, 12, 64, rows=500)
    first = RowCounts.from_batches(batches[:2], BAGS)

    def schedule():
        return HotSchedule(10, BAGS, first, window=4, refresh_every=6, decay=0.5, threads=3)

    whole = schedule()
    for b in batches[2:8]:
        whole.add(b)
    rows = whole.refresh()
    want = first.decayed(1.0, RowCounts.from_batches(batches[2:8], BAGS))
    assert [r.tolist() for r in rows] == [r.tolist() for r in want.top_rows(10)]

    stopped = schedule()
    for b in batches[2:5]:
        stopped.add(b)
    saved = json.loads(json.dumps(stopped.to_json()))
    stopped.close()
    resumed = schedule()
    resumed.load_json(saved)
    for b in batches[5:8]:
        resumed.add(b)
    assert [r.tolist() for r in resumed.refresh()] == [r.tolist() for r in rows]
    assert resumed.to_json() == whole.to_json()
    whole.close()
    resumed.close()


def test_hot_rows_are_at_most_the_tables_rows_and_count_in_the_budget(tiny):
    """Before: embedding.hot.rows=1,000,000 on tables of 6,350 rows sized its buffer and its
    all-reduce a step by the million (127 MiB a device, 53 MiB a step, 17x slower), and the
    hot buffers were never held to embedding.memory_budget_gb (65 MiB a device trained under
    a 10 MB budget): the budget was checked before they were added."""
    from dlrm_jax.data.sources.synthetic import SyntheticSource
    from dlrm_jax.embedding.plan.embedding_plan import PlanError
    from dlrm_jax.parallel.mesh import make_mesh
    from dlrm_jax.train.build import build

    cfg = tiny("embedding.hot.rows=1000000")
    said = []
    plan, _ = build(cfg, make_mesh(2), SyntheticSource(cfg), log=said.append)
    assert plan.hot_rows == sum(cfg.table_rows) and any("is more than the tables'" in x for x in said)
    small = tiny("embedding.hot.rows=1000000", "embedding.memory_budget_gb=0.0001")
    build(tiny("embedding.memory_budget_gb=0.0001"), make_mesh(2), SyntheticSource(small), log=said.append)  # fits
    with pytest.raises(PlanError, match=r"hot rows, over the .* budget \(embedding.memory_budget_gb\)"):
        build(small, make_mesh(2), SyntheticSource(small), log=said.append)
