"""The configuration's schema: one frozen dataclass per section, whose defaults *are* the
embedded default configuration (``configs/default.yaml`` spells them out; a test keeps the
two identical). Field metadata lists the words a key takes; :mod:`dlrm_jax.config` loads,
coerces and checks values against it.

Each section has a module of its own here; this one holds the whole and re-exports the rest.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dlrm_jax.choices import Ids, Storage
from dlrm_jax.config_schema.data import CRITEO_KAGGLE_CARDINALITIES, DataConfig
from dlrm_jax.config_schema.embedding import DynamicConfig, EmbeddingConfig, HotConfig, TierConfig
from dlrm_jax.config_schema.fields import CONFIG_DIR, NONNEG, POS, ConfigError, _choices, doc
from dlrm_jax.config_schema.model import ModelConfig, WideConfig
from dlrm_jax.config_schema.train import TrainConfig

__all__ = [
    "AUTO_ROW_CAP",
    "CONFIG_DIR",
    "CRITEO_KAGGLE_CARDINALITIES",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DynamicConfig",
    "EmbeddingConfig",
    "HotConfig",
    "MeshConfig",
    "ModelConfig",
    "TierConfig",
    "TrainConfig",
    "WideConfig",
]

AUTO_ROW_CAP = 20000  # data.max_rows=auto for synthetic data and Criteo text


@dataclass(frozen=True)
class MeshConfig:
    devices: int = field(
        default=0,
        metadata=NONNEG
        | doc("devices in the mesh, over all hosts; 0 = all (8 simulated CPU devices without accelerators)"),
    )
    hosts: int = field(
        default=0,
        metadata=NONNEG
        | doc(
            "hosts of the (`hosts`, `data`, `model`) mesh for per-host tables; 0 = one per process, more "
            "splits each process's devices into simulated hosts"
        ),
    )
    model: int = field(
        default=1,
        metadata=POS | doc("neighbouring devices per model group that share the dense layers (`model.mlp_parallel`)"),
    )


@dataclass(frozen=True)
class ClusterConfig:
    """The machines embedding.sharding=auto prices a plan for (embedding/plan/cost.py has the
    model and the sources of the profiles' numbers); 0 = the profile's value."""

    profile: str = field(
        default="auto",
        metadata=_choices("auto", "h100", "cpu")
        | doc(
            "the machines `embedding.sharding=auto` prices plans for ([the cost "
            "model](sharding.md#the-cost-model)): `h100` (8 GPUs a host, NVLink within, one 400 Gb/s "
            "InfiniBand NIC per GPU between hosts), `cpu` (simulated CPU devices of one host); `auto`: "
            "`cpu` when training on simulated CPU devices, else `h100`"
        ),
    )
    devices_per_host: int = field(
        default=0,
        metadata=NONNEG | doc("devices that share the fast links of one host (0: the profile's: 8 for `h100`)"),
    )
    intra_host_gbps: float = field(
        default=0.0,
        metadata=NONNEG | doc("GB/s each way per device between devices of one host (0: the profile's: 450, NVLink 4)"),
    )
    inter_host_gbps: float = field(
        default=0.0,
        metadata=NONNEG | doc("GB/s each way per device between hosts (0: the profile's: 50, a 400 Gb/s NIC per GPU)"),
    )
    hbm_gbps: float = field(
        default=0.0,
        metadata=NONNEG
        | doc("device memory bandwidth in GB/s, for lookups and updates (0: the profile's: 3350, HBM3)"),
    )
    tflops: float = field(
        default=0.0,
        metadata=NONNEG
        | doc("dense matmul peak in TFLOP/s at bfloat16, half of it at float32 (0: the profile's: 990)"),
    )
    device_memory_gb: float = field(
        default=0.0,
        metadata=NONNEG
        | doc(
            "the planner's memory budget is 90% of it when `embedding.memory_budget_gb` is 0 and the devices "
            "do not report their memory (`plan`, CPU devices) (0: the profile's: 80 for `h100`, none for `cpu`)"
        ),
    )


@dataclass(frozen=True)
class Config:
    """A whole, validated configuration, frozen: build one with ``dlrm_jax.load_config`` (a
    shipped config's name or a YAML file, and ``KEY=VALUE`` overrides) and derive another with
    ``dlrm_jax.with_overrides``; its sections are train, data, model, embedding, mesh and
    cluster, each key documented in docs/configs.md. One changed with ``dataclasses.replace``
    is checked again when it trains."""

    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    embedding: EmbeddingConfig = EmbeddingConfig()
    mesh: MeshConfig = MeshConfig()
    cluster: ClusterConfig = ClusterConfig()

    @property
    def num_features(self) -> int:
        return len(self.data.cardinalities)

    @property
    def table_rows(self) -> tuple[int, ...]:
        """Rows of each feature's table after the ``data.max_rows`` cap."""
        cap = self.row_cap
        return tuple(min(c, cap) if cap else c for c in self.data.cardinalities)

    @property
    def row_cap(self) -> int:
        """``data.max_rows`` as a number (0: no cap): ``auto`` caps synthetic data and Criteo
        text at 20,000 rows a table and leaves a preprocessed dataset its own sizes."""
        cap = self.data.max_rows
        if cap == "auto":
            return 0 if self.data.source == "binary" else AUTO_ROW_CAP
        return cap

    @property
    def bag_sizes(self) -> tuple[int, ...]:
        """Maximum ids per sample for each feature (1 = one-hot)."""
        b = self.data.bag_sizes
        return tuple(b) * self.num_features if len(b) == 1 else tuple(b)

    @property
    def dynamic_tables(self) -> tuple[int, ...]:
        """The features whose tables take raw ids (``embedding.ids``, ``embedding.table_ids``)."""
        return tuple(f for f in range(self.num_features) if self.embedding.ids_of(f"cat_{f}") == Ids.DYNAMIC)

    @property
    def tiered_tables(self) -> tuple[int, ...]:
        """The features whose tables live in the disk tier (``embedding.storage``, ``embedding.table_storage``)."""
        return tuple(f for f in range(self.num_features) if self.embedding.storage_of(f"cat_{f}") == Storage.TIERED)

    @property
    def embedding_learning_rate(self) -> float:
        return self.embedding.learning_rate or self.train.learning_rate

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(dataclasses.asdict(self))


def _to_plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(v) for v in obj]
    return obj
