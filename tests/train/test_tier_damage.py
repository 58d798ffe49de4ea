"""A damaged disk tier stops a run at once with one line naming the file, never trains on the
damaged rows; a damaged snapshot is skipped for an older checkpoint; a tier folder that is not
writable is named as the cause, not blamed on the checkpoints."""

import errno
import json
import os
import subprocess
import sys

import pytest

from dlrm_jax.embedding.tiers import snapshots
from dlrm_jax.train.checkpoint_reader import CheckpointsIntact
from dlrm_jax.train.trainer import train_and_evaluate
from tests.child_env import child_env
from tests.embedding.tiered_configs import BASE, TIERED
from tests.helpers import QUIET, TINY, losses
from tests.train.damage import damage

RUN = [*BASE, *TIERED, "mesh.devices=1", "train.log_every=1", "train.checkpoint_every=2"]
CHUNK = "cat_0/values/c.0.0"  # the table's one chunk of values: every row


# Before step 4 the working chunk is made the run's own copy, as a write since the step-2
# checkpoint makes it, then damaged: the snapshot of step 2 stays intact. The tier is read ahead,
# on the reader thread, as a tier larger than RAM is.
DAMAGED_MID_RUN = """
import sys
import numpy as np
from dlrm_jax.cli import main
from dlrm_jax.embedding.tiers import tables
from dlrm_jax.train.tier_runner import TierRunner
from tests.train.damage import damage

tables.MAPPED_SHARE = 0.0
train = TierRunner.train

def damaged_before_step_4(self, state, batch, fills, reads=None, planned=None):
    if int(np.asarray(state.step)) == 3:
        self.tiered.store._make_private(("cat_0", "values", 0))
        damage(self.tiered.store.root / "work" / {chunk!r})
    return train(self, state, batch, fills, reads, planned)

TierRunner.train = damaged_before_step_4
sys.exit(main(["train", "--run-dir", {run!r}, *[a for o in {overrides!r} for a in ("--set", o)]]))
"""


def test_a_chunk_damaged_mid_run_stops_it_with_one_line_naming_the_chunk(tmp_path):
    run = tmp_path / "run"
    overrides = [*TINY, *RUN, "train.steps=6", "embedding.tier.lookahead=2"]
    script = DAMAGED_MID_RUN.format(run=str(run), chunk=CHUNK, overrides=overrides)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=child_env(), timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"dlrm-jax: error: {run / 'tier/work' / CHUNK}: row"), proc.stderr[-3000:]
    assert "of table cat_0 do" in last and "not match" in last and "the file changed after the tier wrote it" in last
    assert "; re-running resumes from the newest checkpoint whose disk-tier snapshot is intact" in last
    assert "nan" not in proc.stdout + proc.stderr and "learning_rate" not in proc.stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and 3 <= steps[-1] < 6  # none after the damage was read


def test_a_damaged_snapshot_is_skipped_for_the_older_checkpoint(tiny, tmp_path):
    whole, run = tmp_path / "whole", tmp_path / "run"
    train_and_evaluate(tiny(*RUN, "train.steps=6"), whole, **QUIET)
    train_and_evaluate(tiny(*RUN, "train.steps=4"), run, **QUIET)
    chunk = run / "tier/work" / CHUNK
    assert os.path.samefile(chunk, run / "tier/snapshots/4" / CHUNK)
    assert not os.path.samefile(chunk, run / "tier/snapshots/2" / CHUNK)
    damage(chunk)  # and so snapshot 4's
    logs = []
    train_and_evaluate(tiny(*RUN, "train.steps=6"), run, log=logs.append)
    warning = next(line for line in logs if line.startswith("warning: checkpoint"))
    assert f"{run / 'tier/snapshots/4' / CHUNK}: rows " in warning and "do not match their checksums" in warning
    assert "resuming from checkpoint at step 2" in logs
    assert losses(run) == losses(whole)  # steps 3-6 trained again from intact rows


def test_a_tier_folder_that_is_not_writable_is_named_and_the_checkpoints_kept(tiny, tmp_path, monkeypatch):
    """Before its fix: 'none of the 2 checkpoints restores ... fix or remove them'."""
    run = tmp_path / "run"
    train_and_evaluate(tiny(*RUN, "train.steps=4"), run, **QUIET)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())

    def read_only(arrays, source, build):  # chmod -R a-w, as a user who is not root
        raise PermissionError(errno.EACCES, "Permission denied", str(build))

    monkeypatch.setattr(snapshots, "_link_tree", read_only)
    with pytest.raises(CheckpointsIntact) as e:
        train_and_evaluate(tiny(*RUN, "train.steps=6"), run, **QUIET)
    said = str(e.value)
    assert said.startswith(f"the disk tier's folder {run / 'tier'} is not writable (EACCES, Permission denied: ")
    assert f"the checkpoints in {run / 'checkpoints'} are intact" in said and "remove" not in said
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before and not (run / "damaged").exists()
