"""Tables saved under one plan, laid out for another, one device shard at a time.

A checkpoint's embedding arrays follow the plan they were saved with (device count,
strategies, column slices). Restoring onto another plan builds each new device shard on the
host from the rows it must hold, read from the saved arrays on demand (any object indexable
by an array of rows: the checkpoint's tensorstore readers, or numpy), and places it on its
device (one shard at a time): no device ever holds more than its own shard, no
whole logical table is assembled, and host memory holds one new shard plus the saved chunks
being read. In a multi-process run each process builds only its own devices' shards.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dlrm_jax.embedding.exchange.collection import EmbeddingCollection, EmbeddingState
from dlrm_jax.embedding.exchange.hot_rows import HotState
from dlrm_jax.embedding.exchange.initializer import logical_rows
from dlrm_jax.embedding.hot.index import HOT_BUCKET, hot_index_buckets
from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan
from dlrm_jax.embedding.plan.layout import (
    KIND_BLOCK,
    KIND_CYCLIC,
    Group,
    VirtualTable,
    build_groups,
)


def saved_shapes(plan: EmbeddingPlan, optimizer) -> EmbeddingState:
    """``jax.ShapeDtypeStruct`` of every array of a plan's embedding state."""
    tables, slots = {}, {}
    for g in build_groups(plan):
        shape = jax.ShapeDtypeStruct((g.array_rows, g.width), jnp.dtype(plan.dtype))
        tables[g.name] = shape
        slots[g.name] = jax.eval_shape(optimizer.init, shape)
    hot = None
    if plan.hot_rows:
        values = jax.ShapeDtypeStruct((plan.hot_rows, plan.tables[0].spec.dim), jnp.dtype(plan.dtype))
        hot = HotState(
            values,
            jax.eval_shape(optimizer.init, values),
            jax.ShapeDtypeStruct((2, plan.hot_rows), jnp.int32),
            jax.ShapeDtypeStruct((hot_index_buckets(plan.hot_rows), HOT_BUCKET, 3), jnp.int32),
            jax.ShapeDtypeStruct((2,), jnp.int32),
        )
    return EmbeddingState(tables, slots, hot)


def physical_rows_np(g: Group, vt: VirtualTable, logical: np.ndarray) -> np.ndarray:
    """Rows of group ``g``'s array holding ``logical`` rows of virtual table ``vt`` (numpy)."""
    if vt.kind == KIND_BLOCK:
        device, local = vt.device + logical // vt.block, vt.offset + logical % vt.block
    elif vt.kind == KIND_CYCLIC:
        device, local = logical % g.num_devices, vt.offset + logical // g.num_devices
    else:
        device, local = (0 if g.replicated else vt.device), vt.offset + logical
    return local if g.replicated else device * g.local_rows + local


class _SavedTables:
    """Reads rows and columns of the saved plan's tables from its host arrays; rows that were
    hot are read from the saved hot copies (their owners' rows are stale)."""

    def __init__(self, plan: EmbeddingPlan, saved: EmbeddingState):
        self.pieces: dict[int, list] = {}  # table -> [(group, vt, values, slots)]
        for g in build_groups(plan):
            for vt in g.vtables:
                self.pieces.setdefault(vt.table, []).append((g, vt, saved.tables[g.name], saved.slots[g.name]))
        self.hot = None
        if saved.hot is not None:  # H rows: small enough to hold whole
            self.hot = (
                _rows_of(saved.hot.keys, 2),
                _rows_of(saved.hot.values, plan.hot_rows),
                {k: _rows_of(v, plan.hot_rows) for k, v in saved.hot.slots.items()},
            )

    def read(self, table: int, logical: np.ndarray, col0: int, width: int, key: str | None):
        """Values (``key`` None) or the slot ``key`` of ``logical`` rows, columns
        [col0, col0 + width); per-row slots ([R]) ignore the columns."""
        out = self._read_owners(table, logical, col0, width, key)
        if self.hot is not None:
            keys, values, slots = self.hot
            mine = np.flatnonzero(keys[0] == table)
            at = np.searchsorted(keys[1, mine], logical)  # the table's hot ids are sorted
            found = at < mine.size
            found[found] = keys[1, mine[at[found]]] == logical[found]
            src = (values if key is None else slots[key])[mine[at[found]]]
            out[found] = src if src.ndim == 1 else src[:, col0 : col0 + width]
        return out

    def _read_owners(self, table: int, logical: np.ndarray, col0: int, width: int, key: str | None):
        out = None
        for g, vt, values, slots in self.pieces[table]:
            src = values if key is None else slots[key]
            rows = physical_rows_np(g, vt, logical)
            if src.ndim == 1:  # one value per row: every slice holds the same
                return src[rows]
            lo, hi = max(col0, vt.col_start), min(col0 + width, vt.col_start + g.width)
            if lo >= hi:
                continue
            if out is None:
                out = np.zeros((len(logical), width), src.dtype)
            out[:, lo - col0 : hi - col0] = src[rows][:, lo - vt.col_start : hi - vt.col_start]
        return out


