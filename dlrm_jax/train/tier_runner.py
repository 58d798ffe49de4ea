"""Train steps over tiered tables: batches planned ahead in a thread, fills in, evictions back.

The planner thread (plain numpy, no device work) reads batches ``lookahead`` ahead of the one
it plans, so the rows they need stay cached, starts reading from the disk tier the rows each
planned batch will fill that no cache holds (on the tier's reader thread, many reads in
flight), and hands over each batch with its tiered ids replaced by cache ids, the rows to
fill and those reads. The dispatching thread takes the incoming rows (DRAM cache, the rows
read ahead, or, for the few the guess missed, the disk), puts the fill arrays on the devices
(asynchronously: the previous step is still running), dispatches the step, and only then
writes back what the previous step evicted (to the DRAM caches; what they evict goes to the
tier's write-behind thread). Every program is dispatched from that one thread.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from dlrm_jax.choices import NewRows
from dlrm_jax.data.batch import Batch
from dlrm_jax.data.pipeline import background
from dlrm_jax.embedding.dynamic.sharded import FreshRows
from dlrm_jax.embedding.tiers import hot as tier_hot
from dlrm_jax.embedding.tiers.cache_planner import plan_stream
from dlrm_jax.embedding.tiers.dynamic_ids import TieredIds
from dlrm_jax.embedding.tiers.tables import TieredTables
from dlrm_jax.ids import PAD_ID
from dlrm_jax.parallel.mesh import host_scalar
from dlrm_jax.train.step import CacheIO


class Planned(NamedTuple):
    """One planned step: the batch with cache ids, its fills, the batch's own ids, the
    future of the tier reads begun for it (None: nothing to read), and with tiered dynamic
    tables the cache slots given to new ids and the host maps' counts; its step."""

    batch: Batch
    fills: dict
    ids: np.ndarray
    reads: Any = None
    fresh: FreshRows | None = None  # tiered dynamic tables: cache slots given to new ids,
    fresh_hot: np.ndarray | None = None  # hot rows given to new ids (with hot rows)
    map_counts: np.ndarray | None = None  # and their host maps' counts (STATS order)
    step: int = 0


class PlannerClosed(Exception):
    """The run stopped taking plans while the planner waited for a hot-row refresh."""


