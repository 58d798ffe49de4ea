"""Which run a disk tier belongs to: ``ROOT/owner.json``, written by the run that makes the tier.

A tier's snapshots are named by step alone, so two runs given one ``embedding.tier.path``
would read and replace each other's: a fresh run started the tier anew and deleted the other
run's snapshots, whose checkpoints then restored the newcomer's tables without a word. The
record holds the run dir that made the tier, where the tier was, and an id; the run's
checkpoints keep the id, so a checkpoint restores only from the tier it was saved with, and a
run refuses a tier that another run dir made (``train.restore.check_tier_owner``), or one whose
run dir still trains on it where a copy of that run dir would share it.
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
    that made it (or took it over: :func:`record_owner`), absolute (None: a run without one,
    whose tier no checkpoint needs); ``root``: where the tier was then (None: a record made
    before roots were recorded)."""

    id: str
    run_dir: str | None
    root: str | None = None

    def maker(self) -> str:
        """Who made the tier, in words."""
        return f"run dir {self.run_dir}" if self.run_dir else "a run without a run dir"

    def made_by(self, run_dir: str | Path | None) -> bool:
        """Whether ``run_dir`` made this tier (the same folder, however it is spelled)."""
        if self.run_dir is None or run_dir is None:
            return self.run_dir is None and run_dir is None
        return os.path.realpath(self.run_dir) == os.path.realpath(run_dir)

    def trains_another_run(self, root: str | Path, run_dir: str | Path | None) -> bool:
        """Whether another run dir than ``run_dir`` made the tier at ``root`` (the one it made,
        not a copy elsewhere) and still holds a run (its checkpoints): a copy of that run dir,
        sharing the tier, would replace that run's snapshots (they are named by step alone)."""
        if self.run_dir is None or self.made_by(run_dir):
            return False
        here = self.root is None or os.path.realpath(self.root) == os.path.realpath(root)
        return here and (Path(self.run_dir) / "checkpoints").is_dir()


def tier_owner(root: str | Path) -> TierOwner | None:
    """The owner recorded in the tier at ``root``; None where none is (a tier made before the
    record, or no tier)."""
    path = Path(root) / OWNER_FILE
    try:
        record = json.loads(path.read_text())
        return TierOwner(str(record["id"]), record["run_dir"], record.get("root"))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        raise TierError(path, "damaged: not a tier's owner record (an id and a run dir, as JSON)") from None


def record_owner(root: str | Path, run_dir: str | Path | None, id: str | None = None) -> TierOwner:
    """Records a new owner of the tier at ``root``: ``run_dir`` and a fresh id, or ``id`` (a
    run dir moved, or copied with its tier, taking over the tier its checkpoints were saved
    with); written whole: a temporary file renamed over the record."""
    owner = TierOwner(
        id or uuid.uuid4().hex,
        None if run_dir is None else str(Path(run_dir).absolute()),
        str(Path(root).absolute()),
    )
    with written_whole(Path(root) / OWNER_FILE) as f:
        json.dump(owner._asdict(), f)
    return owner
