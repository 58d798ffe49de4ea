"""The training driver: ``train_and_evaluate(cfg, run_dir)`` reads top to bottom."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import math
import signal
import threading
import time
from pathlib import Path

import jax
import numpy as np

from dlrm_jax import hostmem, stopping
from dlrm_jax.config import Config, ConfigError
from dlrm_jax.data.batch import DataSource
from dlrm_jax.data.pipeline import InputPipeline, dispatched_ahead
from dlrm_jax.data.sources import cap_note, make_source, resolve_data_config
from dlrm_jax.embedding.hot import refresh as hot_setup
from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan
from dlrm_jax.embedding.plan.stats import collective_bytes
from dlrm_jax.embedding.tiers.runner import TierRunner
from dlrm_jax.embedding.tiers.setup import tier_root
from dlrm_jax.embedding.tiers.tables import TieredTables
from dlrm_jax.observe.metrics import MetricsWriter
from dlrm_jax.parallel.coordination import outcomes_of_every_process, report_progress, watch_for_hangs
from dlrm_jax.parallel.mesh import host_scalar
from dlrm_jax.train.build import build, mesh_from_config
from dlrm_jax.train.checkpoint import (
    Checkpoints,
    largest_shard_bytes,
)
from dlrm_jax.train.display import StepDisplay
from dlrm_jax.train.evaluate import RunSummary, evaluate
from dlrm_jax.train.planning import plan_summary, run_plan_report
from dlrm_jax.train.progress import (
    Evaluation,
    Progress,
    newest_progress,
    resumed_progress,
)
from dlrm_jax.train.restore import (
    check_tier_kept,
    restore_or_init,
)
from dlrm_jax.train.rundir import RunDir
from dlrm_jax.train.step import StepFunctions
from dlrm_jax.train.watch import LossWatch, TrainingDiverged  # noqa: F401 - TrainingDiverged: the trainer's error

# Fields only the run's final metrics.jsonl event has (a run cut at step N and resumed logs the
# same events as an uninterrupted one, except these at N).
RUN_END_FIELDS = ("run_samples_per_s", "best_step", "best_auc", "best_logloss", "stop_reason")

# How many train steps the host may dispatch ahead of the devices. XLA's CPU client launches
# each device's part of a program from a shared pool of max(cores, devices) threads, and a
# launch first takes one of the device's 32 in-flight slots, blocking its pool thread while
# the slots are full. A host that dispatches far ahead fills the slots; blocked launches then
# hold the pool threads that the running program's last devices need, so its all-reduce never
# gets all participants (rendezvous.cc "only 7 of them arrived", exit 134). Waiting for step
# N - DISPATCH_AHEAD before dispatching step N keeps a few programs in flight, far below the
# limit, and still overlaps host work with the device. Every program with collectives is
# dispatched from this (the main) thread, in the same order on every process; other threads
# (batch preparation, orbax's writer) never launch one.
DISPATCH_AHEAD = 2


class Interrupted(Exception):  # noqa: N818 - a control-flow signal, not an error
    """SIGINT/SIGTERM arrived; the state at ``step`` was checkpointed (if the run has a dir)."""

    def __init__(self, signum: int, step: int, saved: bool):
        self.signum, self.step, self.saved = signum, step, saved
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")


class _StopSignals:
    """SIGINT/SIGTERM set a flag the loop reads after each step; a second one exits at once."""

    def __init__(self):
        self.signum, self._old = None, {}

    def __enter__(self):
        stopping.raise_if_stopped()  # a signal before the loop whose exception was swallowed
        if threading.current_thread() is threading.main_thread():
            for sig in stopping.STOP_SIGNALS:  # SIGHUP: the terminal closed
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:  # asked twice: do not wait for the step
            raise KeyboardInterrupt
        self.signum = signum

    def requested(self, step: int, every: int) -> int | None:
        """The signal to stop on, agreed by every process (checked every ``every`` steps when
        there are several, since agreeing is a round trip to the coordinator). Agreed through
        the coordination service's key-value store, not a device program: it needs no device
        time, and a program with collectives that does not depend on the train state would
        still run on devices whose step failed when a peer died."""
        if jax.process_count() == 1:
            return self.signum
        if step % every:
            return None
        return max(map(int, outcomes_of_every_process(str(self.signum or 0)))) or None

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def train_and_evaluate(
    cfg: Config, run_dir: str | Path | None = None, *, log=print, source: DataSource | None = None
) -> RunSummary:
    """Train ``cfg`` on the current devices, resuming from ``run_dir``'s newest intact checkpoint.

    ``source``: the data, when not the config's ``data.source`` (a notebook's own loader, or
    in-memory arrays: :class:`~dlrm_jax.data.arrays.ArraySource`); any object with
    ``train_batch(step)``, ``eval_batches()`` and ``skip_report()`` (``num_train`` for epochs).

    Raises :class:`Interrupted` after saving when SIGINT/SIGTERM arrive, :class:`TrainingDiverged`
    (nothing saved past the last good checkpoint) when the loss blows up, and
    :class:`~dlrm_jax.train.rundir.RunDirError` (nothing written) for a run dir in use or one
    started with another model. Makes the process keep freed host buffers for reuse
    (:func:`dlrm_jax.hostmem.keep_freed_memory`).
    """
    hostmem.keep_freed_memory()
    cfg = resolve_data_config(cfg)
    mesh = mesh_from_config(cfg)  # first: every process's config is compared before any is used
    with RunDir.open(run_dir, cfg, writer=jax.process_index() == 0, log=log) as rd:
        given = source
        if cfg.train.epochs or cfg.train.evals_per_epoch:  # steps follow from the train split's rows
            source = source or make_source(cfg, jax.process_index(), jax.process_count(), evaluates=True)
            cfg = with_epoch_steps(cfg, source)
        newest, progress = newest_progress(rd.checkpoint_dir) if rd.path else (None, Progress())
        stopped = progress.stop_reason(cfg.train)
        recorded = rd.recorded_final(newest) if newest is not None and (newest >= cfg.train.steps or stopped) else None
        if recorded is not None:
            log(
                f"run stopped early at step {newest}: {stopped}; it is not trained further (change "
                f"train.target_auc or train.early_stop_evals to go on); its recorded final metrics:"
                if stopped
                else f"run already finished at step {newest}; its recorded final metrics:"
            )
            return RunSummary.from_event(recorded)
        watch_for_hangs(cfg.train.hang_timeout_s)  # from here: planning reads batches, restores, compiles
        report_progress(0, "planning")
        source = source or make_source(cfg, jax.process_index(), jax.process_count(), evaluates=True)
        for note in ("" if given else cap_note(cfg), epoch_note(cfg, source), source.skip_report()):
            if note:
                log(note)
        plan, steps = build(cfg, mesh, source, log)
        runner = None
        if plan.tiered_tables:
            if rd.path:
                check_tier_kept(tier_root(cfg, rd.path), rd.checkpoint_dir, log)
            tiered = TieredTables(
                plan,
                steps.collection.groups,
                steps.collection.optimizer,
                tier_root(cfg, rd.path),
                steps.embedding_key(),
                int(cfg.embedding.tier.chunk_mb * 2**20),
                log,
            )
            runner = TierRunner(steps, tiered, cfg.embedding.tier.lookahead)
        ckpts = None
        if rd.path:
            ckpts = Checkpoints(
                rd.checkpoint_dir, cfg.train.keep_checkpoints, largest_shard_bytes(steps.abstract_state())
            )
        metrics = MetricsWriter(rd.metrics_path, cfg.train.tensorboard)
        try:
            return _train(cfg, rd, ckpts, metrics, log, source, plan, steps, runner)
        finally:
            metrics.close()
            if ckpts:
                ckpts.close()
            if runner:
                runner.tiered.close()
            if steps.hot:
                steps.hot.close()


def with_epoch_steps(cfg: Config, source: DataSource) -> Config:
    """``cfg`` whose train.steps are train.epochs passes over ``source``'s train split and
    whose train.eval_every is an epoch over train.evals_per_epoch (the saved config keeps them
    as given: a resumed run derives the same steps)."""
    rows, t = getattr(source, "num_train", None), cfg.train
    if rows is None:
        raise ConfigError(
            "train.epochs, train.evals_per_epoch: synthetic data has no train split to count epochs "
            "of; use train.steps and train.eval_every"
        )
    steps = max(1, math.ceil(t.epochs * rows / t.batch_size)) if t.epochs else t.steps
    every = max(1, round(rows / t.batch_size / t.evals_per_epoch)) if t.evals_per_epoch else t.eval_every
    return dataclasses.replace(cfg, train=dataclasses.replace(t, steps=steps, eval_every=every))


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
    return f"train split: {rows:,} rows, {rows / t.batch_size:,.1f} steps of {t.batch_size:,} an epoch; {how}"


def _train(
    cfg: Config,
    rd: RunDir,
    ckpts: Checkpoints | None,
    metrics: MetricsWriter,
    log,
    source: DataSource,
    plan: EmbeddingPlan,
    steps: StepFunctions,
    runner: TierRunner | None = None,
) -> RunSummary:
    t = cfg.train
    epoch_rows = getattr(source, "num_train", None)
    mesh, hot = steps.mesh, steps.hot
    plan_json = plan.to_json()
    replicas = steps.hosts if steps.collection.replicas else 1
    sent = collective_bytes(plan, replicas)  # per device and step, at the compiled capacities
    report = run_plan_report(cfg, plan, jax.default_backend() == "cpu")
    if jax.process_index() == 0:  # the whole plan goes to RUN/plan.txt; the terminal gets its gist
        log(plan_summary(cfg, plan, jax.default_backend() == "cpu", rd.path))
    report_progress(0, "restoring or initialising the state")
    state = restore_or_init(steps, ckpts, log, runner.tiered if runner else None)
    rd.record(report, plan_json)  # only now: a refused resume leaves the run dir as it was
    start = int(host_scalar(state.step))
    progress, stop_reason = resumed_progress(t, ckpts, start, log)
    end = start if stop_reason else t.steps  # the last step this run trains
    metrics.truncate_after(start, log)

    t0 = time.perf_counter()
    report_progress(start, "compiling the train step", timed=False)
    if runner is None:
        compiled = steps.train_step.lower(state, steps.device_batch(source.train_batch(start))).compile()
        log(
            f"compiled the train step in {time.perf_counter() - t0:.1f}s on {mesh.size} "
            f"{jax.default_backend()} devices in {jax.process_count()} process(es); {_memory_report(compiled)}"
        )
        device_batches = getattr(source, "device_batches", None)  # generated on the devices
        if device_batches is not None:
            pipeline = None
            batches = dispatched_ahead(device_batches(steps.batch_sharding), range(start, end), cfg.data.prefetch)
        else:
            pipeline = InputPipeline(
                source.train_batch,
                range(start, end),
                to_device=steps.device_batch,
                readers=cfg.data.readers,
                depth=cfg.data.prefetch,
            )
            batches = pipeline
    else:
        pipeline = None
        if hot is not None:
            runner.use_hot(np.asarray(state.emb.hot.keys))
        batches = runner.planned(source.train_batch, range(start, end))

    bar = StepDisplay(
        t.steps,
        start,
        bar=t.progress_bar,
        shown=jax.process_index() == 0,
        batch=t.batch_size,
        epoch_rows=epoch_rows,
        log=log,
    )
    watch, pending = LossWatch(t.max_loss_ratio, progress.loss_reference), collections.deque()
    train_time, trained_steps, last_loss, window_start = 0.0, 0, float("nan"), None
    auc = ll = float("nan")
    scored = 0
    evaluated = False
    with _StopSignals() as stop, contextlib.closing(pipeline) if pipeline else contextlib.nullcontext():
        for step, item in zip(
            range(start + 1, end + 1), _reporting(batches, start + 1, runner is not None), strict=True
        ):
            window_start = window_start or time.perf_counter()
            if runner is None:
                ids = item.host.ids if item.host is not None else _LocalRows(item.device.ids)
                state, out = compiled(state, item.device)
            else:
                ids = item.ids  # as read: tiered runs train on a copy with cache ids
                state, out = runner.train(state, item.batch, item.fills)
            pending.append((step, out))
            if steps.per_host and cfg.embedding.sync_every and step % cfg.embedding.sync_every == 0:
                state = state._replace(emb=steps.sync_tables(state.emb))
            signum = stop.requested(step, every=10)
            is_eval = (t.eval_every and step % t.eval_every == 0) or step == t.steps
            is_ckpt = (t.checkpoint_every and step % t.checkpoint_every == 0) or step == t.steps or signum
            # A state that may be saved is scored first (before a hot-row refresh moves rows about);
            # an evaluation may ask for a save (a new best, an early stop).
            state_check = None
            if ckpts is not None and (is_ckpt or (is_eval and (t.keep_best or t.target_auc or t.early_stop_evals))):
                state_check = steps.state_check(state, item.device if runner is None else runner.last_batch)
            if hot is not None:
                state = hot_setup.count_and_refresh(hot, steps, state, step, ids, runner)
            while len(pending) > DISPATCH_AHEAD:
                watch.add(*pending.popleft())
            bar.update(1)
            if not (is_eval or is_ckpt or (t.log_every and step % t.log_every == 0)):
                continue
            while pending:  # every step up to here is checked before anything is saved
                watch.add(*pending.popleft())
            if state_check is not None:
                watch.check_state(step, state_check)
            elapsed = time.perf_counter() - window_start
            last_loss, window_steps, overflows, hit_rate = watch.take_window()
            train_time, trained_steps = train_time + elapsed, trained_steps + window_steps
            rate = window_steps * t.batch_size / elapsed
            event = {
                "event": "train",
                "step": step,
                "loss": last_loss,
                "samples_per_s": rate,
                "learning_rate": float(steps.schedule(step - 1)),
                "exchange_overflows": overflows,
                "hot_hit_rate": hit_rate,
                "a2a_bytes": sent["all-to-all"],
                "allreduce_bytes": sent["all-reduce"],
                "allgather_bytes": sent["all-gather"],
            }
            bar.window(step, last_loss, rate, train_time / max(trained_steps, 1))
            if runner is not None:
                event.update(runner.take_metrics(window_steps))
            if pipeline is not None:
                event.update(pipeline.times.take())
            if steps.per_host:
                event["table_divergence"] = host_scalar(steps.table_divergence(state.emb))
            if is_eval and not signum:
                report_progress(step, "evaluation", timed=evaluated)  # the first one compiles
                evaluated = True
                auc, ll, scored = evaluate(steps, state, source, runner)
                event.update(event="eval", auc=auc, logloss=ll, eval_samples=scored)
                bar.write(
                    f"step {step}: loss {last_loss:.4f} eval auc {auc:.4f} logloss {ll:.4f} on {scored:,} samples"
                )
                progress = progress.evaluated(Evaluation(step, auc, ll))
                stop_reason = progress.stop_reason(t)
                progress = dataclasses.replace(progress, stopped=stop_reason)
                if t.keep_best and progress.best.step == step and ckpts:  # a new best: saved and kept
                    is_ckpt = True
                    ckpts.keep_also([step])
                is_ckpt = is_ckpt or bool(stop_reason)
            if step == t.steps or stop_reason:
                event["run_samples_per_s"] = trained_steps * t.batch_size / train_time
                event.update(progress.final_fields(step, auc, ll))
            metrics.write(event)
            if is_ckpt and ckpts:
                report_progress(step, "checkpoint")
                if runner is not None:  # the tier's snapshot first: a saved step always has one
                    runner.tiered.checkpoint(
                        step, state.emb.tables, state.emb.slots, ckpts.all_steps(), t.keep_checkpoints, state.emb.hot
                    )
                progress = dataclasses.replace(progress, loss_reference=watch.reference)
                ckpts.save(
                    step,
                    steps.checkpoint_form(state),
                    plan_json,
                    hot.to_json() if hot else None,
                    steps.hosts if steps.per_host else 0,
                    progress.to_json(),
                )
            if signum:
                if ckpts:
                    ckpts.wait()
                bar.close()
                raise Interrupted(signum, step, saved=ckpts is not None)
            if stop_reason:
                log(f"early stop at step {step}: {stop_reason}")
                break
            window_start = None
    bar.close()
    report_progress(end, "finishing")

    if trained_steps == 0:  # nothing left to train: evaluate what the checkpoint holds
        auc, ll, scored = evaluate(steps, state, source, runner)
    rate = trained_steps * t.batch_size / train_time if train_time else float("nan")
    step = int(host_scalar(state.step))
    return RunSummary(step, last_loss, auc, ll, rate, progress.best or Evaluation(step, auc, ll), stop_reason, scored)


class _LocalRows:
    """This process's rows of a device array, copied to the host only if read (hot-row
    counting reads a batch's ids on the steps it counts)."""

    def __init__(self, x: jax.Array):
        self._x = x

    def __array__(self, dtype=None, copy=None):
        by_start = {s.index[0].start or 0: s for s in self._x.addressable_shards}  # replicas once
        local = np.concatenate([np.asarray(by_start[k].data) for k in sorted(by_start)])
        return local if dtype is None else local.astype(dtype)


def _reporting(batches, first_step: int, first_compiles: bool):
    """``batches``, telling the hang watch (train.hang_timeout_s) when the loop waits for one
    and when a step runs (untimed when ``first_compiles``: the tiered step compiles on first use)."""
    it = iter(batches)
    for step in itertools.count(first_step):
        report_progress(step, "reading input")
        try:
            item = next(it)
        except StopIteration:
            return
        first = first_compiles and step == first_step
        report_progress(step, "compiling and running the first train step" if first else "train step", not first)
        yield item


def _memory_report(compiled) -> str:
    try:
        m = compiled.memory_analysis()
        total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
        return f"per-device memory {total / 2**20:.1f} MiB (temp {m.temp_size_in_bytes / 2**20:.1f} MiB)"
    except Exception:  # noqa: BLE001 - not every backend reports memory
        return "memory analysis unavailable"
