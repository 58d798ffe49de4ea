"""What the train and eval steps are built from: a record the edge makes from a config
(``wiring.step_spec``), so nothing below it reads a config."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import optax
from flax import nnx

from dlrm_jax.choices import NewRows
from dlrm_jax.embedding.dynamic.idmap import MapSpec
from dlrm_jax.model.parts import SparsePart


@dataclass(frozen=True)
class StepSpec:
    """What the steps are built from, made at the edge from a config (``wiring.step_spec``):
    ``dense(rngs)``: the dense model (``wiring.ModelEntry.dense``), ``parts``: extra sparse
    parts by name whose logits are added (``wiring.ModelEntry.parts``; Wide&Deep's ``wide``), ``tx`` and ``schedule``: the dense optimizer and its learning
    rate per step, ``emb_lr_scale``: the tables' learning rate over the dense part's, ``seed``:
    of the parameters and the tables, ``batch_size``: the global batch, ``bag_sizes`` and
    ``num_dense``: the batch's shape, ``mlp_parallel`` and ``microbatches``: the dense layers'
    layout over a model group's devices, ``maps``: {table index: its id map} of the tables
    taking raw ids (``wiring.dynamic_maps``; embedding/dynamic), ``new_rows``: what their rows
    given to new ids start from (``embedding.dynamic.new_rows``)."""

    dense: Callable[[nnx.Rngs], nnx.Module]
    parts: Mapping[str, SparsePart]
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    emb_lr_scale: float
    seed: int
    batch_size: int
    bag_sizes: tuple[int, ...]
    num_dense: int
    mlp_parallel: str = "data"
    microbatches: int = 1
    maps: Mapping[int, MapSpec] = field(default_factory=dict)
    new_rows: str = NewRows.SHARED

    def __post_init__(self):
        taken = set(self.parts) & {*CORE_FIELDS, MAPS}
        if taken:
            raise ValueError(f"a sparse part may not be named {sorted(taken)[0]!r}: the train state's own field")


# The train state's own fields; checkpoints hold the parts beside them, by name, and the
# dynamic tables' id maps under MAPS when there are any (train/state.py).
CORE_FIELDS = ("step", "params", "opt_state", "emb")
MAPS = "maps"
