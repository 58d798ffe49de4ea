"""Checkpoints of the whole train state with orbax, restorable onto any mesh.

Threads: orbax writes asynchronously from its own background thread. That thread must never
launch a program with collectives (see :mod:`dlrm_jax.train.trainer`): by default orbax's
multi-process barriers are ``sync_global_devices``, an all-reduce over every device, run from
that thread while the main thread dispatches train steps, so processes launch collectives in
different orders and hang. :func:`_use_coordination_service_barriers` switches orbax to the
``jax.distributed`` key-value barriers, which touch no device.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path

import jax
import numpy as np

from dlrm_jax.embedding.plan.layout import CHUNK_BYTES
from dlrm_jax.files import os_error_code
from dlrm_jax.parallel.coordination import outcome_of_process_0, outcomes_of_every_process
from dlrm_jax.train.checkpoint_leases import remove_unheld
from dlrm_jax.train.checkpoint_reader import CheckpointReader
from dlrm_jax.train.orbax_quiet import ocp
from dlrm_jax.train.state_digest import combine, process_sums
from dlrm_jax.wording import run_dir_flag

# Arrays are stored in chunks of at most CHUNK_BYTES (orbax's default is one chunk per device
# shard): a restore onto another plan reads scattered rows, and decodes whole chunks. The
# layout pads large shards' rows so that such chunks divide them (layout.storage_rows).


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, permissions); older ones are intact."""


def largest_shard_bytes(abstract_state) -> int:
    """Bytes of the largest single-device piece of any array of a (sharded) abstract state."""
    return max(
        int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(abstract_state)
    )


def _bytes_to_write(state) -> int:
    """Bytes this process writes for ``state``: each array once, split over the processes."""
    return sum(x.nbytes for x in jax.tree.leaves(state)) // jax.process_count() + (1 << 20)


def _use_coordination_service_barriers() -> None:
    from absl import flags

    if jax.process_count() == 1:
        return
    if not flags.FLAGS.is_parsed():  # a CLI without absl: take every flag's default
        flags.FLAGS.mark_as_parsed()
    flags.FLAGS.experimental_orbax_use_distributed_barrier = True


def _state_writer(write_gb: float) -> ocp.PyTreeCheckpointHandler:
    """orbax's writer of the state (what its StandardCheckpointHandler wraps: the same files),
    with type handlers of its own: on CPU devices each replicated array is written whole from
    one replica, as orbax does on GPUs. Its replica-parallel save (each replica writing a
    slice, its default off GPUs) compiles a slicing program per array shape on a process's
    first save (48 on the smoke config: about 1.2 s a save on a 2-core machine) to split what
    on simulated CPU devices is one host memory. Orbax's own registry, which a notebook's other
    saves use, is left as it is."""
    th = ocp.type_handlers
    arrays = th.ArrayHandler(use_replica_parallel=False if jax.default_backend() == "cpu" else None)
    scalars = th.ScalarHandler()
    registry = th.create_type_handler_registry(
        (jax.Array, arrays),
        (np.ndarray, th.NumpyHandler()),
        (int, scalars),
        (float, scalars),
        (np.number, scalars),
        (str, th.StringHandler()),
    )
    return ocp.PyTreeCheckpointHandler(save_concurrent_gb=write_gb, type_handler_registry=registry)


