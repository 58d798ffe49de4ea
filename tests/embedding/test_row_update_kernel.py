"""The fused sparse update (Pallas kernels, run here in Pallas's interpreter) against the XLA
form it replaces on GPUs: every optimizer, pooled lookups with weights and padding, rows long
enough to be summed in chunks, narrow tables, whole-row statistics of column slices; and
through the exchange's forms against the single-device reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm_jax.embedding.exchange import row_update_kernel
from dlrm_jax.embedding.exchange.optimizers import adagrad, ftrl, rowwise_adagrad, sgd
from dlrm_jax.embedding.exchange.row_grads import Lookups
from tests.embedding.reference_checks import CARDS, check_against_reference

R, D = 23, 8
OPTIMIZERS = {"sgd": sgd(), "adagrad": adagrad(), "rowwise_adagrad": rowwise_adagrad(), "ftrl": ftrl()}


def fused(opt, *args, **kwargs):
    return jax.jit(
        lambda *a: row_update_kernel.fused_row_update(opt.step, *a, **kwargs, interpret=True), static_argnums=()
    )(*args)


def batch(rng, samples=20):
    """Bags of 3 over 2 vectors per sample; row 2 in every sample's first bag (60 lookups: a
    long row at LONG=8), some padding (row R)."""
    ids = rng.integers(0, R + 1, (samples, 6)).astype(np.int32)
    ids[:, :3] = 2
    weights = rng.uniform(0.1, 1.0, ids.shape).astype(np.float32)
    pooled = rng.normal(size=(samples * 2, D)).astype(np.float32)
    return Lookups.of_bags(jnp.asarray(ids), np.repeat(np.arange(2), 3), 2, jnp.asarray(weights)), jnp.asarray(pooled)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_update_matches_the_xla_form(monkeypatch, name, dtype):
    monkeypatch.setattr(row_update_kernel, "LONG", 8)  # row 2's 60 lookups: chunks of 8
    rng = np.random.default_rng(3)
    opt = OPTIMIZERS[name]
    table = jnp.asarray(rng.normal(size=(R, D)).astype(np.float32)).astype(dtype)
    state = opt.init(table)
    for _ in range(3):  # a few steps: state carries over
        lookups, pooled = batch(rng)
        got = fused(opt, table, state, lookups, pooled, 0.05)
        table, state = opt.update(table, state, lookups, pooled, 0.05)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves((table, state)), strict=True):
            tol = 1e-5 if dtype == "float32" else 1e-2  # bf16: a sum's order can move one rounding
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol)
        table, state = got


def test_fused_update_takes_whole_row_statistics_and_drops_padding():
    rng = np.random.default_rng(4)
    opt = rowwise_adagrad()
    lookups, pooled = batch(rng)
    mean_sq = jnp.asarray(rng.uniform(0, 1, R + 1).astype(np.float32))[jnp.minimum(lookups.rows, R)]
    table = jnp.asarray(rng.normal(size=(R, D)).astype(np.float32))
    got = fused(opt, table, opt.init(table), lookups, pooled, 0.05, mean_sq)
    want = opt.update(table, opt.init(table), lookups, pooled, 0.05, row_mean_sq=mean_sq)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    only_padding = Lookups(jnp.full(8, R, jnp.int32))
    same, acc = fused(opt, table, opt.init(table), only_padding, jnp.ones((8, D)), 1.0)
    np.testing.assert_array_equal(np.asarray(same), np.asarray(table))
    assert float(acc["accumulator"].sum()) == 0.0


@pytest.mark.parametrize(
    "strategy,optimizer", [("replicated", "rowwise_adagrad"), ("table", "adagrad"), ("row", "sgd")]
)
def test_fused_update_through_the_forms_matches_the_reference(tiny, strategy, optimizer):
    """40 steps on 2 devices: the gathered replicated update, owners' pooled bags, ids."""
    cfg = tiny(
        "train.batch_size=16",
        CARDS,
        "data.bag_sizes=[3, 1, 4, 2, 2]",
        f"embedding.sharding={strategy}",
        f"embedding.optimizer={optimizer}",
        "embedding.sparse_update=fused",
    )
    check_against_reference(cfg, 2)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fewer_programs_taking_rows_in_rounds_give_the_same_bits(monkeypatch, name):
    """The row kernel with at most 2 programs (each taking 4 places a round, 8 apart, until the
    distinct rows run out: several rounds here) writes the bits of one program per 4 lookups,
    over steps whose distinct rows change (and one batch of padding alone)."""
    monkeypatch.setattr(row_update_kernel, "LONG", 8)
    rng = np.random.default_rng(5)
    opt = OPTIMIZERS[name]
    table = jnp.asarray(rng.normal(size=(R, D)).astype(np.float32))
    state = opt.init(table)
    steps = [batch(rng), batch(rng, samples=7), (Lookups(jnp.full(8, R, jnp.int32)), jnp.ones((8, D)))]
    for lookups, pooled in steps:
        every = fused(opt, table, state, lookups, pooled, 0.05)
        few = fused(opt, table, state, lookups, pooled, 0.05, programs=2)
        for a, b in zip(jax.tree.leaves(few), jax.tree.leaves(every), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        table, state = every


@pytest.mark.parametrize("programs", [0, 2])
def test_a_batch_without_padding_updates_its_last_row(monkeypatch, programs):
    """Every lookup a real row (no padding's place after the rows, whose count the row kernel
    reads from the last lookup's place): the last distinct row is updated too."""
    monkeypatch.setattr(row_update_kernel, "LONG", 8)
    rng = np.random.default_rng(6)
    opt = sgd()
    table = jnp.asarray(rng.normal(size=(R, D)).astype(np.float32))
    # rows 0-20, each looked up (21 places: the last one starts a program's group of PLACES)
    ids = jnp.asarray(np.concatenate([np.arange(21), rng.integers(0, 21, 99)]).reshape(20, 6).astype(np.int32))
    ids = ids.at[:, 0].set(20)  # the last row in every sample: a long row, placed last
    lookups = Lookups.of_bags(ids, np.repeat(np.arange(2), 3), 2, jnp.ones(ids.shape, jnp.float32))
    pooled = jnp.asarray(rng.normal(size=(40, D)).astype(np.float32))
    got, _ = fused(opt, table, opt.init(table), lookups, pooled, 0.05, programs=programs)
    want, _ = opt.update(table, opt.init(table), lookups, pooled, 0.05)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(got)[20], np.asarray(table)[20])


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("programs", [0, 8])
def test_kernels_lower_to_triton_for_a_gpu(name, programs):
    """The kernels as a GPU build would compile them: lowered for CUDA (on this CPU machine) to
    two Triton kernels, with rows of 128 floats and bf16 tables (what the interpreter cannot
    check: Triton's own rules on shapes, loads and loops), and no loop around them: the host
    drives a loop on GPUs round by round (a binary search as a loop of 21 rounds was 87 of
    criteo_kaggle's 191 kernels a step, two and a copy a round)."""
    opt = OPTIMIZERS[name]

    def update(table, state, ids, weights, pooled, lr):
        lookups = Lookups.of_bags(ids, np.repeat(np.arange(2), 3), 2, weights)
        return row_update_kernel.fused_row_update(
            opt.step, table, state, lookups, pooled, lr, interpret=False, programs=programs
        )

    table = jax.ShapeDtypeStruct((1000, 128), jnp.bfloat16)
    args = (
        table,
        jax.eval_shape(opt.init, table),
        jax.ShapeDtypeStruct((64, 6), jnp.int32),
        jax.ShapeDtypeStruct((64, 6), jnp.float32),
        jax.ShapeDtypeStruct((128, 128), jnp.float32),
        jax.ShapeDtypeStruct((), jnp.float32),
    )
    triton = "__gpu$xla.gpu.triton"
    exported = jax.export.export(
        jax.jit(update), platforms=["cuda"], disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)]
    )(*args)
    assert exported.mlir_module().count(f"@{triton}(") == 2
    assert "stablehlo.while" not in exported.mlir_module()


