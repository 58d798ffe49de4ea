"""examples/two_tower.py, a model of the user's own on the sharded tables, on 8 devices.

Against a plain single-device reference -- dense jnp tables differentiated whole, the same loss,
optax on the towers and textbook Adagrad on the full tables' gradients -- the example's sharded
lookup, gradients and sparse updates agree: the forward and every gradient of one step, and the
losses, towers, tables and accumulators over 5 of its own jitted train steps. And it learns:
held-out recall@k rises from chance.
"""

import dataclasses
import importlib.util
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dlrm_jax


def load_example(name: str):
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"examples_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


tt = load_example("two_tower")
SMALL = tt.Settings(
    batch_size=64,
    devices=8,
    users=500,
    topics=8,
    items_per_topic=40,
    regions=32,
    history=4,
    dim=8,
    hidden=16,
    out=8,
    k=5,
    eval_batches=2,
)
TOL = dict(rtol=1e-5, atol=1e-6)  # as tests/embedding/test_embedding.py: float32 rounding, other sum orders


@pytest.fixture(scope="module")
def mesh():
    return dlrm_jax.make_mesh(8)


def reference_lookup(tables, ids_bs, specs):
    """Pooled [B, F, D] from whole tables on one device: gather, mask the padding, pool."""
    out, col = [], 0
    for table, spec in zip(tables, specs, strict=True):
        ids = ids_bs[:, col : col + spec.bag_size]
        col += spec.bag_size
        valid = ids != dlrm_jax.PAD_ID
        pooled = jnp.sum(table[jnp.where(valid, ids, 0)] * valid[..., None], axis=1)
        if spec.pooling == "mean":
            pooled = pooled / jnp.maximum(jnp.sum(valid, axis=1, keepdims=True), 1)
        out.append(pooled)
    return jnp.stack(out, axis=1)


def reference_grads(graphdef, s, params, tables, ids_bs):
    """Loss, pooled vectors and the gradients w.r.t. the towers and the whole tables."""

    def loss(params, tables):
        pooled = reference_lookup(tables, ids_bs, tt.table_specs(s))
        return tt.loss_fn(graphdef, s, params, pooled, ids_bs), pooled

    (value, pooled), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(params, tables)
    return value, pooled, grads


def reference_step(graphdef, s, tx, params, opt_state, tables, accs, ids_bs):
    value, _, (g_params, g_tables) = reference_grads(graphdef, s, params, tables, ids_bs)
    updates, opt_state = tx.update(g_params, opt_state, params)
    params = optax.apply_updates(params, updates)
    # Textbook Adagrad on the whole tables' gradients (rows not looked up: g = 0, unchanged).
    accs = [a + g * g for a, g in zip(accs, g_tables, strict=True)]
    tables = [t - s.sparse_lr * g / (jnp.sqrt(a) + 1e-8) for t, g, a in zip(tables, g_tables, accs, strict=True)]
    return params, opt_state, tables, accs, value


def host(tree):
    return jax.tree.map(np.asarray, tree)


def logical(collection, emb):
    tables, slots = collection.logical_tables(emb)
    return host(tables), host([s.get("accumulator") for s in slots])


@pytest.mark.slow  # 6-10 s on 2 cores
def test_forward_and_gradients_match_reference(mesh):
    s = SMALL
    parts = tt.build(s, mesh)
    assert [t.strategy.value for t in parts.tables.plan.tables] == ["row", "table", "row", "row", "table"]
    ids = tt.Clicks(s).batch(0)
    ids_bs = jax.device_put(ids, parts.tables.batch_sharding)
    # The tables' gradient, read off an SGD update (lr 1) of zeroed tables on the same plan.
    sgd = dlrm_jax.EmbeddingCollection(parts.tables.plan, mesh, dlrm_jax.sparse_optimizer("sgd"))

    @jax.jit
    def sharded(state, ids_bs):
        pooled, res = parts.tables.lookup(state.tables, ids_bs)
        loss, (g_params, g_bfd) = jax.value_and_grad(partial(tt.loss_fn, parts.graphdef, s), (0, 1))(
            state.params, pooled, ids_bs
        )
        zero = dlrm_jax.EmbeddingState(
            jax.tree.map(jnp.zeros_like, state.tables.tables), {k: {} for k in state.tables.slots}
        )
        return loss, pooled, g_params, sgd.apply_gradients(zero, res, g_bfd, 1.0)

    loss, pooled, g_params, minus_g = sharded(parts.state, ids_bs)
    tables, accs = logical(parts.tables, parts.state.tables)
    assert all(np.all(a == 0) for a in accs)
    want_loss, want_pooled, (want_params, want_tables) = jax.jit(partial(reference_grads, parts.graphdef, s))(
        host(parts.state.params), tables, ids
    )

    np.testing.assert_allclose(pooled, want_pooled, **TOL)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, **TOL), host(g_params), host(want_params))
    got_tables, _ = logical(sgd, minus_g)
    for got, want in zip(got_tables, host(want_tables), strict=True):
        np.testing.assert_allclose(-got, want, **TOL)
    assert sum(np.count_nonzero(g.any(1)) for g in got_tables) > s.batch_size  # many rows, not all
    assert all(np.count_nonzero(g.any(1)) < len(g) for g in got_tables[::3])


