"""``chunks.in_chunks``: the first ``count`` entries written a chunk at a time reach what one
write of them all reaches (the last chunk may repeat entries: a set written twice is the
same), whatever the count, the chunk size and the length."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm_jax.chunks import in_chunks
from tests.helpers import examples

TARGET = 64


def write_all(rows, values, count):
    want = np.zeros(TARGET, np.float32)
    for r, v in zip(rows[:count], values[:count], strict=True):
        if r >= 0:
            want[r] = v
    return want


@settings(max_examples=examples(60), deadline=None)
@given(
    n=st.integers(1, 40),
    size=st.sampled_from([1, 3, 8, 64]),
    data=st.data(),
)
def test_chunks_write_the_first_count_entries_once_over(n, size, data):
    rows = np.array(data.draw(st.lists(st.integers(-1, TARGET - 1), min_size=n, max_size=n, unique=True)), np.int32)
    values = np.arange(1, n + 1, dtype=np.float32)
    count = data.draw(st.integers(0, n))
    rows = np.where(np.arange(n) < count, rows, -1)  # past count: nothing to write, as the step pads

    def write(target, r, v):
        return target.at[jnp.where(r >= 0, r, TARGET)].set(v, mode="drop")

    got = jax.jit(lambda r, v, c: in_chunks((r, v), c, size, jnp.zeros(TARGET, jnp.float32), write))(
        rows, values, jnp.int32(count)
    )
    np.testing.assert_array_equal(np.asarray(got), write_all(rows, values, count))


def test_the_loop_runs_as_many_chunks_as_the_count_needs():
    passes = lambda count: in_chunks(
        (jnp.zeros(10, jnp.int32),), jnp.int32(count), 4, jnp.int32(0), lambda c, _: c + 1
    )  # 10 entries, 4 at a time
    assert [int(jax.jit(passes, static_argnums=0)(c)) for c in (0, 1, 4, 5, 9, 10)] == [0, 1, 1, 2, 3, 3]