@pytest.mark.parametrize(
    "choice,backend,kernel",
    [("auto", "gpu", True), ("auto", "cpu", False), ("xla", "gpu", False), ("fused", "cpu", True)],
)
def test_the_default_update_is_fused_on_gpus_and_xla_elsewhere(monkeypatch, choice, backend, kernel):
    """``embedding.sparse_update=auto`` (the default) runs the kernels where they were measured
    faster (GPUs) and the XLA form where Pallas only interprets them; a named form is kept."""
    from dlrm_jax.config import load_config
    from dlrm_jax.train import optimizer_setup

    assert load_config().embedding.sparse_update == "auto"
    cfg = load_config(None, [f"embedding.sparse_update={choice}"])
    monkeypatch.setattr(optimizer_setup.jax, "default_backend", lambda: backend)
    assert optimizer_setup.sparse_optimizer_from_config(cfg).kernel is kernel
    capped = load_config(None, [f"embedding.sparse_update={choice}", "embedding.fused_programs=64"])
    assert optimizer_setup.sparse_optimizer_from_config(capped).kernel_programs == 64
    # by default the row kernel's programs are capped (uncapped, 90% of them idled on one H200)
    assert optimizer_setup.sparse_optimizer_from_config(cfg).kernel_programs == 65536


def _chunk_plan(s, num_rows):
    """Each chunk program's [begin, end) for the sorted lookups ``s``, as the kernel takes them."""
    blocks = -(-s.order.shape[0] // row_update_kernel.LONG)
    plan = jax.vmap(lambda c: row_update_kernel.chunk_range(c, blocks, s.segment, s.starts, s.rows, num_rows))
    begin, end = plan(jnp.arange(2 * blocks))
    return blocks, np.asarray(begin), np.asarray(end)


def test_padding_is_never_summed_in_chunks():
    """A batch whose unused bag slots (rows past the table) far outnumber LONG: only the real
    long row is chunked, so the chunk kernel sums no padding (before, the padding's place was
    chunked too, then skipped by the row kernel: DLRM-DCNv2's bags are half padding)."""
    from dlrm_jax.embedding.exchange.row_grads import sort_by_row

    long = row_update_kernel.LONG
    rows = np.concatenate([np.full(3 * long, R), np.full(2 * long + 5, 7), np.arange(5)]).astype(np.int32)
    s = sort_by_row(jnp.asarray(np.random.default_rng(0).permutation(rows)), R)
    _, begin, end = _chunk_plan(s, R)
    summed = end - begin
    assert summed.sum() == 2 * long + 5 and (summed > 0).sum() == 3  # row 7's lookups alone, in 3 pieces
    row_7 = np.flatnonzero(np.asarray(s.rows) == 7)[0]
    assert begin[summed > 0].min() == np.asarray(s.starts)[row_7]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=300), st.integers(2, 9))
