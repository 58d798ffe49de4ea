"""``dlrm-jax bench hot``: hot-row replication against none, side by side, on skewed ids.

For each Zipf exponent, id layout (``permuted``: hot ids scattered over each table;
``frequency_ordered``: id 0 the most frequent, as ``preprocess`` vocabularies number them) and
row layout (``block``, ``cyclic``), every table row-wise, the run is built as training builds it,
twice: with ``embedding.hot.rows=auto`` (the cost model decides, possibly nothing) and with no
hot rows. Reported per case:

- bytes per device and step counted from the compiled HLO of the embedding step alone (lookup,
  exchange, sparse update from a fixed upstream gradient), so every collective in it is the
  embedding's (the overflow rounds, compiled but not taken, left out): all-to-all (with the
  pooled exchange's and replicated tables' all-gathers), all-reduce (the hot gradients), total;
- the bucket capacity (the busiest owner's, which hot rows are meant to shrink), and the hot
  hit rate measured on the timed batches;
- ``step_ms``: the whole train step (dense forward and backward, the hot gradients inside the
  dense gradients' all-reduce), and ``embedding_step_ms``: the embedding step alone;
- what an exchange without deduplication would send (one id, vector and gradient per remote
  lookup, as TorchRec and HugeCTR send them; averaged over devices).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlrm_jax.bench import check_device_step
from dlrm_jax.bench.common import (
    each_case,
    hlo_collective_bytes,
    machine_description,
    round_robin,
    write_report,
)
from dlrm_jax.config import validate
from dlrm_jax.data.sources import make_source
from dlrm_jax.embedding.exchange.common import ROUNDS_SCOPE
from dlrm_jax.embedding.exchange.relayout import physical_rows_np
from dlrm_jax.embedding.hot.index import hot_keys
from dlrm_jax.embedding.plan.embedding_plan import DTYPE_BYTES
from dlrm_jax.embedding.plan.layout import build_groups, group_capacity
from dlrm_jax.embedding.plan.stats import exchange_bytes_per_step, lower_bound_bytes
from dlrm_jax.ids import PAD_ID
from dlrm_jax.parallel.mesh import AXIS, make_mesh
from dlrm_jax.train.build import build

ZIPF = (1.05, 1.1, 1.2)
LAYOUTS = ("permuted", "frequency_ordered")
ROW_LAYOUTS = ("block", "cyclic")
LR = 0.01
TIMED_BATCHES = 4  # distinct batches the timed steps cycle over (after the calibration batches)


def _with(cfg, **embedding_and_data):
    data = {k: v for k, v in embedding_and_data.items() if k in ("zipf_exponent", "id_layout")}
    emb = {k: v for k, v in embedding_and_data.items() if k not in data}
    hot = emb.pop("hot_rows", None)
    embedding = dataclasses.replace(cfg.embedding, **emb)
    if hot is not None:
        embedding = dataclasses.replace(embedding, hot=dataclasses.replace(embedding.hot, rows=hot))
    return validate(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **data), embedding=embedding))


def _variants(cfg, mesh, emb_inputs, first_batch: int) -> tuple[dict, dict]:
    """The embedding step and the train step of ``cfg``, built as training builds them (one
    plan: measured buckets, hot rows chosen), compiled, with their inputs."""
    source = make_source(cfg)
    plan, fns = build(cfg, mesh, source, log=lambda *_: None)
    coll = fns.collection
    train_state = fns.init_state()
    train_inputs = [(fns.device_batch(source.train_batch(first_batch + i)),) for i in range(TIMED_BATCHES)]
    train = {
        "fn": fns.train_step.lower(train_state, *train_inputs[0]).compile(),
        "state": train_state,
        "inputs": train_inputs,
    }

    def step(state, ids, grad):
        pooled, res = coll.lookup(state, ids)  # the output keeps the forward exchange alive
        counts = res.hot_counts if res.hot_counts is not None else jnp.zeros(2, jnp.float32)
        return coll.apply_gradients(state, res, grad, jnp.float32(LR)), (jnp.sum(pooled), counts)

    sharding = coll.state_sharding()
    fn = jax.jit(step, in_shardings=(sharding, None, None), out_shardings=(sharding, None), donate_argnums=0)
    state = coll.init(jax.random.key(0))
    if fns.hot is not None:
        state = coll.refresh(state, hot_keys(fns.hot.current_rows(), fns.hot.capacity))
    compiled = fn.lower(state, *emb_inputs[0]).compile()
    sharded = [g for g in build_groups(plan) if not g.replicated]
    embedding = {
        "fn": compiled,
        "state": state,
        "inputs": emb_inputs,
        "plan": plan,
        "hlo": hlo_collective_bytes(compiled.as_text(), mesh.size, ROUNDS_SCOPE),
        "capacity": max((group_capacity(plan, g) for g in sharded), default=0),
    }
    return embedding, train


def _hit_rate(outs) -> float:
    hits, lookups = np.sum([np.asarray(counts) for _, counts in outs], axis=0)
    return float(hits / max(lookups, 1))


def no_dedup_bytes(plan, ids_batches: list[np.ndarray]) -> float:
    """Bytes one device sends per step, on average over devices and batches, if every remote
    lookup of a sharded table carried its own id, vector and gradient (no deduplication)."""
    n, wire = plan.num_devices, DTYPE_BYTES[plan.exchange_dtype]
    starts = np.concatenate([[0], np.cumsum([t.spec.bag_size for t in plan.tables])])
    total = 0.0
    for ids in ids_batches:
        requester = np.repeat(np.arange(n), ids.shape[0] // n)
        for g in build_groups(plan):
            if g.replicated:
                continue
            for vt in g.vtables:
                block = ids[:, starts[vt.table] : starts[vt.table + 1]]
                valid = block != PAD_ID
                owner = physical_rows_np(g, vt, np.where(valid, block, 0)) // g.local_rows
                remote = valid & (owner != requester[:, None])
                total += remote.sum() * (4 + 2 * wire * g.width)
    return total / n / len(ids_batches)


def bench_hot(
    cfg,
    *,
    steps: int,
    repeats: int = 3,
    zipf=ZIPF,
    layouts=LAYOUTS,
    row_layouts=ROW_LAYOUTS,
    output: str | None,
    log=print,
) -> dict:
    """Every (zipf, layout, row layout) case with the model's hot rows and without; table; JSON.
    Each case's four programs (train and embedding step, with and without hot rows) are timed
    in ``repeats`` alternating chunks of ``steps``."""
    check_device_step("hot", cfg)
    mesh = make_mesh(cfg.mesh.devices)
    data = NamedSharding(mesh, P(AXIS))
    cases = []
    log(HEADER)  # then a row as each case is measured
    for z in zipf:
        for layout in layouts:
            for row_layout in each_case(row_layouts):
                base = _with(cfg, zipf_exponent=z, id_layout=layout, sharding="row", row_layout=row_layout)
                source = make_source(base)
                # Timed on batches after those the hot set and capacities were measured on.
                first = max(cfg.embedding.hot.stats_batches, 4)
                host = [source.train_ids(first + i) for i in range(TIMED_BATCHES)]
                rng = np.random.default_rng(0)
                inputs = [
                    (
                        jax.device_put(ids, data),
                        jax.device_put(
                            rng.normal(size=(*ids.shape[:1], cfg.num_features, cfg.model.embedding_dim)).astype(
                                np.float32
                            )
                            / ids.shape[0],
                            data,
                        ),
                    )
                    for ids in host
                ]
                hot, hot_train = _variants(_with(base, hot_rows="auto"), mesh, inputs, first)
                cold, cold_train = _variants(_with(base, hot_rows=0), mesh, inputs, first)
                round_robin([hot, cold, hot_train, cold_train], steps, repeats)
                hot["train_ms"], cold["train_ms"] = hot_train["step_ms"], cold_train["step_ms"]
                cases.append(_case(z, layout, row_layout, hot, cold, no_dedup_bytes(cold["plan"], host)))
                log(_row(cases[-1]))
    report = {
        "benchmark": "hot_rows",
        "devices": mesh.size,
        "global_batch": cfg.train.batch_size,
        "tables": cfg.num_features,
        "table_rows": int(sum(cfg.table_rows)),
        "embedding_dim": cfg.model.embedding_dim,
        "optimizer": cfg.embedding.optimizer,
        "timed_steps": steps * repeats,
        "machine": machine_description(),
        "cases": cases,
    }
    write_report(report, output)
    return report


def _case(z, layout, row_layout, hot, cold, no_dedup) -> dict:
    def a2a(r):
        return r["hlo"].get("all-to-all", 0.0) + r["hlo"].get("all-gather", 0.0)

    return {
        "zipf": z,
        "layout": layout,
        "row_layout": row_layout,
        "hot_rows": hot["plan"].hot_rows,
        "hot_hit_rate": _hit_rate(hot["outs"]),
        "a2a_bytes": a2a(hot),
        "allreduce_bytes": hot["hlo"].get("all-reduce", 0.0),
        "total_bytes": sum(hot["hlo"].values()),
        "no_hot_total_bytes": sum(cold["hlo"].values()),
        "no_dedup_bytes": no_dedup,
        "lower_bound_bytes": lower_bound_bytes(cold["plan"]),
        "capacity": hot["capacity"],
        "no_hot_capacity": cold["capacity"],
        "step_ms": hot["train_ms"],
        "no_hot_step_ms": cold["train_ms"],
        "embedding_step_ms": hot["step_ms"],
        "no_hot_embedding_step_ms": cold["step_ms"],
        "predicted_total_bytes": exchange_bytes_per_step(hot["plan"]),
        "no_hot_predicted_total_bytes": exchange_bytes_per_step(cold["plan"]),
    }


HEADER = (
    f"{'zipf':>5} {'layout':<18}{'rows':<7}{'hot rows':>9}{'hit':>7}{'a2a KiB':>9}{'a-r KiB':>9}"
    f"{'total':>8}{'no hot':>8}{'bound':>8}{'no dedup':>9}{'cap':>6}{'no hot':>7}{'step ms':>8}{'no hot':>7}{'x':>6}"
    f"{'emb ms':>8}{'no hot':>7}"
)


def _row(c: dict) -> str:
    kib = 1 / 1024
    return (
        f"{c['zipf']:>5} {c['layout']:<18}{c['row_layout']:<7}{c['hot_rows']:>9,}{100 * c['hot_hit_rate']:>6.1f}%"
        f"{c['a2a_bytes'] * kib:>9.1f}{c['allreduce_bytes'] * kib:>9.1f}{c['total_bytes'] * kib:>8.1f}"
        f"{c['no_hot_total_bytes'] * kib:>8.1f}{c['lower_bound_bytes'] * kib:>8.1f}{c['no_dedup_bytes'] * kib:>9.1f}"
        f"{c['capacity']:>6}"
        f"{c['no_hot_capacity']:>7}{c['step_ms']:>8.2f}{c['no_hot_step_ms']:>7.2f}"
        f"{c['no_hot_step_ms'] / c['step_ms']:>6.2f}{c['embedding_step_ms']:>8.2f}{c['no_hot_embedding_step_ms']:>7.2f}"
    )
