"""Flags every test process compiles with, and the environment of the tests' child processes.

Standard library only: conftest imports it before JAX, to set the XLA flags."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the checkout, whose tests/ is the package `tests`

# Tests compile far more than they run: LLVM's optimisation passes are most of a CPU compile and
# level 0 makes the suite about a third faster. XLA:CPU's MLIR fusion emitters take about twice
# the compile time of its older ones (jaxlib 0.10.2; a 37 s test with 17 s of compiles ran in 26 s
# with 8 s). Results are unchanged (no fast-math either way); a user's runs keep XLA's defaults.
COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def child_env(drop=("JAX_PLATFORMS",)) -> dict:
    """os.environ for a child that sets its own device count (the CLI, launch_local.sh), with
    the test compile flags and the checkout first on PYTHONPATH (a script a test writes imports
    its helpers as the tests do: ``from tests.helpers import tiny_config``); ``drop``: other
    variables it must not inherit."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and k not in drop}
    env["XLA_FLAGS"] = COMPILE_FLAGS
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def cli(*args, timeout=300, check=False, drop=()) -> subprocess.CompletedProcess:
    """``python -m dlrm_jax ARGS`` in a child with the tests' compile flags; ``check``: an
    AssertionError showing both streams unless it exits 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "dlrm_jax", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(drop=drop),
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc
