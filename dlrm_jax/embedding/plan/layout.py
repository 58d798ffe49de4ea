"""Fused arrays derived from a plan: which virtual tables share an array, and at which rows.

A *group* is one fused array: all replicated tables of one width, or all sharded pieces of
one slice width (whole tables, row blocks and column slices alike). A sharded group's array is
[N * local_rows, width], split over the mesh by rows, so device d holds rows
[d * local_rows, (d + 1) * local_rows): its local shard. Every piece of a table inside a group
is a *virtual table* with routing parameters (see :mod:`~dlrm_jax.embedding.exchange.routing`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from dlrm_jax.choices import SPARSE_OPTIMIZER_KINDS
from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan, RowLayout, Strategy

# Strategies whose tables live on the devices of one host (plan.host_size of them).
HOST_STRATEGIES = (Strategy.HOST_ROW, Strategy.HOST_COLUMN)

# Arrays over this many bytes are checkpointed in chunks of at most as many (train/checkpoint.py),
# and a chunk must divide a device's shard (each shard is written apart). A shard with a prime
# row count could only be stored one row a chunk: criteo_kaggle's replicated tables on one
# device, 33,762,577 rows, took minutes and ten times their memory to save. So such arrays' rows
# are padded to a multiple of a power of two near 1/256 of them (under 0.4% more rows, never
# read): chunks of 1/512 of the shard or more always divide it.
CHUNK_BYTES = 32 * 2**20


def storage_rows(rows: int, width: int) -> int:
    """``rows`` of one device's shard of ``width`` as stored: padded (see CHUNK_BYTES) when the
    shard is large enough to be checkpointed in chunks."""
    if rows * width * 4 <= CHUNK_BYTES:
        return rows
    quantum = 1 << ((rows // 256).bit_length() - 1)
    return -(-rows // quantum) * quantum


# How a virtual table's ids map to owners (the exchange's routing reads these).
KIND_FIXED = 0  # the owner is a fixed device (table-wise, column slice, or replicated)
KIND_BLOCK = 1  # row-wise, contiguous blocks: owner = device + id // block (device: the first)
KIND_CYCLIC = 2  # row-wise, cyclic: owner = id % N


@dataclass(frozen=True)
class VirtualTable:
    """A table, or one column slice of it, as placed in a group."""

    table: int  # index into plan.tables (= feature index)
    col_start: int  # first column of the table this piece holds
    kind: int  # KIND_FIXED, KIND_BLOCK or KIND_CYCLIC
    device: int  # KIND_FIXED on a sharded group: the owner; KIND_BLOCK: the first owner
    offset: int  # first local row
    block: int  # KIND_BLOCK: rows per device
    rows: int

    @property
    def span(self) -> int:
        """Devices holding rows of a row-wise piece (KIND_BLOCK: from ``device`` on)."""
        return -(-self.rows // self.block) if self.kind == KIND_BLOCK else 1


@dataclass(frozen=True)
class Group:
    """One fused array and the static routing of every virtual slot that reads it.

    Per virtual slot v (V of them): ``vslot_slot`` [V] batch slot, ``vslot_kind/device/offset/
    block`` [V] routing, ``vslot_cols`` [V, width] columns of the flattened pooled output
    [B, F * D] it fills, ``vslot_vfeature`` [V] its virtual feature; ``vfeature_cols`` [F', width].
    """

    name: str
    width: int
    replicated: bool
    local_rows: int  # rows of one device's shard (replicated: of the whole array)
    num_devices: int
    vtables: tuple[VirtualTable, ...]
    vslot_slot: np.ndarray
    vslot_kind: np.ndarray
    vslot_device: np.ndarray
    vslot_offset: np.ndarray
    vslot_block: np.ndarray
    vslot_cols: np.ndarray
    vslot_vfeature: np.ndarray
    vfeature_cols: np.ndarray

    @property
    def num_vslots(self) -> int:
        return int(self.vslot_slot.shape[0])

    @property
    def vslot_table(self) -> np.ndarray:
        """int [V]: the table each virtual slot reads."""
        return np.array([self.vtables[v].table for v in self.vslot_vfeature], np.int32)

    @property
    def has_column_slices(self) -> bool:
        """Whether some table here is split into column slices (several virtual tables)."""
        tables = [vt.table for vt in self.vtables]
        return len(set(tables)) < len(tables)

    @property
    def array_rows(self) -> int:
        return self.local_rows if self.replicated else self.num_devices * self.local_rows

    def max_capacity(self, local_batch: int) -> int:
        """Requests one device can send one owner, at most: every slot distinct."""
        return local_batch * self.num_vslots

    def capacity(self, local_batch: int, factor: float) -> int:
        """Compiled bucket size per owner: ``factor`` x the busiest owner's expected requests
        (each fixed-owner slot sends all its B_local ids to one device, a row-wise slot spreads
        them over N), never above the most that can occur."""
        load = np.zeros(self.num_devices)
        for v in self.vslot_vfeature:
            vt = self.vtables[v]
            if vt.kind == KIND_FIXED:
                load[vt.device] += local_batch
            elif vt.kind == KIND_BLOCK:
                load[vt.device : vt.device + vt.span] += local_batch / vt.span
            else:
                load += local_batch / self.num_devices
        return max(1, min(self.max_capacity(local_batch), math.ceil(factor * load.max())))


@dataclass(frozen=True)
class ExchangePart:
    """The virtual tables of one fused array that one exchange form serves, as a group of
    their own (same name, width and rows as the storage group; only these vtables' slots)."""

    kind: str  # its kind's name in part_kinds.PART_KINDS (an ExchangeKind for the built-in ones)
    group: Group


def _capacity(plan: EmbeddingPlan, g: Group) -> int:
    """Distinct-request bucket size per owner of an ids part: measured when the plan has it,
    else ``capacity_factor`` x the batch-size bound; never above the worst case."""
    local_batch = plan.local_batch
    measured = dict(plan.capacities).get(g.name)
    if measured is None:
        return g.capacity(local_batch, plan.capacity_factor)
    return max(1, min(g.max_capacity(local_batch), measured))


def group_capacity(plan: EmbeddingPlan, g: Group) -> int:
    """The compiled bucket size of an ids part (``g``: the part's group)."""
    return _capacity(plan, g)


def two_level_ids(plan: EmbeddingPlan, g: Group) -> bool:
    """Whether an ids part goes in two levels (``plan.ids_hosts`` > 1): not where
    :func:`why_ids_flat` says why not."""
    return plan.ids_hosts > 1 and not why_ids_flat(plan, g)


def why_ids_flat(plan: EmbeddingPlan, g: Group) -> str:
    """Why an ids part goes flat where the plan's hosts could take two levels ('' where it does
    not): column slices whose update needs whole-row statistics, or a plan with tiered tables
    (its device caches' exchange, every group's, is flat)."""
    if plan.tier is not None:
        return "the plan has tiered tables, whose device caches exchange flat"
    if needs_whole_rows(plan, g):
        return f"its column slices' {plan.optimizer} updates gather whole-row statistics flat"
    return ""


def two_level_keys(g: Group) -> tuple[str, str]:
    """The keys of a two-level ids part's stage-1 and stage-2 capacities in ``plan.capacities``."""
    return f"{g.name}:local", f"{g.name}:hosts"


def two_level_capacities(plan: EmbeddingPlan, g: Group) -> tuple[int, int]:
    """(C1, C2) of a two-level ids part: the distinct rows one device sends its relay for the
    owners of one local index, and one relay sends one host; measured when the plan has them,
    else every request (which no step can exceed)."""
    every = plan.local_batch * g.num_vslots
    host_devices = plan.num_devices // plan.ids_hosts
    measured = dict(plan.capacities)
    c1, c2 = (measured.get(k) for k in two_level_keys(g))
    return (
        every if c1 is None else max(1, min(every, c1)),
        host_devices * every if c2 is None else max(1, min(host_devices * every, c2)),
    )


def whole_rows_key(g: Group) -> str:
    """The key of a host-columns part's whole-row capacity in ``plan.capacities`` (beside the
    ids parts' buckets, which are keyed by the group's name alone)."""
    return f"{g.name}:whole_rows"


def needs_whole_rows(plan: EmbeddingPlan, g: Group) -> bool:
    """Whether the part's updates need each row's squared gradient over its whole width from
    the column slices' owners (row-wise Adagrad on a table split by columns)."""
    return SPARSE_OPTIMIZER_KINDS[plan.optimizer].whole_rows and g.has_column_slices


def whole_rows_capacity(plan: EmbeddingPlan, g: Group) -> int:
    """Distinct rows whose squared gradients a host-columns part's devices add up in one
    all-reduce (row-wise Adagrad): measured when the plan has it, else every position a
    device pools (the global batch times K), which no step can exceed. A step with more
    distinct rows adds the rest in further rounds of the same size."""
    positions = plan.global_batch * pooled_layout(plan, g).ids_per_sample
    measured = dict(plan.capacities).get(whole_rows_key(g))
    return positions if measured is None else max(1, min(positions, measured))


def pools_by_mean(plan: EmbeddingPlan, g: Group) -> bool:
    """Whether any bag of the group's tables is a mean (its lookups' weights are not all 1)."""
    return any(
        plan.tables[vt.table].spec.pooling == "mean" and plan.tables[vt.table].spec.bag_size > 1 for vt in g.vtables
    )


def gather_bytes_per_sample(plan: EmbeddingPlan, g: Group) -> int:
    """What a replicated group's gathered update sends per sample: each slot's row id (and
    weight, for means) and each feature's pooled gradient, float32."""
    return g.num_vslots * 4 * (1 + pools_by_mean(plan, g)) + len(g.vtables) * 4 * g.width


def host_size(plan: EmbeddingPlan) -> int:
    """Devices of one host that tables split within a host are split over (every such table's
    ``devices``; the plan's devices when it has none)."""
    return _host_size(plan.tables, plan.num_devices)


def _host_size(tables, num_devices: int) -> int:
    sizes = {len(tp.devices) for tp in tables if tp.strategy in HOST_STRATEGIES}
    if len(sizes) > 1:
        raise ValueError(f"tables within hosts span different host sizes {sorted(sizes)}: one host size per plan")
    return sizes.pop() if sizes else num_devices


@dataclass(frozen=True)
class PooledLayout:
    """Where a pooled part's bags travel (all static; ``exchange/pooled.py`` and
    ``exchange/host_pooled.py`` read it).

    An *owner* is a device (POOLED parts: table-wise tables and column slices) or a host
    (HOST_POOLED: tables split by rows over one host's devices); there are ``owners`` of them.
    Every owner holds up to J pieces, sorted by bag size, largest first. A request buffer row
    holds K = sum(piece_bags) ids: piece j of every owner at positions ``starts[j]:starts[j +
    1]``, so pooling is a static slice whatever the owner. ``send_slot`` [O, K]: the batch slot
    each position of the buffer to owner o carries (-1: none); ``row_offset`` [O, K]: its
    piece's first local row at o; ``block`` [O, K]: rows of the piece per device of a host (1
    for a device owner); ``k_piece`` [K]: the piece of each position; ``reply_index`` [V']: per
    virtual table of the part, its (owner, piece) as owner * J + piece; ``send_index`` [O * J]:
    the inverse (V' where no piece is)."""

    owners: int
    pieces: int
    piece_bags: tuple[int, ...]
    starts: tuple[int, ...]
    send_slot: np.ndarray
    row_offset: np.ndarray
    k_piece: np.ndarray
    reply_index: np.ndarray
    send_index: np.ndarray
    block: np.ndarray

    @property
    def ids_per_sample(self) -> int:
        """K: ids one device sends each owner per sample."""
        return self.starts[-1]


def pooled_layout(plan: EmbeddingPlan, g: Group) -> PooledLayout:
    """The static layout of a pooled part ``g``: its vtables all of fixed owners (POOLED), or
    all split by rows within hosts (HOST_POOLED: the owners are hosts). The planner's search
    asks for the same ones many times over: remembered (treat them as read-only)."""
    return _pooled_layout(plan.tables, g.vtables, g.num_devices)


@functools.lru_cache(maxsize=1024)
def _pooled_layout(tables: tuple, vtables: tuple, num_devices: int) -> PooledLayout:
    if any(tables[vt.table].strategy == Strategy.HOST_COLUMN for vt in vtables):  # one piece per table
        vtables = tuple(vt for vt in vtables if vt.col_start == 0)
    v_count = len(vtables)
    hosts = any(tables[vt.table].strategy in HOST_STRATEGIES for vt in vtables)
    host_devices = _host_size(tables, num_devices) if hosts else 1
    n = num_devices // host_devices
    device = np.array([vt.device // host_devices for vt in vtables], np.int64)
    table = np.array([vt.table for vt in vtables], np.int64)
    bag = np.array([tables[t].spec.bag_size for t in table], np.int64)
    order = np.lexsort((np.arange(v_count), -bag, device))  # by owner, largest bag first
    first = np.searchsorted(device[order], device[order], side="left")
    piece = np.empty(v_count, np.int64)
    piece[order] = np.arange(v_count) - first  # each vtable's place among its owner's
    pieces = int(piece.max()) + 1 if v_count else 0
    piece_bags = np.zeros(pieces, np.int64)
    np.maximum.at(piece_bags, piece, bag)
    starts = np.concatenate([[0], np.cumsum(piece_bags)])
    k = int(starts[-1])
    send_slot = np.full((n, k), -1, np.int32)
    row_offset = np.zeros((n, k), np.int32)
    slot_start = np.concatenate([[0], np.cumsum([tp.spec.bag_size for tp in tables])])
    within = np.concatenate([np.arange(b) for b in bag]) if v_count else np.zeros(0, np.int64)
    vt_of = np.repeat(np.arange(v_count), bag)
    send_slot[device[vt_of], starts[piece[vt_of]] + within] = slot_start[table[vt_of]] + within
    span = np.repeat(np.arange(v_count), piece_bags[piece])  # every position of each vtable's piece
    span_k = starts[piece[span]] + np.concatenate(
        [np.arange(piece_bags[piece[v]]) for v in range(v_count)] or [np.zeros(0, np.int64)]
    )
    row_offset[device[span], span_k] = np.array([vt.offset for vt in vtables], np.int64)[span]
    block = np.ones((n, k), np.int32)
    block[device[span], span_k] = np.array([vt.block for vt in vtables], np.int64)[span]
    reply = (device * pieces + piece).astype(np.int32)
    send_index = np.full(n * pieces, v_count, np.int32)
    send_index[reply] = np.arange(v_count)
    k_piece = np.repeat(np.arange(pieces), piece_bags).astype(np.int32)
    return PooledLayout(
        n,
        pieces,
        tuple(int(b) for b in piece_bags),
        tuple(int(x) for x in starts),
        send_slot,
        row_offset,
        k_piece,
        reply,
        send_index,
        block,
    )


def build_groups(plan: EmbeddingPlan) -> list[Group]:
    """The fused groups of a plan, in a fixed order (replicated first, then by width). They
    depend only on the tables' placement and the device count, and the planner's search asks
    for the same placements many times over: remembered (treat them as read-only)."""
    return list(_groups_of(plan.tables, plan.num_devices, plan.padded_rows))


@functools.lru_cache(maxsize=256)
def _groups_of(tables: tuple, n: int, padded: bool) -> tuple[Group, ...]:
    rows_of = storage_rows if padded else (lambda rows, width: rows)
    dim = tables[0].spec.dim
    slots_of = _slots_of_tables(tables)
    groups = []
    rep = [t for t, tp in enumerate(tables) if tp.strategy == Strategy.REPLICATED]
    if rep:
        vts, offset = [], 0
        for t in rep:
            vts.append(VirtualTable(t, 0, KIND_FIXED, 0, offset, 1, tables[t].spec.rows))
            offset += tables[t].spec.rows
        groups.append(_group("replicated", dim, True, rows_of(offset, dim), n, vts, slots_of, dim))
    widths = sorted({tp.slice_dim for tp in tables if tp.strategy != Strategy.REPLICATED}, reverse=True)
    for width in widths:
        vts, used = [], np.zeros(n, np.int64)
        # Row-wise pieces first: they sit at the same local offset on every device.
        for t, tp in enumerate(tables):
            if tp.strategy == Strategy.ROW and tp.slice_dim == width:
                blk = tp.rows_per_device(n)
                kind = KIND_CYCLIC if tp.row_layout == RowLayout.CYCLIC else KIND_BLOCK
                vts.append(VirtualTable(t, 0, kind, 0, int(used.max()), blk, tp.spec.rows))
                used[:] = used.max() + blk
        # Then pieces within one host: the same local offset on each device of their host.
        for t, tp in enumerate(tables):
            if tp.strategy in HOST_STRATEGIES and tp.slice_dim == width:
                blk, devs = tp.rows_per_device(n), list(tp.devices)
                offset = int(used[devs].max())
                if tp.strategy == Strategy.HOST_ROW:
                    vts.append(VirtualTable(t, 0, KIND_BLOCK, tp.devices[0], offset, blk, tp.spec.rows))
                else:
                    vts += [
                        VirtualTable(t, j * width, KIND_FIXED, d, offset, 1, tp.spec.rows) for j, d in enumerate(devs)
                    ]
                used[devs] = offset + blk
        for t, tp in enumerate(tables):
            if tp.strategy in (Strategy.TABLE, Strategy.COLUMN) and tp.slice_dim == width:
                for j, dev in enumerate(tp.devices):
                    vts.append(VirtualTable(t, j * width, KIND_FIXED, dev, int(used[dev]), 1, tp.spec.rows))
                    used[dev] += tp.spec.rows
        local = rows_of(int(used.max()), width)
        groups.append(_group(f"sharded_w{width}", width, False, local, n, vts, slots_of, dim))
    return tuple(groups)


def _slots_of_tables(tables) -> list[list[int]]:
    out, start = [], 0
    for tp in tables:
        out.append(list(range(start, start + tp.spec.bag_size)))
        start += tp.spec.bag_size
    return out


def _group(name, width, replicated, local_rows, n, vts, slots_of, dim) -> Group:
    """Per virtual slot (each vtable's slots in order) its slot, routing, columns and vtable."""
    field = lambda attr: np.array([getattr(vt, attr) for vt in vts], np.int64)
    counts = np.array([len(slots_of[vt.table]) for vt in vts], np.int64)
    vfeature = np.repeat(np.arange(len(vts)), counts)
    vfeature_cols = (field("table") * dim + field("col_start"))[:, None] + np.arange(width)  # [V', W]
    slot = np.concatenate([slots_of[vt.table] for vt in vts]) if vts else np.zeros(0, np.int64)
    arr = lambda x: np.asarray(x, np.int32)
    return Group(
        name,
        width,
        replicated,
        max(local_rows, 1),
        n,
        tuple(vts),
        arr(slot),
        arr(field("kind")[vfeature]),
        arr(field("device")[vfeature]),
        arr(field("offset")[vfeature]),
        arr(field("block")[vfeature]),
        arr(vfeature_cols[vfeature].reshape(-1, width)),
        arr(vfeature),
        arr(vfeature_cols.reshape(-1, width)),
    )


def subgroup(plan: EmbeddingPlan, g: Group, vts) -> Group:
    """``g`` restricted to the virtual tables ``vts`` (same array: name, width, rows)."""
    return _group(
        g.name,
        g.width,
        g.replicated,
        g.local_rows,
        g.num_devices,
        list(vts),
        _slots_of_tables(plan.tables),
        plan.tables[0].spec.dim,
    )


def is_identity(index: np.ndarray) -> bool:
    """Whether a static index lists 0, 1, 2, ... in order (flattened)."""
    return bool(np.array_equal(index.reshape(-1), np.arange(index.size)))
