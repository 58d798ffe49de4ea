"""Eight simulated CPU devices for every test; must run before JAX is imported."""

import os
import sys
from pathlib import Path

from child_env import COMPILE_FLAGS  # noqa: E402 - (tests/ is on sys.path)

TESTS = Path(__file__).resolve().parent  # tests/ mirrors the package's folders
REPO = TESTS.parent
# Test modules import each other's helpers by module name (test_embedding's reference check,
# test_tiered's configs) across folders: every folder of tests/ is importable.
sys.path[1:1] = [str(d) for d in sorted(TESTS.iterdir()) if d.is_dir() and d.name.isidentifier()]

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {COMPILE_FLAGS}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No XLA persistent compilation cache: with jaxlib 0.10.2, loading some cached CPU executables
# kills the process ("Fatal Python error" in test_hot_rows with a warm cache, none with an empty one).

import json  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from dlrm_jax.config import load_config  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def _compile_identical_programs_once():
    """Tests build the same programs many times (every run, resume and restore makes new
    closures, so jit's own caches miss) and compiling is most of the suite's time. XLA's
    persistent cache would dedupe them but crashes on load in jaxlib 0.10.2 (above), so this
    process keeps each loaded executable by what the persistent cache keys on: the program's
    bytecode (debug info stripped), its compile options and its devices. Programs with host
    callbacks are always compiled."""
    import io
    from collections import OrderedDict

    from jax._src import compiler
    from jax._src.lib.mlir import passmanager

    compile_and_load = compiler.backend_compile_and_load
    executables: OrderedDict = OrderedDict()

    def program_key(module, devices, options) -> tuple:
        with module.context:
            bare = module.operation.clone()
            passmanager.PassManager.parse("builtin.module(strip-debuginfo)").run(bare)
        code = io.BytesIO()
        bare.write_bytecode(file=code)
        return code.getvalue(), options.SerializeAsString(), tuple(d.id for d in devices)

    def compile_once(backend, module, executable_devices, options, host_callbacks):
        if host_callbacks:
            return compile_and_load(backend, module, executable_devices, options, host_callbacks)
        key = (id(backend), *program_key(module, executable_devices, options))
        if key not in executables:
            executables[key] = compile_and_load(backend, module, executable_devices, options, host_callbacks)
            if len(executables) > 512:
                executables.popitem(last=False)
        executables.move_to_end(key)
        return executables[key]

    compiler.backend_compile_and_load = compile_once


# The memo patches a private JAX function: only on the JAX it was written against, and never with
# DLRM_TEST_COMPILE_MEMO=0 (compare a run without it when a test behaves oddly).
_MEMO_JAX = ("0.10.",)
if os.environ.get("DLRM_TEST_COMPILE_MEMO", "1") != "0" and jax.__version__.startswith(_MEMO_JAX):
    _compile_identical_programs_once()


TINY = [  # tiny_config's settings, as --set arguments take them (a CLI child's)
    "train.batch_size=64",
    "train.steps=6",
    "train.log_every=2",
    "train.eval_every=0",
    "train.eval_batches=2",
    "train.checkpoint_every=0",
    "train.progress_bar=false",
    "data.cardinalities=[300, 40, 1000, 7]",
    "data.max_rows=0",
    "model.embedding_dim=8",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
]


def tiny_config(*overrides: str):
    """A small config that compiles and runs in about a second."""
    return load_config(None, [*TINY, *overrides])


@pytest.fixture
def tiny():
    return tiny_config


# ---------------------------------------------------------------- shared by the tests

QUIET = dict(log=lambda *_: None)  # train_and_evaluate & co. without their progress lines


def losses(run_dir) -> list[float]:
    """Every metrics.jsonl event's loss, in order."""
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# Hypothesis: HYPOTHESIS_PROFILE=fast (a quarter of the examples: the inner loop), default, or
# thorough (5x: a longer search before a release). Tests give their example counts through
# examples(), which the profile scales; no deadline (first calls compile).
_EXAMPLE_SCALE = {"fast": 0.25, "default": 1.0, "thorough": 5.0}
settings.register_profile("default", deadline=None)
settings.register_profile("fast", deadline=None)
settings.register_profile("thorough", deadline=None)
_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "default")
if _PROFILE not in _EXAMPLE_SCALE:
    raise pytest.UsageError(f"HYPOTHESIS_PROFILE={_PROFILE}: one of {', '.join(_EXAMPLE_SCALE)}")
settings.load_profile(_PROFILE)


def examples(n: int) -> int:
    """``n`` hypothesis examples, scaled by the profile (at least 2)."""
    return max(2, round(n * _EXAMPLE_SCALE[_PROFILE]))


def pytest_collection_modifyitems(items):
    """The 4- and 8-device columns of a battery parametrized over ``devices`` are slow: the fast
    lane (``pytest -m "not slow"``) keeps its 1 and 2 devices, sharded all the same."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("devices", 0) >= 4:
            item.add_marker(pytest.mark.slow)
