"""Does the training-time block shuffle cost accuracy? Trains the same config on the same
preprocessed dataset with a per-row reshuffle every epoch (``data.shuffle_block=1``: what a
full permutation gives), the block shuffle at several block sizes, and no shuffle, several
seeds each, and reports the final AUC of each variant with its spread.

    python scripts/bench_shuffle_auc.py --data DATASET --epochs 3 --seeds 0,1 --out shuffle.json

The dataset is one made by ``dlrm-jax preprocess`` (globally shuffled at preprocessing, the
default). Variants run in turn within each seed, so a drifting machine slows them alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import dlrm_jax


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--config", default="criteo_kaggle")
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--blocks", default="1,4096,65536", help="data.shuffle_block values (1: per row)")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--out")
    args = p.parse_args(argv)
    dlrm_jax.request_cpu_devices(args.devices)
    from dlrm_jax.data.shards import read_meta

    rows = read_meta(args.data)["train_rows"]
    steps = max(1, int(args.epochs * rows / args.batch))
    variants = {f"block={b}": [f"data.shuffle_block={b}"] for b in args.blocks.split(",")}
    variants["no shuffle"] = ["data.shuffle=false"]
    results = {name: [] for name in variants}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name, sets in variants.items():
            cfg = dlrm_jax.load_config(
                args.config,
                [
                    "data.source=binary",
                    f"data.path={args.data}",
                    f"train.batch_size={args.batch}",
                    f"train.steps={steps}",
                    f"train.seed={seed}",
                    "train.eval_every=0",
                    "train.eval_batches=0",
                    "train.checkpoint_every=0",
                    "train.progress_bar=false",
                    f"mesh.devices={args.devices}",
                    *args.overrides,
                    *sets,
                ],
            )
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as run_dir:
                s = dlrm_jax.train_and_evaluate(cfg, run_dir, log=lambda *_: None)
            results[name].append({"seed": seed, "auc": s.auc, "logloss": s.logloss, "wall_s": time.perf_counter() - t0})
            print(f"seed {seed} {name:<14} auc {s.auc:.5f} logloss {s.logloss:.5f}", flush=True)
    summary = {
        name: {
            "auc_mean": statistics.mean(r["auc"] for r in runs),
            "auc_spread": max(r["auc"] for r in runs) - min(r["auc"] for r in runs),
            "runs": runs,
        }
        for name, runs in results.items()
    }
    report = {"data": args.data, "train_rows": rows, "steps": steps, "batch": args.batch, "variants": summary}
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
