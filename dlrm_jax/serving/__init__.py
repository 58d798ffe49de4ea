"""Serving a trained model: ``load(DEST)`` an artifact written by ``dlrm-jax export --serving``
and score samples with it, given ids (``predict``) or raw Criteo lines (``predict_raw``).

Needs only numpy, jax and tensorstore (no flax, optax or orbax): the dense part is a
``jax.export`` function, the tables zarr3 arrays. See docs/serving.md.
"""

from dlrm_jax.serving.artifact import ArtifactError
from dlrm_jax.serving.model import ServingModel, load

__all__ = ["ArtifactError", "ServingModel", "load"]
