"""``dlrm-jax report``: plots of runs' metrics on shared axes."""

from __future__ import annotations

import os
from pathlib import Path

from dlrm_jax.files import file_key

NAME = "report"
HELP = "PNG plots of runs' metrics.jsonl (and profile.json), on shared axes"


def add_arguments(p) -> None:
    p.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="run folders (train's or profile's --run-dir), plotted together on shared axes",
    )
    p.add_argument("--output", help="folder for the PNG files (default: FIRST_RUN_DIR/report)")


def run(args) -> int:
    from dlrm_jax.observe.report import load_run, run_labels, summary, write_report

    run_dirs = [Path(p) for p in args.run_dirs]
    seen: dict = {}
    for d in args.run_dirs:  # (plotted twice under one label, the legend could not tell them apart)
        if (key := file_key(d)) in seen:
            raise ValueError(f"{d}: given twice ({seen[key]} is the same run dir); give each run once")
        seen[key] = d
    output = Path(args.output) if args.output else run_dirs[0] / "report"
    if not args.output and run_dirs[0].is_dir() and not os.access(run_dirs[0], os.W_OK):
        raise ValueError(
            f"{run_dirs[0]}: cannot be written to (a read-only run dir?); give the plots a folder: --output DIR"
        )
    for path in write_report(run_dirs, output):
        print(f"wrote {path}", flush=True)
    for run_dir, label in zip(run_dirs, run_labels(run_dirs), strict=True):
        print(summary(load_run(run_dir), label), flush=True)
    return 0
