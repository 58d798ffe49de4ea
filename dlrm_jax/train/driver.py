"""The step driver: the next batch, the train step, and the host work around them, behind one
interface for the two ways a run feeds its steps.

- :class:`DeviceDriver`: batches read by the input pipeline's threads (or generated on the
  devices, the synthetic source) and one compiled train step.
- :class:`TieredDriver`: tiered tables, whose batches are planned ahead by the
  :class:`~dlrm_jax.train.tier_runner.TierRunner` (cache fills, evictions, write-backs).

Both count hot-row lookups and refresh the hot set (:meth:`StepDriver.after_step`), evaluate,
and report their host metrics. The training loop, ``evaluate_run`` and ``dlrm-jax profile`` go
through them; nothing else dispatches a train step. One thread drives them, in step order.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import NamedTuple

import jax
import numpy as np

from dlrm_jax.choices import HostMemory
from dlrm_jax.data.batch import DataSource, faster_path
from dlrm_jax.data.host_buffers import HostBuffers
from dlrm_jax.data.packed import packed_reader
from dlrm_jax.data.pipeline import InputPipeline, dispatched_ahead, input_readers
from dlrm_jax.data.reader_processes import ProcessReaders
from dlrm_jax.data.sources import close_source
from dlrm_jax.embedding.hot.index import hot_keys
from dlrm_jax.embedding.tiers.tables import TieredTables
from dlrm_jax.parallel.mesh import host_scalar
from dlrm_jax.train.evaluate import evaluate
from dlrm_jax.train.step import StepFunctions, TrainState
from dlrm_jax.train.tier_runner import TierRunner


class Stepped(NamedTuple):
    """What one train step left: the new state, its metrics (device arrays, read later), and
    this process's ids of its batch (host-readable, for hot-row counting)."""

    state: TrainState
    out: dict
    ids: object


class StepDriver:
    """What both drivers share: hot-row counting and refreshes, evaluation, closing."""

    compiles_on_first_step = False  # the first step compiles (the hang watch does not time it)
    closes_source = False  # the source is the driver's own (made for it), closed with it

    def __init__(self, steps: StepFunctions, source: DataSource):
        self.steps, self.source = steps, source

    def batches(self, state: TrainState, start: int, end: int) -> Iterable:
        """The inputs of steps ``start + 1`` .. ``end``, in order (compiling first if needed)."""
        raise NotImplementedError

    def run(self, state: TrainState, item) -> Stepped:
        raise NotImplementedError

    def check_inputs(self, item) -> tuple:
        """What a state check of the step just run scores, after the state: the eval step's
        inputs (:meth:`StepFunctions.state_check`)."""
        raise NotImplementedError

    def after_step(self, state: TrainState, step: int, ids) -> TrainState:
        """After train step ``step``: count its ids if it falls in a statistics window (on the
        counting thread) and refresh the hot set when one is due, before any checkpoint of this
        step (a resumed run starts from the refreshed rows and the statistics that chose them)."""
        hot = self.steps.hot
        if hot is None:
            return state
        if hot.counts_batch(step - 1):
            hot.add(ids)
        if not hot.refresh_due(step):
            return state
        return self._refresh_hot(state, hot_keys(hot.refresh(), hot.capacity), step)

    def _refresh_hot(self, state: TrainState, keys: np.ndarray, step: int) -> TrainState:
        return state._replace(emb=self.steps.collection.refresh(state.emb, keys))

    def take_metrics(self, window_steps: int) -> dict:
        """Host metrics of the steps since the last call."""
        return {}

    def map_metrics(self, state: TrainState) -> dict:
        """The dynamic tables' maps now (``map_fill``; empty without dynamic tables)."""
        return {k: host_scalar(v) for k, v in self.steps.map_metrics(state).items()}

    def save_tiers(self, step: int, state: TrainState, saved_steps: list[int], keep: int) -> str | None:
        """Before checkpoint ``step`` is saved: whatever must be durable with it; returns the
        id of the disk tier the checkpoint needs (None: none), which it keeps."""
        return None

    def tiers_saved(self, saved_steps: list[int]) -> None:
        """Once every checkpoint is committed and rotated: the checkpoints there are ``saved_steps``."""

    def evaluate(self, state: TrainState, batches=None) -> tuple[float, float, int]:
        """AUC, logloss and samples scored of the held-out split, or of ``batches``."""
        return evaluate(self.steps, state, self.source, None, batches)

    def close(self) -> None:
        if self.steps.hot:
            self.steps.hot.close()
        if self.closes_source:
            close_source(self.source)


