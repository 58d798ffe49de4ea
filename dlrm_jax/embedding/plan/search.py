"""The planner's search: every table placed where the predicted step time grows least.

First, each table is kept on every device (its gradient all-reduced) when that is predicted
faster than its share of an evenly balanced exchange: what TorchRec calls data-parallel
tables, here decided by time on the cluster's links. The others are taken in order of the
exchange bytes they cause (bag ids plus a vector each way per sample), largest first, and each
tries its options: table-wise on the least busy device, column-wise in 2, 4, ... slices on the
least busy devices, row-wise over all devices; table- and column-wise pieces exchange pooled
bags (or distinct ids). Each option is priced by ``cost.predict_step`` on the plan of the tables
placed so far plus this one. All-to-alls are padded to their busiest owner, so a piece that
fills another device's padding costs nothing and one that raises the busiest owner costs every
device; while tables remain to be placed, padding up to the even share of all the sharded
tables (their ids and columns over N owners) is counted as already spent, so the first tables
are not split only because they are first. The cheapest option that fits the memory budget
wins; ties go to the simpler strategy. Then every sharded table is taken out and placed again
with all the others in place, twice over. Ids buckets of row-wise tables are estimated from the
data's statistics (:class:`TableStats`) while searching and measured once the plan is made.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from dlrm_jax.choices import Sharding
from dlrm_jax.embedding.plan.cost import Cluster, link_seconds, predict_step
from dlrm_jax.embedding.plan.embedding_plan import (
    DTYPE_BYTES,
    EmbeddingPlan,
    ExchangeKind,
    PlanError,
    RowLayout,
    Strategy,
    TablePlan,
    vector_bytes,
)
from dlrm_jax.embedding.plan.estimates import TableStats, estimated_capacities
from dlrm_jax.embedding.plan.layout import HOST_STRATEGIES, pooled_layout
from dlrm_jax.embedding.plan.part_kinds import exchange_parts
from dlrm_jax.embedding.plan.specs import TableSpec
from dlrm_jax.embedding.plan.stats import fmt_bytes

MIN_COLUMN_WIDTH = 4  # narrower slices make lookups inefficient
ORDER = (Strategy.REPLICATED, Strategy.TABLE, Strategy.ROW, Strategy.COLUMN, Strategy.HOST_COLUMN, Strategy.HOST_ROW)


def column_slices(spec: TableSpec, num_devices: int) -> int:
    """Most slices, each at least MIN_COLUMN_WIDTH wide and dividing dim, one per device."""
    best = 1
    for c in range(1, num_devices + 1):
        if spec.dim % c == 0 and spec.dim // c >= MIN_COLUMN_WIDTH:
            best = c
    return best


def cache_slots(rows_per_owner: int, rows: int, fraction: float) -> int:
    """Device-cache slots of a tiered table per owner: ``rows``, or else ``fraction`` of the
    rows it owns; never more than it owns."""
    return max(1, min(rows_per_owner, rows or math.ceil(fraction * rows_per_owner)))


def column_options(spec: TableSpec, n: int) -> list[int]:
    """Slice counts the search tries: powers of two up to :func:`column_slices`."""
    most, out, c = column_slices(spec, n), [], 2
    while c <= most:
        if spec.dim % c == 0:
            out.append(c)
        c *= 2
    return out


class Search:
    """Places tables one at a time (see the module docstring). ``template``: the plan's
    settings (optimizer, batch, dtypes, capacity factor), its tables ignored."""

    def __init__(
        self,
        specs: Sequence[TableSpec],
        template: EmbeddingPlan,
        cluster: Cluster,
        stats: Sequence[TableStats],
        budget: int,
    ):
        self.specs, self.template, self.cluster, self.stats, self.budget = specs, template, cluster, stats, budget
        self.n = template.num_devices
        self.placed: dict[int, TablePlan] = {}
        self.memory = np.zeros(self.n, np.int64)
        self.floor_ids = self.floor_cols = 0.0  # per owner: the even share of the sharded tables

    def prefers_replicated(self, spec: TableSpec) -> bool:
        """Whether all-reducing the table's gradient (and updating every row) is predicted
        faster than its share of a balanced exchange (a vector each way and its ids, per
        sample)."""
        n, lb = self.n, self.template.global_batch // self.n
        vec = vector_bytes(self.template.exchange_dtype, spec.dim)
        hbm = self.cluster.hbm_gbps * 1e9 * self.cluster.hbm_efficiency
        allreduce = link_seconds("all-reduce", 2 * (n - 1) / n * spec.rows * spec.dim * 4, n, self.cluster) + (
            spec.rows * spec.dim * (8 + 2 * DTYPE_BYTES[self.template.dtype]) / hbm
        )  # every row updated
        shared = link_seconds("all-to-all", (n - 1) / n * lb * (4 * spec.bag_size + 2 * vec), n, self.cluster)
        return n == 1 or allreduce - self.cluster.latency_us * 1e-6 <= shared - self.cluster.latency_us * 1e-6

    def set_floors(self, sharded: Sequence[TableSpec]) -> None:
        """The even share of these tables' ids and columns on each of the N owners."""
        self.floor_ids = sum(s.bag_size for s in sharded) / self.n
        self.floor_cols = sum(s.dim for s in sharded) / self.n

    def order(self) -> list[int]:
        """Largest exchange first (bag ids and a vector each way per sample), then largest table."""
        weight = lambda s: 4 * s.bag_size + 2 * vector_bytes(self.template.exchange_dtype, s.dim)
        return sorted(
            range(len(self.specs)), key=lambda t: (-weight(self.specs[t]), -self.specs[t].rows * self.specs[t].dim, t)
        )

    def plan_with(self, extra: dict[int, TablePlan]) -> EmbeddingPlan:
        tables = {**self.placed, **extra}
        plan = dataclasses.replace(self.template, tables=tuple(tables[t] for t in sorted(tables)), capacities=())
        stats = [self.stats[t] for t in sorted(tables)]
        return dataclasses.replace(plan, capacities=estimated_capacities(plan, stats))

    def cost(self, t: int, tp: TablePlan) -> float:
        plan = self.plan_with({t: tp})
        return predict_step(plan, self.cluster).embedding_s + self._unfilled_share(plan)

    def _unfilled_share(self, plan: EmbeddingPlan) -> float:
        """Seconds of the pooled all-to-alls' padding below the even share: spent anyway once
        every table is placed (see the module docstring)."""
        ids = cols = 0
        for part in exchange_parts(plan):
            if part.kind == ExchangeKind.POOLED:  # (host pooled parts carry no device's padding)
                lay = pooled_layout(plan, part.group)
                ids, cols = ids + lay.ids_per_sample, cols + lay.pieces * part.group.width
        lb, wire = plan.local_batch, DTYPE_BYTES[plan.exchange_dtype]
        missing = (self.n - 1) * lb * (4 * max(0.0, self.floor_ids - ids) + 2 * wire * max(0.0, self.floor_cols - cols))
        return link_seconds("all-to-all", missing, self.n, self.cluster) if missing > 0 else 0.0

    def least_busy(self, width: int, count: int, spec: TableSpec) -> tuple[int, ...]:
        """The ``count`` devices with the fewest pooled pieces of this width, then the fewest
        pooled ids, then the least memory."""
        pieces, ids = np.zeros(self.n), np.zeros(self.n)
        for tp in self.placed.values():
            if tp.strategy in (Strategy.TABLE, Strategy.COLUMN) and tp.exchange == ExchangeKind.POOLED:
                for d in tp.devices:
                    pieces[d] += tp.slice_dim == width
                    ids[d] += tp.spec.bag_size
        order = np.lexsort((np.arange(self.n), self.memory, ids, pieces))
        return tuple(int(d) for d in order[:count])

    @property
    def host_size(self) -> int:
        """Devices of one host (``cluster.devices_per_host``, at most all of them)."""
        return min(self.n, self.cluster.devices_per_host)

    def least_busy_host(self) -> tuple[int, ...]:
        """The devices of the host whose row-within-host tables send it the fewest ids per
        sample, then whose fullest device holds the least."""
        g = self.host_size
        ids = np.zeros(self.n // g)
        for tp in self.placed.values():
            if tp.strategy in HOST_STRATEGIES:
                ids[tp.devices[0] // g] += tp.spec.bag_size
        memory = self.memory.reshape(-1, g).max(1)
        host = int(np.lexsort((np.arange(self.n // g), memory, ids))[0])
        return tuple(range(host * g, (host + 1) * g))

    def fits(self, tp: TablePlan) -> bool:
        if not self.budget:
            return True
        added = tp.bytes_on_device(self.n, self.template.optimizer, self.template.dtype).sum(1)
        return bool((self.memory + added <= self.budget).all())

    def place(self, t: int, tp: TablePlan) -> None:
        self.placed[t] = tp
        self.memory += tp.bytes_on_device(self.n, self.template.optimizer, self.template.dtype).sum(1)

    def remove(self, t: int) -> TablePlan:
        tp = self.placed.pop(t)
        self.memory -= tp.bytes_on_device(self.n, self.template.optimizer, self.template.dtype).sum(1)
        return tp

    def candidates(
        self,
        spec: TableSpec,
        options: Sequence[Strategy],
        layouts: Sequence[RowLayout],
        exchanges: Sequence[ExchangeKind],
        slices: int | None = None,
    ) -> list[TablePlan]:
        """Placements of ``spec`` for each strategy in ``options`` (row-wise: in each of
        ``layouts``; column-wise: ``slices`` slices, or every count :func:`column_options`
        allows), on the least busy devices."""
        out, layout = [], layouts[0]
        for s in options:
            if s == Strategy.REPLICATED:
                out.append(TablePlan(spec, s, tuple(range(self.n)), layout))
                continue
            if s == Strategy.ROW:
                out += [TablePlan(spec, s, tuple(range(self.n)), x) for x in layouts]
                continue
            if s in HOST_STRATEGIES:
                out += [TablePlan(spec, s, self.least_busy_host(), layout, exchange=x) for x in exchanges]
                continue
            counts = [1] if s == Strategy.TABLE else ([slices] if slices else column_options(spec, self.n))
            for count in counts:
                devices = self.least_busy(spec.dim // count, count, spec)
                out += [TablePlan(spec, s, devices, layout, exchange=x) for x in exchanges]
        return out

    def choose(self, t: int, candidates: list[TablePlan]) -> TablePlan | None:
        """The cheapest candidate that fits (None when none does)."""
        priced = [
            (self.cost(t, tp), ORDER.index(tp.strategy), len(tp.devices), i, tp)
            for i, tp in enumerate(candidates)
            if self.fits(tp)
        ]
        return min(priced)[-1] if priced else None


def exchange_for(tp: TablePlan, bag_exchange: str) -> ExchangeKind:
    """An explicitly placed table's exchange: ``embedding.bag_exchange``, where ``auto`` pools
    the bags of table- and column-wise tables and sends one-hot ids as distinct rows; a table
    split by rows within a host pools unless ``ids`` is asked for."""
    if tp.strategy in HOST_STRATEGIES:
        return ExchangeKind.IDS if bag_exchange == "ids" else ExchangeKind.POOLED
    if tp.strategy not in (Strategy.TABLE, Strategy.COLUMN) or bag_exchange == "ids":
        return ExchangeKind.IDS
    return ExchangeKind.POOLED if bag_exchange == "pooled" or tp.spec.bag_size > 1 else ExchangeKind.IDS


def allowed(spec: TableSpec, s: Strategy, n: int, host_size: int) -> bool:
    """Whether the search may try ``s`` for ``spec``: column slices when the width splits;
    within a host when hosts of ``host_size`` devices tile the ``n`` devices (columns: and
    the width splits into ``host_size`` slices at least MIN_COLUMN_WIDTH wide)."""
    if s in HOST_STRATEGIES and n % host_size:
        return False
    if s == Strategy.HOST_COLUMN:
        return host_size == 1 or (spec.dim % host_size == 0 and spec.dim // host_size >= MIN_COLUMN_WIDTH)
    if s == Strategy.HOST_ROW:
        return True
    return s != Strategy.COLUMN or n == 1 or column_slices(spec, n) > 1


def place_tables(
    specs: Sequence[TableSpec],
    template: EmbeddingPlan,
    cluster: Cluster,
    stats: Sequence[TableStats],
    budget: int,
    wanted: Sequence[str],
    tiered: Sequence[bool],
    layouts: Sequence[Sequence[RowLayout]],
    bag_exchange: str,
    device_cache: tuple[int, float],
    budget_key: str = "embedding.memory_budget_gb",
) -> tuple[TablePlan, ...]:
    """Every table's placement (``budget_key``: what set ``budget``, for the message of a table
    that does not fit): ``wanted[t]`` a strategy, or ``auto`` for the search (see the
    module docstring), its rows (row-wise) in one of ``layouts[t]``. The search runs once with every option open and once per slice count
    (table-wise, 2, 4, ... column slices) preferred for the sharded tables, and keeps the plan
    whose predicted step is shortest, after one more pass over its sharded tables."""
    n = template.num_devices
    probe = Search(specs, template, cluster, stats, budget)
    replicated = {
        t
        for t, w in enumerate(wanted)
        if w == Strategy.REPLICATED or (w == Sharding.AUTO and not tiered[t] and probe.prefers_replicated(specs[t]))
    }
    args = (
        specs,
        template,
        cluster,
        stats,
        budget,
        wanted,
        tiered,
        layouts,
        bag_exchange,
        device_cache,
        replicated,
        budget_key,
    )
    auto = [t for t, w in enumerate(wanted) if w == Sharding.AUTO and t not in replicated]
    if not auto:
        return _run(*args, None).tables_in_order()
    most = max(column_slices(specs[t], n) for t in auto)
    preferences = [None, 1, *[c for c in (2**k for k in range(1, 12)) if c <= most]]
    best = min((_run(*args, p) for p in preferences), key=lambda r: r.final_cost())
    best.improve(auto)
    return best.tables_in_order()


class _Run:
    """One pass of the search with a slice preference (None: every option)."""

    def __init__(
        self, search: Search, specs, wanted, tiered, layouts, bag_exchange, device_cache, replicated, budget_key
    ):
        self.search, self.specs, self.wanted, self.tiered = search, specs, wanted, tiered
        self.budget_key = budget_key
        self.layouts, self.bag_exchange, self.device_cache, self.replicated = (
            layouts,
            bag_exchange,
            device_cache,
            replicated,
        )
        self.exchanges = {"ids": [ExchangeKind.IDS], "pooled": [ExchangeKind.POOLED]}.get(bag_exchange)

    def candidates(self, t: int, prefer: int | None) -> list[TablePlan]:
        search, spec, n = self.search, self.specs[t], self.search.n
        if self.wanted[t] != Sharding.AUTO:
            out = [self.explicit(t, Strategy(self.wanted[t]))]
        else:
            sharded, slices = [s for s in ORDER[1:] if allowed(spec, s, n, search.host_size)], None
            if prefer is not None:  # the preferred slices (or the most the table allows), or rows
                slices = min(prefer, column_slices(spec, n))
                sharded = [Strategy.TABLE if slices == 1 else Strategy.COLUMN, Strategy.ROW]
            kinds = self.exchanges or (
                [ExchangeKind.POOLED] if spec.bag_size > 1 else [ExchangeKind.POOLED, ExchangeKind.IDS]
            )
            first = [Strategy.REPLICATED] if t in self.replicated else []
            out = search.candidates(spec, first + sharded, self.layouts[t], kinds, slices)
        if self.tiered[t]:  # (a host's row blocks would need a cache space per owner of the host)
            if any(c.strategy == Strategy.HOST_ROW for c in out) and self.wanted[t] != Sharding.AUTO:
                raise PlanError(
                    f"table {spec.name}: host_row tables live on the devices; tier it host_column-, row- or table-wise"
                )
            out = [c for c in out if c.strategy != Strategy.HOST_ROW]
            out = [
                dataclasses.replace(c, cache_rows=cache_slots(c.rows_per_device(n), *self.device_cache)) for c in out
            ]
        return out

    def explicit(self, t: int, strategy: Strategy) -> TablePlan:
        """The one placement an explicit strategy allows: table- and column-wise pieces (as
        many slices as fit) on the least busy devices."""
        n, spec = self.search.n, self.specs[t]
        if strategy in (Strategy.REPLICATED, Strategy.ROW):
            devices = tuple(range(n))
        elif strategy in HOST_STRATEGIES:
            if not allowed(spec, strategy, n, self.search.host_size):
                slices = f" and dim {spec.dim} in as many slices at least {MIN_COLUMN_WIDTH} wide"
                raise PlanError(
                    f"table {spec.name}: {strategy.value} needs the {n} devices in hosts of "
                    f"cluster.devices_per_host={self.search.host_size}"
                    + (slices if strategy == Strategy.HOST_COLUMN else "")
                    + "; use row or column sharding"
                )
            devices = self.search.least_busy_host()
        else:
            slices = 1 if strategy == Strategy.TABLE else column_slices(spec, n)
            devices = self.search.least_busy(spec.dim // slices, slices, spec)
        # Rows in the layout whose busiest owner is least busy on the data (blocks on a tie).
        stats = self.search.stats[t]
        layout = min(self.layouts[t], key=lambda x: (stats.owner(x), self.layouts[t].index(x)))
        tp = TablePlan(spec, strategy, devices, layout)
        return dataclasses.replace(tp, exchange=exchange_for(tp, self.bag_exchange))

    def place(self, t: int, prefer: int | None) -> None:
        """The cheapest candidate that fits; a table the search keeps on every device takes
        that when it fits."""
        options, search = self.candidates(t, prefer), self.search
        if t in self.replicated and self.wanted[t] == Sharding.AUTO and search.fits(options[0]):
            options = options[:1]
        best = search.choose(t, options)
        if best is None:
            spec, opt, dtype = self.specs[t], search.template.optimizer, search.template.dtype
            need = min(int((search.memory + c.bytes_on_device(search.n, opt, dtype).sum(1)).max()) for c in options)
            raise PlanError(
                f"table {spec.name} ({spec.rows:,} rows x {spec.dim}) does not fit: "
                f"{fmt_bytes(need)} needed on a device, budget {fmt_bytes(search.budget)} "
                f"({self.budget_key}); "
                f"try more devices or another embedding.sharding"
            )
        search.place(t, best)

    def improve(self, tables: Sequence[int]) -> None:
        """Each table taken out and placed again with every option open, all others in place."""
        for t in tables:
            self.search.remove(t)
            self.place(t, None)

    def final_cost(self) -> float:
        return predict_step(self.search.plan_with({}), self.search.cluster).embedding_s

    def tables_in_order(self) -> tuple[TablePlan, ...]:
        return tuple(self.search.placed[t] for t in range(len(self.specs)))


def _run(
    specs,
    template,
    cluster,
    stats,
    budget,
    wanted,
    tiered,
    layouts,
    bag_exchange,
    device_cache,
    replicated,
    budget_key,
    prefer,
) -> _Run:
    search = Search(specs, template, cluster, stats, budget)
    search.set_floors([specs[t] for t in range(len(specs)) if t not in replicated])
    run = _Run(search, specs, wanted, tiered, layouts, bag_exchange, device_cache, replicated, budget_key)
    for t in search.order():
        run.place(t, prefer)
    return run
