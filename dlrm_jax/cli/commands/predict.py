"""``dlrm-jax predict``: score raw input lines with a serving artifact."""

from __future__ import annotations

import sys

from dlrm_jax import stopping
from dlrm_jax.cli.args import POSITIVE
from dlrm_jax.config import ConfigError

NAME = "predict"
HELP = "score raw input lines with a serving artifact (export --serving)"


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="the serving artifact's folder")
    p.add_argument(
        "--delta", action="append", default=[], metavar="DIR", help="a delta export to apply, in order (repeatable)"
    )
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="raw files (plain or .gz), the training files' layout "
        "(Criteo TSV or the model's tabular schema); the label column may be present or absent",
    )
    p.add_argument(
        "--output",
        required=True,
        help="file for the probabilities, one a line, in input order (written whole or not at all); "
        "'-', a pipe or a device (/dev/stdout) is written to as lines are scored",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an --output file that exists already")
    p.add_argument(
        "--format",
        choices=["criteo", "tabular"],
        help="the input's layout (default and only choice: "
        "the model's training files', Criteo TSV or its tabular schema's)",
    )
    p.add_argument(
        "--batch-size", type=POSITIVE, default=4096, help="lines scored per call of the model (default 4096)"
    )
    p.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="score a malformed line as nan and go on (default: stop at the first, naming file and line)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (none is drawn off a terminal either)")


def run(args) -> int:
    from dlrm_jax.serving import load
    from dlrm_jax.serving.files import predict_files, writes_through

    with stopping.deferred("scoring the current chunk of lines"), load(args.model, args.delta) as model:
        if args.format and args.format != model.rules.format:
            raise ConfigError(
                f"--format {args.format}: {args.model} was trained on {model.rules.format} files, and reads those"
            )
        report = predict_files(
            model,
            args.input,
            args.output,
            batch_size=args.batch_size,
            skip_bad_lines=args.skip_bad_lines,
            progress=not args.no_progress,
            overwrite=args.overwrite,
        )
    to = sys.stderr if writes_through(args.output) else sys.stdout  # not amid the scores
    print(report.summary(args.output), flush=True, file=to)
    return 0
