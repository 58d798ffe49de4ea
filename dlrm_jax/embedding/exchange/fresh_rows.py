"""The rows a step gave to new ids reset, inside the step: a dynamic table's fresh rows
(:class:`~dlrm_jax.embedding.dynamic.sharded.FreshRows`, each device's own) set to their new
ids' initial vectors and the optimizer's initial state, where the rows live, with no
communication but the hot rows' (a fresh row that is hot is reset in the hot copy on every
device) and, with ``new_rows="shared"``, each fresh row's vector started from its shard's
shared row's value before the step.

Each function takes ``dyn``, the :class:`~dlrm_jax.embedding.exchange.dynamic_tables.DynamicTables`
whose rows they reset (its ``maps``, ``mesh``, ``collection``, ``new_rows``, ``reset_chunk``,
``shared_by_shard`` and ``where``: {table index: (group, virtual table)}).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from dlrm_jax.choices import NewRows
from dlrm_jax.chunks import form_for_platform, in_chunks, in_chunks_on_cpu
from dlrm_jax.embedding.dynamic.idmap import control_flow_of, id_hash, shared_row_of
from dlrm_jax.embedding.dynamic.sharded import FreshRows, map_devices
from dlrm_jax.embedding.exchange.collection import EmbeddingCollection, EmbeddingState
from dlrm_jax.embedding.exchange.initializer import hash_uniform
from dlrm_jax.embedding.hot.index import split_hot
from dlrm_jax.ids import PAD_ID
from dlrm_jax.parallel.mesh import AXIS, varying

RESET_CHUNK = 512  # fresh rows a reset writes at a time


def reset_in_chunks(dyn, parts: tuple, count: jax.Array, carry, write):
    """``chunks.in_chunks`` of fresh entries (``parts``: rows first, -1 where none, then
    what else ``write`` takes, each [N]), ``reset_chunk`` at a time (a row reset twice is
    reset once): the tables updated in place, the work following the fresh rows (most steps
    of a filled map give out few). Inside shard_map. On one GPU, every entry at once
    (``chunks.in_chunks_on_cpu``: a loop's predicate is read on the host each chunk, and a
    filling map gives out thousands of rows a step; entries past the fresh ones reset
    nothing); on several devices each chunk meets in a sum, so the chunks stay."""
    if map_devices(dyn.mesh) > 1:
        return in_chunks(parts, count, dyn.reset_chunk, carry, write)
    form = form_for_platform(control_flow_of(dyn.maps.values()), dyn.mesh.devices.flat[0].platform)
    return in_chunks_on_cpu(parts, count, dyn.reset_chunk, carry, write, form)


def reset_fresh_rows(dyn, emb: EmbeddingState, fresh: FreshRows, key, hot_found=None) -> EmbeddingState:
    """Every dynamic table's fresh rows reset, in one program and one write per group: a
    device writes its fresh rows' entries only (never the whole block). A fresh row that is
    hot is reset in the hot group too, on every device: each device finds which of its own
    fresh rows are hot (the step's hash index of the hot keys) and the hot slots' new ids
    meet in one sum over the devices (a row has one owner), [H, 4] whatever the batch.
    ``hot_found``: those [H, 4] entries (new id's flag, table, id's words) given instead,
    replicated (tiered tables: the host knows which hot rows it gave out; [H, 6] with
    ``new_rows="shared"``: and where it placed each one's shared row, device and slot)."""
    opt = dyn.collection.optimizer
    seed_2 = jax.random.key_data(key).astype(jnp.uint32).reshape(-1)[:2]
    tables = list(dyn.maps)  # fresh.table indexes these
    by_name = {dyn.where[t][0].name: dyn.where[t][0] for t in tables}
    groups = sorted(by_name)
    const = lambda values, dtype=jnp.int32: jnp.asarray(np.asarray(values), dtype)
    group_of = [groups.index(dyn.where[t][0].name) for t in tables]
    offsets = np.asarray([dyn.where[t][1].offset for t in tables])
    offset = const(offsets)
    col_start = const([dyn.where[t][1].col_start for t in tables])
    scales = np.asarray([1.0 / dyn.maps[t].rows ** 0.5 for t in tables])
    scale = const(scales, jnp.float32)
    mantissa, exponent = np.frexp(scales)  # new_rows="shared": the scale on 11 significant bits (see ``initial``)
    short_scale = const(np.ldexp(np.round(mantissa * 2**11) / 2**11, exponent), jnp.float32)
    table_index = const(tables)
    block = const([dyn.maps[t].rows // map_devices(dyn.mesh) for t in tables])  # a device's rows of each
    slots_of = const([dyn.maps[t].slots for t in tables])
    warm = dyn.new_rows == NewRows.SHARED
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
    shards_here = [dyn.maps[t].vshards // map_devices(dyn.mesh) for t in tables]
    in_group = {name: [i for i, g in enumerate(group_of) if g == gi] for gi, name in enumerate(groups)}
    per_shard = (
        warm
        and dyn.shared_by_shard
        and fresh.shared is None
        and sum(shards_here) <= fresh.rows.shape[0] // map_devices(dyn.mesh)
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
        if base is None:
            values = (2.0 * u - 1.0) * scale[table][:, None]
        else:
            # A perturbation of the shared row that is exact in float32 (u on 12 bits, the scale
            # on 11: a product of at most 24), so base + it rounds once however XLA fuses the
            # two: contracted into one fused multiply-add in one program and not in another, a
            # row started 1 ulp apart in a tiered run and on the devices, which were to agree.
            u = jnp.floor(u * 4096.0) * (1.0 / 4096.0)
            values = base + (2.0 * u - 1.0) * short_scale[table][:, None]
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
                [np.arange(k) * dyn.maps[tables[i]].slots for i, k in zip(mine, shards, strict=True)]
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
        arrays, slots, found, found_base = reset_in_chunks(dyn, parts, jnp.sum(rows >= 0), carry, write)
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
        mesh=dyn.mesh,
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


def reset_replicated_rows(dyn, collection: EmbeddingCollection, state: EmbeddingState, fresh: FreshRows, lr):
    """``collection``: tables replicated on every device whose table t has as many rows as
    this one's dynamic table t (Wide&Deep's wide part: one weight per row); ``state`` with
    the rows ``fresh`` gave to new ids set to zero (as that part starts; ``new_rows="shared"``:
    to their shards' shared rows' values) and their optimizer
    state to its initial state for those values (``SparseOptimizer.state_for`` at the part's
    rate ``lr``: FTRL's weights follow from its state), on every device. Each device's fresh rows are gathered
    from all, a chunk at a time (:func:`reset_in_chunks`, as many chunks as the device with the most
    needs). Traceable: call it inside the step, after :meth:`DynamicTables.resolve`."""
    n, opt = map_devices(dyn.mesh), collection.optimizer
    tables = list(dyn.maps)  # fresh.table indexes these
    placed = {}
    for t in tables:
        (g, vt), *_ = [(g, vt) for g in collection.groups for vt in g.vtables if vt.table == t]
        if not g.replicated or vt.rows != dyn.maps[t].rows:
            raise ValueError(f"table {t}: not a replicated table of {dyn.maps[t].rows} rows")
        placed[t] = (g, vt)
    groups = sorted({g.name for g, _ in placed.values()})
    const = lambda values: jnp.asarray(np.asarray(values), jnp.int32)
    group_of = const([groups.index(placed[t][0].name) for t in tables])
    offset = const([placed[t][1].offset for t in tables])
    block = const([dyn.maps[t].rows // n for t in tables])
    slots_of = const([dyn.maps[t].slots for t in tables])
    width = {g.name: g.width for g, _ in placed.values()}

    def reset(arrays, slots, rows, table):
        arrays, slots = dict(arrays), {g: dict(v) for g, v in slots.items()}
        # Every device's entries, [n, k], on every device: a sum of each device's own row
        # (a sum is replicated by type; an all-gather's result is not, in shard_map).
        mine = jnp.zeros((n, 2, rows.shape[0]), jnp.int32).at[lax.axis_index(AXIS)].set(jnp.stack([rows + 1, table]))
        every = lax.psum(mine, AXIS)
        rows, table = every[:, 0] - 1, every[:, 1]
        logical = rows + lax.broadcasted_iota(jnp.int32, rows.shape, 0) * block[table]
        rows, logical, table = rows.reshape(-1), logical.reshape(-1), table.reshape(-1)
        for gi, name in enumerate(groups):
            array = arrays[name]
            at = jnp.where((rows >= 0) & (group_of[table] == gi), offset[table] + logical, array.shape[0])
            if dyn.new_rows == NewRows.SHARED:  # the shard's shared row's value before the step
                start = array[offset[table] + shared_row_of(logical, slots_of[table])]
            else:
                start = jnp.zeros((at.shape[0], width[name]), array.dtype)
            arrays[name] = array.at[at].set(start, mode="drop")
            initial = opt.state_for(start, lr)  # (FTRL's weights follow from its state: one that keeps them)
            slots[name] = {s: v.at[at].set(initial[s], mode="drop") for s, v in slots[name].items()}
        return arrays, slots

    def local(arrays, slots, rows, table):
        most = lax.pmax(jnp.sum(rows >= 0), AXIS)  # as many chunks on every device (each meets in a sum)
        write = lambda carry, rows, table: reset(*carry, rows, table)
        return reset_in_chunks(dyn, (rows, table), most, (arrays, slots), write)

    everywhere = lambda tree: jax.tree.map(lambda _: P(), tree)
    arrays = {g: state.tables[g] for g in groups}
    slots = {g: state.slots[g] for g in groups}
    arrays, slots = jax.shard_map(
        local,
        mesh=dyn.mesh,
        in_specs=(everywhere(arrays), everywhere(slots), P(AXIS), P(AXIS)),
        out_specs=(everywhere(arrays), everywhere(slots)),
    )(arrays, slots, fresh.rows, fresh.table)
    return state._replace(tables={**state.tables, **arrays}, slots={**state.slots, **slots})
