"""Reading checkpoints without changing them: what ``eval``, ``export`` and a resume read,
while a training run may be saving into the same folder (its writer,
:class:`~dlrm_jax.train.checkpoint.Checkpoints`, is a reader too).

Restores check the arrays against the checksums saved beside them, skip a step a training run
removed since it was listed, and try older steps when the newest is damaged, every process
deciding together.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from contextlib import closing
from pathlib import Path

import jax
import tensorstore as ts

from dlrm_jax import stopping
from dlrm_jax.files import numbered_folders
from dlrm_jax.parallel.coordination import outcome_of_process_0, outcomes_of_every_process
from dlrm_jax.train.checkpoint_leases import ReaderLeases
from dlrm_jax.train.orbax_quiet import ocp
from dlrm_jax.train.saved_array import OCDBT_CACHE, SavedArray
from dlrm_jax.train.state_digest import ChecksumMismatch, combine, first_mismatch, leaf_names, process_sums


def _no_raw_byte_telemetry() -> None:
    """Orbax (0.12) counts the bytes tensorstore wrote or read for each array it saves or
    restores, for telemetry of its own, through ``ts.experimental_collect_matching_metrics``,
    whose Python binding (tensorstore 0.1.86) keeps about 3 KB and five objects of every call:
    a run's host memory grew 68-87 KB a checkpoint for good (36 KB a save of 40 arrays with
    orbax alone; 1.7 GB over a long run saving every 50 steps). The count is taken as 0, so
    orbax records none; what the checkpoints hold is unchanged."""
    from orbax.checkpoint._src.serialization import tensorstore_utils

    if hasattr(tensorstore_utils, "get_tensorstore_raw_bytes"):
        tensorstore_utils.get_tensorstore_raw_bytes = lambda *args, **kwargs: 0


_no_raw_byte_telemetry()


class IncompatibleCheckpoint(ValueError):
    """A checkpoint this config cannot restore (not damage: it is left where it is)."""


class CheckpointsIntact(OSError):
    """A restore failed for a cause outside the checkpoints (a folder it must write is not
    writable): none is damaged, so none is set aside and no older one is tried."""


def saved_steps(directory: Path) -> list[int]:
    """Steps of the complete checkpoints in ``directory`` (orbax renames a step's folder to
    its number only once it is whole), read from the folder names without opening anything."""
    return numbered_folders(directory)


def saved_json(directory: Path, step: int) -> dict:
    """What a checkpoint saved beside its arrays (plan, hot-row statistics, hosts), read
    without a checkpoint manager (which would clean up a running save's temporary folders)."""
    with closing(ocp.JsonCheckpointHandler()) as handler:
        return handler.restore(Path(directory) / str(step) / "plan", args=ocp.args.JsonRestore())


@contextlib.contextmanager
def reading(directory: Path):
    """Leases (:class:`ReaderLeases`) on every checkpoint now in ``directory``, held until the
    block ends: a training run's rotation keeps them while ``eval`` or ``export`` reads."""
    leases = ReaderLeases(directory)
    try:
        for step in saved_steps(directory):
            leases.hold(step)  # False: being removed, and not read
        yield leases
    finally:
        leases.release()


class CheckpointReader:
    """Reads the checkpoints under ``directory`` and never changes them (``eval``, ``export``):
    a training run may be saving into the same folder. It holds a lease on each step it reads
    (``checkpoints/.readers/``, :mod:`~dlrm_jax.train.checkpoint_leases`), which keeps the
    run's rotation from removing it midway; ``leases``: a session's (:func:`reading`).

    Lists only complete steps, by folder name: an in-flight save's temporary folder
    (``N.orbax-checkpoint-tmp-*``) is not one. It opens no orbax CheckpointManager, whose
    start-up removes temporary folders, a running training's save among them. A step that
    cannot be read is skipped with a one-line warning and left where it is.
    """

    def __init__(self, directory: Path, leases: ReaderLeases | None = None):
        self.directory = Path(directory).absolute()
        self._sums: dict[int, dict[str, int]] = {}  # step -> this process's part of its checksums
        self._own_leases = leases is None
        self._leases = ReaderLeases(self.directory) if leases is None else leases

    def hold(self, step: int) -> bool:
        """Whether ``step`` is held on every process (False: a training run removed it, or
        is removing it, since it was listed: not damage)."""
        held = self._leases.hold(step)
        return all(json.loads(o) for o in outcomes_of_every_process(json.dumps(held)))

    def release(self) -> None:
        """Drops the leases this reader took (a session's are dropped when it ends)."""
        if self._own_leases:
            self._leases.release()

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        return saved_steps(self.directory)

    def _step(self, step: int | None) -> int:
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError("no checkpoint to restore")
        return step

    # Restores call the item handlers directly, not orbax's manager: orbax ends every restore
    # with a barrier across processes, so a process whose shards of a damaged checkpoint fail
    # to read would leave the others waiting there. Each process reads its part, then
    # restore_newest_intact decides with the others whether the step was whole.

    def saved_plan(self, step: int | None = None) -> str:
        """The JSON of the plan the checkpoint at ``step`` (default newest) was saved with."""
        return self._saved_json(step)["plan"]

    def saved_hot_counts(self, step: int | None = None) -> dict | None:
        """The hot-row statistics saved with the checkpoint at ``step`` (None: none saved)."""
        return self._saved_json(step).get("hot_counts")

    def saved_hosts(self, step: int | None = None) -> int:
        """How many hosts' tables the checkpoint at ``step`` holds (0: one set, not per host)."""
        return int(self._saved_json(step).get("hosts") or 0)

    def _saved_json(self, step: int | None) -> dict:
        return saved_json(self.directory, self._step(step))

    def check_fits(self, expected, step: int | None = None) -> None:
        """Raises IncompatibleCheckpoint naming the first array whose shape in the checkpoint
        at ``step`` differs from ``expected``'s (a pytree of arrays or ShapeDtypeStructs), or
        that only one of them has: the config asks for another model, nothing is damaged.
        Metadata that cannot be read is damage, raised as orbax raises it."""
        path = self.directory / str(self._step(step))
        with closing(ocp.StandardCheckpointHandler()) as handler:
            saved = _shapes(handler.metadata(path / "state").tree)
        want = _shapes(expected)
        names = sorted(saved.keys() | want.keys(), key=lambda k: (k.startswith("opt_state"), k))  # params first
        differ = [(k, saved.get(k), want.get(k)) for k in names if saved.get(k) != want.get(k)]
        if not differ:
            return
        name, there, here = differ[0]
        what = (
            f"{name} is not in the checkpoint"
            if there is None
            else f"{name} is not in this config's state"
            if here is None
            else f"{name} has shape {there} there, {here} here"
        )
        more = f" (and {len(differ) - 1} more arrays)" if len(differ) > 1 else ""
        raise IncompatibleCheckpoint(f"checkpoint {path} does not fit this config: {what}{more}")

    def restore(self, abstract_state: dict, step: int | None = None) -> dict:
        """The state at ``step`` (default newest), laid out like ``abstract_state``'s shardings
        (a dict of the saved tree's top-level entries)."""
        self.check_fits(abstract_state, step)
        path = self.directory / str(self._step(step)) / "state"
        with closing(ocp.StandardCheckpointHandler()) as handler:
            item = self._with_empty_entries(handler, path, abstract_state)
            state = handler.restore(path, args=ocp.args.StandardRestore(item))
        state = {k: state[k] for k in abstract_state}
        self._sums[self._step(step)] = process_sums(state)
        return state

    def _contents_differ(self, step: int, every: list[dict | None]) -> str:
        """What differs between the arrays restored at ``step`` (``every`` process's part of
        their checksums; None: a process restored nothing to check) and the checksums saved
        with them; "" when nothing does."""
        if any(part is None for part in every):
            return ""
        return first_mismatch(combine(every), self._saved_json(step).get("checksums"))

    def check_contents(self, step: int) -> None:
        """Raises ChecksumMismatch when an array restored at ``step`` differs from its saved
        checksum (after a restore of that step outside :meth:`restore_newest_intact`)."""
        every = [json.loads(o) for o in outcomes_of_every_process(json.dumps(self._sums.pop(step, None)))]
        if differ := self._contents_differ(step, every):
            raise ChecksumMismatch(differ)

    @staticmethod
    def _with_empty_entries(handler, path: Path, abstract_state: dict) -> dict:
        """``abstract_state`` with the saved tree's empty top-level entries that it lacks
        (checkpoints written before extra sparse parts were named hold an empty ``wide``):
        orbax restores only a tree of the saved structure, and check_fits has compared every
        array already."""
        saved = handler.metadata(path).tree
        empty = {k: {} for k, v in saved.items() if k not in abstract_state and not jax.tree.leaves(v)}
        return {**abstract_state, **empty}

    def restore_lazily(self, abstract_state: dict, field: str, saved_like, step: int | None = None) -> dict:
        """The state at ``step`` (default newest) laid out like ``abstract_state``, except
        ``field``, which was saved in another layout (its arrays shaped like ``saved_like``):
        those come back unread, as :class:`SavedArray` readers of the checkpoint's arrays."""
        step = self._step(step)
        self.check_fits({**abstract_state, field: saved_like}, step)
        skipped = {**abstract_state, field: jax.tree.map(lambda _: ocp.PLACEHOLDER, saved_like)}
        parent = self.directory / str(step) / "state"
        with closing(ocp.PyTreeCheckpointHandler()) as handler:
            skipped = self._with_empty_entries(handler, parent, skipped)
            state = handler.restore(
                parent,
                args=ocp.args.PyTreeRestore(skipped, restore_args=ocp.checkpoint_utils.construct_restore_args(skipped)),
            )

        def spec(name: str, context: ts.Context) -> dict:
            info = ocp.type_handlers.ParamInfo(name=name, parent_dir=parent, use_zarr3=False, ts_context=context)
            return ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=True)

        names = jax.tree_util.tree_map_with_path(
            lambda path, _: ".".join([field, *(str(getattr(k, "name", getattr(k, "key", k))) for k in path)]),
            saved_like,
        )
        # A few decoded chunks cached, shared by all arrays: consecutive reads mostly revisit them.
        probe = ts.Context(OCDBT_CACHE)
        chunk = max(SavedArray.open(spec(n, probe), probe).chunk_bytes for n in jax.tree.leaves(names))
        context = ts.Context({"cache_pool": {"total_bytes_limit": 4 * chunk}, **OCDBT_CACHE})
        readers = jax.tree.map(lambda n: SavedArray.open(spec(n, context), context), names)
        state = {k: state[k] for k in abstract_state}
        self._sums[step] = process_sums(state)  # not `field`'s: read later, row by row, to be re-laid out
        return {**state, field: readers}

    def restore_newest_intact(self, restore_step, log=print):
        """``restore_step(step)`` for the newest step that restores on every process; each
        damaged newer one gets a one-line warning and is set aside (:meth:`_set_aside`) once an
        older one restored. Returns (step, result). None restoring is an error that moves
        nothing; IncompatibleCheckpoint (the config, not the checkpoint) and CheckpointsIntact
        (the machine) are raised at once.

        Every process reads its own shards, so one may fail where the others succeed: they
        exchange outcomes and skip a step together (no device is touched while deciding)."""
        damaged, tried = [], set()
        while (step := self._newest_untried(tried)) is not None:
            tried.add(step)
            if not self.hold(step):
                continue  # removed by a training run's rotation since it was listed: not damage
            try:
                with _native_noise_to(self.directory.parent / "dlrm-jax.log"):
                    result, failure = restore_step(step), ""
            except (IncompatibleCheckpoint, CheckpointsIntact):
                raise
            except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many kinds
                result, failure = None, error_line(e)
            sums = None if failure else self._sums.pop(step, None)
            every = [json.loads(o) for o in outcomes_of_every_process(json.dumps([failure, sums]))]
            failures = [(p, f) for p, (f, _) in enumerate(every) if f]
            if not failures and (differ := self._contents_differ(step, [s for _, s in every])):
                failures = [(None, differ)]  # every process read its files, the whole is not what was saved
            if not failures:
                for bad, reason in damaged:
                    log(
                        f"warning: checkpoint {self.directory / str(bad)} is damaged ({reason}); {self._set_aside(bad)}"
                    )
                return step, result
            del result  # a partly restored state: its arrays are dropped before the next try
            process, reason = failures[0]
            on = f" on process {process}" if process is not None and jax.process_count() > 1 else ""
            damaged.append((step, reason + on))
        if not damaged:
            raise FileNotFoundError(f"{self.directory}: no checkpoint to restore")
        newest, reason = damaged[0]
        raise FileNotFoundError(
            f"{self.directory}: none of the {len(damaged)} checkpoints restores (newest, step {newest}: {reason}); "
            f"nothing was moved{self._no_intact_advice()}"
        )

    def _newest_untried(self, tried: set[int]) -> int | None:
        """The newest step on disk not in ``tried`` (listed afresh: a training run may have
        saved since), as process 0 sees it: every process tries the same one."""
        fresh = [s for s in self.all_steps() if s not in tried]
        return json.loads(outcome_of_process_0(json.dumps(fresh[-1] if fresh else None)))

    def _set_aside(self, step: int) -> str:
        """What became of a damaged step older ones replaced: a reader leaves it in place."""
        return "skipped it (left in place: only a training run sets damaged checkpoints aside)"

    def _no_intact_advice(self) -> str:
        return ""


