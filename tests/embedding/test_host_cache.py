"""The DRAM cache against a plain dict model: reads always return the newest rows (cached,
written back, or in the tier), dirty rows reach the tier when evicted or flushed."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm_jax.embedding.tiers.dram_cache import HostCache
from dlrm_jax.embedding.tiers.store import TierStore
from tests.helpers import examples

ROWS = 40


def store(tmp_path):
    fields = {"values": ((3,), "float32"), "accumulator": ((), "float32")}
    init = lambda name, a, b: {
        "values": np.arange(a, b, dtype=np.float32)[:, None].repeat(3, 1),
        "accumulator": np.zeros(b - a, np.float32),
    }
    return TierStore.create(tmp_path, {"t": (ROWS, fields)}, init, chunk_rows=8)


ops = st.lists(
    st.tuples(
        st.sampled_from(["get", "put", "flush", "expect"]),
        st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=12, unique=True),
    ),
    max_size=25,
)


@settings(max_examples=examples(40))
@given(ops=ops, capacity=st.integers(1, 16), policy=st.sampled_from(["lru", "lfu", "tinylfu"]))
def test_reads_see_the_newest_rows(tmp_path_factory, ops, capacity, policy):
    tier = store(tmp_path_factory.mktemp("tier"))
    cache = HostCache(tier, "t", capacity, policy)
    model = {r: float(r) for r in range(ROWS)}
    for i, (op, rows) in enumerate(ops):
        rows = np.array(rows, np.int64)
        if op == "get":
            got = cache.get(rows)
            np.testing.assert_array_equal(got["values"][:, 0], [model[r] for r in rows])
        elif op == "put":
            vals = 1000.0 * (i + 1) + rows
            cache.put(
                rows,
                {"values": np.repeat(vals[:, None], 3, 1).astype(np.float32), "accumulator": vals.astype(np.float32)},
            )
            model.update(zip(rows.tolist(), vals.tolist(), strict=True))
        elif op == "expect":  # a batch planned ahead expects rows; batches before it have run
            cache.expect(rows, batch=i + 2)
            cache.next_batch = i
        else:
            cache.flush()
        assert (cache.row_of >= 0).sum() <= capacity
    cache.flush()
    on_disk = tier.read("t", np.arange(ROWS))
    np.testing.assert_array_equal(on_disk["values"][:, 0], [model[r] for r in range(ROWS)])
    np.testing.assert_array_equal(
        on_disk["accumulator"][[r for r in range(ROWS) if model[r] >= 1000]],
        [model[r] for r in range(ROWS) if model[r] >= 1000],
    )
    tier.close()


def test_rows_a_planned_batch_expects_are_evicted_last_until_it_runs(tmp_path):
    """The planner skips reading ahead rows DRAM holds and marks them expected by their batch:
    a wave of misses evicts other rows first (a row evicted anyway would be read at its step,
    on the dispatching thread). Once the batch ran, they are ordinary rows again."""
    cache = HostCache(store(tmp_path), "t", 16, "lru")
    cache.get(np.arange(4))
    cache.get(np.arange(4, 16))  # full; rows 0-3 the least recently used
    held = cache.expect(np.array([0, 1, 2, 3, 30]), batch=5)
    np.testing.assert_array_equal(held, [True, True, True, True, False])
    cache.next_batch = 2  # batches 2-5 not run yet
    cache.get(np.arange(16, 24))  # 8 misses: 8 slots freed
    assert (cache.slot_of[:4] >= 0).all(), "rows batch 5 expects were evicted before it ran"
    cache.next_batch = 6  # batch 5 ran
    cache.get(np.arange(24, 40))  # 16 misses: the whole cache turns over
    assert (cache.slot_of[:4] < 0).all()
    cache.expect(np.arange(24, 40), batch=9)  # every slot expected: misses still find room
    cache.get(np.arange(0, 4))
    assert (cache.row_of >= 0).sum() == 16


def test_tinylfu_admission_keeps_frequent_rows_through_a_scan_of_one_time_rows(tmp_path):
    """TinyLFU admits a missed row only once the sketch saw it twice: a scan of rows asked for
    once passes through without evicting the rows asked for every batch, which plain LRU loses.
    Dirty rows it does not admit reach the tier at once."""
    tier = store(tmp_path)
    kept = {}
    for policy in ("lru", "tinylfu"):
        cache = HostCache(tier, "t", 8, policy)
        hot = np.arange(4)
        for batch in range(3):
            cache.get(hot)
            cache.get(np.arange(8 + 8 * batch, 16 + 8 * batch))  # 8 rows, each asked for once
        kept[policy] = int((cache.slot_of[hot] >= 0).sum())
    assert kept == {"lru": 0, "tinylfu": 4}, kept
    assert cache.not_admitted > 0
    cache.put(np.array([39]), {"values": np.full((1, 3), 7.0, np.float32), "accumulator": np.ones(1, np.float32)})
    assert cache.slot_of[39] < 0  # never asked for: not admitted, written through
    np.testing.assert_array_equal(tier.read("t", np.array([39]))["values"], [[7.0, 7.0, 7.0]])
    tier.close()


@settings(max_examples=examples(12))
@given(rows=st.integers(50, 2000), exponent=st.sampled_from([0.0, 0.8, 1.1, 1.4]), fraction=st.floats(0.01, 0.6))
def test_predicted_lru_hit_rate_matches_a_simulated_lru(rows, exponent, fraction):
    """The plan's cache model (Che's approximation) against an LRU replayed over independent
    draws from the same row probabilities: within a few points of the hit rate."""
    import collections

    from dlrm_jax.embedding.tiers.setup import che_hit_rate

    p = 1.0 / np.arange(1, rows + 1) ** exponent
    p /= p.sum()
    capacity = max(1, int(fraction * rows))
    draws = np.random.default_rng(rows).choice(rows, size=40_000, p=p)
    lru, hits = collections.OrderedDict(), 0
    for i, r in enumerate(draws.tolist()):
        if r in lru:
            hits += i >= 10_000  # after a warm-up
            lru.move_to_end(r)
        else:
            lru[r] = None
            if len(lru) > capacity:
                lru.popitem(last=False)
    predicted = che_hit_rate((p, np.ones(rows)), capacity)
    assert abs(predicted - hits / 30_000) < 0.03
    assert che_hit_rate((p, np.ones(rows)), rows) == 1.0 and che_hit_rate((p, np.ones(rows)), 0) == 0.0


TIERED = (
    "data.cardinalities=[3000, 400, 10000, 70]",
    "embedding.table_storage=[cat_0=tiered, cat_2=tiered]",
    "embedding.tier.device_cache_fraction=0.05",
    "embedding.optimizer=rowwise_adagrad",
)


def test_dram_caches_default_to_half_the_memory_available(tiny):
    """``host_cache_fraction=0``: the DRAM caches together take half the memory available when
    the run plans (all rows when that fits); the plan's host rows follow, and say so."""
    from dlrm_jax.data.sources.synthetic import SyntheticSource
    from dlrm_jax.embedding.tiers import setup
    from dlrm_jax.parallel.mesh import make_mesh
    from dlrm_jax.train.build import build

    cfg = tiny(*TIERED)
    assert cfg.embedding.tier.host_cache_fraction == 0  # the shipped default
    plan, _ = build(cfg, make_mesh(2), SyntheticSource(cfg), log=lambda *a: None)
    row = 4 * plan.tables[0].spec.dim + 4  # float32 values, one Adagrad accumulator
    total = 13000 * row
    said = []
    assert setup.host_cache_fraction_from_memory(plan, total, said.append) == 0.5
    assert "50.0% of the tiered rows" in said[0] and "host_cache_fraction" in said[0]
    assert setup.host_cache_fraction_from_memory(plan, 10 * total, said.append) == 1.0
    assert setup.host_cache_fraction_from_memory(plan, None, said.append) == setup.DEFAULT_HOST_FRACTION
    # The machine running this test has far more than 2 x 52 KB available: every row.
    assert plan.tier.host_rows[0] == 3000 and plan.tier.host_rows[2] == 10000
    # embedding.tier.host_cache_rows sizes them itself (before: the run still said "DRAM caches:
    # 100.0% of the tiered rows" from the memory, of caches of 1,000 rows)
    said = []
    plan, _ = build(
        tiny(*TIERED, "embedding.tier.host_cache_rows=1000"), make_mesh(2), SyntheticSource(cfg), log=said.append
    )
    assert plan.tier.host_rows[0] == 1000 and not [x for x in said if x.startswith("DRAM caches")], said