class TierRunner:
    """Drives ``steps`` (built with cache groups) over the tiered tables ``tiered``: a thread
    plans each batch ``lookahead`` steps ahead (which rows each device cache must hold, the
    disk reads begun for them), and each step gets its cache fills with its batch. What
    ``train_and_evaluate`` uses for a config with tiered tables; a step loop of your own over
    tiered tables takes :meth:`planned`'s items in order.

    With hot rows, the planner splits tiered tables' hot ids off (they never take a cache
    slot) and stops before the first batch after each refresh of the schedule until
    :meth:`refresh_hot` has moved the rows and handed it the new set."""

    def __init__(self, steps, tiered: TieredTables, lookahead: int):
        self.steps, self.tiered, self.lookahead = steps, tiered, lookahead
        self.slot_table = steps.collection.slot_feature
        self.stall_s = 0.0
        # Host time on the dispatching thread, by kind (dlrm-jax profile prints it).
        self.host_s: collections.Counter = collections.Counter()
        self._step_inputs = ()  # the last train step's (batch, fills, evictions), for step_input_shapes
        self._no_host_pooled = None  # a state check's zeros for the eval step's host-pooled vectors
        self.h2d_bytes = 0
        self._empty = None
        self._last = {}
        self._caches = None
        self._hot_maps: dict = {}
        self._gate = threading.Condition()
        self._arrived = self._released = -1  # the refresh boundary the planner waits at / may pass
        self._planner_done = True
        self._closing = False  # the steps stopped taking plans: a planner waiting for a refresh ends
        maps = tiered.maps  # tiered dynamic tables' host maps: their ids resolved in the planner thread
        self.ids = (
            None
            if maps is None
            else TieredIds(
                maps,
                steps.collection,
                list(steps.spec.maps),
                steps.spec.bag_sizes,
                shared=steps.spec.new_rows == NewRows.SHARED,
            )
        )

    def use_hot(self, hot_keys: np.ndarray) -> None:
        """The hot set the state starts with (before :meth:`planned`)."""
        self._hot_maps = tier_hot.hot_maps(self.steps.collection, hot_keys)

    def planned(self, make_batch: Callable[[int], Batch], steps: range) -> Iterator[Planned]:
        """Each step's :class:`Planned`; planned in a thread reading ``lookahead`` batches
        ahead (inline when 0)."""
        self._caches = caches = self.tiered.new_caches()
        batches = background(map(make_batch, steps)) if self.lookahead else map(make_batch, steps)
        schedule = self.steps.hot
        threaded = bool(self.lookahead)
        self._planner_done, self._closing = not threaded, False

        def hot_for(k: int) -> dict:
            i = steps.start + k
            if threaded and schedule is not None and k and schedule.refresh_due(i):
                with self._gate:  # caches and hot set change here: wait for refresh_hot(i)
                    self._arrived = i
                    self._gate.notify_all()
                    self._gate.wait_for(lambda: self._released >= i or self._closing)
                    if self._released < i:  # the run stopped before the refresh (a signal, an early stop)
                        raise PlannerClosed
            return self._hot_maps

        if self.ids is not None:
            self.tiered.maps.rewind(steps.start)

        def plans():
            try:
                pending, hosts = {}, {}

                def read(i, batch):  # (tiered dynamic ids to rows here, in batch order)
                    pending[i] = batch
                    if self.ids is None:
                        return batch.ids
                    pending[i], hosts[i] = self.ids.host_ids(batch, steps.start + i)
                    return hosts[i].planned_ids(pending[i].ids)  # (and the fresh rows' shared rows)

                ids = (read(i, b) for i, b in enumerate(batches))
                stream = plan_stream(
                    caches, self.slot_table, ids, self.lookahead, hot_for if schedule is not None else None
                )
                for i, (orig, remapped, fills) in enumerate(stream):
                    reads = self.tiered.read_ahead_for(fills) if threaded else None
                    fresh = fresh_hot = counts = None
                    batch = pending.pop(i)
                    if self.ids is not None:
                        host = hosts.pop(i)
                        fresh, fresh_hot = self.ids.fresh_slots(host, remapped, host.resolved.rows.size)
                        counts = host.resolved.stats.sum(axis=0)
                    orig, remapped = orig[: batch.ids.shape[0]], remapped[: batch.ids.shape[0]]
                    batch = batch._replace(ids=remapped)
                    yield Planned(batch, fills, orig, reads, fresh, fresh_hot, counts, steps.start + i)
            except PlannerClosed:
                return
            finally:
                if hasattr(batches, "close"):  # (the batches' reader thread, on this thread)
                    batches.close()
                with self._gate:
                    self._planner_done = True
                    self._gate.notify_all()

        source = background(plans(), depth=self.lookahead) if self.lookahead else plans()
        try:
            while True:
                t0 = time.perf_counter()
                item = next(source, None)
                waited = time.perf_counter() - t0
                self.stall_s += waited
                self.host_s["planner wait"] += waited
                if item is None:
                    return
                yield item
        finally:
            # The run took its last plan (the end, a stop signal, an early stop, an error): a
            # planner waiting for a hot-row refresh that will not come ends, and its thread is
            # joined. (It waited forever, and the process with it, after the checkpoint.)
            with self._gate:
                self._closing = True
                self._gate.notify_all()
            source.close()

    def refresh_hot(self, state, keys: np.ndarray, step: int):
        """The state with hot set ``keys`` after train step ``step`` (a refresh of the
        schedule), tiered rows moved between the hot copies and the caches; the planner,
        stopped before batch ``step``, then goes on with the new set."""
        with self._gate:
            self._gate.wait_for(lambda: self._arrived >= step or self._planner_done)
        emb = tier_hot.refresh(self.steps.collection, self.tiered, state.emb, keys, self._caches)
        self._hot_maps = tier_hot.hot_maps(self.steps.collection, keys)
        with self._gate:
            self._released = step
            self._gate.notify_all()
        return state._replace(emb=emb)

    def _device(self, tree):
        self.h2d_bytes += sum(x.nbytes for x in jax.tree.leaves(tree))
        return jax.device_put(tree, self.steps.batch_sharding)

    def take_metrics(self, steps: int) -> dict:
        """The tier's figures since the last call, for a metrics event of ``steps`` steps:
        device and DRAM hit rates, rows filled and evicted, host->device bytes, planning plus
        fill-assembly stall per step, and the disk tier's traffic (rows read ahead or at the
        step, read requests and bytes, and the step's wait on reads)."""
        host = self.tiered.host.values()
        now = dict(self.tiered.stats) | {
            "host_hits": sum(h.hits for h in host),
            "host_misses": sum(h.misses for h in host),
            "h2d": self.h2d_bytes,
            "stall": self.stall_s,
            "read_ahead": sum(h.rows_read_ahead for h in host),
            "read_at_step": sum(h.tier_rows_read for h in host),
            "from_queue": sum(h.rows_from_queue for h in host),
            "tier_wait": self.tiered.read_ahead.wait_s + sum(h.read_wait_s for h in host),
            "tier_reads": self.tiered.store.io_stats.reads,
            "tier_read_bytes": self.tiered.store.io_stats.read_bytes,
        }
        d = {k: v - self._last.get(k, 0) for k, v in now.items()}
        self._last = now
        steps = max(steps, 1)
        return {
            "device_hit_rate": 1 - d.get("rows_filled", 0) / max(d.get("rows_requested", 0), 1),
            "host_hit_rate": d["host_hits"] / max(d["host_hits"] + d["host_misses"], 1),
            "rows_filled": d.get("rows_filled", 0),
            "rows_evicted": d.get("rows_evicted", 0),
            "fill_rounds": d.get("fill_rounds", 0),
            "h2d_bytes_per_step": d["h2d"] / steps,
            "stall_ms_per_step": 1e3 * d["stall"] / steps,
            # Tier traffic: rows DRAM missed, by where they came from, and the disk requests made.
            "rows_read_ahead": d["read_ahead"],
            "rows_read_at_step": d["read_at_step"],
            "rows_from_write_queue": d["from_queue"],
            "tier_wait_ms_per_step": 1e3 * d["tier_wait"] / steps,
            "tier_reads": d["tier_reads"],
            "tier_read_bytes": d["tier_read_bytes"],
        }

    def _previous(self):
        if self.tiered.pending is not None:
            return self.tiered.pending[0]
        if self._empty is None:
            self._empty = self._device(self.tiered.empty_evictions())
        return self._empty

    def train(self, state, batch: Batch, fills: dict, reads=None, planned: Planned | None = None):
        """One train step (after any extra fill rounds the batch needs): (state, metrics).
        ``reads``: the :class:`Planned` batch's tier reads; ``planned``: the whole of it (its
        fresh cache slots and host map counts, with tiered dynamic tables)."""
        fresh = None
        if planned is not None and planned.fresh is not None:
            self.tiered.maps.forget_before(planned.step)  # the state is at this step or later now
            fresh = planned.fresh
        t0 = time.perf_counter()
        programs = self.tiered.programs(fills, reads)
        for program in programs[:-1]:  # overflow of the fill capacity: fill-only rounds first
            emb, evicted = self.steps.fill_step(state.emb, self._device(program.fills), self._previous())
            state = state._replace(emb=emb)
            self.tiered.dispatched(program, evicted)
            self.tiered.drain()
        step_fills = self._device(programs[-1].fills)
        assembly = time.perf_counter() - t0
        self.stall_s += assembly
        self.host_s["fill assembly + h2d"] += assembly
        cache = CacheIO(step_fills, self._previous())
        if fresh is not None:
            hot = None if planned.fresh_hot is None else jax.device_put(planned.fresh_hot, self.steps.replicated)
            cache = cache._replace(fresh=self._device(fresh), fresh_hot=hot)
        self._step_inputs = inputs = (self.steps.device_batch(batch), cache)
        state, out, evicted = self.steps.train_step(state, *inputs)
        if fresh is not None:
            out = {**out, "host_id_map_counts": planned.map_counts}
        t1 = time.perf_counter()
        self.tiered.dispatched(programs[-1], evicted)  # (waits for the previous step's evictions)
        self.host_s["write-back"] += time.perf_counter() - t1
        return state, out

    def check_inputs(self) -> tuple:
        """The eval step's inputs that score the state after the last train step: its device
        batch, tiered ids as cache ids (rows the caches hold until the next step's fills), and
        no host-pooled vectors."""
        batch = self._step_inputs[0]
        if self._no_host_pooled is None:
            local = self.steps.spec.batch_size // jax.process_count()
            zeros = np.zeros((local, len(self.tiered.plan.tables), self.tiered.dim), np.float32)
            self._no_host_pooled = jax.device_put(zeros, self.steps.batch_sharding)
        return batch, self._no_host_pooled

    def step_input_shapes(self) -> tuple:
        """Shapes, dtypes and shardings of the last train step's inputs after the state (to
        lower the step again, e.g. for its HLO)."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self._step_inputs)

    def eval_inputs(self, state, batch: Batch) -> tuple[Batch, np.ndarray]:
        """An eval batch with its tiered ids padded out, and their features' pooled vectors
        read on the host (call :meth:`TieredTables.sync_to_host` once before evaluating)."""
        if self.ids is not None:  # rows of the maps as of the state's step
            batch, _ = self.ids.host_ids(batch, int(host_scalar(state.step)), learn=False)
        ids = batch.ids
        tiered = np.isin(self.slot_table, self.tiered.tables)
        weights = self.pool_weights(ids)
        pooled = self.tiered.host_pooled(ids, self.slot_table, weights)
        return batch._replace(ids=np.where(tiered[None, :], PAD_ID, ids).astype(ids.dtype)), pooled

    def pool_weights(self, ids: np.ndarray) -> np.ndarray:
        """Each slot's pooling weight (0 padding; 1 / bag length under mean pooling)."""
        coll = self.steps.collection
        valid = (ids != PAD_ID).astype(np.float32)
        count = np.zeros((ids.shape[0], len(coll.specs)), np.float32)
        np.add.at(count, (slice(None), coll.slot_feature), valid)
        mean = coll.mean_pooling[coll.slot_feature]
        denom = np.where(mean, np.maximum(count[:, coll.slot_feature], 1.0), 1.0)
        return valid / denom
