"""Evaluating a model: exact AUC and logloss over the held-out batches (:func:`evaluate`, which
the step drivers call), and what a run ended with (:class:`RunSummary`). A saved run's
checkpoint is evaluated by :func:`dlrm_jax.train.saved_run.evaluate_run`."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import jax
import numpy as np

from dlrm_jax.data.batch import Batch, DataSource
from dlrm_jax.data.batch import padded as pad_batch
from dlrm_jax.data.pipeline import InputPipeline, background
from dlrm_jax.observe.metrics import log_loss_of_logits, roc_auc
from dlrm_jax.train.progress import Evaluation
from dlrm_jax.train.step import StepFunctions, TrainState
from dlrm_jax.train.tier_runner import TierRunner
from dlrm_jax.train.watch import LossWatch, TrainingDiverged  # noqa: F401 - TrainingDiverged: the trainer's error


@dataclass(frozen=True)
class RunSummary:
    """What a run ended with; ``final_line()`` is the CLI's contract line. ``best``: the best
    evaluation of the run (by train.keep_best's metric, or auc), beside the last one in
    ``auc`` / ``logloss``; ``stop_reason``: why it stopped early ('' if it did not)."""

    step: int
    loss: float
    auc: float
    logloss: float
    samples_per_s: float
    best: Evaluation | None = None
    stop_reason: str = ""
    eval_samples: int = 0  # samples the last evaluation scored (evaluate_run: samples_per_s is its speed)

    def final_line(self) -> str:
        return (
            f"final step={self.step} loss={self.loss:.6f} auc={self.auc:.6f} "
            f"logloss={self.logloss:.6f} samples_per_s={self.samples_per_s:.1f}"
        )

    def best_line(self) -> str:
        b = self.best
        return f"best step={b.step} auc={b.auc:.6f} logloss={b.logloss:.6f}" if b else ""

    @classmethod
    def from_event(cls, e: dict) -> RunSummary:
        """The summary a run's final metrics.jsonl events (merged) record."""
        best = (
            Evaluation(e["best_step"], _nan(e["best_auc"]), _nan(e["best_logloss"]))
            if "best_step" in e
            else Evaluation(e["step"], _nan(e["auc"]), _nan(e["logloss"]))
            if "auc" in e
            else None  # a run that never evaluates (train.eval_every=-1)
        )
        return cls(
            e["step"],
            _nan(e["loss"]),
            _nan(e.get("auc")),
            _nan(e.get("logloss")),
            _nan(e.get("run_samples_per_s", e["samples_per_s"])),
            best,
            e.get("stop_reason", ""),
            int(e.get("eval_samples", 0)),
        )


def _nan(x: float | None) -> float:
    return float("nan") if x is None else x


@dataclass(frozen=True)
class Indexed:
    """Held-out batches read by index: ``read(i)`` for ``i`` in ``range(count)``, from any
    thread and in any order (several readers take them at once)."""

    count: int
    read: Callable[[int], Batch]

    def __iter__(self) -> Iterator[Batch]:  # (in order, on the caller's thread)
        return map(self.read, range(self.count))


def held_out(source: DataSource) -> Indexed | Iterable[Batch]:
    """The source's held-out batches: by index where it can read them so (``eval_batch_count``
    and ``eval_batch``: the binary and Criteo-text sources), else its ``eval_batches()``."""
    if hasattr(source, "eval_batch") and hasattr(source, "eval_batch_count"):
        return Indexed(source.eval_batch_count(), source.eval_batch)
    return source.eval_batches()


def evaluate(
    steps: StepFunctions,
    state: TrainState,
    source: DataSource,
    runner: TierRunner | None = None,
    batches: Indexed | Iterable[Batch] | None = None,
    readers: int | str = 1,
    depth: int = 4,
) -> tuple[float, float, int]:
    """Exact AUC and logloss over the held-out batches, and how many samples they scored
    (every process gets the same numbers; ``train.eval_batches``, 0 = the whole split).
    ``batches``: this process's slices of other batches to score instead (progressive
    validation scores training batches before they are trained on). ``readers``, ``depth``:
    as the training input's (``data.readers``, ``data.prefetch``), for batches read by index.

    Processes may hold different numbers of rows of the last, partial batch: each gathers its
    padded predictions and a validity mask, so the cross-process all-gather has equal shapes.
    """
    # Scored on logits: a float32 sigmoid ties every logit above 16.6 at 1.0 (metrics.log_loss_of_logits)
    logits, labels, valid = [], [], []
    for z, y, m in eval_scores(steps, state, source, runner, batches, readers, depth, logits=True):
        logits.append(z)
        labels.append(y)
        valid.append(m)
    if not logits:  # (numpy's "need at least one array to concatenate")
        raise ValueError(f"nothing to evaluate: {type(source).__name__}.eval_batches() gave no batches")
    z, y, m = np.concatenate(logits), np.concatenate(labels), np.concatenate(valid)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        z, y, m = (np.asarray(multihost_utils.process_allgather(a, tiled=True)) for a in (z, y, m))
    return roc_auc(y[m], z[m]), log_loss_of_logits(y[m], z[m]), int(m.sum())


# Eval steps dispatched before the first one's scores are read (as training's DISPATCH_AHEAD:
# a few programs in flight overlap the host with the devices, far below XLA:CPU's limit).
_READ_BEHIND = 2


def eval_scores(
    steps: StepFunctions,
    state: TrainState,
    source: DataSource,
    runner: TierRunner | None = None,
    batches: Indexed | Iterable[Batch] | None = None,
    readers: int | str = 1,
    depth: int = 4,
    logits: bool = False,
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per held-out batch, in order, this process's (probabilities, labels, valid) [per-process
    batch]: the batch padded to full size, ``valid`` marking its real rows (``logits``: the
    logits in place of the probabilities). The batches are read,
    padded and placed on the devices ahead of the eval steps, by ``readers`` threads where they
    are read by index (:class:`Indexed`) and by one thread otherwise, while this thread only
    dispatches the steps (in order: programs with collectives come from one thread) and reads
    each one's scores ``_READ_BEHIND`` steps later."""
    per_process = steps.spec.batch_size // jax.process_count()
    state = state._replace(emb=steps.collection.model_tables(state.emb))  # (per-host tables: their average)
    batches = held_out(source) if batches is None else batches
    which = 1 if logits else 0  # (eval_step gives both)
    if runner is not None:  # tiered features are pooled on the host from the newest rows
        runner.tiered.sync_to_host(state.emb.tables, state.emb.slots, state.emb.hot)
        for batch in batches:
            padded = pad_batch(batch, per_process)
            ids_padded, pooled = runner.eval_inputs(state, padded)
            out = steps.eval_step(state, steps.device_batch(ids_padded), jax.device_put(pooled, steps.batch_sharding))[
                which
            ]
            yield _scores(out), padded.labels, np.arange(per_process) < batch.size
        return

    def placed(batch: Batch) -> tuple:  # (on the reading threads: host work and a transfer, no program)
        padded = pad_batch(batch, per_process)
        return steps.device_batch(padded), padded.labels, np.arange(per_process) < batch.size

    if isinstance(batches, Indexed):
        pipeline = InputPipeline(batches.read, range(batches.count), to_device=placed, readers=readers, depth=depth)
        items, close = (p.device for p in pipeline), pipeline.close
    else:
        items = background(map(placed, batches), depth)
        close = items.close
    pending: deque = deque()
    try:
        for device, labels, valid in items:
            pending.append((steps.eval_step(state, device)[which], labels, valid))
            while len(pending) > _READ_BEHIND:
                out, labels, valid = pending.popleft()
                yield _scores(out), labels, valid
        while pending:
            out, labels, valid = pending.popleft()
            yield _scores(out), labels, valid
    finally:
        close()


def _scores(out: jax.Array) -> np.ndarray:
    """This process's rows of a batch's scores, in order (a wait for its eval step)."""
    shards = sorted(out.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards])
