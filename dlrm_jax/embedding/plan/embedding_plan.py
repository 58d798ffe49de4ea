"""Sharding plans: where every table lives, as JSON-able data.

The exchange code reads a plan, never the config. A plan holds, per table, its strategy and the
devices holding a part of it. :mod:`~dlrm_jax.embedding.plan.layout` derives the fused arrays from
it, :mod:`~dlrm_jax.embedding.plan.stats` the bytes and the printed report, and
:mod:`~dlrm_jax.embedding.plan.planner` makes plans.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import asdict, dataclass, replace

import numpy as np

from dlrm_jax.choices import SPARSE_OPTIMIZER_KINDS, RowLayout, Strategy  # noqa: F401 - defined once there
from dlrm_jax.embedding.plan.specs import Pooling, TableSpec


class PlanError(ValueError):
    """A plan that cannot be made: the message names the table and the limit."""


class ExchangeKind(enum.StrEnum):
    """How the looked-up vectors of a part of the tables travel (``exchange/`` has each form)."""

    ALLREDUCE = "allreduce"  # replicated: local lookups, the gradient all-reduced as [rows, W]
    GATHER = "gather"  # replicated: local lookups, every device's rows and gradients all-gathered
    IDS = "ids"  # sharded: distinct rows go to the requester, which pools (buckets of capacity C)
    POOLED = "pooled"  # sharded on fixed owners: every bag goes to its owner, which pools it
    # rows of one host (HOST_ROW tables with POOLED exchange): every bag goes to its host, whose
    # devices pool their rows of it and add the partial sums within the host
    HOST_POOLED = "host_pooled"
    # columns of one host (HOST_COLUMN tables with POOLED exchange): every bag goes to its host,
    # whose devices pool their columns of it; the slices meet within the host
    HOST_COLUMNS = "host_columns"


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float8": 1}  # float8: the exchange only


def vector_bytes(exchange_dtype: str, width: int) -> int:
    """Bytes of one W-wide vector or gradient on the wire (float8 adds its float32 scale)."""
    return width * DTYPE_BYTES[exchange_dtype] + (4 if exchange_dtype == "float8" else 0)


def optimizer_bytes_per_row(optimizer: str, dim: int) -> int:
    """Optimizer state per table row of width ``dim`` (``choices.SPARSE_OPTIMIZER_KINDS``)."""
    return SPARSE_OPTIMIZER_KINDS[optimizer].state_bytes_per_row(dim)


@dataclass(frozen=True)
class TablePlan:
    """One table's placement.

    devices: REPLICATED and ROW, every device; TABLE, the one owner; COLUMN, the owner of each
    column slice in slice order (so ``len(devices)`` slices of ``dim / len(devices)`` columns);
    HOST_ROW, the devices of one host in order, each a block of ``ceil(rows / len(devices))``;
    HOST_COLUMN, the devices of one host in order, each a column slice.
    """

    spec: TableSpec
    strategy: Strategy
    devices: tuple[int, ...]
    row_layout: RowLayout = RowLayout.BLOCK
    # Tiered storage: the table lives in the host tier and each owner's devices hold this many
    # cache slots of its part (rows of its block; of the whole table for table/column-wise);
    # 0 = the whole table lives on its devices.
    cache_rows: int = 0
    # TABLE, COLUMN and HOST_ROW: POOLED (the owners pool each bag) or IDS (distinct rows
    # travel, the requester pools); ROW is always IDS; REPLICATED looks up locally (unused).
    exchange: ExchangeKind = ExchangeKind.IDS

    @property
    def tiered(self) -> bool:
        return self.cache_rows > 0

    @property
    def column_slices(self) -> int:
        return len(self.devices) if self.strategy in (Strategy.COLUMN, Strategy.HOST_COLUMN) else 1

    @property
    def slice_dim(self) -> int:
        return self.spec.dim // self.column_slices

    def rows_per_device(self, num_devices: int) -> int:
        """Rows a device holding a part of this table keeps (row-wise: the padded block)."""
        if self.tiered:
            return self.cache_rows
        if self.strategy == Strategy.ROW:
            return math.ceil(self.spec.rows / num_devices)
        if self.strategy == Strategy.HOST_ROW:
            return math.ceil(self.spec.rows / len(self.devices))
        return self.spec.rows

    def spaces(self, num_devices: int) -> int:
        """Independent sets of cache slots of a tiered table: one per owner of a row-wise
        table (each caches rows of its own block), one otherwise (column slices cache the
        same rows, each its own columns)."""
        return num_devices if self.strategy == Strategy.ROW else 1

    def bytes_on_device(self, num_devices: int, optimizer: str, dtype: str) -> np.ndarray:
        """Parameter and optimizer-state bytes this table puts on each device: int64 [N, 2]."""
        out = np.zeros((num_devices, 2), np.int64)
        rows = self.rows_per_device(num_devices)
        per_slice = rows * self.slice_dim
        for d in self.devices:
            out[d, 0] += per_slice * DTYPE_BYTES[dtype]
            out[d, 1] += rows * optimizer_bytes_per_row(optimizer, self.slice_dim)
        return out


@dataclass(frozen=True)
class HotPlan:
    """Hot-row replication: ``rows`` (the capacity, fixed at compile time) rows of any tables
    live on every device with their optimizer state; which rows is training state (a refresh
    changes it, never the capacity).

    per_table: how many of the first chosen rows each table got; hit_rate: the share of
    lookups they took in the statistics batches, over all tables and per table
    (``table_hit_rates``); no_hot_capacities: the bucket capacities measured without
    replication, to report what it saves.
    """

    rows: int
    per_table: tuple[int, ...] = ()
    hit_rate: float = 0.0
    no_hot_capacities: tuple[tuple[str, int], ...] = ()
    table_hit_rates: tuple[float, ...] = ()


@dataclass(frozen=True)
class TierPlan:
    """Tiered storage settings the host side runs with (the device caches' sizes are each
    table's ``TablePlan.cache_rows``).

    host_rows: per table, rows of its host DRAM cache (0 for device-resident tables);
    policy: the DRAM cache's eviction policy (``lru`` | ``lfu`` | ``tinylfu``: LRU behind a
    frequency admission filter); lookahead: batches the
    planner works ahead; fill_rows: per sharded group, the rows one step may fill on one
    device (more run in extra fill rounds); device_hit_rates / host_hit_rates: per table,
    the predicted share of lookups each cache serves (from the id statistics).
    """

    host_rows: tuple[int, ...]
    policy: str = "lru"
    lookahead: int = 2
    fill_rows: tuple[tuple[str, int], ...] = ()
    device_hit_rates: tuple[float, ...] = ()
    host_hit_rates: tuple[float, ...] = ()

    def fill_capacity(self, group: str) -> int:
        return dict(self.fill_rows).get(group, 0)


@dataclass(frozen=True)
class EmbeddingPlan:
    """Every table's placement, and the exchange settings the step is compiled with."""

    tables: tuple[TablePlan, ...]
    num_devices: int
    optimizer: str
    global_batch: int
    capacity_factor: float = 1.25
    dtype: str = "float32"  # table storage
    exchange_dtype: str = "float32"  # vectors and gradients on the wire
    # Measured bucket capacities of the ids exchange per sharded group: (group name, distinct
    # requests one device may send one owner). Groups not listed get capacity_factor x the
    # batch-size bound.
    capacities: tuple[tuple[str, int], ...] = ()
    hot: HotPlan | None = None
    tier: TierPlan | None = None
    # Hosts the ids exchange goes over in two levels (exchange/host_ids.py: a host's requests
    # merged before they cross hosts); 1: one level, every device to every owner.
    ids_hosts: int = 1
    # Large shards' rows padded for chunked checkpoints (layout.storage_rows); False in plans
    # saved before the padding, so their checkpoints restore with the arrays they hold.
    padded_rows: bool = True

    @property
    def local_batch(self) -> int:
        """Samples of one step on one device: the exchange's buffers are sized for them."""
        return self.global_batch // self.num_devices

    @property
    def tiered_tables(self) -> tuple[int, ...]:
        """Indices of the tables kept in the host tier."""
        return tuple(t for t, tp in enumerate(self.tables) if tp.tiered)

    def device_view(self) -> EmbeddingPlan:
        """The plan the devices run: each tiered table replaced by its device caches, a
        table of cache slots routed like the original (row-wise: ``cache_rows`` per owner,
        same layout), so cache ids reach the owner of the logical row they stand for."""
        tables = []
        for tp in self.tables:
            if tp.tiered:
                rows = tp.cache_rows * (self.num_devices if tp.strategy == Strategy.ROW else 1)
                tp = replace(tp, spec=replace(tp.spec, rows=rows), cache_rows=0)
            tables.append(tp)
        return replace(self, tables=tuple(tables))

    @property
    def hot_rows(self) -> int:
        """Capacity of the replicated hot group (0: no hot-row replication)."""
        return self.hot.rows if self.hot else 0

    def hot_bytes_per_device(self) -> tuple[int, int]:
        """(parameter, optimizer-state) bytes the hot group puts on every device."""
        dim = self.tables[0].spec.dim
        return (
            self.hot_rows * dim * DTYPE_BYTES[self.dtype],
            self.hot_rows * optimizer_bytes_per_row(self.optimizer, dim),
        )

    # ------------------------------------------------------------ data round trip
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> EmbeddingPlan:
        raw = json.loads(text)
        tables = tuple(
            TablePlan(
                TableSpec(**{**t["spec"], "pooling": Pooling(t["spec"]["pooling"])}),
                Strategy(t["strategy"]),
                tuple(t["devices"]),
                RowLayout(t["row_layout"]),
                int(t.get("cache_rows", 0)),
                ExchangeKind(t.get("exchange", "ids")),
            )
            for t in raw.pop("tables")
        )
        raw.pop("bag_exchange", None)  # plans saved before it became each table's exchange
        raw.setdefault("padded_rows", False)  # plans saved before large shards were padded
        raw["capacities"] = _capacities(raw.get("capacities", ()))
        if raw.get("hot") is not None:
            hot = raw["hot"]
            raw["hot"] = HotPlan(
                int(hot["rows"]),
                tuple(hot["per_table"]),
                float(hot["hit_rate"]),
                _capacities(hot["no_hot_capacities"]),
                tuple(hot["table_hit_rates"]),
            )
        if raw.get("tier") is not None:
            tier = raw["tier"]
            raw["tier"] = TierPlan(
                tuple(tier["host_rows"]),
                tier["policy"],
                int(tier["lookahead"]),
                tuple((str(g), int(r)) for g, r in tier["fill_rows"]),
                tuple(tier["device_hit_rates"]),
                tuple(tier["host_hit_rates"]),
            )
        return cls(tables, **raw)


def _capacities(raw) -> tuple[tuple[str, int], ...]:
    """(group, capacity) pairs; plans saved before the pooled form lost its own capacity
    listed (group, capacity, all-request capacity)."""
    return tuple((str(k), int(a)) for k, a, *_ in raw)
