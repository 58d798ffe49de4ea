"""A low-rank cross layer's second product with its elementwise work through the Pallas kernel
(run here in Pallas's interpreter) against XLA's form: values and gradient, split over the
batch's devices without collectives, and lowered to Triton for a GPU (the step, 40 steps
against XLA's layers and one device: tests/train/test_step_invariance.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlrm_jax.model import cross_kernel
from dlrm_jax.parallel.mesh import batch_spec, make_mesh


def _xla(h, v, b, x0, x):
    return x0 * (h @ v + b) + x


def _operands(rng, batch, rank, width, dtype):
    shapes = [(batch, rank), (rank, width), (width,), (batch, width), (batch, width)]
    scales = [1.0, 0.1, 1.0, 1.0, 1.0]
    return [jnp.asarray(rng.standard_normal(s) * c, dtype) for s, c in zip(shapes, scales, strict=True)]


@pytest.mark.parametrize(
    "batch,rank,width",
    [(256, 128, 256), (64, 32, 48), (16, 16, 16), (32, 24, 88), (8, 16, 32)],
    ids=lambda x: str(x),
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_the_layer_and_its_gradient_are_xlas(batch, rank, width, dtype):
    """Tiles of the output in both directions and the product over R in two steps (256, 128,
    256); a tile of 16 (Triton's least) and of a width not a power of two (48 = 3 x 16); shapes
    the kernel does not take (88 wide, 8 samples) in XLA's form. In bfloat16 the values are
    XLA's bit for bit (the product rounded, then each operation), the gradient is in every
    dtype (the backward is XLA's own); in float32 the product is summed in its own order."""
    rng = np.random.default_rng(batch + rank + width)
    args = _operands(rng, batch, rank, width, dtype)
    g = jnp.asarray(rng.standard_normal((batch, width)), dtype)
    want, want_vjp = jax.vjp(_xla, *args)
    got, got_vjp = jax.vjp(jax.jit(cross_kernel.fused_cross), *args)
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == jnp.bfloat16:
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    else:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * np.sqrt(rank))
    for a, w in zip(got_vjp(g), want_vjp(g), strict=True):
        assert a.dtype == w.dtype and a.shape == w.shape
        if dtype == jnp.bfloat16:
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(w, np.float32))
        else:
            np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_each_device_takes_its_own_samples(devices):
    """Under jit's sharding the kernel runs on each device's samples (the weights whole on
    each): the result comes out split as the batch is, and the forward gathers and exchanges
    nothing (XLA would otherwise gather the batch to every device for a kernel it cannot split);
    the backward's only collective sums the weights' gradients."""
    mesh = make_mesh(devices)
    rows, whole = NamedSharding(mesh, batch_spec(mesh)), NamedSharding(mesh, P())
    rng = np.random.default_rng(devices)
    h, v, b, x0, x = _operands(rng, 16 * 8, 16, 32, jnp.float32)
    h, x0, x = (jax.device_put(a, rows) for a in (h, x0, x))
    v, b = jax.device_put(v, whole), jax.device_put(b, whole)
    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)
    got = jax.jit(jax.value_and_grad(loss(cross_kernel.fused_cross), argnums=(0, 1, 2, 3, 4)))(h, v, b, x0, x)
    want = jax.jit(jax.value_and_grad(loss(_xla), argnums=(0, 1, 2, 3, 4)))(h, v, b, x0, x)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for a, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-4, atol=1e-4)
    assert got[1][0].sharding.is_equivalent_to(rows, 2)
    y = jax.jit(cross_kernel.fused_cross)(h, v, b, x0, x)
    assert y.sharding.is_equivalent_to(rows, 2)
    text = jax.jit(cross_kernel.fused_cross).lower(h, v, b, x0, x).compile().as_text()
    for collective in ("all-gather", "all-to-all", "collective-permute", "all-reduce"):
        assert collective not in text, collective


def test_the_kernel_lowers_to_triton_for_a_gpu():
    """The kernel as a GPU build compiles it: lowered for CUDA (on this CPU machine) to one
    Triton kernel at DLRM-DCNv2's shape in bfloat16 (what the interpreter cannot check: Triton's
    rules on block shapes, loads, stores and its dot)."""
    shapes = [(65536, 512), (512, 3456), (3456,), (65536, 3456), (65536, 3456)]
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
    triton = "__gpu$xla.gpu.triton"
    layer = lambda *a: cross_kernel.cross_layer(*a, interpret=False)
    export = jax.export.export(
        jax.jit(layer), platforms=["cuda"], disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)]
    )
    assert export(*args).mlir_module().count(f"@{triton}(") == 1


@pytest.mark.parametrize(
    "choice,parallel,taken",
    [("auto", "data", "xla"), ("xla", "data", "xla"), ("fused", "data", "fused"), ("fused", "tensor", "fused")],
)
def test_model_cross_layers_names_the_layers_the_model_runs(choice, parallel, taken):
    """``auto`` is XLA's layers until the kernel is measured on a GPU; ``fused`` is refused with
    the pipeline, whose first stage runs inside shard_map (with ``tensor`` the layers, split
    over the model group, stay XLA's: :class:`~dlrm_jax.model.cross.CrossNetwork`)."""
    from dlrm_jax.config import ConfigError, load_config
    from dlrm_jax.train.wiring import cross_layers

    assert load_config().model.cross_layers == "auto"
    assert cross_layers(load_config(None, [f"model.cross_layers={choice}", f"model.mlp_parallel={parallel}"])) == taken
    with pytest.raises(ConfigError, match="model.cross_layers=fused: not with model.mlp_parallel=pipeline"):
        load_config(None, ["model.cross_layers=fused", "model.mlp_parallel=pipeline"])
