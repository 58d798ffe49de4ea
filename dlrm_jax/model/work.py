"""What the dense part is made of, by arithmetic on the model section alone (no JAX): the interaction's
width, and the FLOPs and parameters the step-time model prices (``embedding.plan.cost``)."""

from __future__ import annotations

from dlrm_jax.choices import Interaction
from dlrm_jax.config_schema import ModelConfig
from dlrm_jax.embedding.plan.cost import DenseWork

KINDS = tuple(Interaction)


def interaction_width(kind: str, num_features: int, dim: int, bottom_width: int | None = None) -> int:
    """Width of the interaction output for F embedding features of width D after a bottom
    output of ``bottom_width`` (default D; dot needs D)."""
    bottom_width = dim if bottom_width is None else bottom_width
    if kind == "dot":
        return bottom_width + (num_features + 1) * num_features // 2
    if kind in ("cat", "dcn"):  # the cross network keeps its input's width
        return bottom_width + dim * num_features
    raise ValueError(f"unknown interaction {kind!r}; allowed: {', '.join(KINDS)}")


def _mlp(widths: list[int]) -> tuple[int, int]:
    """(multiply-adds per sample, parameters) of linear layers through ``widths``."""
    pairs = list(zip(widths[:-1], widths[1:], strict=True))
    return sum(a * b for a, b in pairs), sum(a * b + b for a, b in pairs)


def dense_work(m: ModelConfig, num_dense: int, f: int, compute_dtype: str) -> DenseWork:
    """The dense part's matmul FLOPs per sample (forward and backward: 3 x 2 x the multiply-
    adds), its parameters, whether it computes in bfloat16, and its linear layers (the dot
    interaction and a low-rank cross layer's two products each one), for model section ``m`` over
    ``num_dense`` dense and ``f`` categorical features."""
    d = m.embedding_dim
    bottom = list(m.bottom_mlp)
    macs, params = _mlp([num_dense, *bottom]) if bottom else (0, 0)
    width = interaction_width(m.interaction, f, d, bottom[-1] if bottom else num_dense)
    if m.interaction == "dot":
        macs += (f + 1) * (f + 1) * d // 2
    if m.interaction == "dcn":
        per_layer = 2 * width * m.dcn_rank if m.dcn_rank else width * width
        macs += m.dcn_layers * per_layer
        params += m.dcn_layers * (per_layer + width)
    top_macs, top_params = _mlp([width, *m.top_mlp])
    layers = len(bottom) + len(m.top_mlp) + (m.interaction == "dot")
    if m.interaction == "dcn":
        layers += m.dcn_layers * (2 if m.dcn_rank else 1)
    return DenseWork(6.0 * (macs + top_macs), params + top_params, compute_dtype == "bfloat16", layers)
