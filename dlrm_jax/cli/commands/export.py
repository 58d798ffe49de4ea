"""``dlrm-jax export``: a run's tables as tensorstore arrays, or a serving artifact."""

from __future__ import annotations

import sys
from pathlib import Path

from dlrm_jax import stopping
from dlrm_jax.cli.args import add_overrides, add_run_and_step
from dlrm_jax.cli.runtime import devices_for, library_logs_to, log, start_jax
from dlrm_jax.config import ConfigError, load_run_config

NAME = "export"
HELP = (
    "write a run's tables (values and optimizer state) as tensorstore arrays, "
    "or (--serving) a self-contained serving artifact"
)


def add_arguments(p) -> None:
    add_run_and_step(
        p,
        "export",
        lambda p: p.add_argument(
            "--output",
            required=True,
            help="folder for OUTPUT/<table>/<field> zarr3 arrays, or the serving artifact (a new folder)",
        ),
    )
    p.add_argument(
        "--serving",
        action="store_true",
        help="write the serving artifact: the dense part as a "
        "jax.export function, the tables, the preprocessing rules and a manifest (docs/serving.md)",
    )
    p.add_argument(
        "--tables",
        choices=["float32", "bfloat16", "int8"],
        default="float32",
        help="--serving: how the tables are stored (int8: a scale and offset per row)",
    )
    p.add_argument(
        "--since",
        type=int,
        metavar="STEP",
        help="--serving: a delta, only the rows changed since "
        "the checkpoint of STEP (load it after that step's export)",
    )
    add_overrides(p, "override a key of the run's config for the export, e.g. --set mesh.devices=4 (repeatable)")


def run(args) -> int:
    cfg = load_run_config(args.run_dir, args.overrides)  # first: a folder that is no run dir is named
    if not args.serving and (args.since is not None or args.tables != "float32"):
        raise ConfigError("--tables and --since go with --serving (the plain export writes float32 tables whole)")
    start_jax(devices_for(cfg), args)
    library_logs_to(Path(args.run_dir))
    from dlrm_jax.train.export import export_run
    from dlrm_jax.train.serving_export import export_serving

    with stopping.deferred("the export"):  # restores and compiles (see dlrm_jax.stopping)
        if args.serving:
            step = export_serving(
                args.run_dir, args.output, args.overrides, args.step, args.tables, args.since, log=log
            )
        else:
            step = export_run(args.run_dir, args.output, args.overrides, step=args.step, log=log)
        # A stop that came meanwhile waited for the export, which is whole now: the command is
        # done (it exited 128 + signal, an export on disk that a re-run into --output refused).
        asked = stopping.take_pending()
    print(f"exported step={step} to {args.output}", flush=True)
    if asked:
        print(
            f"dlrm-jax: {stopping.signal_words(asked)[0]} came while the export was made; it is whole", file=sys.stderr
        )
    return 0