def test_train_steps_match_reference(mesh):
    """The example's own jitted step (Adam on the towers, sparse Adagrad) against the reference."""
    s = SMALL
    parts = tt.build(s, mesh)
    tables, accs = logical(parts.tables, parts.state.tables)
    params, opt_state = host(parts.state.params), host(parts.state.opt_state)
    step = jax.jit(partial(reference_step, parts.graphdef, s, tt.dense_optimizer(s)))
    data, state = tt.Clicks(s), parts.state
    for i in range(5):
        ids = data.batch(i)
        state, loss = parts.train_step(state, jax.device_put(ids, parts.tables.batch_sharding))
        params, opt_state, tables, accs, want_loss = step(params, opt_state, tables, accs, ids)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, **TOL), host(state.params), host(params))
    got_tables, got_accs = logical(parts.tables, state.tables)
    for got, want in zip(got_tables + got_accs, host(tables) + host(accs), strict=True):
        np.testing.assert_allclose(got, want, **TOL)
    for table in state.tables.tables.values():  # still split over the 8 devices, nowhere whole
        assert {shard.data.shape[0] for shard in table.addressable_shards} == {table.shape[0] // 8}


def test_recall_rises_from_chance():
    lines = []
    history = tt.train(dataclasses.replace(SMALL, steps=60, eval_every=30), log=lines.append)
    chance = SMALL.k / SMALL.batch_size
    assert [h["step"] for h in history] == [0, 30, 60]
    assert history[0]["recall"] < 2 * chance
    assert history[-1]["recall"] > 4 * chance, history
    assert history[-1]["loss"] < history[0]["loss"] - 1.0, history
    assert lines[0].startswith("Embedding plan: 5 tables on 8 devices")  # the example prints the whole plan
    assert lines[-1].startswith("final step=60 ")


def test_pieces_name_what_is_wrong():
    """Mistakes a user of the pieces makes are refused with the table or name in the message."""
    with pytest.raises(ValueError, match="table hist: pooling 'avg'"):
        dlrm_jax.TableSpec("hist", 10, 8, bag_size=3, pooling="avg")
    with pytest.raises(ValueError, match="table t: rows=0"):
        dlrm_jax.TableSpec("t", 0, 8)
    specs = tt.table_specs(SMALL)
    with pytest.raises(dlrm_jax.PlanError, match="no table named 'user_regoin'"):
        dlrm_jax.plan_embeddings(specs, "row", 8, "adagrad", 64, overrides={"user_regoin": "table"})
    with pytest.raises(ValueError, match="no sparse optimizer 'adam'"):
        dlrm_jax.sparse_optimizer("adam")
    assert dlrm_jax.TableSpec("h", 10, 8, 3, "mean").pooling == "mean"
    # Before: ids of the wrong rank were a TypeError from inside JAX ("incompatible shapes").
    two = [dlrm_jax.TableSpec("a", 10, 8), dlrm_jax.TableSpec("b", 10, 8, bag_size=2)]
    tables = dlrm_jax.EmbeddingCollection(dlrm_jax.plan_embeddings(two, "row", 2, "sgd", 4), dlrm_jax.make_mesh(2))
    with pytest.raises(ValueError, match=r"ids must have shape \[batch, 3\] .*got \[4, 1, 3\]"):
        tables.lookup(tables.init(jax.random.key(0)), np.zeros((4, 1, 3), np.int32))


@pytest.mark.parametrize(
    "change,says",
    [
        ({"devices": 16}, "--devices 16: 0 (all) to the 8 devices here"),
        ({"devices": 3}, "--batch-size 256: a multiple of the 3 devices"),
        ({"eval_every": 0}, "--eval-every 0: expected an integer >= 1"),  # was a ZeroDivisionError
        ({"sharding": "foo"}, "--sharding foo: one of row"),  # was a PlanError traceback
        ({"k": 10, "batch_size": 8}, "--k 10: at most --batch-size 8"),  # was 'chance 1.250'
    ],
)
def test_the_examples_settings_are_checked_in_one_line(change, says):
    assert tt.settings_problem(dataclasses.replace(tt.Settings(), **change), 8).startswith(says)
    assert tt.settings_problem(tt.Settings(), 8) == ""