class DeviceDriver(StepDriver):
    """Batches from the input pipeline (or made on the devices) into one compiled train step."""

    def __init__(
        self,
        steps: StepFunctions,
        source: DataSource,
        readers: int,
        prefetch: int,
        log=print,
        processes: bool = False,
        host_memory: str = HostMemory.AUTO,
    ):
        super().__init__(steps, source)
        self.readers, self.prefetch, self.log, self.processes = readers, prefetch, log, processes
        self.host_memory = host_memory
        self.pipeline: InputPipeline | None = None
        self.reader_processes: ProcessReaders | None = None
        self.buffers: HostBuffers | None = None
        self.compiled = None

    def batches(self, state: TrainState, start: int, end: int) -> Iterable:
        """Batches made on the devices (the synthetic source), or read by the input pipeline
        into reused host buffers (pinned on GPUs, :mod:`dlrm_jax.data.host_buffers`) and placed
        packed (one transfer each, :mod:`dlrm_jax.data.packed`)."""
        steps, t0 = self.steps, time.perf_counter()
        device_batches = faster_path(self.source, "device_batches")  # generated on the devices
        if device_batches is None and self.buffers is None:
            self.buffers = HostBuffers.for_devices(self.host_memory, list(steps.batch_sharding.addressable_devices))
        if self.processes and device_batches is None:  # data.reader_processes
            read = self.reader_processes = ProcessReaders(
                self.source, steps.packed_layout(), input_readers(self.readers), self.buffers
            )
        else:
            read = packed_reader(self.source, steps.packed_layout(), self.buffers)
        first = steps.device_batch(self.source.train_batch(start) if device_batches else read(start))
        self.compiled = steps.train_step.lower(state, first).compile()
        self.log(
            f"compiled the train step in {time.perf_counter() - t0:.1f}s on {steps.mesh.size} "
            f"{jax.default_backend()} devices in {jax.process_count()} process(es); {_memory_report(self.compiled)}"
        )
        if device_batches is not None:
            return dispatched_ahead(device_batches(steps.batch_sharding), range(start, end), self.prefetch)
        self.pipeline = InputPipeline(
            read,
            range(start, end),
            to_device=steps.device_batch,
            readers=self.readers,
            depth=self.prefetch,
        )
        return self.pipeline

    def run(self, state: TrainState, item) -> Stepped:
        ids = None  # read only for hot-row counting (after_step), so nothing per step without it
        state, out, _ = self.compiled(state, item.device)
        if self.steps.hot is not None:
            if "rows" in out:  # dynamic tables: the rows their maps gave the raw ids
                ids = _LocalRows(out["rows"])
            else:
                ids = item.host.ids if item.host is not None else _LocalRows(item.device.ids)
        return Stepped(state, out, ids)

    def check_inputs(self, item) -> tuple:
        return (item.device,)

    def evaluate(self, state: TrainState, batches=None) -> tuple[float, float, int]:
        """As :meth:`StepDriver.evaluate`, the batches read ahead by the training input's readers."""
        return evaluate(self.steps, state, self.source, None, batches, self.readers or 1, self.prefetch or 1)

    def take_metrics(self, window_steps: int) -> dict:
        if self.pipeline is None:
            return {}
        return self.pipeline.times.take() | self.buffers.stats()

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
        if self.reader_processes is not None:
            self.reader_processes.close()
        if self.buffers is not None:
            self.buffers.close()
        super().close()


