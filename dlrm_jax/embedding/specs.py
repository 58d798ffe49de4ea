"""Embedding tables described as data: what each table is, independent of where it lives."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from dlrm_jax.data.batch import PAD_ID


class Pooling(enum.StrEnum):
    SUM = "sum"
    MEAN = "mean"


@dataclass(frozen=True)
class TableSpec:
    """One embedding table read by one categorical feature.

    rows: number of ids; dim: vector width; bag_size: maximum ids per sample (1 = one-hot);
    pooling: how a bag's vectors combine into the feature's one vector.
    """

    name: str
    rows: int
    dim: int
    bag_size: int = 1
    pooling: Pooling = Pooling.SUM

    @property
    def bytes_f32(self) -> int:
        return self.rows * self.dim * 4


def specs_from_config(cfg) -> tuple[TableSpec, ...]:
    """One table per categorical feature, named ``cat_<feature>``, rows capped by data.max_rows."""
    return tuple(
        TableSpec(f"cat_{f}", rows, cfg.model.embedding_dim, bag, Pooling(cfg.data.pooling))
        for f, (rows, bag) in enumerate(zip(cfg.table_rows, cfg.bag_sizes, strict=True))
    )


@dataclass(frozen=True)
class SlotLayout:
    """Where each id slot of a batch's ``ids`` [B, S] points, for tables fused into one array.

    slot_feature: int32 [S]  feature (= table) of each slot
    slot_offset:  int32 [S]  first row of that table inside the fused array
    table_offset: int64 [T]  first fused row of each table; total_rows = fused array height
    """

    slot_feature: np.ndarray
    slot_offset: np.ndarray
    table_offset: np.ndarray
    total_rows: int
    one_hot: bool

    @classmethod
    def build(cls, specs: tuple[TableSpec, ...]) -> SlotLayout:
        rows = np.array([s.rows for s in specs], np.int64)
        table_offset = np.concatenate([[0], np.cumsum(rows)[:-1]])
        slot_feature = np.repeat(np.arange(len(specs)), [s.bag_size for s in specs])
        total = int(rows.sum())
        if total >= np.iinfo(np.int32).max:
            raise ValueError(f"{total} fused rows exceed int32 ids; split the tables into groups")
        return cls(slot_feature.astype(np.int32), table_offset[slot_feature].astype(np.int32),
                   table_offset, total, all(s.bag_size == 1 for s in specs))

    def fused_rows(self, ids_bs):
        """Table-local ids [B, S] -> fused row ids [B, S]; padding -> total_rows (out of range)."""
        import jax.numpy as jnp

        return jnp.where(ids_bs == PAD_ID, self.total_rows, ids_bs + self.slot_offset)
