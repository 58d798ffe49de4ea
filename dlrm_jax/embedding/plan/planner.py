"""The planner: chooses a strategy and devices for every table, within a memory budget.

Explicit strategies (``replicated``, ``table``, ``row``, ``column``, ``host_row``,
``host_column``) apply to every table not named in the per-table overrides. ``auto`` decides
per table by the predicted step time of the busiest device on the cluster the plan is for
(``cost.py``; the search is ``search.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from dlrm_jax.choices import (  # defined once there
    SPARSE_OPTIMIZER_KINDS,
    BagExchange,
    RowLayoutChoice,
    Sharding,
    Storage,
)
from dlrm_jax.embedding.plan.cost import PROFILES, Cluster
from dlrm_jax.embedding.plan.embedding_plan import (  # noqa: F401 - PlanError re-exported
    EmbeddingPlan,
    PlanError,
    RowLayout,
    Strategy,
)
from dlrm_jax.embedding.plan.estimates import TableStats, batch_bound_stats
from dlrm_jax.embedding.plan.search import (  # noqa: F401 - column_slices, cache_slots re-exported
    MIN_COLUMN_WIDTH,
    cache_slots,
    column_slices,
    place_tables,
)
from dlrm_jax.embedding.plan.specs import Pooling, TableSpec
from dlrm_jax.embedding.plan.stats import exchange_bytes_per_step, fmt_bytes, per_device_bytes


def parse_overrides(
    items: Sequence[str], specs: Sequence[TableSpec], key: str = "embedding.table_sharding", values: type = Strategy
) -> dict:
    """``["cat_2=row", ...]`` -> {name: value}; unknown tables or values are errors."""
    names = [s.name for s in specs]
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in names:
            raise PlanError(f"{key}: no table named {name!r} (tables: {', '.join(names)})")
        try:
            out[name] = values(value)
        except ValueError:
            raise PlanError(f"{key}: {item!r}: must be one of {', '.join(v.value for v in values)}") from None
    return out


@dataclass(frozen=True)
class PlanOptions:
    """Everything a plan is made under besides the tables, the devices, the optimizer and the
    batch: the planner's options as one record (``plan_from_config`` builds it from a config).

    ``overrides``: {table name: strategy} over the default ``sharding``; ``row_layout``: block,
    cyclic, or auto (per row-wise table, whichever the data's statistics predict cheaper;
    block without statistics); ``capacity_factor``: the buckets' headroom; ``dtype`` / ``exchange_dtype``:
    table storage and the wire; ``budget_bytes``: per device (0 = no limit); ``bag_exchange``:
    auto, ids or pooled; ``storage`` and ``storage_overrides``: device or tiered tables
    (counted by their device caches, ``device_cache``: rows per owner, or 0 and a fraction);
    ``cluster``: the machines ``auto`` prices plans for (default: the simulated CPU profile);
    ``stats``: per table, its ids' statistics in the data (default: the batch-size bound);
    ``ids_hosts``: hosts the ids exchange goes over in two levels (1: one level), as the
    search prices it and the plan records it; ``block_rows``: tables whose rows, row-wise,
    lie in blocks whatever ``row_layout`` says (dynamic tables: their maps' blocks)."""

    overrides: Mapping[str, Strategy | str] = field(default_factory=dict)
    row_layout: RowLayoutChoice = RowLayoutChoice.BLOCK
    capacity_factor: float = 1.25
    dtype: str = "float32"
    exchange_dtype: str = "float32"
    budget_bytes: int = 0
    budget_key: str = "embedding.memory_budget_gb"  # what set budget_bytes (a table that does not fit names it)
    bag_exchange: BagExchange = BagExchange.AUTO
    storage: Storage = Storage.DEVICE
    storage_overrides: Mapping[str, Storage] = field(default_factory=dict)
    device_cache: tuple[int, float] = (0, 0.1)
    cluster: Cluster | None = None
    stats: Sequence[TableStats] | None = None
    ids_hosts: int = 1
    block_rows: frozenset[str] = frozenset()


@dataclass(frozen=True)
class PlanRequest:
    """One plan asked for, as one record: the tables, how they are placed (``sharding``: a
    strategy for every table, or ``Sharding.AUTO``), the devices, the sparse optimizer, the batch the
    devices share and the options. The edge builds it once from a config
    (``train.wiring.plan_request``); planning replans by replacing an option
    (:meth:`with_options`), never by rewriting a config."""

    specs: tuple[TableSpec, ...]
    sharding: Sharding
    num_devices: int
    optimizer: str
    global_batch: int
    options: PlanOptions = field(default_factory=PlanOptions)

    def with_options(self, **fields) -> PlanRequest:
        """The same request with those options replaced (``row_layout=...``, ``stats=...``)."""
        return dataclasses.replace(self, options=dataclasses.replace(self.options, **fields))

    def plan(self) -> EmbeddingPlan:
        """The plan (:func:`plan_embeddings`)."""
        return plan_embeddings(
            self.specs, self.sharding, self.num_devices, self.optimizer, self.global_batch, self.options
        )


def _choice(kind: type, value, what: str):
    try:
        return kind(value)
    except ValueError:
        raise PlanError(f"{what}: {value!r} is not one of {', '.join(kind)}") from None


def plan_embeddings(
    specs: Sequence[TableSpec],
    sharding: Sharding | str,
    num_devices: int,
    optimizer: str,
    global_batch: int,
    options: PlanOptions | None = None,
    **option_fields,
) -> EmbeddingPlan:
    """A plan for ``specs`` on ``num_devices`` devices; raises PlanError naming the table when
    one cannot be placed within the budget per device.

    ``sharding``: a :class:`~dlrm_jax.choices.Sharding` (or its value): AUTO, or a strategy for every table
    not in the options' ``overrides`` ({table name: strategy}, e.g. ``{"user_region": "table"}``);
    ``optimizer``: the sparse optimizer's name (its state counts in the bytes);
    ``global_batch``: the samples of one step over all devices (the exchange is sized for it);
    ``options``: a :class:`PlanOptions`, or its fields as keywords (``overrides=...``,
    ``budget_bytes=...``). Tiered tables are never replicated: ``auto`` chooses among the
    sharded strategies for them."""
    try:
        o = dataclasses.replace(options or PlanOptions(), **option_fields)
    except TypeError as e:
        raise TypeError(f"plan_embeddings: {e} (the options are PlanOptions' fields)") from None
    overrides, storage_overrides = dict(o.overrides or {}), dict(o.storage_overrides or {})
    capacity_factor, dtype, exchange_dtype, budget_bytes = o.capacity_factor, o.dtype, o.exchange_dtype, o.budget_bytes
    storage, stats, cluster = o.storage, o.stats, o.cluster
    row_layout, bag_exchange, device_cache = o.row_layout, o.bag_exchange, o.device_cache
    names = [s.name for s in specs]  # in the tables' order (cat_2 before cat_10)
    sharding, row_layout = _choice(Sharding, sharding, "sharding"), _choice(RowLayoutChoice, row_layout, "row_layout")
    # (a KeyError 'adam' from the bytes of its state; a ZeroDivisionError for no devices)
    if optimizer not in SPARSE_OPTIMIZER_KINDS:
        raise PlanError(f"optimizer: {optimizer!r} is not one of {', '.join(SPARSE_OPTIMIZER_KINDS)}")
    if not isinstance(num_devices, int) or num_devices < 1:
        raise PlanError(f"num_devices: expected a positive integer, got {num_devices!r}")
    overrides = {name: _choice(Sharding, v, f"overrides[{name!r}]") for name, v in overrides.items()}
    for given, what in ((overrides, "overrides"), (storage_overrides, "storage_overrides")):
        unknown = [name for name in given if name not in names]
        if unknown:
            raise PlanError(f"{what}: no table named {', '.join(map(repr, unknown))} (tables: {', '.join(names)})")
    layouts = tuple(RowLayout) if row_layout is RowLayoutChoice.AUTO else (RowLayout(row_layout),)
    template = EmbeddingPlan(
        (), num_devices, optimizer, global_batch, capacity_factor, dtype, exchange_dtype, ids_hosts=o.ids_hosts
    )
    local_batch = global_batch // num_devices
    stats = list(stats) if stats is not None else [batch_bound_stats(s, local_batch, num_devices) for s in specs]
    wanted, tiered = [], []
    for spec in specs:
        wanted.append(overrides.get(spec.name, sharding))
        tiered.append(storage_overrides.get(spec.name, Storage(storage)) == Storage.TIERED)
        if tiered[-1] and wanted[-1] == Strategy.REPLICATED:
            if spec.name in storage_overrides:
                raise PlanError(
                    f"table {spec.name}: a replicated table lives on every device and cannot be "
                    f"tiered (embedding.table_storage); shard it or keep it on the devices"
                )
            tiered[-1] = False  # (a global storage=tiered: replicated tables stay on their devices)
        if wanted[-1] != Sharding.AUTO:
            _check_allowed(spec, Strategy(wanted[-1]), num_devices, explicit=True)
    tables = place_tables(
        specs,
        template,
        cluster or PROFILES["cpu"],
        stats,
        budget_bytes,
        wanted,
        tiered,
        [(RowLayout.BLOCK,) if spec.name in o.block_rows else layouts for spec in specs],
        bag_exchange,
        device_cache,
        o.budget_key,
    )
    plan = dataclasses.replace(template, tables=tables)

    check_budget(plan, budget_bytes, o.budget_key)
    return plan


def _check_allowed(spec: TableSpec, s: Strategy, n: int, explicit: bool) -> None:
    if not explicit or s != Strategy.COLUMN:
        return
    if n > 1 and column_slices(spec, n) < 2:
        raise PlanError(
            f"table {spec.name}: dim {spec.dim} cannot be split on {n} devices into "
            f"column slices at least {MIN_COLUMN_WIDTH} wide; use table or row sharding"
        )


def check_budget(plan: EmbeddingPlan, budget: int, key: str = "embedding.memory_budget_gb") -> None:
    """A PlanError where a device's share of ``plan`` (tables, optimizer state, exchange and
    hot-row buffers) is over ``budget`` bytes (0: none), which ``key`` set."""
    if not budget:
        return
    total = sum(per_device_bytes(plan).values())
    worst = int(np.argmax(total))
    if total[worst] > budget:
        biggest = max(
            (t for t in plan.tables if worst in t.devices),
            key=lambda t: t.bytes_on_device(plan.num_devices, plan.optimizer, plan.dtype)[worst].sum(),
        )
        hot = f", {plan.hot_rows:,} hot rows" if plan.hot_rows else ""
        raise PlanError(
            f"device {worst} needs {fmt_bytes(total[worst])} with exchange buffers{hot}, over the "
            f"{fmt_bytes(budget)} budget ({key}); its largest table is {biggest.spec.name} ({biggest.spec.rows:,} rows)"
        )


def wide_plan(
    table_rows: Sequence[int], bag_sizes: Sequence[int], optimizer: str, batch_size: int, num_devices: int
) -> EmbeddingPlan:
    """Wide&Deep's wide part: one weight per id of every feature (dim 1, sum pooling), every
    table replicated on each of ``num_devices`` devices."""
    specs = tuple(
        TableSpec(f"wide_{f}", rows, 1, bag, Pooling.SUM)
        for f, (rows, bag) in enumerate(zip(table_rows, bag_sizes, strict=True))
    )
    return plan_embeddings(specs, "replicated", num_devices, optimizer, batch_size)


def wide_bytes_per_device(plan: EmbeddingPlan) -> int:
    """The wide tables' weights and optimizer state, which every device holds whole."""
    return int(sum(t.bytes_on_device(plan.num_devices, plan.optimizer, plan.dtype)[0].sum() for t in plan.tables))


def wide_report(wide: EmbeddingPlan, optimizer: str) -> str:
    """The plan report's line on Wide&Deep's wide part."""
    rows = sum(t.spec.rows for t in wide.tables)
    return (
        f"Wide part: {len(wide.tables)} tables, {rows:,} weights, replicated: "
        f"{wide_bytes_per_device(wide) / 2**20:,.1f} MiB on every device with its "
        f"{optimizer} state (beside the device table's totals; counted in embedding.memory_budget_gb); its update "
        f"all-gathers the batch's ids and "
        f"gradients, {fmt_bytes(exchange_bytes_per_step(wide))} a step per device beside the exchange above"
    )
