"""Sizes and bytes of the sharded id maps (:mod:`dlrm_jax.embedding.dynamic.sharded`): the
buffers a resolution routes ids in, a map's memory a device, the bytes each of a step's
resolution paths sends, and the plan report's lines on dynamic tables."""

from __future__ import annotations

from dlrm_jax.embedding.dynamic.idmap import MapSpec


def route_capacities(ids: int, devices: int) -> list[int]:
    """The buffers one device's distinct ids for one owner are routed in (``ids``: a device's
    ids), least first: twice a fair share of a sixteenth, a quarter and all of them, and some
    (a batch repeats most ids: a device's distinct ids are often a quarter of them or fewer),
    each kept only where it is at most half the next one kept (each buffer is a copy of the
    routed path in the program, over a second of compile on CPU: one that saves less than
    half the bytes is not worth it; small batches, whose buffers the slack makes alike, keep
    one); none where routing saves nothing (few devices)."""
    fair = lambda k: 2 * -(-k // devices) + 64
    full = fair(ids)
    if devices == 1 or full >= ids:
        return []
    kept = [full]
    for k in sorted({fair(ids // d) for d in (16, 4)}, reverse=True):
        if 2 * k <= kept[-1]:
            kept.append(k)
    return kept[::-1]


def own_capacity(total: int, devices: int) -> int:
    """Ids of one device's shards of the gathered batch a resolution holds at once before it
    resolves them a few tables at a time: twice a fair share and some (hashing spreads ids
    evenly; a repeated id does not)."""
    return total if devices == 1 else min(total, 2 * -(-total // devices) + 64)


def map_bytes_per_device(spec: MapSpec, devices: int) -> int:
    """One device's bytes of a map split over ``devices``: its rows' keys, flags, recency and
    counts, and its shards' admission sketches."""
    return (spec.rows * spec.bytes_per_row() + spec.sketch_bytes()) // devices


def resolution_paths(ids_per_step: int, devices: int, rows_back: bool = True) -> list[dict[str, int]]:
    """Bytes a device sends to the others a step resolving the raw ids of the dynamic tables
    (``ids_per_step``: their ids over the whole batch), by collective, on each path a step may
    take, in the order :func:`~dlrm_jax.embedding.dynamic.sharded.sharded_resolve_fused` numbers them: routed, in each buffer of
    :func:`route_capacities` (each distinct id's table, words and count out, and with
    ``rows_back`` its row back), then gathered (every id's words and flag; the rows met in a
    max, a ring all-reduce). The per-table counts' sum and the one max choosing the path are
    left out."""
    n = devices
    routed = [{"all-to-all": (n - 1) * k * (16 + 4 * rows_back)} for k in route_capacities(ids_per_step // n, n)]
    return [
        *routed,
        {"all-gather": (n - 1) * ids_per_step * 12 // n, "all-reduce": 2 * (n - 1) * ids_per_step * 4 // n},
    ]


def resolution_bytes_per_device(ids_per_step: int, devices: int, rows_back: bool = True) -> tuple[int, int]:
    """The least and most bytes of :func:`resolution_paths` a device sends a step: of the routed
    paths (the gathered one is their fallback), or the gathered one where none is routed."""
    return least_and_most(resolution_paths(ids_per_step, devices, rows_back))


def least_and_most(paths: list[dict[str, int]]) -> tuple[int, int]:
    """The least and most bytes a device sends a step on ``paths`` (:func:`resolution_paths`'
    order, or ``DynamicTables.resolution_paths``'): of the routed ones (the gathered one is
    their fallback), or the gathered one where none is routed."""
    totals = [sum(p.values()) for p in paths[:-1] or paths]
    return min(totals), max(totals)


def maps_report(
    specs: dict[str, MapSpec],
    bags: dict[str, int],
    devices: int,
    batch: int,
    tiered=(),
    unsent: int = 0,
    rows_back: bool = True,
) -> str:
    """The plan report's lines on dynamic tables: their maps' memory and the raw ids' traffic;
    tiered ones' (``tiered``: their table indices, names ``cat_<index>``) are held whole on the
    host and resolved there. ``unsent``: bytes a device does not send a step where the lookups
    send their requests as the maps routed them (their row ids); ``rows_back``: whether a
    routed resolution sends the rows back (:func:`resolution_paths`)."""
    host = {k: s for k, s in specs.items() if int(k.removeprefix("cat_")) in set(tiered)}
    specs = {k: s for k, s in specs.items() if k not in host}
    lines = []
    if specs:
        memory = sum(map_bytes_per_device(s, devices) for s in specs.values())
        least, most = resolution_bytes_per_device(batch * sum(bags[name] for name in specs), devices, rows_back)
        per_row = {s.bytes_per_row() for s in specs.values()}
        lines.append(
            f"Dynamic tables ({', '.join(specs)}): id maps {memory / 2**20:,.2f} MiB a device "
            f"({'/'.join(map(str, sorted(per_row)))} B a row, sketches apart; beside the device table's totals, "
            f"counted in embedding.memory_budget_gb), "
            f"raw ids resolved: {least / 2**10:,.1f}-{most / 2**10:,.1f} KiB a step sent per device"
            " (as many distinct ids as the batch holds)"
            + (
                f"; their lookups send the requests as the maps routed them, {unsent / 2**10:,.1f} KiB a step"
                " fewer than the all-to-all above where they were routed"
                if unsent
                else ""
            )
        )
    if host:
        memory = sum(map_bytes_per_device(s, 1) for s in host.values())
        lines.append(
            f"Tiered dynamic tables ({', '.join(host)}): id maps {memory / 2**20:,.2f} MiB on the host "
            f"(whole; raw ids resolved there, in the planner thread)"
        )
    return "\n".join(lines)
