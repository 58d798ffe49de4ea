"""The packed feed: a batch placed as one array of bytes and unpacked inside the step is the
batch placed field by field, bit for bit; sources that cannot read in place are copied in; a
batch handed out stays intact while later ones are read."""

import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from dlrm_jax.data.batch import PAD_ID, Batch
from dlrm_jax.data.packed import HostPacked, Packed, PackedLayout, packed_reader, unpacked
from dlrm_jax.data.pipeline import InputPipeline
from dlrm_jax.data.sources.arrays import ArraySource
from dlrm_jax.parallel.mesh import batch_spec, make_mesh


def random_batch(rng, n: int, bags: tuple[int, ...], rows: tuple[int, ...], num_dense: int) -> Batch:
    ids = np.concatenate([rng.integers(0 if b == 1 else PAD_ID, r, (n, b)) for b, r in zip(bags, rows, strict=True)], 1)
    dense = rng.standard_normal((n, num_dense)).astype(np.float32)
    dense[0, 0] = -0.0  # compared as bits, not values
    return Batch(dense, ids.astype(np.int32), (rng.random(n) < 0.3).astype(np.float32))


def place(sharding, batch: Batch) -> Batch:
    return Batch(*(jax.make_array_from_process_local_data(sharding, x) for x in batch))


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
@pytest.mark.parametrize("bags,num_dense", [((1,) * 26, 13), ((3, 1, 100, 1), 1)])
def test_unpacked_on_the_devices_is_the_batch_placed_field_by_field(devices, bags, num_dense):
    mesh = make_mesh(devices)
    spec = batch_spec(mesh)
    sharding = NamedSharding(mesh, spec)
    rng = np.random.default_rng(devices)
    n = 64 * devices
    batch = random_batch(rng, n, bags, tuple(rng.integers(1, 1000, len(bags))), num_dense)
    layout = PackedLayout(devices, n // devices, sum(bags), num_dense)
    packed = Packed(jax.make_array_from_process_local_data(sharding, layout.pack(batch)), layout)
    got = jax.jit(lambda p: unpacked(p, mesh, spec))(packed)
    want = place(sharding, batch)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and g.sharding.is_equivalent_to(w.sharding, g.ndim)
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


def array_source(n=1000, batch=64, seed=0):
    rng = np.random.default_rng(seed)
    bags, rows = (2, 1, 1), (50, 7, 300)
    train, val = (random_batch(rng, k, bags, rows, 13) for k in (n, 100))
    return ArraySource(train, val, batch, table_rows=rows, bag_sizes=bags, seed=seed)


def test_a_source_that_cannot_read_in_place_is_copied_in():
    source = array_source()
    layout = PackedLayout(8, 8, 4, 13)
    read = packed_reader(source, layout)
    for step in range(40):
        got, want = read(step), source.train_batch(step)
        views = layout.views(got.buf)
        for name in ("dense", "ids", "labels"):
            np.testing.assert_array_equal(np.concatenate(views[name]), getattr(want, name))


def test_a_batch_handed_out_stays_intact_while_later_ones_are_read():
    """A slow consumer holds every step it took while the readers go on (with 8 readers and
    12 steps ahead): each held device batch still holds its own step's rows at the end, so no
    buffer a step reads is written for another. (On one CPU device the placed array aliases
    the host buffer: a buffer reused too early would show here.)"""
    source = array_source(n=4000)
    mesh = make_mesh(1)
    spec = batch_spec(mesh)
    sharding = NamedSharding(mesh, spec)
    layout = PackedLayout(1, 64, 4, 13)

    def to_device(host: HostPacked) -> Packed:
        return Packed(jax.make_array_from_process_local_data(sharding, host.buf), host.layout)

    held = []
    with InputPipeline(packed_reader(source, layout), range(60), to_device=to_device, readers=8, depth=12) as p:
        for item in p:
            held.append(item)
            time.sleep(0.002)
    unpack = jax.jit(lambda b: unpacked(b, mesh, spec))
    for item in held:
        got, want = unpack(item.device), source.train_batch(item.step)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), w)
