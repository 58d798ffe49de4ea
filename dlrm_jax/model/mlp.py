"""Multi-layer perceptrons with float32 master weights and optional bfloat16 compute."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


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
    """

    def __init__(self, in_features: int, widths: Sequence[int], *, final_relu: bool,
                 dtype: jnp.dtype, rngs: nnx.Rngs):
        sizes = [in_features, *widths]
        self.layers = nnx.List([
            nnx.Linear(a, b, dtype=dtype, param_dtype=jnp.float32, rngs=rngs,
                       kernel_init=xavier_normal, bias_init=_dlrm_bias_init)
            for a, b in zip(sizes[:-1], sizes[1:], strict=True)
        ])
        self.final_relu = final_relu

    def __call__(self, x: jax.Array) -> jax.Array:
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = _linear(layer, x)
            if i < last or self.final_relu:
                x = jax.nn.relu(x)
        return x


# Matmuls contract over a multiple of this many inputs: the inputs' extra columns and the
# kernel's extra rows are zeros, so the result is the same and the parameters keep their
# shape. XLA:CPU's matmul kernels (YNNPACK) are much slower on ragged widths: DLRM's top MLP
# takes D + F(F+1)/2 inputs (367 for 26 features of 16), see BENCHMARKS.md.
CONTRACTION_MULTIPLE = 8


def _linear(layer: nnx.Linear, x: jax.Array) -> jax.Array:
    kernel, bias = layer.kernel[...], layer.bias[...]
    pad = -kernel.shape[0] % CONTRACTION_MULTIPLE
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)))
        kernel = jnp.pad(kernel, ((0, pad), (0, 0)))
    x, kernel, bias = layer.promote_dtype((x, kernel, bias), dtype=layer.dtype)
    return x @ kernel + bias
