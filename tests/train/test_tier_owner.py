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


@pytest.mark.slow  # four short tiered runs
def test_a_copied_run_dir_sharing_its_tier_is_refused_and_a_moved_one_takes_it(tiny, tmp_path):
    """Before: a copy of a run dir with an explicit embedding.tier.path resumed on the same
    tier (its checkpoints keep the tier's id), and the two runs replaced each other's
    snapshots: the first run's eval scored the copy's tables (AUC 0.732 -> 0.716)."""
    shared = f"embedding.tier.path={tmp_path / 'shared'}"
    first = tmp_path / "A"
    train_and_evaluate(tiny("train.steps=2", *RUN, shared), first, **QUIET)
    shutil.copytree(first, tmp_path / "copy")
    scored = evaluate_run(first, log=lambda *_: None)
    before = tree(tmp_path / "shared")
    with pytest.raises(RunDirError, match=f"the disk tier of run dir {first}, which still trains on it"):
        train_and_evaluate(tiny("train.steps=4", *RUN, shared), tmp_path / "copy", **QUIET)
    assert tree(tmp_path / "shared") == before
    again = evaluate_run(first, log=lambda *_: None)
    assert (again.step, again.auc, again.logloss) == (scored.step, scored.auc, scored.logloss)
    # A copy given a copy of the tier resumes on it; a run dir moved takes the tier it left.
    shutil.copytree(tmp_path / "shared", tmp_path / "copied_tier")
    train_and_evaluate(
        tiny("train.steps=4", *RUN, f"embedding.tier.path={tmp_path / 'copied_tier'}"), tmp_path / "copy", **QUIET
    )
    assert tree(tmp_path / "shared") == before
    first.rename(tmp_path / "moved")
    train_and_evaluate(tiny("train.steps=4", *RUN, shared), tmp_path / "moved", **QUIET)
    owner = json.loads((tmp_path / "shared" / OWNER_FILE).read_text())
    assert owner["run_dir"] == str(tmp_path / "moved") and owner["root"] == str(tmp_path / "shared")


def test_a_tier_in_use_by_a_run_is_refused_to_another(tiny, tmp_path):
    """Before: two new runs started at once on one embedding.tier.path both passed the owner
    check (no record yet) and raced to make the tier; the loser failed with '[Errno 39]
    Directory not empty: .../work.tmp -> .../work' or a zarr ALREADY_EXISTS error."""
    from dlrm_jax.embedding.tiers.format import TierError
    from dlrm_jax.files import FolderLock

    root = tmp_path / "shared"
    root.mkdir()
    holder = FolderLock(root).take(lambda who: AssertionError(who))
    try:
        with pytest.raises(TierError, match=f"{root}: the disk tier is in use by pid "):
            train_and_evaluate(tiny("train.steps=2", *RUN, f"embedding.tier.path={root}"), tmp_path / "B", **QUIET)
    finally:
        holder.release()
    assert sorted(p.name for p in root.iterdir()) == []  # nothing made, no lock left
    train_and_evaluate(tiny("train.steps=2", *RUN, f"embedding.tier.path={root}"), tmp_path / "B", **QUIET)


@pytest.mark.slow  # a short tiered run
def test_the_tier_keeps_snapshots_only_of_the_checkpoints_left(tiny, tmp_path):
    """Before: each save told the tier which checkpoints remain before the last save's rotation
    had removed any, so the tier kept snapshots of checkpoints already gone (checkpoints 60 65
    70 beside snapshots 36 40 60 65 70): on a large tier, copies of the tables. Then a run's
    end left the one the rotation after its last save removed, for good (a finished run's
    tier held a snapshot of no checkpoint); now a run ends with just the checkpoints'."""
    run = tmp_path / "run"
    steps = lambda folder: sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())
    train_and_evaluate(tiny("train.steps=10", *RUN, "train.keep_checkpoints=2"), run, **QUIET)
    assert steps(run / "checkpoints") == steps(run / "tier" / "snapshots") == [8, 10]
    train_and_evaluate(tiny("train.steps=14", *RUN, "train.keep_checkpoints=2"), run, **QUIET)
    assert steps(run / "checkpoints") == steps(run / "tier" / "snapshots") == [12, 14]


def test_a_tier_path_that_is_the_run_dir_itself_is_refused_by_name(tiny, tmp_path):
    """Before: 'the disk tier is in use by pid N', N the run's own (the tier's lock file and the
    run dir's are one)."""
    from dlrm_jax.config import ConfigError
    from dlrm_jax.train.wiring import tier_root

    run = tmp_path / "run"
    with pytest.raises(ConfigError, match="embedding.tier.path=.*: the run dir itself; give the tier a folder"):
        tier_root(tiny(*TIERED, f"embedding.tier.path={tmp_path}/./run"), run)
    assert tier_root(tiny(*TIERED, f"embedding.tier.path={run}/tier"), run) == run / "tier"
