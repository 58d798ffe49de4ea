"""The dot interaction's pairs as GPU kernels (Pallas, Triton): [B, N, D] -> the dot products
of vector pairs i > j, and their gradient, without the [B, N, N] products in memory.

XLA's form (``interaction.lower_triangle_gram``) writes each sample's N x N products (a batched
GEMM) and gathers the pairs from them. The pairs feed the top MLP's first GEMM, whose weight
gradient wants them batch-minor ([pairs, B]), so XLA lays the gather's output out that way and
reads the products one 2-byte value per 32-byte memory sector (criteo_kaggle on one H200: 0.166
ms of a 2.08 ms step; the gradient's gather another 0.059 ms). Here:

forward   a program takes its samples (a power of two: ``samples_per_program``), loads
          their vectors once (in CHUNK-row blocks) and, for each i, the products with the
          rows j < i, CHUNK at a time, summed over D in float32; it writes them pair-major ([P, B]: each store its samples' contiguous
          values of a pair), which is the layout the top MLP reads, so no gather and no
          transpose.
backward  the pairs' gradient dP [B, P] (the layout the top MLP's input gradient comes in):
          dT[i] = sum_j dP(i, j) T[j]; each row i's pairs are contiguous in dP, so a program
          reads them CHUNK at a time and adds both ways (dT[i] += dP(i, j) T[j] and dT[j] +=
          dP(i, j) T[i]), its samples' dT held in registers until written once.

Pairs are in row-major order of (i, j), i > j (``np.tril_indices(n, k=-1)``): pair (i, j) at
i (i - 1) / 2 + j. On other backends the kernels run in Pallas's interpreter (the tests' path).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jax.sharding import PartitionSpec as P

from dlrm_jax.model.per_device import per_batch_shard

CHUNK = 8  # rows j a product block takes (Triton's blocks are powers of two)
WARPS = 4  # per program
# A program's vectors held in registers, in floats: forward, and backward (where their gradient
# is held beside them). At these, ptxas (sm_90a) gives 96 and 104 registers a thread at D = 16,
# no spills; twice the backward's spilled 1.7 KB a thread.
FORWARD_FLOATS = 8192
BACKWARD_FLOATS = 4096


def samples_per_program(batch: int, floats_per_sample: int, budget: int) -> int:
    """Samples a program takes: its vectors within ``budget`` floats, a power of two dividing
    the batch (no program past its end)."""
    most = max(1, budget // floats_per_sample)
    return min(batch & -batch, 1 << (most.bit_length() - 1))


def _chunks(n: int) -> int:
    return -(-n // CHUNK)


def _rows(first: int, count: int):
    """A block of CHUNK places from ``first``, those past ``first + count`` masked (read as
    zero, never written; the arrays are padded so that a block never reaches past them)."""
    return pl.ds(first, CHUNK), lax.iota(jnp.int32, CHUNK) < count


def _load_rows(t_ref, b0, samples, c, n):
    """Samples [b0, b0 + samples) rows [c CHUNK, (c + 1) CHUNK) of t: [samples, CHUNK, D]
    float32 (rows past n read as zero)."""
    rows, inside = _rows(c * CHUNK, n - c * CHUNK)
    block = plt.load(t_ref.at[pl.ds(b0, samples), rows, :], mask=inside[None, :, None], other=0)
    return block.astype(jnp.float32)


def _pairs_kernel(t_ref, out_ref, *, n: int, samples: int):
    b0 = pl.program_id(0) * samples
    # [CHUNK, samples, D]: a block of products comes out pair-major, as it is stored
    blocks = [jnp.transpose(_load_rows(t_ref, b0, samples, c, n), (1, 0, 2)) for c in range(_chunks(n))]
    for i in range(1, n):
        ti = t_ref[pl.ds(b0, samples), i, :].astype(jnp.float32)
        for c in range(_chunks(i)):
            dots = jnp.sum(blocks[c] * ti[None, :, :], axis=2)  # [CHUNK, samples]: pairs (i, c CHUNK + k)
            at, inside = _rows(i * (i - 1) // 2 + c * CHUNK, i - c * CHUNK)
            plt.store(out_ref.at[at, pl.ds(b0, samples)], dots.astype(out_ref.dtype), mask=inside[:, None])


def _pairs_grad_kernel(t_ref, d_ref, dt_ref, *, n: int, samples: int):
    b0 = pl.program_id(0) * samples
    blocks = [_load_rows(t_ref, b0, samples, c, n) for c in range(_chunks(n))]
    acc = [jnp.zeros_like(x) for x in blocks]
    place = lax.iota(jnp.int32, CHUNK)
    for i in range(1, n):
        ti = t_ref[pl.ds(b0, samples), i, :].astype(jnp.float32)
        own = jnp.zeros_like(ti)  # dT[i]'s terms from the pairs (i, j < i)
        for c in range(_chunks(i)):
            at, inside = _rows(i * (i - 1) // 2 + c * CHUNK, i - c * CHUNK)
            d = plt.load(d_ref.at[pl.ds(b0, samples), at], mask=inside[None, :], other=0).astype(jnp.float32)
            own = own + jnp.sum(d[:, :, None] * blocks[c], axis=1)
            acc[c] = acc[c] + d[:, :, None] * ti[:, None, :]
        ci, k = divmod(i, CHUNK)
        acc[ci] = acc[ci] + jnp.where((place == k)[None, :, None], own[:, None, :], 0.0)
    for c, a in enumerate(acc):
        rows, inside = _rows(c * CHUNK, n - c * CHUNK)
        plt.store(dt_ref.at[pl.ds(b0, samples), rows, :], a.astype(dt_ref.dtype), mask=inside[None, :, None])


def _call(kernel, grid: int, out_shape, interpret: bool | None, *args):
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    params = plt.CompilerParams(num_warps=WARPS, num_stages=1)
    return pl.pallas_call(kernel, grid=(grid,), out_shape=out_shape, interpret=interpret, compiler_params=params)(*args)


def _padded_rows(t_bnd: jax.Array) -> jax.Array:
    """T with its rows padded to whole CHUNKs (XLA writes the pad with T's own concatenation)."""
    n = t_bnd.shape[1]
    return jnp.pad(t_bnd, ((0, 0), (0, _chunks(n) * CHUNK - n), (0, 0)))


def pairs_transposed(t_bnd: jax.Array, interpret: bool | None = None) -> jax.Array:
    """[B, N, D] -> [P, B]: the dot products of vector pairs i > j (row-major), pair-major."""
    b, n, d = t_bnd.shape
    pairs = n * (n - 1) // 2
    out = jax.ShapeDtypeStruct((pairs + CHUNK, b), t_bnd.dtype)  # (the last row's block reaches past P)
    samples = samples_per_program(b, _chunks(n) * CHUNK * d, FORWARD_FLOATS)
    kernel = functools.partial(_pairs_kernel, n=n, samples=samples)
    return _call(kernel, b // samples, out, interpret, _padded_rows(t_bnd))[:pairs]


def pairs_gradient(t_bnd: jax.Array, d_pairs: jax.Array, interpret: bool | None = None) -> jax.Array:
    """The gradient of the pairs w.r.t. T: dP [B, P] -> dT [B, N, D]."""
    b, n, d = t_bnd.shape
    t = _padded_rows(t_bnd)
    samples = samples_per_program(b, _chunks(n) * CHUNK * d, BACKWARD_FLOATS)
    kernel = functools.partial(_pairs_grad_kernel, n=n, samples=samples)
    d_padded = jnp.pad(d_pairs, ((0, 0), (0, CHUNK)))  # (the last row's block reaches past P)
    out = jax.ShapeDtypeStruct(t.shape, t_bnd.dtype)
    return _call(kernel, b // samples, out, interpret, t, d_padded)[:, :n]


_pairs_sharded = per_batch_shard(lambda t: pairs_transposed(t), "b n d -> p b", lambda b: P(None, b))
_gradient_sharded = per_batch_shard(
    lambda t, d: pairs_gradient(t, d), "b n d, b q -> b n d", lambda b: P(b, None, None)
)


@jax.custom_vjp
def lower_triangle_gram(t_bnd: jax.Array) -> jax.Array:
    """``interaction.lower_triangle_gram`` through the kernels: [B, N, D] -> [B, N(N-1)/2], the
    dot products of vector pairs i > j (row-major), laid out pair-major."""
    return _pairs_sharded(t_bnd).T


def _forward(t_bnd):
    return lower_triangle_gram(t_bnd), t_bnd


def _backward(t_bnd, d_pairs):
    return (_gradient_sharded(t_bnd, d_pairs),)


lower_triangle_gram.defvjp(_forward, _backward)
