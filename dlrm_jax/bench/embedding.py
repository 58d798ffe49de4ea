"""``dlrm-jax bench embedding``: the embedding step of every strategy, side by side.

Each variant runs the same math — look up and pool a batch, take a fixed upstream gradient,
apply SGD to the looked-up rows — on the same tables and ids:

- the collection under each plan (replicated, table, row, column, auto), buckets sized from
  the batch alone, and ``auto_measured``: buckets sized from the distinct requests measured
  on other batches, as training does;
- ``xla_take``: the table row-sharded over the mesh, ``jnp.take`` + autodiff left to XLA's
  partitioner (a full-table gradient, sharded);
- ``dense_gradient``: a replicated table updated with its dense, all-reduced gradient.

Bytes per step and device are predicted from the plan's shapes and counted from the compiled
HLO's collectives (the overflow rounds, compiled but not taken, are left out of the count).
"""

from __future__ import annotations

import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlrm_jax.bench.common import (
    each_case,
    hlo_collective_bytes,
    machine_description,
    time_steps,
    write_report,
)
from dlrm_jax.data.sources import make_source
from dlrm_jax.embedding.exchange.capacity import measure_capacities
from dlrm_jax.embedding.exchange.collection import EmbeddingCollection
from dlrm_jax.embedding.exchange.common import ROUNDS_SCOPE
from dlrm_jax.embedding.exchange.optimizers import sgd
from dlrm_jax.embedding.plan.layout import group_capacity
from dlrm_jax.embedding.plan.part_kinds import exchange_parts
from dlrm_jax.embedding.plan.stats import exchange_bytes_per_step
from dlrm_jax.parallel.mesh import AXIS, make_mesh
from dlrm_jax.train.wiring import plan_from_config

LR = 0.01


def _collection_variant(cfg, strategy, mesh, ids, grad, steps, calibration=None):
    """The collection under ``strategy``; with ``calibration`` id batches, buckets sized from
    their measured distinct requests (what training compiles) instead of the batch bound."""
    cfg = dataclasses.replace(cfg, embedding=dataclasses.replace(cfg.embedding, sharding=strategy, optimizer="sgd"))
    plan = plan_from_config(cfg, mesh.size)
    coll = EmbeddingCollection(plan, mesh, sgd())
    if calibration is not None:
        plan = dataclasses.replace(
            plan, capacities=measure_capacities(plan, calibration, cfg.embedding.capacity_factor)
        )
        coll = EmbeddingCollection(plan, mesh, sgd())

    def step(state, ids, grad):
        pooled, res = coll.lookup(state, ids)  # the output keeps the forward exchange alive
        return coll.apply_gradients(state, res, grad, jnp.float32(LR)), jnp.sum(pooled)

    sharding = coll.state_sharding()
    fn = jax.jit(step, in_shardings=(sharding, None, None), out_shardings=(sharding, None), donate_argnums=0)
    state = coll.init(jax.random.key(0))
    compiled = fn.lower(state, ids, grad).compile()
    hlo = hlo_collective_bytes(compiled.as_text(), mesh.size, ROUNDS_SCOPE)
    times, state, _ = time_steps(compiled, state, [(ids, grad)], steps)
    seconds = statistics.median(times)
    _, res = jax.jit(coll.lookup)(state, ids)
    strategies = sorted({t.strategy.value for t in plan.tables})
    return {
        "step_ms": 1e3 * seconds,
        "predicted_bytes": exchange_bytes_per_step(plan),
        "hlo_bytes": sum(hlo.values()),
        "hlo_by_kind": hlo,
        "strategies": strategies,
        "capacities": {p.group.name: group_capacity(plan, p.group) for p in exchange_parts(plan) if p.kind == "ids"},
        "overflowed": bool(int(np.asarray(res.overflow.addressable_data(0)))),
    }


