"""``dlrm-jax profile``: the time of each phase of a few train steps, and a trace."""

from __future__ import annotations

import os
from pathlib import Path

from dlrm_jax import stopping
from dlrm_jax.cli.args import COUNT, POSITIVE, add_config_args, add_distributed_args
from dlrm_jax.cli.runtime import devices_for, library_logs_to, log, start_jax
from dlrm_jax.config import load_config

NAME = "profile"
HELP = "time per phase of a few train steps, peak memory, and a trace"


def add_arguments(p) -> None:
    add_config_args(p)
    p.add_argument("--steps", type=POSITIVE, default=10, help="traced steps (default 10)")
    p.add_argument("--warmup", type=COUNT, default=3, help="untraced steps after compilation (default 3)")
    p.add_argument(
        "--run-dir",
        help="where profile.json and profile-trace/ go (default: runs/profile-<time>); "
        "a training run's dir (its config.yaml profiled where --config is not given) adds its "
        "phase bars to `dlrm-jax report`",
    )
    add_distributed_args(p)


def run(args) -> int:
    saved = Path(args.run_dir) / "config.yaml" if args.run_dir else None
    if args.config is None and saved is not None and saved.is_file():
        log(f"profiling the run's config, {saved} (--config to profile another)")
        cfg = load_config(saved, args.overrides)
    else:
        cfg = load_config(args.config, args.overrides)
    # XLA:CPU records one trace event per executed operation only when asked, before it starts.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_enable_xprof_traceme=true".strip()
    start_jax(devices_for(cfg), args, cfg.mesh.devices)
    from dlrm_jax.bench.profile import profile
    from dlrm_jax.train.rundir import agree_on_run_dir

    if args.run_dir:
        run_dir = Path(args.run_dir)
    else:  # runs/profile-<time>, the same on every process
        agreed = Path(agree_on_run_dir(None))
        run_dir = agreed.with_name(f"profile-{agreed.name}")
    library_logs_to(run_dir)
    # A stop waits for the step under way (the traced steps as one): raised while jaxlib
    # compiles, its exit crashed the process; raised inside the trace, the profiler's stop
    # never returned (see dlrm_jax.stopping). A second one ends the process at once.
    with stopping.deferred("the step under way (the traced steps as one)"):
        profile(cfg, run_dir, steps=args.steps, warmup=args.warmup, log=log)
    return 0
