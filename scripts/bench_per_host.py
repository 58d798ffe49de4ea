"""embedding.sync=global vs per_host (sync_every 0, 10, 100) vs host_replicas, each over N
local processes.

Every variant, side by side in one run, through ``scripts/launch_local.sh`` (N processes on
127.0.0.1, simulated CPU devices or the host's GPUs):

- accuracy: one run each of the same steps: AUC and log loss, the mean of the tables'
  divergence across hosts over the logged steps, and the AUC of the synthetic data's hidden
  model on the same eval samples, the best any model can reach (*Distributed Training of DLRM*'s single-node vs
  independent-embeddings comparison, against a known ground truth);
- speed: ``--repeats`` short runs each without evaluation, interleaved, median samples/s and
  its ratio to global;
- ``dlrm-jax profile`` on the same processes for the per-phase table.

    python scripts/bench_per_host.py --out runs/bench-per-host            # 2 processes x 4 devices
    python scripts/bench_per_host.py --processes 2 --devices 8 --steps 1500 --set train.batch_size=2048
    python scripts/bench_per_host.py --variants global host_replicas          # a subset, side by side

Writes OUT/per_host.json and prints a markdown table (for BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "global": [],
    "per_host sync 0": ["embedding.sync=per_host", "embedding.sync_every=0"],
    "per_host sync 10": ["embedding.sync=per_host", "embedding.sync_every=10"],
    "per_host sync 100": ["embedding.sync=per_host", "embedding.sync_every=100"],
    "host_replicas": ["embedding.sync=host_replicas"],
}


def launch(processes: int, args: list[str], log: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    with open(log, "w") as f:
        done = subprocess.run(
            [str(REPO / "scripts" / "launch_local.sh"), str(processes), *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=3600,
        )
    if done.returncode:
        sys.exit(f"bench_per_host: {' '.join(args[:1])} failed (exit {done.returncode}); see {log}")


def oracle_auc(config: str, overrides: list[str]) -> float:
    """AUC of the hidden model's true logits on the eval samples every variant is scored on."""
    from dlrm_jax.config import load_config
    from dlrm_jax.data.sources import resolve_data_config
    from dlrm_jax.data.sources.synthetic import SyntheticSource
    from dlrm_jax.observe.metrics import roc_auc

    cfg = resolve_data_config(load_config(config, overrides))
    source = SyntheticSource(cfg)
    labels = [b.labels for b in source.eval_batches()]
    import numpy as np

    return roc_auc(np.concatenate(labels), source.eval_logits())


