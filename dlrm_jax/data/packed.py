"""A batch in one host buffer, placed on the devices in one transfer and split into its fields
inside the train step.

Why: every array placed on the devices costs the reader thread a fixed share of host time
under the GIL (sharding, per-device slicing, the transfer's bookkeeping): 0.42-0.64 ms a batch
for the three fields on this project's CPU, whatever the batch size. One array of bytes costs
one share, and the split is free on the device (slices and bitcasts the step fuses into its
first reads). Readers that can write a batch in place (the binary source's ``pread``) write
straight into the buffer, so the batch is copied once on the host, by the kernel.

Layout. The batch axis is cut into the shards of the mesh's batch sharding (one per device);
this process's buffer is uint8 ``[local shards, shard_bytes]``, shard j holding rows
``[j*rows, (j+1)*rows)`` of the process's slice, field by field: ids (int32 ``[rows, S]``),
dense (float32 ``[rows, num_dense]``), labels (float32 ``[rows]``) and, for dynamic tables
fed by a source with raw ids, raw (uint64 ``[rows, W]``: W 64-bit values per row, of which
``raw_pick`` are the dynamic features', in table order; a preprocessed dataset's rows are read
in whole, so the high and low halves are split and the columns picked on the device, not on the
host's reader threads). Placed with the batch
sharding, each device holds exactly its shard, and :meth:`PackedLayout.unpack` (a
``shard_map`` of local slices) gives the same :class:`~dlrm_jax.data.batch.Batch`, bit for
bit, as placing the three fields one by one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import jax
import numpy as np

from dlrm_jax.data.batch import Batch, RawBatch, faster_path
from dlrm_jax.data.host_buffers import HostBuffers
from dlrm_jax.ids import raw_values

_FIELDS = (("ids", np.int32), ("dense", np.float32), ("labels", np.float32), ("raw", np.uint64))


@dataclass(frozen=True)
class PackedLayout:
    """Where each field of a shard's rows lies in its bytes (see the module docstring)."""

    shards: int  # this process's shards of the batch axis
    rows: int  # rows a shard holds
    ids_width: int  # S: sum of the bag sizes
    num_dense: int
    raw_words: int = 0  # W: 64-bit raw values per row (0: the batch carries no raw ids)
    raw_pick: tuple[int, ...] = ()  # which of them are the dynamic features' ids, in table order

    def widths(self) -> dict[str, tuple[int, ...]]:
        widths = {"ids": (self.ids_width,), "dense": (self.num_dense,), "labels": ()}
        return widths | ({"raw": (self.raw_words,)} if self.raw_words else {})

    def with_raw(self, words: int, pick: tuple[int, ...] | None = None) -> PackedLayout:
        """This layout with ``words`` raw values per row, ``pick`` of them (default: all, in
        order) the dynamic features' ids."""
        return replace(self, raw_words=words, raw_pick=tuple(range(words)) if pick is None else tuple(pick))

    @functools.cached_property
    def offsets(self) -> dict[str, tuple[int, int]]:
        """Field -> (first byte, bytes) within a shard (computed once: readers ask every batch)."""
        out, at = {}, 0
        for name, dtype in self._fields():
            n = self.rows * int(np.prod(self.widths()[name], dtype=np.int64)) * np.dtype(dtype).itemsize
            out[name], at = (at, n), at + n
        return out

    def _fields(self) -> tuple[tuple[str, type], ...]:
        return _FIELDS if self.raw_words else _FIELDS[:3]

    @property
    def shard_bytes(self) -> int:
        return sum(n for _, n in self.offsets.values())

    def empty(self, buffers: HostBuffers | None = None) -> np.ndarray:
        """A host buffer for one batch: from ``buffers`` (reused, pinned on GPUs:
        :mod:`dlrm_jax.data.host_buffers`), else a new one (malloc's kept free lists make that
        cheap: :func:`dlrm_jax.hostmem.keep_freed_memory`)."""
        shape = (self.shards, self.shard_bytes)
        return np.empty(shape, np.uint8) if buffers is None else buffers.take(shape)

    def views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        """Field -> a writable ``[shards, rows, ...]`` view into ``buf`` (each shard's rows
        C-contiguous, the shards ``shard_bytes`` apart)."""
        out = {}
        for (name, dtype), (first, n) in zip(self._fields(), self.offsets.values(), strict=True):
            shape = (self.shards, self.rows, *self.widths()[name])
            out[name] = buf[:, first : first + n].view(dtype).reshape(shape)
        return out

    def pack(self, batch: Batch, buffers: HostBuffers | None = None) -> np.ndarray:
        """A host batch copied into a buffer (sources that cannot read in place; ``buffers``:
        as :meth:`empty`'s)."""
        has_raw = isinstance(batch, RawBatch)
        if has_raw != bool(self.raw_words):  # raw ids dropped here would train on placeholders
            raise ValueError(
                f"PackedLayout.pack: a {type(batch).__name__} into a layout "
                f"{'with' if self.raw_words else 'without'} raw ids (PackedLayout.with_raw)"
            )
        buf = self.empty(buffers)
        for name, view in self.views(buf).items():
            got = getattr(batch, name)
            if name == "raw":  # uint32 [rows, 2, R] (high, low) -> uint64 [rows, R]
                got = raw_values(got)
            view[...] = got.reshape(view.shape)
        return buf

    def unpack(self, packed: jax.Array, mesh, spec) -> Batch:
        """Traced: the global packed array (``[shards over every process, shard_bytes]``,
        sharded by ``spec`` on its first axis) -> the batch, sharded the same way by rows."""
        offsets, pick = self.offsets, np.asarray(self.raw_pick, np.int32)

        def local(x):  # [1, shard_bytes] -> this device's rows
            got = {}
            for name, dtype in self._fields():
                first, n = offsets[name]
                if name == "raw":  # 64-bit values as little-endian (low, high) 32-bit words
                    words = x[0, first : first + n].reshape(-1, 4)
                    halves = jax.lax.bitcast_convert_type(words, np.uint32).reshape(self.rows, self.raw_words, 2)
                    picked = halves[:, pick]  # [rows, R, 2]
                    got[name] = jax.numpy.stack([picked[..., 1], picked[..., 0]], axis=1)  # [rows, 2, R]
                    continue
                words = x[0, first : first + n].reshape(-1, np.dtype(dtype).itemsize)
                got[name] = jax.lax.bitcast_convert_type(words, dtype).reshape(self.rows, *self.widths()[name])
            if self.raw_words:
                return RawBatch(got["dense"], got["ids"], got["labels"], got["raw"])
            return Batch(got["dense"], got["ids"], got["labels"])

        out_specs = RawBatch(spec, spec, spec, spec) if self.raw_words else Batch(spec, spec, spec)
        return jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=out_specs)(packed)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Packed:
    """A batch as one device array of bytes (the train step unpacks it); ``layout`` is static."""

    data: jax.Array
    layout: PackedLayout = field(metadata={"static": True})


