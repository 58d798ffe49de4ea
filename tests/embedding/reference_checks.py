"""The single-device float64 reference the embedding tests hold every strategy to: a plain
gather and loops for the forward vectors, the textbook optimizer on the full-table gradient for
the tables and their state (tests/embedding/test_embedding.py's docstring says more). Shared
by test_embedding, test_hot_rows and test_row_update_kernel."""

import jax
import jax.numpy as jnp
import numpy as np

from dlrm_jax.data.batch import PAD_ID
from dlrm_jax.data.sources.synthetic import SyntheticSource
from dlrm_jax.embedding.exchange.collection import EmbeddingCollection
from dlrm_jax.parallel.mesh import AXIS, make_mesh
from dlrm_jax.train.optimizer_setup import sparse_optimizer_from_config
from dlrm_jax.train.wiring import plan_from_config
from tests.reference import dense_reference

CARDS = "data.cardinalities=[50, 9, 120, 7, 33]"


def reference_pool(table, offsets, ids, specs):
    """Pooled [B, F, D] by explicit loops over samples and slots (float64)."""
    out = np.zeros((ids.shape[0], len(specs), table.shape[1]))
    slot_feature = np.repeat(np.arange(len(specs)), [s.bag_size for s in specs])
    for i in range(ids.shape[0]):
        for f, spec in enumerate(specs):
            vecs = [table[offsets[f] + ids[i, k]] for k in np.flatnonzero(slot_feature == f) if ids[i, k] != PAD_ID]
            if vecs:
                out[i, f] = np.sum(vecs, 0) / (len(vecs) if spec.pooling == "mean" else 1)
    return out


def build(cfg, devices, plan=None):
    plan = plan or plan_from_config(cfg, devices)
    return EmbeddingCollection(plan, make_mesh(devices), sparse_optimizer_from_config(cfg))


def logical(coll, state):
    tables, slots = coll.logical_tables(state)
    acc = [s["accumulator"] for s in slots] if "accumulator" in slots[0] else None
    return (
        np.concatenate([np.asarray(t, np.float64) for t in tables]),
        None if acc is None else np.concatenate([np.asarray(a, np.float64) for a in acc]),
    )


def close(got, want, rtol, atol, norm_tol):
    if norm_tol is None:
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    else:  # bf16: rounding of partial sums before they cancel makes elementwise error meaningless
        rel = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert rel < norm_tol, rel


def check_against_reference(
    cfg, devices, steps=40, rtol=1e-5, atol=1e-6, norm_tol=None, plan=None, hot_keys=None, refresh=None
):
    """``hot_keys``: the hot set to start with (the plan must have hot rows); ``refresh``: {step:
    keys} hot sets to switch to before those steps."""
    coll = build(cfg, devices, plan)
    source = SyntheticSource(cfg)
    state = coll.init(jax.random.key(0))
    if hot_keys is not None:
        state = coll.refresh(state, hot_keys)
    table, acc = logical(coll, state)
    offsets = np.concatenate([[0], np.cumsum([s.rows for s in coll.specs])[:-1]])
    slot_feature = coll.slot_feature
    lookup, update = jax.jit(coll.lookup), jax.jit(coll.apply_gradients)
    batch_sharding = jax.sharding.NamedSharding(coll.mesh, jax.P(AXIS))
    for step in range(steps):
        if refresh and step in refresh:
            state = coll.refresh(state, refresh[step])
            got_table, got_acc = logical(coll, state)
            close(got_table, table, rtol, atol, norm_tol)
        ids = source.train_batch(step).ids
        pooled, res = lookup(state, jax.device_put(ids, batch_sharding))
        close(np.asarray(pooled), reference_pool(table, offsets, ids, coll.specs), rtol, atol, norm_tol)
        w = np.random.default_rng(step).normal(size=pooled.shape).astype(np.float32)
        state = update(state, res, jax.device_put(w, batch_sharding), jnp.float32(0.05))
        # Reference: d(sum(pooled * w))/d(row) = w[feature] * pooling weight, summed per row.
        rows = np.where(ids == PAD_ID, len(table), ids + offsets[slot_feature])
        grads = w[:, slot_feature, :] * np.asarray(res.weights_bs)[..., None]
        table, acc = dense_reference(
            cfg.embedding.optimizer, table, acc, rows.reshape(-1), grads.reshape(-1, table.shape[1]), 0.05
        )
        got_table, got_acc = logical(coll, state)
        close(got_table, table, rtol, atol, norm_tol)
        if acc is not None:
            close(got_acc, acc, rtol, atol * 0.1, norm_tol)
    return coll, state


def strategy_overrides(name):
    if name == "row_cyclic":
        return ["embedding.sharding=row", "embedding.row_layout=cyclic"]
    if name == "mixed":
        return ["embedding.sharding=table", "embedding.table_sharding=[cat_0=row, cat_1=replicated, cat_2=column]"]
    if name in ("host_row", "host_column"):  # hosts of 2 devices: 1, 1, 2 and 4 hosts on 1, 2, 4 and 8 devices
        return [f"embedding.sharding={name}", "cluster.devices_per_host=2"]
    if name == "mixed_hosts":  # every strategy beside rows and columns within hosts of 4
        return [
            "embedding.sharding=host_row",
            "cluster.devices_per_host=4",
            "model.embedding_dim=16",
            "model.bottom_mlp=[16, 16]",
            "embedding.table_sharding=[cat_0=row, cat_1=replicated, cat_2=column, cat_3=host_column]",
        ]
    return [f"embedding.sharding={name}"]
