"""Cache planning of tiered tables (host side, no JAX): property tests against a replay.

The replay applies every planned fill to a plain slot table, as the step will; the properties:
cache ids route to the owner of their logical row and name the slot that holds it, a fill's
evicted row is what its slot held, only uncached rows are filled, and a row a batch of the
lookahead window needs is never evicted when the cache can hold the window.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm_jax.data.batch import PAD_ID
from dlrm_jax.embedding.plan.embedding_plan import RowLayout, Strategy, TablePlan
from dlrm_jax.embedding.plan.layout import KIND_BLOCK, KIND_CYCLIC, KIND_FIXED
from dlrm_jax.embedding.plan.specs import TableSpec
from dlrm_jax.embedding.tiers.cache_planner import CacheTooSmall, TableCache, plan_stream
from tests.helpers import examples


def tiered(rows, strategy, layout="block", cache=4, devices=4):
    devs = tuple(range(devices)) if strategy == Strategy.ROW else (1,)
    return TablePlan(TableSpec("t", rows, 8), Strategy(strategy), devs, RowLayout(layout), cache)


def owner_of_cache_id(plan: TablePlan, n: int, cid: np.ndarray):
    """Where the device view routes a cache id: (owner, local slot)."""
    kind = (
        KIND_FIXED
        if plan.strategy != Strategy.ROW
        else (KIND_CYCLIC if plan.row_layout == RowLayout.CYCLIC else KIND_BLOCK)
    )
    if kind == KIND_BLOCK:
        return cid // plan.cache_rows, cid % plan.cache_rows
    if kind == KIND_CYCLIC:
        return cid % n, cid // n
    return np.zeros_like(cid), cid


batches_st = st.lists(st.lists(st.integers(-1, 59), min_size=1, max_size=10), min_size=1, max_size=12)


@settings(max_examples=examples(120))
@given(
    batches=batches_st,
    strategy=st.sampled_from(["row", "table", "column"]),
    layout=st.sampled_from(["block", "cyclic"]),
    cache=st.integers(3, 16),
    lookahead=st.integers(0, 3),
    devices=st.sampled_from([1, 2, 4]),
)
def test_planned_ids_name_the_slots_that_hold_their_rows(batches, strategy, layout, cache, lookahead, devices):
    plan = tiered(60, strategy, layout, cache, devices)
    tc = TableCache(plan, devices)
    spaces = tc.num_spaces
    ids = [np.array([PAD_ID if i < 0 else i for i in b], np.int32)[:, None] for b in batches]
    held = np.full((spaces, cache), -1)
    try:
        stream = list(plan_stream({0: tc}, np.zeros(1, np.int32), ids, lookahead))
    except CacheTooSmall:
        per_space = [
            max(np.bincount(tc.space_of(np.unique(b[b != PAD_ID])), minlength=spaces)) if (b != PAD_ID).any() else 0
            for b in ids
        ]
        assert max(per_space) > cache
        return
    for t, (orig, remapped, fills) in enumerate(stream):
        f = fills[0]
        assert np.array_equal(held[f.space, f.slot], f.evicted)  # evicted = what the slot held
        assert all(f.row[i] not in held[f.space[i]] for i in range(len(f)))  # only uncached rows are filled
        assert len(set(zip(f.space.tolist(), f.row.tolist(), strict=True))) == len(f)
        held[f.space, f.slot] = f.row
        valid = orig != PAD_ID
        assert np.array_equal(remapped == PAD_ID, ~valid)
        rows, cids = orig[valid].astype(np.int64), remapped[valid].astype(np.int64)
        owner, local = owner_of_cache_id(plan, devices, cids)
        assert np.array_equal(owner, tc.space_of(rows) if strategy == "row" else np.zeros_like(rows))
        assert ((0 <= local) & (local < cache)).all()
        assert np.array_equal(held[owner, local], rows)  # the slot holds the logical row
        # Window protection: with room for the window, no row a windowed batch needs leaves.
        window = ids[t + 1 : t + 1 + lookahead]
        if window and f.evicted.size:
            needed = np.unique(np.concatenate([w[w != PAD_ID] for w in window] + [orig[valid]]))
            per = np.bincount(tc.space_of(needed), minlength=spaces) if needed.size else np.zeros(spaces)
            if per.max() <= cache:
                assert not np.isin(f.evicted[f.evicted >= 0], needed).any()


def test_lru_order_and_refusal():
    tc = TableCache(tiered(100, "table", cache=3), 4)
    ids = lambda *r: np.array(r, np.int32)[:, None]
    _, f = tc.plan(ids(1, 2, 3))
    assert f.evicted.tolist() == [-1, -1, -1]
    tc.plan(ids(1))  # 1 used: 2 is now the least recently used
    _, f = tc.plan(ids(4))
    assert f.evicted.tolist() == [2] and f.row.tolist() == [4]
    with pytest.raises(CacheTooSmall, match="table t: a batch needs 4 distinct rows"):
        tc.plan(ids(5, 6, 7, 8))
    with pytest.raises(ValueError, match="id 100 outside"):
        tc.plan(ids(100))
