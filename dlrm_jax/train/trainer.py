"""The training driver: ``train_and_evaluate(cfg, run_dir)`` reads top to bottom."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import tempfile
import threading
from pathlib import Path

import jax

from dlrm_jax import hostmem, stopping
from dlrm_jax.choices import HostMemory
from dlrm_jax.config import Config, ConfigError, validated
from dlrm_jax.config_checks import check_schedule
from dlrm_jax.config_schema import TrainConfig
from dlrm_jax.data.batch import DataSource, check_source
from dlrm_jax.data.host_buffers import HostBuffers
from dlrm_jax.data.sources import cap_note, close_source, make_source, resolve_data_config
from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan
from dlrm_jax.embedding.tiers.tables import TieredTables
from dlrm_jax.jax_settings import with_library_settings
from dlrm_jax.observe.loop_trace import LoopTrace
from dlrm_jax.observe.metrics import MetricsWriter
from dlrm_jax.parallel.mesh import host_scalar
from dlrm_jax.parallel.watchdog import report_progress, saves_checkpoints_in, watch_for_hangs
from dlrm_jax.train.build import build, mesh_from_config
from dlrm_jax.train.checkpoint import Checkpoints, largest_shard_bytes
from dlrm_jax.train.checks import EPOCHS_NEED_A_SPLIT, check_runnable
from dlrm_jax.train.driver import DeviceDriver, StepDriver, TieredDriver
from dlrm_jax.train.evaluate import RunSummary
from dlrm_jax.train.library_log import closed_loops_logged, library_logs_in
from dlrm_jax.train.loop import RUN_END_FIELDS, Plan, TrainingLoop, reporting  # noqa: F401
from dlrm_jax.train.optimizer_setup import decay_moved
from dlrm_jax.train.planning import plan_summary, run_plan_report
from dlrm_jax.train.progress import Evaluation, Progress, newest_progress, resumed_progress
from dlrm_jax.train.restore import (
    check_tier_kept,
    check_tier_owner,
    check_tiers_unmoved,
    restore_or_init,
    saved_tiers,
)
from dlrm_jax.train.rundir import RunDir, RunDirError
from dlrm_jax.train.step import StepFunctions
from dlrm_jax.train.stop_signals import STOP_AGREE_EVERY, Interrupted, StopSignals  # noqa: F401 - the API's
from dlrm_jax.train.watch import TrainingDiverged  # noqa: F401 - the trainer's error
from dlrm_jax.train.wiring import tier_root
from dlrm_jax.wording import said

_ONE_RUN = threading.Lock()  # orbax's checkpointing is process-wide: two runs at once broke each other's saves


def _one_run_at_a_time(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if not _ONE_RUN.acquire(blocking=False):
            raise RuntimeError(
                "another dlrm_jax run is training in this process (a thread of a sweep?): orbax's "
                "checkpointing is process-wide, and two runs at once broke each other's checkpoints; "
                "run them one after the other, or in processes of their own"
            )
        try:
            return fn(*args, **kwargs)
        finally:
            _ONE_RUN.release()

    return wrapped


@_one_run_at_a_time
@with_library_settings  # (whatever JAX settings the process has: see jax_settings)
def train_and_evaluate(
    cfg: Config, run_dir: str | Path | None = None, *, log=print, source: DataSource | None = None
) -> RunSummary:
    """Train ``cfg`` on the current devices, resuming from ``run_dir``'s newest intact checkpoint.

    ``source``: the data, when not the config's ``data.source`` (a notebook's own loader, or
    in-memory arrays: :class:`~dlrm_jax.data.sources.arrays.ArraySource`); any object with
    ``train_batch(step)`` and ``eval_batches()`` (``skip_report()``: a line on what it skipped;
    ``num_train`` for epochs).

    Raises :class:`Interrupted` after saving when SIGINT/SIGTERM arrive, :class:`TrainingDiverged`
    (nothing saved past the last good checkpoint) when the loss blows up, and
    :class:`~dlrm_jax.train.rundir.RunDirError` (nothing written) for a run dir in use or one
    started with another model. Makes the process keep freed host buffers for reuse
    (:func:`dlrm_jax.hostmem.keep_freed_memory`). ``log=None``: no progress lines.
    """
    log = log or _silent
    check_source(source)
    hostmem.keep_freed_memory()
    cfg = resolve_data_config(validated(cfg))  # (a config built in code, dataclasses.replace's, is unchecked)
    mesh = mesh_from_config(cfg)  # first: every process's config is compared before any is used
    simulated = jax.default_backend() == "cpu"
    check_runnable(cfg, mesh.size, jax.process_count(), simulated=simulated, source_given=source is not None)
    if hasattr(source, "check_config"):  # (a source of the caller's: against the config, before a run dir is made)
        source.check_config(cfg)
    if cfg.data.host_memory == HostMemory.PINNED:  # a runtime that cannot pin: refused before a run dir is made
        HostBuffers.for_devices(cfg.data.host_memory).close()
    with (
        RunDir.open(run_dir, cfg, writer=jax.process_index() == 0, log=log, source_given=source is not None) as rd,
        contextlib.ExitStack() as stack,
    ):
        if rd.path:  # (the command line's already are)
            stack.enter_context(library_logs_in(rd.path, jax.process_index()))
        stack.enter_context(closed_loops_logged())  # (a failed checkpoint write's stragglers)
        given = source
        if cfg.train.epochs or cfg.train.evals_per_epoch:  # steps follow from the train split's rows
            source = source or make_source(cfg, jax.process_index(), jax.process_count(), evaluates=cfg.train.evaluates)
            cfg = with_epoch_steps(cfg, source)
        recorded = _recorded_final(cfg, rd, log)
        if recorded is not None:
            return RunSummary.from_event(recorded)
        watch_for_hangs(cfg.train.hang_timeout_s)  # from here: planning reads batches, restores, compiles
        report_progress(0, "planning")
        with stopping.deferred("planning"):  # it compiles too: a stop waits for the end (see stopping)
            source = source or make_source(cfg, jax.process_index(), jax.process_count(), evaluates=cfg.train.evaluates)
            if given is None:  # (a notebook's runs each make one: its open files go with the run)
                stack.callback(close_source, source)
            skipped = source.skip_report() if hasattr(source, "skip_report") else ""
            for note in ("" if given else cap_note(cfg), epoch_note(cfg, source), skipped):
                if note:
                    log(note)
            asked = rd.resumed_config or cfg  # (the config its checkpoints were saved with)
            saved = saved_tiers(rd.checkpoint_dir, asked) if rd.path and cfg.tiered_tables else None
            plan, steps = build(cfg, mesh, source, log, saved)
            if rd.path:
                check_tiers_unmoved(rd.checkpoint_dir, plan)  # (before a tier is made for it)
            driver = stack.enter_context(contextlib.closing(_driver(cfg, rd, plan, steps, source, log)))
            ckpts = None
            stack.enter_context(saves_checkpoints_in(rd.checkpoint_dir if rd.path else None))  # (a lost peer's advice)
            if rd.path:
                ckpts = Checkpoints(
                    rd.checkpoint_dir, cfg.train.keep_checkpoints, largest_shard_bytes(steps.abstract_state())
                )
                stack.callback(ckpts.close)
            metrics = stack.enter_context(contextlib.closing(MetricsWriter(rd.metrics_path, cfg.train.tensorboard)))
        return _train(cfg, rd, ckpts, metrics, log, plan, driver, type(given).__name__ if given is not None else "")


def _silent(*_) -> None:
    pass


def _recorded_final(cfg: Config, rd: RunDir, log) -> dict | None:
    """A finished (or early-stopped) run's final event: it is not trained further."""
    newest, progress = newest_progress(rd.checkpoint_dir) if rd.path else (None, Progress())
    stopped = progress.stop_reason(cfg.train)
    recorded = (
        rd.recorded_final(newest, cfg.train.evaluates, log)
        if newest is not None and (newest >= cfg.train.steps or stopped)
        else None
    )
    if recorded is None and newest is not None and newest > cfg.train.steps and not stopped:
        raise RunDirError(
            f"run dir {rd.path} holds a checkpoint at step {newest}, past train.steps={cfg.train.steps}: nothing to "
            f"train; score it with {said(f'`dlrm-jax eval --run-dir {rd.path}`', f'evaluate_run({str(rd.path)!r})')}, "
            f"or set train.steps >= {newest} to go on"
        )
    if recorded is not None:
        log(
            f"run stopped early at step {newest}: {stopped}; it is not trained further (change "
            f"train.target_auc or train.early_stop_evals to go on); its recorded final metrics:"
            if stopped
            else f"run already finished at step {newest}; its recorded final metrics:"
        )
    return recorded


