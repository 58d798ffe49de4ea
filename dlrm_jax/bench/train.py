"""``dlrm-jax bench train``: train-step throughput of several configs on the current devices. Host batches
are prepared before timing (the step, not the data generator, is measured), compilation and
warm-up steps are excluded, and the median of per-step times is reported with the mean.

With them, the compiled step's scratch memory per device and the host's minor page faults per
timed step: XLA:CPU allocates a run's scratch afresh, and above glibc's 32 MiB mmap cutoff
every page it touches faults again each step (the dynamic step's 93 MiB once cost ~90 ms of
kernel time a step on 8 simulated devices).
"""

from __future__ import annotations

import gc
import resource
import statistics
import time

import jax
import numpy as np

from dlrm_jax import hostmem
from dlrm_jax.bench.common import machine_description, write_report
from dlrm_jax.data.sources import make_source, resolve_data_config
from dlrm_jax.embedding.plan.stats import per_device_bytes
from dlrm_jax.train.build import build, mesh_from_config


def _state_bytes(state) -> int:
    """Bytes of every device buffer of a state (all devices together)."""
    return sum(s.data.nbytes for leaf in jax.tree.leaves(state) for s in leaf.addressable_shards)


def time_train_step(cfg, steps: int, warmup: int) -> dict:
    """Build ``cfg`` as training does, then time its compiled train step (median of ``steps``
    after ``warmup``), with its plan's bytes and the process's peak host memory."""
    gc.collect()
    hostmem.reset_peak_rss()
    rss_before = hostmem.rss_bytes()
    cfg = resolve_data_config(cfg)
    mesh = mesh_from_config(cfg)
    source = make_source(cfg, jax.process_index(), jax.process_count())
    plan, fns = build(cfg, mesh, source, log=lambda *_: None)
    batches = [fns.device_batch(source.train_batch(i)) for i in range(4)]
    state = fns.init_state()
    t0 = time.perf_counter()
    compiled = fns.train_step.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    for i in range(warmup):
        state, out, _ = compiled(state, batches[i % len(batches)])
    jax.block_until_ready(state)
    step_s = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(steps):
        t = time.perf_counter()
        state, out, _ = compiled(state, batches[i % len(batches)])
        jax.block_until_ready((state, out))
        step_s.append(time.perf_counter() - t)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    median = statistics.median(step_s)
    memory = compiled.memory_analysis()  # (None where a backend does not say)
    plan_bytes = int(sum(per_device_bytes(plan).values()).sum())
    peak = hostmem.peak_rss_bytes()
    return {
        "devices": mesh.size,
        "global_batch": cfg.train.batch_size,
        "tables": len(plan.tables),
        "table_rows": sum(t.spec.rows for t in plan.tables),
        "embedding_dim": cfg.model.embedding_dim,
        "sharding": cfg.embedding.sharding,
        "compile_s": compile_s,
        "step_ms_median": 1e3 * median,
        "step_ms_mean": 1e3 * float(np.mean(step_s)),
        "step_ms_min": 1e3 * min(step_s),
        "samples_per_s": cfg.train.batch_size / median,
        "loss_last": float(out["loss"]),
        "plan_bytes": plan_bytes,
        "state_bytes": _state_bytes(state),
        "rss_before_bytes": rss_before,
        "peak_rss_bytes": peak,
        "peak_rss_over_plan": peak / plan_bytes,
        "huge_page_bytes": hostmem.huge_page_bytes(),
        "scratch_bytes_per_device": int(memory.temp_size_in_bytes) if memory is not None else None,
        "page_faults_per_step": faults / max(steps, 1),
    }


def bench_train(configs: dict, *, steps: int, warmup: int, output: str | None, log=print) -> dict:
    """Time each named config's train step; print a table with ratios to the first; JSON out."""
    results = {name: time_train_step(cfg, steps, warmup) for name, cfg in configs.items()}
    first = next(iter(results.values()))["samples_per_s"]
    for r in results.values():
        r["ratio_to_first"] = r["samples_per_s"] / first
    report = {
        "benchmark": "train_step",
        "timed_steps": steps,
        "warmup_steps": warmup,
        "machine": machine_description(),
        "results": results,
    }
    log(
        f"{'config':<18}{'devices':>8}{'batch':>8}{'rows':>12}{'step ms':>10}{'samples/s':>12}{'ratio':>7}"
        f"{'plan MiB':>10}{'peak RSS MiB':>14}"
    )
    for name, r in results.items():
        log(
            f"{name:<18}{r['devices']:>8}{r['global_batch']:>8}{r['table_rows']:>12,}"
            f"{r['step_ms_median']:>10.2f}{r['samples_per_s']:>12,.0f}{r['ratio_to_first']:>7.2f}"
            f"{r['plan_bytes'] / 2**20:>10,.0f}{r['peak_rss_bytes'] / 2**20:>14,.0f}"
        )
    log(write_report(report, output))
    return report
