"""Each sparse optimizer equals its dense counterpart on the full-table gradient.

The dense reference builds the R x D gradient by scatter-adding every looked-up row's
gradient (what autodiff of a gather would give), then applies the textbook update to every row.
Duplicates, padding ids and rows at the table's edges are all exercised.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm_jax.embedding.exchange.optimizers import adagrad, ftrl, rowwise_adagrad, sgd
from dlrm_jax.embedding.exchange.row_grads import (
    Lookups,
    buffer_row_sums,
    dense_row_sums,
    dense_sums_in_order,
    sum_by_row,
)
from tests.helpers import examples
from tests.reference import dense_reference

R, D = 23, 4


OPTIMIZERS = {"sgd": sgd(), "adagrad": adagrad(), "rowwise_adagrad": rowwise_adagrad(), "ftrl": ftrl()}
EXACT = {
    "sgd": sgd(exact_sums=True),
    "adagrad": adagrad(exact_sums=True),
    "rowwise_adagrad": rowwise_adagrad(exact_sums=True),
    "ftrl": ftrl(exact_sums=True),
}
LOOKUPS = 40  # every step padded to this many lookups with the padding row R: one compiled shape
UPDATES = {
    (name, exact): jax.jit((EXACT if exact else OPTIMIZERS)[name].update)
    for name in OPTIMIZERS
    for exact in (False, True)
}


def run_both(name, rows_steps, seed, exact=False):
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(R, D)).astype(np.float32)
    opt = (EXACT if exact else OPTIMIZERS)[name]
    state = opt.init(jnp.asarray(table))
    ref_table = table.astype(np.float64)
    ref_acc = {
        "sgd": None,
        "adagrad": np.zeros((R, D)),
        "rowwise_adagrad": np.zeros(R),
        "ftrl": (np.zeros((R, D)), np.full((R, D), 0.1)),
    }[name]
    jt = jnp.asarray(table)
    for rows in rows_steps:
        rows = np.asarray(rows, np.int32)
        grads = rng.normal(size=(len(rows), D)).astype(np.float32)
        pad = LOOKUPS - len(rows)  # padding lookups carry gradients too: they must change nothing
        padded_rows = np.concatenate([rows, np.full(pad, R, np.int32)])
        padded_grads = np.concatenate([grads, rng.normal(size=(pad, D)).astype(np.float32)])
        jt, state = UPDATES[name, exact](jt, state, jnp.asarray(padded_rows), jnp.asarray(padded_grads), 0.05)
        ref_table, ref_acc = dense_reference(name, ref_table, ref_acc, rows, grads, 0.05)
    np.testing.assert_allclose(np.asarray(jt), ref_table, rtol=2e-5, atol=2e-5)
    if name == "ftrl":
        for got, want in zip((state["z"], state["n"]), ref_acc, strict=True):
            np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    elif ref_acc is not None:
        np.testing.assert_allclose(np.asarray(state["accumulator"]), ref_acc, rtol=2e-5, atol=1e-6)


# Row R (and anything larger) is the padding id: it must change nothing, including row 0.
row_ids = st.integers(0, R)


@pytest.mark.parametrize("exact", [False, True], ids=["plain", "exact_sums"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@settings(max_examples=examples(25))
@given(steps=st.lists(st.lists(row_ids, min_size=1, max_size=40), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_sparse_equals_dense(name, exact, steps, seed):
    run_both(name, steps, seed, exact)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_exact_sums_give_the_same_bits_in_any_order(name):
    """What GPU atomics do to duplicates, done here by permuting the lookups."""
    rng = np.random.default_rng(7)
    rows = rng.integers(0, 4, 400).astype(np.int32)  # many duplicates of few rows
    grads = (rng.normal(size=(400, D)) * np.exp2(rng.uniform(-12, 12, (400, 1)))).astype(np.float32)
    opt = EXACT[name]
    table = jnp.asarray(rng.normal(size=(R, D)).astype(np.float32))
    outs = []
    for p in (np.arange(400), rng.permutation(400), rng.permutation(400)):
        out, state = opt.update(table, opt.init(table), jnp.asarray(rows[p]), jnp.asarray(grads[p]), 0.05)
        outs.append((np.asarray(out), [np.asarray(v) for v in state.values()]))
    for out, state in outs[1:]:
        np.testing.assert_array_equal(out, outs[0][0])
        for a, b in zip(state, outs[0][1], strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_edge_cases(name):
    run_both(name, [[5] * LOOKUPS], 0)  # all ids equal
    run_both(name, [list(range(R))], 1)  # all distinct, both table edges
    run_both(name, [[R] * 10], 2)  # only padding: nothing moves
    run_both(name, [[0, R, 0, R, R - 1]], 3)  # padding next to row 0


def test_padding_never_touches_row_zero():
    opt = rowwise_adagrad()
    table = jnp.ones((R, D))
    state = opt.init(table)
    out, state = opt.update(table, state, jnp.full((8,), R, jnp.int32), jnp.ones((8, D)), 1.0)
    np.testing.assert_array_equal(np.asarray(out), np.ones((R, D)))
    assert float(state["accumulator"].sum()) == 0.0


def test_ftrl_l1_keeps_rarely_pushed_weights_at_zero_and_l2_shrinks_the_rest():
    """Wide&Deep's reason for FTRL: a sparse linear model. |z| <= l1 gives exactly 0."""
    rows = jnp.asarray([1, 2, 2, 2, 2], jnp.int32)
    grads = jnp.asarray([[0.1], [1.0], [1.0], [1.0], [1.0]], jnp.float32)
    table = jnp.zeros((4, 1))
    plain = ftrl()
    sparse, l2 = ftrl(l1=0.5), ftrl(l2=10.0)
    out = {}
    for name, opt in (("plain", plain), ("l1", sparse), ("l2", l2)):
        out[name], _ = opt.update(table, opt.init(table), rows, grads, 0.1)
    assert float(out["plain"][1, 0]) < 0 and float(out["l1"][1, 0]) == 0.0  # |z| = 0.1 <= l1
    assert float(out["l1"][2, 0]) < 0  # |z| = 4 > l1: kept, shrunk toward 0
    assert abs(float(out["plain"][2, 0])) > abs(float(out["l1"][2, 0])) > 0
    assert abs(float(out["plain"][2, 0])) > abs(float(out["l2"][2, 0])) > 0
    np.testing.assert_allclose(float(out["plain"][2, 0]), -4.0 / (np.sqrt(0.1 + 16.0) / 0.1), rtol=1e-6)


