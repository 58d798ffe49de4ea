"""The kinds of exchange part, as the planner sees them: which pieces of the tables each serves,
the collectives it runs, its buffers, its device-memory traffic and its line in the plan's report.

One class per kind, registered in :data:`PART_KINDS` under the name the exchange builds its form
by (``embedding/exchange/forms.py``'s ``FORMS``). :func:`exchange_parts` splits a plan's groups
into parts by asking the registry: a replicated group takes the cheapest usable replicated kind;
each piece of a sharded group the one sharded kind that serves its table. The byte counts here
are what the compiled programs move (``tests/embedding/test_exchange_plan.py`` holds them to the
HLO), and the cost model prices them. Adding a kind: docs/sharding.md, "Adding a form".
"""

from __future__ import annotations

from typing import NamedTuple

from dlrm_jax.choices import SPARSE_OPTIMIZER_KINDS
from dlrm_jax.embedding.plan.embedding_plan import (
    DTYPE_BYTES,
    EmbeddingPlan,
    ExchangeKind,
    Strategy,
    TablePlan,
    optimizer_bytes_per_row,
    vector_bytes,
)
from dlrm_jax.embedding.plan.layout import (
    ExchangePart,
    Group,
    build_groups,
    gather_bytes_per_sample,
    group_capacity,
    needs_whole_rows,
    pooled_layout,
    pools_by_mean,
    subgroup,
    two_level_capacities,
    two_level_ids,
    whole_rows_capacity,
    why_ids_flat,
)

# Which devices a collective joins (cost.predict_step prices each over the links it crosses).
SPAN_ALL = "all"  # every device of the plan (times ``table_copies``)
SPAN_HOSTS = "hosts"  # one device of each host: only links between hosts
SPAN_HOST = "host"  # the devices of one host: only links within it

Link = tuple[str, float, str]  # (the collective as HLO names it, bytes one device sends, span)


class PartKind:
    """One kind of exchange part. A subclass sets ``name`` (its form's key in the exchange's
    ``FORMS``) and ``replicated``, and implements the byte model; the defaults say "serves
    nothing"."""

    name: str = ""
    replicated: bool = False  # serves a replicated group whole; else pieces of sharded groups

    def serves(self, plan: EmbeddingPlan, tp: TablePlan) -> bool:
        """(sharded kinds) Whether the pieces of table ``tp`` are exchanged this way: exactly
        one registered sharded kind serves each sharded table."""
        return False

    def usable(self, plan: EmbeddingPlan, devices: int) -> bool:
        """(replicated kinds) Whether this kind can serve a replicated group copied on
        ``devices`` devices; the usable one with the fewest bytes sent is chosen."""
        return True

    def links(self, plan: EmbeddingPlan, part: ExchangePart, table_copies: int = 1) -> list[Link]:
        """Every collective of one step of the part: (kind, bytes one device sends, span).
        ``table_copies``: copies of the tables that apply every update (embedding.sync=host_replicas:
        the hosts, each holding one)."""
        raise NotImplementedError

    def buffer_bytes(self, plan: EmbeddingPlan, part: ExchangePart) -> int:
        """Per device: the part's exchange buffers at the compiled sizes."""
        raise NotImplementedError

    def memory_traffic(self, plan: EmbeddingPlan, part: ExchangePart) -> tuple[float, float]:
        """(lookup, update) bytes one device reads and writes in device memory, at the compiled
        sizes (padding included: the step processes it)."""
        raise NotImplementedError

    def update_lookups(self, plan: EmbeddingPlan, part: ExchangePart) -> float:
        """Lookups one device's sparse update sorts and sums a step, each counted in
        ``memory_traffic``'s update bytes at :func:`update_bytes_per_value` a value (where the
        cost model has a measured rate per lookup, ``cost.Cluster.update_ns_per_lookup``, that
        rate prices them instead); 0: no such update (priced by its bytes alone)."""
        return 0.0

    def describe(self, plan: EmbeddingPlan, part: ExchangePart) -> tuple[str, str]:
        """(where the rows are, how the vectors travel): the part's line in the plan's report."""
        raise NotImplementedError