@contextlib.contextmanager
def _native_noise_to(log: Path, settle_s: float = 1.0):
    """Whatever is written to stderr (fd 2) while a restore is tried goes to ``log``. When one
    fails, tensorstore's reads still in flight finish into orbax's closed event loop, and each
    prints a traceback from a native thread ("Event loop is closed": 28 of them, 168 lines, for
    one damaged checkpoint); the damage itself is reported in one line. On a failure the
    redirection stays ``settle_s`` longer, for the late ones. A log that stays empty is not
    left behind: like the libraries' logger, only the first message makes it."""
    sys.stderr.flush()
    saved, made = os.dup(2), not log.exists()
    try:
        target = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
        target = os.open(os.devnull, os.O_WRONLY)
    os.dup2(target, 2)
    os.close(target)
    try:
        with stopping.stop_lines_to(saved):  # (a stop's lines to the terminal, not the log)
            yield
    except BaseException:
        time.sleep(settle_s)
        raise
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        with contextlib.suppress(OSError):
            if made and log.stat().st_size == 0:
                log.unlink()


def _shapes(tree) -> dict[str, tuple[int, ...]]:
    """{"params.bottom.layers.0.kernel": shape} of every array of a pytree."""
    return {
        name: tuple(getattr(leaf, "shape", None) or ())
        for name, leaf in zip(leaf_names(tree), jax.tree.leaves(tree), strict=True)
    }


def error_line(e: Exception) -> str:
    """A library's failure in one line: its first, without TensorStore's details (a method's repr)."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return line.split(" See full TensorStore details")[0][:200]  # the rest is a method's repr
