"""The planner: chooses a strategy and devices for every table, within a memory budget.

Explicit strategies (``replicated``, ``table``, ``row``, ``column``) apply to every table not
named in the per-table overrides. ``auto`` decides per table with a cost model: the bytes the
busiest device moves per step, counting that each device sends an owner every distinct id only
once (so a small table costs little wherever it is), under the per-device memory budget.
Tables are placed largest first, each where it raises the busiest device's traffic least;
ties go to the simpler strategy (replicated, table, row, column).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence

import numpy as np

from dlrm_jax.embedding.plan.embedding_plan import (
    DTYPE_BYTES,
    EmbeddingPlan,
    ExchangeKind,
    RowLayout,
    Strategy,
    TablePlan,
)
from dlrm_jax.embedding.plan.specs import Pooling, TableSpec, specs_from_config
from dlrm_jax.embedding.plan.stats import per_device_bytes, plan_report

MIN_COLUMN_WIDTH = 4  # narrower slices make lookups inefficient (seed 002)
ORDER = (Strategy.REPLICATED, Strategy.TABLE, Strategy.ROW, Strategy.COLUMN)


class PlanError(ValueError):
    """A plan that cannot be made: the message names the table and the limit."""


def column_slices(spec: TableSpec, num_devices: int) -> int:
    """Most slices, each at least MIN_COLUMN_WIDTH wide and dividing dim, one per device."""
    best = 1
    for c in range(1, num_devices + 1):
        if spec.dim % c == 0 and spec.dim // c >= MIN_COLUMN_WIDTH:
            best = c
    return best


def parse_overrides(items: Sequence[str], specs: Sequence[TableSpec], key: str = "embedding.table_sharding",
                    values: type = Strategy) -> dict:
    """``["cat_2=row", ...]`` -> {name: value}; unknown tables or values are errors."""
    names = {s.name for s in specs}
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in names:
            raise PlanError(f"{key}: no table named {name!r} (tables: {', '.join(sorted(names))})")
        try:
            out[name] = values(value)
        except ValueError:
            raise PlanError(f"{key}: {item!r}: must be one of {', '.join(v.value for v in values)}") from None
    return out


class Storage(enum.StrEnum):
    DEVICE = "device"
    TIERED = "tiered"


def cache_slots(rows_per_owner: int, rows: int, fraction: float) -> int:
    """Device-cache slots of a tiered table per owner: ``rows``, or else ``fraction`` of the
    rows it owns; never more than it owns."""
    return max(1, min(rows_per_owner, rows or math.ceil(fraction * rows_per_owner)))


class _Placer:
    """Running per-device memory and traffic while tables are placed."""

    def __init__(self, n, optimizer, dtype, wire, local_batch, budget):
        self.n, self.optimizer, self.dtype, self.wire = n, optimizer, dtype, wire
        self.local_batch, self.budget = local_batch, budget
        self.memory = np.zeros(n, np.int64)
        self.traffic = np.zeros(n, np.float64)

    def candidate(self, spec: TableSpec, strategy: Strategy, row_layout: RowLayout, cache: tuple[int, float] | None):
        """(TablePlan, memory after, traffic after) for this table placed this way (``cache``:
        a tiered table's device cache per owner, as rows or 0 and a fraction)."""
        n, lb, lookups = self.n, self.local_batch, self.local_batch * spec.bag_size
        per_id = lambda width: 8 + 2 * self.wire * width  # ids both ways, vectors + gradients  # noqa: E731
        traffic = np.zeros(n)
        if strategy == Strategy.REPLICATED:
            devices = tuple(range(n))
            traffic += (n - 1) * lb * spec.bag_size * (4 + 4 * spec.dim)
        elif strategy == Strategy.ROW:
            devices = tuple(range(n))
            traffic += (n - 1) * min(lookups / n, math.ceil(spec.rows / n)) * per_id(spec.dim)
        else:
            slices = 1 if strategy == Strategy.TABLE else column_slices(spec, n)
            width = spec.dim // slices
            order = np.lexsort((self.memory, self.traffic))  # least busy first
            devices = tuple(int(d) for d in order[:slices])
            traffic[list(devices)] += (n - 1) * min(lookups, spec.rows) * per_id(width)
        plan = TablePlan(spec, strategy, devices, row_layout)
        if cache is not None and strategy != Strategy.REPLICATED:
            plan = dataclasses.replace(plan, cache_rows=cache_slots(plan.rows_per_device(n), *cache))
        memory = self.memory + plan.bytes_on_device(n, self.optimizer, self.dtype).sum(1)
        return plan, memory, self.traffic + traffic

    def place(self, plan_memory_traffic) -> TablePlan:
        plan, self.memory, self.traffic = plan_memory_traffic
        return plan

    def fits(self, memory: np.ndarray) -> bool:
        return not self.budget or bool((memory <= self.budget).all())


def plan_embeddings(specs: Sequence[TableSpec], sharding: str, num_devices: int, optimizer: str,
                    global_batch: int, *, overrides: Mapping[str, Strategy | str] | None = None,
                    row_layout: str = "block", capacity_factor: float = 1.25, dtype: str = "float32",
                    exchange_dtype: str = "float32", budget_bytes: int = 0,
                    bag_exchange: str = "auto", storage: str = "device",
                    storage_overrides: Mapping[str, Storage] | None = None,
                    device_cache: tuple[int, float] = (0, 0.1)) -> EmbeddingPlan:
    """A plan for ``specs`` on ``num_devices`` devices; raises PlanError naming the table when
    one cannot be placed within ``budget_bytes`` per device (0 = no limit).

    ``sharding``: ``auto``, ``replicated``, ``table``, ``row`` or ``column`` for every table
    not in ``overrides`` ({table name: strategy}, e.g. ``{"user_region": "table"}``);
    ``optimizer``: the sparse optimizer's name (its state counts in the bytes);
    ``global_batch``: the samples of one step over all devices (the exchange is sized for it).

    Tiered tables (``storage``, ``storage_overrides``) count only their device caches
    (``device_cache``: rows per owner, or 0 and a fraction of the rows it owns); they are
    never replicated: ``auto`` chooses among the sharded strategies for them."""
    overrides = dict(overrides or {})
    storage_overrides = dict(storage_overrides or {})
    names = {s.name for s in specs}
    for given, what in ((overrides, "overrides"), (storage_overrides, "storage_overrides")):
        unknown = sorted(set(given) - names)
        if unknown:
            raise PlanError(f"{what}: no table named {', '.join(map(repr, unknown))} "
                            f"(tables: {', '.join(sorted(names))})")
    layout = RowLayout(row_layout)
    placer = _Placer(num_devices, optimizer, dtype, DTYPE_BYTES[exchange_dtype],
                     global_batch // num_devices, budget_bytes)
    placed: dict[int, TablePlan] = {}
    order = sorted(range(len(specs)), key=lambda t: (-specs[t].rows * specs[t].dim, t))
    for t in order:
        spec = specs[t]
        wanted = overrides.get(spec.name, sharding)
        tiered = storage_overrides.get(spec.name, Storage(storage)) == Storage.TIERED
        options = ORDER if wanted == "auto" else (Strategy(wanted),)
        if tiered and wanted == "auto":
            options = ORDER[1:]
        elif tiered and options == (Strategy.REPLICATED,) and spec.name in storage_overrides:
            raise PlanError(f"table {spec.name}: a replicated table lives on every device and cannot be "
                            f"tiered (embedding.table_storage); shard it or keep it on the devices")
        for s in options:
            _check_allowed(spec, s, num_devices, explicit=wanted != "auto")
        options = [s for s in options if _allowed(spec, s, num_devices)]
        candidates = [placer.candidate(spec, s, layout, device_cache if tiered else None) for s in options]
        feasible = [c for c in candidates if placer.fits(c[1])]
        if not feasible:
            need = min(int(c[1].max()) for c in candidates)
            raise PlanError(f"table {spec.name} ({spec.rows:,} rows x {spec.dim}) does not fit: "
                            f"{need / 2**30:.2f} GiB needed on a device, budget "
                            f"{budget_bytes / 2**30:.2f} GiB (embedding.memory_budget_gb); "
                            f"try more devices or another embedding.sharding")
        best = min(feasible, key=lambda c: (c[2].max(), ORDER.index(c[0].strategy)))
        placed[t] = placer.place(best)
    tables = tuple(dataclasses.replace(placed[t], exchange=_exchange(placed[t], bag_exchange)) for t in range(len(specs)))
    plan = EmbeddingPlan(tables, num_devices, optimizer, global_batch, capacity_factor, dtype, exchange_dtype)
    _check_budget_with_buffers(plan, budget_bytes)
    return plan


def _exchange(tp: TablePlan, bag_exchange: str) -> ExchangeKind:
    if tp.strategy not in (Strategy.TABLE, Strategy.COLUMN) or bag_exchange == "ids":
        return ExchangeKind.IDS
    return ExchangeKind.POOLED if bag_exchange == "pooled" or tp.spec.bag_size > 1 else ExchangeKind.IDS


def _allowed(spec: TableSpec, s: Strategy, n: int) -> bool:
    if s == Strategy.COLUMN:
        return n == 1 or column_slices(spec, n) > 1
    return True


def _check_allowed(spec: TableSpec, s: Strategy, n: int, explicit: bool) -> None:
    if not explicit or s != Strategy.COLUMN:
        return
    if n > 1 and column_slices(spec, n) < 2:
        raise PlanError(f"table {spec.name}: dim {spec.dim} cannot be split on {n} devices into "
                        f"column slices at least {MIN_COLUMN_WIDTH} wide; use table or row sharding")


def _check_budget_with_buffers(plan: EmbeddingPlan, budget: int) -> None:
    if not budget:
        return
    total = sum(per_device_bytes(plan).values())
    worst = int(np.argmax(total))
    if total[worst] > budget:
        biggest = max((t for t in plan.tables if worst in t.devices),
                      key=lambda t: t.bytes_on_device(plan.num_devices, plan.optimizer, plan.dtype)[worst].sum())
        raise PlanError(f"device {worst} needs {total[worst] / 2**30:.2f} GiB with exchange buffers, "
                        f"over the {budget / 2**30:.2f} GiB budget; its largest table is "
                        f"{biggest.spec.name} ({biggest.spec.rows:,} rows)")



def plan_from_config(cfg, num_devices: int, budget_bytes: int | None = None) -> EmbeddingPlan:
    """The plan for a config's tables on ``num_devices`` devices (the budget defaults to
    ``embedding.memory_budget_gb``)."""
    e = cfg.embedding
    specs = specs_from_config(cfg)
    budget = int(e.memory_budget_gb * 2**30) if budget_bytes is None else budget_bytes
    if budget and cfg.model.kind == "wide_deep":  # every device also holds the wide part whole
        budget = max(budget - wide_bytes_per_device(wide_plan(cfg, num_devices)), 1)
    return plan_embeddings(
        specs, e.sharding, num_devices, e.optimizer, cfg.train.batch_size,
        overrides=parse_overrides(e.table_sharding, specs), row_layout=e.row_layout,
        capacity_factor=e.capacity_factor, dtype=e.dtype, exchange_dtype=e.exchange_dtype,
        budget_bytes=budget, bag_exchange=e.bag_exchange, storage=e.storage,
        storage_overrides=parse_overrides(e.table_storage, specs, "embedding.table_storage", Storage),
        device_cache=(e.tier.device_cache_rows, e.tier.device_cache_fraction),
    )


def host_plan_from_config(cfg, num_devices: int, hosts: int, budget_bytes: int | None = None) -> EmbeddingPlan:
    """With per-host tables (embedding.sync per_host or host_replicas), each of ``hosts`` hosts
    holds a whole set over its own devices: the plan of one host's ``num_devices / hosts``
    devices and its share of the batch. Otherwise the plan over all ``num_devices``."""
    if not cfg.embedding.tables_per_host:
        return plan_from_config(cfg, num_devices, budget_bytes)
    local = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=cfg.train.batch_size // hosts))
    return plan_from_config(local, num_devices // hosts, budget_bytes)


def wide_plan(cfg, num_devices: int) -> EmbeddingPlan:
    """Wide&Deep's wide part (model.kind=wide_deep): one weight per id of every feature (dim 1,
    sum pooling), every table replicated on each of ``num_devices`` devices."""
    specs = tuple(TableSpec(f"wide_{f}", rows, 1, bag, Pooling.SUM)
                  for f, (rows, bag) in enumerate(zip(cfg.table_rows, cfg.bag_sizes, strict=True)))
    return plan_embeddings(specs, "replicated", num_devices, cfg.model.wide_optimizer, cfg.train.batch_size)


def wide_bytes_per_device(plan: EmbeddingPlan) -> int:
    """The wide tables' weights and optimizer state, which every device holds whole."""
    return int(sum(t.bytes_on_device(plan.num_devices, plan.optimizer, plan.dtype)[0].sum() for t in plan.tables))


def config_plan_report(cfg, plan: EmbeddingPlan) -> str:
    """:func:`~dlrm_jax.embedding.plan.stats.plan_report` (with per-host tables, one host's plan:
    its header names the global batch and the host's share), and for Wide&Deep a line on its
    wide part."""
    report = plan_report(plan, cfg.train.batch_size if cfg.embedding.tables_per_host else None)
    if cfg.model.kind != "wide_deep":
        return report
    wide = wide_plan(cfg, plan.num_devices)
    rows = sum(t.spec.rows for t in wide.tables)
    return (f"{report}\nWide part: {len(plan.tables)} tables, {rows:,} weights, replicated: "
            f"{wide_bytes_per_device(wide) / 2**20:,.1f} MiB on every device with its "
            f"{cfg.model.wide_optimizer} state (counted in embedding.memory_budget_gb)")