# ---------------------------------------------------------------- lookups of pooled gradients


def bags(rng, samples, bag, rows, vectors, mean):
    """A batch of bags: rows [samples, slots] (some padding), each slot's vector, weights."""
    slot_vector = np.repeat(np.arange(vectors), bag)
    ids = rng.integers(0, rows + 1, (samples, vectors * bag)).astype(np.int32)  # rows: padding
    valid = (ids < rows).astype(np.float32)
    if not mean:
        return ids, slot_vector, valid
    count = np.stack([valid[:, slot_vector == v].sum(1) for v in range(vectors)], 1)
    return ids, slot_vector, valid / np.maximum(count[:, slot_vector], 1.0)


@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@settings(max_examples=examples(10), deadline=None)
@given(seed=st.integers(0, 2**16), bag=st.integers(1, 6), vectors=st.integers(1, 3))
def test_lookups_of_pooled_gradients_give_the_bits_of_one_gradient_per_lookup(name, mean, seed, bag, vectors):
    """The update reads each lookup's gradient from its bag's pooled gradient times its
    weight, never a row per lookup: the same bits as the per-lookup form, in the same order."""
    rng = np.random.default_rng(seed)
    ids, slot_vector, weights = bags(rng, 7, bag, R, vectors, mean)
    pooled = jnp.asarray(rng.normal(size=(7 * vectors, D)).astype(np.float32))
    lookups = Lookups.of_bags(jnp.asarray(ids), slot_vector, vectors, jnp.asarray(weights))
    table = jnp.asarray(rng.normal(size=(R, D)).astype(np.float32))
    opt = OPTIMIZERS[name]
    got = opt.update(table, opt.init(table), lookups, pooled, 0.05)
    per_lookup = pooled[lookups.sources] * lookups.weights[:, None]  # a gradient row per lookup
    want = opt.update(table, opt.init(table), lookups.rows, per_lookup, 0.05)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_duplicate_heavy_batches_match_the_dense_reference(name):
    """Bags of 100 on a 3-row table (4,000 lookups, each row over a thousand times), and one
    row looked up by every lookup of a batch."""
    rng = np.random.default_rng(11)
    opt = OPTIMIZERS[name]
    for ids in (rng.integers(0, 3, (40, 100)), np.zeros((40, 100), np.int64)):
        ids = ids.astype(np.int32)
        pooled = rng.normal(size=(40, D)).astype(np.float32) * 0.01
        lookups = Lookups.of_bags(jnp.asarray(ids), np.zeros(100, np.int32), 1)
        table = rng.normal(size=(R, D)).astype(np.float32)
        state = opt.init(jnp.asarray(table))
        got, state = jax.jit(opt.update)(jnp.asarray(table), state, lookups, jnp.asarray(pooled), 0.05)
        acc = {"sgd": None, "adagrad": np.zeros((R, D)), "rowwise_adagrad": np.zeros(R)}.get(
            name, (np.zeros((R, D)), np.full((R, D), 0.1))
        )
        grads = np.repeat(pooled, 100, axis=0)
        want, _ = dense_reference(name, table.astype(np.float64), acc, ids.reshape(-1), grads, 0.05)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_a_rows_gradient_is_the_sum_of_its_lookups_in_their_order():
    """The fixed order the same bits every run come from: a row's lookups, in the order given,
    added one after the other (what numpy's float32 running sum does)."""
    rng = np.random.default_rng(5)
    rows = rng.integers(0, 3, 5000).astype(np.int32)
    grads = (rng.normal(size=(5000, D)) * np.exp2(rng.uniform(-10, 10, (5000, 1)))).astype(np.float32)
    got = jax.jit(sum_by_row, static_argnums=2)(jnp.asarray(rows), jnp.asarray(grads), R)
    for place, row in enumerate(range(3)):
        assert int(got.rows[place]) == row
        in_order = np.cumsum(grads[rows == row], axis=0, dtype=np.float32)[-1]
        np.testing.assert_array_equal(np.asarray(got.grads[place]), in_order)
    assert (np.asarray(got.rows[3:]) >= R).all()  # unused places point past the table


