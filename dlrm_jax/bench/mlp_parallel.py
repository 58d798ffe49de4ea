"""``dlrm-jax bench mlp-parallel``: the dense layers data-parallel, tensor-parallel (Megatron
pairs) and pipelined (GPipe stages) over model groups of ``--model`` devices, side by side: step
time (the variants take turns, ``common.round_robin``), per-device memory of the compiled step
(XLA's memory analysis: arguments + outputs - aliased + temporaries) and of the dense state,
and the bytes each device sends per step, all of it and the dense layers' share (collectives
traced in the dense phases' scopes), from the compiled HLO. *Multi-GPU Parallelism and Large Sparse Data Movement in DL Models*' horizontal-vs-vertical
comparison, on the dense parts of the given configs (their tables capped to ``--max-rows``
rows: the embeddings are the same in every mode and not what is compared).
"""

from __future__ import annotations

import jax

from dlrm_jax.bench import check_device_step
from dlrm_jax.bench.common import (
    each_case,
    hlo_collective_bytes,
    machine_description,
    round_robin,
    write_report,
)
from dlrm_jax.config import load_config
from dlrm_jax.data.sources import make_source, resolve_data_config
from dlrm_jax.observe.trace import PHASE_SCOPES
from dlrm_jax.train.build import build, mesh_from_config

MODES = ("data", "tensor", "pipeline")
DENSE_SCOPES = (PHASE_SCOPES["dense"], PHASE_SCOPES["dense_optimizer"])


def _variant(config: str, mode: str, overrides: list[str]) -> dict:
    cfg = resolve_data_config(load_config(config, [*overrides, f"model.mlp_parallel={mode}"]))
    mesh = mesh_from_config(cfg)
    source = make_source(cfg, jax.process_index(), jax.process_count())
    _, fns = build(cfg, mesh, source, log=lambda *_: None)
    batches = [(fns.device_batch(source.train_batch(i)),) for i in range(2)]
    state = fns.init_state()
    compiled = fns.train_step.lower(state, *batches[0]).compile()
    mem = compiled.memory_analysis()
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    hlo = compiled.as_text()
    dense_lines = "\n".join(line for line in hlo.splitlines() if any(f"/{s}/" in line for s in DENSE_SCOPES))
    first = mesh.devices.flat[0]
    dense_state = sum(
        s.data.nbytes
        for leaf in jax.tree.leaves((state.params, state.opt_state))
        for s in leaf.addressable_shards
        if s.device == first
    )
    return {
        "config": config,
        "mode": mode,
        "fn": compiled,
        "state": state,
        "inputs": batches,
        "devices": mesh.size,
        "model": cfg.mesh.model,
        "global_batch": cfg.train.batch_size,
        "peak_bytes_per_device": int(peak),
        "temp_bytes_per_device": int(mem.temp_size_in_bytes),
        "dense_state_bytes_per_device": int(dense_state),
        "bytes_sent_per_device": hlo_collective_bytes(hlo, mesh.size),
        "dense_bytes_sent_per_device": hlo_collective_bytes(dense_lines, mesh.size),
    }


def bench_mlp_parallel(
    configs: list[str],
    overrides: list[str],
    modes=MODES,
    steps: int = 5,
    repeats: int = 3,
    output: str | None = None,
    log=print,
) -> dict:
    """Every mode of every config, timed in turns; prints a table per config; JSON out."""
    for config in configs:
        check_device_step("mlp-parallel", load_config(config, overrides), config)
    report = {
        "benchmark": "mlp_parallel",
        "machine": machine_description(),
        "steps": steps,
        "repeats": repeats,
        "overrides": list(overrides),
        "results": [],
    }
    for config in each_case(configs):
        variants = [_variant(config, mode, overrides) for mode in modes]
        round_robin(variants, steps, repeats)
        base = variants[0]
        log(
            f"\n{config}: {base['devices']} devices, model groups of {base['model']}, "
            f"global batch {base['global_batch']}"
        )
        log(
            f"{'mode':<10}{'step ms':>10}{'vs ' + base['mode']:>10}{'peak MiB/dev':>14}{'dense state MiB/dev':>21}"
            f"{'sent KiB/dev':>14}{'dense sent KiB/dev':>20}"
        )
        for v in variants:
            sent, dense = sum(v["bytes_sent_per_device"].values()), sum(v["dense_bytes_sent_per_device"].values())
            log(
                f"{v['mode']:<10}{v['step_ms']:>10.1f}{base['step_ms'] / v['step_ms']:>9.2f}x"
                f"{v['peak_bytes_per_device'] / 2**20:>14.1f}{v['dense_state_bytes_per_device'] / 2**20:>21.2f}"
                f"{sent / 2**10:>14.1f}{dense / 2**10:>20.1f}"
            )
            row = {k: v[k] for k in v if k not in ("fn", "state", "inputs", "times", "outs")}
            row["speed_vs_first"] = base["step_ms"] / v["step_ms"]
            row["loss_last"] = float(v["outs"][-1]["loss"])
            report["results"].append(row)
        del variants
    write_report(report, output)
    return report