class Checkpoints(CheckpointReader):
    """Asynchronous sharded saves under ``directory``; restores onto the current mesh's shardings.
    Only a run dir's writer (``train``, holding its lock) opens one.

    An interrupted save never becomes the newest checkpoint: orbax writes to a temporary folder
    and renames it only once complete (leftover temporary folders are removed on open). A
    checkpoint that cannot be read, when an older one can, is moved to ``damaged/`` beside the
    checkpoints and the older one is used.
    """

    def __init__(self, directory: Path, keep: int, largest_shard_bytes: int = 0):
        """``largest_shard_bytes``: the largest single-device piece of the state; orbax's writer
        holds a host copy of at most max(that, 256 MiB) at a time. (Its default, 96 GB, copies
        the whole state at once: on simulated CPU devices, a second copy of every table.)"""
        super().__init__(directory)
        _use_coordination_service_barriers()
        self.keep, self._kept = keep, set()  # the newest `keep`, and those of keep_also
        self._saving: int | None = None  # the step whose save may still be under way
        # orbax keeps every step: the rotation is this class's, at wait() (leases: readers'),
        # so a step is removed only once a newer one is whole, and never while a reader reads it
        # Its folders made before the save returns: made asynchronously, a failure to make them (a
        # full disk, no inodes left) left orbax's other writer threads waiting for their signal,
        # and the process could not exit for 5 minutes (their timeout), then printed their stacks.
        options = ocp.CheckpointManagerOptions(
            create=True,
            cleanup_tmp_directories=True,
            async_options=ocp.options.AsyncOptions(create_directories_asynchronously=False),
        )
        write_gb = max(int(largest_shard_bytes * 1.01) + 2**20, 2**28) / 1e9
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "state": _state_writer(write_gb),
                "plan": ocp.JsonCheckpointHandler(),
            },
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def hold(self, step: int) -> bool:
        return True  # the run dir's writer: nothing else rotates its checkpoints

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(
        self,
        step: int,
        state,
        plan_json: str,
        hot_counts: dict | None = None,
        hosts: int = 0,
        run: dict | None = None,
        tier: str | None = None,
    ) -> None:
        """Saves the state with the embedding plan that laid its tables out, the hot-row
        statistics (``HotSchedule.to_json``) a resumed run needs to refresh as this one would,
        ``hosts``: how many hosts' tables it holds (embedding.sync=per_host; 0 otherwise),
        ``run``: the run's own record (``progress.Progress.to_json``), and ``tier``: the id of
        the disk tier holding its tiered tables (``embedding.tiers.owner``).

        Refuses up front, with CheckpointWriteError, when the disk lacks room for the state's
        bytes: orbax would otherwise fail midway in its writer threads.
        """
        self.wait()  # the previous save's bytes are on disk: free space is what it says
        need = _bytes_to_write(state)
        free = shutil.disk_usage(self.directory).free
        if free < need:
            raise self._write_error(
                step,
                OSError(errno.ENOSPC, "no space left on device"),
                f" ({need / 2**20:,.1f} MiB needed, {free / 2**20:,.1f} MiB free)",
            )
        record = {"plan": plan_json, "hot_counts": hot_counts, "hosts": hosts, "run": run, "tier": tier}
        # orbax's files hold no checksum of their contents: restores check these
        record["checksums"] = combine(
            [json.loads(o) for o in outcomes_of_every_process(json.dumps(process_sums(state)))]
        )
        self._saving = step
        try:
            chunked = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), state)
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeSave(state, save_args=chunked), plan=ocp.args.JsonSave(record)
                ),
            )
        except OSError as e:
            raise self._write_error(step, e) from None

    def keep_also(self, steps) -> None:
        """Keep the checkpoints of ``steps`` (and no other older ones) beyond the newest
        ``keep``: the rotation that follows each save leaves them (train.keep_best's step)."""
        self._kept.clear()
        self._kept.update(steps)

    def wait(self) -> None:
        """Blocks until every started save is on disk, then rotates (:meth:`_rotate`); raises
        CheckpointWriteError if a save failed."""
        try:
            self._manager.wait_until_finished()
        except OSError as e:
            raise self._write_error(self._saving, e) from None
        except Exception as e:  # orbax re-raises its writer threads' failures in other types
            code = os_error_code(f"{e} {e.__cause__ or ''} {e.__context__ or ''}")
            if code is None:
                raise
            # (a file size limit, a quota, an I/O error: tensorstore's text of it named no remedy)
            raise self._write_error(self._saving, OSError(code, os.strerror(code))) from None
        self._saving = None
        self._rotate()

    def _rotate(self) -> None:
        """Removes the steps older than the newest ``keep`` (and not kept by keep_also) that no
        reader holds; process 0 removes them, and every process re-lists after."""
        steps = self.all_steps()
        doomed = [s for i, s in enumerate(steps) if i < len(steps) - self.keep and s not in self._kept]
        if not doomed:
            return
        removed = remove_unheld(self.directory, doomed) if jax.process_index() == 0 else []
        if json.loads(outcome_of_process_0(json.dumps(removed))):
            self._manager.reload()

    def _write_error(self, step: int | None, e: OSError, detail: str = "") -> CheckpointWriteError:
        what = ("no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))) + detail
        at = f" at step {step}" if step is not None else ""
        # (as on disk now: the folder moved or removed while the run trained keeps none here)
        intact = [s for s in self.all_steps() if (self.directory / str(s)).is_dir()]
        kept = f"older checkpoints intact (steps {intact})" if intact else "no earlier checkpoint"
        if not self.directory.is_dir():
            kept = "the checkpoints folder is gone (moved or removed while the run trained)"
        return CheckpointWriteError(f"could not write the checkpoint{at} in {self.directory}: {what}; {kept}")

    def _set_aside(self, step: int) -> str:
        target = self.directory.parent / "damaged" / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        if jax.process_index() == 0:
            target.parent.mkdir(exist_ok=True)
            shutil.move(str(self.directory / str(step)), target)
        # Process 0 names the target (clocks differ) and has moved it before anyone re-lists.
        target = Path(outcome_of_process_0(str(target)))
        self._manager.reload()
        return f"moved to {target}"

    def _no_intact_advice(self) -> str:
        return f": fix or remove them, or pass a new {run_dir_flag()} to start fresh"

    def close(self) -> None:
        try:
            self.wait()
        except KeyboardInterrupt:  # (the run dir's lock goes after this: no second writer while these write)
            self._manager.wait_until_finished()
            raise
        self._manager.close()
