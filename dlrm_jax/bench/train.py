"""``dlrm-jax bench train``: train-step throughput of several configs on the current devices. Each
step takes a batch of its own, as training does, made and placed on the devices before its
timing starts (the step, not the data generator, is measured; four batches in turn had let a
dynamic table's map hold every id from the fifth step on, as a stream never does),
compilation and warm-up steps are excluded, and the median of per-step times is reported with
the mean. With ``--rounds``, the configs' steps are interleaved, so a machine's drift moves
them alike.

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
from dlrm_jax.bench import check_device_step
from dlrm_jax.bench.common import each_case, machine_description, write_report
from dlrm_jax.data.sources import make_source, resolve_data_config
from dlrm_jax.embedding.plan.stats import per_device_bytes
from dlrm_jax.train.build import build, mesh_from_config


def _state_bytes(state) -> int:
    """Bytes of every device buffer of a state (all devices together)."""
    return sum(s.data.nbytes for leaf in jax.tree.leaves(state) for s in leaf.addressable_shards)


class _Prepared:
    """One config built as training builds it, its step compiled and warmed up."""

    def __init__(self, cfg, warmup: int):
        gc.collect()
        hostmem.reset_peak_rss()
        self.rss_before = hostmem.rss_bytes()
        cfg = resolve_data_config(cfg)
        self.cfg, self.mesh = cfg, mesh_from_config(cfg)
        source = make_source(cfg, jax.process_index(), jax.process_count())
        self.plan, fns = build(cfg, self.mesh, source, log=lambda *_: None)
        self.batch_of = lambda i: jax.block_until_ready(fns.device_batch(source.train_batch(i)))
        self.state = fns.init_state()
        t0 = time.perf_counter()
        self.compiled = fns.train_step.lower(self.state, self.batch_of(0)).compile()
        self.compile_s = time.perf_counter() - t0
        self.step_s, self.cpu_s, self.faults, self.calls = [], [], 0, 0
        self.run(warmup, timed=False)

    def run(self, steps: int, timed: bool = True) -> None:
        """``steps`` steps, each timed alone (``timed``) with its page faults and the process's
        CPU time (CPU a step: per call of ``run``); its batch made before, outside all three."""
        faults = cpu = 0.0
        for _ in range(steps):
            batch = self.batch_of(self.calls)
            usage, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            self.state, self.out, _ = self.compiled(self.state, batch)
            jax.block_until_ready((self.state, self.out))
            elapsed, after = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
            self.calls += 1
            faults += after.ru_minflt - usage.ru_minflt
            cpu += after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime
            if timed:
                self.step_s.append(elapsed)
        if timed:
            self.faults += faults
            self.cpu_s.append(cpu / max(steps, 1))

    def result(self) -> dict:
        cfg, step_s = self.cfg, self.step_s
        median = statistics.median(step_s)
        memory = self.compiled.memory_analysis()  # (None where a backend does not say)
        plan_bytes = int(sum(per_device_bytes(self.plan).values()).sum())
        peak = hostmem.peak_rss_bytes()
        return {
            "devices": self.mesh.size,
            "global_batch": cfg.train.batch_size,
            "tables": len(self.plan.tables),
            "table_rows": sum(t.spec.rows for t in self.plan.tables),
            "embedding_dim": cfg.model.embedding_dim,
            "sharding": cfg.embedding.sharding,
            "compile_s": self.compile_s,
            "step_ms_median": 1e3 * median,
            "step_ms_mean": 1e3 * float(np.mean(step_s)),
            "step_ms_min": 1e3 * min(step_s),
            # the process's CPU time a step (every device's threads; the median of the turns):
            # steadier than wall time on a shared VM, whose speed moves both alike
            "cpu_ms_per_step": 1e3 * statistics.median(self.cpu_s),
            "samples_per_s": cfg.train.batch_size / median,
            "loss_last": float(self.out["loss"]),
            "plan_bytes": plan_bytes,
            "state_bytes": _state_bytes(self.state),
            "rss_before_bytes": self.rss_before,
            "peak_rss_bytes": peak,
            "peak_rss_over_plan": peak / plan_bytes,
            "huge_page_bytes": hostmem.huge_page_bytes(),
            "scratch_bytes_per_device": int(memory.temp_size_in_bytes) if memory is not None else None,
            "page_faults_per_step": self.faults / max(len(step_s), 1),
        }


def time_train_step(cfg, steps: int, warmup: int) -> dict:
    """Build ``cfg`` as training does, then time its compiled train step (median of ``steps``
    after ``warmup``), with its plan's bytes and the process's peak host memory."""
    prepared = _Prepared(cfg, warmup)
    prepared.run(steps)
    return prepared.result()


def time_interleaved(configs: dict, steps: int, warmup: int, rounds: int) -> dict:
    """Every config built and warmed up, then timed in ``rounds`` turns of ``steps / rounds``
    steps each, config after config, each turn after one untimed step (the allocator settles
    on the config's buffers again): a machine whose speed drifts over minutes (a shared VM)
    moves every config alike, so their ratios hold where one config after another's do not.
    All configs' states are held at once; the peak host memory is the run's."""
    prepared = {name: _Prepared(cfg, warmup) for name, cfg in each_case(configs.items())}
    per_turn = -(-steps // rounds)
    for _ in each_case(range(rounds)):
        for p in prepared.values():
            p.run(1, timed=False)
            p.run(per_turn)
    return {name: p.result() for name, p in prepared.items()}


def bench_train(configs: dict, *, steps: int, warmup: int, output: str | None, log=print, rounds: int = 1) -> dict:
    """Time each named config's train step; print a table with ratios to the first; JSON out.
    ``rounds`` > 1: the configs' steps interleaved (:func:`time_interleaved`)."""
    for name, cfg in configs.items():
        check_device_step("train", cfg, name)
    if rounds > 1:
        results = time_interleaved(configs, steps, warmup, rounds)
    else:
        results = {name: time_train_step(cfg, steps, warmup) for name, cfg in each_case(configs.items())}
    first = next(iter(results.values()))
    for r in results.values():
        r["ratio_to_first"] = r["samples_per_s"] / first["samples_per_s"]
        r["cpu_ratio_to_first"] = first["cpu_ms_per_step"] / r["cpu_ms_per_step"]
    report = {
        "benchmark": "train_step",
        "timed_steps": steps if rounds == 1 else -(-steps // rounds) * rounds,
        "warmup_steps": warmup,
        "rounds": rounds,
        "machine": machine_description(),
        "results": results,
    }
    log(
        f"{'config':<18}{'devices':>8}{'batch':>8}{'rows':>12}{'step ms':>10}{'samples/s':>12}{'ratio':>7}"
        f"{'CPU ms':>9}{'ratio':>7}{'plan MiB':>10}{'peak RSS MiB':>14}"
    )
    for name, r in results.items():
        log(
            f"{name:<18}{r['devices']:>8}{r['global_batch']:>8}{r['table_rows']:>12,}"
            f"{r['step_ms_median']:>10.2f}{r['samples_per_s']:>12,.0f}{r['ratio_to_first']:>7.2f}"
            f"{r['cpu_ms_per_step']:>9.1f}{r['cpu_ratio_to_first']:>7.2f}"
            f"{r['plan_bytes'] / 2**20:>10,.0f}{r['peak_rss_bytes'] / 2**20:>14,.0f}"
        )
    log(write_report(report, output))
    return report
