"""What a run carries across resumes beside its train state, saved with every checkpoint.

- The divergence limit's reference (train.max_loss_ratio): the first loss of the run that
  started the lineage, not the first loss of a resumed run, which may already be a bad state's.
- The best evaluation so far by the tracked metric (train.keep_best, or auc), the last one,
  and how many evaluations in a row did not improve on the best (train.early_stop_evals).
- Why the run stopped early, if it did (train.target_auc, train.early_stop_evals).

Every process reads and updates the same record from the same numbers (losses and evaluations
are replicated), so every process makes the same decisions from it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from dlrm_jax.train.checkpoint_reader import saved_json, saved_steps


def _num(x: float | None) -> float | None:
    """JSON-safe: NaN and infinities as None."""
    return x if x is not None and math.isfinite(x) else None


def _float(x: float | None) -> float:
    return math.nan if x is None else float(x)


@dataclass(frozen=True)
class Evaluation:
    """One evaluation of the held-out data."""

    step: int
    auc: float
    logloss: float

    def to_json(self) -> dict:
        return {"step": self.step, "auc": _num(self.auc), "logloss": _num(self.logloss)}

    @classmethod
    def from_json(cls, d: dict | None) -> Evaluation | None:
        return None if not d else cls(int(d["step"]), _float(d.get("auc")), _float(d.get("logloss")))

    def better_than(self, other: Evaluation, metric: str) -> bool:
        """Strictly better by ``metric`` (auc: higher, logloss: lower); NaN is never better."""
        new, old = getattr(self, metric), getattr(other, metric)
        if math.isnan(new):
            return False
        return math.isnan(old) or (new > old if metric == "auc" else new < old)


def auc_note(auc: float, logloss: float, samples: int) -> str:
    """Why an evaluation's AUC is NaN where its logloss is not ('' otherwise): no score is NaN
    (it would make the logloss NaN too), so its samples are all of one class."""
    if math.isnan(auc) and not math.isnan(logloss):  # (an infinite logit's logloss is inf)
        return f"auc undefined: every one of the {samples:,} scored samples has the same label"
    return ""


def tracked_metric(train_cfg) -> str:
    """The metric that decides the best evaluation: train.keep_best, or auc when that is off."""
    return train_cfg.keep_best or "auc"


@dataclass(frozen=True)
class Progress:
    """``loss_reference``: the loss of the lineage's first step (None: not yet known);
    ``best`` / ``last``: evaluations (None: none yet), ``best`` by ``metric``;
    ``evals_since_best``: evaluations since ``best`` that did not improve on it;
    ``stopped``: why the run stopped early ('' if it did not); ``windows_through``: the last
    step whose progressive-validation window was scored (None: saved before it was kept)."""

    loss_reference: float | None = None
    metric: str = "auc"
    best: Evaluation | None = None
    last: Evaluation | None = None
    evals_since_best: int = 0
    stopped: str = ""
    windows_through: int | None = 0

    def evaluated(self, ev: Evaluation) -> Progress:
        """The record after evaluation ``ev``. One whose metric is NaN (an AUC of a split of
        one class) neither becomes the best nor counts against it: before, the first became
        the best and early stopping stopped the run an evaluation later, 'without a better auc
        than step 6's nan', though its logloss had improved."""
        if math.isnan(getattr(ev, self.metric)):
            return dataclasses.replace(self, last=ev)
        if self.best is None or ev.better_than(self.best, self.metric):
            return dataclasses.replace(self, best=ev, last=ev, evals_since_best=0)
        return dataclasses.replace(self, last=ev, evals_since_best=self.evals_since_best + 1)

    def tracking(self, metric: str, log=None, saved: Collection[int] = ()) -> Progress:
        """The record for a run that tracks ``metric``. When a resumed run changed the metric,
        the best so far stays the one to beat where its checkpoint is among ``saved`` (it was
        rotated out when the new best was tracked afresh, though it was better by the new
        metric too); else the best is tracked afresh (evaluations without a checkpoint cannot
        become the best)."""
        if metric == self.metric:
            return self
        best = self.best if self.best is not None and self.best.step in saved else None
        if self.best is not None and log is not None:
            log(
                f"train.keep_best: the best evaluation is now chosen by {metric}, not {self.metric}; "
                + (
                    f"step {best.step}'s ({metric} {getattr(best, metric):.6f}) stays the one to beat"
                    if best is not None
                    else "it is tracked afresh from here"
                )
            )
        return dataclasses.replace(self, metric=metric, best=best, evals_since_best=0)

    def window_unscored(self, step: int, windows) -> bool:
        """Whether the progressive-validation window starting at ``step`` (a resumed run's
        first), one of ``windows``, was not scored before the checkpoint at ``step`` was saved:
        the run ending there had no next window (a later one raised train.steps past it)."""
        return step in windows and self.windows_through is not None and self.windows_through < step

    def stop_reason(self, train_cfg) -> str:
        """Why a run with these settings stops here ('' if it goes on)."""
        t, last = train_cfg, self.last
        if t.target_auc and last is not None and last.auc >= t.target_auc:
            return f"auc {last.auc:.6f} at step {last.step} reached train.target_auc={t.target_auc:g}"
        tracked = self.tracking(tracked_metric(t))
        best, since = tracked.best, tracked.evals_since_best
        if t.early_stop_evals and best is not None and since >= t.early_stop_evals:
            return (
                f"{since} evaluations without a better {tracked.metric} than step {best.step}'s "
                f"{getattr(best, tracked.metric):.6f} (train.early_stop_evals={t.early_stop_evals})"
            )
        return ""

    def final_fields(self, step: int, auc: float, logloss: float, evaluates: bool = True) -> dict:
        """What metrics.jsonl's final event adds: the best evaluation (the last one, at
        ``step``, if none was better; none for a run that never evaluates) and why the run
        stopped early."""
        best = self.best or Evaluation(step, auc, logloss)
        out = {"best_step": best.step, "best_auc": best.auc, "best_logloss": best.logloss} if evaluates else {}
        return {**out, "stop_reason": self.stopped} if self.stopped else out

    def to_json(self) -> dict:
        return {
            "loss_reference": _num(self.loss_reference),
            "metric": self.metric,
            "best": self.best and self.best.to_json(),
            "last": self.last and self.last.to_json(),
            "evals_since_best": self.evals_since_best,
            "stopped": self.stopped,
            "windows_through": self.windows_through,
        }

    @classmethod
    def from_json(cls, d: dict | None) -> Progress:
        """The record saved by :meth:`to_json`; empty for checkpoints saved before it existed."""
        d = d or {}
        return cls(
            loss_reference=d.get("loss_reference"),
            metric=d.get("metric") or "auc",
            best=Evaluation.from_json(d.get("best")),
            last=Evaluation.from_json(d.get("last")),
            evals_since_best=int(d.get("evals_since_best") or 0),
            stopped=d.get("stopped") or "",
            windows_through=d.get("windows_through"),
        )


def resumed_progress(train_cfg, ckpts, start: int, log) -> tuple[Progress, str]:
    """The record of ``ckpts``' checkpoint at ``start`` (an empty one at 0) for a run with
    ``train_cfg``, and why that run trains no further ('' if it does). A run that stopped early
    stays stopped while its reason holds under this config; it goes on otherwise, and says so.
    With train.keep_best, the best step's checkpoint is kept from rotation."""
    t = train_cfg
    if not start:  # (no checkpoint: nothing recorded; ckpts is None without a run dir)
        progress = Progress().tracking(tracked_metric(t))
    else:
        progress = saved_progress(ckpts.directory, start).tracking(tracked_metric(t), log, ckpts.all_steps())
    if t.keep_best and progress.best is not None:
        ckpts.keep_also([progress.best.step])
    elif progress.best is not None and start:
        saved = ckpts.all_steps()
        if progress.best.step in saved[: -t.keep_checkpoints]:  # kept by train.keep_best alone
            log(
                f"train.keep_best is off: step {progress.best.step}'s checkpoint, the best evaluation so far, is no "
                f"longer kept and goes with the next rotation (train.keep_checkpoints={t.keep_checkpoints})"
            )
    reason = progress.stop_reason(t)
    if reason:
        log(
            f"run stopped early at step {start}: {reason}; it is not trained further (change train.target_auc "
            f"or train.early_stop_evals to go on)"
        )
    elif progress.stopped:
        log(
            f"run stopped early at step {start} ({progress.stopped}); with this config's train.target_auc="
            f"{t.target_auc:g} and train.early_stop_evals={t.early_stop_evals} it trains on to step {t.steps}"
        )
    return dataclasses.replace(progress, stopped=reason), reason


