"""The exchange forms' one interface and their registry.

An exchange part (``plan/part_kinds.py``: a group's pieces that one kind serves) runs in the
jitted step as a form: :class:`ExchangeForm` says what each implements, and :data:`FORMS` builds
the form of each part from its kind's name. The collection asks nothing else of a form, so a new
form is a module implementing the protocol, a builder row here, and its kind's byte model in
``PART_KINDS`` (docs/sharding.md, "Adding a form", lists the steps; a test keeps the two
registries in step and runs a toy form through the collection).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np

from dlrm_jax.embedding.exchange.host_ids import HostIdsForm
from dlrm_jax.embedding.exchange.host_pooled import HostColumnsForm, HostPooledForm
from dlrm_jax.embedding.exchange.optimizers import SparseOptimizer
from dlrm_jax.embedding.exchange.pooled import PooledForm
from dlrm_jax.embedding.exchange.replicated import ReplicatedForm
from dlrm_jax.embedding.exchange.sharded import IdsForm
from dlrm_jax.embedding.exchange.wire import Wire
from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan, ExchangeKind
from dlrm_jax.embedding.plan.layout import (
    ExchangePart,
    Group,
    group_capacity,
    pools_by_mean,
    two_level_capacities,
    two_level_ids,
)
from dlrm_jax.parallel.mesh import HOST_AXIS


class ExchangeForm(Protocol):
    """What every exchange form implements, inside the jitted step (B: the global batch, V':
    the part's features, W: its group's width; arrays batch-sharded over the mesh).

    ``group``: the part's group (its fused array's name in the state, rows, virtual tables);
    ``cols``: int [V' * W], the columns of the collection's flattened [B, F * D] output that the
    form's output fills, in its output's order. ``reads_any_float`` (optional, False): ``update``
    takes the gradient in the dtype the model read the vectors in (bfloat16), as it comes, and
    gives the bits it would give its float32 copy; otherwise it is given float32.
    """

    group: Group
    cols: np.ndarray

    def forward(self, table: jax.Array, ids_bs: jax.Array, weights_bs: jax.Array) -> tuple[jax.Array, Any, jax.Array]:
        """The group's array, the batch's ids int32 [B, S] (PAD_ID for an empty slot; hot ids
        already taken out) and each slot's pooling weight float32 [B, S] -> (pooled float32
        [B, V' * W], the residual ``update`` needs, int32 [] 1 when the exchange ran in rounds)."""
        ...

    def update(
        self, table: jax.Array, slots: dict[str, jax.Array], residual: Any, grad: jax.Array, lr: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The sparse update of the looked-up rows and their optimizer state from the gradient
        [B, V' * W] w.r.t. ``forward``'s output (float32 unless ``reads_any_float``)."""
        ...


class FormRequest(NamedTuple):
    """What a builder gets: the plan and the part, the mesh the exchange runs over (one host's,
    with per-host tables), the wire format, the sparse optimizer, the tables' width, and
    ``agree_over``: the mesh axis along which copies of the tables are kept equal (None when
    none)."""

    plan: EmbeddingPlan
    part: ExchangePart
    mesh: jax.sharding.Mesh
    wire: Wire
    optimizer: SparseOptimizer
    dim: int
    agree_over: str | None


def _replicated(r: FormRequest) -> ExchangeForm:
    return ReplicatedForm(r.part, r.mesh, r.optimizer, r.agree_over, pools_by_mean(r.plan, r.part.group))


def _pooled(r: FormRequest) -> ExchangeForm:
    return PooledForm(r.plan, r.part, r.mesh, r.wire, r.optimizer, r.dim, r.agree_over)


def _within_hosts(form):
    def build(r: FormRequest) -> ExchangeForm:
        if HOST_AXIS in r.mesh.shape:  # a per-host mesh: each host's tables on its devices already
            raise ValueError(
                "host_row and host_column tables are split within a host: not with embedding.sync=per_host"
            )
        return form(r.plan, r.part, r.mesh, r.wire, r.optimizer, r.dim)

    return build


def _ids(r: FormRequest) -> ExchangeForm:
    plan, g = r.plan, r.part.group
    if r.agree_over is None and two_level_ids(plan, g):
        capacities = (group_capacity(plan, g), *two_level_capacities(plan, g))
        return HostIdsForm(r.part, r.mesh, capacities, r.wire, r.optimizer, r.dim, plan.ids_hosts)
    return IdsForm(r.part, r.mesh, group_capacity(plan, g), r.wire, r.optimizer, r.dim, r.agree_over)


# Keyed by the kind's name in plan/part_kinds.PART_KINDS.
FORMS: dict[str, Callable[[FormRequest], ExchangeForm]] = {
    ExchangeKind.ALLREDUCE: _replicated,
    ExchangeKind.GATHER: _replicated,
    ExchangeKind.POOLED: _pooled,
    ExchangeKind.HOST_POOLED: _within_hosts(HostPooledForm),
    ExchangeKind.HOST_COLUMNS: _within_hosts(HostColumnsForm),
    ExchangeKind.IDS: _ids,
}


def build_form(request: FormRequest) -> ExchangeForm:
    """The form serving ``request.part``, built by its kind's registered builder."""
    kind = request.part.kind
    if kind not in FORMS:
        raise ValueError(f"no exchange form registered for part kind {kind!r}: one of {', '.join(FORMS)}")
    return FORMS[kind](request)
