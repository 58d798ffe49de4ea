"""How advice names what the user changes: ``dlrm-jax``'s flags (``--run-dir``, ``--set``) while
the command line runs, the Python API's arguments (``run_dir``, the overrides) when a notebook
calls ``train_and_evaluate``, ``evaluate_run`` or ``load_config`` itself (before, it was told to
"pass a new --run-dir", a flag it has no way to give). The command says it runs
(:func:`command_line`, in :mod:`dlrm_jax.cli`); everything else asks :func:`said`.

Process-wide, not per thread: a command's own threads (its loop's, its checkpoint's) speak as it
does. Imports nothing of the package.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_commands = 0  # commands running in this process (a notebook may call dlrm_jax.cli.main)


@contextlib.contextmanager
def command_line() -> Iterator[None]:
    """While the ``dlrm-jax`` command runs: advice names its flags."""
    global _commands
    with _lock:
        _commands += 1
    try:
        yield
    finally:
        with _lock:
            _commands -= 1


def said(cli: str, api: str) -> str:
    """``cli`` while a command runs, else ``api``: the same advice in the words of each."""
    return cli if _commands else api


def run_dir_flag() -> str:
    """``--run-dir``, or ``run_dir`` (the argument of ``train_and_evaluate`` and the rest)."""
    return said("--run-dir", "run_dir")


def setting(key: str, value: object) -> str:
    """``--set KEY=VALUE``, or the override ``'KEY=VALUE'`` (as ``load_config`` takes it)."""
    return said(f"--set {key}={value}", f"the override '{key}={value}'")
