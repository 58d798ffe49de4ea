"""The folders and files the project writes appear whole or not at all (dlrm_jax/files.py)."""

import os

import pytest

from dlrm_jax.files import new_folder


def test_a_new_folder_through_a_symbolic_link_appears_where_it_points(tmp_path):
    """Before: export --output LINK (to an empty folder, or to none yet) wrote everything, then
    failed to rename over the link ('Not a directory') and left LINK.partial behind."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "to_empty").symlink_to(tmp_path / "empty")
    (tmp_path / "to_none").symlink_to(tmp_path / "later" / "none")
    for link, target in (("to_empty", "empty"), ("to_none", "later/none")):
        with new_folder(tmp_path / link, "export") as work:
            (work / "a.txt").write_text("whole")
        assert (tmp_path / target / "a.txt").read_text() == "whole"
        assert (tmp_path / link).is_symlink() and (tmp_path / link / "a.txt").is_file()
    assert not [p for p in tmp_path.rglob("*.partial")]


def test_a_mount_point_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """Before: a mount point (a container's volume) was written beside, on the parent's disk,
    then could not be renamed over: the whole export failed at its end, its .partial left."""
    dest = tmp_path / "volume"
    dest.mkdir()
    mounted = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: os.fspath(p) == str(dest) or mounted(p))
    with pytest.raises(FileExistsError, match=f"{dest}: a mount point; export into a new folder inside it"):
        with new_folder(dest, "export"):
            raise AssertionError("nothing is written")
    assert list(tmp_path.iterdir()) == [dest]


def test_a_folder_that_cannot_be_put_in_place_leaves_no_partial(tmp_path, monkeypatch):
    from pathlib import Path

    def refused(self, target):
        raise OSError(16, "Device or resource busy", str(target))

    monkeypatch.setattr(Path, "rename", refused)
    with pytest.raises(OSError, match="busy"):
        with new_folder(tmp_path / "out", "export") as work:
            (work / "a.txt").write_text("x")
    assert list(tmp_path.iterdir()) == []


def test_preprocess_onto_a_mount_point_is_refused_first(tmp_path, monkeypatch):
    """Before: '[Errno 16] Device or resource busy' after the whole dataset was written."""
    from dlrm_jax.data.shards import check_output_target

    dest = tmp_path / "volume"
    dest.mkdir()
    mounted = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: os.fspath(p) == str(dest) or mounted(p))
    with pytest.raises(FileExistsError, match=f"^output {dest}: a mount point; preprocess into a new folder inside"):
        check_output_target(dest)


def test_runs_started_in_the_same_second_get_run_dirs_of_their_own(tmp_path, monkeypatch):
    """Before: three `dlrm-jax train &` of a sweep shared runs/<time>, and all but one were
    refused as 'in use' though none was given a run dir."""
    import time

    from dlrm_jax.files import new_run_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt: "20261207-150957")
    got = [new_run_dir() for _ in range(3)]
    assert got == ["runs/20261207-150957", "runs/20261207-150957-2", "runs/20261207-150957-3"]
    assert all((tmp_path / g).is_dir() for g in got)


def test_a_train_refused_after_its_run_dir_was_chosen_leaves_none(tmp_path, monkeypatch, capsys):
    """The runs/<time> a run without --run-dir is given is made when chosen: a run refused after
    that (pinned host memory on a CPU runtime) takes it away again, and runs/ with it."""
    from dlrm_jax.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--set", "mesh.devices=8", "--set", "data.host_memory=pinned"]) == 2
    assert "data.host_memory=pinned" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_partial_scores_of_a_killed_predict_go_at_the_next_one(tmp_path):
    """Before: a predict killed by SIGKILL or the OOM killer left its hidden partial file for good."""
    import socket
    import subprocess
    import sys

    from dlrm_jax.serving.files import remove_stale_partials

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    here = socket.gethostname()
    dead = tmp_path / f".scores.txt.{here}-{gone.stdout.strip()}.partial"
    alive = tmp_path / f".scores.txt.{here}-{os.getppid()}.partial"  # (a process still running: its own)
    other = tmp_path / f".other.txt.{here}-{gone.stdout.strip()}.partial"
    elsewhere = tmp_path / f".scores.txt.otherhost-{gone.stdout.strip()}.partial"  # (a shared folder)
    for f in (dead, alive, other, elsewhere):
        f.write_text("0.5\n")
    remove_stale_partials(tmp_path / "scores.txt")
    assert not dead.exists() and alive.exists() and other.exists() and elsewhere.exists()
