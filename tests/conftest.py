"""Eight simulated CPU devices for every test; must run before JAX is imported. Also the compile
memo, the ``tiny`` fixture, the hypothesis profiles and the slow marks; what tests import is in
tests/helpers.py (tests/ is a package: ``from tests.helpers import ...``)."""

import gc
import os
from collections import OrderedDict
from pathlib import Path

from tests.child_env import COMPILE_FLAGS  # the standard library only: no JAX yet

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {COMPILE_FLAGS}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No XLA persistent compilation cache: with jaxlib 0.10.2, loading some cached CPU executables
# kills the process ("Fatal Python error" in test_hot_rows with a warm cache, none with an empty one).

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from tests.helpers import EXAMPLE_SCALE, PROFILE, tiny_config  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


_EXECUTABLES: OrderedDict = OrderedDict()  # the compile memo's loaded executables, oldest first


def _compile_identical_programs_once():
    """Tests build the same programs many times (every run, resume and restore makes new
    closures, so jit's own caches miss) and compiling is most of the suite's time. XLA's
    persistent cache would dedupe them but crashes on load in jaxlib 0.10.2 (above), so this
    process keeps each loaded executable by what the persistent cache keys on: the program's
    bytecode (debug info stripped), its compile options and its devices. Programs with host
    callbacks are always compiled."""
    import io

    from jax._src import compiler
    from jax._src.lib.mlir import passmanager

    compile_and_load = compiler.backend_compile_and_load
    executables = _EXECUTABLES

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


def _mapping_count() -> int:
    """This process's memory mappings (0 where /proc does not say)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def _max_map_count() -> int:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 65530  # Linux's default


# A loaded XLA:CPU executable keeps its JIT code in memory mappings of its own: 190 for a tiny
# 2-device train step, 620 for an 8-device dynamic one. A worker that had run ~700 tests reached
# Linux's vm.max_map_count (65,530; its core had 65,531 segments) with the memo's and jit's
# caches holding them, and died in its next compile (SIGSEGV or SIGABRT in
# backend_compile_and_load). Past half the limit, both caches are dropped between tests.
_MAPPINGS_HIGH = _max_map_count() // 2


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if _mapping_count() > _MAPPINGS_HIGH:
        _EXECUTABLES.clear()
        jax.clear_caches()
        gc.collect()


@pytest.fixture
def tiny():
    return tiny_config


@pytest.fixture(scope="session", autouse=True)
def _temp_folder_pytest_prunes(tmp_path_factory):
    """What the code and its child processes leave in the temp folder (a launch's logs after a
    stop, traces, benchmark scratch) goes under pytest's own base folder, which pytest prunes
    (its last three runs), not into /tmp for good: 54 launch folders had piled up there."""
    import tempfile

    where = tmp_path_factory.mktemp("tmp", numbered=False)
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(where)  # (children inherit it)
    tempfile.tempdir = None  # (this process's choice, made again from TMPDIR)
    yield
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old
    tempfile.tempdir = None


# Hypothesis profiles (tests/helpers.py: which one, and examples() that it scales): no deadline,
# as first calls compile.
for _name in EXAMPLE_SCALE:
    settings.register_profile(_name, deadline=None)
if PROFILE not in EXAMPLE_SCALE:
    raise pytest.UsageError(f"HYPOTHESIS_PROFILE={PROFILE}: one of {', '.join(EXAMPLE_SCALE)}")
settings.load_profile(PROFILE)


# The tests a full run measured at 3 s or more (scripts/suite_durations.py --slow-list writes it).
MEASURED_SLOW = Path(__file__).with_name("measured_slow.txt")


def measured_slow() -> frozenset[str]:
    if not MEASURED_SLOW.is_file():
        return frozenset()
    lines = MEASURED_SLOW.read_text(encoding="utf-8").splitlines()
    return frozenset(line for line in lines if line and not line.startswith("#"))


def pytest_collection_modifyitems(items):
    """Slow, so the fast lane (``pytest -m "not slow"``) leaves them out: the 4- and 8-device
    columns of a battery parametrized over ``devices`` (the lane keeps its 1 and 2 devices,
    sharded all the same), and the tests the last full run measured at 3 s or more."""
    slow = measured_slow()
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("devices", 0) >= 4 or item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
