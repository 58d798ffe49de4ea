"""The dense DLRM: interactions against NumPy references, shapes, bf16 compute."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dlrm_jax.model.dlrm import DLRMDense
from dlrm_jax.model.interaction import cat_interaction, dot_interaction, interaction_width


def numpy_dot_interaction(bottom, emb):
    b, f, d = emb.shape
    t = np.concatenate([bottom[:, None, :], emb], axis=1)
    out = []
    for s in range(b):
        pairs = [t[s, i] @ t[s, j] for i in range(f + 1) for j in range(i)]
        out.append(np.concatenate([bottom[s], pairs]))
    return np.stack(out)


@pytest.mark.parametrize("pairs", ["xla", "fused"])
@pytest.mark.parametrize("f,d", [(1, 4), (3, 8), (26, 16)])
def test_dot_interaction_matches_numpy(f, d, pairs):
    rng = np.random.default_rng(f)
    bottom = rng.normal(size=(5, d)).astype(np.float32)
    emb = rng.normal(size=(5, f, d)).astype(np.float32)
    got = np.asarray(dot_interaction(jnp.asarray(bottom), jnp.asarray(emb), pairs))
    np.testing.assert_allclose(got, numpy_dot_interaction(bottom, emb), rtol=1e-5, atol=1e-5)
    assert got.shape[1] == interaction_width("dot", f, d)


def autodiff_dot_interaction(bottom, emb):
    """The interaction as plain jnp ops, differentiated by JAX: the reference for the hand-written
    gradient of ``lower_triangle_gram``."""
    t = jnp.concatenate([bottom[:, None, :], emb], axis=1)
    rows, cols = np.tril_indices(t.shape[1], k=-1)
    return jnp.concatenate([bottom, jnp.einsum("bid,bjd->bij", t, t)[:, rows, cols]], axis=1)


@pytest.mark.parametrize("f,d", [(1, 4), (3, 8), (26, 16)])
def test_dot_interaction_gradient_matches_autodiff(f, d):
    rng = np.random.default_rng(f)
    bottom, emb = (
        jnp.asarray(rng.normal(size=(6, d)), jnp.float32),
        jnp.asarray(rng.normal(size=(6, f, d)), jnp.float32),
    )
    weights = jnp.asarray(rng.normal(size=(6, interaction_width("dot", f, d))), jnp.float32)
    grads = [
        jax.jit(jax.grad(lambda b, e, fn=fn: jnp.sum(weights * fn(b, e)), argnums=(0, 1)))(bottom, emb)
        for fn in (dot_interaction, autodiff_dot_interaction)
    ]
    for got, want in zip(*grads, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_cat_interaction():
    rng = np.random.default_rng(0)
    bottom = rng.normal(size=(3, 4)).astype(np.float32)
    emb = rng.normal(size=(3, 2, 4)).astype(np.float32)
    got = np.asarray(cat_interaction(jnp.asarray(bottom), jnp.asarray(emb)))
    np.testing.assert_array_equal(got, np.concatenate([bottom, emb[:, 0], emb[:, 1]], axis=1))
    assert got.shape[1] == interaction_width("cat", 2, 4)


def numpy_cross_network(x0, weights, biases):
    """DCNv2 as the paper writes it, one sample at a time: x_{l+1} = x0 * (x_l W_l + b_l) + x_l,
    W_l given whole or as its low-rank factors (U_l, V_l) multiplied out."""
    out = []
    for s in range(x0.shape[0]):
        x = x0[s].astype(np.float64)
        for w, b in zip(weights, biases, strict=True):
            w = w[0].astype(np.float64) @ w[1] if isinstance(w, tuple) else w.astype(np.float64)
            x = x0[s] * (x @ w + b) + x
        out.append(x)
    return np.stack(out)


@pytest.mark.parametrize("layers,rank", [(1, 0), (3, 0), (3, 4), (2, 40)])
def test_cross_network_matches_numpy(layers, rank):
    from dlrm_jax.model.cross import CrossNetwork

    width = 24
    net = CrossNetwork(width, layers, rank, dtype=jnp.float32, rngs=nnx.Rngs(layers + rank))
    rng = np.random.default_rng(rank)
    for i in range(layers):  # non-zero biases, so the test sees them
        net.bias[i][...] = jnp.asarray(rng.normal(size=width) * 0.1, jnp.float32)
    weights = [
        (np.asarray(net.u[i][...]), np.asarray(net.v[i][...])) if rank else np.asarray(net.w[i][...])
        for i in range(layers)
    ]
    biases = [np.asarray(net.bias[i][...]) for i in range(layers)]
    x0 = rng.normal(size=(7, width)).astype(np.float32)
    np.testing.assert_allclose(
        np.asarray(net(jnp.asarray(x0))), numpy_cross_network(x0, weights, biases), rtol=2e-5, atol=2e-5
    )
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(net, nnx.Param)))
    assert n_params == layers * ((2 * width * rank if rank else width * width) + width)


def test_the_cross_networks_x0_is_written_whole_in_the_forward_and_its_gradient_passes_untouched():
    """x0 goes through one optimization barrier in the forward (so the fusion making it writes
    it whole and the stacked pooled vectors are not written apart: 0.9 GB a step on DLRM-DCNv2,
    ``cross.written_once``), none in the backward (one there made XLA write x0's gradient whole
    as well: 1.0 GB more); the values and gradients are the plain ones."""
    from dlrm_jax.model.cross import CrossNetwork, written_once

    net = CrossNetwork(16, 2, 4, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x0 = jnp.asarray(np.random.default_rng(0).normal(size=(5, 16)), jnp.float32)
    loss = lambda x: jnp.sum(net(x) ** 2)
    jaxpr = str(jax.make_jaxpr(jax.value_and_grad(loss))(x0))
    assert jaxpr.count("optimization_barrier") == 1
    y, back = jax.vjp(written_once, x0)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x0))
    np.testing.assert_array_equal(np.asarray(back(2 * x0)[0]), np.asarray(2 * x0))


def test_dcn_model_is_cat_through_the_cross_network():
    kw = dict(num_dense=13, num_features=5, embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1))
    model = DLRMDense(**kw, interaction="dcn", dcn_layers=2, dcn_rank=4, rngs=nnx.Rngs(0))
    dense = jax.random.uniform(jax.random.key(1), (9, 13))
    emb = jax.random.normal(jax.random.key(2), (9, 5, 8))
    want = model.top(model.cross(cat_interaction(model.bottom(dense), emb)))[:, 0]
    np.testing.assert_allclose(np.asarray(model(dense, emb)), np.asarray(want), rtol=1e-6)
    assert model.cross.u[0].shape == (interaction_width("dcn", 5, 8), 4)


@pytest.mark.parametrize("interaction", ["dot", "cat", "dcn"])
def test_dlrm_shapes_and_bf16(interaction):
    kw = dict(
        num_dense=13, num_features=5, embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1), interaction=interaction
    )
    f32 = DLRMDense(**kw, rngs=nnx.Rngs(0))
    bf16 = DLRMDense(**kw, compute_dtype="bfloat16", rngs=nnx.Rngs(0))
    dense = jax.random.uniform(jax.random.key(1), (32, 13))
    emb = jax.random.normal(jax.random.key(2), (32, 5, 8)) * 0.1
    out32, out16 = f32(dense, emb), bf16(dense, emb)
    assert out32.shape == (32,) and out32.dtype == jnp.float32 and out16.dtype == jnp.float32
    # Master weights stay float32 under bf16 compute.
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(bf16, nnx.Param)))
    rel = float(jnp.linalg.norm(out16 - out32) / jnp.linalg.norm(out32))
    assert rel < 3e-2, rel


def test_a_low_precision_layer_rounds_once_and_its_gradients_are_the_products_in_its_dtype():
    """``mlp.linear`` in bfloat16: the product accumulated and the float32 bias added before one
    rounding (bit for bit that expression); its gradients (its own rule: the matrix products in
    bfloat16, where autodiff of a float32 sum ran them in float32) against the float32 layer's
    within bfloat16's precision, the weights' and the bias's returned in float32; and in float32
    the layer is the plain expression still."""
    from dlrm_jax.model.mlp import linear

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(64, 13)).astype(np.float32))  # 13 inputs: padded to 16
    kernel = jnp.asarray(rng.normal(size=(13, 8)).astype(np.float32))
    bias = jnp.asarray(rng.normal(size=(8,)).astype(np.float32))
    bf = jnp.bfloat16
    got = linear(x, kernel, bias, bf)
    want = (jnp.dot(x.astype(bf), kernel.astype(bf), preferred_element_type=jnp.float32) + bias).astype(bf)
    assert got.dtype == bf
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))

    weights = jnp.asarray(rng.normal(size=(64, 8)).astype(np.float32))
    loss = lambda dtype: lambda k, b, x: jnp.sum(linear(x, k, b, dtype).astype(jnp.float32) * weights)
    low = jax.grad(loss(bf), argnums=(0, 1, 2))(kernel, bias, x)
    full = jax.grad(loss(jnp.float32), argnums=(0, 1, 2))(kernel, bias, x)
    for g, f in zip(low, full, strict=True):
        assert g.dtype == jnp.float32 and g.shape == f.shape
        scale = float(jnp.max(jnp.abs(f)))
        np.testing.assert_allclose(np.asarray(g), np.asarray(f), atol=0.02 * scale, rtol=0)
    padded = jnp.pad(x, ((0, 0), (0, 3))) @ jnp.pad(kernel, ((0, 3), (0, 0))) + bias
    np.testing.assert_array_equal(np.asarray(linear(x, kernel, bias, jnp.float32)), np.asarray(padded))
