"""``dlrm-jax``'s commands, one module each: its ``NAME``, its ``HELP`` line,
``add_arguments(parser)`` and ``run(args) -> exit status``. Each loads and checks its config
before JAX is imported (a bad key fails in milliseconds and ``mesh.devices`` can still shape
the simulated CPU devices), then calls the library. A new command is a module and a row of
:data:`COMMANDS`."""

from __future__ import annotations

from types import ModuleType

from dlrm_jax.cli.commands import (
    bench,
    config,
    evaluate,
    export,
    plan,
    predict,
    preprocess,
    profile,
    report,
    train,
)

# In the order `dlrm-jax -h` lists them.
COMMANDS: tuple[ModuleType, ...] = (train, evaluate, export, predict, plan, config, preprocess, profile, report, bench)


def by_name() -> dict[str, ModuleType]:
    """Each command's module by its name on the command line."""
    return {c.NAME: c for c in COMMANDS}
