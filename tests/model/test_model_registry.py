"""Models enter by their registries: ``choices.MODEL_KINDS`` (the config's values) and
``train.wiring.MODELS`` (how each is built). A toy model added here, in this file only, is
accepted by the config and trained end to end."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dlrm_jax.choices import MODEL_KINDS
from dlrm_jax.config import ConfigError
from dlrm_jax.parallel.mesh import make_mesh
from dlrm_jax.train import wiring
from dlrm_jax.train.build import build
from dlrm_jax.train.trainer import train_and_evaluate
from tests.helpers import QUIET, losses, tiny_config


def test_every_model_kind_is_built_by_a_registered_entry():
    assert set(MODEL_KINDS) == set(wiring.MODELS)


class MeanLinear(nnx.Module):
    """logit = w . [dense, mean over features of the pooled vectors] + b."""

    def __init__(self, num_dense: int, dim: int, rngs: nnx.Rngs):
        self.linear = nnx.Linear(num_dense + dim, 1, rngs=rngs)

    def __call__(self, dense_bd, emb_bfd, tensor=None):
        return self.linear(jnp.concatenate([dense_bd, emb_bfd.mean(axis=1)], axis=1))[:, 0]


@pytest.mark.slow
def test_a_toy_model_is_configured_and_trained_from_its_registry_rows(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match="model.kind"):
        tiny_config("model.kind=mean_linear")
    monkeypatch.setitem(MODEL_KINDS, "mean_linear", "a linear model over the dense features and the mean vector")
    monkeypatch.setitem(
        wiring.MODELS,
        "mean_linear",
        wiring.ModelEntry(lambda cfg, rngs: MeanLinear(cfg.data.num_dense, cfg.model.embedding_dim, rngs)),
    )
    cfg = tiny_config("model.kind=mean_linear", "mesh.devices=2")
    train_and_evaluate(cfg, tmp_path, **QUIET)
    seen = losses(tmp_path)
    assert len(seen) == 3 and all(np.isfinite(seen))
    params = build(cfg, make_mesh(2))[1].state_sharding.params  # the toy's parameters, nothing of DLRM's
    assert jax.tree.structure(params) == jax.tree.structure({"linear": {"bias": 0, "kernel": 0}})
