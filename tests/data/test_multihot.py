"""MLPerf DLRM-DCNv2's one-hot -> multi-hot rule (dlrm_jax.data.preprocessing.multihot) against a per-row model.

The model below follows the structure of mlcommons/training
recommendation_v2/torchrec_dlrm/multi_hot.py (Multihot.__make_multi_hot_indices_tables) and
scripts/materialize_synthetic_multihot_dataset.py: the global legacy NumPy generator seeded with 0
once, then per feature a table [card, bag] whose column 0 is the row's own id and whose other
columns are drawn; each sample's bag is the table row of its id.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm_jax.data.preprocessing.multihot import MLPERF_DCNV2_BAG_SIZES, MultiHotRule, table_bytes
from tests.helpers import REPO, examples

# Tiny, single-row, bag-1 and large features, with a 100-wide bag like MLPerf's feature 20.
CARDS = (3, 4, 10, 1, 1000, 200_000, 2_000_000, 7, 1)
BAGS = (3, 1, 5, 4, 100, 2, 3, 1, 2)
N = 5000  # more than one 4096-row block of expand


def model_tables(cards, bags, distribution):
    """The reference's lookup tables, drawn the way it draws them (global np.random, int64)."""
    saved = np.random.get_state()
    try:
        np.random.seed(0)
        tables = []
        for card, bag in zip(cards, bags, strict=True):
            own = np.arange(card)[:, None]
            if distribution == "uniform":
                drawn = np.random.randint(0, card, size=(card, bag - 1))
            else:
                with np.errstate(invalid="ignore"):
                    drawn = np.random.pareto(a=0.25, size=(card, bag - 1)).astype(np.int32) % card
            tables.append(np.concatenate((own, drawn), axis=-1))
        return tables
    finally:
        np.random.set_state(saved)


def model_expand(tables, ids):
    """Row by row, feature by feature: the bag of each id, concatenated."""
    rows = []
    for r in range(ids.shape[0]):
        row = []
        for f, table in enumerate(tables):
            row.extend(int(v) for v in table[int(ids[r, f])])
        rows.append(row)
    return np.array(rows, dtype=np.int32).reshape(ids.shape[0], -1)


def random_ids(cards, n, seed):
    rng = np.random.default_rng(seed)
    return np.stack([rng.integers(0, c, n, dtype=np.int32) for c in cards], axis=1)


@functools.cache
def rule(distribution="uniform"):
    return MultiHotRule(CARDS, BAGS, distribution)


@pytest.mark.parametrize("distribution", ["uniform", "pareto"])
def test_matches_per_row_model(distribution):
    ids = random_ids(CARDS, N, seed=1)
    got = rule(distribution).expand(ids)
    assert got.dtype == np.int32 and got.shape == (N, sum(BAGS))
    np.testing.assert_array_equal(got, model_expand(model_tables(CARDS, BAGS, distribution), ids))


def test_stream_is_drawn_cell_by_cell_feature_after_feature():
    """Scalar draws, one per table cell in row-major order, continue one stream over features;
    bag-1 and single-row features draw nothing."""
    cards, bags = (3, 1, 4, 10, 2, 5), (3, 4, 1, 2, 6, 3)
    rs = np.random.RandomState(0)
    expected = [
        [[i] + [rs.randint(0, c) for _ in range(b - 1)] for i in range(c)] for c, b in zip(cards, bags, strict=True)
    ]
    r = MultiHotRule(cards, bags)
    for f, (c, b) in enumerate(zip(cards, bags, strict=True)):
        ids = np.zeros((c, len(cards)), np.int32)
        ids[:, f] = np.arange(c)
        got = r.expand(ids)[:, r.starts[f] : r.starts[f] + b]
        np.testing.assert_array_equal(got, expected[f])


@pytest.mark.parametrize("distribution", ["uniform", "pareto"])
def test_bag_structure_and_ranges(distribution):
    r = rule(distribution)
    ids = random_ids(CARDS, N, seed=2)
    out = r.expand(ids)
    for f, (card, bag, start) in enumerate(zip(CARDS, BAGS, r.starts, strict=True)):
        bags = out[:, start : start + bag]
        np.testing.assert_array_equal(bags[:, 0], ids[:, f])  # first element: the one-hot id
        assert bags.min() >= 0 and bags.max() < card
    assert r.starts == tuple(np.cumsum((0,) + BAGS[:-1]))