def train(a, name: str, run_dir: Path, sets: list[str]) -> list[dict]:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    launch(
        a.processes,
        ["train", "--config", a.config, *sets, "--run-dir", str(run_dir)],
        run_dir.parent / f"{run_dir.name}.log",
    )
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def flags(*settings: str) -> list[str]:
    return [x for kv in settings for x in ("--set", kv)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--devices", type=int, default=8, help="mesh.devices over all processes")
    ap.add_argument("--steps", type=int, default=600, help="steps of the accuracy runs")
    ap.add_argument("--speed-steps", type=int, default=200, help="steps of each timed run")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per variant, interleaved")
    ap.add_argument("--config", default="default")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", default="runs/bench-per-host")
    a = ap.parse_args()
    out = Path(a.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    common = [f"mesh.devices={a.devices}", "train.checkpoint_every=0", *a.overrides]
    dirname = lambda name: name.replace(" ", "_")
    rows = {name: {"variant": name} for name in a.variants}

    # Accuracy: one run each (deterministic); divergence logged off the sync steps.
    for name in a.variants:
        events = train(
            a,
            name,
            out / dirname(name),
            flags(
                *common,
                *VARIANTS[name],
                f"train.steps={a.steps}",
                f"train.eval_every={a.steps // 4}",
                f"train.log_every={a.steps // 20 + 1}",
            ),
        )
        evals, logged = [e for e in events if "auc" in e], [e for e in events if e["event"] == "train"]
        rows[name].update(
            auc_curve=[(e["step"], e["auc"]) for e in evals],
            auc=evals[-1]["auc"],
            logloss=evals[-1]["logloss"],
            mean_table_divergence=sum(e.get("table_divergence", 0.0) for e in logged) / len(logged),
            # per device and step, at the compiled capacities (metrics.jsonl)
            a2a_bytes=logged[-1]["a2a_bytes"],
            allgather_bytes=logged[-1]["allgather_bytes"],
        )
        print(f"{name}: AUC {rows[name]['auc']:.4f}", flush=True)
    # Speed: short runs without evaluation, interleaved so drift of the machine hits every variant.
    for r in range(a.repeats):
        for name in a.variants[r % len(a.variants) :] + a.variants[: r % len(a.variants)]:
            events = train(
                a,
                name,
                out / f"speed_{dirname(name)}",
                flags(
                    *common,
                    *VARIANTS[name],
                    f"train.steps={a.speed_steps}",
                    "train.eval_every=0",
                    f"train.log_every={a.speed_steps}",
                ),
            )
            rows[name].setdefault("samples_per_s_runs", []).append(events[-1]["run_samples_per_s"])
    # Per-phase table: dlrm-jax profile on the same processes.
    for name in a.variants:
        run_dir = out / dirname(name)
        launch(
            a.processes,
            [
                "profile",
                "--config",
                a.config,
                *flags(*common, *VARIANTS[name]),
                "--steps",
                "20",
                "--run-dir",
                str(run_dir),
            ],
            out / f"{run_dir.name}.profile.log",
        )
        profile = json.loads((run_dir / "profile.json").read_text())
        rows[name].update(
            step_wall_ms=profile["step_wall_ms"],
            phases=profile["phases"],
            memory_per_device=profile["memory_per_device"],
        )
    for row in rows.values():
        row["samples_per_s"] = statistics.median(row["samples_per_s_runs"])
    rows = list(rows.values())
    best = oracle_auc(a.config, common)
    base = next((r for r in rows if r["variant"] == "global"), rows[0])
    result = {
        "machine": f"{platform.node()} ({os.cpu_count()} cores)",
        "command": " ".join(sys.argv),
        "processes": a.processes,
        "devices": a.devices,
        "steps": a.steps,
        "speed_steps": a.speed_steps,
        "repeats": a.repeats,
        "config": a.config,
        "overrides": a.overrides,
        "oracle_auc": best,
        "variants": rows,
    }
    (out / "per_host.json").write_text(json.dumps(result, indent=1) + "\n")

    print(
        f"\n{a.processes} processes x {a.devices // a.processes} devices, config {a.config}; AUC after {a.steps} "
        f"steps (hidden model's AUC on the eval samples {best:.4f}); samples/s: median of {a.repeats} interleaved "
        f"runs of {a.speed_steps} steps\n"
    )
    print(
        "| variant | samples/s (runs) | vs global | AUC | gap to hidden model | log loss | mean table divergence "
        "| all-to-all B/step | all-gather B/step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        runs = ", ".join(f"{x:,.0f}" for x in r["samples_per_s_runs"])
        print(
            f"| {r['variant']} | {r['samples_per_s']:,.0f} ({runs}) | {r['samples_per_s'] / base['samples_per_s']:.2f}x | "
            f"{r['auc']:.4f} | {best - r['auc']:.4f} | {r['logloss']:.4f} | {r['mean_table_divergence']:.4f} | "
            f"{r['a2a_bytes']:,} | {r['allgather_bytes']:,} |"
        )
    names = list(dict.fromkeys(p["name"] for r in rows for p in r["phases"]))
    print("\nms per step (profile: device phases from the trace, mean per device; host phases timed alone)\n")
    print("| phase | " + " | ".join(r["variant"] for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for n in names:
        cells = [next((f"{p['ms']:.2f}" for p in r["phases"] if p["name"] == n), "-") for r in rows]
        print(f"| {n} | " + " | ".join(cells) + " |")
    print("| step wall (blocking) | " + " | ".join(f"{r['step_wall_ms']:.2f}" for r in rows) + " |")


if __name__ == "__main__":
    main()
