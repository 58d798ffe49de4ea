"""The ``model`` section and its wide part: the dense network of each model kind."""

from __future__ import annotations

from dataclasses import dataclass, field

from dlrm_jax.choices import (
    MODEL_KINDS,
    SPARSE_OPTIMIZER_KINDS,
    CrossLayers,
    DotPairs,
    Interaction,
    MlpParallel,
)
from dlrm_jax.config_schema.fields import F32, NONNEG, POS, _bound, _choices, doc


@dataclass(frozen=True)
class WideConfig:
    """Wide&Deep's wide part (`model.kind: wide_deep`; [models](models.md#widedeep))."""

    optimizer: str = field(
        default="ftrl",
        metadata=_choices(*(k.name for k in SPARSE_OPTIMIZER_KINDS.values() if k.wide))
        | doc("the wide part's own optimizer (`ftrl`: FTRL-Proximal)"),
    )
    learning_rate: float = field(default=0.05, metadata=F32 | doc("the wide part's constant learning rate"))
    l1: float = field(default=0.0, metadata=F32 | doc("`ftrl`: L1 strength (exact zeros)"))
    l2: float = field(default=0.0, metadata=F32 | doc("`ftrl`: L2 strength"))


@dataclass(frozen=True)
class ModelConfig:
    # The registry itself is the choices (read when a value is checked): a registered model is valid.
    kind: str = field(
        default="dlrm",
        metadata={"choices": MODEL_KINDS}
        | doc(
            "`dlrm`, or `wide_deep`: Wide&Deep (`model.bottom_mlp: []`, interaction `cat` or `dcn`, plus "
            "a wide linear part; [models](models.md#widedeep))"
        ),
    )
    embedding_dim: int = field(default=16, metadata=POS | doc("width of every embedding vector"))
    bottom_mlp: tuple[int, ...] = field(
        default=(128, 64, 16),
        metadata=_bound(">0", each=True)
        | doc("output widths of the bottom MLP over the dense features; the last must be `embedding_dim` for `dot`"),
    )
    top_mlp: tuple[int, ...] = field(
        default=(256, 128, 1),
        metadata=_bound(">0", each=True) | doc("output widths of the top MLP; the last must be 1"),
    )
    interaction: str = field(
        default="dot",
        metadata=_choices(*Interaction)
        | doc(
            "`dot` (DLRM's pairwise dot products), `cat` (concatenation), `dcn` (DLRM-DCNv2: the "
            "concatenation through a cross network)"
        ),
    )
    dot_pairs: str = field(
        default="auto",
        metadata=_choices(*DotPairs)
        | doc(
            "`dot`: how the pairs' dot products are made; `xla`: each sample's N x N products (a batched "
            "GEMM), then a gather of the pairs; `fused`: Pallas kernels that write the pairs, and their "
            "gradient, with no N x N products in memory (interpreted off GPUs, for tests; not with "
            "`model.mlp_parallel=pipeline`); `auto`: `xla` (the kernels are not yet measured on a GPU) "
            "([models](models.md#the-dot-interactions-pairs))"
        ),
    )
    cross_layers: str = field(
        default="auto",
        metadata=_choices(*CrossLayers)
        | doc(
            "`dcn` with `dcn_rank` > 0: how each cross layer's second product and its elementwise work run; "
            "`xla`: XLA's GEMM writes the product, a fusion reads it back beside x0 and x; `fused`: one "
            "Pallas kernel does both, each tile's product never written (interpreted off GPUs, for tests; "
            "not with `model.mlp_parallel=tensor` or `pipeline`, whose layers stay XLA's); `auto`: `xla` (the "
            "kernel is not yet measured on a GPU) ([models](models.md#the-cross-layers-products-and-their-elementwise-work))"
        ),
    )
    dcn_layers: int = field(default=3, metadata=POS | doc("`dcn`: cross layers"))
    dcn_rank: int = field(
        default=0, metadata=NONNEG | doc("`dcn`: rank r of each cross layer's weight U V; 0 = full width x width")
    )
    wide: WideConfig = WideConfig()
    mlp_parallel: str = field(
        default="data",
        metadata=_choices(*MlpParallel)
        | doc(
            "how the dense layers use a model group's `mesh.model` devices: `data` (each holds all), "
            "`tensor` (Megatron pairs), `pipeline` (GPipe stages) ([models](models.md#mlp-parallelism))"
        ),
    )
    microbatches: int = field(
        default=4, metadata=POS | doc("`pipeline`: microbatches a model group's rows are split into")
    )