def saved_progress(directory: Path, step: int) -> Progress:
    """The progress saved with the checkpoint at ``step`` in ``directory``."""
    return Progress.from_json(saved_json(directory, step).get("run"))


def newest_progress(directory: Path) -> tuple[int | None, Progress]:
    """(step, progress) of the newest checkpoint whose record reads; (None, empty) if none."""
    for step in reversed(saved_steps(directory)):
        try:
            return step, saved_progress(directory, step)
        except Exception:  # noqa: BLE001, S112 - a damaged checkpoint: the restore sets it aside
            continue
    return None, Progress()


def checkpoint_step(directory: Path, step: int | str | None) -> int | None:
    """The checkpoint that ``--step`` names: None (the newest intact), a step, or ``best``
    (the best evaluation's, as the newest checkpoint records it). An error names what is saved."""
    if step is None:
        return None
    saved = saved_steps(directory)
    if step == "best":
        _, progress = newest_progress(directory)
        best = progress.best
        if best is None and progress.last is not None:  # (every evaluation's metric NaN: none is the best)
            raise FileNotFoundError(
                f"{directory}: no evaluation has a defined {progress.metric} to choose the best by (the last, step "
                f"{progress.last.step}: {progress.metric} {getattr(progress.last, progress.metric)}; an AUC is "
                f"undefined where every scored sample has the same label); saved steps {saved}"
            )
        if best is None:
            raise FileNotFoundError(f"{directory}: no evaluation recorded with the checkpoints (saved steps {saved})")
        if best.step not in saved:
            raise FileNotFoundError(
                f"{directory}: the best evaluation (step {best.step}, {progress.metric} "
                f"{getattr(best, progress.metric):.6f}) has no checkpoint left (rotated out: train.keep_best "
                f"was off); saved steps {saved}"
            )
        return best.step
    if isinstance(step, str) and step.strip().isdigit():  # (from Python: "20" read as no step 20 of [20])
        step = int(step)
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"step must be a checkpoint's step number, 'best' or None (the newest), got {step!r}")
    if step not in saved:
        raise FileNotFoundError(f"{directory}: no checkpoint at step {step}; saved steps {saved}")
    return step
