"""What happens around each train step, one concern to a method: dispatching the step and the
host work after it, deciding what this step does (log, evaluate, save), the window's metrics
event, evaluation with the run's record (best, early stop), and the checkpoint.
``trainer._train`` drives it top to bottom."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import time
from typing import NamedTuple

import jax

from dlrm_jax.config_schema import TrainConfig
from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan
from dlrm_jax.embedding.plan.stats import collective_bytes
from dlrm_jax.observe.loop_trace import LoopTrace, format_summary
from dlrm_jax.observe.metrics import MetricsWriter
from dlrm_jax.parallel.mesh import host_scalar
from dlrm_jax.parallel.watchdog import report_progress
from dlrm_jax.train.checkpoint import Checkpoints
from dlrm_jax.train.display import StepDisplay
from dlrm_jax.train.driver import StepDriver
from dlrm_jax.train.evaluate import Indexed
from dlrm_jax.train.progress import Evaluation, Progress, auc_note
from dlrm_jax.train.release import ReleaseThread
from dlrm_jax.train.step import TrainState
from dlrm_jax.train.stop_signals import Interrupted
from dlrm_jax.train.watch import LossWatch

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


class Plan(NamedTuple):
    """What step ``step`` does besides training: evaluate, save, log; ``signum``: stop after it."""

    evaluate: bool
    save: bool
    log: bool
    signum: int | None
    progressive: bool = False  # score the next window's training batches (train.progressive_window)


def progressive_windows(t: TrainConfig, source) -> dict[int, tuple[int, int, str]]:
    """The progressive validation windows of a run (``train.progressive_window``): the step
    each begins at -> (its index, the step after its last, its label). Every N steps, or the
    dataset's own windows (``data``: :meth:`~dlrm_jax.data.sources.binary.BinarySource.window_steps`);
    the first window is never scored (no model has trained before it), the last is scored whole
    (past ``train.steps`` where the run ends inside it), up to the end of its pass over the data."""
    if not t.progressive_window:
        return {}
    if t.progressive_window == "data":
        starts, last_end = source.window_steps(t.steps), source.window_end(t.steps)
    else:
        n = t.progressive_window
        starts, last_end = [(s, "") for s in range(0, t.steps, n)], -(-t.steps // n) * n
    # The last window runs to its own end, not the run's (a run stopped inside it and raised past
    # it later scored part of it, for good: its model has trained on the rest since), but not
    # past the end of the pass over the data it is in: the batches after it are rows trained on
    rows = getattr(source, "num_train", None)
    if rows and len(starts) > 1:
        first_row = starts[-1][0] * t.batch_size
        pass_end = -(-(first_row // rows + 1) * rows // t.batch_size)  # the first step of the next pass
        last_end = min(last_end or pass_end, pass_end)
    ends = [s for s, _ in starts[1:]] + [max(last_end or t.steps, t.steps)]
    return {
        s: (k, e, label or f"steps {s}-{e - 1}")
        for k, ((s, label), e) in enumerate(zip(starts, ends, strict=True))
        if k
    }


class TrainingLoop:
    """The loop's state between steps (the loss watch, the window's timing, the run's record)
    and what it does around each step. ``train``: the config's ``train`` section (the steps,
    the batch, when to log, evaluate and save, what stops early), the only keys it reads."""

    def __init__(
        self,
        train: TrainConfig,
        driver: StepDriver,
        ckpts: Checkpoints | None,
        metrics: MetricsWriter,
        plan: EmbeddingPlan,
        progress: Progress,
        start: int,
        log=print,
        trace: LoopTrace | None = None,
    ):
        self.t, self.driver, self.steps, self.trace = train, driver, driver.steps, trace
        self.ckpts, self.metrics, self.progress, self.log = ckpts, metrics, progress, log
        self.plan_json = plan.to_json()
        # per device and step, at the compiled capacities; the dynamic tables' raw ids by the
        # path each step's resolution took
        self.sent = collective_bytes(plan, self.steps.collection.table_copies)
        dynamic = self.steps.dynamic
        self.route_bytes = dynamic.resolution_paths(train.batch_size) if dynamic is not None else []
        self.watch, self.pending = LossWatch(self.t.max_loss_ratio, progress.loss_reference), collections.deque()
        self.train_time, self.trained_steps, self.last_loss, self.window_start = 0.0, 0, float("nan"), None
        self.result_wait_s = self.result_wait_cpu_s = 0.0  # the window's, in read_results: wall, CPU
        # the window's time on the dispatching thread that is checkpointing's, not training's
        # (the first state check's compile, each state check's run), or a compile's (the first
        # hot-row refresh's), wall and CPU: left out of its samples/s as the train step's compile
        # and the saves are
        self.apart_s = self.apart_cpu_s = 0.0
        self.state_checked = False
        self.refreshed = False  # a hot-row refresh ran in this process (its program compiled)
        self.dispatched = False  # (a step dispatched by this loop)
        self.release, self._ids = ReleaseThread(), None
        self.window_cpu = 0.0
        self.windows = progressive_windows(train, driver.source)
        self.auc = self.logloss = float("nan")
        self.scored, self.evaluated, self.stop_reason = 0, False, ""
        self.bar = StepDisplay(
            self.t.steps,
            start,
            bar=self.t.progress_bar,
            shown=jax.process_index() == 0,
            batch=self.t.batch_size,
            epoch_rows=getattr(driver.source, "num_train", None),
            log=log,
        )

    def dispatch(self, state: TrainState, step: int, item) -> TrainState:
        """Run train step ``step``, then what the tables ask after it (per-host tables: their sync, when due)."""
        if self.window_start is None:
            self.window_start, self.window_cpu = time.perf_counter(), time.thread_time()
        if self.trace is not None:
            self.trace.before(step)
        self.release.release()  # what the last step left (see ReleaseThread)
        # a driver whose step compiles on its first call (tiered tables): that call's time is
        # left out of the window's samples/s, as the device step's compile before the loop is
        compiles = self.driver.compiles_on_first_step and not self.dispatched
        self.dispatched = True
        with self.apart() if compiles else contextlib.nullcontext():
            stepped = self.driver.run(state, item)
        self.pending.append((step, stepped.out))
        self.release.hold(state, item, self._ids)
        state, self._ids = stepped.state, stepped.ids
        return state._replace(emb=self.steps.collection.after_step(state.emb, step))

    def plan_step(self, step: int, signum: int | None) -> Plan:
        t = self.t
        evaluate = bool((t.eval_every > 0 and step % t.eval_every == 0) or (step == t.steps and t.evaluates))
        save = bool((t.checkpoint_every and step % t.checkpoint_every == 0) or step == t.steps or signum)
        progressive = step in self.windows and step < t.steps
        log = bool(evaluate or save or progressive or (t.log_every and step % t.log_every == 0))
        return Plan(evaluate, save, log, signum, progressive)

    def after_step(self, state: TrainState, step: int, item, todo: Plan) -> TrainState:
        """A state that may be saved is scored first (before a hot-row refresh moves rows
        about; an evaluation may ask for a save: a new best, an early stop); then the hot-row
        counting and refresh; then the losses of steps far enough behind."""
        t, self._state_check = self.t, None
        if self.ckpts is not None and (
            todo.save or (todo.evaluate and (t.keep_best or t.target_auc or t.early_stop_evals))
        ):
            first = not self.state_checked  # the first compiles the check and the eval step it runs
            if first:  # (the steps in flight end first, so none of their time is left out with it)
                self.read_results(0)
            with self.apart() if first else contextlib.nullcontext():
                self._state_check = self.steps.state_check(state, *self.driver.check_inputs(item))
            self.state_checked = True
        hot = self.steps.hot  # the process's first refresh compiles its program: left out, as the check's
        first = hot is not None and not self.refreshed and hot.refresh_due(step)
        if first:
            self.read_results(0)
            self.refreshed = True
        with self.apart() if first else contextlib.nullcontext():
            state = self.driver.after_step(state, step, self._ids)
        self.read_results(DISPATCH_AHEAD)
        self.end_trace(step - len(self.pending))
        self.bar.update(1)
        return state

    @contextlib.contextmanager
    def running(self):
        """Around the loop: a trace still running when it ends (a run shorter than its traced
        steps) is read, or when it raises, ended unread (a notebook's next run could not start
        one); the release thread is joined."""
        try:
            yield
        except BaseException:
            if self.trace is not None:
                self.trace.stop(read=False)
            raise
        finally:
            self.release.close()
        self.end_trace()

    def read_results(self, keep: int) -> None:
        """The losses (and counts) of the dispatched steps but the last ``keep``, read on the
        host: a wait for the devices to finish them (timed: ``result_wait_ms``; the CPU this
        thread spends in it, mostly the runtime's spin while it waits: ``result_read_cpu_ms``)."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        while len(self.pending) > keep:
            done = self.pending.popleft()
            self.watch.add(*done)
            self.release.hold(done)
        self.result_wait_s += time.perf_counter() - t0
        self.result_wait_cpu_s += time.thread_time() - cpu0

    def end_trace(self, read_through: int | None = None) -> None:
        """The ``trace`` event and its line, once the traced steps' results are read (steps up
        to ``read_through``), or now (None: the loop ended first)."""
        if self.trace is None:
            return
        with self.apart():  # stopping the profiler and reading its files: not training's time
            summary = self.trace.stop() if read_through is None else self.trace.done(read_through)
        if summary is None:
            return
        self.metrics.write({"event": "trace", "step": self.trace.last, **summary, "trace_dir": self.trace.trace_dir})
        self.bar.write(f"{format_summary(summary)} ({self.trace.trace_dir})")

    def _sent_bytes(self) -> dict:
        """``a2a_bytes``, ``allreduce_bytes``, ``allgather_bytes``: per device and step, the
        embeddings' at the compiled capacities and the raw ids' resolution as the window's
        steps took it (a mean over them)."""
        sent = dict(self.sent)
        routes = self.watch.take_id_routes()
        for path, steps in routes.items():
            for kind, size in self.route_bytes[path].items():
                sent[kind] += size * steps / sum(routes.values())
        return {
            f"{k}_bytes": sent[c]
            for k, c in (("a2a", "all-to-all"), ("allreduce", "all-reduce"), ("allgather", "all-gather"))
        }

    @contextlib.contextmanager
    def apart(self):
        """The body's time on this thread, wall and CPU, left out of the window's samples/s
        (``apart_s``, ``apart_cpu_s``): checkpointing's, not training's."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.apart_s += time.perf_counter() - t0
            self.apart_cpu_s += time.thread_time() - cpu0

    def window_event(self, step: int, state: TrainState) -> dict:
        """Every step up to here checked (before anything is saved), and the window's event."""
        self.read_results(0)
        if self._state_check is not None:  # (its run, after the window's steps: a read of every
            with self.apart():  # table, 1 s a save on CPU)
                self.watch.check_state(step, self._state_check)
        elapsed = time.perf_counter() - self.window_start - self.apart_s
        # this thread's CPU time (a blocking wait counts only its spin)
        dispatch_cpu_s = time.thread_time() - self.window_cpu - self.apart_cpu_s
        self.last_loss, window_steps, overflows, hit_rate = self.watch.take_window()
        self.train_time, self.trained_steps = self.train_time + elapsed, self.trained_steps + window_steps
        rate = window_steps * self.t.batch_size / elapsed
        event = {
            "event": "train",
            "step": step,
            "loss": self.last_loss,
            "samples_per_s": rate,
            "batch_size": self.t.batch_size,  # (a resumed run may change it: the report's samples seen)
            "learning_rate": float(self.steps.schedule(step - 1)),
            "exchange_overflows": overflows,
            "hot_hit_rate": hit_rate,
            **self._sent_bytes(),
            "dispatch_ms": 1e3 * dispatch_cpu_s / max(window_steps, 1),
            "result_wait_ms": 1e3 * self.result_wait_s / max(window_steps, 1),
            # of dispatch_ms, the reads': the rest is the loop's own work (issue 47's 0.3 ms)
            "result_read_cpu_ms": 1e3 * self.result_wait_cpu_s / max(window_steps, 1),
        }
        self.result_wait_s = self.result_wait_cpu_s = self.apart_s = self.apart_cpu_s = 0.0
        self.bar.window(step, self.last_loss, rate, self.train_time / max(self.trained_steps, 1))
        event.update(self.driver.take_metrics(window_steps))
        event.update({k: host_scalar(v) for k, v in self.steps.collection.step_metrics(state.emb).items()})
        event.update(self.watch.take_id_maps())
        event.update(self.driver.map_metrics(state))
        return event

    def evaluate(self, step: int, state: TrainState, event: dict, todo: Plan) -> Plan:
        """Score the held-out split into ``event`` and the run's record; a new best or an early
        stop asks for a save."""
        report_progress(step, "evaluation", timed=self.evaluated)  # the first one compiles
        self.evaluated = True
        t0 = time.perf_counter()
        self.auc, self.logloss, self.scored = self.driver.evaluate(state)
        seconds = time.perf_counter() - t0  # (the first evaluation's includes compiling the eval step)
        event.update(event="eval", auc=self.auc, logloss=self.logloss, eval_samples=self.scored, eval_s=seconds)
        note = auc_note(self.auc, self.logloss, self.scored)
        self.bar.write(
            f"step {step}: loss {self.last_loss:.4f} eval auc {self.auc:.4f} "
            f"logloss {self.logloss:.4f} on {self.scored:,} samples{f' ({note})' if note else ''}"
        )
        t, progress = self.t, self.progress.evaluated(Evaluation(step, self.auc, self.logloss))
        self.stop_reason = progress.stop_reason(t)
        self.progress = dataclasses.replace(progress, stopped=self.stop_reason)
        save = todo.save or bool(self.stop_reason)
        best = self.progress.best
        if t.keep_best and best is not None and best.step == step and self.ckpts:  # a new best: saved and kept
            save = True
            self.ckpts.keep_also([step])
        return todo._replace(save=save)

    def progressive(self, step: int, state: TrainState) -> None:
        """Progressive validation: the state after ``step`` scores the next window's training
        batches (those of steps ``step + 1`` onward, as the source reads them) before they are
        trained on; a ``progressive`` event with the window's AUC and logloss."""
        report_progress(step, "progressive validation")
        window, end, label = self.windows[step]
        source = self.driver.source
        batches = Indexed(end - step, lambda k: source.train_batch(step + k))
        auc, logloss, scored = self.driver.evaluate(state, batches)
        self.metrics.write(
            {
                "event": "progressive",
                "step": step,
                "window": window,
                "window_label": label,
                "progressive_auc": auc,
                "progressive_logloss": logloss,
                "progressive_samples": scored,
            }
        )
        self.bar.write(
            f"step {step}: window {window} ({label}) scored before training on it: auc {auc:.4f} logloss {logloss:.4f}"
        )
        self.progress = dataclasses.replace(self.progress, windows_through=step)

    def record(self, step: int, event: dict) -> None:
        """The window's event; the last one carries the run's final fields."""
        if step == self.t.steps or self.stop_reason:
            event["run_samples_per_s"] = self.trained_steps * self.t.batch_size / self.train_time
            event.update(self.progress.final_fields(step, self.auc, self.logloss, self.t.evaluates))
        self.metrics.write(event)
        self.window_start = None

    def save(self, step: int, state: TrainState) -> None:
        report_progress(step, "checkpoint")
        # the last save committed and rotated first: the tier then keeps the snapshots of the
        # checkpoints still there (it kept those rotation was about to remove: up to 2 copies)
        self.ckpts.wait()
        tier = self.driver.save_tiers(step, state, self.ckpts.all_steps(), self.t.keep_checkpoints)
        self.progress = dataclasses.replace(self.progress, loss_reference=self.watch.reference)
        hot = self.steps.hot
        self.ckpts.save(
            step,
            self.steps.checkpoint_form(state),
            self.plan_json,
            hot.to_json() if hot else None,
            self.steps.collection.host_sets,
            self.progress.to_json(),
            tier,
        )

    def settle(self) -> None:
        """The run ends: its checkpoints committed and rotated, and the tier's snapshots of
        those rotated away removed."""
        if self.ckpts:
            self.ckpts.wait()
            self.driver.tiers_saved(self.ckpts.all_steps())

    def interrupted(self, step: int, signum: int) -> Interrupted:
        self.settle()
        self.bar.close()
        return Interrupted(signum, step, saved=self.ckpts is not None)

    @property
    def samples_per_s(self) -> float:
        return self.trained_steps * self.t.batch_size / self.train_time if self.train_time else float("nan")


def reporting(batches, first_step: int, first_compiles: bool):
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
