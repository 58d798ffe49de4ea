"""The packed feed: a batch placed as one array of bytes and unpacked inside the step is the
batch placed field by field, bit for bit; sources that cannot read in place are copied in; a
batch handed out stays intact while later ones are read."""

import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from dlrm_jax.data.batch import PAD_ID, Batch, RawBatch
from dlrm_jax.data.packed import HostPacked, Packed, PackedLayout, packed_reader, unpacked
from dlrm_jax.data.pipeline import InputPipeline
from dlrm_jax.data.sources.arrays import ArraySource
from dlrm_jax.ids import raw_columns
from dlrm_jax.parallel.mesh import batch_spec, make_mesh


def random_batch(rng, n: int, bags: tuple[int, ...], rows: tuple[int, ...], num_dense: int) -> Batch:
    ids = np.concatenate([rng.integers(0 if b == 1 else PAD_ID, r, (n, b)) for b, r in zip(bags, rows, strict=True)], 1)
    dense = rng.standard_normal((n, num_dense)).astype(np.float32)
    dense[0, 0] = -0.0  # compared as bits, not values
    return Batch(dense, ids.astype(np.int32), (rng.random(n) < 0.3).astype(np.float32))


def place(sharding, batch: Batch | RawBatch) -> Batch | RawBatch:
    return type(batch)(*(jax.make_array_from_process_local_data(sharding, x) for x in batch))


def with_raw(batch: Batch, rng, columns: int) -> RawBatch:
    """The batch with ``columns`` raw 64-bit ids per row (every bit pattern, the top bit too)."""
    return RawBatch(*batch, raw_columns(rng.integers(0, 2**64, (batch.size, columns), dtype=np.uint64)))


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
@pytest.mark.parametrize("bags,num_dense,raw", [((1,) * 26, 13, 0), ((3, 1, 100, 1), 1, 0), ((1,) * 26, 13, 3)])
def test_unpacked_on_the_devices_is_the_batch_placed_field_by_field(devices, bags, num_dense, raw):
    """Raw ids too (``raw`` columns: dynamic tables' ids read from text or arrays)."""
    mesh = make_mesh(devices)
    spec = batch_spec(mesh)
    sharding = NamedSharding(mesh, spec)
    rng = np.random.default_rng(devices)
    n = 64 * devices
    batch = random_batch(rng, n, bags, tuple(rng.integers(1, 1000, len(bags))), num_dense)
    layout = PackedLayout(devices, n // devices, sum(bags), num_dense)
    if raw:
        batch, layout = with_raw(batch, rng, raw), layout.with_raw(raw)
    packed = Packed(jax.make_array_from_process_local_data(sharding, layout.pack(batch)), layout)
    got = jax.jit(lambda p: unpacked(p, mesh, spec))(packed)
    want = place(sharding, batch)
    assert type(got) is type(want)
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


def test_raw_ids_are_packed_with_the_batch_never_dropped():
    """A source with raw ids (Criteo text, arrays with a raw column) is packed with them: the
    step's dynamic tables map these, not the placeholder ids beside them. A layout without room
    for them refuses the batch rather than drop them."""
    rng = np.random.default_rng(3)
    train = random_batch(rng, 512, (1, 1, 1), (50, 7, 300), 13)
    raw = rng.integers(0, 2**64, (512, 2), dtype=np.uint64)
    source = ArraySource((*train, raw), (*train, raw), 64, table_rows=(50, 7, 300), bag_sizes=(1, 1, 1))
    mesh = make_mesh(2)
    spec = batch_spec(mesh)
    layout = PackedLayout(2, 32, 3, 13)
    read = packed_reader(source, layout)
    unpack = jax.jit(lambda b: unpacked(b, mesh, spec))
    sharding = NamedSharding(mesh, spec)
    for step in range(3):
        host, want = read(step), source.train_batch(step)
        got = unpack(Packed(jax.make_array_from_process_local_data(sharding, host.buf), host.layout))
        assert isinstance(got, RawBatch)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), w)
    with pytest.raises(ValueError, match="RawBatch into a layout without raw ids"):
        layout.pack(source.train_batch(0))


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
