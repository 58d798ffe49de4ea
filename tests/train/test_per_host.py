"""embedding.sync=per_host against a plain single-device reference: each host's tables see
only that host's rows of the batch, the MLP gradient is the global mean, and every
``sync_every`` steps the tables are averaged over hosts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlrm_jax.data.sources import make_source, resolve_data_config
from dlrm_jax.model.dlrm import bce_loss
from dlrm_jax.observe.metrics import TIMING_FIELDS
from dlrm_jax.train.build import build, mesh_from_config
from dlrm_jax.train.trainer import RUN_END_FIELDS as RUN_END

STEPS = 4


def reference_run(steps, state, batches, hosts: int, sync_every: int):
    """Plain JAX on one device: whole [rows, D] tables per host, dense autodiff, SGD."""
    params = jax.device_get(state.params)
    tables = [
        [np.asarray(t) for t in steps.collection.logical_tables(jax.tree.map(lambda x, h=h: x[h], state.emb))[0]]
        for h in range(hosts)
    ]

    def loss_fn(params, tables, batch):
        per = batch.ids.shape[0] // hosts
        pooled = jnp.concatenate(
            [
                jnp.stack([tables[h][f][batch.ids[h * per : (h + 1) * per, f]] for f in range(len(tables[h]))], axis=1)
                for h in range(hosts)
            ]
        )
        return jnp.mean(bce_loss(steps._forward(params, pooled, batch), batch.labels))

    grad = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))
    losses = []
    for step, batch in enumerate(batches, 1):
        lr = float(steps.schedule(step - 1))
        loss, (g_params, g_tables) = grad(params, tables, batch)
        losses.append(float(loss))
        params = jax.tree.map(lambda p, g, lr=lr: p - lr * g, params, g_params)
        tables = jax.tree.map(lambda t, g, lr=lr: t - lr * steps.emb_lr_scale * g, tables, g_tables)
        if sync_every and step % sync_every == 0:
            mean = [sum(tables[h][f] for h in range(hosts)) / hosts for f in range(len(tables[0]))]
            tables = [list(mean) for _ in range(hosts)]
    return losses, params, tables


@pytest.mark.parametrize(
    "devices,hosts,sharding,sync_every",
    [(8, 2, "row", 0), (8, 2, "table", 2), (4, 2, "column", 3), (2, 2, "row", 2), (8, 4, "row", 2), (1, 1, "row", 0)],
)
def test_per_host_matches_the_reference(tiny, devices, hosts, sharding, sync_every):
    cfg = resolve_data_config(
        tiny(
            f"mesh.devices={devices}",
            f"mesh.hosts={hosts}",
            "embedding.sync=per_host",
            f"embedding.sync_every={sync_every}",
            f"embedding.sharding={sharding}",
            "train.optimizer=sgd",
            "embedding.optimizer=sgd",
            "train.learning_rate=0.5",
        )
    )
    source = make_source(cfg)
    _, steps = build(cfg, mesh_from_config(cfg), source, log=lambda *_: None)
    state = steps.init_state()
    batches = [source.train_batch(i) for i in range(STEPS)]
    want_losses, want_params, want_tables = reference_run(steps, state, batches, hosts, sync_every)

    losses = []
    for step, batch in enumerate(batches, 1):
        state, out, _ = steps.train_step(state, steps.device_batch(batch))
        losses.append(float(out["loss"]))
        state = state._replace(emb=steps.collection.after_step(state.emb, step))  # the average when due
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5)
    for got, want in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    for h in range(hosts):
        got = steps.collection.logical_tables(jax.tree.map(lambda x, h=h: x[h], state.emb))[0]
        for t, (g, w) in enumerate(zip(got, want_tables[h], strict=True)):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-6, err_msg=f"host {h} table {t}")
    divergence = float(steps.collection.step_metrics(state.emb)["table_divergence"])
    if hosts == 1 or (sync_every and STEPS % sync_every == 0):
        assert divergence == 0.0
    else:
        assert divergence > 0.0


@pytest.mark.slow
def test_per_host_run_resumes_bitwise_logs_divergence_and_exports_the_average(tiny, tmp_path):
    import json

    import tensorstore as ts

    from dlrm_jax.train.export import export_run
    from dlrm_jax.train.trainer import train_and_evaluate

    quiet = dict(log=lambda *_: None)
    overrides = [
        "mesh.devices=8",
        "mesh.hosts=2",
        "embedding.sync=per_host",
        "embedding.sync_every=4",
        "embedding.sharding=row",
        "train.log_every=1",
        "train.checkpoint_every=3",
        "train.eval_every=3",
    ]
    whole = train_and_evaluate(tiny(*overrides, "train.steps=6"), tmp_path / "whole", **quiet)
    train_and_evaluate(tiny(*overrides, "train.steps=3"), tmp_path / "cut", **quiet)
    cut = train_and_evaluate(tiny(*overrides, "train.steps=6"), tmp_path / "cut", **quiet)
    events = {
        name: [
            {k: v for k, v in json.loads(line).items() if k not in (*TIMING_FIELDS, *RUN_END)}
            for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        ]
        for name in ("whole", "cut")
    }
    assert events["whole"] == events["cut"] and (whole.auc, whole.loss) == (cut.auc, cut.loss)
    divergence = {e["step"]: e["table_divergence"] for e in events["whole"]}
    assert divergence[4] == 0.0 and all(divergence[s] > 0 for s in (1, 2, 3, 5, 6))  # synced at step 4

    # Other host counts or per-host layouts are refused in one line; eval/export of a run saved
    # by several processes (mesh.hosts=0) simulate its hosts in this one.
    from dlrm_jax.train.checkpoint_reader import IncompatibleCheckpoint

    before = {p.name: p.read_bytes() for p in (tmp_path / "cut").iterdir() if p.is_file() and p.name != ".lock"}
    for other, needs in (
        ("mesh.hosts=4", "holds the per-host tables of 2 hosts, this run has 4"),
        ("mesh.devices=4", "laid out on 4 devices per host, this run has 2"),
    ):
        with pytest.raises(IncompatibleCheckpoint, match=needs) as refused:
            train_and_evaluate(tiny(*overrides, other, "train.steps=9"), tmp_path / "cut", **quiet)
        assert "\n" not in str(refused.value)
        # Refused: config.yaml, plan.txt/json and metrics are as the last real run left them.
        assert {
            p.name: p.read_bytes() for p in (tmp_path / "cut").iterdir() if p.is_file() and p.name != ".lock"
        } == before
    assert export_run(tmp_path / "whole", tmp_path / "export", ["mesh.hosts=0"], **quiet) == 6
    cfg = resolve_data_config(tiny(*overrides, "train.steps=6"))
    _, steps = build(cfg, mesh_from_config(cfg), make_source(cfg), **quiet)
    from dlrm_jax.train.checkpoint import Checkpoints
    from dlrm_jax.train.restore import restore_state

    state = restore_state(steps, Checkpoints(tmp_path / "whole" / "checkpoints", 3), **quiet)
    per_host = [steps.collection.logical_tables(jax.tree.map(lambda x, h=h: x[h], state.emb))[0] for h in range(2)]
    for t, name in enumerate(["cat_0", "cat_1", "cat_2", "cat_3"]):
        exported = (
            ts.open(
                {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "export" / name / "values")}}
            )
            .result()
            .read()
            .result()
        )
        np.testing.assert_allclose(exported, (np.asarray(per_host[0][t]) + np.asarray(per_host[1][t])) / 2, rtol=1e-6)

    # A serving delta is of the hosts' average too: it was "operands could not be broadcast
    # together" (its base read with a table per host), and base + delta load to the full export.
    from dlrm_jax import serving
    from dlrm_jax.train.serving_export import export_serving

    for name, kw in (("s3", dict(step=3)), ("s6", {}), ("d", dict(since=3))):
        export_serving(tmp_path / "whole", tmp_path / name, ["mesh.hosts=0"], **kw, **quiet)
    with serving.load(tmp_path / "s3", [tmp_path / "d"]) as merged, serving.load(tmp_path / "s6") as full:
        for f in full.features:
            a, b = merged.tables.table_fields(f["table"]), full.tables.table_fields(f["table"])
            for k in b:
                np.testing.assert_array_equal(a[k], b[k], err_msg=f["table"])
