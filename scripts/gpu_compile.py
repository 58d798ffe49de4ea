#!/usr/bin/env python3
"""A train step compiled for a GPU on a machine without one, and what its program does each step.

    python scripts/gpu_compile.py --out DIR --configs criteo_kaggle,criteo_kaggle_dynamic \
        --variants default,prefixes:criteo_kaggle_dynamic --card h100

XLA compiles for a named card without the card (deviceless compilation: the CUDA plugin with a
target description in place of a device). For each config and variant of
``scripts/gpu_bench.py`` (the same names, overrides and XLA flags, each in a process of its
own) this builds the step as training builds it, compiles it for the card, keeps its optimized
HLO (``DIR/<variant>-<config>.gpu.hlo.txt``) and prints what ``dlrm_jax.bench.hlo_kernels``
reads there: kernels launched a step, the loops and switches decided on the host (each a copy
to the host and a wait, the device idle), the bytes the kernels move (an estimate) and their
time at the card's bandwidth, the roofline time (each kernel's bytes at the card's measured
copy rate or its matrix FLOPs at its measured matmul rate, the longer, summed), the step's
scratch memory, gathers that read an array by columns, and the largest kernels. JSON in
``DIR/gpu_compile.json``. It times nothing: the GPU figures are ``gpu_bench.py``'s.

Needs the CUDA plugin beside JAX (not the project's dependencies; about 4 GB), best in a
virtual environment of its own:

    python3 -m venv /tmp/gpuc && /tmp/gpuc/bin/pip install "jax[cuda13]==$(.venv/bin/python -c \
        'import jax; print(jax.__version__)')" && /tmp/gpuc/bin/pip install -e .

(the version of the project's own JAX, with its CUDA 13 plugin; a few minutes).

Where it differs from a GPU: no autotuning (XLA takes its default GEMM and fusion
configurations), and sorts that a GPU gives to CUB's radix sort stay XLA's own sort kernels
(XLA needs CUB's scratch sizes from a device).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# Before JAX is imported: the CUDA plugin without a device (a machine with a GPU compiles for the
# named card all the same) and without a CUDA runtime to check.
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu,cuda")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The cards' descriptions as XLA's GPU compiler takes them (NVIDIA's datasheets: 132 SMs at
# 1.98 GHz, 50 MiB of L2; H100 SXM 80 GB at 3.35 TB/s, H200 141 GB at 4.8 TB/s).
_HOPPER = """gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth} l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: {memory} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }} registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 13 minor: 0 patch: 0 }}
device_description_str: "{name}"
"""
# ``copy`` and ``matmul``: the ceilings gpu_bench.py measured on each card (a device-to-device
# copy's bytes read plus written a second, an 8192^3 bfloat16 matmul's FLOPs; docs/benchmarks-log.md,
# "GPU: one H100", 2026-11-23: 2.66-2.81 TB/s, 633-707 TFLOP/s; "GPU: one H200", 2026-12-04:
# 3.66-3.70 TB/s, 638-651 TFLOP/s): what a kernel's roofline time is priced at.
CARDS = {
    "h100": dict(
        name="NVIDIA H100 80GB HBM3", bandwidth=3_352_320_000_000, memory=84_929_347_584, copy=2.74e12, matmul=670e12
    ),
    "h200": dict(name="NVIDIA H200", bandwidth=4_800_000_000_000, memory=150_754_820_096, copy=3.68e12, matmul=645e12),
}


def compile_one(config: str, variant: str, card: str, overrides: list[str], out: str) -> dict:
    """One config and variant compiled for ``card`` (in this process: its XLA flags are set)."""
    import gpu_bench_cases as cases
    import jax

    from dlrm_jax.bench.exchange import compiled_train_step
    from dlrm_jax.bench.hlo_kernels import command_buffer_types, program
    from dlrm_jax.bench.xla_options import command_buffer_types_installed
    from dlrm_jax.data.sources import make_source
    from dlrm_jax.parallel.mesh import AXIS
    from dlrm_jax.train.build import build

    mesh = _gpu_mesh(card, AXIS)
    # The code asks the default backend which platform it runs on (the sparse update's form,
    # Pallas's interpreter): here that is the CPU, so it is told what a GPU machine would say.
    jax.default_backend = lambda: "gpu"
    cases.EXTRA_OVERRIDES[:] = overrides + cases.VARIANTS[variant][1]  # (as a variant's child takes them)
    cfg = cases.step_config(config)
    source = make_source(cfg, 0, 1)
    _, fns = build(cfg, mesh, source, log=lambda *_: None)
    t0 = time.perf_counter()
    compiled = compiled_train_step(fns, cases.variant_batch(variant, fns, source.train_batch(0)))
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    prefix = "" if variant == "default" else f"{variant}-"
    with open(os.path.join(out, f"{prefix}{config}.gpu.hlo.txt"), "w") as f:
        f.write(text)
    # what this XLA records into command buffers, the variant's flags applied
    graphs = command_buffer_types_installed() or command_buffer_types(os.environ.get("XLA_FLAGS", ""))
    p = program(text, graphs, bandwidth=CARDS[card]["copy"], flop_rate=CARDS[card]["matmul"])
    mem = compiled.memory_analysis()
    bandwidth = CARDS[card]["bandwidth"]
    return {
        "config": config,
        "variant": variant,
        "card": CARDS[card]["name"],
        "overrides": cases.COMMON + cases.CONFIGS[config][1] + cases.EXTRA_OVERRIDES,
        "compile_s": compile_s,
        "temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "kernels": len(p.kernels),
        # a step's cheapest and dearest paths through its switches (a loop decided on the host: a round)
        "launches_per_step": list(p.launches),
        "command_buffer_types": sorted(graphs),
        "host_reads": p.host_reads,
        "host_reads_per_step": list(p.reads_per_step),  # cheapest and dearest paths (a loop: a round)
        "decided_on_device": p.on_device,  # switches (and loops, with +WHILE) recorded into CUDA graphs whole
        "loops": [{"op": op, "trip_count": n} for op, n in p.loops],
        "loop_launches_per_step": p.loop_launches,
        "traffic_bytes": list(p.traffic),
        "traffic_ms_at_bandwidth": [1e3 * b / bandwidth for b in p.traffic],
        "matmul_flops": list(p.flops),
        # each kernel's bytes at the card's measured copy rate or its FLOPs at its matmul rate,
        # the longer, summed: the step with no launch gap and every kernel at the ceiling
        "roofline_ms": [1e3 * t for t in p.roofline_s],
        "strided_gathers": p.strided_gathers,
        "largest": [
            {"name": k.name, "opcode": k.opcode, "bytes": k.bytes, "runs": k.runs, "where": k.where, "op": k.op_name}
            for k in p.largest(15)
        ],
    }


def _gpu_mesh(card: str, axes: tuple[str, ...]):
    """A mesh of one device of ``card`` described to XLA, not present (deviceless compilation)."""
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh

    target = _HOPPER.format(**CARDS[card])
    topology = topologies.get_topology_desc(platform="cuda", target_config=target, topology="1x1x1")
    return Mesh(np.array(topology.devices[:1]).reshape((1,) * len(axes)), axes, axis_types=(AxisType.Auto,) * len(axes))


def write_sample(path: str) -> None:
    """The small program ``tests/bench/test_hlo_kernels.py`` reads, compiled for an H100: a
    gather and an in-place scatter on a table of 32 MiB, a loop decided on the host, one of a
    known trip count, and a switch (its text without the source locations)."""
    import re

    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec

    replicated = NamedSharding(_gpu_mesh("h100", ("d",)), PartitionSpec())

    def f(table, ids, grads):
        rows = table[ids]  # 4096 rows of 8 floats read, not the table
        table = table.at[ids].add(grads)  # in place: the updates written, not the table
        _, halved = lax.while_loop(lambda c: jnp.any(c[1] > 0), lambda c: (c[0] + 1, c[1] // 2), (0, ids))
        z = lax.fori_loop(0, 3, lambda i, x: x + 1, halved)
        w = lax.cond(jnp.sum(z) > 5, jnp.sort, lambda x: jnp.cumsum(x[::-1]), z)
        return table, rows.sum(1) + w

    shapes = [((1 << 20, 8), jnp.float32), ((4096,), jnp.int32), ((4096, 8), jnp.float32)]
    args = [jax.ShapeDtypeStruct(s, d, sharding=replicated) for s, d in shapes]
    text = jax.jit(f, donate_argnums=0).lower(*args).compile().as_text()
    keep_op_name = lambda m: ", metadata={" + "".join(re.findall(r'op_name="[^"]*"', m.group(0))) + "}"
    text = re.sub(r", metadata=\{[^}]*\}", keep_op_name, text)
    text = re.sub(r"\n\n(FileNames|FunctionNames|FileLocations|StackFrames)\n.*?(?=\n\n)", "", text, flags=re.S)
    with open(path, "w") as out:
        out.write(text)


def print_table(results: list[dict]) -> None:
    print(
        f"{'variant':<24}{'config':<22}{'launches':>10}{'in loops':>9}{'host reads':>11}{'traffic MB':>14}"
        f"{'ms at bw':>13}{'roofline ms':>13}{'scratch MB':>11}{'compile s':>10}"
    )
    span = lambda pair, f: f(pair[0]) if pair[0] == pair[1] else f"{f(pair[0])}-{f(pair[1])}"
    for r in results:
        print(
            f"{r['variant']:<24}{r['config']:<22}{span(r['launches_per_step'], str):>10}"
            f"{r['loop_launches_per_step']:>9}{span(r['host_reads_per_step'], str):>11}"
            f"{span(r['traffic_bytes'], lambda b: f'{b / 1e6:,.0f}'):>14}"
            f"{span(r['traffic_ms_at_bandwidth'], lambda t: f'{t:.2f}'):>13}"
            f"{span(r['roofline_ms'], lambda t: f'{t:.2f}'):>13}"
            f"{r['temp_bytes'] / 2**20:>11,.0f}{r['compile_s']:>10.1f}"
        )
    for r in results:
        loops = [f"{x['op']}[{x['trip_count'] or '?'}]" for x in r["loops"]]
        print(f"\n{r['variant']} {r['config']}: loops {loops or 'none'}; host reads {r['host_reads'] or 'none'}")
        print(f"decided on the device (recorded into CUDA graphs whole): {r['decided_on_device'] or 'none'}")
        print(f"strided gathers {r['strided_gathers'] or 'none'}; largest kernels (MB a step):")
        for k in r["largest"][:10]:
            where = f" in {k['where']}" if k["where"] else ""
            print(f"  {k['bytes'] * k['runs'] / 1e6:9.1f}  {k['opcode']:<12} {k['op'][-80:]}{where}")


def _has_cuda_plugin() -> bool:
    import importlib.util

    if importlib.util.find_spec("jax_plugins") is None:
        return False
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13))


def main() -> int:
    import gpu_bench_cases as cases

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="criteo_kaggle", help="of: " + ", ".join(cases.CONFIGS))
    ap.add_argument(
        "--variants",
        default="default",
        help="gpu_bench.py's variants, comma-separated; NAME:CONFIG+CONFIG compiles NAME for those configs only",
    )
    ap.add_argument("--card", default="h100", choices=sorted(CARDS))
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override, repeatable")
    ap.add_argument("--one", nargs=2, metavar=("CONFIG", "VARIANT"), help=argparse.SUPPRESS)
    ap.add_argument("--sample", metavar="FILE", help="write the test's small program (tests/golden/hlo/) and stop")
    args = ap.parse_args()
    if args.sample:
        write_sample(args.sample)
        return 0
    os.makedirs(args.out, exist_ok=True)
    if args.one:
        result = compile_one(*args.one, args.card, args.overrides, args.out)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if not _has_cuda_plugin():
        ap.error(f"no CUDA plugin beside JAX in {sys.executable}: install one as this script's docstring says")
    try:
        runs = cases.variant_runs(args.variants, args.configs)
    except ValueError as e:
        ap.error(str(e))
    results = []
    for variant, configs in runs:
        # XLA reads its flags once a process: each variant in its own; autotuning needs a device
        flags = " ".join(f for f in cases.VARIANTS[variant][0].split() if "autotune" not in f)
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
        for config in configs:
            cmd = [sys.executable, __file__, "--out", args.out, "--card", args.card, "--one", config, variant]
            cmd += [a for o in args.overrides for a in ("--set", o)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode or not lines:
                print(f"{variant} {config}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
                continue
            results.append(json.loads(lines[-1][len("RESULT ") :]))
    with open(os.path.join(args.out, "gpu_compile.json"), "w") as f:
        json.dump({"card": args.card, "results": results}, f, indent=1)
    print_table(results)
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