def _driver(cfg: Config, rd: RunDir, plan: EmbeddingPlan, steps: StepFunctions, source: DataSource, log) -> StepDriver:
    """The tiered driver for a plan with tiered tables, else the device one."""
    if not plan.tiered_tables:
        return DeviceDriver(
            steps, source, cfg.data.readers, cfg.data.prefetch, log, cfg.data.reader_processes, cfg.data.host_memory
        )
    root = tier_root(cfg, rd.path)
    check_tier_owner(root, rd.path, rd.checkpoint_dir if rd.path else None)
    if rd.path:
        was = tier_root(rd.resumed_config, rd.path) if rd.resumed_config is not None else None
        check_tier_kept(root, rd.checkpoint_dir, log, was)
    tier = cfg.embedding.tier
    tiered = TieredTables(
        plan,
        steps.collection.groups,
        steps.collection.optimizer,
        root,
        steps.embedding_key(),
        int(tier.chunk_mb * 2**20),
        log,
        maps=steps.tiered_maps,
        run_dir=rd.path,
    )
    return TieredDriver(steps, source, tiered, tier.lookahead, log)


def with_epoch_steps(cfg: Config, source: DataSource) -> Config:
    """``cfg`` whose train.steps are train.epochs passes over ``source``'s train split and
    whose train.eval_every is an epoch over train.evals_per_epoch (the saved config keeps them
    as given: a resumed run derives the same steps)."""
    rows, t = getattr(source, "num_train", None), cfg.train
    if rows is None:
        raise ConfigError(EPOCHS_NEED_A_SPLIT)
    steps = max(1, math.ceil(t.epochs * rows / t.batch_size)) if t.epochs else t.steps
    every = max(1, round(rows / t.batch_size / t.evals_per_epoch)) if t.evals_per_epoch else t.eval_every
    t = dataclasses.replace(t, steps=steps, eval_every=every)
    if cfg.train.epochs:  # (the config's own steps were checked when it was loaded)
        check_schedule(t, f", from train.epochs={cfg.train.epochs:g}")
    return dataclasses.replace(cfg, train=t)