class _Joined:
    """A ``[shards, rows, ...]`` view read as ``[shards * rows, ...]`` (``np.asarray``),
    copied only when read."""

    def __init__(self, view: np.ndarray):
        self._view = view

    def __array__(self, dtype=None, copy=None):
        joined = self._view.reshape(-1, *self._view.shape[2:])
        return joined if dtype is None else joined.astype(dtype)


def unpacked(batch, mesh, spec) -> Batch | RawBatch:
    """Traced: ``batch`` as a :class:`Batch` (a :class:`RawBatch` with raw ids), unpacking a
    :class:`Packed` one."""
    return batch.layout.unpack(batch.data, mesh, spec) if isinstance(batch, Packed) else batch


class HostPacked(NamedTuple):
    """One batch's host buffer and its layout (what the readers hand to the transfer)."""

    buf: np.ndarray
    layout: PackedLayout

    @property
    def ids(self) -> _Joined:
        """The batch's ids, joined only when read (hot-row counting reads the steps it counts,
        on its own threads)."""
        return _Joined(self.layout.views(self.buf)["ids"])


def reading_layout(source, layout: PackedLayout) -> PackedLayout:
    """The layout a source that reads in place (``train_batch_into``) writes ``layout``'s
    batches in: with its ``raw_layout``, when not None, the raw values it writes per row and
    which of them are the dynamic features'."""
    raw = getattr(source, "raw_layout", None) if faster_path(source, "train_batch_into") is not None else None
    return layout if raw is None else layout.with_raw(*raw)


def packed_reader(source, layout: PackedLayout, buffers: HostBuffers | None = None) -> Callable[[int], HostPacked]:
    """``step -> HostPacked`` for ``source``: read in place where the source can
    (``train_batch_into``: the binary source's reads go straight into the buffer, in
    :func:`reading_layout`), else its ``train_batch`` copied in (a :class:`RawBatch`'s raw ids
    too); the buffers from ``buffers`` (:mod:`dlrm_jax.data.host_buffers`), else new ones."""
    into = faster_path(source, "train_batch_into")
    layout = reading_layout(source, layout)

    with_raw = functools.cache(layout.with_raw)  # one layout for every batch with raw ids

    def read(step: int) -> HostPacked:
        if into is None:
            batch = source.train_batch(step)
            fits = with_raw(batch.raw.shape[2]) if isinstance(batch, RawBatch) else layout
            return HostPacked(fits.pack(batch, buffers), fits)
        buf = layout.empty(buffers)
        into(step, layout.views(buf))
        return HostPacked(buf, layout)

    return read
