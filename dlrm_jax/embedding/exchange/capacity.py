"""Bucket capacities of the ids exchange, measured on the host from batches of ids.

The ids form sends each owner at most C distinct rows per step (``C``: the part's compiled
capacity). Training and ``dlrm-jax plan`` both size C here, from the same first batches, so the
plan predicts what the step compiles: per ids part, ``headroom`` x the most distinct (owner,
row) requests that one device's share of a batch sends one owner. Numpy on the calling thread;
the routing is ``routing.route``, the step's own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from dlrm_jax.embedding.exchange.routing import route
from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan, ExchangeKind
from dlrm_jax.embedding.plan.layout import KIND_BLOCK, KIND_CYCLIC, Group, exchange_parts
from dlrm_jax.embedding.plan.search import TableStats
from dlrm_jax.embedding.plan.specs import TableSpec
from dlrm_jax.ids import PAD_ID


def busiest_owner(g: Group, ids_local: np.ndarray) -> int:
    """The most distinct rows one owner is asked for by one device holding ``ids_local``
    (int32 [B_l, S], the device's share of a batch)."""
    vids = ids_local[:, g.vslot_slot]
    owner, row, valid = route(vids, g.vslot_kind, g.vslot_device, g.vslot_offset, g.vslot_block, g.num_devices, xp=np)
    key = owner.astype(np.int64)[valid] * g.local_rows + row[valid]
    return int(np.bincount(np.unique(key) // g.local_rows, minlength=g.num_devices).max(initial=0))


def measure_capacities(
    plan: EmbeddingPlan, id_batches: Iterable[np.ndarray], headroom: float
) -> tuple[tuple[str, int], ...]:
    """Per ids part of ``plan``: (group name, ``headroom`` x the busiest owner's distinct
    requests over every device's share of ``id_batches``). Each batch holds consecutive
    devices' rows (``plan.global_batch / plan.num_devices`` each): a process's rows, or a
    global batch. Several processes take the maximum of their results."""
    parts = [p.group for p in exchange_parts(plan) if p.kind == ExchangeKind.IDS]
    local = plan.global_batch // plan.num_devices
    most = dict.fromkeys((g.name for g in parts), 0)
    for ids in id_batches:
        ids = np.asarray(ids)
        for start in range(0, ids.shape[0], local):
            for g in parts:
                most[g.name] = max(most[g.name], busiest_owner(g, ids[start : start + local]))
    return tuple((name, max(1, math.ceil(headroom * m))) for name, m in most.items())


def table_stats(
    specs: list[TableSpec], id_batches: Iterable[np.ndarray], num_devices: int, local_batch: int
) -> list[TableStats]:
    """Per table, what the planner estimates buckets from (``plan.search.TableStats``): over
    every device's share (``local_batch`` rows) of ``id_batches``, the mean distinct rows one
    device looks up, and the most it asks of one owner were the table split by rows over all
    ``num_devices`` devices, in blocks and cyclically."""
    starts = np.concatenate([[0], np.cumsum([s.bag_size for s in specs])])
    distinct, chunks = np.zeros(len(specs)), 0
    busiest = {kind: np.zeros(len(specs)) for kind in (KIND_BLOCK, KIND_CYCLIC)}
    for ids in id_batches:
        ids = np.asarray(ids)
        for start in range(0, ids.shape[0], local_batch):
            chunks += 1
            for t, spec in enumerate(specs):
                block = -(-spec.rows // num_devices)
                sub = ids[start : start + local_batch, starts[t] : starts[t + 1]]
                # Routing (routing.route) maps each id to one (owner, row): distinct ids are the
                # distinct requests, and their owners are id // block (blocks) or id % N (cyclic).
                rows = np.unique(sub[sub != PAD_ID]).astype(np.int64)
                distinct[t] += rows.size
                for kind, owner in ((KIND_BLOCK, rows // block), (KIND_CYCLIC, rows % num_devices)):
                    most = np.bincount(owner, minlength=num_devices).max(initial=0)
                    busiest[kind][t] = max(busiest[kind][t], most)
    return [
        TableStats(float(d / max(chunks, 1)), float(b), float(c))
        for d, b, c in zip(distinct, busiest[KIND_BLOCK], busiest[KIND_CYCLIC], strict=True)
    ]
