"""The id map sharded with its table (embedding/dynamic/sharded.py) equals one map on one
device, batch by batch, on 1, 2, 4 and 8 devices: rows, fresh rows, every array of the map and
the counts, through evictions and admissions."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlrm_jax.embedding.dynamic.idmap import STATS, IdMap, MapSpec, init_map, resolve, split_ids
from dlrm_jax.embedding.dynamic.sharded import sharded_resolve
from dlrm_jax.parallel.mesh import AXIS, make_mesh

SPEC = MapSpec(rows=8 * 6, vshards=8, probes=3, policy="lfu", half_life=2, admit=2, sketch_depth=2, sketch_width=8)


def stream(steps: int, batch: int, bag: int, seed: int = 0):
    """Batches of 64-bit ids, from a population drifting past the map's rows (new ids born,
    old ones fading), with padding."""
    rng = np.random.default_rng(seed)
    for step in range(steps):
        born = np.arange(step * 7, step * 7 + 60, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        ids = born[np.minimum(rng.zipf(1.3, size=(batch, bag)) - 1, len(born) - 1)]
        yield ids, rng.random((batch, bag)) > 0.1


@pytest.mark.slow  # 3-6 s each on 2 cores
@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_the_sharded_map_equals_one_map_step_by_step(devices):
    mesh = make_mesh(devices)
    on = lambda spec: NamedSharding(mesh, spec)
    sharded = jax.jit(functools.partial(sharded_resolve, SPEC, mesh))
    one = jax.jit(functools.partial(resolve, SPEC))
    m_sharded = jax.device_put(init_map(SPEC), IdMap(*(on(P(AXIS)),) * 6))
    m_one = init_map(SPEC)
    seen = dict.fromkeys(STATS, 0)
    for step, (ids, valid) in enumerate(stream(12, 16, 3)):
        hi, lo = split_ids(ids)
        got = sharded(m_sharded, *(jax.device_put(x, on(P(AXIS))) for x in (hi, lo, valid)), step)
        want = one(
            m_one, jnp.asarray(hi.reshape(-1)), jnp.asarray(lo.reshape(-1)), jnp.asarray(valid.reshape(-1)), step
        )
        m_sharded, m_one = got.map, want.map
        np.testing.assert_array_equal(np.asarray(got.rows).reshape(-1), np.asarray(want.rows), err_msg=f"step {step}")
        np.testing.assert_array_equal(np.asarray(got.fresh), np.asarray(want.fresh))
        for a, b in zip(got.map, want.map, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert {k: int(got.stats[k]) for k in STATS} == {k: int(want.stats[k]) for k in STATS}
        seen = {k: seen[k] + int(want.stats[k]) for k in STATS}
    assert seen["evicted"] and seen["admitted"] and seen["held_back"] and seen["found"]  # all of it happened


def test_a_map_that_does_not_split_in_whole_shards_is_refused():
    with pytest.raises(ValueError, match="6 shards cannot be split over 4 devices"):
        sharded_resolve(MapSpec(rows=12, vshards=6), make_mesh(4), None, None, None, None, 0)