def update_bytes_per_value(plan: EmbeddingPlan, width: int) -> float:
    """Device-memory bytes an update moves per value of a row: the gradient out and in, the
    row and its optimizer state read and written, and the sort's share."""
    store, state = DTYPE_BYTES[plan.dtype], optimizer_bytes_per_row(plan.optimizer, width) / width
    return 8 + 2 * store + 2 * state + 16 / width


def _measured(plan: EmbeddingPlan, g: Group) -> str:
    return "measured on the data" if g.name in {name for name, _ in plan.capacities} else "from the batch size"


class AllReduce(PartKind):
    """Replicated: local lookups; the [rows, W] float32 gradient all-reduced (ring: 2 (n-1)/n
    of it). Not with FTRL, whose update rewrites every row it is given from (z, n); not on one
    device, where the gathered form is the plain sparse update."""

    name, replicated = ExchangeKind.ALLREDUCE.value, True

    def usable(self, plan, devices):
        return not SPARSE_OPTIMIZER_KINDS[plan.optimizer].rewrites_given_rows and devices > 1

    def links(self, plan, part, table_copies=1):
        m = plan.num_devices * table_copies
        return [("all-reduce", 2 * (m - 1) / m * part.group.local_rows * part.group.width * 4, SPAN_ALL)]

    def buffer_bytes(self, plan, part):
        return 2 * part.group.local_rows * part.group.width * 4

    def memory_traffic(self, plan, part):
        g, lb = part.group, plan.local_batch
        return lb * g.num_vslots * g.width * DTYPE_BYTES[plan.dtype], g.local_rows * g.width * update_bytes_per_value(
            plan, g.width
        )

    def describe(self, plan, part):
        return "on every device", "their gradients summed over the devices (all-reduce)"


class Gather(PartKind):
    """Replicated: local lookups; every device's row ids (and weights, for means) and pooled
    gradients all-gathered, and every device applies the same sparse update."""

    name, replicated = ExchangeKind.GATHER.value, True

    def links(self, plan, part, table_copies=1):
        lb = plan.local_batch
        return [
            (
                "all-gather",
                (plan.num_devices * table_copies - 1) * lb * gather_bytes_per_sample(plan, part.group),
                SPAN_ALL,
            )
        ]

    def buffer_bytes(self, plan, part):
        g, n = part.group, plan.num_devices
        return n * plan.local_batch * g.num_vslots * (4 + 4 * g.width)

    def memory_traffic(self, plan, part):
        g, n = part.group, plan.num_devices
        lb, w = plan.local_batch, g.width
        return lb * g.num_vslots * w * DTYPE_BYTES[plan.dtype], n * lb * g.num_vslots * w * update_bytes_per_value(
            plan, w
        )

    def update_lookups(self, plan, part):
        return plan.num_devices * plan.local_batch * part.group.num_vslots

    def describe(self, plan, part):
        return "on every device", "the batch's rows and gradients gathered to every device"


