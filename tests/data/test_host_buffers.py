"""The batches' host buffers (data/host_buffers.py): a buffer is reused only once nothing can
read it any more (no view of it, no placed array aliasing it, no step still reading a batch
from it), the pool stays the size of the batches in flight, pinning registers each buffer once
and releases it, and ``data.host_memory`` says which."""

import gc
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from dlrm_jax.config import ConfigError
from dlrm_jax.data.host_buffers import HostBuffers, pins_memory
from dlrm_jax.data.packed import Packed, PackedLayout, packed_reader, unpacked
from dlrm_jax.data.pipeline import InputPipeline
from dlrm_jax.parallel.mesh import batch_spec, make_mesh
from tests.data.test_packed import array_source


def address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_a_buffer_comes_back_once_its_last_view_is_gone():
    pool = HostBuffers()
    a = pool.take((2, 4096))
    first = address(a)
    row = a[1]  # a view keeps it
    del a
    gc.collect()
    b = pool.take((2, 4096))
    assert address(b) != first and pool.regions == 2
    del row, b
    gc.collect()
    again = {address(pool.take((2, 4096))) for _ in range(20)}  # each dropped at once: reused
    assert pool.regions == 2 and len(again) == 1


def test_a_placed_array_keeps_its_buffer_until_it_is_gone():
    """On CPU devices a placed array may alias its host buffer: the buffer must not be handed
    out again while the array lives, however many batches are taken meanwhile."""
    pool = HostBuffers()
    buf = pool.take((1, 1 << 16))
    buf[...] = 7
    placed = jax.device_put(buf, jax.devices()[0])
    del buf
    gc.collect()
    for k in range(30):
        pool.take((1, 1 << 16))[...] = k
    np.testing.assert_array_equal(np.asarray(placed), 7)
    made = pool.regions
    del placed
    gc.collect()
    for k in range(30):
        pool.take((1, 1 << 16))[...] = k
    assert pool.regions == made  # the placed array's buffer came back; nothing new was needed


def test_batches_a_slow_step_still_reads_are_never_written_while_buffers_are_reused():
    """The readers run ahead of a slow consumer that keeps only its last few device batches (a
    step in flight) and drops the rest: each kept batch still holds its own step's rows when
    checked, and the pool reuses buffers rather than growing with the steps."""
    source = array_source(n=4000)
    mesh = make_mesh(1)
    spec = batch_spec(mesh)
    sharding = NamedSharding(mesh, spec)
    layout = PackedLayout(1, 64, 4, 13)
    pool = HostBuffers()
    unpack = jax.jit(lambda b: unpacked(b, mesh, spec))

    def to_device(host):
        return Packed(jax.make_array_from_process_local_data(sharding, host.buf), host.layout)

    kept, steps = [], 60
    with InputPipeline(
        packed_reader(source, layout, pool), range(steps), to_device=to_device, readers=8, depth=12
    ) as p:
        for item in p:
            kept.append((item.step, item.device))
            kept = kept[-3:]
            time.sleep(0.002)
            for step, device in kept:
                got, want = unpack(device), source.train_batch(step)
                for g, w in zip(got, want, strict=True):
                    np.testing.assert_array_equal(np.asarray(g), w)
    assert pool.regions < steps // 2, pool.regions


def test_pinned_buffers_are_registered_once_and_released():
    pinned, unpinned = [], []
    pool = HostBuffers(lambda at, n: pinned.append((at, n)), unpinned.append)
    held = pool.take((3, 5000))
    for _ in range(5):
        pool.take((3, 5000))
    assert len(pinned) == 2 and all(n == 15000 and at % 4096 == 0 for at, n in pinned)
    pool.close()  # the free buffer now; the held one when it comes back
    assert len(unpinned) == 1
    del held
    gc.collect()
    assert sorted(unpinned) == sorted(at for at, _ in pinned)


def test_host_memory_setting():
    cpus = jax.devices("cpu")
    assert not pins_memory("auto", cpus) and not pins_memory("pageable", cpus) and pins_memory("pinned", cpus)
    assert not HostBuffers.for_devices("auto", cpus).pinned
    with pytest.raises(ConfigError, match=r"data.host_memory=pinned: the cpu runtime cannot register host memory"):
        HostBuffers.for_devices("pinned", cpus)


def test_pinned_host_memory_a_runtime_cannot_give_is_refused_before_a_run_dir(tiny, tmp_path):
    """Before: train printed the plan, then refused pinned buffers when its input started,
    leaving config.yaml, plan.txt, plan.json and an empty checkpoints/ (the next run there
    moved them to earlier/)."""
    from dlrm_jax.train.trainer import train_and_evaluate

    with pytest.raises(ConfigError, match=r"data.host_memory=pinned: the cpu runtime cannot register host memory"):
        train_and_evaluate(tiny("data.host_memory=pinned"), tmp_path / "run", log=None)
    assert not (tmp_path / "run").exists()


class _Refusing:
    """A device whose runtime cannot register host memory, though its platform is a GPU's."""

    platform = "gpu"

    class client:  # noqa: N801 - the attribute jax's devices have
        @staticmethod
        def dma_map(address, size):
            raise RuntimeError("UNIMPLEMENTED: DmaMap")

        dma_unmap = dma_map


def test_auto_falls_back_to_pageable_where_registering_fails_and_pinned_says_so():
    assert pins_memory("auto", [_Refusing()])
    assert not HostBuffers.for_devices("auto", [_Refusing()]).pinned
    with pytest.raises(ConfigError, match="the gpu runtime cannot register host memory"):
        HostBuffers.for_devices("pinned", [_Refusing()])
