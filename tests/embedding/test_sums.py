"""exact_segment_sum: the same bits in any order, within its stated bound of the exact sum."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm_jax.embedding.exchange.sums import exact_segment_sum
from tests.helpers import examples


def reference_and_bound(data, ids, num):
    """float64 sums, and the stated error bound per segment: count * 2**(e - 47 + 2 ceil(log2
    count)) with max|x| < 2**e over the segment, plus the final rounding to float32."""
    ref = np.zeros((num,) + data.shape[1:])
    valid = (ids >= 0) & (ids < num)
    np.add.at(ref, ids[valid], data[valid].astype(np.float64))
    count = np.bincount(ids[valid], minlength=num)
    seg_max = np.zeros(num)
    np.maximum.at(seg_max, ids[valid], np.abs(data[valid]).max(1))
    seg_max = seg_max[:, None]
    _, e = np.frexp(seg_max)
    k = np.ceil(np.log2(np.maximum(count, 1))).astype(int)[:, None]
    bound = count[:, None] * np.ldexp(1.0, e + 2 * k - 47) + np.abs(ref) * 2.0**-24
    return ref, bound


MAX_N, MAX_WIDTH = 300, 5
SUM = jax.jit(exact_segment_sum, static_argnums=2)


@settings(max_examples=examples(60))
@given(
    n=st.integers(1, MAX_N),
    num=st.integers(1, 20),
    width=st.integers(1, MAX_WIDTH),
    spread=st.floats(0, 60),
    seed=st.integers(0, 2**16),
)
def test_any_order_same_bits_and_within_bound(n, num, width, spread, seed):
    rng = np.random.default_rng(seed)
    # Magnitudes over up to 2**60 of range, zeros, and ids outside [0, num) (dropped).
    data = rng.standard_normal((n, width)) * np.exp2(rng.uniform(-spread / 2, spread / 2, (n, 1)))
    data[rng.random(n) < 0.1] = 0.0
    data = data.astype(np.float32)
    ids = rng.integers(-1, num + 1, n).astype(np.int32)
    # One compiled shape per num: padded to MAX_N addends with id -1 (dropped) and to MAX_WIDTH
    # columns of zeros (which leave every addend's largest magnitude, hence its scale, alone).
    padded = np.zeros((MAX_N, MAX_WIDTH), np.float32)
    padded[:n, :width] = data
    padded[n:] = rng.standard_normal((MAX_N - n, MAX_WIDTH))
    padded_ids = np.concatenate([ids, np.full(MAX_N - n, -1, np.int32)])
    got = np.asarray(SUM(jnp.asarray(padded), jnp.asarray(padded_ids), num))
    for _ in range(3):
        p = rng.permutation(MAX_N)
        again = np.asarray(SUM(jnp.asarray(padded[p]), jnp.asarray(padded_ids[p]), num))
        np.testing.assert_array_equal(again, got)
    got = got[:, :width]
    ref, bound = reference_and_bound(data, ids, num)
    assert np.all(np.abs(got - ref) <= bound + 1e-37), np.max(np.abs(got - ref) - bound)


def test_single_addends_are_kept_exactly():
    data = np.array([[3.0e-20, -7.25e-20], [1.0e30, 0.1e24], [np.pi, -np.e]], np.float32)
    got = exact_segment_sum(jnp.asarray(data), jnp.array([2, 0, 1]), 3)
    np.testing.assert_array_equal(np.asarray(got), data[[1, 2, 0]])


def test_plain_segment_sum_does_depend_on_order():
    """Why the exact sum exists: the same addends in another order give other bits."""
    rng = np.random.default_rng(0)
    data = (rng.standard_normal((4000, 1)) * np.exp2(rng.uniform(-20, 20, (4000, 1)))).astype(np.float32)
    ids = np.zeros(4000, np.int32)
    p = rng.permutation(4000)
    plain = [np.asarray(jax.ops.segment_sum(jnp.asarray(d), jnp.asarray(ids), 1)) for d in (data, data[p])]
    exact = [np.asarray(exact_segment_sum(jnp.asarray(d), jnp.asarray(ids), 1)) for d in (data, data[p])]
    assert not np.array_equal(*plain)
    np.testing.assert_array_equal(*exact)


def test_non_finite_values_stay_non_finite():
    got = np.asarray(exact_segment_sum(jnp.array([1.0, np.inf, np.nan, 2.0]), jnp.array([0, 1, 2, 0]), 3))
    assert got[0] == 3.0 and not np.isfinite(got[1]) and np.isnan(got[2])


def test_too_many_addends_is_refused():
    with pytest.raises(ValueError, match="addends"):
        jax.eval_shape(
            lambda d, i: exact_segment_sum(d, i, 2),
            jax.ShapeDtypeStruct(((1 << 24) + 1,), jnp.float32),
            jax.ShapeDtypeStruct(((1 << 24) + 1,), jnp.int32),
        )
