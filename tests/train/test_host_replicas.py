"""embedding.sync=host_replicas against a plain single-device reference: one set of whole
tables, the global batch's gradient and the textbook optimizer. Every host's replica must
equal it after several steps, although each host's all-to-all only reaches its own devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlrm_jax.data.sources import make_source, resolve_data_config
from dlrm_jax.model.dlrm import bce_loss
from dlrm_jax.observe.metrics import TIMING_FIELDS
from dlrm_jax.train.build import build, mesh_from_config
from dlrm_jax.train.trainer import RUN_END_FIELDS as RUN_END
from tests.reference import dense_reference

STEPS = 4
BAGS = ["data.bag_sizes=[3, 1, 4, 2]", "data.pooling=mean"]


def pooled_reference(tables, ids, bag_sizes, mean: bool):
    """[B, F, D]: each feature's bag of rows summed (or averaged), padding (-1) skipped."""
    out, start = [], 0
    for f, size in enumerate(bag_sizes):
        bag = ids[:, start : start + size]
        valid = (bag >= 0).astype(jnp.float32)
        vectors = tables[f][jnp.maximum(bag, 0)] * valid[..., None]
        total = vectors.sum(1)
        out.append(total / jnp.maximum(valid.sum(1), 1.0)[:, None] if mean else total)
        start += size
    return jnp.stack(out, axis=1)


def reference_run(steps, state, batches, optimizer: str, bag_sizes, mean: bool):
    params = jax.device_get(state.params)
    host0 = jax.tree.map(lambda x: x[0], state.emb)
    tables, slots = steps.collection.logical_tables(host0)
    tables = [np.asarray(t, np.float64) for t in tables]
    accs = [np.asarray(s["accumulator"], np.float64) if s else None for s in slots]

    def loss_fn(params, tables, batch):
        pooled = pooled_reference(tables, batch.ids, bag_sizes, mean)
        return jnp.mean(bce_loss(steps._forward(params, pooled, batch), batch.labels))

    grad = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))
    losses = []
    for step, batch in enumerate(batches, 1):
        lr = float(steps.schedule(step - 1))
        loss, (g_params, g_tables) = grad(params, [t.astype(np.float32) for t in tables], batch)
        losses.append(float(loss))
        params = jax.tree.map(lambda p, g, lr=lr: p - lr * g, params, g_params)
        for f, g in enumerate(g_tables):
            rows = np.arange(tables[f].shape[0])
            tables[f], accs[f] = dense_reference(
                optimizer, tables[f], accs[f], rows, np.asarray(g, np.float64), lr * steps.emb_lr_scale
            )
    return losses, params, tables, accs


@pytest.mark.parametrize(
    "devices,hosts,sharding,optimizer,extra",
    [
        (8, 2, "row", "adagrad", []),
        (8, 2, "table", "sgd", BAGS),
        (8, 2, "row", "rowwise_adagrad", [*BAGS, "embedding.bag_exchange=pooled"]),
        (4, 2, "column", "rowwise_adagrad", []),  # whole-row statistics of column slices, over hosts
        (8, 4, "row", "adagrad", ["embedding.capacity_factor=0.3"]),  # buckets overflow: rounds agreed over hosts
        (2, 2, "replicated", "rowwise_adagrad", []),
        (8, 8, "row", "sgd", []),
        (1, 1, "row", "adagrad", []),
    ],
)
def test_host_replicas_match_the_reference(tiny, devices, hosts, sharding, optimizer, extra):
    cfg = resolve_data_config(
        tiny(
            f"mesh.devices={devices}",
            f"mesh.hosts={hosts}",
            "embedding.sync=host_replicas",
            f"embedding.sharding={sharding}",
            "train.optimizer=sgd",
            f"embedding.optimizer={optimizer}",
            "train.learning_rate=0.3",
            *extra,
        )
    )
    source = make_source(cfg)
    _, steps = build(cfg, mesh_from_config(cfg), source, log=lambda *_: None)
    state = steps.init_state()
    batches = [source.train_batch(i) for i in range(STEPS)]
    want_losses, want_params, want_tables, want_accs = reference_run(
        steps, state, batches, optimizer, cfg.bag_sizes, cfg.data.pooling == "mean"
    )

    losses, overflows = [], 0
    for batch in batches:
        state, out, _ = steps.train_step(state, steps.device_batch(batch))
        losses.append(float(out["loss"]))
        overflows += int(out["exchange_overflows"])
    assert ("embedding.capacity_factor=0.3" in extra) == (overflows > 0)
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5)
    for got, want in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    # An adaptive step divides by the gradient's own size: a row whose float32 gradient is a
    # nearly cancelling sum moves by lr * (its rounding) / |g|, so those compare more loosely.
    atol = 1e-6 if optimizer == "sgd" else 3e-5
    for h in range(hosts):
        tables, slots = steps.collection.logical_tables(jax.tree.map(lambda x, h=h: x[h], state.emb))
        for t, (got, want) in enumerate(zip(tables, want_tables, strict=True)):
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=atol, err_msg=f"host {h} table {t}")
            if want_accs[t] is not None:
                np.testing.assert_allclose(
                    np.asarray(slots[t]["accumulator"]),
                    want_accs[t],
                    rtol=1e-4,
                    atol=1e-7,
                    err_msg=f"host {h} table {t} accumulator",
                )
    for x in jax.tree.leaves(state.emb):  # the replicas are bitwise equal
        x = np.asarray(x)
        assert all(np.array_equal(x[h], x[0]) for h in range(hosts))
    assert float(steps.collection.step_metrics(state.emb)["table_divergence"]) == 0.0


