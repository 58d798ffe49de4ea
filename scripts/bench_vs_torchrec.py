#!/usr/bin/env python3
"""dlrm_jax against TorchRec on CPU, side by side: configs c1 and c2 (configs/bench/), one
process, uniform one-hot ids, SGD. Runs are interleaved (TorchRec with 4 KiB and with huge
pages, ours on 1 and 8 simulated devices, in bfloat16, with 4 KiB pages, then the next config,
then the next repeat) so drift on the machine hits every variant alike. Prints medians with min-max and the ratios; writes JSON.

    scripts/bench_vs_torchrec.sh [REPEATS] [OUTPUT]    # builds the venvs, then runs this

samples/s is batch / median step time for both sides (TorchRec: forward, loss, backward and
optimizer of DistributedModelParallel with fused TBE kernels; ours: the compiled train step),
data generation and compilation excluded. The comparison with TorchRec is float32; bf16 MLP
compute is reported on its own line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# The TorchRec harness's flags for each config (the same shapes as configs/bench/*.yaml).
TORCHREC_ARGS = {
    "c1": ["--emb-dim", "16", "--num-tables", "26", "--rows", "100000", "--bot", "13-512-256-64-16"],
    "c2": ["--emb-dim", "64", "--num-tables", "8", "--rows", "1000000", "--bot", "13-512-256-64"],
}
OURS = {  # variant -> overrides for `dlrm-jax bench train`
    "dlrm_jax 1 device": ["mesh.devices=1"],
    "dlrm_jax 8 devices": ["mesh.devices=8"],
    "dlrm_jax 1 device bf16": ["mesh.devices=1", "train.compute_dtype=bfloat16"],
    "dlrm_jax 1 device 4K pages": ["mesh.devices=1"],
}
# Host memory pages. The dlrm-jax CLI puts its memory on transparent huge pages by default
# (dlrm_jax/hostmem.py); "4K pages" turns that off. TorchRec runs as its harness sets it up
# (4 KiB pages) and, as "torchrec huge pages", with the same glibc tunable plus PyTorch's own
# switch, so that the comparison does not rest on a setting the other side could also use.
NO_HUGE_PAGES = {"DLRM_JAX_HUGE_PAGES": "0"}
TORCHREC_HUGE_PAGES = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "THP_MEM_ALLOC_ENABLE": "1"}
TORCHREC = {"torchrec": {}, "torchrec huge pages": TORCHREC_HUGE_PAGES}


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "THP_MEM_ALLOC_ENABLE")}
    return env | extra


def run_ours(cli: str, config: str, overrides: list[str], steps: int, warmup: int, env: dict) -> float:
    with tempfile.TemporaryDirectory() as folder:  # (bench's --output is a new file)
        out = Path(folder) / "ours.json"
        cmd = [
            cli,
            "bench",
            "train",
            "--configs",
            str(REPO / "configs" / "bench" / f"{config}.yaml"),
            "--max-rows",
            "0",
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
            "--output",
            str(out),
        ]
        for o in overrides:
            cmd += ["--set", o]
        subprocess.run(cmd, check=True, capture_output=True, text=True, env=_env(env))
        result = next(iter(json.loads(out.read_text())["results"].values()))
    return result["samples_per_s"]


def run_torchrec(python: str, config: str, steps: int, warmup: int, env: dict) -> float:
    cmd = [
        python,
        str(HERE / "peers" / "torchrec_dlrm_bench.py"),
        "--emb-mode",
        "dmp",
        "--batch-size",
        "2048",
        "--top",
        "512-256-1",
        "--lr",
        "0.1",
        "--steps",
        str(steps + warmup),
        "--warmup",
        str(warmup),
        *TORCHREC_ARGS[config],
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=_env(env)).stdout
    return float(re.search(r"median_step_samples_per_s=([\d.]+)", out).group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per run (both sides)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--configs", default="c1,c2")
    ap.add_argument("--variants", default=",".join(OURS), help="which of our variants to run")
    ap.add_argument("--torchrec-python", default="/tmp/venv-torchrec/bin/python")
    ap.add_argument("--cli", default=str(Path(sys.executable).parent / "dlrm-jax"))
    ap.add_argument("--output", default="bench_vs_torchrec.json")
    args = ap.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    variants = [v for v in args.variants.split(",") if v]
    samples: dict[str, dict[str, list[float]]] = {c: {} for c in configs}
    for r in range(args.repeats):
        for c in configs:
            for name in [*TORCHREC, *variants]:
                t = time.time()
                if name in TORCHREC:
                    sps = run_torchrec(args.torchrec_python, c, args.steps, args.warmup, TORCHREC[name])
                else:
                    env = NO_HUGE_PAGES if name.endswith("4K pages") else {}
                    sps = run_ours(args.cli, c, OURS[name], args.steps, args.warmup, env)
                samples[c].setdefault(name, []).append(sps)
                print(f"repeat {r + 1} {c} {name}: {sps:,.0f} samples/s ({time.time() - t:.0f} s)", flush=True)

    summary = {}
    print(
        f"\n{'config':<7}{'variant':<28}{'median samples/s':>18}{'min-max':>22}{'vs TorchRec':>13}"
        f"{'vs TorchRec huge pages':>24}"
    )
    for c in configs:
        med = {n: statistics.median(v) for n, v in samples[c].items()}
        summary[c] = {
            n: {
                "median": med[n],
                "min": min(v),
                "max": max(v),
                "runs": v,
                "ratio_to_torchrec": med[n] / med["torchrec"],
                "ratio_to_torchrec_huge_pages": med[n] / med["torchrec huge pages"],
            }
            for n, v in samples[c].items()
        }
        if "dlrm_jax 8 devices" in med and "dlrm_jax 1 device" in med:
            summary[c]["dlrm_jax 8 devices"]["ratio_to_1_device"] = med["dlrm_jax 8 devices"] / med["dlrm_jax 1 device"]
        for n, v in samples[c].items():
            print(
                f"{c:<7}{n:<28}{med[n]:>18,.0f}{f'{min(v):,.0f}-{max(v):,.0f}':>22}"
                f"{med[n] / med['torchrec']:>12.2f}x{med[n] / med['torchrec huge pages']:>23.2f}x"
            )
    report = {
        "benchmark": "dlrm_jax vs torchrec, CPU train step",
        "repeats": args.repeats,
        "timed_steps": args.steps,
        "warmup_steps": args.warmup,
        "machine": {
            "host": platform.node(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "results": summary,
    }
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
