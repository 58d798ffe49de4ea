"""Bucket capacities of the ids exchange (and the distinct rows a host-columns part adds up),
measured on the host from batches of ids.

The ids form sends each owner at most C distinct rows per step (``C``: the part's compiled
capacity). Training and ``dlrm-jax plan`` both size C here, from the same first batches, so the
plan predicts what the step compiles: per ids part, ``headroom`` x the most distinct (owner,
row) requests that one device's share of a batch sends one owner. Numpy on the calling thread;
the routing is ``routing.route``, the step's own.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import numpy as np

from dlrm_jax.embedding.exchange.routing import route
from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan, ExchangeKind
from dlrm_jax.embedding.plan.estimates import TableStats
from dlrm_jax.embedding.plan.layout import (
    KIND_BLOCK,
    KIND_CYCLIC,
    Group,
    needs_whole_rows,
    pooled_layout,
    two_level_ids,
    two_level_keys,
    whole_rows_key,
)
from dlrm_jax.embedding.plan.part_kinds import exchange_parts
from dlrm_jax.embedding.plan.specs import TableSpec
from dlrm_jax.ids import PAD_ID

# Values one sort takes at once: shares of a batch smaller than this are sorted many to a sort
# (a loop over 512 devices' shares of 128 rows is Python-bound: Kaggle's statistics 1.2 s by
# device, 0.3 s so), larger ones alone, in their own width (a sort that fits the cache, and of
# int32, runs about twice as fast per value as one of millions: DLRM-DCNv2's 1.0 s, not 2.6 s).
_SORT_CHUNK = 1 << 14


def distinct_by_share(value: np.ndarray, valid: np.ndarray, rows: int, span: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of each share of ``rows`` consecutive rows of ``value`` [B, ...]
    (ints in [0, ``span``) where ``valid``), as sorted (share, value) int64 pairs."""
    batch = value.shape[0]
    if rows * math.prod(value.shape[1:]) >= _SORT_CHUNK:
        parts = [sorted_distinct(value[a : a + rows][valid[a : a + rows]]) for a in range(0, batch, rows)]
        share = np.repeat(np.arange(len(parts), dtype=np.int64), [p.size for p in parts])
        return share, np.concatenate(parts).astype(np.int64)
    counts = np.add.reduceat(valid.reshape(batch, -1).sum(1), np.arange(0, batch, rows))
    return distinct_pairs(np.repeat(np.arange(counts.size, dtype=np.int64), counts), value[valid], span)


