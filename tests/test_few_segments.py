"""``few_segments.few_segment_sum``: integer sums into a few segments through private copies
equal ``jax.ops.segment_sum``'s, entries outside the segments (negative, past the end)
dropped, whatever the number of entries against the copies and the values' trailing shape;
and its program scatters into the copies, never into the few segments themselves."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm_jax.few_segments import LANES, few_segment_sum
from tests.helpers import examples


@settings(max_examples=examples(60), deadline=None)
@given(
    n=st.sampled_from([1, 5, LANES - 1, LANES, 3 * LANES + 7]),
    k=st.integers(1, 9),
    width=st.sampled_from([(), (3,)]),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_sums_are_segment_sums(n, k, width, seed):
    rng = np.random.default_rng(seed)
    values = rng.integers(-1000, 1000, (n, *width)).astype(np.int32)
    segments = rng.integers(-2, k + 2, n).astype(np.int32)  # some outside [0, k): dropped
    got = few_segment_sum(jnp.asarray(values), jnp.asarray(segments), k)
    want = jax.ops.segment_sum(values, segments, k)
    assert got.dtype == jnp.int32 and got.shape == (k, *width)
    np.testing.assert_array_equal(got, want)


def test_the_scatter_lands_in_the_copies():
    hlo = jax.jit(lambda v, s: few_segment_sum(v, s, 26)).lower(
        jnp.ones(10_000, jnp.int32), jnp.zeros(10_000, jnp.int32)
    )
    text = hlo.as_text()
    assert f"tensor<{26 * LANES}xi32>" in text  # the copies the entries add into
    assert "scatter" in text
