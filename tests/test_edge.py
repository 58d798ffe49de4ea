"""Where the config stops (docs/architecture.md, "The edge"): the modules of ``train/`` that turn
a config into records (the setup wing) and the commands' entry points take a ``Config``; the
run wing (the steps, their state, the loop, its driver, evaluation, checkpoints) takes the
records they make. Per-host tables are one wrapper: its name for them is the config's, the
wrapper's and the edge's alone."""

import ast
import io
import re
import tokenize
from pathlib import Path

import dlrm_jax

ROOT = Path(dlrm_jax.__file__).parent
TRAIN = ROOT / "train"

# train/'s wings. setup: config -> records; entry: a command's or the Python API's way in,
# reading a (saved) config; run: what the records drive.
SETUP = {"wiring", "optimizer_setup", "build", "planning", "checks", "hot_setup", "rundir", "restore"}
ENTRY = {"trainer", "export", "saved_run", "serving_export", "serving_rules"}
RUN = {"step", "spec", "state", "loop", "driver", "evaluate", "checkpoint", "progress", "display", "watch"}
RUN |= {
    "tier_runner",
    "release",
    "state_digest",
    "saved_array",
    "checkpoint_leases",
    "checkpoint_reader",
    "orbax_quiet",
    "library_log",
    "stop_signals",
}


def test_every_module_of_train_is_in_one_wing():
    modules = {p.stem for p in TRAIN.glob("*.py")} - {"__init__"}
    assert modules == SETUP | ENTRY | RUN, modules ^ (SETUP | ENTRY | RUN)
    assert not (SETUP & ENTRY or SETUP & RUN or ENTRY & RUN)


def takes_a_config(path: Path) -> list[str]:
    """Where a module imports ``Config`` or has a parameter named ``cfg`` or typed ``Config``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module in ("dlrm_jax.config", "dlrm_jax.config_schema"):
            found += [f"imports {a.name}" for a in node.names if a.name == "Config"]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in node.args.args + node.args.kwonlyargs:
                typed = arg.annotation is not None and ast.unparse(arg.annotation) == "Config"
                if arg.arg == "cfg" or typed:
                    found.append(f"{node.name}({arg.arg})")
    return found


def test_the_run_wing_takes_no_config():
    found = {name: takes_a_config(TRAIN / f"{name}.py") for name in sorted(RUN)}
    assert not any(found.values()), {k: v for k, v in found.items() if v}
    assert takes_a_config(TRAIN / "wiring.py")  # the check sees what it looks for


PER_HOST_NAMES = re.compile(r"per_host|replicas|PER_HOST|HOST_REPLICAS")
PER_HOST_ALLOWED = {
    "choices.py",  # Sync's members
    "config.py",
    "config_checks.py",
    "config_schema/__init__.py",
    "config_schema/embedding.py",
    "embedding/exchange/host_tables.py",  # the wrapper
    *(f"train/{name}.py" for name in SETUP),
}


def per_host_names(path: Path) -> set[str]:
    """Identifiers (not prose: comments and strings are not tokens of this kind) that name
    per-host tables; ``devices_per_host`` is the cluster's host size, another thing."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {
        t.string
        for t in tokens
        if t.type == tokenize.NAME and PER_HOST_NAMES.search(t.string) and t.string != "devices_per_host"
    }


def test_per_host_tables_are_named_by_the_wrapper_the_config_and_the_edge_alone():
    named = {str(p.relative_to(ROOT)): per_host_names(p) for p in ROOT.rglob("*.py")}
    outside = {f: n for f, n in named.items() if n and f not in PER_HOST_ALLOWED and not f.startswith("cli/")}
    assert not outside, outside
    assert named["embedding/exchange/host_tables.py"]