def test_deterministic_and_split_invariant():
    ids = random_ids(CARDS, N, seed=3)
    a = MultiHotRule(CARDS, BAGS).expand(ids)
    np.testing.assert_array_equal(a, rule().expand(ids))
    halves = np.concatenate([rule().expand(ids[:1234]), rule().expand(ids[1234:])])
    np.testing.assert_array_equal(a, halves)
    out = np.full((N, sum(BAGS)), -7, np.int32)
    assert rule().expand(ids, out=out) is out
    np.testing.assert_array_equal(out, a)
    assert rule().expand(ids[:0]).shape == (0, sum(BAGS))


def test_wrap_reduces_raw_ids_modulo_cardinality():
    raw = random_ids([2**31 - 1] * len(CARDS), 300, seed=4).astype(np.int64) - 2**30
    wrapped = raw % np.array(CARDS)
    np.testing.assert_array_equal(rule().expand(raw, wrap=True), rule().expand(wrapped))


@pytest.mark.parametrize("mmap", [True, False])
def test_save_load_round_trip(tmp_path, mmap):
    rule("pareto").save(tmp_path)
    loaded = MultiHotRule.load(tmp_path, mmap=mmap)
    assert loaded.distribution == "pareto" and loaded.cardinalities == list(CARDS)
    ids = random_ids(CARDS, 500, seed=5)
    np.testing.assert_array_equal(loaded.expand(ids), rule("pareto").expand(ids))
    assert isinstance(loaded.tables[4], np.memmap) == mmap


def test_mlperf_constants_match_config():
    config = REPO / "configs" / "mlperf_dlrm_dcnv2.yaml"
    data = yaml.safe_load(config.read_text())["data"]
    assert MLPERF_DCNV2_BAG_SIZES == tuple(data["bag_sizes"])
    assert len(MLPERF_DCNV2_BAG_SIZES) == 26 and sum(MLPERF_DCNV2_BAG_SIZES) == 214
    assert table_bytes(data["cardinalities"], MLPERF_DCNV2_BAG_SIZES) == 23_098_260_712


@settings(max_examples=examples(40))
@given(
    n=st.integers(0, 300),
    cut=st.integers(0, 300),
    seed=st.integers(0, 2**32 - 1),
    distribution=st.sampled_from(["uniform", "pareto"]),
)
def test_property_split_invariant_and_in_range(n, cut, seed, distribution):
    r = rule(distribution)
    ids = random_ids(CARDS, n, seed)
    cut = min(cut, n)
    whole = r.expand(ids)
    np.testing.assert_array_equal(whole, np.concatenate([r.expand(ids[:cut]), r.expand(ids[cut:])]))
    for card, bag, start in zip(CARDS, BAGS, r.starts, strict=True):
        assert np.all((whole[:, start : start + bag] >= 0) & (whole[:, start : start + bag] < card))


@pytest.mark.parametrize(
    "args, match",
    [
        (((3, 4), (1,)), "2 cardinalities but 1 bag sizes"),
        (((), ()), "no features"),
        (((3, 0), (1, 1)), r"cardinalities must lie in \[1, 2\*\*31 - 1\]"),
        (((3, 4), (1, 0)), "bag sizes must be >= 1"),
        (((3, 4), (1, 2), "zipf"), "distribution must be one of"),
    ],
)
def test_constructor_errors(args, match):
    with pytest.raises(ValueError, match=match):
        MultiHotRule(*args)


def test_expand_errors():
    r = MultiHotRule((3, 5), (2, 1))
    with pytest.raises(ValueError, match=r"ids must have shape \[n, 2\], got \(4, 3\)"):
        r.expand(np.zeros((4, 3), np.int32))
    with pytest.raises(ValueError, match="ids must be integers, got float32"):
        r.expand(np.zeros((4, 2), np.float32))
    with pytest.raises(ValueError, match=r"feature 1: id 5 outside \[0, 5\)"):
        r.expand(np.array([[0, 1], [2, 5]], np.int32))
    with pytest.raises(ValueError, match=r"feature 0: id -1 outside \[0, 3\)"):
        r.expand(np.array([[-1, 1]], np.int32))
    with pytest.raises(ValueError, match=r"out is int64 \(1, 3\), expected int32 \(1, 3\)"):
        r.expand(np.zeros((1, 2), np.int32), out=np.zeros((1, 3), np.int64))
    with pytest.raises(ValueError, match=r"table 0 is int32 \(3, 2\), expected int32 \(3, 1\)"):
        tables = [np.zeros((3, 2), np.int32), np.zeros((5, 0), np.int32)]
        MultiHotRule((3, 5), (2, 1), tables=tables)
