"""DCNv2's cross network (Wang et al., 2021), the interaction of MLPerf's DLRM-DCNv2.

x0 = [bottom output, every embedding vector] (the ``cat`` interaction), then per layer, with
rows as samples, ``x_{l+1} = x0 * (x_l W_l + b_l) + x_l``. With ``rank`` r > 0 each W_l is the
low-rank product U_l V_l (U_l [d, r], V_l [r, d]), applied as (x_l U_l) V_l: 2dr weights and
flops per sample instead of d^2, as MLPerf uses (3 layers of rank 512 over d = 27 x 128). The
output keeps x0's width and feeds the top MLP.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dlrm_jax.model import cross_kernel
from dlrm_jax.model.mlp import xavier_normal


@jax.custom_vjp
def written_once(x0: jax.Array) -> jax.Array:
    """``x0`` as it is, made in the forward by one fusion that writes it whole (an optimization
    barrier; its gradient passes through untouched). Every layer reads x0, so XLA writes it
    anyway; left to itself it also fused x0's concatenation into the first layer's weight-
    gradient GEMM, which then read the pooled vectors apart, so they were written once more
    (DLRM-DCNv2 at 65,536 compiled for one H100, scripts/gpu_compile.py: the stacked pooled
    vectors, 436 MB, written and read again; 0.9 GB a step fewer and 432 MB less scratch
    without them). The same values either way."""
    return jax.lax.optimization_barrier(x0)


written_once.defvjp(lambda x0: (jax.lax.optimization_barrier(x0), None), lambda _, g: (g,))


class CrossNetwork(nnx.Module):
    """``layers`` cross layers over inputs of ``width``; full rank when ``rank`` is 0.

    Parameters: per layer ``u`` [width, rank] and ``v`` [rank, width] (or ``w`` [width, width]),
    Xavier-normal, and ``bias`` [width], zero. Parameters are float32; ``dtype`` is the compute
    precision. Call: x0 [B, width] -> [B, width].

    ``tensor`` (model.mlp_parallel=tensor): a low-rank layer's U is column-parallel and V
    row-parallel over the model group, a Megatron pair with one reduction; full-rank layers
    stay whole.

    ``layers_form`` (``model.cross_layers``): ``fused`` runs a low-rank layer's second product
    with its elementwise work in one kernel (:mod:`dlrm_jax.model.cross_kernel`; not with
    ``tensor``), ``xla`` as XLA composes them; the same values to the product's rounding.
    """

    def __init__(
        self, width: int, layers: int, rank: int, *, dtype: jnp.dtype, layers_form: str = "xla", rngs: nnx.Rngs
    ):
        def weights(shape):
            return nnx.Param(xavier_normal(rngs.params(), shape))

        if rank:
            self.u = nnx.List([weights((width, rank)) for _ in range(layers)])
            self.v = nnx.List([weights((rank, width)) for _ in range(layers)])
        else:
            self.w = nnx.List([weights((width, width)) for _ in range(layers)])
        self.bias = nnx.List([nnx.Param(jnp.zeros((width,), jnp.float32)) for _ in range(layers)])
        self.layers, self.rank, self.dtype, self.layers_form = layers, rank, dtype, layers_form

    def __call__(self, x0: jax.Array, tensor=None) -> jax.Array:
        x0 = written_once(x0.astype(self.dtype))
        x = x0
        fused = self.layers_form == "fused" and self.rank and tensor is None  # (shapes it cannot take: XLA's form)
        for i in range(self.layers):
            if fused:  # the second product, the bias, x0's product and x's sum: one kernel
                h = x @ self.u[i][...].astype(self.dtype)
                v, b = self.v[i][...].astype(self.dtype), self.bias[i][...].astype(self.dtype)
                x = cross_kernel.fused_cross(h, v, b, x0, x)
                continue
            if self.rank and tensor is not None:
                h = tensor.split(tensor.gathered(x) @ self.u[i][...].astype(self.dtype))
                h = tensor.rows(h @ self.v[i][...].astype(self.dtype))
            elif self.rank:  # (x U) V: the d x d product is never formed
                h = (x @ self.u[i][...].astype(self.dtype)) @ self.v[i][...].astype(self.dtype)
            else:
                h = x @ self.w[i][...].astype(self.dtype)
            x = x0 * (h + self.bias[i][...].astype(self.dtype)) + x
        return x
