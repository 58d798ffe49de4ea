"""Host buffers for the batches the readers assemble: reused, not allocated per step, and on
GPUs pinned (page-locked and registered with the device runtime) so the host-to-device copy
reads them directly.

Why pinned. A transfer from ordinary (pageable) memory cannot be a DMA: the GPU runtime first
copies each batch into a pinned staging buffer of its own (PJRT's ``BufferFromHostBuffer``, on
one of its threads) and then transfers that. Memory the runtime was told about (the client's
``dma_map``, CUDA's host registration) is transferred from where it lies, asynchronously, with
no staging copy: a batch of criteo_kaggle at 65,536 (10 MB) is one host copy fewer a step.
Registering is slow (milliseconds), so it is done once per buffer and the buffers are reused.

When a buffer can be reused. A placed array may still read its host buffer after the reader
returns: on a GPU until its transfer is done, and on CPU devices for as long as the array lives
(XLA's CPU client aliases host memory it can). Readers and hot-row counting may hold the batch
too. So a buffer comes back to the pool when the last Python object viewing it is gone: each
batch's array views a ``ctypes`` object of its own, a weak reference to which returns the
memory, and jaxlib holds a reference to the numpy array it transfers from until the runtime is
done with it. Nothing is reused while anything can still read it, on any platform, and no step
waits for a buffer: the pool grows to the batches in flight.
"""

from __future__ import annotations

import ctypes
import mmap
import weakref
from collections import defaultdict, deque
from collections.abc import Callable

import jax
import numpy as np

from dlrm_jax.choices import HostMemory
from dlrm_jax.config import ConfigError

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def pins_memory(setting: str, devices=None) -> bool:
    """Whether ``data.host_memory`` (``setting``) pins the batches' buffers for ``devices``
    (default: this process's): ``auto`` where they are GPUs."""
    if setting == HostMemory.AUTO:
        devices = jax.local_devices() if devices is None else devices
        return devices[0].platform in _GPU_PLATFORMS
    return setting == HostMemory.PINNED


class _Region:
    """One buffer's memory: an anonymous mapping (page-aligned), registered with the runtime
    while ``pinned``."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.map = mmap.mmap(-1, max(1, nbytes))
        self._anchor = ctypes.c_char.from_buffer(self.map)  # (an export: the map stays while it does)
        self.address = ctypes.addressof(self._anchor)
        self.pinned = False

    def free(self) -> None:
        self._anchor = None
        self.map.close()


class HostBuffers:
    """A pool of host buffers (see the module docstring). ``pin``: register each new buffer
    with the devices' runtime (``client.dma_map``), and ``unpin`` it when it is freed; ``None``
    for pageable buffers (CPU devices). Safe to use from several threads: buffers come back
    from whichever thread drops a batch's last view, through deques (atomic under the GIL, no
    lock for a finalizer to wait on)."""

    def __init__(self, pin: Callable[[int, int], None] | None = None, unpin: Callable[[int], None] | None = None):
        self._pin, self._unpin = pin, unpin
        self._free: dict[int, deque[_Region]] = defaultdict(deque)
        self._closed = False
        self.regions = 0  # buffers made (each once, then reused)
        self.bytes = 0  # their memory
        self.pinned_regions = 0  # of them registered with the runtime

    @classmethod
    def for_devices(cls, setting: str, devices=None) -> HostBuffers:
        """The pool ``data.host_memory`` asks for on ``devices`` (default: this process's). A
        runtime that cannot register host memory gives pageable buffers under ``auto`` and a
        config error under ``pinned``."""
        devices = jax.local_devices() if devices is None else devices
        if not pins_memory(setting, devices):
            return cls()
        client = devices[0].client
        probe = _Region(mmap.PAGESIZE)
        try:
            client.dma_map(probe.address, probe.nbytes)
            client.dma_unmap(probe.address)
        except Exception as e:  # noqa: BLE001 - said in one line, with the key
            if setting == HostMemory.AUTO:
                return cls()
            raise ConfigError(
                f"data.host_memory=pinned: the {devices[0].platform} runtime cannot register host memory ({e}); "
                "use auto or pageable"
            ) from None
        finally:
            probe.free()
        return cls(client.dma_map, client.dma_unmap)

    @property
    def pinned(self) -> bool:
        """Whether new buffers are pinned."""
        return self._pin is not None

    def take(self, shape: tuple[int, ...]) -> np.ndarray:
        """A uint8 array of ``shape`` (contents undefined) whose memory returns to the pool when
        the array and every view of it are gone."""
        nbytes = int(np.prod(shape, dtype=np.int64))
        try:
            region = self._free[nbytes].pop()
        except IndexError:
            region = self._new(nbytes)
        owner = (ctypes.c_uint8 * max(1, nbytes)).from_address(region.address)
        weakref.finalize(owner, self._give_back, region).atexit = False  # (not at exit: the runtime may be gone)
        return np.frombuffer(owner, np.uint8, nbytes).reshape(shape)

    def _new(self, nbytes: int) -> _Region:
        region = _Region(nbytes)
        if self._pin is not None:
            try:
                self._pin(region.address, region.nbytes)
                region.pinned = True
                self.pinned_regions += 1
            except Exception:  # noqa: BLE001 - out of memory the driver can lock: this one stays pageable (stats say)
                pass
        self.regions, self.bytes = self.regions + 1, self.bytes + nbytes
        return region

    def _give_back(self, region: _Region) -> None:
        if self._closed:
            self._release(region)
        else:
            self._free[region.nbytes].append(region)

    def _release(self, region: _Region) -> None:
        if region.pinned:
            self._unpin(region.address)
            region.pinned = False
        region.free()

    def stats(self) -> dict:
        """``input_buffers``: buffers made so far (the batches in flight at most, not the steps);
        ``input_buffer_mb``: their memory; ``input_buffers_pinned``: how many of them are pinned."""
        return {
            "input_buffers": self.regions,
            "input_buffer_mb": self.bytes / 2**20,
            "input_buffers_pinned": self.pinned_regions,
        }

    def close(self) -> None:
        """Free the buffers not in use now; those still in use are freed when they come back."""
        self._closed = True
        for free in self._free.values():
            while free:
                self._release(free.pop())
