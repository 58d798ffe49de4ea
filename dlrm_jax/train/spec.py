"""What the train and eval steps are built from: a record the edge makes from a config
(``wiring.step_spec``), so nothing below it reads a config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import optax
from flax import nnx

from dlrm_jax.model.wide import WidePart


@dataclass(frozen=True)
class StepSpec:
    """What the steps are built from, made at the edge from a config (``wiring.step_spec``):
    ``dense(rngs)``: the dense model (``wiring.ModelEntry.dense``), ``wide``: a wide part whose
    logits are added (None: none), ``tx`` and ``schedule``: the dense optimizer and its learning
    rate per step, ``emb_lr_scale``: the tables' learning rate over the dense part's, ``seed``:
    of the parameters and the tables, ``batch_size``: the global batch, ``bag_sizes`` and
    ``num_dense``: the batch's shape, ``mlp_parallel`` and ``microbatches``: the dense layers'
    layout over a model group's devices."""

    dense: Callable[[nnx.Rngs], nnx.Module]
    wide: WidePart | None
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    emb_lr_scale: float
    seed: int
    batch_size: int
    bag_sizes: tuple[int, ...]
    num_dense: int
    mlp_parallel: str = "data"
    microbatches: int = 1
