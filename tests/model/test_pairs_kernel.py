"""The dot interaction's pairs through the Pallas kernels (run here in Pallas's interpreter)
against XLA's form: values and gradient, split over the batch's devices without collectives,
and lowered to Triton for a GPU (the step, 40 steps against one device with XLA's pairs:
tests/train/test_step_invariance.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from dlrm_jax.model import interaction, pairs_kernel
from dlrm_jax.parallel.mesh import batch_spec, make_mesh


def _pairs_and_gradient(pairs, t, d_pairs):
    out, vjp = jax.vjp(pairs, t)
    return out, vjp(d_pairs)[0]


@pytest.mark.parametrize(
    "b,n,d",
    [(64, 27, 16), (24, 5, 8), (16, 9, 128), (6, 10, 4), (5, 2, 8), (8, 8, 16), (16, 17, 8)],
    ids=lambda x: str(x),
)
def test_pairs_and_their_gradient_are_xlas(b, n, d):
    """Rows in one block and in several, the last row's block reaching past the pairs (n = 10,
    17), a single pair (n = 2), an odd batch (one sample a program)."""
    rng = np.random.default_rng(n * d)
    t = jnp.asarray(rng.standard_normal((b, n, d)), jnp.float32)
    d_pairs = jnp.asarray(rng.standard_normal((b, n * (n - 1) // 2)), jnp.float32)
    want = _pairs_and_gradient(interaction.lower_triangle_gram, t, d_pairs)
    got = _pairs_and_gradient(jax.jit(pairs_kernel.lower_triangle_gram), t, d_pairs)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5 * np.sqrt(d * n))


def test_bfloat16_vectors_give_their_float32_sums_rounded_once():
    """In bfloat16 each pair is summed in float32 and rounded once, as the GEMM does."""
    rng = np.random.default_rng(0)
    t = jnp.asarray(rng.standard_normal((32, 12, 16)), jnp.bfloat16)
    d_pairs = jnp.asarray(rng.standard_normal((32, 66)), jnp.bfloat16)
    got = _pairs_and_gradient(pairs_kernel.lower_triangle_gram, t, d_pairs)
    exact = _pairs_and_gradient(interaction.lower_triangle_gram, t.astype(jnp.float32), d_pairs.astype(jnp.float32))
    for g, w in zip(got, exact, strict=True):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w.astype(jnp.bfloat16), np.float32), rtol=8e-3)


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_each_device_takes_its_own_samples(devices):
    """Under jit's sharding the kernels run on each device's samples: the pairs come out split
    as the batch is, and neither direction gathers or exchanges anything (XLA would otherwise
    gather the batch to every device for a kernel it cannot split)."""
    mesh = make_mesh(devices)
    sharding = NamedSharding(mesh, batch_spec(mesh))
    rng = np.random.default_rng(devices)
    t = jax.device_put(jnp.asarray(rng.standard_normal((64, 11, 8)), jnp.float32), sharding)
    step = jax.jit(lambda t: jax.value_and_grad(lambda t: jnp.sum(pairs_kernel.lower_triangle_gram(t) ** 2))(t))
    (loss, grad), (want_loss, want_grad) = (
        step(t),
        jax.jit(jax.value_and_grad(lambda t: jnp.sum(interaction.lower_triangle_gram(t) ** 2)))(t),
    )
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=1e-5, atol=1e-4)
    assert grad.sharding.is_equivalent_to(sharding, 3)
    assert jax.jit(pairs_kernel.lower_triangle_gram)(t).sharding.is_equivalent_to(sharding, 2)
    hlo = jax.jit(lambda t: jax.grad(lambda t: jnp.sum(pairs_kernel.lower_triangle_gram(t)))(t)).lower(t)
    text = hlo.compile().as_text()
    for collective in ("all-gather", "all-to-all", "collective-permute", "all-reduce"):
        assert collective not in text, collective


@pytest.mark.parametrize("width", [16, 128])
def test_kernels_lower_to_triton_for_a_gpu(width):
    """The kernels as a GPU build compiles them: lowered for CUDA (on this CPU machine) to one
    Triton kernel each way, in bfloat16 at criteo_kaggle's and the MLPerf-v1 shape's widths
    (what the interpreter cannot check: Triton's rules on shapes, loads and stores)."""
    t = jax.ShapeDtypeStruct((65536, 27, width), jnp.bfloat16)
    d_pairs = jax.ShapeDtypeStruct((65536, 351), jnp.bfloat16)
    triton = "__gpu$xla.gpu.triton"
    export = jax.export.export
    checks = [jax.export.DisabledSafetyCheck.custom_call(triton)]
    forward = lambda t: pairs_kernel.pairs_transposed(t, interpret=False)
    backward = lambda t, d: pairs_kernel.pairs_gradient(t, d, interpret=False)
    for fn, args in ((forward, (t,)), (backward, (t, d_pairs))):
        module = export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()
        assert module.count(f"@{triton}(") == 1


@pytest.mark.parametrize("batch", [65536, 96, 5, 1])
def test_a_program_takes_a_power_of_two_of_samples_that_divides_the_batch(batch):
    for floats, budget in ((32 * 16, pairs_kernel.FORWARD_FLOATS), (32 * 128, pairs_kernel.BACKWARD_FLOATS)):
        samples = pairs_kernel.samples_per_program(batch, floats, budget)
        assert batch % samples == 0 and samples & (samples - 1) == 0
        assert samples * floats <= budget or samples == 1


@pytest.mark.parametrize(
    "choice,parallel,taken",
    [("auto", "data", "xla"), ("xla", "data", "xla"), ("fused", "data", "fused"), ("fused", "tensor", "fused")],
)
def test_model_dot_pairs_names_the_pairs_the_model_makes(choice, parallel, taken):
    """``auto`` is XLA's pairs until the kernels are measured on a GPU; ``fused`` is refused
    with the pipeline, whose first stage runs inside shard_map."""
    from dlrm_jax.config import ConfigError, load_config
    from dlrm_jax.train.wiring import dot_pairs

    assert load_config().model.dot_pairs == "auto"
    assert dot_pairs(load_config(None, [f"model.dot_pairs={choice}", f"model.mlp_parallel={parallel}"])) == taken
    with pytest.raises(ConfigError, match="model.dot_pairs=fused: not with model.mlp_parallel=pipeline"):
        load_config(None, ["model.dot_pairs=fused", "model.mlp_parallel=pipeline"])
