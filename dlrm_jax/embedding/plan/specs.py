"""Embedding tables described as data: what each table is, independent of where it lives."""

from __future__ import annotations

from dataclasses import dataclass

from dlrm_jax.choices import Pooling  # noqa: F401 - defined once there


@dataclass(frozen=True)
class TableSpec:
    """One embedding table read by one categorical feature.

    rows: number of ids; dim: vector width; bag_size: maximum ids per sample (1 = one-hot);
    pooling: how a bag's vectors combine into the feature's one vector (``"sum"`` or ``"mean"``).
    """

    name: str
    rows: int
    dim: int
    bag_size: int = 1
    pooling: Pooling = Pooling.SUM

    def __post_init__(self):
        try:
            object.__setattr__(self, "pooling", Pooling(self.pooling))
        except ValueError:
            raise ValueError(
                f"table {self.name}: pooling {self.pooling!r} must be one of {', '.join(p.value for p in Pooling)}"
            ) from None
        for field in ("rows", "dim", "bag_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"table {self.name}: {field}={getattr(self, field)} must be at least 1")
