"""Multi-layer perceptrons with float32 master weights and optional bfloat16 compute."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dlrm_jax.parallel.mesh import varying


def xavier_normal(key, shape, dtype=jnp.float32):
    """DLRM's (and DCNv2's) weight initialiser: N(0, sqrt(2 / (fan_in + fan_out)))."""
    fan_in, fan_out = shape
    return jax.random.normal(key, shape, dtype) * np.sqrt(2.0 / (fan_in + fan_out))


def _dlrm_bias_init(key, shape, dtype=jnp.float32):
    """DLRM's bias initialiser: N(0, sqrt(1 / fan_out))."""
    return jax.random.normal(key, shape, dtype) * np.sqrt(1.0 / shape[0])


class MLP(nnx.Module):
    """Linear layers with ReLU between them (and after the last when ``final_relu``).

    x: [B, in_features] -> [B, widths[-1]]. Parameters are float32; ``dtype`` is the compute
    precision (bfloat16 halves the bytes of activations and runs on matrix units).

    ``tensor`` (model.mlp_parallel=tensor, :class:`~dlrm_jax.model.mlp_parallel.TensorLayout`):
    layers pair up as :func:`pair_roles` says, a column-parallel layer then a row-parallel one.
    """

    def __init__(self, in_features: int, widths: Sequence[int], *, final_relu: bool, dtype: jnp.dtype, rngs: nnx.Rngs):
        sizes = [in_features, *widths]
        self.layers = nnx.List(
            [
                nnx.Linear(
                    a,
                    b,
                    dtype=dtype,
                    param_dtype=jnp.float32,
                    rngs=rngs,
                    kernel_init=xavier_normal,
                    bias_init=_dlrm_bias_init,
                )
                for a, b in zip(sizes[:-1], sizes[1:], strict=True)
            ]
        )
        self.final_relu = final_relu

    def __call__(self, x: jax.Array, tensor=None) -> jax.Array:
        last = len(self.layers) - 1
        roles = pair_roles(len(self.layers)) if tensor is not None else ("whole",) * len(self.layers)
        for i, (layer, role) in enumerate(zip(self.layers, roles, strict=True)):
            if role == "column":
                x = tensor.gathered(x)
            # A row-parallel kernel is split by its rows: padding them would move it.
            x = linear(x, layer.kernel[...], layer.bias[...], layer.dtype, pad=role != "row")
            if role == "column":
                x = tensor.split(x)
            elif role == "row":
                x = tensor.rows(x)
            if i < last or self.final_relu:
                x = jax.nn.relu(x)
        return x


def pair_roles(layers: int) -> tuple[str, ...]:
    """Megatron pairs over a model group: layers 0, 2, ... are ``column``-parallel (the kernel
    split by output columns), each followed by a ``row``-parallel one (split by input rows,
    whose partial sums are the pair's one reduction); an odd last layer stays ``whole``."""
    return tuple("whole" if i == layers - 1 and i % 2 == 0 else ("column", "row")[i % 2] for i in range(layers))


# Matmuls contract over a multiple of this many inputs: the inputs' extra columns and the
# kernel's extra rows are zeros, so the result is the same and the parameters keep their
# shape. XLA:CPU's matmul kernels (YNNPACK) are much slower on ragged widths: DLRM's top MLP
# takes D + F(F+1)/2 inputs (367 for 26 features of 16), see BENCHMARKS.md.
CONTRACTION_MULTIPLE = 8


def linear(x: jax.Array, kernel: jax.Array, bias: jax.Array, dtype, pad: bool = True) -> jax.Array:
    """``x @ kernel + bias`` computed in ``dtype``; ``pad``: contract over a multiple of
    CONTRACTION_MULTIPLE inputs (zeros added to both sides). Below float32 the product is
    accumulated in float32 and the float32 bias added before one rounding to ``dtype``
    (:func:`_rounded_once`)."""
    extra = -kernel.shape[0] % CONTRACTION_MULTIPLE if pad else 0
    if extra:
        x = jnp.pad(x, ((0, 0), (0, extra)))
        kernel = jnp.pad(kernel, ((0, extra), (0, 0)))
    if dtype is not None and jnp.finfo(dtype).bits < 32:
        # (inside shard_map the weights typed as varying like x first, so autodiff sums their
        # gradients over the devices, not the rule below)
        vary = tuple(jax.typeof(x).manual_axis_type.varying)
        return _rounded_once(x.astype(dtype), varying(kernel, vary), varying(bias.astype(jnp.float32), vary))
    if dtype is not None:
        x, kernel, bias = x.astype(dtype), kernel.astype(dtype), bias.astype(dtype)
    return x @ kernel + bias


@jax.custom_vjp
def _rounded_once(x: jax.Array, kernel: jax.Array, bias: jax.Array) -> jax.Array:
    """``x @ kernel + bias`` for low-precision ``x`` (the float32 ``kernel`` taken in ``x``'s
    dtype), accumulated and biased in float32, then rounded to ``x``'s dtype once. Besides
    the one rounding (the product was rounded, then the bias added and rounded again), on GPUs
    XLA then adds the bias inside the product's kernel: with the bias converted to bfloat16
    there, it wrote the product and a kernel of its own read it back to add the bias (5 such
    passes over criteo_kaggle's activations a step, 420 MB, compiled for one H200). The
    backward is the plain one, in ``x``'s dtype where the autodiff of a float32 result would
    have run its matrix products in float32: the input's gradient in ``x``'s dtype, the
    weights' and the bias's accumulated in float32."""
    return (jnp.dot(x, kernel.astype(x.dtype), preferred_element_type=jnp.float32) + bias).astype(x.dtype)


def _rounded_once_fwd(x, kernel, bias):
    return _rounded_once(x, kernel, bias), (x, kernel.astype(x.dtype))


def _rounded_once_bwd(residuals, g):
    x, kernel = residuals
    dx = g @ kernel.T  # (in x's dtype, accumulated in float32 as any such product)
    dkernel = jnp.dot(x.T, g, preferred_element_type=jnp.float32)
    return dx, dkernel, jnp.sum(g, axis=0, dtype=jnp.float32)


_rounded_once.defvjp(_rounded_once_fwd, _rounded_once_bwd)
