"""What a run carries across resumes beside its train state, saved with every checkpoint.

- The divergence limit's reference (train.max_loss_ratio): the first loss of the run that
  started the lineage, not the first loss of a resumed run, which may already be a bad state's.

Every process reads and updates the same record from the same numbers (losses and evaluations
are replicated), so every process makes the same decisions from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from dlrm_jax.train.checkpoint import saved_json


def _num(x: float | None) -> float | None:
    """JSON-safe: NaN and infinities as None."""
    return x if x is not None and math.isfinite(x) else None


@dataclass(frozen=True)
class Progress:
    """``loss_reference``: the loss of the lineage's first step (None: not yet known)."""

    loss_reference: float | None = None

    def to_json(self) -> dict:
        return {"loss_reference": _num(self.loss_reference)}

    @classmethod
    def from_json(cls, d: dict | None) -> Progress:
        """The record saved by :meth:`to_json`; empty for checkpoints saved before it existed."""
        d = d or {}
        return cls(loss_reference=d.get("loss_reference"))


def saved_progress(directory: Path, step: int) -> Progress:
    """The progress saved with the checkpoint at ``step`` in ``directory``."""
    return Progress.from_json(saved_json(directory, step).get("run"))
