"""Writing a step's few entries into large state in place, a chunk at a time.

A step often writes a number of entries known only at run time (the rows a batch gave to new
ids, the map slots it set) into arrays far larger than them (tables, id maps). Choosing among
compiled sizes with ``lax.switch`` would copy those arrays: XLA gives a switch's results
buffers of their own, so state written in a branch is copied whole every step (a table of 200k
rows, 13 MB, twice a step on CPU). A ``while_loop`` carries its buffers and updates them where
they lie; its trip count follows the entries, not the arrays.

:func:`by_chunks` is the other direction: per-entry work over many entries in passes of a
fixed size, so the intermediate arrays hold one pass (a rare large batch needs no more scratch
than the common ones).

On GPUs the trade differs: XLA's GPU runtime reads every loop predicate on the host, and the
index of every switch holding a loop or a collective, a copy and a wait with the device idle
(on one H200 the dynamic step was idle 1.3 ms of 7.1 for them), where on CPUs they cost
nothing and the branches save work; a switch of kernels alone it records into the step's CUDA
graph and decides on the device (``bench.hlo_kernels``).
:func:`by_platform` picks a program's form by the platform it is compiled for (where the caller
knows it, :func:`form_for_platform` picks it before tracing), and :func:`in_chunks_on_cpu`
writes every entry at once elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from dlrm_jax.choices import ControlFlow


def in_chunks(parts, count, size: int, carry, write):
    """``carry`` after ``write(carry, *chunk)`` over the first ``count`` (traced) entries of
    ``parts`` (arrays of one length N), ``size`` at a time. The last chunk ends at N (no
    padding copied each step): it may hold entries an earlier chunk held, so ``write`` must
    give the same result for an entry written twice (a set, not an add). Traceable; inside
    shard_map, a ``write`` whose chunks meet in a collective needs ``count`` alike on every
    device."""
    total = parts[0].shape[0]
    size = max(1, min(size, total))

    def body(c):
        i, carry = c
        start = jnp.minimum(i * size, total - size)
        return i + 1, write(carry, *(lax.dynamic_slice_in_dim(p, start, size) for p in parts))

    return lax.while_loop(lambda c: c[0] * size < count, body, (jnp.int32(0), carry))[1]


def padded_chunks(chunk: int, x: jax.Array) -> jax.Array:
    """``x`` [U, ...] as [chunks, chunk, ...], the last chunk padded with zeros."""
    chunks = -(-x.shape[0] // chunk)
    pad = jnp.zeros((chunks * chunk - x.shape[0], *x.shape[1:]), x.dtype)
    return jnp.concatenate([x, pad]).reshape(chunks, chunk, *x.shape[1:])


def by_chunks(chunk: int, f, *xs):
    """``f`` of the arrays ``xs`` (each [U, ...]; ``f`` works id by id) in passes of ``chunk``
    ids (the padding's results dropped), or at once where ``chunk`` is U."""
    if chunk == xs[0].shape[0]:
        return f(*xs)
    out = lax.map(lambda a: f(*a), [padded_chunks(chunk, x) for x in xs])
    return jax.tree.map(lambda y: y.reshape(-1, *y.shape[2:])[: xs[0].shape[0]], out)


def by_platform(branchy, straight, form: str = ControlFlow.AUTO, sizes: bool = False):
    """``branchy()`` in a program compiled for CPUs, ``straight()`` elsewhere (only the one is
    compiled; ``lax.platform_dependent``): the same results, with or without data-dependent
    loops and switches (see the module docstring). ``form`` (``embedding.dynamic.control_flow``):
    ``branches`` or ``one_path`` takes that one on every platform; ``prefixes`` takes
    ``branchy`` where it is a choice among compiled sizes (``sizes``: one switch, whose work
    follows the batch), ``straight`` elsewhere (loops of chunks, conditionals); ``auto`` is
    ``branches`` on CPUs and ``prefixes`` elsewhere: a choice among sizes is ``branchy``
    everywhere (on GPUs a switch of kernels alone, its branches straight: decided on the device)."""
    if form == ControlFlow.PREFIXES or (form == ControlFlow.AUTO and sizes):
        form = ControlFlow.BRANCHES if sizes else ControlFlow.ONE_PATH
    if form == ControlFlow.BRANCHES:
        return branchy()
    if form == ControlFlow.ONE_PATH:
        return straight()
    return lax.platform_dependent(cpu=branchy, default=straight)


def form_for_platform(form: str, platform: str) -> str:
    """``form`` for a program compiled for ``platform`` (a device's, such as ``"cpu"``): ``auto``
    made the form it takes there (``branches`` on CPUs, ``prefixes`` elsewhere), the others as
    they are. :func:`by_platform` then traces one form, not every platform's: tracing both
    (``lax.platform_dependent``) was half of the dynamic step's 8 s of tracing on CPU."""
    if form != ControlFlow.AUTO:
        return form
    return ControlFlow.BRANCHES if platform == "cpu" else ControlFlow.PREFIXES


def in_chunks_on_cpu(parts, count, size: int, carry, write, form: str = ControlFlow.AUTO):
    """:func:`in_chunks` on CPUs, every entry of ``parts`` at once elsewhere (``form``: as
    :func:`by_platform`'s): ``write`` must leave ``carry`` as it is for the entries past
    ``count`` (padding)."""
    return by_platform(lambda: in_chunks(parts, count, size, carry, write), lambda: write(carry, *parts), form)
