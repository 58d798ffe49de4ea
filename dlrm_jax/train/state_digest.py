"""Content checksums of a train state's arrays, saved with each checkpoint and checked on restore.

Orbax's files carry no checksum of their contents: a flipped bit inside a compressed chunk can
decompress to other values without an error, and the run would resume from a state it never
had. An array's checksum is every element's bits, mixed with the element's position in the
whole array, summed modulo 2**32. A sum does not depend on how the array is split, so a state
restored onto another device count checks against the checksums saved from the old one; a
changed element changes its own term only, so any one is caught, and several cancel with a
chance of one in 2**32.

Each device sums its own block (one program for the whole state, at memory speed, with no
collective: a process can compute its part while another has failed to read its files), each
process adds its devices' sums, and the processes add theirs where they decide together
(:meth:`dlrm_jax.train.checkpoint_reader.CheckpointReader.restore_newest_intact`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

_POSITION = np.uint32(0x9E3779B9)  # odd: positions mixed in without two sharing a pattern
_MIX = np.uint32(0x85EBCA6B)  # odd: multiplying by it is one-to-one on 32-bit words


class ChecksumMismatch(ValueError):
    """A restored array's contents differ from the checksum saved with it: the checkpoint is
    damaged (restores treat it as they treat unreadable files)."""


def leaf_names(tree) -> list[str]:
    """ "params.bottom.layers.0.kernel" of every leaf, in tree order (named tuples, dicts and
    lists alike: orbax's metadata holds a saved named tuple as a dict)."""

    def key(k) -> str:
        return str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))))

    return [".".join(key(k) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _words(x: jax.Array) -> jax.Array:
    """x's bits as uint32 words: one per element of 4 bytes or fewer, two (a last axis) for 8."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _block_sum(block: jax.Array, offsets: list, whole: tuple[int, ...]) -> jax.Array:
    """The checksum's terms of ``block``, whose corner is at ``offsets`` in an array shaped ``whole``."""
    words = _words(block)
    whole = (*whole, *words.shape[block.ndim :])
    offsets = [*offsets, *[0] * (words.ndim - block.ndim)]
    position, stride = jnp.zeros(words.shape, jnp.uint32), 1
    for d in reversed(range(words.ndim)):  # the row-major position, modulo 2**32
        at = lax.broadcasted_iota(jnp.uint32, words.shape, d) + jnp.asarray(offsets[d]).astype(jnp.uint32)
        position = position + at * np.uint32(stride % 2**32)
        stride *= whole[d]
    return jnp.sum((words ^ (position * _POSITION)) * _MIX, dtype=jnp.uint32)


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@functools.lru_cache(maxsize=16)  # a run saves and restores the same layouts: compiled once
def _device_sums(mesh, specs: tuple[P, ...], shapes: tuple[tuple[int, ...], ...]):
    """A program: the arrays -> per array, each device's sum over its block ([devices] each),
    a replicated block counted on one device only."""
    names = tuple(mesh.axis_names)

    def local(*blocks):
        sums = []
        for block, spec, whole in zip(blocks, specs, shapes, strict=True):
            offsets, used = [], set()
            for d in range(block.ndim):
                axes = _axes(spec[d] if d < len(spec) else None)
                used.update(axes)
                index = 0
                for a in axes:
                    index = index * mesh.shape[a] + lax.axis_index(a)
                offsets.append(index * block.shape[d])
            first = jnp.bool_(True)  # a replica's copy: the first copy's device counts it
            for a in names:
                if a not in used:
                    first = first & (lax.axis_index(a) == 0)
            sums.append(jnp.where(first, _block_sum(block, offsets, whole), np.uint32(0))[None])
        return sums

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=P(names), check_vma=False))


def process_sums(tree) -> dict[str, int]:
    """{leaf name: this process's devices' part of its checksum} of every array in ``tree``
    (other leaves are not checked). Touches only this process's devices."""
    named = [(n, x) for n, x in zip(leaf_names(tree), jax.tree.leaves(tree), strict=True) if isinstance(x, jax.Array)]
    groups: dict = {}
    for name, x in named:
        if not isinstance(x.sharding, NamedSharding):
            raise TypeError(f"{name}: a state array laid out by {type(x.sharding).__name__}, not on a mesh")
        groups.setdefault(x.sharding.mesh, []).append((name, x))
    out = {}
    for mesh, members in groups.items():
        arrays = [x for _, x in members]
        program = _device_sums(mesh, tuple(x.sharding.spec for x in arrays), tuple(x.shape for x in arrays))
        for (name, _), sums in zip(members, program(*arrays), strict=True):
            out[name] = sum(int(np.asarray(s.data)[0]) for s in sums.addressable_shards) % 2**32
    return out


def combine(every: list[dict[str, int]]) -> dict[str, str]:
    """Every process's :func:`process_sums` -> {leaf name: the checksum, 8 hex digits}."""
    return {name: f"{sum(part[name] for part in every) % 2**32:08x}" for name in every[0]}


def first_mismatch(checksums: dict[str, str], saved: dict[str, str] | None) -> str:
    """What differs between ``checksums`` and ``saved`` (names ``saved`` lacks, and
    checkpoints saved without checksums, pass); "" when nothing does."""
    for name, value in checksums.items():
        if saved and name in saved and saved[name] != value:
            return f"{name}'s contents differ from the checksum saved with it ({value} against {saved[name]})"
    return ""
