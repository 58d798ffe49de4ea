"""Hot rows of tiered tables: moving them between the hot copies and the tiers at a refresh.

While a row of a tiered table is hot it lives only in the replicated hot arrays: the planner
splits it off before the device caches see a batch (``hot.index.split_hot_host``), so it never
takes a cache slot, and its copy in the DRAM cache or the disk tier is stale. A refresh runs
with no program in flight and the planner stopped before the first batch of the new set:

1. every tiered hot row is written to the DRAM caches (the leaving ones must be; the staying
   ones are read back in step 3, bit for bit);
2. the entering rows leave the device caches (read back, their slots freed) for the DRAM caches;
3. the collection's refresh program moves the device tables' hot rows; the tiered ones are
   then set from the DRAM caches.

Checkpoints and evaluation also write the hot rows to the DRAM caches
(``TieredTables.sync_to_host``), so a tier snapshot always holds the whole logical tables and a
run restored onto another plan needs only the snapshot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlrm_jax.embedding.exchange.collection import EmbeddingCollection, EmbeddingState
from dlrm_jax.embedding.hot.index import hot_step_keys, tiered_hot_maps
from dlrm_jax.embedding.tiers.cache_planner import TableCache
from dlrm_jax.embedding.tiers.tables import TieredTables


def view_rows(collection: EmbeddingCollection) -> dict[int, int]:
    """Per tiered table, the rows of its device view: cache ids are below, hot step ids above."""
    return {t: collection.plan.tables[t].spec.rows for t in collection.tiered_tables}


def hot_maps(collection: EmbeddingCollection, keys: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """The planner's split of tiered tables' hot rows for hot set ``keys``."""
    return tiered_hot_maps(np.asarray(keys), view_rows(collection))


def refresh(
    collection: EmbeddingCollection,
    tiered: TieredTables,
    emb: EmbeddingState,
    keys: np.ndarray,
    caches: dict[int, TableCache] | None = None,
) -> EmbeddingState:
    """``emb`` with the hot set ``keys`` (``hot.index.hot_keys``), tiered tables' rows included,
    exactly. ``caches``: the planner's device caches, which forget the entering rows (None
    when no planner runs yet). Donates ``emb``."""
    keys = np.asarray(keys, np.int32)
    tiered.drain()
    tiered.put_hot_rows(emb.hot)
    entering = {t: keys[1, keys[0] == t].astype(np.int64) for t in tiered.tables if (keys[0] == t).any()}
    tiered.take_from_devices(collection.mesh, emb.tables, emb.slots, entering)
    for t, rows in entering.items():
        if caches is not None:
            caches[t].drop(rows)
    emb = collection.refresh(emb, keys, hot_step_keys(keys, view_rows(collection)))
    if not entering:
        return emb
    hot = emb.hot
    values = np.zeros(hot.values.shape, hot.values.dtype)
    slots = {k: np.zeros(v.shape, v.dtype) for k, v in hot.slots.items()}
    mask = np.zeros(keys.shape[1], bool)
    for t, rows in entering.items():
        at = np.flatnonzero(keys[0] == t)
        got = tiered.host[t].get(rows)
        values[at], mask[at] = got.pop("values"), True
        for k, v in got.items():
            slots[k][at] = v
    return emb._replace(hot=_set_rows(collection.mesh)(hot, mask, values, slots))


@functools.lru_cache(maxsize=8)
def _set_rows(mesh):  # one compiled program per mesh
    replicated = NamedSharding(mesh, P())

    def set_rows(hot, mask, values, slots):
        pick = lambda new, old: jnp.where(mask.reshape(-1, *([1] * (old.ndim - 1))), new.astype(old.dtype), old)
        return hot._replace(values=pick(values, hot.values), slots={k: pick(slots[k], v) for k, v in hot.slots.items()})

    return jax.jit(set_rows, out_shardings=replicated, donate_argnums=0)
