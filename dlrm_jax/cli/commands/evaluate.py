"""``dlrm-jax eval``: evaluate a checkpoint of a run."""

from __future__ import annotations

from pathlib import Path

from dlrm_jax import stopping
from dlrm_jax.cli.args import add_distributed_args, step_arg
from dlrm_jax.cli.runtime import devices_for, library_logs_to, log, run_config, start_jax

NAME = "eval"
HELP = "evaluate a checkpoint of a run (default: the newest)"


def add_arguments(p) -> None:
    p.add_argument("--run-dir", required=True, help="the training run's folder (its config.yaml and checkpoints)")
    p.add_argument(
        "--step",
        type=step_arg,
        help="the checkpoint to evaluate: a step, or 'best' (train.keep_best's); default: the newest intact",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of the run's config for this evaluation, e.g. --set mesh.devices=4 "
        "or --set train.eval_batches=0 (the whole held-out split; repeatable)",
    )
    add_distributed_args(p)


def run(args) -> int:
    cfg = run_config(args.run_dir, args.overrides)
    start_jax(devices_for(cfg), args, cfg.mesh.devices)
    library_logs_to(Path(args.run_dir))
    from dlrm_jax.train.saved_run import evaluate_run

    with stopping.deferred("the evaluation"):  # restores and compiles (see dlrm_jax.stopping)
        summary = evaluate_run(args.run_dir, args.overrides, step=args.step, log=log)
    print(
        f"eval step={summary.step} auc={summary.auc:.6f} logloss={summary.logloss:.6f} samples={summary.eval_samples}",
        flush=True,
    )
    return 0
