"""What the tests share: the tiny config, quiet logging, a run's losses, hypothesis example
counts, the checkout's paths. ``from tests.helpers import ...``, in the tests and in the scripts
they run as child processes. Imports no JAX: conftest sets the XLA flags before JAX loads."""

import json
import os

from dlrm_jax.config import load_config
from tests.child_env import REPO

TESTS = REPO / "tests"  # tests/ mirrors the package's folders

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


QUIET = dict(log=lambda *_: None)  # train_and_evaluate & co. without their progress lines


def losses(run_dir) -> list[float]:
    """Every metrics.jsonl event's loss, in order."""
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# Hypothesis: HYPOTHESIS_PROFILE=fast (a quarter of the examples: the inner loop), default, or
# thorough (5x: a longer search before a release). Tests give their example counts through
# examples(), which the profile scales; conftest registers the profiles and refuses others.
EXAMPLE_SCALE = {"fast": 0.25, "default": 1.0, "thorough": 5.0}
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "default")


def examples(n: int) -> int:
    """``n`` hypothesis examples, scaled by the profile (at least 2)."""
    return max(2, round(n * EXAMPLE_SCALE[PROFILE]))
