"""A disk tier belongs to the run that made it: another run given the same embedding.tier.path
is refused before it changes anything, and a checkpoint reads its tiered tables only from the
tier it was saved with."""

import json
import shutil

import pytest

from dlrm_jax.embedding.tiers.owner import OWNER_FILE
from dlrm_jax.train.export import export_run
from dlrm_jax.train.rundir import RunDirError
from dlrm_jax.train.saved_run import evaluate_run
from dlrm_jax.train.trainer import train_and_evaluate
from tests.embedding.tiered_configs import BASE, TIERED
from tests.helpers import QUIET

RUN = [*BASE, *TIERED, "mesh.devices=1", "train.checkpoint_every=2", "train.eval_batches=1"]


def tree(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.slow  # three short tiered runs
def test_a_tier_path_another_run_dir_made_is_refused_and_left_whole(tiny, tmp_path):
    """Before: a second run dir given the first's tier path started the tier anew (its
    snapshots deleted without a word), and the first run's eval then scored its checkpoint
    with the second run's tables."""
    shared = f"embedding.tier.path={tmp_path / 'shared'}"
    first = tmp_path / "A"
    train_and_evaluate(tiny("train.steps=2", *RUN, shared), first, **QUIET)
    scored = evaluate_run(first, log=lambda *_: None)
    owner = json.loads((tmp_path / "shared" / OWNER_FILE).read_text())
    assert owner["run_dir"] == str(first) and len(owner["id"]) == 32
    before = tree(tmp_path / "shared")
    with pytest.raises(RunDirError, match=f"tier.path={tmp_path / 'shared'}: holds the disk tier of run dir {first}"):
        train_and_evaluate(tiny("train.steps=2", "train.seed=5", *RUN, shared), tmp_path / "C", **QUIET)
    assert tree(tmp_path / "shared") == before
    again = evaluate_run(first, log=lambda *_: None)
    assert (again.step, again.auc, again.logloss) == (scored.step, scored.auc, scored.logloss)
    # The run that made it goes on from its checkpoint, and its later ones keep the tier's id.
    train_and_evaluate(tiny("train.steps=4", *RUN, shared), first, **QUIET)
    assert json.loads((tmp_path / "shared" / OWNER_FILE).read_text())["id"] == owner["id"]


@pytest.mark.slow  # two short tiered runs
def test_a_checkpoint_reads_its_tables_only_from_the_tier_it_was_saved_with(tiny, tmp_path):
    """Another run's tier put where a run's was (the same steps' snapshots, other tables) is
    refused by resume, eval and export, where they read the other tables silently before."""
    train_and_evaluate(tiny("train.steps=2", *RUN), tmp_path / "A", **QUIET)
    train_and_evaluate(tiny("train.steps=2", "train.seed=5", *RUN), tmp_path / "B", **QUIET)
    shutil.rmtree(tmp_path / "A" / "tier")
    shutil.copytree(tmp_path / "B" / "tier", tmp_path / "A" / "tier")
    another = f"{tmp_path / 'A' / 'tier'}: holds the disk tier of another run \\(run dir {tmp_path / 'B'}\\)"
    with pytest.raises(RunDirError, match=another + ", not the one the checkpoints in"):
        train_and_evaluate(tiny("train.steps=4", *RUN), tmp_path / "A", **QUIET)
    with pytest.raises(RunDirError, match=another + ", not the one checkpoint 2 in"):
        evaluate_run(tmp_path / "A", log=lambda *_: None)
    with pytest.raises(RunDirError, match=another):
        export_run(tmp_path / "A", tmp_path / "out", log=lambda *_: None)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # two short tiered runs
def test_a_tier_without_an_owner_record_is_taken_and_a_moved_run_dir_keeps_its_own(tiny, tmp_path):
    """A tier made before owners were recorded resumes as before and is recorded then; a run
    dir moved with its tier inside it resumes, and starts afresh, where it now is."""
    train_and_evaluate(tiny("train.steps=2", *RUN), tmp_path / "A", **QUIET)
    (tmp_path / "A" / "tier" / OWNER_FILE).unlink()
    train_and_evaluate(tiny("train.steps=4", *RUN), tmp_path / "A", **QUIET)
    assert json.loads((tmp_path / "A" / "tier" / OWNER_FILE).read_text())["run_dir"] == str(tmp_path / "A")
    (tmp_path / "A").rename(tmp_path / "moved")
    shutil.rmtree(tmp_path / "moved" / "checkpoints")
    train_and_evaluate(tiny("train.steps=2", *RUN), tmp_path / "moved", **QUIET)
    assert json.loads((tmp_path / "moved" / "tier" / OWNER_FILE).read_text())["run_dir"] == str(tmp_path / "moved")


def test_a_tier_path_changed_on_resume_names_the_folder_the_checkpoints_need(tiny, tmp_path):
    """Before: the refusal said the checkpoints keep their tables in the new, empty path."""
    train_and_evaluate(tiny("train.steps=2", *RUN), tmp_path / "A", **QUIET)
    moved = f"embedding.tier.path={tmp_path / 'new'}"
    with pytest.raises(RunDirError, match=f"keep their tiered tables in {tmp_path / 'A' / 'tier'}, where they were"):
        train_and_evaluate(tiny("train.steps=4", *RUN, moved), tmp_path / "A", **QUIET)
