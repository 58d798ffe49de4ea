"""Eight simulated CPU devices for every test; must run before JAX is imported."""

import os

from child_env import COMPILE_FLAGS  # noqa: E402 - (tests/ is on sys.path)

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {COMPILE_FLAGS}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No XLA persistent compilation cache: with jaxlib 0.10.2, loading some cached CPU executables
# kills the process ("Fatal Python error" in test_hot_rows with a warm cache, none with an empty one).

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
