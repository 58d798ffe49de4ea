"""Eight simulated CPU devices for every test; must run before JAX is imported."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests (and the CLI processes they start, which inherit this) compile the same programs:
# XLA's persistent cache turns the repeats into reads. Compilation is deterministic, so a
# cached program computes bit for bit what a fresh compile would.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "dlrm_jax_tests_xla_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

from dlrm_jax.config import load_config  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def tiny_config(*overrides: str):
    """A small config that compiles and runs in about a second."""
    return load_config(None, [
        "train.batch_size=64", "train.steps=6", "train.log_every=2", "train.eval_every=0",
        "train.eval_batches=2", "train.checkpoint_every=0", "train.progress_bar=false",
        "data.cardinalities=[300, 40, 1000, 7]", "data.max_rows=0",
        "model.embedding_dim=8", "model.bottom_mlp=[16, 8]", "model.top_mlp=[16, 1]",
        *overrides,
    ])


@pytest.fixture
def tiny():
    return tiny_config