FEW_STEPS_AN_EPOCH = 100  # below this many steps an epoch, the epoch note suggests a smaller batch


def epoch_note(cfg: Config, source: DataSource) -> str:
    """One line: the train split's rows, steps of the batch an epoch, and the run's length in
    epochs ('' for data without a split)."""
    rows = getattr(source, "num_train", None)
    if not rows:
        return ""
    t = cfg.train
    how = (
        f"train.epochs={t.epochs:g} sets train.steps={t.steps:,}"
        if t.epochs
        else f"train.steps={t.steps:,} is {t.steps * t.batch_size / rows:.2f} epochs (or set train.epochs)"
    )
    if t.evals_per_epoch:
        how += f"; train.evals_per_epoch={t.evals_per_epoch} sets train.eval_every={t.eval_every:,}"
    note = f"train split: {rows:,} rows, {rows / t.batch_size:,.1f} steps of {t.batch_size:,} an epoch; {how}"
    if rows / t.batch_size < FEW_STEPS_AN_EPOCH:
        smaller = max(64, 2 ** int(math.log2(max(rows // FEW_STEPS_AN_EPOCH, 1))))
        if smaller < t.batch_size:
            note += (
                f"\nnote: the batch is large for this data: a smaller one learns more an epoch "
                f"(e.g. train.batch_size={smaller}: {rows / smaller:,.0f} steps; Criteo's 8k-line sample "
                f"reached AUC 0.735 at 128 against 0.709 at 2,048)"
            )
    return note


def _loop_trace(t: TrainConfig, rd: RunDir, start: int, end: int) -> LoopTrace | None:
    """``train.trace_steps``' trace, into the run dir's ``trace/process_N`` (or a temporary
    dir for a run without one)."""
    if not t.trace_steps or end - start < 2:
        return None
    root = rd.path / "trace" if rd.path else Path(tempfile.mkdtemp(prefix="dlrm-jax-trace-"))
    first = LoopTrace.first_step(start, end, t.trace_steps, t.log_every)
    return LoopTrace(first, t.trace_steps, str(root / f"process_{jax.process_index()}"))


def _train(
    cfg: Config,
    rd: RunDir,
    ckpts: Checkpoints | None,
    metrics: MetricsWriter,
    log,
    plan: EmbeddingPlan,
    driver: StepDriver,
    given_source: str = "",
) -> RunSummary:
    t, steps, on_cpu = cfg.train, driver.steps, jax.default_backend() == "cpu"
    if jax.process_index() == 0:  # the whole plan goes to RUN/plan.txt; the terminal gets its gist
        log(plan_summary(cfg, plan, on_cpu, rd.path))
    report_progress(0, "restoring or initialising the state")
    with stopping.deferred("restoring the state and compiling the train step"):
        state = restore_or_init(steps, ckpts, log, getattr(driver, "tiered", None))
        start = int(host_scalar(state.step))
        # only now: a refused resume changes nothing
        rd.record(
            run_plan_report(cfg, plan, on_cpu), plan.to_json(), fresh=start == 0, log=log, given_source=given_source
        )
        progress, stop_reason = resumed_progress(t, ckpts, start, log)
        end = start if stop_reason else t.steps  # the last step this run trains
        if rd.resumed_config is not None and start < end:
            was = rd.resumed_config
            was = with_epoch_steps(was, driver.source) if was.train.epochs else was
            if moved := decay_moved(was, cfg, start):
                log(moved)
        metrics.truncate_after(start, log)
        report_progress(start, "compiling the train step", timed=False)
        batches = reporting(driver.batches(state, start, end), start + 1, driver.compiles_on_first_step)
    loop = TrainingLoop(cfg.train, driver, ckpts, metrics, plan, progress, start, log, _loop_trace(t, rd, start, end))
    agree_every = 1 if jax.process_count() == 1 else STOP_AGREE_EVERY
    with StopSignals(saves=ckpts is not None, agree_every=agree_every) as stop, loop.running():
        if start < end and progress.window_unscored(start, loop.windows):  # (train.steps raised past its end)
            loop.progressive(start, state)
        for step, item in zip(range(start + 1, end + 1), batches, strict=True):
            state = loop.dispatch(state, step, item)
            todo = loop.plan_step(step, stop.requested(step))
            state = loop.after_step(state, step, item, todo)
            if not todo.log:
                continue
            event = loop.window_event(step, state)
            # (a stop at an evaluation's step evaluates first: a resumed run decides, and records,
            # as the uninterrupted one: the stop dropped that evaluation and its window for good)
            if todo.evaluate:
                todo = loop.evaluate(step, state, event, todo)
            loop.record(step, event)
            if todo.progressive and not loop.stop_reason:
                loop.progressive(step, state)
            if todo.save and ckpts:
                loop.save(step, state)
            if todo.signum:
                raise loop.interrupted(step, todo.signum)
            if loop.stop_reason:
                log(f"early stop at step {step}: {loop.stop_reason}")
                break
        # The last save committed under the loop's handlers: a stop now waits for it (outside
        # them a notebook's Ctrl-C left it half written, and a re-run wrote over it at once).
        loop.settle()
        if stop.signum and jax.process_count() == 1:  # (several: each agrees only at steps, and all are done)
            raise loop.interrupted(int(host_scalar(state.step)), stop.signum)
    loop.bar.close()
    report_progress(end, "finishing")
    if loop.trained_steps == 0 and t.evaluates:  # the run's end, saved, but its evaluation not recorded
        with stopping.deferred("the evaluation"):
            loop.last_loss = metrics.loss_before  # (none trained here: the window that ended at start)
            event = {"step": start, "loss": loop.last_loss, "samples_per_s": float("nan")}
            last = loop.progress.last
            if last is not None and last.step == start:  # counted already (killed before its record)
                loop.auc, loop.logloss, loop.scored = driver.evaluate(state)
                event.update(event="eval", auc=loop.auc, logloss=loop.logloss, eval_samples=loop.scored)
            else:
                loop.evaluate(start, state, event, Plan(True, False, True, None))
            metrics.write({**event, **loop.progress.final_fields(start, loop.auc, loop.logloss)})
    step = int(host_scalar(state.step))
    best = loop.progress.best or (Evaluation(step, loop.auc, loop.logloss) if t.evaluates else None)
    return RunSummary(
        step,
        loop.last_loss,
        loop.auc,
        loop.logloss,
        loop.samples_per_s,
        best,
        loop.stop_reason or stop_reason,
        loop.scored,
    )
