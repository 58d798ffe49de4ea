"""Evaluation metrics computed exactly on the host, and the metrics.jsonl writer."""

from __future__ import annotations

import errno
import json
import math
import os
import time
from pathlib import Path

import numpy as np


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Exact area under the ROC curve; tied scores count one half (Mann-Whitney U).

    labels: [n] in {0, 1}; scores: [n]. NaN when only one class is present, or a score is NaN
    (a diverged model's: they sorted as the highest, an AUC of 1.0 for 4 rows).
    """
    labels, scores = _paired(labels, scores, "scores")
    labels = labels.astype(bool)
    pos = int(labels.sum())
    neg = labels.size - pos
    if pos == 0 or neg == 0 or np.isnan(scores).any():
        return float("nan")
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    # Average rank (1-based) of each run of equal scores.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], scores.size]
    avg_rank = (starts + ends + 1) / 2.0
    ranks = np.empty(scores.size)
    ranks[order] = np.repeat(avg_rank, ends - starts)
    return float((ranks[labels].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def log_loss(labels: np.ndarray, probs: np.ndarray, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities, clipped to [eps, 1 - eps]."""
    y, p = _paired(labels, probs, "probs")
    p = np.clip(p, eps, 1.0 - eps)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))


def log_loss_of_logits(labels: np.ndarray, logits: np.ndarray) -> float:
    """Mean binary cross-entropy of logits, exact in float64 (the training loss's definition).
    Evaluation scores logits, not probabilities: a float32 sigmoid rounds every logit above
    16.6 to 1.0 (ties, as AUC counts them) and ``log_loss`` clips what it cannot tell apart."""
    y, z = _paired(labels, logits, "logits")
    # softplus(z) - y z, as softplus(-z) where y is 1: an infinite logit's is inf or 0 (the
    # difference was inf - inf and 0 * inf, NaN either way)
    return float(np.mean(np.logaddexp(0.0, np.where(y == 1, -z, z))))


def _paired(labels, values, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``labels`` and ``values`` as float64 [n] each, or a ValueError: lengths that differ, or a
    label other than 0 or 1 (arguments given the other way round scored NaN without a word)."""
    labels = np.asarray(labels, np.float64).ravel()
    values = np.asarray(values, np.float64).ravel()
    if labels.size != values.size:
        raise ValueError(f"{labels.size} labels and {values.size} {name}")
    bad = (labels != 0) & (labels != 1)
    if bad.any():
        at = int(np.flatnonzero(bad)[0])
        raise ValueError(f"labels must be 0 or 1: {labels[at].item()!r} at index {at} (labels first, then {name})")
    return labels, values


# TensorBoard sections of metrics.jsonl's fields; anything unlisted goes under "train/".
_SECTIONS = {
    "auc": "eval",
    "logloss": "eval",
    "exchange_overflows": "exchange",
    "a2a_bytes": "exchange",
    "allreduce_bytes": "exchange",
    "allgather_bytes": "exchange",
    "hot_hit_rate": "hot_rows",
}
_NOT_SCALARS = ("step", "event", "wall_s")
# Fields that measure the machine, not the training: a resumed run logs the same events as an
# uninterrupted one except these (and the final event's run fields).
TIMING_FIELDS = (
    "wall_s",
    "samples_per_s",
    "dispatch_ms",
    "result_wait_ms",
    "result_read_cpu_ms",
    "input_read_ms",
    "input_h2d_ms",
    "input_wait_ms",
    "input_buffers",
    "input_buffer_mb",
    "input_buffers_pinned",
    "eval_s",
)


def tensorboard_tag(key: str) -> str:
    """The TensorBoard tag of a metrics.jsonl field: ``eval/auc``, ``cache/device_hit_rate``..."""
    if key.startswith(("device_", "host_", "rows_", "fill_", "h2d_", "tier_", "stall")):
        return f"cache/{key}"
    return f"{_SECTIONS.get(key, 'train')}/{key}"


def recorded_events(path: Path, lines: list[str], log=print) -> list[tuple[str, dict]]:
    """(line, event) of each of ``path``'s ``lines``: a last line cut short (a write that a
    kill interrupted) is dropped with a warning; a damaged line before the last is a
    ValueError naming it: the file is not ours to guess at."""
    events = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            events.append((line, json.loads(line)))
        except json.JSONDecodeError as e:
            if number != len(lines):
                raise ValueError(
                    f"{path}:{number}: not a JSON event ({e.msg}); fix or remove that line to resume"
                ) from None
            log(f"warning: {path}:{number}: dropped a torn last line (an interrupted write)")
    return events


class MetricsWriter:
    """Appends one JSON object per event to ``metrics.jsonl`` (appending keeps resumed runs whole),
    and with ``tensorboard`` the same numbers as TensorBoard scalars in ``tensorboard/`` beside it.

    Every event gets ``wall_s``: seconds since the run started, counting only the time its
    processes ran (a resumed run continues from the last kept event's value), so runs can be
    compared against wall time. Only the run dir's writer (process 0) has a path; the others
    write nothing.
    """

    def __init__(self, path: Path | None, tensorboard: bool = False):
        self.path, self.tensorboard, self._tb, self._resumed_at = path, tensorboard, None, None
        self._started, self._wall_before = time.perf_counter(), 0.0
        self.loss_before = float("nan")  # the last logged loss of the steps kept (truncate_after)

    def truncate_after(self, step: int, log=print) -> None:
        """Drop events past ``step``: a run killed after its last checkpoint logged steps that
        the resumed run will log again (TensorBoard is told to hide them too). A last line cut
        short (a write that a kill interrupted) is dropped with a warning; a damaged line
        before the last is an error naming it: the file is not ours to guess at."""
        self._resumed_at = step + 1
        if self.path is None or not self.path.exists():
            return
        lines = self.path.read_text(errors="replace").splitlines()
        events = recorded_events(self.path, lines, log)
        kept = [line for line, event in events if event.get("step", 0) <= step]
        if kept:
            self._wall_before = json.loads(kept[-1]).get("wall_s") or 0.0
        losses = [e["loss"] for _, e in events if e.get("step", 0) <= step and isinstance(e.get("loss"), float)]
        self.loss_before = losses[-1] if losses else float("nan")
        if len(kept) != len(lines):
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(self.path)

    def write(self, event: dict) -> None:
        """Appends the event as one line. A failed write (a full disk) takes back whatever part
        of the line reached the file, so no torn line is left, and says which file and step."""
        if self.path is None:
            return
        event = {**event, "wall_s": round(self._wall_before + time.perf_counter() - self._started, 3)}
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in event.items()}
        data = (json.dumps(clean) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            except OSError as e:
                os.ftruncate(fd, size)
                what = "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
                error = OSError(
                    f"cannot append step {event.get('step')}'s metrics to {self.path}: {what}; "
                    f"free space and run the same command to resume from the last checkpoint"
                )
                error.errno = e.errno
                raise error from None
        finally:
            os.close(fd)
        if self.tensorboard:
            self._write_scalars(clean)

    def _write_scalars(self, event: dict) -> None:
        if self._tb is None:
            from tensorboardX import SummaryWriter

            # purge_step: a resumed run hides the events a killed run logged past its checkpoint.
            self._tb = SummaryWriter(str(self.path.parent / "tensorboard"), purge_step=self._resumed_at, flush_secs=30)
        step = int(event["step"])
        for key, value in event.items():
            if key not in _NOT_SCALARS and isinstance(value, int | float) and not isinstance(value, bool):
                self._tb.add_scalar(tensorboard_tag(key), value, step)
        self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
