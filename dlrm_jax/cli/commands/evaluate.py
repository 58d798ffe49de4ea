"""``dlrm-jax eval``: evaluate a checkpoint of a run."""

from __future__ import annotations

from pathlib import Path

from dlrm_jax import stopping
from dlrm_jax.cli.args import add_distributed_args, add_overrides, add_run_and_step
from dlrm_jax.cli.runtime import devices_for, library_logs_to, log, start_jax
from dlrm_jax.config import load_run_config

NAME = "eval"
HELP = "evaluate a checkpoint of a run (default: the newest)"


def add_arguments(p) -> None:
    add_run_and_step(p, "evaluate")
    add_overrides(
        p,
        "override a key of the run's config for this evaluation, e.g. --set mesh.devices=4 "
        "or --set train.eval_batches=0 (the whole held-out split; repeatable)",
    )
    add_distributed_args(p)


def run(args) -> int:
    cfg = load_run_config(args.run_dir, args.overrides)
    start_jax(devices_for(cfg), args, cfg.mesh.devices)
    library_logs_to(Path(args.run_dir))
    from dlrm_jax.train.saved_run import evaluate_run

    # restores and compiles (see dlrm_jax.stopping); a stop loses only its scores: at once
    with stopping.deferred("the evaluation", keeps_nothing=True):
        summary = evaluate_run(args.run_dir, args.overrides, step=args.step, log=log)
    import jax

    if jax.process_index() == 0:  # every process holds the same result: one line for the reader, as train's
        print(
            f"eval step={summary.step} auc={summary.auc:.6f} logloss={summary.logloss:.6f} "
            f"samples={summary.eval_samples}",
            flush=True,
        )
    return 0
