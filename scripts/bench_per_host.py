"""embedding.sync=global vs per_host (sync_every 0, 10, 100), each over N local processes.

For every variant, side by side in one run: trains the same steps through
``scripts/launch_local.sh`` (N processes on 127.0.0.1, simulated CPU devices or the host's
GPUs), then ``dlrm-jax profile`` on the same processes for the per-phase table. Reports
samples/s (and its ratio to global), AUC and log loss after the same steps, the tables'
divergence across hosts, and the AUC of the synthetic data's hidden model on the same eval
samples: the best any model can reach (seed 003's single-node vs independent-embeddings
accuracy comparison, against a known ground truth).

    python scripts/bench_per_host.py --out runs/bench-per-host            # 2 processes x 4 devices
    python scripts/bench_per_host.py --processes 2 --devices 8 --steps 1500 --set train.batch_size=2048

Writes OUT/per_host.json and prints a markdown table (for BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {"global": [], "per_host sync 0": ["embedding.sync=per_host", "embedding.sync_every=0"],
            "per_host sync 10": ["embedding.sync=per_host", "embedding.sync_every=10"],
            "per_host sync 100": ["embedding.sync=per_host", "embedding.sync_every=100"]}


def launch(processes: int, args: list[str], log: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    with open(log, "w") as f:
        done = subprocess.run([str(REPO / "scripts" / "launch_local.sh"), str(processes), *args], stdout=f,
                              stderr=subprocess.STDOUT, env=env, timeout=3600)
    if done.returncode:
        sys.exit(f"bench_per_host: {' '.join(args[:1])} failed (exit {done.returncode}); see {log}")


def oracle_auc(config: str, overrides: list[str]) -> float:
    """AUC of the hidden model's true logits on the eval samples every variant is scored on."""
    from dlrm_jax.config import load_config
    from dlrm_jax.data.sources import resolve_data_config
    from dlrm_jax.data.synthetic import SyntheticSource
    from dlrm_jax.train.metrics import roc_auc

    cfg = resolve_data_config(load_config(config, overrides))
    source = SyntheticSource(cfg)
    labels = [b.labels for b in source.eval_batches()]
    import numpy as np

    return roc_auc(np.concatenate(labels), source.eval_logits())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--devices", type=int, default=8, help="mesh.devices over all processes")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--config", default="default")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", default="runs/bench-per-host")
    a = ap.parse_args()
    out = Path(a.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    common = [f"mesh.devices={a.devices}", f"train.steps={a.steps}", f"train.eval_every={a.steps // 4}",
              f"train.log_every={max(1, a.steps // 20)}", "train.checkpoint_every=0", *a.overrides]
    rows = []
    for name in a.variants:
        sets = [x for kv in [*common, *VARIANTS[name]] for x in ("--set", kv)]
        run_dir = out / name.replace(" ", "_")
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)
        t0 = time.time()
        launch(a.processes, ["train", "--config", a.config, *sets, "--run-dir", str(run_dir)], out / f"{run_dir.name}.log")
        events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        evals = [e for e in events if "auc" in e]
        launch(a.processes, ["profile", "--config", a.config, *sets, "--run-dir", str(run_dir)],
               out / f"{run_dir.name}.profile.log")
        profile = json.loads((run_dir / "profile.json").read_text())
        rows.append({"variant": name, "samples_per_s": evals[-1]["run_samples_per_s"],
                     "auc_curve": [(e["step"], e["auc"]) for e in evals], "auc": evals[-1]["auc"],
                     "logloss": evals[-1]["logloss"], "table_divergence": evals[-1].get("table_divergence", 0.0),
                     "step_wall_ms": profile["step_wall_ms"], "phases": profile["phases"],
                     "memory_per_device": profile["memory_per_device"], "wall_s": time.time() - t0})
        print(f"{name}: {rows[-1]['samples_per_s']:,.0f} samples/s, AUC {rows[-1]['auc']:.4f}", flush=True)
    best = oracle_auc(a.config, [*common])
    base = next((r for r in rows if r["variant"] == "global"), rows[0])
    result = {"machine": f"{platform.node()} ({os.cpu_count()} cores)", "command": " ".join(sys.argv),
              "processes": a.processes, "devices": a.devices, "steps": a.steps, "config": a.config,
              "overrides": a.overrides, "oracle_auc": best, "variants": rows}
    (out / "per_host.json").write_text(json.dumps(result, indent=1) + "\n")

    print(f"\n{a.processes} processes x {a.devices // a.processes} devices, config {a.config}, {a.steps} steps; "
          f"hidden model's AUC on the eval samples {best:.4f}\n")
    print("| variant | samples/s | vs global | AUC | AUC gap to hidden model | log loss | table divergence |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['samples_per_s']:,.0f} | {r['samples_per_s'] / base['samples_per_s']:.2f}x | "
              f"{r['auc']:.4f} | {best - r['auc']:.4f} | {r['logloss']:.4f} | {r['table_divergence']:.4f} |")
    names = [p["name"] for p in rows[0]["phases"]]
    names += [p["name"] for r in rows for p in r["phases"] if p["name"] not in names]
    names = list(dict.fromkeys(names))
    print("\nms per step (profile: device phases from the trace, mean per device; host phases timed alone)\n")
    print("| phase | " + " | ".join(r["variant"] for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for n in names:
        cells = [next((f"{p['ms']:.2f}" for p in r["phases"] if p["name"] == n), "-") for r in rows]
        print(f"| {n} | " + " | ".join(cells) + " |")
    print("| step wall (blocking) | " + " | ".join(f"{r['step_wall_ms']:.2f}" for r in rows) + " |")


if __name__ == "__main__":
    main()