class TieredDriver(StepDriver):
    """Tiered tables: batches planned ahead with their cache fills (:class:`TierRunner`)."""

    compiles_on_first_step = True  # (its fills' shapes come with the first planned batch)

    def __init__(self, steps: StepFunctions, source: DataSource, tiered: TieredTables, lookahead: int, log=print):
        super().__init__(steps, source)
        self.runner = TierRunner(steps, tiered, lookahead)
        self.log, self.ran = log, False

    @property
    def tiered(self) -> TieredTables:
        return self.runner.tiered

    def batches(self, state: TrainState, start: int, end: int) -> Iterable:
        if self.steps.hot is not None:
            self.runner.use_hot(np.asarray(state.emb.hot.keys))
        return self.runner.planned(self.source.train_batch, range(start, end))

    def run(self, state: TrainState, item) -> Stepped:
        t0 = time.perf_counter()
        state, out = self.runner.train(state, item.batch, item.fills, item.reads, item)
        if not self.ran:  # (the call compiled the step: its dispatch is asynchronous)
            self.ran = True
            self.log(
                f"compiled the train step in {time.perf_counter() - t0:.1f}s on {self.steps.mesh.size} "
                f"{jax.default_backend()} devices in {jax.process_count()} process(es), with its first cache fills"
            )
        ids = item.ids  # as read (tiered runs train on a copy with cache ids): the tiered maps' rows
        if "rows" in out:  # dynamic tables left on the devices: the rows their maps gave, not raw ids
            ids = _RowsOf(ids, out["rows"], self._device_map_columns())
        return Stepped(state, out, ids)

    def _device_map_columns(self) -> np.ndarray:
        """The id columns (a feature's bag each) of the dynamic tables whose maps the devices hold."""
        starts = np.concatenate([[0], np.cumsum(self.steps.spec.bag_sizes)])
        return np.concatenate([np.arange(starts[t], starts[t + 1]) for t in sorted(self.steps.dynamic.maps)])

    def check_inputs(self, item) -> tuple:
        return self.runner.check_inputs()

    def _refresh_hot(self, state: TrainState, keys: np.ndarray, step: int) -> TrainState:
        return self.runner.refresh_hot(state, keys, step)  # it moves the tiered rows too

    def take_metrics(self, window_steps: int) -> dict:
        return self.runner.take_metrics(window_steps)

    def map_metrics(self, state: TrainState) -> dict:
        maps = self.tiered.maps
        if maps is None:
            return super().map_metrics(state)
        # every dynamic table's fill: the devices' maps' and the host maps' (newest batch planned)
        steps = self.steps
        used, rows = (int(host_scalar(steps.map_used(state))), steps.map_rows) if steps.dynamic else (0, 0)
        return {"map_fill": (used + maps.used()) / (rows + maps.rows)}

    def save_tiers(self, step: int, state: TrainState, saved_steps: list[int], keep: int) -> str | None:
        # the tier's snapshot first: a saved step always has one
        self.tiered.checkpoint(step, state.emb.tables, state.emb.slots, saved_steps, keep, state.emb.hot)
        return self.tiered.owner.id

    def tiers_saved(self, saved_steps: list[int]) -> None:
        self.tiered.keep_saved(saved_steps)

    def evaluate(self, state: TrainState, batches=None) -> tuple[float, float, int]:
        return evaluate(self.steps, state, self.source, self.runner, batches)

    def close(self) -> None:
        self.tiered.close()
        super().close()


class _LocalRows:
    """This process's rows of a device array, copied to the host only if read (hot-row
    counting reads a batch's ids on the steps it counts)."""

    def __init__(self, x: jax.Array):
        self._x = x

    def __array__(self, dtype=None, copy=None):
        by_start = {s.index[0].start or 0: s for s in self._x.addressable_shards}  # replicas once
        local = np.concatenate([np.asarray(by_start[k].data) for k in sorted(by_start)])
        return local if dtype is None else local.astype(dtype)


class _RowsOf:
    """A tiered run's ids for hot-row counting: as the host read them (rows for the tables it
    resolves), with the ``columns`` of dynamic tables on the devices from the step's rows;
    copied only if read."""

    def __init__(self, ids, rows: jax.Array, columns: np.ndarray):
        self._ids, self._rows, self._columns = ids, _LocalRows(rows), columns

    def __array__(self, dtype=None, copy=None):
        ids = np.array(self._ids)
        ids[:, self._columns] = np.asarray(self._rows)[:, self._columns]
        return ids if dtype is None else ids.astype(dtype)


def _memory_report(compiled) -> str:
    try:
        m = compiled.memory_analysis()
        total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
        return f"per-device memory {total / 2**20:.1f} MiB (temp {m.temp_size_in_bytes / 2**20:.1f} MiB)"
    except Exception:  # noqa: BLE001 - not every backend reports memory
        return "memory analysis unavailable"
