"""``dlrm-jax bench exchange``: the bytes the compiled train step moves, against the plan's
prediction and the exchange's lower bound.

For the config's own plan (``embedding.sharding`` as given: the plan training builds, buckets
measured on the data) and for each explicit strategy, the train step is compiled, not run, at
the config's full size on the current devices: the state is abstract (shapes and shardings,
no memory), so a 100 GB table set compiles on a laptop. The compiled program's collectives are
counted (``common.hlo_collective_bytes``; the overflow rounds, compiled but not taken, left out,
and so is dynamic tables' resolution of raw ids, whose paths are branches a step takes one of:
their bytes a step, each path's as the plan prices it, are reported beside, ``resolution_bytes``;
the lookups that may send their requests as the resolution routed them hold both forms, routed
and not: the plain form is counted, as the plan prices it, and the routed forms' bytes are
reported beside, ``routed_lookup_bytes``)
and the dense part's gradient all-reduce (the same under every plan) taken away: what remains
is the embedding exchange, beside ``plan.stats``' prediction of it, the lower bound and the
predicted step time on the config's cluster. XLA may fuse the replicated tables' gradient
all-reduce with the dense one into one instruction; its operands are told apart by shape (a
replicated group's [rows, W] or the hot rows' [H, D] belong to the exchange).
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax

from dlrm_jax.bench import check_device_step
from dlrm_jax.bench.common import (
    _COLLECTIVE,
    _DTYPE_BYTES,
    _SHAPE,
    each_case,
    hlo_collective_bytes,
    machine_description,
    write_report,
)
from dlrm_jax.choices import Sharding
from dlrm_jax.data.batch import Batch
from dlrm_jax.data.packed import HostPacked, Packed
from dlrm_jax.data.sources import make_source, resolve_data_config
from dlrm_jax.embedding.dynamic.sizing import least_and_most
from dlrm_jax.embedding.exchange.common import RESOLUTION_SCOPE, ROUNDS_SCOPE, ROUTED_SCOPE
from dlrm_jax.embedding.plan.cost import bound_link_bytes, exchange_link_bytes, predict_step
from dlrm_jax.embedding.plan.embedding_plan import ExchangeKind
from dlrm_jax.embedding.plan.layout import needs_whole_rows, whole_rows_capacity
from dlrm_jax.embedding.plan.part_kinds import exchange_parts
from dlrm_jax.embedding.plan.stats import collective_bytes, lower_bound_bytes
from dlrm_jax.observe.trace import PHASE_SCOPES
from dlrm_jax.parallel.mesh import hosts_of
from dlrm_jax.train.build import build, mesh_from_config
from dlrm_jax.train.wiring import cluster_from_config, dense_work, plan_from_config, wide_plan_from_config

STRATEGIES = tuple(Sharding)


def compiled_train_step(steps, batch: Batch | HostPacked):
    """The train step compiled for an abstract state (no memory) and ``batch``'s shapes (a
    packed one: the step fed one array of bytes a batch, as a dataset's readers feed it)."""
    state = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        jax.eval_shape(steps.init_state),
        steps.state_sharding,
    )
    like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=steps.batch_sharding)
    abstract = Packed(like(batch.buf), batch.layout) if isinstance(batch, HostPacked) else Batch(*map(like, batch))
    return steps.train_step.lower(state, abstract).compile()


def exchange_case(cfg, mesh, source, label: str, log) -> dict:
    """One plan's compiled, predicted and lower-bound bytes per device and step."""
    t0 = time.perf_counter()
    plan, steps = build(cfg, mesh, source, log=lambda *_: None)
    hlo = compiled_train_step(steps, source.train_batch(0)).as_text()
    n = mesh.size
    dense = dense_work(cfg)
    counted = hlo_collective_bytes(hlo, n, (ROUNDS_SCOPE, RESOLUTION_SCOPE, ROUTED_SCOPE))
    with_routed = hlo_collective_bytes(hlo, n, (ROUNDS_SCOPE, RESOLUTION_SCOPE))
    dense_allreduce = _dense_allreduce_bytes(hlo, n, _exchange_shapes(plan))
    measured = sum(counted.values()) - dense_allreduce
    predicted = sum(collective_bytes(plan).values())
    if cfg.model.kind == "wide_deep":  # the wide part's update all-gathers the batch's ids and gradients
        predicted += sum(collective_bytes(wide_plan_from_config(cfg, n)).values())
    cluster = cluster_from_config(cfg, jax.default_backend() == "cpu")
    step = predict_step(plan, cluster, dense)
    case = {
        "strategy": label,
        "devices": n,
        "predicted_bytes": predicted,
        "measured_bytes": measured,
        "lower_bound_bytes": lower_bound_bytes(plan),
        "predicted_step_ms": 1e3 * step.total_s,
        "predicted_phases_ms": {k: 1e3 * v for k, v in step.phases.items()},
        "bound_exchange_ms": 1e3 * step.bound_exchange_s,  # the bound's bytes over the same links
        # what crosses the links between hosts (cluster.devices_per_host), predicted and the bound's
        "predicted_between_hosts_bytes": exchange_link_bytes(plan, cluster)[1],
        "bound_between_hosts_bytes": bound_link_bytes(plan, cluster)[1],
        "strategies": sorted({t.strategy.value for t in plan.tables}),
        "hlo_bytes_by_kind": counted,
        # dynamic tables: the least and most a step's resolution sends (the routed paths, or the
        # gathered one where none is routed), each path as training's events count it
        "resolution_bytes": _resolution_bytes(steps, cfg.train.batch_size),
        # dynamic tables: the lookups' forms that reuse the maps' routing (a step takes them or
        # the plain form counted above, as the resolution went)
        "routed_lookup_bytes": sum(with_routed.values()) - sum(counted.values()),
        "dense_allreduce_bytes": dense_allreduce,
        "compile_s": time.perf_counter() - t0,
    }
    log(
        f"{label:<12}{n:>8}{predicted / 2**20:>14.1f}{measured / 2**20:>14.1f}{case['lower_bound_bytes'] / 2**20:>12.1f}"
        f"{measured / max(case['lower_bound_bytes'], 1):>10.2f}{measured / max(predicted, 1):>12.3f}"
        f"{case['predicted_step_ms']:>12.3f}  {','.join(case['strategies'])}"
    )
    return case