@pytest.mark.parametrize("exact", [False, True])
def test_an_exchange_buffers_sums_on_cpu_are_the_sorted_sums_bits_without_the_sort(exact):
    """On CPU an exchange buffer's sums (what a device sends its owners) are one scatter-add
    of the lookups as given: each row's lookups added in their order, as the sorted form adds
    them, so the bits are the sorted form's (bags with weights, many lookups of few rows, rows
    past the end dropped), and the compiled program sorts nothing."""
    rng = np.random.default_rng(7)
    samples, slots, vectors, rows_n = 3000, 6, 2, 5
    rows = rng.integers(0, rows_n + 2, (samples, slots)).astype(np.int32)  # past rows_n: padding
    weights = rng.uniform(0.5, 2.0, (samples, slots)).astype(np.float32)
    grads = rng.normal(size=(samples * vectors, 16)) * np.exp2(rng.uniform(-10, 10, (samples * vectors, 1)))
    grads = grads.astype(np.float32)
    lookups = Lookups.of_bags(jnp.asarray(rows), np.arange(slots) % vectors, vectors, jnp.asarray(weights))
    run = lambda f: jax.jit(lambda lk, g: f(lk, g, rows_n, exact))  # (the lookups traced: nothing folded)
    got, in_order, by_sort = (
        np.asarray(run(f)(lookups, jnp.asarray(grads))) for f in (buffer_row_sums, dense_sums_in_order, dense_row_sums)
    )
    np.testing.assert_array_equal(got, by_sort)
    np.testing.assert_array_equal(in_order, by_sort)
    if not exact:  # numpy's float32 running sum of each row's lookups, in their order
        sources = np.asarray(lookups.sources)
        for r in range(rows_n):
            mine = rows.reshape(-1) == r
            added = grads[sources[mine]] * weights.reshape(-1)[mine][:, None]
            np.testing.assert_array_equal(got[r], np.cumsum(added, axis=0, dtype=np.float32)[-1])
    compiled = lambda f: run(f).lower(lookups, jnp.asarray(grads)).compile().as_text()
    assert " sort(" not in compiled(buffer_row_sums) and " sort(" in compiled(dense_row_sums)


def test_each_optimizer_declares_the_state_it_keeps():
    """choices.SPARSE_OPTIMIZER_KINDS (what the planner counts, no JAX) and the optimizers'
    registry name the same optimizers, and each built optimizer's state is the bytes per row
    its kind declares, with the whole-row statistic it says it reads."""
    from dlrm_jax.choices import SPARSE_OPTIMIZER_KINDS
    from dlrm_jax.embedding.exchange.optimizers import SPARSE_OPTIMIZERS, sparse_optimizer

    assert set(SPARSE_OPTIMIZER_KINDS) == set(SPARSE_OPTIMIZERS)
    for name, kind in SPARSE_OPTIMIZER_KINDS.items():
        opt = sparse_optimizer(name)
        for dim in (1, 8, 24):
            state = jax.eval_shape(opt.init, jax.ShapeDtypeStruct((10, dim), jnp.float32))
            nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
            assert nbytes == 10 * kind.state_bytes_per_row(dim), (name, dim)
        assert opt.needs_whole_rows == kind.whole_rows, name
        assert (not opt.step.adds) == kind.rewrites_given_rows, name  # FTRL writes rows, not deltas


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "ftrl", "ftrl_l1_l2"])
def test_a_row_restarted_at_a_weight_keeps_it(name):
    """A fresh row of a dynamic table given its shared row's weight (``new_rows: shared``) keeps
    it under a zero gradient. Before: FTRL's state was reset to (z=0, n=0.1), from which its
    weights follow: the Wide&Deep wide weight 0.5 the row inherited became 0.0 at its first step."""
    opt = ftrl(l1=0.01, l2=0.5) if name == "ftrl_l1_l2" else OPTIMIZERS[name]
    w = jnp.asarray([[0.5, -0.25, 0.0, 3.0]], jnp.float32)
    lr = jnp.float32(0.05)
    table, _ = opt.apply(w, opt.state_for(w, lr), None, jnp.zeros_like(w), lr)
    np.testing.assert_allclose(np.asarray(table), np.asarray(w), rtol=1e-6)
    if name == "ftrl":  # and a gradient moves it from there, as from a row that trained to it
        moved, _ = opt.apply(w, opt.state_for(w, lr), None, jnp.full_like(w, 0.01), lr)
        assert np.all(np.abs(np.asarray(moved - w)) < 0.01)
