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


@settings(max_examples=examples(150))
@given(
    st.integers(1, 4),  # devices
    st.integers(1, 5),  # fill_rows
    st.lists(
        st.tuples(
            st.sampled_from(["row", "table", "column", "two_pieces"]),
            st.lists(st.integers(0, 3), max_size=40),  # each fill's space (taken mod devices)
        ),
        min_size=1,
        max_size=4,
    ),
    st.booleans(),  # one group, or a group a table
)
def test_overflowing_fills_split_into_programs_within_each_devices_capacity(devices, fill_rows, tables, one_group):
    """Every fill entry in one program; per program, no device gets more entries of a group
    than ``fill_rows``; a row's pieces on several devices in one program. Before: each table's
    fills were cut into as many slices as the busiest device needed, so with more tables than
    ``fill_rows`` on a device every slice overflowed it and the loop adding slices never ended."""
    from collections import Counter

    from dlrm_jax.embedding.tiers.cache_planner import Fills
    from dlrm_jax.embedding.tiers.fill_programs import FillPrograms
    from dlrm_jax.embedding.tiers.tables import _Piece

    programs = FillPrograms.__new__(FillPrograms)
    programs.pieces, programs.names, fills = {}, {}, {}
    for t, (kind, spaces) in enumerate(tables):
        group = "g" if one_group else f"g{t}"
        placed_on = {"row": [-1], "table": [t % devices], "column": list(range(devices))}.get(kind, [t % devices] * 2)
        programs.pieces[t] = [_Piece(group, 0, i, d) for i, d in enumerate(placed_on)]
        programs.names[t] = f"cat_{t}"
        space = np.array([s % devices for s in spaces], np.int64) if kind == "row" else np.zeros(len(spaces), np.int64)
        rows = np.arange(len(spaces), dtype=np.int64)
        fills[t] = Fills(space, rows, rows, np.full(len(spaces), -1, np.int64))
    programs.fill_rows = {p.group: fill_rows for ps in programs.pieces.values() for p in ps}
    if fill_rows < 2 and any(kind == "two_pieces" for kind, spaces in tables if spaces):
        with pytest.raises(ValueError, match="embedding.tier.fill_rows=1: a row of table cat_.* has 2 pieces"):
            programs._program_of(fills)
        return
    program_of = programs._program_of(fills)
    load = Counter()
    for t, f in fills.items():
        assert program_of[t].shape == (len(f),) and (program_of[t] >= 0).all()
        for i in range(len(f)):
            for p in programs.pieces[t]:
                load[(program_of[t][i], p.group, int(f.space[i]) if p.device < 0 else p.device)] += 1
    assert max(load.values(), default=0) <= fill_rows
