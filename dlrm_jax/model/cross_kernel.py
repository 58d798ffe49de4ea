"""A low-rank cross layer's second GEMM with its elementwise work, as one GPU kernel (Pallas,
Triton): ``y = x0 * (h V + b) + x`` for h = x U [B, R], V [R, D].

XLA's form (``cross.CrossNetwork``) writes h V [B, D] from a GEMM, then reads it back beside
x0 and x in a fusion that writes y: at DLRM-DCNv2's shape (B = 65,536, D = 3,456, R = 512, in
bfloat16) each layer's GEMM writes 453 MB that the next kernel reads again, and the GEMM's own
time is not hidden under that traffic. Here a program takes a [BM, BN] tile of the output: it
sums h V over R in float32 (BK at a time), rounds it as XLA's GEMM does, and in the same tile
adds the bias, multiplies by x0 and adds x, writing ``hv + b`` (the backward's residual) and
y. The backward is XLA's own (the same operations as differentiating XLA's form).

Each result is rounded where XLA's form rounds it (the product to the compute dtype, then each
elementwise operation), so the two agree to the GEMM's summation order. On other backends the
kernel runs in Pallas's interpreter (the tests' path).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jax.sharding import PartitionSpec as P

from dlrm_jax.model.per_device import per_batch_shard

BM, BN, BK = 128, 128, 64  # a program's output tile, and the reduction's step over R
WARPS, STAGES = 8, 3


def _tile(n: int, most: int) -> int:
    """The largest power of two dividing ``n``, at most ``most``."""
    return min(n & -n, most)


def applies(batch: int, rank: int, width: int) -> bool:
    """Whether the kernel takes these shapes: tiles of at least 16 (Triton's dot) dividing them."""
    return all(_tile(n, 16) == 16 for n in (batch, rank, width))


def _kernel(h_ref, v_ref, b_ref, x0_ref, x_ref, hb_ref, y_ref, *, bk: int):
    rank = h_ref.shape[1]

    def step(k, acc):
        at = pl.ds(k * bk, bk)
        return acc + jnp.dot(h_ref[:, at], v_ref[at, :], preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, rank // bk, step, jnp.zeros((h_ref.shape[0], v_ref.shape[1]), jnp.float32))
    dtype = y_ref.dtype
    hb = acc.astype(dtype) + b_ref[...][None, :]  # (rounded as XLA's GEMM, then the add)
    hb_ref[...] = hb
    y_ref[...] = x0_ref[...] * hb + x_ref[...]


def cross_layer(h, v, b, x0, x, interpret: bool | None = None):
    """(``hv + b``, ``x0 * (hv + b) + x``) for h [B, R], v [R, D], b [D], x0 and x [B, D], all
    of one dtype: one kernel (``interpret``: in Pallas's interpreter; default: off GPUs)."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    (batch, rank), width = h.shape, v.shape[1]
    if not applies(batch, rank, width):  # (a device's share of a small batch): XLA's form
        hb = h @ v + b
        return hb, x0 * hb + x
    bm, bn, bk = _tile(batch, BM), _tile(width, BN), _tile(rank, BK)
    tile = lambda rows, cols: pl.BlockSpec((rows, cols), lambda i, j: (i, j))
    out = jax.ShapeDtypeStruct((batch, width), x.dtype)
    return pl.pallas_call(
        functools.partial(_kernel, bk=bk),
        grid=(batch // bm, width // bn),
        in_specs=[
            pl.BlockSpec((bm, rank), lambda i, j: (i, 0)),
            pl.BlockSpec((rank, bn), lambda i, j: (0, j)),
            pl.BlockSpec((bn,), lambda i, j: (j,)),
            tile(bm, bn),
            tile(bm, bn),
        ],
        out_specs=[tile(bm, bn), tile(bm, bn)],
        out_shape=[out, out],
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=WARPS, num_stages=STAGES),
    )(h, v, b, x0, x)


# each device's samples, the weights (v, b) whole on each: no collective either way
_cross_sharded = per_batch_shard(
    lambda h, v, b, x0, x: tuple(cross_layer(h, v, b, x0, x)),
    "b r, r d, d, b d, b d -> b d, b d",
    lambda batch: (P(batch, None), P(batch, None)),
    whole=(1, 2),
)


@jax.custom_vjp
def fused_cross(h, v, b, x0, x):
    """``x0 * (h @ v + b) + x`` through the kernel, differentiable (the backward is XLA's)."""
    return _cross_sharded(h, v, b, x0, x)[1]


def _forward(h, v, b, x0, x):
    hb, y = _cross_sharded(h, v, b, x0, x)
    return y, (h, v, hb, x0)


def _backward(residuals, g):
    """What differentiating XLA's form does, operation for operation (the same bits)."""
    h, v, hb, x0 = residuals
    dhb, dx0, dx = jax.vjp(lambda hb, x0, x: x0 * hb + x, hb, x0, x0)[1](g)
    dhv, db = jax.linear_transpose(lambda hv, b: hv + b, hb, v[0])(dhb)  # (linear: shapes only)
    dh, dv = jax.vjp(jnp.matmul, h, v)[1](dhv)
    return dh, dv, db, dx0, dx


fused_cross.defvjp(_forward, _backward)
