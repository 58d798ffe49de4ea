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
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlrm_jax.choices import NewRows
from dlrm_jax.chunks import in_chunks, in_chunks_on_cpu
from dlrm_jax.embedding.dynamic.idmap import STATS, IdMap, MapSpec, control_flow_of, id_hash, init_map, shared_row_of
from dlrm_jax.embedding.dynamic.sharded import (
    FreshRows,
    check_split,
    fuse_maps,
    map_devices,
    resolution_paths,
    sharded_resolve_fused,
    side_by_side,
    split_maps,
)
from dlrm_jax.embedding.exchange.collection import EmbeddingCollection, EmbeddingState
from dlrm_jax.embedding.exchange.initializer import hash_uniform
from dlrm_jax.embedding.exchange.sharded import IdsForm
from dlrm_jax.embedding.hot.index import split_hot
from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan, ExchangeKind
from dlrm_jax.embedding.plan.layout import KIND_BLOCK, Group, VirtualTable, group_capacity, two_level_ids
from dlrm_jax.embedding.plan.part_kinds import exchange_parts
from dlrm_jax.ids import PAD_ID
from dlrm_jax.parallel.mesh import AXIS, HOST_AXIS, varying

RESET_CHUNK = 512  # fresh rows a reset writes at a time
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
    # each fresh row reads (:meth:`_reset`); False: each fresh entry gathers its own (the tests'
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
        self._where: dict[int, tuple[Group, VirtualTable]] = {}
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
            self._where[t] = (g, vt)
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
        offsets = None if self.routed_group is None else tuple(self._where[t][1].offset for t in tables)
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
        each path :meth:`resolve` may take (``sharded.resolution_paths``). Where the lookups
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

    def _in_chunks(self, parts: tuple, count: jax.Array, carry, write):
        """``chunks.in_chunks`` of fresh entries (``parts``: rows first, -1 where none, then
        what else ``write`` takes, each [N]), ``reset_chunk`` at a time (a row reset twice is
        reset once): the tables updated in place, the work following the fresh rows (most steps
        of a filled map give out few). Inside shard_map. On one GPU, every entry at once
        (``chunks.in_chunks_on_cpu``: a loop's predicate is read on the host each chunk, and a
        filling map gives out thousands of rows a step; entries past the fresh ones reset
        nothing); on several devices each chunk meets in a sum, so the chunks stay."""
        if map_devices(self.mesh) > 1:
            return in_chunks(parts, count, self.reset_chunk, carry, write)
        form = control_flow_of(self.maps.values())
        return in_chunks_on_cpu(parts, count, self.reset_chunk, carry, write, form)

    def _reset(self, emb: EmbeddingState, fresh: FreshRows, key, hot_found=None) -> EmbeddingState:
        """Every dynamic table's fresh rows reset, in one program and one write per group: a
        device writes its fresh rows' entries only (never the whole block). A fresh row that is
        hot is reset in the hot group too, on every device: each device finds which of its own
        fresh rows are hot (the step's hash index of the hot keys) and the hot slots' new ids
        meet in one sum over the devices (a row has one owner), [H, 4] whatever the batch.
        ``hot_found``: those [H, 4] entries (new id's flag, table, id's words) given instead,
        replicated (tiered tables: the host knows which hot rows it gave out; [H, 6] with
        ``new_rows="shared"``: and where it placed each one's shared row, device and slot)."""
        opt = self.collection.optimizer
        seed_2 = jax.random.key_data(key).astype(jnp.uint32).reshape(-1)[:2]
        tables = list(self.maps)  # fresh.table indexes these
        by_name = {self._where[t][0].name: self._where[t][0] for t in tables}
        groups = sorted(by_name)
        const = lambda values, dtype=jnp.int32: jnp.asarray(np.asarray(values), dtype)
        group_of = [groups.index(self._where[t][0].name) for t in tables]
        offsets = np.asarray([self._where[t][1].offset for t in tables])
        offset = const(offsets)
        col_start = const([self._where[t][1].col_start for t in tables])
        scale = const([1.0 / self.maps[t].rows ** 0.5 for t in tables], jnp.float32)
        table_index = const(tables)
        block = const([self.maps[t].rows // map_devices(self.mesh) for t in tables])  # a device's rows of each
        slots_of = const([self.maps[t].slots for t in tables])
        warm = self.new_rows == NewRows.SHARED
        hot = emb.hot
        parts = (fresh.rows, fresh.table, fresh.hi, fresh.lo)
        if warm and fresh.shared is not None:
            parts += (fresh.shared,)
        given = () if hot is None or hot_found is None else (hot_found,)
        n_given = len(given)
        # new_rows="shared" (rows the devices place): every shard's shared row here, gathered
        # once into a small array each fresh row reads (``shard_values``), where there are
        # fewer shared rows than fresh entries. Gathered from the table being written, a value
        # per entry was a [N, width] array of its own (on one GPU at criteo_kaggle's batch,
        # 1.7M entries: 480 MB a step); from a small array the reset's write reads its own.
        shards_here = [self.maps[t].vshards // map_devices(self.mesh) for t in tables]
        in_group = {name: [i for i, g in enumerate(group_of) if g == gi] for gi, name in enumerate(groups)}
        per_shard = (
            warm
            and self.shared_by_shard
            and fresh.shared is None
            and sum(shards_here) <= fresh.rows.shape[0] // map_devices(self.mesh)
        )
        first_shared = {}  # per group, each table's first shard's place in its shard_values array
        for name, mine in in_group.items() if per_shard else ():
            starts = np.zeros(len(tables), np.int64)
            starts[mine] = np.cumsum([0] + [shards_here[i] for i in mine])[:-1]
            first_shared[name] = const(starts)

        def initial(table, hi, lo, width, dtype, base=None):
            """The new ids' initial vectors (``table``: indices into ``tables``) and optimizer
            state: a function of the seed, the table and the id alone, wherever the row is
            (plus ``base``, float32, where given: their shared rows' values)."""
            cols = col_start[table][:, None] + lax.iota(jnp.int32, width)[None, :]
            u = hash_uniform(seed_2, table_index[table][:, None], id_hash(hi, lo)[:, None], cols)
            values = (2.0 * u - 1.0) * scale[table][:, None]
            if base is not None:
                values = base + values
            return values.astype(dtype), opt.init(jnp.zeros((table.shape[0], width), dtype))

        def shared_rows(arrays, hot_state, hot_index, rows, table, name, placed=None):
            """float32 [k, width]: the value of each fresh row's shard's shared row (slot 0 of
            its shard, on this device) before the step: the hot copy where the row is hot.
            ``placed``: where the host put it instead (tiered tables: :attr:`FreshRows.shared`)."""
            if placed is not None:
                values = arrays[name][jnp.where(placed >= 0, offset[table] + placed, 0)].astype(jnp.float32)
                if hot_state is None:
                    return values
                from_hot = hot_state.values[jnp.maximum(-2 - placed, 0), : values.shape[1]].astype(jnp.float32)
                return jnp.where(placed[:, None] <= -2, from_hot, values)
            local = shared_row_of(rows, slots_of[table])
            values = arrays[name][jnp.where(rows >= 0, offset[table] + local, 0)].astype(jnp.float32)
            if hot_state is None:
                return values
            logical = jnp.where(rows >= 0, lax.axis_index(AXIS) * block[table] + local, PAD_ID)
            at, _ = split_hot(logical[None, :], table_index[table], *hot_index)
            from_hot = hot_state.values[jnp.maximum(at[0], 0), : values.shape[1]].astype(jnp.float32)
            return jnp.where(at[0][:, None] >= 0, from_hot, values)

        def shard_values(arrays, hot_state, hot_index):
            """{group: float32 [S, width]}: the value of every shared row of the group's dynamic
            tables on this device before the step (the hot copy where hot), table by table, a
            shard's at ``first_shared[group][table] + its index here``."""
            out = {}
            for name, mine in in_group.items():
                shards = [shards_here[i] for i in mine]
                local = np.concatenate(
                    [np.arange(k) * self.maps[tables[i]].slots for i, k in zip(mine, shards, strict=True)]
                )
                table = np.repeat(np.asarray(mine, np.int32), shards)
                values = arrays[name][offsets[table] + local].astype(jnp.float32)
                if hot_state is not None:
                    logical = lax.axis_index(AXIS) * block[table] + local
                    at, _ = split_hot(logical[None, :], table_index[table], *hot_index)
                    from_hot = hot_state.values[jnp.maximum(at[0], 0), : values.shape[1]].astype(jnp.float32)
                    values = jnp.where(at[0][:, None] >= 0, from_hot, values)
                out[name] = values
            return out

        def reset(arrays, slots, hot_state, hot_index, shard_base, rows, table, hi, lo, placed=None):
            """The fresh rows ``rows`` (-1: none) reset; and, with hot rows, per hot slot given
            to a new id here its entry (flag, table, id's words) and its shared row's value.
            ``shard_base``: :func:`shard_values`' arrays, or None (each entry gathers its own)."""
            before = arrays
            arrays, slots = dict(arrays), {g: dict(v) for g, v in slots.items()}
            entry_base = None  # each entry's shared row's value, from its own group's
            for gi, name in enumerate(groups):
                width, array = by_name[name].width, arrays[name]
                mine = (rows >= 0) & (const(group_of)[table] == gi)
                row = jnp.where(mine, offset[table] + rows, array.shape[0])  # others: dropped
                if shard_base is not None:  # (another group's entries read any: not written here)
                    at = jnp.where(mine, first_shared[name][table] + rows // slots_of[table], 0)
                    base = shard_base[name][at]
                else:
                    base = shared_rows(before, hot_state, hot_index, rows, table, name, placed) if warm else None
                if warm:
                    entry_base = base if entry_base is None else jnp.where(mine[:, None], base, entry_base)
                values, state = initial(table, hi, lo, width, array.dtype, base)
                arrays[name] = array.at[row].set(values, mode="drop")
                slots[name] = {s: v.at[row].set(state[s], mode="drop") for s, v in slots[name].items()}
            if hot is None or hot_found is not None:
                return arrays, slots, jnp.zeros((0, 4), jnp.int32), jnp.zeros((0, 0))
            logical = jnp.where(rows >= 0, lax.axis_index(AXIS) * block[table] + rows, PAD_ID)
            at, _ = split_hot(logical[None, :], table_index[table], *hot_index)
            entries = jnp.stack([jnp.ones_like(table), table, hi.view(jnp.int32), lo.view(jnp.int32)], 1)
            n_hot = hot.values.shape[0]
            slot = jnp.where(at[0] >= 0, at[0], n_hot)
            if warm:  # every dynamic table's rows are the hot rows' width
                hot_base = jnp.zeros((n_hot, hot.values.shape[1]), jnp.float32).at[slot].set(entry_base, mode="drop")
            else:
                hot_base = jnp.zeros((n_hot, 0))
            return arrays, slots, jnp.zeros((n_hot, 4), jnp.int32).at[slot].set(entries, mode="drop"), hot_base

        def given_hot_base(arrays, hot_state, found):
            """float32 [H, width]: per hot slot the host gave a new id (``found``: flag, table,
            id's words, then its shared row's device and slot there, device -1: a hot slot),
            its shared row's value: a sum of the holding device's and zeros, exact."""
            table, owner, at = found[:, 1], found[:, 4], found[:, 5]
            width = hot_state.values.shape[1]
            mine = (found[:, 0] > 0) & (owner == lax.axis_index(AXIS))
            base = jnp.zeros((found.shape[0], width), jnp.float32)
            for gi, name in enumerate(groups):
                here = mine & (const(group_of)[table] == gi)
                value = arrays[name][jnp.where(here, offset[table] + at, 0)].astype(jnp.float32)
                value = jnp.pad(value, ((0, 0), (0, width - value.shape[1])))
                base = jnp.where(here[:, None], value, base)
            base = lax.psum(base, AXIS)
            from_hot = hot_state.values[jnp.maximum(at, 0)].astype(jnp.float32)
            return jnp.where(((found[:, 0] > 0) & (owner < 0))[:, None], from_hot, base)

        def local(arrays, slots, hot_state, rows, table, hi, lo, *rest):
            placed, given = rest[: len(rest) - n_given], rest[len(rest) - n_given :]
            index = (hot_state.index, hot_state.seeds) if hot_state is not None else None
            n_hot = 0 if hot is None or hot_found is not None else hot.values.shape[0]
            hot_width = hot.values.shape[1] if n_hot and warm else 0

            shard_base = shard_values(arrays, hot_state, index) if per_shard else None

            def write(carry, *chunk):  # each hot slot is found by one entry at most (perhaps twice over)
                arrays, slots, found, found_base = carry
                arrays, slots, more, more_base = reset(arrays, slots, hot_state, index, shard_base, *chunk)
                if not n_hot:
                    return arrays, slots, found, found_base
                got = more[:, :1] > 0
                found_base = jnp.where(got, more_base, found_base) if hot_width else found_base
                return arrays, slots, jnp.where(got, more, found), found_base

            # (each device finds its own)
            carry = (arrays, slots, varying(jnp.zeros((n_hot, 4), jnp.int32)), varying(jnp.zeros((n_hot, hot_width))))
            parts = (rows, table, hi, lo, *placed)
            arrays, slots, found, found_base = self._in_chunks(parts, jnp.sum(rows >= 0), carry, write)
            if hot_state is None:
                return arrays, slots, hot_state
            # every hot slot given a new id this step, on every device (and its shared row's
            # value: a sum of one device's and zeros, exact)
            found = given[0] if given else lax.psum(found, AXIS)
            if given and warm:
                base = given_hot_base(arrays, hot_state, found)
            else:
                base = lax.psum(found_base, AXIS) if hot_width else None
            reset_here = found[:, 0] > 0
            new_ids = (found[:, 1], found[:, 2].view(jnp.uint32), found[:, 3].view(jnp.uint32))
            values, state = initial(*new_ids, hot_state.values.shape[1], hot_state.values.dtype, base)
            keep = lambda old, new: jnp.where(reset_here.reshape(-1, *[1] * (old.ndim - 1)), new, old)
            hot_state = hot_state._replace(
                values=keep(hot_state.values, values),
                slots={s: keep(v, state[s]) for s, v in hot_state.slots.items()},
            )
            return arrays, slots, hot_state

        tree_rows = lambda tree: jax.tree.map(lambda _: P(AXIS), tree)
        everywhere = lambda tree: jax.tree.map(lambda _: P(), tree)
        arrays = {g: emb.tables[g] for g in groups}
        slots = {g: emb.slots[g] for g in groups}
        arrays, slots, hot = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(
                tree_rows(arrays),
                tree_rows(slots),
                everywhere(hot),
                *(P(AXIS),) * len(parts),
                *(P(),) * n_given,
            ),
            out_specs=(tree_rows(arrays), tree_rows(slots), everywhere(hot)),
        )(arrays, slots, hot, *parts, *given)
        return emb._replace(tables={**emb.tables, **arrays}, slots={**emb.slots, **slots}, hot=hot)

    def reset_replicated(self, collection: EmbeddingCollection, state: EmbeddingState, fresh: FreshRows):
        """``collection``: tables replicated on every device whose table t has as many rows as
        this one's dynamic table t (Wide&Deep's wide part: one weight per row); ``state`` with
        the rows ``fresh`` gave to new ids set to zero (as that part starts; ``new_rows="shared"``:
        to their shards' shared rows' values) and their optimizer
        state to its initial state, on every device. Each device's fresh rows are gathered
        from all, a chunk at a time (:meth:`_in_chunks`, as many chunks as the device with the most
        needs). Traceable: call it inside the step, after :meth:`resolve`."""
        n, opt = map_devices(self.mesh), collection.optimizer
        tables = list(self.maps)  # fresh.table indexes these
        placed = {}
        for t in tables:
            (g, vt), *_ = [(g, vt) for g in collection.groups for vt in g.vtables if vt.table == t]
            if not g.replicated or vt.rows != self.maps[t].rows:
                raise ValueError(f"table {t}: not a replicated table of {self.maps[t].rows} rows")
            placed[t] = (g, vt)
        groups = sorted({g.name for g, _ in placed.values()})
        const = lambda values: jnp.asarray(np.asarray(values), jnp.int32)
        group_of = const([groups.index(placed[t][0].name) for t in tables])
        offset = const([placed[t][1].offset for t in tables])
        block = const([self.maps[t].rows // n for t in tables])
        slots_of = const([self.maps[t].slots for t in tables])
        width = {g.name: g.width for g, _ in placed.values()}

        def reset(arrays, slots, rows, table):
            arrays, slots = dict(arrays), {g: dict(v) for g, v in slots.items()}
            # Every device's entries, [n, k], on every device: a sum of each device's own row
            # (a sum is replicated by type; an all-gather's result is not, in shard_map).
            mine = (
                jnp.zeros((n, 2, rows.shape[0]), jnp.int32).at[lax.axis_index(AXIS)].set(jnp.stack([rows + 1, table]))
            )
            every = lax.psum(mine, AXIS)
            rows, table = every[:, 0] - 1, every[:, 1]
            logical = rows + lax.broadcasted_iota(jnp.int32, rows.shape, 0) * block[table]
            rows, logical, table = rows.reshape(-1), logical.reshape(-1), table.reshape(-1)
            for gi, name in enumerate(groups):
                array = arrays[name]
                at = jnp.where((rows >= 0) & (group_of[table] == gi), offset[table] + logical, array.shape[0])
                if self.new_rows == NewRows.SHARED:  # the shard's shared row's value before the step
                    shared = offset[table] + shared_row_of(logical, slots_of[table])
                    arrays[name] = array.at[at].set(array[shared], mode="drop")
                else:
                    arrays[name] = array.at[at].set(0, mode="drop")
                initial = opt.init(jnp.zeros((at.shape[0], width[name]), array.dtype))
                slots[name] = {s: v.at[at].set(initial[s], mode="drop") for s, v in slots[name].items()}
            return arrays, slots

        def local(arrays, slots, rows, table):
            most = lax.pmax(jnp.sum(rows >= 0), AXIS)  # as many chunks on every device (each meets in a sum)
            write = lambda carry, rows, table: reset(*carry, rows, table)
            return self._in_chunks((rows, table), most, (arrays, slots), write)

        everywhere = lambda tree: jax.tree.map(lambda _: P(), tree)
        arrays = {g: state.tables[g] for g in groups}
        slots = {g: state.slots[g] for g in groups}
        arrays, slots = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(everywhere(arrays), everywhere(slots), P(AXIS), P(AXIS)),
            out_specs=(everywhere(arrays), everywhere(slots)),
        )(arrays, slots, fresh.rows, fresh.table)
        return state._replace(tables={**state.tables, **arrays}, slots={**state.slots, **slots})


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
        self._where = {}
        for t in self.maps:
            name = collection.plan.tables[t].spec.name
            placed = [(g, vt) for g in collection.groups for vt in g.vtables if vt.table == t]
            if t not in collection.tiered_tables or len(placed) != 1 or placed[0][1].kind != KIND_BLOCK:
                raise ValueError(f"table {name}: a tiered dynamic table is row-wise in whole blocks of cache slots")
            self._where[t] = placed[0]

    def reset(self, emb: EmbeddingState, fresh: FreshRows, hot_found: jax.Array, key: jax.Array) -> EmbeddingState:
        """``emb`` with the cache slots ``fresh`` names (each device's slot within its block of
        the table's device view) reset, and the hot rows given to new ids (a hot row of a
        tiered table never takes a cache slot): ``hot_found`` int32 [H, 4], per hot slot
        whether it was given out, its table (an index into the maps) and its new id's words
        (``new_rows="shared"``: [H, 6], and where its shared row is: device and cache slot, or
        -1 and hot slot). Traceable."""
        return self._reset(emb, fresh, key, hot_found if emb.hot is not None else None)