def relayout(
    saved_plan: EmbeddingPlan, host: EmbeddingState, collection: EmbeddingCollection, skip: frozenset[int] = frozenset()
) -> EmbeddingState:
    """The collection's state, on its mesh with its shardings, from the saved plan's arrays
    (readers or numpy, shaped as :func:`saved_shapes` says). Tables in ``skip`` (tiered ones:
    their arrays are device caches, their rows live in the disk tier) are left zero."""
    saved = _SavedTables(saved_plan, host)
    groups, shardings = collection.groups, collection.state_sharding()
    tables, slots = host.tables, host.slots

    def build(g: Group, key: str | None, like: np.ndarray, sharding):
        shape = (g.array_rows, *like.shape[1:])

        def shard(index):
            rows = np.arange(g.array_rows)[index[0]]
            out = np.zeros((len(rows), *shape[1:]), like.dtype)
            for v, vt in enumerate(g.vtables):
                if vt.table in skip:
                    continue
                logical, held = logical_rows(g, v, rows)
                logical, held = np.asarray(logical), np.asarray(held)
                if held.any():
                    out[held] = saved.read(vt.table, logical[held], vt.col_start, g.width, key)
            return out

        # One shard built and placed at a time (make_array_from_callback builds them all first).
        pieces, last = [], (None, None)
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            key_ = tuple((s.start, s.stop) for s in index)
            if key_ != last[0]:  # replicas of one shard are built once
                last = (key_, shard(index))
            pieces.append(jax.device_put(last[1], device))
        del last
        return jax.make_array_from_single_device_arrays(shape, sharding, pieces)

    any_table = next(iter(tables.values()))
    new_tables = {
        g.name: build(g, None, np.empty((0, g.width), any_table.dtype), shardings.tables[g.name]) for g in groups
    }
    any_slots = next(iter(slots.values()))
    new_slots = {
        g.name: {
            k: build(g, k, np.empty((0, g.width)[: v.ndim], v.dtype), shardings.slots[g.name][k])
            for k, v in any_slots.items()
        }
        for g in groups
    }
    hot = None
    if collection.hot is not None:  # empty: the caller refreshes it with the rows it wants hot
        hot = jax.jit(lambda: collection.hot.init(collection.storage_dtype), out_shardings=shardings.hot)()
    return EmbeddingState(new_tables, new_slots, hot)


def _rows_of(array, rows: int) -> np.ndarray:
    """The first ``rows`` rows of a saved array (reader or numpy) as numpy."""
    return np.asarray(array[np.arange(rows)])


def tables_on_host(collection, state: EmbeddingState, skip: frozenset[int] = frozenset()):
    """Per table of ``collection`` (not in ``skip``): (index, values float32 [rows, D], its
    optimizer state by name), as :meth:`EmbeddingCollection.logical_tables` gives them, laid
    out on the host from each array's device shards (the rows' owners by the plan, hot rows
    from their copies). No device gathers a table: the device program did, and every device
    then held every whole table (an export of tables sharded because no device holds them all
    ran out of its memory). Host memory: the collection's arrays and one logical table."""
    plan = getattr(collection, "inner", collection).plan  # (per-host tables: one host's)
    host = EmbeddingState(
        {name: np.asarray(a) for name, a in state.tables.items()},
        {name: {k: np.asarray(v) for k, v in s.items()} for name, s in state.slots.items()},
        None if state.hot is None else jax.tree.map(np.asarray, state.hot),
    )
    saved, names = _SavedTables(plan, host), sorted(next(iter(host.slots.values()), {}))
    for t, tp in enumerate(plan.tables):
        if t in skip:
            continue
        rows, dim = np.arange(tp.spec.rows), tp.spec.dim
        values = saved.read(t, rows, 0, dim, None).astype(np.float32)
        yield t, values, {k: saved.read(t, rows, 0, dim, k) for k in names}