def test_each_long_rows_pieces_cover_its_lookups_once_in_order(rows, long):
    """Property: the chunk programs' ranges are disjoint, lie inside long real rows, and a long
    row's pieces as the row kernel reads them (its first piece, then the rest in order) are
    consecutive and cover its lookups exactly; every other range is empty."""
    from dlrm_jax.embedding.exchange.row_grads import sort_by_row

    num_rows = 10  # ids 10..12: padding, capped to one place
    row_update_kernel.LONG, saved = long, row_update_kernel.LONG
    try:
        s = sort_by_row(jnp.asarray(np.asarray(rows, np.int32)), num_rows)
        blocks, begin, end = _chunk_plan(s, num_rows)
        places, starts = np.asarray(s.rows), np.asarray(s.starts)
        covered = np.zeros(len(rows), int)
        for b, e in zip(begin, end, strict=True):
            covered[b:e] += 1
        for k, row in enumerate(places):
            start, stop = int(starts[k]), int(starts[k + 1])
            is_long = row < num_rows and stop - start > long
            if not is_long:  # short rows and the padding: read directly, or never
                assert covered[start:stop].sum() == 0
                continue
            first, lo, hi = (int(x) for x in row_update_kernel._long_row_pieces(start, stop, blocks))
            pieces = [(begin[first], end[first])] + list(zip(begin[lo:hi], end[lo:hi], strict=True))
            assert pieces[0][0] == start and pieces[-1][1] == stop
            assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False))
            assert all(e > b for b, e in pieces)
        assert covered.max(initial=0) <= 1
        long_lookups = sum(
            int(starts[k + 1] - starts[k])
            for k, r in enumerate(places)
            if r < num_rows and starts[k + 1] - starts[k] > long
        )
        assert covered.sum() == long_lookups
    finally:
        row_update_kernel.LONG = saved
