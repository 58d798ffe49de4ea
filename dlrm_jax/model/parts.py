"""Extra sparse parts: a model's trained pieces beside the embedding tables and the dense
model, each with its own tables, optimizer and logits added to the dense model's (Wide&Deep's
wide part, :mod:`dlrm_jax.model.wide`, is one).

A model registers its parts by name (``train.wiring.ModelEntry.parts``); the train state holds
each part's state under that name (``TrainState.parts``), checkpoints keep it at the top level
under the same name, and ``dlrm-jax export`` and the serving artifact name its tables
``<name>_<feature>`` and its dense weights ``<name>_linear``. The steps call nothing else.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax

from dlrm_jax.embedding.exchange.collection import EmbeddingCollection, EmbeddingState, LookupResiduals


class PartInputs(NamedTuple):
    """What the loss differentiates in a part: its pooled lookups [B, F, W] and its dense
    weights (one array: what :meth:`SparsePart.dense_arrays` exports as ``values``)."""

    pooled: jax.Array
    weights: jax.Array


class SparsePart(Protocol):
    """One extra sparse part on one mesh. ``collection``: its tables (whole, on every device or
    as its plan lays them out). The state is any pytree the part defines."""

    collection: EmbeddingCollection
    learning_rate: float  # its tables' optimizer's rate (a row restarted at a weight: FTRL's state follows it)

    def state_sharding(self) -> Any:
        """The state's shardings (a pytree like :meth:`init`'s)."""

    def init(self) -> Any:
        """The fresh state, on the mesh."""

    def lookup(self, state: Any, ids_bs: jax.Array) -> tuple[PartInputs, LookupResiduals]:
        """The batch's pooled lookups and dense weights, and what the update needs."""

    def apply_gradients(self, state: Any, res: LookupResiduals, grads: PartInputs) -> Any:
        """The state after the part's own optimizer step on ``grads`` (of :meth:`lookup`'s inputs)."""

    def logits(self, inputs: PartInputs, dense_bd: jax.Array) -> jax.Array:
        """float32 [B]: what the part adds to the dense model's logits."""

    def tables(self, state: Any) -> EmbeddingState:
        """The part's tables and their optimizer state (exported as ``<name>_<feature>``)."""

    def with_tables(self, state: Any, tables: EmbeddingState) -> Any:
        """``state`` with :meth:`tables` replaced (dynamic tables reset rows given to new ids)."""

    def dense_arrays(self, state: Any) -> dict[str, jax.Array]:
        """The part's dense weights as exported (``<name>_linear/values``) and their optimizer
        state (``<name>_linear/<slot>``): ``{"values": ..., slot: ...}``."""
