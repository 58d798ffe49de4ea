"""Which run a disk tier belongs to: ``ROOT/owner.json``, written by the run that makes the tier.

A tier's snapshots are named by step alone, so two runs given one ``embedding.tier.path``
would read and replace each other's: a fresh run started the tier anew and deleted the other
run's snapshots, whose checkpoints then restored the newcomer's tables without a word. The
record holds the run dir that made the tier and an id; the run's checkpoints keep the id, so a
checkpoint restores only from the tier it was saved with, and a run refuses a tier that another
run dir made (``train.restore.check_tier_owner``).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import NamedTuple

from dlrm_jax.embedding.tiers.format import TierError
from dlrm_jax.files import written_whole

OWNER_FILE = "owner.json"


class TierOwner(NamedTuple):
    """``id``: the tier's, kept by every checkpoint saved with it; ``run_dir``: the run dir
    that made it, absolute (None: a run without one, whose tier no checkpoint needs)."""

    id: str
    run_dir: str | None

    def maker(self) -> str:
        """Who made the tier, in words."""
        return f"run dir {self.run_dir}" if self.run_dir else "a run without a run dir"

    def made_by(self, run_dir: str | Path | None) -> bool:
        """Whether ``run_dir`` made this tier (the same folder, however it is spelled)."""
        if self.run_dir is None or run_dir is None:
            return self.run_dir is None and run_dir is None
        return os.path.realpath(self.run_dir) == os.path.realpath(run_dir)


def tier_owner(root: str | Path) -> TierOwner | None:
    """The owner recorded in the tier at ``root``; None where none is (a tier made before the
    record, or no tier)."""
    path = Path(root) / OWNER_FILE
    try:
        record = json.loads(path.read_text())
        return TierOwner(str(record["id"]), record["run_dir"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        raise TierError(path, "damaged: not a tier's owner record (an id and a run dir, as JSON)") from None


def record_owner(root: str | Path, run_dir: str | Path | None) -> TierOwner:
    """Records a new owner of the tier at ``root``: ``run_dir`` and a fresh id (written whole:
    a temporary file renamed over the record)."""
    owner = TierOwner(uuid.uuid4().hex, None if run_dir is None else str(Path(run_dir).absolute()))
    with written_whole(Path(root) / OWNER_FILE) as f:
        json.dump(owner._asdict(), f)
    return owner
