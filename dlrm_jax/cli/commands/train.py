"""``dlrm-jax train``: train a model, resuming from its run dir's newest checkpoint."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from dlrm_jax import stopping
from dlrm_jax.cli.args import add_config_args, add_distributed_args
from dlrm_jax.cli.runtime import devices_for, library_logs_to, log, start_jax
from dlrm_jax.config import ConfigError, load_config
from dlrm_jax.files import numbered_folders
from dlrm_jax.parallel.launch import RESUME_ENV

NAME = "train"
HELP = "train a model (resumes from --run-dir's newest checkpoint)"


def add_arguments(p) -> None:
    add_config_args(p)
    p.add_argument("--run-dir", help="where config, plan, metrics and checkpoints go (default: runs/<time>)")
    add_distributed_args(p)


def run(args) -> int:
    cfg = load_config(args.config, args.overrides)
    from dlrm_jax.data.sources import check_data_path, resolve_data_config

    check_data_path(cfg)  # before a run dir exists: a mistake leaves nothing behind
    _check_config_outside_run_dir(args)
    start_jax(devices_for(cfg), args, cfg.mesh.devices)
    import jax

    from dlrm_jax.parallel.mesh import check_available
    from dlrm_jax.train.checks import check_runnable
    from dlrm_jax.train.library_log import log_path
    from dlrm_jax.train.rundir import agree_on_run_dir

    devices, cpu = cfg.mesh.devices or jax.device_count(), jax.default_backend() == "cpu"
    check_available(devices, jax.device_count(), jax.default_backend())
    cfg = resolve_data_config(cfg)  # binary data's features, checked against the config's
    check_runnable(cfg, devices, jax.process_count(), simulated=cpu)  # the plan command's checks, before a run dir
    run_dir = Path(agree_on_run_dir(args.run_dir))  # every process: the same directory
    log(f"run dir: {run_dir}")
    library_logs_to(run_dir)
    # (a Ctrl-C that also ends `| tee`, a closed terminal: the run still saves, its lines to the log)
    with stopping.keep_output_going(str(log_path(run_dir, jax.process_index()))):
        try:
            return _trained(args, cfg, run_dir)
        finally:
            if not args.run_dir and jax.process_index() == 0:  # (runs/<time>, made to be this run's alone:
                with contextlib.suppress(OSError):  # left empty by a refused run; runs/ too, where it holds no other)
                    run_dir.rmdir()
                    run_dir.parent.rmdir()


def _trained(args, cfg, run_dir: Path) -> int:
    """The run, and the lines that end it; its exit status."""
    import jax

    from dlrm_jax.train.trainer import Interrupted, train_and_evaluate

    try:
        # Planning, restoring, compiling and the final evaluation compile: a stop signal there
        # waits for a point where nothing native is under way (see dlrm_jax.stopping).
        with stopping.deferred("the run's start"):
            summary = train_and_evaluate(cfg, run_dir, log=log)
    except Interrupted as e:
        # (under the launch supervisor, its command: the run dir it chose is not in the user's)
        resume = os.environ.get(RESUME_ENV)
        again = (
            f"run `{resume}`"
            if resume
            else "re-run the same command"
            if args.run_dir
            else f"re-run the command with --run-dir {run_dir}"
        )
        saved = f"checkpoint saved in {run_dir}; {again} to resume" if e.saved else "nothing saved"
        print(f"dlrm-jax: {e}; {saved}", file=sys.stderr, flush=True)
        return 128 + e.signum
    if jax.process_index() == 0:  # every process holds the same summary: one copy for the reader
        if summary.best is not None:  # the best evaluation, then the last (the contract's final line)
            print(summary.best_line(), flush=True)
        print(summary.final_line(), flush=True)
    return 0


def _check_config_outside_run_dir(args) -> None:
    """A ConfigError when --config is the file a new run in --run-dir would write its resolved
    config over (the user's comments and layout lost); a run dir's own config.yaml, beside its
    checkpoints, is its record, and resuming with it is fine."""
    if not args.run_dir or not args.config or not Path(args.config).is_file():
        return
    own = Path(args.run_dir) / "config.yaml"
    if own.exists() and own.resolve() == Path(args.config).resolve():
        if not numbered_folders(Path(args.run_dir) / "checkpoints"):  # no checkpoint: a new run
            raise ConfigError(
                f"--config {args.config} is where --run-dir {args.run_dir} records the run's resolved config: "
                f"a new run would write over it; keep your config outside the run dir"
            )