class Ids(PartKind):
    """Sharded, the requester pools: per owner C distinct row ids out, C vectors back and C
    gradients out (the owner kept the row ids; + C floats both ways of whole-row statistics for
    row-wise Adagrad on column slices). In two levels (``ids_hosts``): to each relay of the host C1 (host, row)
    pairs out, C1 vectors back and C1 gradients out, to each other host C2 rows out, C2 vectors
    back and C2 gradients out, and the two fullest buckets' counts all-reduced (the one-level
    overflow path not counted). With host replicas, owners all-gather what their counterparts
    received."""

    name = ExchangeKind.IDS.value

    def serves(self, plan, tp):
        return tp.exchange == ExchangeKind.IDS or (tp.exchange == ExchangeKind.POOLED and tp.strategy == Strategy.ROW)

    def links(self, plan, part, table_copies=1):
        g, n = part.group, plan.num_devices
        vec = vector_bytes(plan.exchange_dtype, g.width)
        if two_level_ids(plan, g):
            (c1, c2), h = two_level_capacities(plan, g), plan.ids_hosts
            host_devices = n // h
            return [
                ("all-to-all", (host_devices - 1) * c1 * (8 + 2 * vec), SPAN_HOST),
                ("all-to-all", (h - 1) * c2 * (4 + 2 * vec), SPAN_HOSTS),
                ("all-reduce", 2 * (n - 1) * 8 / n, SPAN_ALL),  # the fullest buckets, agreed
            ]
        c = group_capacity(plan, g)
        return [
            ("all-to-all", (n - 1) * c * (4 + 2 * vec) + (n - 1) * c * 8 * needs_whole_rows(plan, g), SPAN_ALL),
            ("all-gather", (table_copies - 1) * n * c * (4 + 4 * g.width), SPAN_ALL),
        ]

    def buffer_bytes(self, plan, part):
        g, n = part.group, plan.num_devices
        vec, c = vector_bytes(plan.exchange_dtype, g.width), group_capacity(plan, g)
        one_level = 2 * n * c * (4 + 2 * vec)
        if not two_level_ids(plan, g):
            return one_level
        (c1, c2), host_devices = two_level_capacities(plan, g), n // plan.ids_hosts
        # beside the one-level buffers of its overflow
        return one_level + 2 * host_devices * c1 * (8 + 2 * vec) + 2 * (n // host_devices) * c2 * (4 + 2 * vec)

    def memory_traffic(self, plan, part):
        # owners gather N x C rows; requesters pick every slot's vector and pool
        g, n = part.group, plan.num_devices
        lb, w = plan.local_batch, g.width
        rows, slots = n * group_capacity(plan, g), lb * g.num_vslots
        return (
            rows * w * (DTYPE_BYTES[plan.dtype] + 4) + slots * w * 8,
            rows * w * update_bytes_per_value(plan, w) + slots * w * 8,
        )

    def update_lookups(self, plan, part):
        return plan.num_devices * group_capacity(plan, part.group)  # the distinct rows sent to an owner

    def describe(self, plan, part):
        g, lb = part.group, plan.local_batch
        if two_level_ids(plan, g):
            (c1, c2), host_devices = two_level_capacities(plan, g), plan.num_devices // plan.ids_hosts
            return (
                f"in {g.width}-wide pieces, in two levels over {plan.ids_hosts} hosts of {host_devices}",
                f"each device's distinct rows go to the device of its host with the owner's local index, which "
                f"merges the host's and asks each host once: up to {c1:,} rows from each device to each of its "
                f"host's, {c2:,} from each to each host a step ({_measured(plan, g)}; "
                f"more run one level, up to {group_capacity(plan, g):,} rows from each device to each owner)",
            )
        flat = f", flat: {why_ids_flat(plan, g)}" if plan.ids_hosts > 1 else ""
        return (
            f"in {g.width}-wide pieces{flat}",
            f"each distinct row sent to the device that asked: up to {group_capacity(plan, g):,} rows from each "
            f"device a step, of at most {g.max_capacity(lb):,} ({_measured(plan, g)})",
        )


class _Bags(NamedTuple):
    """A pooled part's sizes: ``lb`` samples a device (B_l), ``k`` ids and ``j`` pieces per
    sample and owner (K, J), bytes of one ``id`` (with its weight for means) and one ``vec``tor
    on the wire, the ``owners`` (hosts, for the host kinds) and each one's ``devices``."""

    lb: int
    k: int
    j: int
    id: int
    vec: int
    owners: int
    devices: int


class _Pooled(PartKind):
    """What the kinds whose owners pool each bag share: the bags' ids go to the owners, the
    pooled vectors come back (B_l: the local batch, K ids and J pieces per sample)."""

    def _bags(self, plan, part) -> _Bags:
        g, lay = part.group, pooled_layout(plan, part.group)
        ids = 4 * (1 + pools_by_mean(plan, g))  # an id, and its weight for means
        vec = vector_bytes(plan.exchange_dtype, g.width)
        owners = lay.owners
        return _Bags(plan.local_batch, lay.ids_per_sample, lay.pieces, ids, vec, owners, plan.num_devices // owners)

    def memory_traffic(self, plan, part):
        g = part.group
        rows = self.update_lookups(plan, part)
        return rows * g.width * (DTYPE_BYTES[plan.dtype] + 4), rows * g.width * update_bytes_per_value(plan, g.width)

    def update_lookups(self, plan, part):
        return plan.num_devices * plan.local_batch * pooled_layout(plan, part.group).ids_per_sample


class Pooled(_Pooled):
    """Sharded on fixed owners (table-wise tables, column slices): per owner B_l x K ids (and
    weights for mean pooling) out, B_l x J vectors back and B_l x J gradients out (+ B_l x K
    floats both ways of whole-row statistics); with host replicas, owners all-gather what their
    counterparts received."""

    name = ExchangeKind.POOLED.value

    def serves(self, plan, tp):
        return tp.exchange == ExchangeKind.POOLED and tp.strategy in (Strategy.TABLE, Strategy.COLUMN)

    def links(self, plan, part, table_copies=1):
        b, g, n = self._bags(plan, part), part.group, plan.num_devices
        whole = needs_whole_rows(plan, g)
        return [
            ("all-to-all", (n - 1) * b.lb * (b.k * b.id + 2 * b.j * b.vec + b.k * 8 * whole), SPAN_ALL),
            ("all-gather", (table_copies - 1) * n * b.lb * b.k * (4 + 4 * g.width + 4 * whole), SPAN_ALL),
        ]

    def buffer_bytes(self, plan, part):
        b, w = self._bags(plan, part), part.group.width
        return plan.num_devices * b.lb * (b.k * (8 + 4 * w) + 2 * b.j * b.vec)

    def describe(self, plan, part):
        lay = pooled_layout(plan, part.group)
        return (
            f"in {part.group.width}-wide pieces",
            f"the device holding a piece sums each bag: {lay.ids_per_sample} ids in and {lay.pieces} "
            f"vector(s) out per sample and device",
        )


class _HostPooled(_Pooled):
    """Split within each host: every bag goes to its host (H hosts of G devices)."""

    def buffer_bytes(self, plan, part):  # every requester's ids and sums
        b, w = self._bags(plan, part), part.group.width
        return plan.num_devices * b.lb * (b.k * (8 + 4 * w) + b.j * (4 * w + b.vec)) + 2 * b.owners * b.lb * b.j * b.vec

    def describe(self, plan, part):
        lay, rows = pooled_layout(plan, part.group), isinstance(self, HostPooled)
        return (
            f"split by {'rows' if rows else 'columns'} within each of {lay.owners} host(s)",
            "each host's devices sum their "
            + (
                "rows of each bag and add the sums within the host"
                if rows
                else "columns of each bag and send each slice straight to its requester"
            )
            + f": {lay.ids_per_sample} ids in and {lay.pieces} vector(s) out per sample and host",
        )


class HostPooled(_HostPooled):
    """host_row tables with pooled exchange: to each other host B_l x K ids (and weights) out,
    B_l x J vectors back and B_l x J gradients out; within the host, the ids (and weights) and
    gradients of all H x G requesters all-gathered and their float32 partial sums
    reduce-scattered."""

    name = ExchangeKind.HOST_POOLED.value

    def serves(self, plan, tp):
        return tp.exchange == ExchangeKind.POOLED and tp.strategy == Strategy.HOST_ROW

    def links(self, plan, part, table_copies=1):
        b = self._bags(plan, part)
        h = b.owners
        return [
            ("all-to-all", (h - 1) * b.lb * (b.k * b.id + 2 * b.j * b.vec), SPAN_HOSTS),
            ("all-gather", (b.devices - 1) * h * b.lb * (b.k * b.id + b.j * b.vec), SPAN_HOST),
            ("reduce-scatter", (b.devices - 1) * h * b.lb * b.j * part.group.width * 4, SPAN_HOST),
        ]


class HostColumns(_HostPooled):
    """host_column tables with pooled exchange: the ids as host_pooled; each device's slices
    of the H x G requesters' vectors and gradients straight to and from them (all-to-all over
    every device; ``vec`` is one slice's), and with row-wise Adagrad one float per distinct row
    all-reduced (the rows' squared gradients over their whole width; ``whole_rows_capacity`` of
    them, the overflow rounds not counted)."""

    name = ExchangeKind.HOST_COLUMNS.value

    def serves(self, plan, tp):
        return tp.exchange == ExchangeKind.POOLED and tp.strategy == Strategy.HOST_COLUMN

    def links(self, plan, part, table_copies=1):
        b, g, n = self._bags(plan, part), part.group, plan.num_devices
        h, rows = b.owners, whole_rows_capacity(plan, g) * needs_whole_rows(plan, g)
        return [
            ("all-to-all", (h - 1) * b.lb * b.k * b.id, SPAN_HOSTS),
            ("all-to-all", (n - 1) * b.lb * 2 * b.j * b.vec, SPAN_ALL),
            ("all-gather", (b.devices - 1) * h * b.lb * b.k * b.id, SPAN_HOST),
            ("all-reduce", 2 * (b.devices - 1) * rows * 4 / b.devices, SPAN_HOST),
        ]


# Registration order matters twice: a group's parts come in this order, and among replicated
# kinds of equal bytes the first wins.
PART_KINDS: dict[str, PartKind] = {
    k.name: k for k in (AllReduce(), Gather(), Pooled(), HostPooled(), HostColumns(), Ids())
}


def part_kind(part: ExchangePart) -> PartKind:
    """The registered kind of ``part``."""
    return PART_KINDS[part.kind]


def replicated_kind(plan: EmbeddingPlan, g: Group, table_copies: int = 1) -> str:
    """The replicated kind that serves ``g`` with the fewest bytes sent per step (the first
    registered among equals): all-reducing the [rows, W] gradient or gathering the lookups."""
    usable = [k for k in PART_KINDS.values() if k.replicated and k.usable(plan, plan.num_devices * table_copies)]
    if not usable:
        raise ValueError(f"no registered replicated exchange kind can serve {g.name} with {plan.optimizer}")
    sent = [sum(b for _, b, _ in k.links(plan, ExchangePart(k.name, g), table_copies)) for k in usable]
    return usable[sent.index(min(sent))].name


def sharded_kind(plan: EmbeddingPlan, tp: TablePlan) -> str:
    """The one registered sharded kind that serves table ``tp``'s pieces."""
    serving = [k.name for k in PART_KINDS.values() if not k.replicated and k.serves(plan, tp)]
    if len(serving) != 1:
        raise ValueError(
            f"table {tp.spec.name} ({tp.strategy.value}, exchange {tp.exchange}): served by "
            f"{len(serving)} exchange kinds ({', '.join(serving) or 'none'}); exactly one must serve it"
        )
    return serving[0]


def exchange_parts(plan: EmbeddingPlan, groups: list[Group] | None = None) -> list[ExchangePart]:
    """Every group split into the parts its exchange forms serve: the replicated group whole;
    a sharded group's pieces by the kind serving their tables (table-wise tables and column
    slices exchanging pooled bags, tables split within a host, and the rest (row-wise tables,
    ids exchange) in an ids part), in registration order."""
    parts = []
    for g in build_groups(plan) if groups is None else groups:
        if g.replicated:
            parts.append(ExchangePart(replicated_kind(plan, g), g))
            continue
        by_table = {t: sharded_kind(plan, plan.tables[t]) for t in {vt.table for vt in g.vtables}}
        kinds = [by_table[vt.table] for vt in g.vtables]  # (a table's pieces: hundreds on many devices)
        for kind in PART_KINDS:
            vts = [vt for vt, k in zip(g.vtables, kinds, strict=True) if k == kind]
            if vts:
                parts.append(ExchangePart(kind, g if len(vts) == len(g.vtables) else subgroup(plan, g, vts)))
    return parts
