"""dlrm-jax: train, evaluate and plan DLRM-family models with sharded embedding tables.

The parser: one sub-command a command module (:mod:`dlrm_jax.cli.commands`), each adding
its own flags with argparse types (:mod:`dlrm_jax.cli.args`), so that a malformed value names
its flag.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from types import ModuleType

from dlrm_jax.cli import commands as registry
from dlrm_jax.cli.args import Parser


def build_parser(commands: Sequence[ModuleType] | None = None) -> argparse.ArgumentParser:
    """``dlrm-jax``'s parser: a sub-command for each of ``commands`` (default: every one of
    :data:`~dlrm_jax.cli.commands.COMMANDS`)."""
    from dlrm_jax import __version__

    parser = Parser(prog="dlrm-jax", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"dlrm-jax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in registry.COMMANDS if commands is None else commands:
        command.add_arguments(sub.add_parser(command.NAME, help=command.HELP))
    return parser