def distinct_pairs(share: np.ndarray, value: np.ndarray, span: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (share, value) pairs of two int64 arrays (``share`` non-decreasing, 0 <=
    value < ``span``), sorted: shares are cut into sorts of about _SORT_CHUNK values."""
    ends = np.unique(np.searchsorted(share, share[_SORT_CHUNK::_SORT_CHUNK])).tolist() + [share.size]
    shares, values = [], []
    for a, b in zip([0, *ends[:-1]], ends, strict=True):
        if b - a >= _SORT_CHUNK and share[a] == share[b - 1]:  # one large share: its values alone
            values.append(sorted_distinct(value[a:b]))
            shares.append(np.full(values[-1].size, share[a]))
        else:
            key = sorted_distinct(share[a:b] * span + value[a:b])
            shares.append(key // span)
            values.append(key % span)
    return np.concatenate(shares), np.concatenate(values)


def _requests(g: Group, ids: np.ndarray, local: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Every device's distinct requests (rows ``ids`` int32 [B, S], ``local`` rows a device)
    as (device, owner * local_rows + row) int64 arrays, routed as the step routes; and how
    many devices."""
    vids = ids[:, g.vslot_slot]
    owner, row, valid = route(vids, g.vslot_kind, g.vslot_device, g.vslot_offset, g.vslot_block, g.num_devices, xp=np)
    key = owner.astype(np.int64) * g.local_rows + row
    device, key = distinct_by_share(key, valid, local, g.num_devices * g.local_rows)
    return device, key, -(-ids.shape[0] // local)


# Ids routed at once when measuring the busiest owner: a few devices' shares of a batch at a
# time, so that `plan` of a large global batch holds a bounded part of it routed (at 512
# devices and 1M samples of DLRM-DCNv2 it held every one: 11.4 GB).
_MEASURE_CHUNK = 1 << 22


def busiest_owner(g: Group, ids: np.ndarray, local: int) -> int:
    """The most distinct rows one owner is asked for by one device, over the devices holding
    ``ids`` (int32 [B, S], ``local`` rows each: consecutive devices' shares of a batch),
    measured a few devices at a time (each device's count is its own)."""
    rows = local * max(1, _MEASURE_CHUNK // max(local * ids.shape[1], 1))
    n, most = g.num_devices, 0
    for a in range(0, ids.shape[0], rows):
        device, key, devices = _requests(g, ids[a : a + rows], local)
        most = max(most, int(np.bincount(device * n + key // g.local_rows, minlength=devices * n).max(initial=0)))
    return most


def two_level_counts(g: Group, ids_host: np.ndarray, hosts: int, local: int) -> tuple[int, int]:
    """For the rows ``ids_host`` of one host's devices (``local`` each, in device order): the
    most distinct requests one device sends its relay for the owners of one local index (C1),
    and the most one relay sends one owner host, its host's requests merged (C2)."""
    host_devices = g.num_devices // hosts
    device, key, devices = _requests(g, ids_host, local)
    owner = key // g.local_rows
    most1 = np.bincount(device * host_devices + owner % host_devices, minlength=devices * host_devices).max(initial=0)
    merged = sorted_distinct(key) // g.local_rows
    return int(most1), int(np.bincount(merged, minlength=g.num_devices).max(initial=0))


def sorted_distinct(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` (flattened, sorted), by a sort: numpy's hash-based ``unique`` is
    about 80x slower on hundreds of thousands of mostly distinct ids (0.53 s against 6 ms)."""
    s = np.sort(values, axis=None)
    return s[np.concatenate([[True], s[1:] != s[:-1]])] if s.size else s


def count_distinct(values: np.ndarray) -> int:
    """How many distinct values ``values`` (non-negative ints) holds: by marking a bitmap when
    it is not much larger than the values (faster than sorting millions of ids), else by
    :func:`sorted_distinct`."""
    if not values.size:
        return 0
    bound = int(values.max()) + 1
    if bound <= max(1 << 24, 16 * values.size):
        seen = np.zeros(bound, np.bool_)
        seen[values] = True
        return int(np.count_nonzero(seen))
    return int(sorted_distinct(values).size)


def busiest_host(plan: EmbeddingPlan, g: Group, ids: np.ndarray) -> int:
    """The most distinct rows one host's devices pool of a host-columns part ``g`` for the
    batch rows ``ids`` (int32 [B, S]): what their whole-row statistics add up. A host's tables
    sit at disjoint rows of its devices (``layout``), so that is the sum of its tables'
    distinct ids, each table counted once however many hosts ask."""
    host_devices = g.num_devices // pooled_layout(plan, g).owners
    starts = np.concatenate([[0], np.cumsum([tp.spec.bag_size for tp in plan.tables])])
    hosts: dict[int, int] = {}
    for vt in g.vtables:
        if vt.col_start == 0:  # one slice of each table names its host
            sent = ids[:, starts[vt.table] : starts[vt.table + 1]]
            host = vt.device // host_devices
            hosts[host] = hosts.get(host, 0) + count_distinct(sent[sent != PAD_ID])
    return max(hosts.values(), default=0)


def measure_capacities(
    plan: EmbeddingPlan, id_batches: Iterable[np.ndarray], headroom: float
) -> tuple[tuple[str, int], ...]:
    """Per ids part of ``plan``: (group name, ``headroom`` x the busiest owner's distinct
    requests over every device's share of ``id_batches``); per host-columns part with
    row-wise Adagrad: (``whole_rows_key``, ``headroom`` x the most distinct rows a host pools,
    scaled up to the global batch when a batch holds fewer rows); per two-level ids part, its
    two stages' (scaled up likewise when a batch holds part of a host). Each batch holds
    consecutive devices' rows (``plan.global_batch / plan.num_devices`` each): a process's
    rows, or a global batch. Several processes take the maximum of their results."""
    if plan.tiered_tables:
        # A tiered table's cache slots go to the owner of the row each stands for, one slot a
        # row: its requests are counted by its rows, routed as on the devices. (Routed through
        # the cache's size, the rows' owners were wrong: buckets a third of the need, every
        # step overflowing.)
        tables = tuple(dataclasses.replace(tp, cache_rows=0) for tp in plan.tables)
        plan = dataclasses.replace(plan, tables=tables)
    parts = [p.group for p in exchange_parts(plan) if p.kind == ExchangeKind.IDS]
    host_columns = [
        p.group
        for p in exchange_parts(plan)
        if p.kind == ExchangeKind.HOST_COLUMNS and needs_whole_rows(plan, p.group) and plan.num_devices > 1
    ]
    local = plan.local_batch
    most = dict.fromkeys((g.name for g in parts), 0) | dict.fromkeys((whole_rows_key(g) for g in host_columns), 0)
    two_level = [g for g in parts if two_level_ids(plan, g)]
    most |= dict.fromkeys((k for g in two_level for k in two_level_keys(g)), 0)
    host_rows = plan.global_batch // max(plan.ids_hosts, 1)
    for ids in id_batches:
        ids = np.asarray(ids)
        for g in parts:
            most[g.name] = max(most[g.name], busiest_owner(g, ids, local))
        for start in range(0, ids.shape[0], host_rows):
            rows = ids[start : start + host_rows]
            # A process holding 1/P of a host's rows (one process per GPU) scales its merged
            # count by P: an upper bound of the host's (the union of P parts is at most their
            # sum, and processes agree on the largest), where its own count would fall short
            # and every step would overflow into the flat form.
            share = host_rows / max(rows.shape[0], 1)
            for g in two_level:
                c1, c2 = two_level_counts(g, rows, plan.ids_hosts, local)
                for key, count in zip(two_level_keys(g), (c1, math.ceil(share * c2)), strict=True):
                    most[key] = max(most[key], count)
        scale = plan.global_batch / max(ids.shape[0], 1)  # distinct rows grow slower: over-counts
        for g in host_columns:
            most[whole_rows_key(g)] = max(most[whole_rows_key(g)], math.ceil(scale * busiest_host(plan, g, ids)))
    return tuple((name, max(1, math.ceil(headroom * m))) for name, m in most.items())


def table_stats(
    specs: list[TableSpec], id_batches: Iterable[np.ndarray], num_devices: int, local_batch: int, host_devices: int = 1
) -> list[TableStats]:
    """Per table, what the planner estimates buckets from (``plan.estimates.TableStats``): over
    every device's share (``local_batch`` rows) of ``id_batches``, the mean distinct rows one
    device looks up, and the most it asks of one owner were the table split by rows over all
    ``num_devices`` devices, in blocks and cyclically; a whole batch's distinct rows; with
    hosts of ``host_devices`` devices (> 1), the most one host's devices together ask of one owner."""
    starts = np.concatenate([[0], np.cumsum([s.bag_size for s in specs])])
    distinct, chunks, batches = np.zeros(len(specs)), 0, 0
    in_batch = np.zeros(len(specs))
    kinds = (KIND_BLOCK, KIND_CYCLIC)
    busiest = {kind: np.zeros((len(specs), num_devices)) for kind in kinds}  # per table and owner
    host_busiest = {kind: np.zeros((len(specs), num_devices)) for kind in kinds}

    def most_of_one_owner(share, rows, spec, shares):  # per split: each owner's most from one share
        block, n = -(-spec.rows // num_devices), num_devices
        return [
            np.bincount(share * n + owner, minlength=shares * n).reshape(shares, n).max(0)
            for owner in (rows // block, rows % n)
        ]

    for ids in id_batches:
        ids = np.asarray(ids)
        batches += 1
        devices = -(-ids.shape[0] // local_batch)
        chunks += devices
        for t, spec in enumerate(specs):
            sub = ids[:, starts[t] : starts[t + 1]]
            # Routing (routing.route) maps each id to one (owner, row): distinct ids are the
            # distinct requests, and their owners are id // block (blocks) or id % N (cyclic).
            device, rows = distinct_by_share(sub, sub != PAD_ID, local_batch, spec.rows)
            distinct[t] += rows.size
            for kind, most in zip(kinds, most_of_one_owner(device, rows, spec, devices), strict=True):
                np.maximum(busiest[kind][t], most, out=busiest[kind][t])
            hosts = devices // host_devices
            if host_devices > 1 and hosts:  # whole hosts only: their devices' rows merged
                whole = device < hosts * host_devices
                host, rows = distinct_pairs(device[whole] // host_devices, rows[whole], spec.rows)
                for kind, most in zip(kinds, most_of_one_owner(host, rows, spec, hosts), strict=True):
                    np.maximum(host_busiest[kind][t], most, out=host_busiest[kind][t])
        # The whole batch's distinct rows, scaled up to a global batch when fewer rows were
        # read (distinct rows grow slower than the batch: an over-estimate).
        scale = num_devices * local_batch / max(ids.shape[0], 1)
        for t in range(len(specs)):
            sub = ids[:, starts[t] : starts[t + 1]]
            in_batch[t] += scale * count_distinct(sub[sub != PAD_ID])
    out = []
    for t in range(len(specs)):
        block, cyclic = (tuple(float(x) for x in busiest[k][t]) for k in kinds)
        host = tuple(tuple(float(x) for x in host_busiest[k][t]) for k in kinds) if host_devices > 1 else None
        out.append(
            TableStats(
                float(distinct[t] / max(chunks, 1)),
                max(block, default=0.0),
                max(cyclic, default=0.0),
                float(in_batch[t] / max(batches, 1)),
                (block, cyclic),
                host,
            )
        )
    return out
