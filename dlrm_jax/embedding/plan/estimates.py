"""What the planner estimates ids buckets from while it searches: each table's id statistics
in the data's first batches (:class:`TableStats`, measured by ``exchange.capacity.table_stats``)
and, for a candidate plan, the buckets they predict (:func:`estimated_capacities`). Once a plan
is made its buckets are measured instead (``exchange.capacity.measure_capacities``)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan, ExchangeKind, RowLayout
from dlrm_jax.embedding.plan.layout import (
    KIND_BLOCK,
    KIND_FIXED,
    host_size,
    needs_whole_rows,
    two_level_ids,
    two_level_keys,
    whole_rows_key,
)
from dlrm_jax.embedding.plan.part_kinds import exchange_parts
from dlrm_jax.embedding.plan.specs import TableSpec


@dataclass(frozen=True)
class TableStats:
    """A table's ids in one device's share of a batch (from the data's first batches):
    ``distinct`` rows it looks up, and ``row_owner`` the most distinct rows it asks of one
    owner when the table is split by rows over every device in blocks (the bucket that split
    needs); ``cyclic_owner`` the same for rows dealt out cyclically (None: as in blocks);
    ``batch_distinct`` the distinct rows of a whole global batch (None: unknown, see
    :meth:`in_batch`)."""

    distinct: float
    row_owner: float
    cyclic_owner: float | None = None
    batch_distinct: float | None = None
    # Per owner, the most distinct rows one device (``by_owner``) and one host's devices together
    # (``by_owner_host``: what two-level ids buckets need) asked of it, in blocks and cyclically
    # (None: not measured): a plan's tables add up per owner, which is tighter than adding each
    # table's busiest owner.
    by_owner: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    by_owner_host: tuple[tuple[float, ...], tuple[float, ...]] | None = None

    def owners(self, layout: RowLayout, n: int, host_devices: int = 0) -> np.ndarray:
        """float [n]: per owner of a split over every one of ``n`` devices, the most distinct
        rows one device (``host_devices`` > 0: one host of that many) asked of it; when not
        measured, the busiest owner's count for every owner (from a host: as if no two of its
        devices asked for the same row)."""
        arrays = self._host_arrays if host_devices else self._device_arrays
        if arrays is not None and arrays.shape[1] == n:
            return arrays[int(layout == RowLayout.CYCLIC)]
        return np.full(n, max(host_devices, 1) * self.owner(layout), np.float64)

    # The search asks for these thousands of times: made into arrays once.
    @functools.cached_property
    def _device_arrays(self):
        return None if self.by_owner is None else np.asarray(self.by_owner, np.float64)

    @functools.cached_property
    def _host_arrays(self):
        return None if self.by_owner_host is None else np.asarray(self.by_owner_host, np.float64)

    def in_batch(self, num_devices: int) -> float:
        """Distinct rows in a global batch of ``num_devices`` devices' shares: measured, else
        every device's distinct rows as if no two shared one (an upper bound)."""
        return self.batch_distinct if self.batch_distinct is not None else self.distinct * num_devices

    def owner(self, layout: RowLayout) -> float:
        """The busiest owner's distinct rows under ``layout``."""
        if layout == RowLayout.CYCLIC and self.cyclic_owner is not None:
            return self.cyclic_owner
        return self.row_owner


def batch_bound_stats(spec: TableSpec, local_batch: int, n: int) -> TableStats:
    """Without data: every lookup distinct, spread evenly over the owners of a row split."""
    lookups = local_batch * spec.bag_size
    return TableStats(
        min(lookups, spec.rows),
        min(math.ceil(lookups / n), math.ceil(spec.rows / n)),
        None,
        min(lookups * n, spec.rows),
    )


def estimated_capacities(plan: EmbeddingPlan, stats: Sequence[TableStats]) -> tuple[tuple[str, int], ...]:
    """Per ids part, the bucket its tables' statistics predict: per owner, the row-wise
    tables' ``row_owner`` plus the distinct rows of its table-wise ids tables; the busiest
    owner's, times the plan's capacity factor (in two levels: each stage's, see
    :func:`_two_level_estimates`). Per host-columns part with whole-row statistics, the
    distinct rows of the busiest host's tables in a batch, times the factor."""
    out = []
    factor = plan.capacity_factor
    for part in exchange_parts(plan):
        g = part.group
        if part.kind == ExchangeKind.HOST_COLUMNS and needs_whole_rows(plan, g):
            host_devices = host_size(plan)
            per_owner = np.zeros(plan.num_devices // host_devices)
            for t in {vt.table for vt in g.vtables}:
                per_owner[plan.tables[t].devices[0] // host_devices] += stats[t].in_batch(plan.num_devices)
            out.append((whole_rows_key(g), max(1, math.ceil(factor * per_owner.max()))))
        if part.kind != ExchangeKind.IDS:
            continue
        per_owner = np.zeros(plan.num_devices)
        for vt in g.vtables:
            if vt.kind == KIND_FIXED:
                per_owner[vt.device] += stats[vt.table].distinct
            elif vt.kind == KIND_BLOCK and vt.span < plan.num_devices:  # rows within one host
                per_owner[vt.device : vt.device + vt.span] += stats[vt.table].row_owner * plan.num_devices / vt.span
            else:
                per_owner += stats[vt.table].owners(plan.tables[vt.table].row_layout, plan.num_devices)
        out.append((g.name, max(1, math.ceil(factor * per_owner.max()))))
        if two_level_ids(plan, g):
            out += _two_level_estimates(plan, g, stats, per_owner)
    return tuple(out)


def _two_level_estimates(plan: EmbeddingPlan, g, stats: Sequence[TableStats], per_owner: np.ndarray) -> list:
    """A two-level ids part's (C1, C2) estimates: stage 1, a device's busiest buckets summed
    over the owners of each local index (``per_owner``: each owner's), at most its distinct
    rows; stage 2, per owner the distinct rows one host asks of it, merged, the busiest's."""
    host_devices, n = plan.num_devices // plan.ids_hosts, plan.num_devices
    distinct = sum(stats[t].distinct for t in {vt.table for vt in g.vtables})
    host = np.zeros(n)
    for vt in g.vtables:
        st = stats[vt.table]
        if vt.kind == KIND_FIXED:
            host[vt.device] += min(host_devices * st.distinct, st.in_batch(n))
        elif vt.kind == KIND_BLOCK and vt.span < n:
            host[vt.device : vt.device + vt.span] += st.row_owner * n / vt.span * host_devices
        else:
            host += st.owners(plan.tables[vt.table].row_layout, n, host_devices)
    by_local = per_owner.reshape(plan.ids_hosts, host_devices).sum(0)
    c1, c2 = min(distinct, by_local.max()), host.max()
    return [(k, max(1, math.ceil(plan.capacity_factor * c))) for k, c in zip(two_level_keys(g), (c1, c2), strict=True)]