@pytest.mark.slow
def test_host_replicas_keep_the_all_to_all_inside_each_host(tiny):
    """The compiled step's all-to-alls each run among one host's devices; what crosses hosts is
    the update's all-gathers between counterpart owners (and the dense all-reduce). The global
    step's all-to-all spans every device."""
    from dlrm_jax.bench.common import hlo_collective_bytes, hlo_replica_groups
    from dlrm_jax.embedding.exchange.common import ROUNDS_SCOPE
    from dlrm_jax.embedding.plan.stats import collective_bytes

    def compiled(sync, hosts):
        cfg = resolve_data_config(
            tiny(
                "mesh.devices=8",
                f"mesh.hosts={hosts}",
                f"embedding.sync={sync}",
                "embedding.sharding=row",
                "embedding.optimizer=adagrad",
            )
        )
        source = make_source(cfg)
        plan, steps = build(cfg, mesh_from_config(cfg), source, log=lambda *_: None)
        batch = steps.device_batch(source.train_batch(0))
        return plan, steps.train_step.lower(steps.init_state(), batch).compile().as_text()

    plan, hlo = compiled("host_replicas", 2)
    # The metrics' predicted cross-host bytes are the compiled step's.
    assert hlo_collective_bytes(hlo, 8, ROUNDS_SCOPE)["all-gather"] == collective_bytes(plan, 2)["all-gather"] > 0
    a2a = hlo_replica_groups(hlo, "all-to-all")
    assert a2a and all(groups and all(len({d // 4 for d in grp}) == 1 for grp in groups) for groups in a2a), a2a
    gathers = [groups for groups in hlo_replica_groups(hlo, "all-gather") if groups]
    assert any(all(grp == [i, i + 4] for i, grp in enumerate(groups)) for groups in gathers), gathers
    assert all(
        groups and [len(grp) for grp in groups] == [8]
        for groups in hlo_replica_groups(compiled("global", 0)[1], "all-to-all")
    )


@pytest.mark.slow
def test_host_replicas_run_equals_a_global_run_through_the_api(tiny, tmp_path):
    """train_and_evaluate with 2 simulated hosts of replicas: the metrics and the exported
    tables are a global run's on the same 8 devices, and a run cut at its step-3 checkpoint
    resumes bitwise."""
    import json

    import tensorstore as ts

    from dlrm_jax.train.export import export_run
    from dlrm_jax.train.trainer import train_and_evaluate

    quiet = dict(log=lambda *_: None)
    common = [
        "mesh.devices=8",
        "embedding.sharding=row",
        "train.log_every=2",
        "train.eval_every=3",
        "train.checkpoint_every=3",
    ]
    runs = {"global": common, "replicas": [*common, "mesh.hosts=2", "embedding.sync=host_replicas"]}
    summaries = {name: train_and_evaluate(tiny(*sets), tmp_path / name, **quiet) for name, sets in runs.items()}
    events = {
        name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in runs
    }
    assert [e["step"] for e in events["global"]] == [e["step"] for e in events["replicas"]]
    for a, b in zip(events["global"], events["replicas"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]) and b["table_divergence"] == 0.0
    assert abs(summaries["global"].auc - summaries["replicas"].auc) < 1e-5
    train_and_evaluate(tiny(*runs["replicas"], "train.steps=3"), tmp_path / "cut", **quiet)
    resumed, whole = train_and_evaluate(tiny(*runs["replicas"]), tmp_path / "cut", **quiet), summaries["replicas"]
    assert (resumed.step, resumed.loss, resumed.auc, resumed.logloss) == (
        whole.step,
        whole.loss,
        whole.auc,
        whole.logloss,
    )
    timeless = lambda e: {k: v for k, v in e.items() if k not in (*TIMING_FIELDS, *RUN_END)}
    cut = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert list(map(timeless, cut)) == list(map(timeless, events["replicas"]))
    for name in runs:
        assert export_run(tmp_path / name, tmp_path / f"{name}_export", **quiet) == 6
    for table in ("cat_0", "cat_2"):
        read = lambda name, t=table: (
            ts.open(
                {
                    "driver": "zarr3",
                    "kvstore": {
                        "driver": "file",
                        "path": str(tmp_path / f"{name}_export" / t / "values"),
                    },
                }
            )
            .result()
            .read()
            .result()
        )
        np.testing.assert_allclose(read("replicas"), read("global"), rtol=1e-5, atol=1e-7)