def _baseline_variant(kind, cfg, mesh, ids, grad, steps):
    """xla_take (row-sharded table, autodiff) or dense_gradient (replicated table, autodiff)."""
    specs_rows = np.array(cfg.table_rows)
    offsets = jnp.asarray(np.concatenate([[0], np.cumsum(specs_rows)[:-1]]).astype(np.int32))
    rows_total, dim = int(specs_rows.sum()), cfg.model.embedding_dim
    if kind == "xla_take":
        rows_total = -(-rows_total // mesh.size) * mesh.size  # divisible by the mesh
    spec = P(AXIS, None) if kind == "xla_take" else P()
    table_sharding = NamedSharding(mesh, spec)
    table = jax.jit(
        lambda k: jax.random.uniform(k, (rows_total, dim), jnp.float32, -0.01, 0.01), out_shardings=table_sharding
    )(jax.random.key(0))

    def step(table, ids, grad):
        vec, pullback = jax.vjp(lambda t: jnp.take(t, ids + offsets, axis=0), table)  # one-hot: pooled = vec
        return table - LR * pullback(grad)[0], jnp.sum(vec)

    fn = jax.jit(
        step, in_shardings=(table_sharding, None, None), out_shardings=(table_sharding, None), donate_argnums=0
    )
    compiled = fn.lower(table, ids, grad).compile()
    hlo = hlo_collective_bytes(compiled.as_text(), mesh.size)
    times, _, _ = time_steps(compiled, table, [(ids, grad)], steps)
    seconds = statistics.median(times)
    return {
        "step_ms": 1e3 * seconds,
        "predicted_bytes": None,
        "hlo_bytes": sum(hlo.values()),
        "hlo_by_kind": hlo,
        "strategies": [kind],
    }


def bench_embedding(cfg, *, steps: int, strategies: list[str], output: str | None, log=print) -> dict:
    """Time every strategy and both baselines on the same batch; print a table; JSON out."""
    if any(b != 1 for b in cfg.bag_sizes):
        raise ValueError("bench embedding runs one-hot features (data.bag_sizes=1)")
    mesh = make_mesh(cfg.mesh.devices)
    source = make_source(cfg)
    batch = source.train_batch(0)
    data = NamedSharding(mesh, P(AXIS))
    ids = jax.device_put(batch.ids, data)
    # Measured on batches other than the timed one, as training measures its first batches.
    calibration = [source.train_ids(i) for i in range(1, 5)]
    grad = jax.device_put(
        np.random.default_rng(0).normal(size=(*batch.ids.shape, cfg.model.embedding_dim)).astype(np.float32)
        / batch.ids.shape[0],
        data,
    )
    results = {s: _collection_variant(cfg, s, mesh, ids, grad, steps) for s in each_case(strategies)}
    results["auto_measured"] = _collection_variant(cfg, "auto", mesh, ids, grad, steps, calibration)
    for kind in ("xla_take", "dense_gradient"):
        results[kind] = _baseline_variant(kind, cfg, mesh, ids, grad, steps)
    best = min(r["step_ms"] for r in results.values())
    for r in results.values():
        r["ratio_to_fastest"] = r["step_ms"] / best
    report = {
        "benchmark": "embedding_step",
        "devices": mesh.size,
        "global_batch": cfg.train.batch_size,
        "tables": len(cfg.table_rows),
        "table_rows": int(sum(cfg.table_rows)),
        "embedding_dim": cfg.model.embedding_dim,
        "timed_steps": steps,
        "machine": machine_description(),
        "results": results,
    }
    log(f"{'variant':<16}{'step ms':>10}{'x fastest':>10}{'predicted B':>14}{'HLO B':>14}  strategies")
    for name, r in results.items():
        pred = "-" if r["predicted_bytes"] is None else f"{r['predicted_bytes']:,}"
        log(
            f"{name:<16}{r['step_ms']:>10.2f}{r['ratio_to_fastest']:>10.2f}{pred:>14}"
            f"{int(r['hlo_bytes']):>14,}  {','.join(r['strategies'])}"
        )
    write_report(report, output)
    return report
