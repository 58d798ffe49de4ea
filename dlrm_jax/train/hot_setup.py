"""Choosing the hot rows when a run starts: statistics from the data, the model's decision.

Every process must choose the same rows, so statistics are taken over global batches: in a
multi-process run each process's slice of a batch is all-gathered to choose the first rows, and
while training each process counts its own slice and the counts are all-gathered at a refresh
(collectives, dispatched by the main thread like every other). Counts come from the ``embedding.hot.stats_batches`` first
training batches, or, for a preprocessed dataset that has them, from the per-feature id
histograms ``preprocess`` wrote (no warm-up pass over the data).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from dlrm_jax.config_schema import HotConfig
from dlrm_jax.data.batch import DataSource, train_ids
from dlrm_jax.embedding.exchange.capacity import measure_capacities
from dlrm_jax.embedding.hot.choice import choose_hot_rows, hot_plan, mask_hot
from dlrm_jax.embedding.hot.counts import RowCounts
from dlrm_jax.embedding.hot.schedule import HotSchedule
from dlrm_jax.embedding.plan.cost import Cluster
from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan


def global_ids(local_ids: np.ndarray) -> np.ndarray:
    """One global batch's ids on every process (this process's slice all-gathered)."""
    if jax.process_count() == 1:
        return np.asarray(local_ids)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(local_ids), tiled=True))


def gather_counts(local: RowCounts) -> RowCounts:
    """The sum over processes of each process's ``local`` counts, on every process (the same
    bits everywhere: whole-number counts, summed in process order)."""
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils

    flat = np.concatenate(
        [
            np.stack([np.full(i.size, t), i, c], 1).astype(np.int32)
            for t, (i, c) in enumerate(zip(local.ids, local.counts, strict=True))
        ]
        or [np.zeros((0, 3), np.int32)]
    )
    longest = int(np.max(multihost_utils.process_allgather(np.array([flat.shape[0]], np.int64))))
    padded = np.full((longest, 3), -1, np.int32)  # ids and window counts fit: x64 is off
    padded[: flat.shape[0]] = flat
    every = np.asarray(multihost_utils.process_allgather(padded))  # [processes, longest, 3]
    out = RowCounts.empty(local.num_tables)
    for rows in every:
        rows = rows[rows[:, 0] >= 0]
        out = out.plus(
            RowCounts(
                tuple(rows[rows[:, 0] == t, 1] for t in range(local.num_tables)),
                tuple(rows[rows[:, 0] == t, 2].astype(np.float64) for t in range(local.num_tables)),
            )
        )
    return out


def initial_counts(source: DataSource, stats_batches: int, bag_sizes: Sequence[int]) -> RowCounts:
    """Lookup counts to choose the first hot set from: the dataset's id histograms when the
    source has them, else the first ``stats_batches`` training batches."""
    histograms = getattr(source, "id_histograms", None)
    per_feature = histograms() if histograms else None
    if per_feature is not None:
        return RowCounts(tuple(ids for ids, _ in per_feature), tuple(c.astype(np.float64) for _, c in per_feature))
    batches = (global_ids(train_ids(source, i)) for i in range(stats_batches))
    return RowCounts.from_batches(batches, bag_sizes)


def choose(
    h: HotConfig,
    plan: EmbeddingPlan,
    mesh,
    source: DataSource,
    calibration_steps: int,
    cluster: Cluster,
    threads: int,
    log=print,
    dynamic: Sequence[int] = (),
    to_rows: Callable[[list[np.ndarray]], list[np.ndarray]] = lambda batches: batches,
) -> tuple[EmbeddingPlan, HotSchedule | None]:
    """``plan`` with its hot rows (the ``embedding.hot`` section ``h``; ``h.rows``: a number, or
    ``auto`` for the cost model pricing sets on ``cluster``), the bucket capacities measured
    with them masked out, and the schedule that starts from the chosen rows (None when no rows
    are replicated; it gathers counts with ``threads`` threads).

    ``dynamic``: tables whose ids are raw ids given rows by their maps as training runs
    (``embedding.ids``): none of their rows is hot at first (no map holds an id yet); the
    schedule counts the rows the maps give, so refreshes make them hot. ``to_rows``: the data's
    batches as the owners will see them (dynamic tables' raw ids: their home rows), for
    measuring the buckets."""
    if h.rows == "auto" and mesh.size == 1:
        log("hot rows: none (one device: no exchange for replication to save)")
        return plan, None
    if h.rows == "auto" and len(set(dynamic)) == len(plan.tables):  # (it priced the empty set alone)
        log(
            "hot rows: none (every table is dynamic: no row is known before the maps give them; "
            "a number with embedding.hot.refresh_every makes the rows of frequent ids hot as training runs)"
        )
        return plan, None
    bags = tuple(t.spec.bag_size for t in plan.tables)
    counts = initial_counts(source, h.stats_batches, bags).without(set(dynamic))
    batches = to_rows([global_ids(train_ids(source, i)) for i in range(calibration_steps)])

    def measure(host_batches):  # global batches: every process measures the same
        return measure_capacities(plan, host_batches, plan.capacity_factor)

    if h.rows == "auto":
        best, priced = choose_hot_rows(plan, measure, counts, batches, int(h.memory_mb * 2**20), cluster)
        rows, capacity = [counts.most_frequent(t, k) for t, k in enumerate(best.rows_per_table)], best.rows
        log(
            f"hot rows: the cost model priced {len(priced)} sets on the {cluster.name} cluster profile:\n"
            + "\n".join(
                f"  {c.rows:>9,} rows  hit rate {100 * c.hit_rate:5.1f}%  all-to-all {c.a2a_bytes:>11,} B"
                f"  all-reduce {c.allreduce_bytes:>11,} B  predicted {1e3 * c.predicted_s:>9.3f} ms"
                f"{'  <- chosen' if c is best else ''}"
                for c in priced
            )
        )
    else:
        capacity = min(h.rows, sum(tp.spec.rows for tp in plan.tables))
        if capacity < h.rows:  # (more was a buffer and an all-reduce a step of rows that do not exist)
            log(f"hot rows: embedding.hot.rows={h.rows:,} is more than the tables' {capacity:,} rows: {capacity:,}")
        rows = counts.top_rows(capacity)
    no_hot = measure(batches) if plan.capacities else ()
    capacities = measure([mask_hot(b, rows, bags) for b in batches]) if plan.capacities else ()
    plan = hot_plan(plan, rows, capacities, no_hot, counts, capacity)
    if plan.hot is None:
        return plan, None
    schedule = HotSchedule(
        plan.hot_rows,
        bags,
        counts,
        window=h.stats_batches,
        refresh_every=h.refresh_every,
        decay=h.decay,
        gather=gather_counts,
        threads=threads,
    )
    return plan, schedule
