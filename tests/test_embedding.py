"""The embedding collection against a plain single-device reference, on 1, 2, 4 and 8 devices.

The reference is the obvious program: look rows up with a gather, pool with a loop-free
einsum, and let autodiff produce the full-table gradient (fine at test sizes), then apply the
dense optimizer. The collection must agree on forward vectors, gradients and on the table and
optimizer state after several steps, for every optimizer, one-hot and multi-hot bags.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import dense_reference

from dlrm_jax.data.batch import PAD_ID
from dlrm_jax.data.synthetic import SyntheticSource
from dlrm_jax.embedding.collection import GROUP, EmbeddingCollection
from dlrm_jax.embedding.optimizers import sparse_optimizer_from_config
from dlrm_jax.embedding.plan import EmbeddingPlan, Strategy, plan_embeddings
from dlrm_jax.embedding.specs import SlotLayout, specs_from_config
from dlrm_jax.parallel.mesh import make_mesh


def reference_pool(table, ids, specs, layout):
    """Pooled [B, F, D] by explicit loops over samples and slots (float64)."""
    b, s = ids.shape
    out = np.zeros((b, len(specs), table.shape[1]))
    for i in range(b):
        for f, spec in enumerate(specs):
            slots = [k for k in range(s) if layout.slot_feature[k] == f and ids[i, k] != PAD_ID]
            vecs = [table[layout.table_offset[f] + ids[i, k]] for k in slots]
            if vecs:
                out[i, f] = np.sum(vecs, 0) / (len(vecs) if spec.pooling == "mean" else 1)
    return out


def build(cfg, devices):
    mesh = make_mesh(devices)
    plan = plan_embeddings(specs_from_config(cfg), "replicated", devices, cfg.embedding.optimizer,
                           cfg.train.batch_size)
    return EmbeddingCollection(plan, mesh, sparse_optimizer_from_config(cfg))


CASES = [("sgd", "[1]", "sum"), ("adagrad", "[1]", "sum"), ("rowwise_adagrad", "[1]", "sum"),
         ("rowwise_adagrad", "[3, 1, 4, 2]", "sum"), ("adagrad", "[3, 1, 4, 2]", "mean")]


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
@pytest.mark.parametrize("optimizer,bags,pooling", CASES)
def test_collection_matches_reference(tiny, devices, optimizer, bags, pooling):
    cfg = tiny(f"embedding.optimizer={optimizer}", f"data.bag_sizes={bags}", f"data.pooling={pooling}",
               "train.batch_size=32", "data.cardinalities=[50, 9, 120, 7]")
    coll = build(cfg, devices)
    source = SyntheticSource(cfg)
    state = coll.init(jax.random.key(0))
    table = np.asarray(state.tables[GROUP], np.float64)
    acc = {"sgd": None, "adagrad": np.zeros(table.shape), "rowwise_adagrad": np.zeros(table.shape[0])}[optimizer]
    lr = 0.05
    lookup = jax.jit(coll.lookup)
    update = jax.jit(coll.apply_gradients)
    for step in range(5):
        ids = source.train_batch(step).ids
        ids_dev = jax.device_put(ids, jax.sharding.NamedSharding(coll.mesh, jax.P("devices")))
        pooled, res = lookup(state, ids_dev)
        np.testing.assert_allclose(np.asarray(pooled), reference_pool(table, ids, coll.specs, coll.layout),
                                   rtol=1e-5, atol=1e-6)
        # Gradient of sum(pooled * w) w.r.t. pooled is w; the reference gets the table gradient
        # by autodiff through a plain gather-and-pool.
        w = np.random.default_rng(step).normal(size=pooled.shape).astype(np.float32)
        state = update(state, res, jnp.asarray(w), jnp.float32(lr))
        rows = np.asarray(coll.layout.fused_rows(jnp.asarray(ids))).reshape(-1)
        grad_bsd = w[:, coll.layout.slot_feature, :] * np.asarray(res.weights_bs)[..., None]
        table, acc = dense_reference(optimizer, table, acc, rows, grad_bsd.reshape(-1, table.shape[1]), lr)
        np.testing.assert_allclose(np.asarray(state.tables[GROUP]), table, rtol=1e-5, atol=1e-6)
        if acc is not None:
            np.testing.assert_allclose(np.asarray(state.slots[GROUP]["accumulator"]), acc, rtol=1e-5, atol=1e-7)


def test_gradient_matches_autodiff_of_gather(tiny):
    """The per-slot gradient the collection scatters equals autodiff through a dense lookup."""
    cfg = tiny("data.bag_sizes=[2, 1, 3, 1]", "data.pooling=mean", "data.cardinalities=[50, 9, 120, 7]",
               "embedding.optimizer=sgd")
    coll = build(cfg, 4)
    ids = SyntheticSource(cfg).train_batch(0).ids
    state = coll.init(jax.random.key(0))
    w = jax.random.normal(jax.random.key(1), (ids.shape[0], 4, cfg.model.embedding_dim))

    def loss_of_table(table):
        pooled, _ = coll.lookup(state._replace(tables={GROUP: table}), jnp.asarray(ids))
        return jnp.sum(pooled * w)

    dense_grad = jax.grad(loss_of_table)(state.tables[GROUP])
    sgd_state = coll.apply_gradients(state, coll.lookup(state, jnp.asarray(ids))[1], w, jnp.float32(1.0))
    # One SGD step with lr=1 moves the table by exactly minus the gradient.
    coll_grad = state.tables[GROUP] - sgd_state.tables[GROUP]
    np.testing.assert_allclose(np.asarray(coll_grad), np.asarray(dense_grad), rtol=1e-5, atol=1e-6)
    # Rows never looked up have zero gradient; looked-up rows have some.
    touched = np.unique(np.asarray(coll.layout.fused_rows(jnp.asarray(ids))))
    touched = touched[touched < coll.layout.total_rows]
    mask = np.zeros(coll.layout.total_rows, bool)
    mask[touched] = True
    assert np.all(np.asarray(dense_grad)[~mask] == 0)


def test_tables_are_replicated_on_every_device(tiny):
    coll = build(tiny(), 8)
    state = coll.init(jax.random.key(0))
    assert state.tables[GROUP].sharding.is_fully_replicated
    assert len(state.tables[GROUP].sharding.device_set) == 8


def test_slot_layout():
    from dlrm_jax.embedding.specs import TableSpec

    specs = (TableSpec("a", 10, 4, 2), TableSpec("b", 5, 4, 1), TableSpec("c", 7, 4, 3))
    layout = SlotLayout.build(specs)
    assert layout.total_rows == 22 and not layout.one_hot
    np.testing.assert_array_equal(layout.slot_feature, [0, 0, 1, 2, 2, 2])
    np.testing.assert_array_equal(layout.slot_offset, [0, 0, 10, 15, 15, 15])
    rows = np.asarray(layout.fused_rows(jnp.array([[9, PAD_ID, 4, 0, 6, PAD_ID]])))
    np.testing.assert_array_equal(rows, [[9, 22, 14, 15, 21, 22]])


def test_plan_json_round_trip_and_text(tiny):
    cfg = tiny()
    plan = plan_embeddings(specs_from_config(cfg), "auto", 8, "rowwise_adagrad", 64)
    assert EmbeddingPlan.from_json(plan.to_json()) == plan
    assert all(t.strategy == Strategy.REPLICATED for t in plan.tables)
    text = plan.to_text()
    for t in plan.tables:
        assert t.spec.name in text
    assert "Per device" in text and "Predicted exchange" in text
