"""Dynamic tables over a collection: raw 64-bit ids resolved to rows by each table's id map
(``embedding/dynamic``), the rows given to new ids reset, then the collection's own lookup and
sparse update, unchanged.

A dynamic table is a row-wise table whose blocks are its map's: device d holds map rows
[d * R/n, (d + 1) * R/n) and the same logical rows of the table, so the map's fresh rows are
reset where they live, with no communication, and a checkpoint's tables and maps restore onto
another device count alike (the planner lays them out in blocks: ``PlanOptions.block_rows``). A fresh row starts as its new id's own initial
vector (a hash of the seed, the table and the id: the same whichever row or device it lands
on) and its optimizer state as the optimizer's initial state. With ``new_rows="shared"`` the
vector starts from its shard's shared row as well (that row's value before the step plus the
id's own initial vector): the id keeps what it was trained through while it had no row.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlrm_jax.choices import NewRows
from dlrm_jax.embedding.dynamic.idmap import STATS, IdMap, MapSpec, init_map
from dlrm_jax.embedding.dynamic.sharded import (
    FreshRows,
    check_split,
    fuse_maps,
    map_devices,
    sharded_resolve_fused,
    side_by_side,
    split_maps,
)
from dlrm_jax.embedding.dynamic.sizing import resolution_paths
from dlrm_jax.embedding.exchange.collection import EmbeddingCollection, EmbeddingState
from dlrm_jax.embedding.exchange.common import RESOLUTION_SCOPE
from dlrm_jax.embedding.exchange.fresh_rows import RESET_CHUNK, reset_fresh_rows, reset_replicated_rows
from dlrm_jax.embedding.exchange.sharded import IdsForm
from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan, ExchangeKind
from dlrm_jax.embedding.plan.layout import KIND_BLOCK, Group, VirtualTable, group_capacity, two_level_ids
from dlrm_jax.embedding.plan.part_kinds import exchange_parts
from dlrm_jax.ids import PAD_ID
from dlrm_jax.parallel.mesh import AXIS, HOST_AXIS

FUSED = "__fused__"  # the step's maps: every dynamic table's in one (by_table: each its own)


def routed_lookup_group(plan: EmbeddingPlan, groups: list[Group], dynamic: list[int]) -> Group | None:
    """The group whose lookups send their requests as the id maps routed them
    (``sharded.Route``), or None: the one group holding every dynamic table (``dynamic``: their
    indices, in order) and nothing else, its slots theirs in order, all exchanged as ids in one
    level, over more than two devices (where the maps route ids at all)."""
    placed = {g.name: g for g in groups for vt in g.vtables if vt.table in set(dynamic)}
    if len(placed) != 1 or plan.num_devices <= 2:
        return None
    (g,) = placed.values()
    bags = np.cumsum([0, *(tp.spec.bag_size for tp in plan.tables)])
    columns = np.concatenate([np.arange(bags[t], bags[t + 1]) for t in dynamic])
    parts = [p for p in exchange_parts(plan, groups) if p.group.name == g.name]
    if g.replicated or len(g.vtables) != len(dynamic) or not np.array_equal(g.vslot_slot, columns):
        return None
    return g if len(parts) == 1 and parts[0].kind == ExchangeKind.IDS and not two_level_ids(plan, g) else None


def rows_sent_back(routed: bool, hot: bool, parts: bool) -> bool:
    """Whether a routed resolution sends each id's row back to the device that looked it up:
    unless the lookups reuse the route (``routed``: :func:`routed_lookup_group` has a group)
    and nothing else reads the rows: no hot rows (their lookup does) and no extra sparse parts
    (``parts``: Wide&Deep's wide part does). Else only the owners know the rows, and a step
    whose lookups cannot reuse the route has them sent by the lookup (a collective fewer in the
    others: on 8 simulated devices, 7% of stream's step)."""
    return not routed or hot or parts


def unsent_row_id_bytes(plan: EmbeddingPlan, g: Group) -> int:
    """The row ids a device does not send a step where the lookups of ``g`` (the
    :func:`routed_lookup_group`) reuse the maps' routing: its forward's all-to-all of buckets."""
    return (plan.num_devices - 1) * group_capacity(plan, g) * 4


class DynamicTables:
    """``collection``'s tables named in ``maps`` ({table index: its MapSpec}) take raw ids.
    ``resolve`` turns a batch's raw ids into the collection's ids and resets the fresh rows;
    the rest of a step is the collection's. ``new_rows``: what a fresh row's vector starts from
    (:class:`~dlrm_jax.choices.NewRows`): its id's initial vector, or that plus its shard's
    shared row. ``only_lookups``: nothing but the collection's ``lookup``, given the route
    ``resolve`` returns, reads the batch's rows of these tables (no extra sparse parts), so
    where it can reuse the route the rows need not travel back (:attr:`rows_back`)."""

    # new_rows="shared": the shards' shared rows gathered once a step into a small array that
    # each fresh row reads (:func:`~dlrm_jax.embedding.exchange.fresh_rows.reset_fresh_rows`); False: each fresh entry gathers its own (the tests'
    # reference for the same bits)
    shared_by_shard = True

    def __init__(
        self,
        collection: EmbeddingCollection,
        maps: Mapping[int, MapSpec],
        new_rows: str = NewRows.SHARED,
        only_lookups: bool = False,
    ):
        if new_rows not in set(NewRows):
            raise ValueError(f"new_rows={new_rows!r}: one of {', '.join(NewRows)}")
        self.collection, self.mesh, self.maps, self.new_rows = collection, collection.mesh, dict(maps), new_rows
        n = map_devices(self.mesh)
        self.where: dict[int, tuple[Group, VirtualTable]] = {}
        for t, spec in self.maps.items():
            name = collection.plan.tables[t].spec.name
            try:
                check_split(spec.check(), n)
            except ValueError as e:
                raise ValueError(f"table {name}: {e} (embedding.dynamic.vshards)") from None
            placed = [(g, vt) for g in collection.groups for vt in g.vtables if vt.table == t]
            g, vt = placed[0]
            whole = g.replicated and n == 1  # one device: the table whole, its rows as the map's
            if spec.rows != vt.rows or len(placed) > 1 or not (whole or (not g.replicated and vt.kind == KIND_BLOCK)):
                raise ValueError(f"table {name}: a dynamic table is row-wise in whole blocks of its {spec.rows} rows")
            if not whole and (vt.block * n != spec.rows or vt.device != 0):
                raise ValueError(f"table {name}: its {spec.rows} rows must split evenly over the {n} devices")
            if t in collection.tiered_tables:
                raise ValueError(f"table {name}: dynamic tables are not tiered")
            if collection.hot is not None and g.width != collection.hot.dim:
                raise ValueError(f"table {name}: its rows are {g.width} wide, the hot rows {collection.hot.dim}")
            self.where[t] = (g, vt)
        self.map_sharding = IdMap(*(NamedSharding(self.mesh, P(AXIS)),) * 6)
        self._names = {t: collection.plan.tables[t].spec.name for t in self.maps}
        specs = [self.maps[t] for t in self.maps]
        self._split = jax.jit(
            lambda m: dict(zip([self._names[t] for t in self.maps], split_maps(specs, n, m), strict=True)),
            out_shardings={self._names[t]: self.map_sharding for t in self.maps},
        )
        self._join = jax.jit(lambda ms: fuse_maps(specs, n, ms), out_shardings=self.map_sharding)
        self.reset_chunk = RESET_CHUNK
        bags = [tp.spec.bag_size for tp in collection.plan.tables]
        self._starts = np.cumsum([0, *bags])  # each feature's first slot in a batch's ids
        self._bags = tuple(bags[t] for t in self.maps)
        self._columns = np.concatenate([np.arange(self._starts[t], self._starts[t + 1]) for t in self.maps])
        self._every_column = np.array_equal(self._columns, np.arange(self._starts[-1]))
        self.routed_group = self._routed_group()
        # whether a routed resolution's ids are rows (else placeholders the lookup fills in)
        self.rows_back = rows_sent_back(self.routed_group is not None, collection.hot is not None, not only_lookups)

    def _routed_group(self) -> str | None:
        """:func:`routed_lookup_group`'s name, where this collection's form of it is the plain
        ids form (no copies over hosts)."""
        coll = self.collection
        g = routed_lookup_group(coll.plan, coll.groups, list(self.maps))
        if g is None or coll.agree_over is not None or HOST_AXIS in self.mesh.shape:
            return None
        forms = [f for f in coll.forms if f.group.name == g.name]
        return g.name if len(forms) == 1 and isinstance(forms[0], IdsForm) else None

    def names(self) -> dict[int, str]:
        """{table index: its name}: the maps' keys in checkpoints and exports."""
        return dict(self._names)

    def init_maps(self) -> dict[str, IdMap]:
        """Empty maps as the step holds them: every table's fused into one (``{FUSED: IdMap}``,
        :func:`~dlrm_jax.embedding.dynamic.sharded.fuse_maps`), sharded over the devices."""
        return self.joined({self._names[t]: init_map(spec) for t, spec in self.maps.items()})

    def maps_sharding(self, by_table: bool = False) -> dict[str, IdMap]:
        """The maps' shardings as the step holds them, or (``by_table``) as :meth:`by_table` gives them."""
        return dict.fromkeys(self._names.values() if by_table else [FUSED], self.map_sharding)

    def by_table(self, maps: dict) -> dict[str, IdMap]:
        """The step's fused maps as each table's own, by table name (whole maps, sharded over
        the devices by rows): what checkpoints and exports hold, the same on any device count."""
        if FUSED not in maps:
            return dict(maps)
        return self._split(maps[FUSED])

    def joined(self, maps: dict) -> dict[str, IdMap]:
        """The inverse of :meth:`by_table`."""
        if FUSED in maps:
            return dict(maps)
        return {FUSED: self._join([maps[self._names[t]] for t in self.maps])}

    def resolve(
        self,
        emb: EmbeddingState,
        maps: dict,
        raw: dict | tuple,
        ids_bs: jax.Array,
        step,
        key: jax.Array,
        learn=True,
    ):
        """``raw``: the dynamic tables' raw ids as :meth:`raw_ids` gives them, or {table: (hi, lo,
        valid)} uint32/uint32/bool [B, bag] of each one's feature (batch-sharded); ``ids_bs``: int32 [B, S], the other features' ids (the dynamic
        features' slots are overwritten). Returns (emb with fresh rows reset, maps, ids_bs,
        counts per table, the fresh rows: for :meth:`reset_replicated`, the resolution's path:
        an index into :meth:`resolution_paths`, and ``{group name: sharded.Route}`` for the
        collection's ``lookup`` to send the ids as they were routed, or {}). ``learn=False``
        (evaluation): the maps are read, nothing is reset. Without :attr:`rows_back`, a routed
        step's ids of the dynamic tables are placeholders (0 for an id, PAD_ID for padding):
        only the owners know the rows, and the lookup takes them from the route where it
        cannot reuse it (``sharded_resolve_fused``'s ``rows_later``). Traceable: call it inside
        the step."""
        tables = list(self.maps)
        if isinstance(raw, dict):  # by table: side by side, as raw_ids gives them
            raw, _ = side_by_side([raw[t] for t in tables])
        offsets = None if self.routed_group is None else tuple(self.where[t][1].offset for t in tables)
        with jax.named_scope(RESOLUTION_SCOPE):  # (its collectives told apart: bench exchange)
            rows, fused, fresh, counts, path, route = sharded_resolve_fused(
                [self.maps[t] for t in tables],
                self.mesh,
                maps[FUSED],
                raw,
                step,
                learn,
                self._bags,
                offsets,
                not self.rows_back,
            )
        if learn:
            emb = self._reset(emb, fresh, key)
            maps = {FUSED: fused}
        rows = rows.astype(ids_bs.dtype)
        ids_bs = rows if self._every_column else ids_bs.at[:, self._columns].set(rows)
        stats = {t: dict(zip(STATS, counts[j], strict=True)) for j, t in enumerate(tables)}
        return emb, maps, ids_bs, stats, fresh, path, {} if route is None else {self.routed_group: route}

    def resolution_paths(self, batch: int) -> list[dict[str, int]]:
        """Bytes a device sends a step resolving a global ``batch``'s raw ids, by collective, on
        each path :meth:`resolve` may take (``sizing.resolution_paths``). Where the lookups
        send their requests as a routed path sent them (:attr:`routed_group`), that path's
        all-to-all is less the row ids the lookup's forward does not send: the plan's bytes
        count them (a step whose busiest owner exceeds the exchange's capacity sends them)."""
        ids = batch * sum(int(self._starts[t + 1] - self._starts[t]) for t in self.maps)
        paths = resolution_paths(ids, map_devices(self.mesh), self.rows_back)
        if self.routed_group is None:
            return paths
        unsent = self.unsent_row_id_bytes()
        return [{**p, "all-to-all": p["all-to-all"] - unsent} if "all-to-all" in p else p for p in paths]

    def unsent_row_id_bytes(self) -> int:
        """:func:`unsent_row_id_bytes` of :attr:`routed_group` (0 without one)."""
        if self.routed_group is None:
            return 0
        (g,) = [g for g in self.collection.groups if g.name == self.routed_group]
        return unsent_row_id_bytes(self.collection.plan, g)

    def raw_ids(self, ids_bs: jax.Array, raw: jax.Array | None) -> tuple:
        """(hi, lo, valid) uint32/uint32/bool [B, R] of the dynamic tables' slots of a batch, one
        table's bag after another in table order: ``raw`` uint32 [B, 2, R] (high and low halves
        of their ids; :func:`raw_columns`), or without it the batch's own ids (``ids_bs`` int32
        [B, S], taken as ids below 2**31). ``valid``: the slot is not padding in ``ids_bs``.
        :meth:`resolve` takes it (or {table: (hi, lo, valid)})."""
        ids = ids_bs if self._every_column else ids_bs[:, self._columns]
        if raw is None:
            return jnp.zeros(ids.shape, jnp.uint32), ids.astype(jnp.uint32), ids != PAD_ID
        return raw[:, 0], raw[:, 1], ids != PAD_ID

    def _reset(self, emb: EmbeddingState, fresh: FreshRows, key, hot_found=None) -> EmbeddingState:
        """:func:`~dlrm_jax.embedding.exchange.fresh_rows.reset_fresh_rows` of these tables."""
        return reset_fresh_rows(self, emb, fresh, key, hot_found)

    def reset_replicated(self, collection: EmbeddingCollection, state: EmbeddingState, fresh: FreshRows, lr):
        """``collection``: tables replicated on every device whose table t has as many rows as
        this one's dynamic table t (Wide&Deep's wide part, trained at rate ``lr``); ``state``
        with the rows ``fresh`` gave to new ids reset on every device
        (:func:`~dlrm_jax.embedding.exchange.fresh_rows.reset_replicated_rows`). Traceable:
        call it inside the step, after :meth:`resolve`."""
        return reset_replicated_rows(self, collection, state, fresh, lr)


class CachedDynamicTables(DynamicTables):
    """Tiered dynamic tables (``maps``: {table index: MapSpec}, in the order of the host maps'
    tables): the host resolves their ids (``dynamic.host_maps``) and the tier runner hands each
    step the device-cache slots given to new ids (:class:`FreshRows`, each device's own
    slots); :meth:`reset` resets them after the step's fills, as :class:`DynamicTables` resets
    its rows: the same initial vector per id and the optimizer's initial state."""

    def __init__(self, collection: EmbeddingCollection, maps: Mapping[int, MapSpec], new_rows=NewRows.SHARED):
        # new_rows=shared: the host places each fresh row's shard's shared row in the step's
        # caches (or finds it hot) and says where (FreshRows.shared, fresh_hot's last columns)
        self.collection, self.mesh, self.maps = collection, collection.mesh, dict(maps)
        self.new_rows = NewRows(new_rows)
        self.reset_chunk = RESET_CHUNK
        self.where = {}
        for t in self.maps:
            name = collection.plan.tables[t].spec.name
            placed = [(g, vt) for g in collection.groups for vt in g.vtables if vt.table == t]
            if t not in collection.tiered_tables or len(placed) != 1 or placed[0][1].kind != KIND_BLOCK:
                raise ValueError(f"table {name}: a tiered dynamic table is row-wise in whole blocks of cache slots")
            self.where[t] = placed[0]

    def reset(self, emb: EmbeddingState, fresh: FreshRows, hot_found: jax.Array, key: jax.Array) -> EmbeddingState:
        """``emb`` with the cache slots ``fresh`` names (each device's slot within its block of
        the table's device view) reset, and the hot rows given to new ids (a hot row of a
        tiered table never takes a cache slot): ``hot_found`` int32 [H, 4], per hot slot
        whether it was given out, its table (an index into the maps) and its new id's words
        (``new_rows="shared"``: [H, 6], and where its shared row is: device and cache slot, or
        -1 and hot slot). Traceable."""
        return self._reset(emb, fresh, key, hot_found if emb.hot is not None else None)