def _resolution_bytes(steps, batch: int) -> dict[str, float] | None:
    if steps.dynamic is None:
        return None
    least, most = least_and_most(steps.dynamic.resolution_paths(batch))
    return {"least": least, "most": most}


def _exchange_shapes(plan) -> set[tuple[int, ...]]:
    """Shapes of the exchange's all-reduced operands: replicated groups' and the hot rows'
    gradients, and the whole-row statistics of host columns (one float per distinct row)."""
    shapes = {(p.group.local_rows, p.group.width) for p in exchange_parts(plan) if p.kind == ExchangeKind.ALLREDUCE}
    shapes |= {
        (whole_rows_capacity(plan, p.group),)
        for p in exchange_parts(plan)
        if p.kind == ExchangeKind.HOST_COLUMNS and needs_whole_rows(plan, p.group)
    }
    if plan.hot_rows:
        shapes.add((plan.hot_rows, plan.tables[0].spec.dim))
    return shapes


def _dense_allreduce_bytes(hlo: str, n: int, exchange_shapes: set) -> float:
    """Bytes of the all-reduce operands that are the dense part's gradients: those of the dense
    phase (a fused instruction names every phase it joins), less any operand shaped like an
    exchange gradient."""
    total = 0.0
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if not m or m.group(2) != "all-reduce" or PHASE_SCOPES["dense"] not in line:
            continue
        for dtype, dims in _SHAPE.findall(m.group(1)):
            shape = tuple(int(d) for d in dims.split(",") if d)
            if shape not in exchange_shapes:
                total += 2 * (n - 1) / n * _DTYPE_BYTES.get(dtype, 4) * math.prod(shape)
    return total


def bench_exchange(cfg, strategies=None, output: str | None = None, log=print) -> dict:
    """Each strategy's case (``auto``: the config's own sharding); a table; JSON out. None:
    every strategy the config's tables can be planned with on this mesh, the others listed
    as ``skipped`` with the planner's reason (one asked for by name that cannot is an error)."""
    check_device_step("exchange", cfg)
    cfg = resolve_data_config(cfg)
    mesh = mesh_from_config(cfg)
    source = make_source(cfg)
    log(
        f"{'strategy':<12}{'devices':>8}{'predicted MiB':>14}{'compiled MiB':>14}{'bound MiB':>12}"
        f"{'x bound':>10}{'compiled/pred':>12}{'step ms':>12}  strategies"
    )
    cases, skipped = [], []
    for s in each_case(STRATEGIES if strategies is None else strategies):
        chosen = (
            cfg
            if s == "auto"
            else dataclasses.replace(cfg, embedding=dataclasses.replace(cfg.embedding, sharding=s, table_sharding=()))
        )
        if strategies is None:
            try:  # (the plan alone: cheap, and the planner's refusal is the reason)
                plan_from_config(chosen, mesh.size, hosts=hosts_of(mesh))
            except ValueError as e:
                log(f"{s:<12}skipped: {e}")
                skipped.append({"strategy": s, "reason": str(e)})
                continue
        cases.append(exchange_case(chosen, mesh, source, cfg.embedding.sharding if s == "auto" else s, log))
    report = {
        "benchmark": "exchange",
        "devices": mesh.size,
        "global_batch": cfg.train.batch_size,
        "machine": machine_description(),
        "cases": cases,
        "skipped": skipped,
    }
    write_report(report, output)
    return report
