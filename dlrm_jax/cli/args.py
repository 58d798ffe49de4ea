"""The argument types and groups ``dlrm-jax``'s commands share: argparse types that name their
flag in an error (bounded numbers, comma-separated lists and names), the config and the
multi-process flags."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

from dlrm_jax.choices import Sharding


def bounded(kind: type, low: float, *, strict: bool = False, below: float | None = None):
    """An argparse type: an integer or number >= ``low`` (> with ``strict``) and < ``below``;
    argparse names the flag in its error."""
    what, op = {int: "an integer", float: "a number"}[kind], ">" if strict else ">="

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value):  # nan passes every comparison; inf overflows a size
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"expected {what} {op} {low:g}, got {text}")
        if below is not None and value >= below:
            raise argparse.ArgumentTypeError(f"expected {what} < {below:g}, got {text}")
        return value

    return parse


class DefaultsShown(argparse.HelpFormatter):
    """``--help`` ends each flag's line with its default, where the help does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text, default = action.help or "", action.default
        if "default" in text or default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        shown = ",".join(map(str, default)) if isinstance(default, list | tuple) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})" if shown else text


class Parser(argparse.ArgumentParser):
    """``dlrm-jax``'s parsers: their ``--help`` shows the defaults (:class:`DefaultsShown`), and
    each sub-command's parser is one too (argparse makes them of the parent's class)."""

    def __init__(self, *args, formatter_class=DefaultsShown, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


def list_of(kind: type, low: float | None = None, empty: bool = False):
    """An argparse type: comma-separated distinct values of ``kind`` (each >= ``low`` if given;
    none at all, ``""``, only when ``empty``)."""
    what = {int: "integers", float: "numbers"}[kind]

    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None
        if not all(map(math.isfinite, values)):
            raise argparse.ArgumentTypeError(f"expected comma-separated finite {what}, got {text!r}")
        if not values and not (empty and not text.strip()):
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
        if low is not None and min(values) < low:
            raise argparse.ArgumentTypeError(f"expected values >= {low}, got {text!r}")
        if len(set(values)) < len(values):  # (each a case of its own: one twice is a mistake)
            raise argparse.ArgumentTypeError(f"expected distinct values, got {text!r}")
        return values

    return parse


def names(*allowed: str):
    """An argparse type: comma-separated distinct names, each one of ``allowed``, at least one; argparse
    names the flag in its error, and the error lists what is allowed."""

    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in allowed]
        if not values or bad:
            got = f"{bad[0]!r} in {text!r}" if bad and bad != [text.strip()] else repr(text)
            raise argparse.ArgumentTypeError(f"expected comma-separated values of {', '.join(allowed)}; got {got}")
        if len(set(values)) < len(values):
            raise argparse.ArgumentTypeError(f"expected distinct values, got {text!r}")
        return values

    return parse


STRATEGIES = tuple(Sharding)  # auto: the config's own embedding.sharding
HOT_LAYOUTS = ("permuted", "frequency_ordered")  # bench/hot.py's LAYOUTS (a test keeps them equal)
MLP_MODES = ("data", "tensor", "pipeline")  # bench/mlp_parallel.py's MODES (likewise)


POSITIVE, COUNT = bounded(int, 1), bounded(int, 0)  # steps and repeats; warmups and caps
FRACTION = bounded(float, 0, below=1)  # a share of rows held out
SHARE = bounded(float, 0, strict=True, below=1.0000001)  # a share of rows cached: (0, 1]
COUNT_NUMBER = bounded(float, 0)  # a size that may be 0 (none)


def config_names(text: str) -> list[str]:
    """An argparse type: comma-separated config names or files, at least one, each once."""
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated config names or files, got {text!r}")
    twice = sorted({v for v in values if values.count(v) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{twice[0]} is given twice (each config is one result)")
    return values


def new_json_file(text: str) -> str:
    """An argparse type: where a benchmark writes its JSON, checked before it runs (it writes at
    the end: a path that cannot take the results would lose them); a file that exists is not
    replaced."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file in it, e.g. {path / 'bench.json'}")
    if path.exists() or path.is_symlink():
        raise argparse.ArgumentTypeError(f"{text} exists; give a new file (a benchmark's results are not replaced)")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: its folder {path.parent} does not exist (or is not a folder)")
    if not os.access(path.parent, os.W_OK):  # (a read-only disk too, even for root)
        raise argparse.ArgumentTypeError(f"{text}: its folder {path.parent} cannot be written to")
    return text


def add_config_args(p: argparse.ArgumentParser, config_required: bool = False) -> None:
    p.add_argument(
        "--config",
        required=config_required,
        help="YAML file (or a name from configs/, e.g. criteo_kaggle; a+b: b's keys over a's); default: the embedded default",
    )
    add_overrides(p, "override a config key, e.g. --set train.steps=100 (repeatable)")


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-process (one process per host)")
    g.add_argument("--coordinator", help="host:port of process 0 for jax.distributed")
    g.add_argument(
        "--coordinator-bind",
        metavar="ADDRESS:PORT",
        help="where process 0's coordination service listens (default: --coordinator's own address, "
        "not every interface; 0.0.0.0:PORT to listen on all)",
    )
    g.add_argument("--num-processes", type=int, help="how many processes take part (every process the same)")
    g.add_argument("--process-id", type=int, help="this process's index, 0 to --num-processes - 1")
    g.add_argument(
        "--join-timeout",
        type=POSITIVE,
        default=300,
        metavar="S",
        help="seconds to wait for every process to join before exiting with one line (default 300)",
    )


def step_arg(text: str) -> int | str:
    """--step: a checkpoint's step, or 'best'."""
    if text == "best":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step number or 'best', got {text!r}") from None


def add_overrides(p: argparse.ArgumentParser, help: str) -> None:
    """--set KEY=VALUE, repeatable, into ``args.overrides``."""
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def add_run_and_step(p: argparse.ArgumentParser, to: str, between: Callable | None = None) -> None:
    """--run-dir (a training run's folder) and --step (one of its checkpoints, which the command
    uses ``to`` ...); ``between`` adds the flags that come between them in ``-h``."""
    p.add_argument("--run-dir", required=True, help="the training run's folder (its config.yaml and checkpoints)")
    if between is not None:
        between(p)
    p.add_argument(
        "--step",
        type=step_arg,
        help=f"the checkpoint to {to}: a step, or 'best' (train.keep_best's); default: the newest intact",
    )


def add_max_rows(p: argparse.ArgumentParser, default: int) -> None:
    """--max-rows: a benchmark's cap on table rows (a config's own tighter cap stays)."""
    p.add_argument(
        "--max-rows",
        type=COUNT,
        default=default,
        help="cap tables at this many rows; a config's own tighter cap stays (0: no change)",
    )


def add_json_output(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--output", type=new_json_file, help="write the results as JSON here (a new file), besides what is printed"
    )
