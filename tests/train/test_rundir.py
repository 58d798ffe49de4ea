"""Run directories under mistakes and faults: one writer, config checked before any write,
damaged checkpoints skipped, read-only commands that change nothing, signals save, a full disk
and a diverging loss stop cleanly."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from dlrm_jax import wording
from dlrm_jax.train.checkpoint import Checkpoints
from dlrm_jax.train.checkpoint_leases import LEASES
from dlrm_jax.train.checkpoint_reader import IncompatibleCheckpoint
from dlrm_jax.train.export import export_run
from dlrm_jax.train.rundir import RunDir, RunDirError, config_differences, describe_changes
from dlrm_jax.train.saved_run import evaluate_run
from dlrm_jax.train.trainer import TrainingDiverged, train_and_evaluate
from tests.child_env import child_env
from tests.helpers import QUIET
from tests.train.damage import change_saved_element


def snapshot(run):
    return {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"}


def tree(run):
    """Every file under a run dir (its lock, library log and readers' empty lease files aside)
    with its bytes."""
    return {
        str(p.relative_to(run)): p.read_bytes()
        for p in sorted(run.rglob("*"))
        if p.is_file() and p.name not in (".lock", "dlrm-jax.log") and p.parent.name != LEASES
    }


def corrupt(checkpoint):
    for f in checkpoint.rglob("*"):
        if f.is_file():
            f.write_bytes(b"\0garbage")


def test_second_writer_is_refused_naming_the_holder(tiny, tmp_path):
    with RunDir.open(tmp_path / "run", tiny()):
        with pytest.raises(RunDirError, match=f"in use by pid {os.getpid()}"):
            RunDir.open(tmp_path / "run", tiny())
    RunDir.open(tmp_path / "run", tiny()).close()  # free again once the first has closed
    assert not (tmp_path / "run" / ".lock").exists()  # and no stale lock is left to read as live


@pytest.mark.slow
def test_a_finished_run_leaves_no_lock_and_no_empty_log(tiny, tmp_path):
    import subprocess
    import sys

    subprocess.run(
        [
            sys.executable,
            "-m",
            "dlrm_jax",
            "train",
            "--config",
            "smoke",
            "--set",
            "train.steps=4",
            "--set",
            "mesh.devices=2",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        check=True,
        capture_output=True,
        timeout=300,
        env=child_env(drop=()),
    )
    names = {p.name for p in (tmp_path / "run").iterdir()}
    assert ".lock" not in names and "dlrm-jax.log" not in names, names


@pytest.mark.slow
def test_incompatible_config_changes_nothing(tiny, tmp_path):
    run = tmp_path / "run"
    train_and_evaluate(tiny("train.steps=2"), run, **QUIET)
    before = snapshot(run)
    for change in (["model.embedding_dim=16", "model.bottom_mlp=[16, 16]"], ["train.optimizer=sgd"]):
        with pytest.raises(RunDirError) as e:
            train_and_evaluate(tiny("train.steps=4", *change), run, **QUIET)
        assert change[0].split("=")[0] in str(e.value) and "new run_dir" in str(e.value)
        assert snapshot(run) == before
    # Settings that do not change the state may change on a resume.
    logs = []
    train_and_evaluate(tiny("train.steps=4", "train.learning_rate=0.002"), run, log=logs.append)
    assert any("train.learning_rate 0.001 -> 0.002" in line for line in logs)


@pytest.mark.slow
def test_a_resume_names_each_changed_key_down_to_its_value(tiny):
    """A nested section's change is its key, not the section's whole dict (a resume with
    ``embedding.dynamic.new_rows`` changed printed every key of ``embedding.dynamic``)."""
    old = tiny("embedding.ids=dynamic", "embedding.dynamic.new_rows=initializer")
    new = tiny("embedding.ids=dynamic", "train.steps=9")
    assert describe_changes(config_differences(old, new)) == (
        "train.steps 6 -> 9; embedding.dynamic.new_rows initializer -> shared"
    )


def test_damaged_newest_checkpoint_falls_back_with_one_warning(tiny, tmp_path):
    cfg = tiny("train.steps=6", "train.checkpoint_every=2", "train.log_every=1", "mesh.devices=4")
    whole = train_and_evaluate(cfg, tmp_path / "whole", **QUIET)
    run = tmp_path / "run"
    train_and_evaluate(
        tiny("train.steps=4", "train.checkpoint_every=2", "train.log_every=1", "mesh.devices=4"), run, **QUIET
    )
    for f in (run / "checkpoints" / "4").rglob("*"):  # corrupt every file of the newest one
        if f.is_file():
            f.write_bytes(b"\0garbage")
    logs = []
    resumed = train_and_evaluate(cfg, run, log=logs.append)
    warnings = [line for line in logs if line.startswith("warning:")]
    assert len(warnings) == 1 and "checkpoints/4" in warnings[0] and len(warnings[0].splitlines()) == 1
    assert "resuming from checkpoint at step 2" in logs
    assert (resumed.step, resumed.auc, resumed.logloss) == (whole.step, whole.auc, whole.logloss)
    assert [p.name.split("-")[0] for p in (run / "damaged").iterdir()] == ["4"]


def test_a_checkpoint_whose_contents_changed_falls_back_on_another_device_count(tiny, tmp_path):
    """Before: orbax's files carry no checksum, and a changed value that decoded without an
    error was resumed from silently (a bit flipped inside a compressed chunk)."""
    args = ("train.checkpoint_every=2", "train.log_every=1")
    train_and_evaluate(tiny("train.steps=2", *args, "mesh.devices=2"), tmp_path / "whole", **QUIET)
    whole = train_and_evaluate(tiny("train.steps=6", *args, "mesh.devices=4"), tmp_path / "whole", **QUIET)
    run = tmp_path / "run"
    train_and_evaluate(tiny("train.steps=4", *args, "mesh.devices=2"), run, **QUIET)
    change_saved_element(run / "checkpoints" / "4", "params.top.layers.0.bias")
    with pytest.raises(ValueError, match="step 4 is damaged .params.top.layers.0.bias's contents differ from the"):
        evaluate_run(run, step=4)
    logs = []
    resumed = train_and_evaluate(tiny("train.steps=6", *args, "mesh.devices=4"), run, log=logs.append)
    warnings = [line for line in logs if line.startswith("warning:")]
    assert len(warnings) == 1 and "checkpoints/4 is damaged (params.top.layers.0.bias's contents differ" in warnings[0]
    assert "resuming from checkpoint at step 2" in logs
    assert (resumed.step, resumed.auc, resumed.logloss) == (whole.step, whole.auc, whole.logloss)


# (--set overrides, what the refusal names): another model or other data than the run's.
OTHER_MODELS = [
    (["model.embedding_dim=16", "model.bottom_mlp=[16, 16]"], "table cat_0 is 300 rows x 8 there, 300 x 16 here"),
    (["model.top_mlp=[32, 1]"], "params.top.layers.0.bias has shape (16,) there, (32,) here"),
    (["data.cardinalities=[300, 40, 2000, 7]"], "table cat_2 is 1,000 rows x 8 there, 2,000 x 8 here"),
]


@pytest.mark.slow
def test_eval_and_export_of_another_model_refuse_in_one_line_and_change_nothing(tiny, tmp_path):
    run = tmp_path / "run"
    train_and_evaluate(tiny("train.steps=4", "train.checkpoint_every=2"), run, **QUIET)
    before = tree(run)
    export = lambda r, o, **kw: export_run(r, tmp_path / "out", o, **kw)
    for (overrides, _), read in zip(OTHER_MODELS, (evaluate_run, export, evaluate_run), strict=True):
        with pytest.raises(IncompatibleCheckpoint) as e:
            read(run, overrides, **QUIET)
        said = str(e.value)
        assert "its checkpoints hold the state of another config" in said and "\n" not in said
        assert f"config.yaml: {overrides[0].split('=')[0]}" in said
        assert tree(run) == before  # no checkpoint set aside as damaged
    assert evaluate_run(run, **QUIET).step == 4


def test_eval_refuses_a_dynamic_tables_setting_that_reads_the_maps_otherwise(tiny, tmp_path):
    """Before: `eval --set embedding.dynamic.probes=2` read maps placed over 8 probes with 2
    (ids further along found nowhere: AUC moved, no word), and a resume only printed it."""
    run = tmp_path / "run"
    dynamic = ("embedding.ids=dynamic", "train.steps=4", "train.checkpoint_every=2")
    train_and_evaluate(tiny(*dynamic), run, **QUIET)
    with pytest.raises(IncompatibleCheckpoint, match="config.yaml: embedding.dynamic.probes 8 -> 2 "):
        evaluate_run(run, ["embedding.dynamic.probes=2"], **QUIET)
    with pytest.raises(RunDirError, match="another model: embedding.dynamic.policy lru -> lfu"):
        train_and_evaluate(tiny(*dynamic, "embedding.dynamic.policy=lfu"), run, **QUIET)
    with pytest.raises(
        RunDirError,
        match=r"another model: dynamic tables \(embedding.ids, embedding.table_ids\) \['cat_0', 'cat_1', 'cat_2', "
        r"'cat_3'\] -> \[\]",
    ):
        train_and_evaluate(tiny(*dynamic[1:]), run, **QUIET)
    evaluate_run(run, ["embedding.dynamic.half_life=100"], **QUIET)  # how counts decay from now on: free
    # the same dynamic tables named another way (every one listed, in any order): refused before
    every = "embedding.table_ids=[cat_3=dynamic, cat_1=dynamic, cat_0=dynamic, cat_2=dynamic]"
    assert evaluate_run(run, ["embedding.ids=vocab", every], **QUIET).step == 4


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["errno", "tensorstore"])
def test_an_export_appears_whole_or_not_at_all(tiny, tmp_path, monkeypatch, fault):
    """`dlrm-jax export` wrote into its destination as it went: a full disk left a folder of
    some tables, taken for an export, and a folder already holding one got its files mixed in.
    Now a folder that holds anything is refused before any work, and a full disk (an OSError,
    or tensorstore's message with the OS's code) is one line naming the export; nothing is left."""
    import errno

    from dlrm_jax.train import export as export_module

    run = tmp_path / "run"
    train_and_evaluate(tiny("train.steps=2", "train.checkpoint_every=2"), run, **QUIET)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    with pytest.raises(FileExistsError, match="full: exists and is not empty; export into a new folder"):
        export_run(run, tmp_path / "full", **QUIET)
    (tmp_path / "afile").write_text("")  # (it said 'exists and is not empty' of an empty file)
    with pytest.raises(FileExistsError, match="afile: is a file, not a folder; export into a new folder"):
        export_run(run, tmp_path / "afile", **QUIET)
    (tmp_path / "afile").unlink()
    calls, real = [], export_module.export_array

    def fills(path, value):
        calls.append(path)
        if len(calls) == 3:
            if fault == "errno":
                raise OSError(errno.ENOSPC, "No space left on device")
            raise ValueError(f"RESOURCE_EXHAUSTED: Error writing local file {path}: ... [os_error_code='28']")
        real(path, value)

    monkeypatch.setattr(export_module, "export_array", fills)
    with pytest.raises(OSError, match="export .*out: no space left on device; nothing was written") as e:
        export_run(run, tmp_path / "out", **QUIET)
    assert e.value.errno == errno.ENOSPC and "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "run"]
    monkeypatch.setattr(export_module, "export_array", real)
    assert export_run(run, tmp_path / "out", **QUIET) == 2 and (tmp_path / "out").is_dir()


def test_eval_skips_a_damaged_checkpoint_and_leaves_it_in_place(tiny, tmp_path):
    run = tmp_path / "run"
    train_and_evaluate(tiny("train.steps=4", "train.checkpoint_every=2"), run, **QUIET)
    corrupt(run / "checkpoints" / "4")
    before, logs = tree(run), []
    assert evaluate_run(run, log=logs.append).step == 2
    warnings = [line for line in logs if line.startswith("warning:")]
    assert len(warnings) == 1 and "checkpoints/4 is damaged" in warnings[0] and "left in place" in warnings[0]
    assert tree(run) == before and not (run / "damaged").exists()
    # Asked for by step: one line naming the step, its folder and the steps to use instead.
    with pytest.raises(
        ValueError,
        match=rf"^{run / 'checkpoints' / '4'}: the checkpoint at step 4 is damaged "
        r"\(.*\); use another step \(step= with one of \[2\]\)",
    ):
        evaluate_run(run, step=4, **QUIET)
    assert tree(run) == before


def test_resume_without_config_yaml_refuses_another_model(tiny, tmp_path):
    run = tmp_path / "run"
    train_and_evaluate(tiny("train.steps=4", "train.checkpoint_every=2"), run, **QUIET)
    (run / "config.yaml").unlink()
    before = tree(run)
    other = tiny("train.steps=6", *OTHER_MODELS[0][0])
    with pytest.raises(IncompatibleCheckpoint, match=OTHER_MODELS[0][1]):
        train_and_evaluate(other, run, **QUIET)
    assert tree(run) == before
    logs = []
    train_and_evaluate(tiny("train.steps=6"), run, log=logs.append)
    assert "resuming from checkpoint at step 4" in logs


def test_no_restorable_checkpoint_moves_nothing_and_set_aside_ones_block_a_fresh_start(tiny, tmp_path):
    run, cfg = tmp_path / "run", tiny("train.steps=6", "train.checkpoint_every=2")
    train_and_evaluate(tiny("train.steps=4", "train.checkpoint_every=2"), run, **QUIET)
    for step in ("2", "4"):
        corrupt(run / "checkpoints" / step)
    before = tree(run)
    with pytest.raises(FileNotFoundError, match="none of the 2 checkpoints restores.*nothing was moved.*new run_dir"):
        train_and_evaluate(cfg, run, **QUIET)
    assert tree(run) == before
    # Every checkpoint set aside (as earlier versions did): refused, not a silent start at step 0.
    (run / "damaged").mkdir()
    for step in ("2", "4"):
        (run / "checkpoints" / step).rename(run / "damaged" / f"{step}-20250101-000000")
    before = tree(run)
    with pytest.raises(RunDirError, match="move one back.*or pass a new run_dir") as e:
        train_and_evaluate(cfg, run, **QUIET)
    assert f"mv {run / 'damaged' / '4-20250101-000000'} {run / 'checkpoints' / '4'}" in str(e.value)
    assert tree(run) == before


def test_resume_with_its_disk_tier_gone_is_refused(tiny, tmp_path):
    from tests.embedding.tiered_configs import BASE, TIERED

    run, tiered = tmp_path / "run", [*BASE, *TIERED, "mesh.devices=2", "train.checkpoint_every=2"]
    train_and_evaluate(tiny("train.steps=2", *tiered), run, **QUIET)
    shutil.rmtree(run / "tier")
    before = tree(run)
    with pytest.raises(RunDirError, match=f"{run / 'tier'}: no disk tier there.*steps 2.*new run_dir"):
        train_and_evaluate(tiny("train.steps=4", *tiered), run, **QUIET)
    assert tree(run) == before and not (run / "tier").exists()


def test_a_tier_moved_from_its_given_path_is_named_where_the_run_left_it(tiny, tmp_path):
    """Before: a run whose tier was at embedding.tier.path=A, moved away, resumed without the
    key was told 'RUN/tier: no disk tier there ... put RUN/tier back as the run left it', a
    folder the run never used; eval and export said only 'A/snapshots/N: missing: no such
    snapshot'."""
    from dlrm_jax.embedding.tiers.format import TierError
    from tests.embedding.tiered_configs import BASE, TIERED

    run, tiered = tmp_path / "run", [*BASE, *TIERED, "mesh.devices=2", "train.checkpoint_every=2"]
    given = tmp_path / "tierA"
    train_and_evaluate(tiny("train.steps=2", *tiered, f"embedding.tier.path={given}"), run, **QUIET)
    given.rename(tmp_path / "tierB")
    before = tree(run)
    with pytest.raises(
        RunDirError,
        match=f"{run / 'tier'}: no disk tier there; nor at {given}, where .*put {given} "
        "back as the run left it or resume with the override 'embedding.tier.path=WHERE_IT_IS_NOW'",
    ):
        train_and_evaluate(tiny("train.steps=4", *tiered), run, **QUIET)
    assert tree(run) == before and not (run / "tier").exists()
    with pytest.raises(
        TierError, match=f"{given}: no disk tier there.*the override 'embedding.tier.path=WHERE_IT_IS_NOW'"
    ):
        evaluate_run(run, log=lambda *a: None)
    assert not given.exists()


def test_finished_run_reports_its_final_metrics(tiny, tmp_path):
    first = train_and_evaluate(tiny("train.steps=4"), tmp_path / "run", **QUIET)
    again = train_and_evaluate(tiny("train.steps=4"), tmp_path / "run", **QUIET)
    assert again == first


@pytest.mark.slow  # 6-10 s on 2 cores
def test_divergence_stops_before_saving_the_bad_state(tiny, tmp_path):
    sane = ["train.checkpoint_every=5", "train.log_every=5", "train.optimizer=sgd", "embedding.optimizer=sgd"]
    train_and_evaluate(tiny("train.steps=5", *sane), tmp_path / "run", **QUIET)
    wild = tiny("train.steps=60", *sane, "train.learning_rate=1e6", "embedding.learning_rate=1e6")
    with pytest.raises(TrainingDiverged, match=r"diverged at step (\d+)") as e:
        train_and_evaluate(wild, tmp_path / "run", **QUIET)
    bad_step = int(e.value.args[0].split("step ")[1].split(":")[0])
    assert bad_step > 5
    assert Checkpoints(tmp_path / "run" / "checkpoints", 3).all_steps() == [5]
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(e["step"] for e in logged) == 5


WILD = ["train.learning_rate=1e6", "embedding.learning_rate=1e6"]


@pytest.mark.slow
def test_a_checkpoint_never_holds_the_update_that_diverged(tiny, tmp_path):
    """A step's update shows only in the next step's loss: with a checkpoint after every step,
    the state saved after step 1 was the blown-up one, and a sane re-run resumed from it."""
    run = tmp_path / "run"
    every_step = ["train.checkpoint_every=1", "train.log_every=1", "train.steps=6"]
    with pytest.raises(TrainingDiverged, match=r"diverged at step 1: the state after it has loss"):
        train_and_evaluate(tiny(*every_step, *WILD), run, **QUIET)
    assert Checkpoints(run / "checkpoints", 3).all_steps() == []
    sane = train_and_evaluate(tiny(*every_step), run, **QUIET)
    assert sane.step == 6 and 0.3 < sane.loss < 1.0 and sane.auc > 0.5, sane
    # Diverging after good checkpoints: the last good one stays the newest.
    with pytest.raises(TrainingDiverged, match=r"diverged at step 7"):
        train_and_evaluate(tiny(*every_step[:2], "train.steps=12", *WILD), run, **QUIET)
    assert Checkpoints(run / "checkpoints", 3).all_steps()[-1] == 6


@pytest.mark.slow  # 6-10 s on 2 cores
def test_the_divergence_limit_keeps_its_reference_across_resumes(tiny, tmp_path):
    """A resumed run measures its losses against the first loss of the run that started the
    run dir, not against its own first loss (which may already be a bad state's)."""
    run = tmp_path / "run"
    # With the limit off, a blown-up (finite) state is saved, as it was before states were checked.
    train_and_evaluate(tiny("train.steps=1", "train.log_every=1", "train.max_loss_ratio=0", *WILD), run, **QUIET)
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    with pytest.raises(TrainingDiverged, match=r"diverged at step 2: loss \S+ \(starting loss (\S+),") as e:
        train_and_evaluate(tiny("train.steps=6", "train.log_every=1"), run, **QUIET)
    assert f"starting loss {first:.6g}," in str(e.value)


def test_a_divergence_from_a_first_loss_far_above_a_fresh_models_names_the_inputs():
    """Before: dense features of 1e30 started at a loss of 5.9e27, and the run 'diverged' nine
    steps later advising a lower learning rate; with the limit off the line said 'limit ... 0x'."""
    from dlrm_jax.train.watch import LossWatch

    for reference, says in ((5.9e27, "inputs out of scale"), (0.7, "lower train.learning_rate")):
        with pytest.raises(TrainingDiverged, match=rf"no limit: train.max_loss_ratio=0\); .*{says}"):
            LossWatch(0.0, reference)._check(float("nan"), "training diverged at step 3: loss nan")


# ---------------------------------------------------------------- the CLI as a user meets it

CLI_ARGS = ["train", "--config", "smoke", "--set", "train.progress_bar=false", "--set", "mesh.devices=2"]


def popen(*args, cwd=None):
    env = child_env(drop=())
    return subprocess.Popen(
        [sys.executable, "-m", "dlrm_jax", *CLI_ARGS, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig,code,named", [(signal.SIGTERM, 143, False), (signal.SIGINT, 130, True), (signal.SIGHUP, 129, True)]
)  # SIGHUP: the terminal closed
def test_signal_finishes_the_step_saves_and_exits(tmp_path, sig, code, named):
    """Without --run-dir the run goes to runs/<time>, and the line names the --run-dir that
    resumes it (the same command would start another)."""
    args = ["--set", "train.steps=100000", "--set", "train.checkpoint_every=50"]
    proc = popen(*args, "--run-dir", str(tmp_path / "run")) if named else popen(*args, cwd=tmp_path)
    deadline = time.time() + 120
    # A fixed depth, not "**": a recursive walk races orbax's temporary folders as they vanish.
    pattern = "run/checkpoints/50" if named else "runs/*/checkpoints/50"
    while not list(tmp_path.glob(pattern)):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    run = list(tmp_path.glob(pattern))[0].parent.parent
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    # What will happen, at once (an evaluation or a save may take minutes), then how it ended.
    notice, end = err.strip().splitlines()
    again = "press Ctrl-C again" if sig == signal.SIGINT else f"send {sig.name} again"
    assert notice == (
        f"dlrm-jax: {sig.name}: the run finishes what it is doing (a step, an evaluation or a save), saves a "
        f"checkpoint and stops after the current step; {again} to stop at once without saving"
    )
    assert "Traceback" not in err
    step = int(end.split("after step ")[1].split(";")[0])
    assert step >= 50 and (run / "checkpoints" / str(step)).exists()
    if named:
        assert "re-run the same command to resume" in end
    else:
        assert f"re-run the command with --run-dir {run.relative_to(tmp_path)} to resume" in end


@pytest.mark.slow
def test_ctrl_c_twice_in_a_notebook_stops_the_run_not_the_kernel(tmp_path):
    """From Python the process is the user's kernel: a second Ctrl-C raised a KeyboardInterrupt
    there, where it had ended the process (rc 130), and every variable of the notebook with it."""
    code = f"""
import os, signal, time, dlrm_jax
dlrm_jax.request_cpu_devices(2)
from tests.helpers import tiny_config
cfg = tiny_config("train.steps=100000", "train.checkpoint_every=0", "mesh.devices=2", "train.eval_every=3")

class Pressing(dlrm_jax.SyntheticSource):  # Ctrl-C twice during the first evaluation
    def eval_batches(self):  # (read on a thread ahead: the run waits for it, handling the signals)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # (two at once are one to Python)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
        yield from super().eval_batches()

kept = "a notebook's variable"
try:
    dlrm_jax.train_and_evaluate(cfg, {str(tmp_path / "run")!r}, source=Pressing(cfg), log=lambda *_: None)
except KeyboardInterrupt:
    print("kernel alive:", kept)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=child_env())
    assert proc.returncode == 0 and "kernel alive: a notebook's variable" in proc.stdout, proc.stderr
    assert "stopped at once by SIGINT: nothing saved since the last checkpoint" in proc.stderr


@pytest.mark.slow
def test_eval_and_export_leave_a_running_save_alone_and_print_no_library_logs(tiny, tmp_path):
    run = tmp_path / "run"
    train_and_evaluate(tiny("train.steps=4", "train.checkpoint_every=2", "mesh.devices=2"), run, **QUIET)
    in_flight = run / "checkpoints" / "6.orbax-checkpoint-tmp" / "state.orbax-checkpoint-tmp"  # a save under way
    in_flight.mkdir(parents=True)
    (in_flight / "manifest.ocdbt").write_bytes(b"partly written")
    for command in (["eval"], ["export", "--output", str(tmp_path / "out")]):
        # On 4 devices the tables are re-laid out: the restore whose reads orbax logs about.
        proc = subprocess.run(
            [sys.executable, "-m", "dlrm_jax", *command, "--run-dir", str(run), "--set", "mesh.devices=4"],
            capture_output=True,
            text=True,
            timeout=300,
            env=child_env(drop=()),
        )
        assert proc.returncode == 0 and "re-laying out" in proc.stdout, proc.stderr
        assert (in_flight / "manifest.ocdbt").read_bytes() == b"partly written"
        assert not proc.stderr.strip(), proc.stderr  # no traceback, no absl warnings
        log = run / "dlrm-jax.log"  # where they go, as in train: made by the first message only
        assert not log.exists() or log.stat().st_size > 0


@contextlib.contextmanager
def small_disk(folder, size: str):
    """``folder`` as a tmpfs of ``size`` (the test skips where none can be mounted)."""
    folder.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@pytest.mark.slow
def test_full_disk_is_one_line_and_keeps_older_checkpoints(tmp_path):
    with small_disk(tmp_path / "disk", "8m") as disk:
        run = disk / "run"
        first = popen("--set", "train.steps=20", "--run-dir", str(run))
        assert first.wait(timeout=120) == 0, first.communicate()
        free = shutil.disk_usage(disk).free
        (disk / "filler").write_bytes(b"\0" * (free - 64 * 1024))  # room for logs, not a checkpoint
        second = popen("--set", "train.steps=40", "--run-dir", str(run))
        _, err = second.communicate(timeout=120)
        assert second.returncode == 1 and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1 and "no space left on device" in err and "[20]" in err
        (disk / "filler").unlink()
        third = popen("--set", "train.steps=40", "--run-dir", str(run))  # resumes from the intact 20
        out, err = third.communicate(timeout=120)
        assert third.returncode == 0 and "resuming from checkpoint at step 20" in out, err


@pytest.mark.slow
def test_a_disk_full_before_the_run_starts_names_the_file(tmp_path):
    """Before its fix: a full disk at the start said '[Errno 28] No space left on device' and no path."""
    with small_disk(tmp_path / "disk", "1m") as disk:
        free = shutil.disk_usage(disk).free
        (disk / "filler").write_bytes(b"\0" * free)
        proc = popen("--set", "train.steps=4", "--run-dir", str(disk / "run"))
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert f"{disk / 'run'}/" in err and "no space left on device" in err and "MiB free" in err, err


@pytest.mark.slow
def test_a_newest_checkpoint_with_truncated_data_is_one_warning_and_no_tracebacks(tmp_path):
    """Before its fix: recovering from a damaged newest checkpoint printed 28 asyncio tracebacks
    ('Event loop is closed', 168 lines): tensorstore reads in flight when the restore failed."""
    run = tmp_path / "run"
    first = popen("--set", "train.steps=4", "--set", "train.checkpoint_every=2", "--run-dir", str(run))
    assert first.wait(timeout=120) == 0, first.communicate()
    for f in (run / "checkpoints" / "4" / "state" / "d").iterdir():
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    again = popen("--set", "train.steps=6", "--run-dir", str(run))
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    assert "Traceback" not in err and "Event loop" not in err and not err.strip(), err
    assert sum(line.startswith("warning: checkpoint") and "is damaged" in line for line in out.splitlines()) == 1
    assert "resuming from checkpoint at step 2" in out


@pytest.mark.slow  # 6-10 s on 2 cores
@pytest.mark.parametrize("loss", ["folder", "chunk"])
def test_a_tier_whose_working_files_alone_are_gone_resumes_from_its_snapshot(tiny, tmp_path, loss):
    """Before its fix: deleting only tier/work said 'no disk tier there ... put RUN/tier back' while
    the snapshots were there, and one working chunk file deleted said '...: missing' with no
    hint. The working files are made again from the newest snapshot, and the run resumes
    bitwise as if nothing had happened."""
    from tests.embedding.tiered_configs import BASE, TIERED

    tiered = [*BASE, *TIERED, "mesh.devices=2", "train.checkpoint_every=2", "train.log_every=1"]
    whole = tmp_path / "whole"
    train_and_evaluate(tiny("train.steps=4", *tiered), whole, **QUIET)
    run = tmp_path / "run"
    train_and_evaluate(tiny("train.steps=2", *tiered), run, **QUIET)
    if loss == "folder":
        shutil.rmtree(run / "tier" / "work")
        said = "tier/work was gone: made again from the disk tier's newest snapshot (step 2)"
    else:
        (run / "tier" / "work" / "cat_0" / "values" / "c.0.0").unlink()
        said = "tier/work/cat_0/values/c.0.0: missing; the disk tier's working files are made again from its snapshot of step 2"
    logs = []
    train_and_evaluate(tiny("train.steps=4", *tiered), run, log=logs.append)
    assert any(said in line for line in logs), logs
    assert files(run / "metrics.jsonl") == files(whole / "metrics.jsonl")


def files(path):
    """Step -> loss (an eval event carries its step's loss too): a resumed run's, bit for bit."""
    import json

    return {e["step"]: e["loss"] for e in map(json.loads, path.read_text().splitlines())}


def test_config_yaml_records_paths_absolute(tiny, tmp_path, monkeypatch):
    """Before: a relative data.path was recorded as given, and `eval --run-dir ../runs/A` from
    another directory said "data.path=data/k: no such folder"."""
    import yaml

    monkeypatch.chdir(tmp_path)
    cfg = tiny("data.source=criteo", "data.path=days/0.tsv,/abs/1.tsv", "embedding.tier.path=tier")
    with RunDir.open(tmp_path / "run", cfg) as rd:
        rd.record("", "{}")
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["data"]["path"] == f"{tmp_path}/days/0.tsv,/abs/1.tsv"
    assert saved["embedding"]["tier"]["path"] == f"{tmp_path}/tier"
    logs = []
    RunDir.open(tmp_path / "run", cfg, log=logs.append).close()  # the same paths: no change to report
    assert logs == []
    # a comma is a folder's own where the path is one folder (before: 'tiers/a,b' recorded as
    # '.../tiers/a,/.../b', and eval and export of the run looked for its tier there); '~' is home
    cfg = tiny("data.path=", "embedding.tier.path=tiers/a,b")
    with RunDir.open(tmp_path / "run2", cfg) as rd:
        rd.record("", "{}")
    assert yaml.safe_load((tmp_path / "run2" / "config.yaml").read_text())["embedding"]["tier"]["path"] == (
        f"{tmp_path}/tiers/a,b"
    )
    from dlrm_jax.config import with_absolute_paths  # (', ' between files: one path, not ' 1.tsv' under the cwd)

    spaced = tiny("data.source=criteo", "data.path=days/0.tsv, /abs/1.tsv")
    assert with_absolute_paths(spaced).data.path == f"{tmp_path}/days/0.tsv,/abs/1.tsv"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tiny("embedding.tier.path=~/t").embedding.tier.path == f"{tmp_path}/home/t"
    assert (
        tiny("data.source=criteo", "data.path=~/a.tsv,~/b.tsv").data.path
        == f"{tmp_path}/home/a.tsv,{tmp_path}/home/b.tsv"
    )


def test_a_change_to_this_versions_default_says_how_to_keep_the_runs(tiny, tmp_path):
    """A run of an older version, whose defaults differed, resumed by the same command took the
    new defaults, said as 'resuming with changed settings', as if the command had changed them:
    it now says which are the defaults and the --set that goes on as the run trained."""
    with RunDir.open(tmp_path / "run", tiny("embedding.dynamic.new_rows=initializer", "train.steps=4")) as rd:
        rd.record("", "{}")
    (tmp_path / "run" / "checkpoints" / "4").mkdir(parents=True)  # (a checkpoint to resume)
    logs = []
    RunDir.open(tmp_path / "run", tiny("train.steps=8"), log=logs.append).close()
    assert logs == [
        "resuming with changed settings: train.steps 4 -> 8; embedding.dynamic.new_rows initializer -> shared "
        "(of these, embedding.dynamic.new_rows now at this version's default: unless this command set them so, "
        "the run's earlier commands set them otherwise or the default changed since; to go on as the run trained: "
        "the override 'embedding.dynamic.new_rows=initializer')"
    ], logs
    # The command line's words in a command (before: a notebook was told its flags too)
    logs.clear()
    with wording.command_line():
        RunDir.open(tmp_path / "run", tiny("train.steps=8"), log=logs.append).close()
    assert logs[0].endswith("to go on as the run trained: --set embedding.dynamic.new_rows=initializer)"), logs
    # A key the run derives is no change (before: switched to epochs, 'train.steps 8 -> 1000 ... now at
    # this version's default ... --set train.steps=8', which the epochs overrule)
    logs.clear()
    shared = "embedding.dynamic.new_rows=initializer"
    RunDir.open(tmp_path / "run", tiny(shared, "train.epochs=1", "train.evals_per_epoch=2"), log=logs.append).close()
    assert logs == ["resuming with changed settings: train.epochs 0.0 -> 1.0; train.evals_per_epoch 0 -> 2"], logs


def test_a_run_from_before_the_data_record_is_not_given_one_at_its_resume(tiny, tmp_path):
    """Before: a run dir without dataset.json (an older version's) resumed over other data
    recorded that data as the one it trained on."""
    (tmp_path / "a.tsv").write_text("1\t2\n")
    (tmp_path / "b.tsv").write_text("0\t5\n" * 3)
    cfg = lambda name: tiny("data.source=criteo", f"data.path={tmp_path / name}", "train.steps=4")
    with RunDir.open(tmp_path / "run", cfg("a.tsv")) as rd:
        rd.record("", "{}")
    assert json.loads((tmp_path / "run" / "dataset.json").read_text())["bytes"] == 4
    (tmp_path / "run" / "dataset.json").unlink()
    (tmp_path / "run" / "checkpoints" / "4").mkdir(parents=True)
    logs = []
    with RunDir.open(tmp_path / "run", cfg("b.tsv"), log=logs.append) as rd:
        rd.record("", "{}")
    assert not (tmp_path / "run" / "dataset.json").exists() and not [x for x in logs if "other data" in x], logs


def test_a_fresh_start_keeps_an_earlier_runs_metrics_and_config(tiny, tmp_path):
    """Before: a run dir whose checkpoints were removed trained again from step 0 without a word,
    and its metrics.jsonl was replaced by the new run's."""
    run = tmp_path / "run"
    train_and_evaluate(tiny("train.steps=4", "train.checkpoint_every=2"), run, **QUIET)
    earlier = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "config.yaml")}
    shutil.rmtree(run / "checkpoints")
    logs = []
    train_and_evaluate(tiny("train.steps=4", "train.checkpoint_every=2"), run, log=logs.append)
    kept = [p for p in (run / "earlier").iterdir()]
    assert len(kept) == 1 and {n: (kept[0] / n).read_bytes() for n in earlier} == earlier
    assert any(line.startswith("no checkpoint to resume in") and str(kept[0]) in line for line in logs)
    assert files(run / "metrics.jsonl") == files(kept[0] / "metrics.jsonl")  # trained again, the same steps


def test_a_run_killed_before_its_first_checkpoint_starts_afresh_with_any_model(tiny, tmp_path):
    """A run stopped while compiling leaves config.yaml and an empty checkpoints/. Before: a
    re-run with another model was refused ('started with another model ... cannot resume') with
    no state to resume, and one with the same model said 'resuming with changed settings'
    before training from step 0; the old config was written over, not kept."""
    run = tmp_path / "run"
    first = tiny("train.steps=4")
    with RunDir.open(run, first) as rd:
        rd.record("", "{}", fresh=True)
    (run / "checkpoints").mkdir()
    old_config = (run / "config.yaml").read_bytes()
    logs = []
    other = tiny("train.steps=2", "model.embedding_dim=4", "model.bottom_mlp=[16, 4]")
    with RunDir.open(run, other, log=logs.append) as rd:
        rd.record("", "{}", fresh=True, log=logs.append)
    assert not any("resuming" in line for line in logs)
    kept = list((run / "earlier").iterdir())
    assert len(kept) == 1 and (kept[0] / "config.yaml").read_bytes() == old_config
    # the line names what it moved (before: 'metrics.jsonl and config', the first never written)
    said = next(line for line in logs if line.endswith(f" moved to {kept[0]}"))
    names = said.split("the earlier run's ")[1].removesuffix(f" moved to {kept[0]}").split(", ")
    assert sorted(names) == sorted(p.name for p in kept[0].iterdir()) and "metrics.jsonl" not in names, said


def test_a_finished_run_whose_metrics_end_in_a_torn_line_says_so(tiny, tmp_path):
    """Before: a bare 'Unterminated string starting at: line 1 column 14', naming no file."""
    run = tmp_path / "run"
    cfg = tiny("train.steps=4", "train.checkpoint_every=2", "train.eval_every=4")
    done = train_and_evaluate(cfg, run, **QUIET)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')
    logs = []
    again = train_and_evaluate(cfg, run, log=logs.append)
    assert (again.step, again.auc) == (done.step, done.auc)
    assert f"warning: {run / 'metrics.jsonl'}:" in "\n".join(logs)
    text = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(["{oops", *text[:-1]]) + "\n")
    with pytest.raises(ValueError, match=f"^{run / 'metrics.jsonl'}:1: not a JSON event"):
        train_and_evaluate(cfg, run, **QUIET)


def test_train_refuses_a_config_that_a_new_run_would_write_over(tmp_path, capsys):
    """Before: `--config myexp/config.yaml --run-dir myexp` replaced the user's commented config
    with the resolved one."""
    from dlrm_jax.cli import main

    mine = tmp_path / "myexp" / "config.yaml"
    mine.parent.mkdir()
    mine.write_text("# my experiment\ntrain:\n  steps: 4\n")
    assert main(["train", "--config", str(mine), "--run-dir", str(mine.parent)]) == 2
    err = capsys.readouterr().err
    assert "is where --run-dir" in err and "keep your config outside the run dir" in err and len(err.splitlines()) == 1
    assert mine.read_text() == "# my experiment\ntrain:\n  steps: 4\n"


def test_an_epochs_run_resumes_only_at_its_batch_size(tiny, tmp_path):
    """Before: resuming 3 epochs at 256 as 4 epochs at 512 said 'run already finished at step
    211' (4 epochs of 512 end at step 141), and the fourth epoch was never trained."""
    run = tmp_path / "run"
    with RunDir.open(run, tiny("train.epochs=3", "train.batch_size=64")) as rd:
        rd.record("", "{}")
    (run / "checkpoints" / "211").mkdir(parents=True)
    with pytest.raises(RunDirError, match=r"counts its epochs in steps of train.batch_size=64: .*batch_size=64"):
        RunDir.open(run, tiny("train.epochs=4", "train.batch_size=128"))
    RunDir.open(run, tiny("train.epochs=4", "train.batch_size=64"), log=lambda *_: None).close()
    RunDir.open(run, tiny("train.batch_size=128"), log=lambda *_: None).close()  # steps, not epochs: free


@pytest.mark.slow  # two short tiered runs and an evaluation
def test_a_tiered_run_resumes_on_a_device_count_where_one_batch_needs_a_whole_part(tiny, tmp_path):
    """On 8 devices an owner holds 9 of cat_3's 70 rows and one batch needs all of them, so the
    planner keeps such a table on the devices. Before: resuming a run that kept it in the tier
    on 1 device was refused ('moving tables between the devices and the tier on restore is not
    supported', naming keys the user never set). The checkpoint's tables stay in the tier, their
    caches holding whole parts."""
    base = [
        "data.cardinalities=[3000, 400, 10000, 70]",
        "train.batch_size=32",
        "embedding.sharding=row",
        "embedding.table_storage=[cat_0=tiered, cat_3=tiered]",
        "embedding.tier.device_cache_fraction=0.03",
        "embedding.tier.host_cache_fraction=0.02",
        "train.checkpoint_every=2",
    ]
    run = tmp_path / "run"
    train_and_evaluate(tiny("train.steps=2", "mesh.devices=1", *base), run, **QUIET)
    logs = []
    done = train_and_evaluate(tiny("train.steps=4", "mesh.devices=8", *base), run, log=logs.append)
    assert "table cat_3: one batch needs 9 of the 9 rows an owner holds; kept in the disk tier" in "\n".join(logs)
    assert "resuming from checkpoint at step 2" in logs and done.step == 4
    assert evaluate_run(run, ["mesh.devices=8"], log=lambda *_: None).auc == done.auc

    # The other way: saved on 8 devices with cat_3 on them, resumed (and evaluated) on 1, where
    # the planner would put it in the tier, was refused in the same words; it stays on the devices.
    other = tmp_path / "other"
    train_and_evaluate(tiny("train.steps=2", "mesh.devices=8", *base), other, **QUIET)
    logs = []
    done = train_and_evaluate(tiny("train.steps=4", "mesh.devices=1", *base), other, log=logs.append)
    assert "table cat_3: kept on the devices, as the checkpoint being restored has it" in logs and done.step == 4
    assert evaluate_run(other, ["mesh.devices=1"], log=lambda *_: None).auc == done.auc


def test_a_run_dirs_config_that_is_not_yaml_is_one_line(tiny, tmp_path):
    """Before: train printed YAML's five-line error with a ^ marker (eval gave one line)."""
    run = tmp_path / "run"
    (run / "checkpoints" / "4").mkdir(parents=True)
    (run / "config.yaml").write_text("train: [\n")
    with pytest.raises(RunDirError) as e:
        RunDir.open(run, tiny())
    said = str(e.value)
    assert "\n" not in said and said.startswith(f"config file {run / 'config.yaml'}:2: cannot be read as YAML")
    assert said.endswith("; use another run_dir")


def test_a_saved_end_without_its_recorded_evaluation_is_evaluated_and_recorded(tiny, tmp_path):
    """Before: the re-run printed a final evaluation that metrics.jsonl never got (every re-run
    scored again), and a run whose newest checkpoint lay past a lowered train.steps printed it
    as its 'final step', beside a best worse than it."""
    run = tmp_path / "run"
    cfg = tiny("train.steps=6", "train.checkpoint_every=2", "train.eval_every=2", "train.log_every=2")
    done = train_and_evaluate(cfg, run, **QUIET)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] < 6))
    again = train_and_evaluate(cfg, run, **QUIET)
    assert (again.step, again.auc, again.best.step) == (6, done.auc, done.best.step)
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert (last["event"], last["step"], last["auc"], last["best_step"]) == ("eval", 6, done.auc, done.best.step)
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] < 6))
    with pytest.raises(RunDirError, match=r"holds a checkpoint at step 6, past train.steps=4: nothing to train"):
        train_and_evaluate(tiny("train.steps=4", "train.checkpoint_every=2", "train.eval_every=2"), run, **QUIET)


def test_raising_the_steps_of_a_decaying_run_says_its_rates_part_from_a_longer_runs(tiny, tmp_path):
    """Before: a 12-step run with train.decay_steps=4 decayed its rate over steps 9-12; raised
    to 20 it went back to the full rate, and ended at AUC 0.5676 where 20 steps from the start
    gave 0.5687, with only 'resuming with changed settings: train.steps 12 -> 20'. A run whose
    decay had not begun at its stop equals the longer run, and says nothing."""
    from dlrm_jax.train.optimizer_setup import decay_moved

    run = tmp_path / "run"
    train_and_evaluate(tiny("train.steps=12", "train.decay_steps=4", "train.checkpoint_every=4"), run, **QUIET)
    logs = []
    train_and_evaluate(tiny("train.steps=20", "train.decay_steps=4", "train.checkpoint_every=4"), run, log=logs.append)
    warned = [line for line in logs if line.startswith("warning: train.steps 12 -> 20 moves the learning rate's decay")]
    assert len(warned) == 1 and "steps 10-12 trained at the rates of a 12-step run" in warned[0], logs
    assert warned[0].endswith("it will not equal a run of 20 steps from the start")
    short, long = tiny("train.steps=12", "train.decay_steps=4"), tiny("train.steps=20", "train.decay_steps=4")
    assert decay_moved(short, long, 8) == ""  # the decay had not begun: the same rates so far
    assert decay_moved(tiny("train.steps=12"), tiny("train.steps=20"), 12) == ""  # no decay


def test_a_saved_end_evaluated_on_a_rerun_gives_the_loss_of_its_last_window(tiny, tmp_path):
    """Before: a run stopped by a signal at step N (its window logged) and re-run with
    train.steps=N evaluated and printed 'final step=N loss=nan' (metrics.jsonl: "loss": null),
    though the window that ended at N was in the file."""
    run = tmp_path / "run"
    cfg = tiny("train.steps=6", "train.checkpoint_every=2", "train.eval_every=2", "train.log_every=2")
    done = train_and_evaluate(cfg, run, **QUIET)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    end = lines[-1]  # as a stop at step 6 logs it: its window, no evaluation
    stopped = {"event": "train", "step": 6, "loss": end["loss"], "samples_per_s": end["samples_per_s"]}
    (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [*lines[:-1], stopped]))
    again = train_and_evaluate(cfg, run, **QUIET)
    assert again.loss == done.loss == end["loss"]
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["loss"] == end["loss"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (orbax's abandoned reads)
def test_a_checkpoint_whose_chunks_do_not_decode_is_one_clean_line(tiny, tmp_path, capfd):
    """Before: eval --step of a checkpoint whose compressed chunks do not decode ended its line
    with 'See full TensorStore details: <bound method pybind11_detail_function_record...', and
    eval of the newest printed orbax's abandoned reads, 60 lines each ('Exception ignored in:
    <coroutine object _read_array_index_and_device_put>'), after its result."""
    from dlrm_jax import stopping

    run = tmp_path / "run"
    train_and_evaluate(tiny("train.steps=4", "train.checkpoint_every=2"), run, **QUIET)
    for f in (run / "checkpoints" / "4" / "state").glob("ocdbt.process_0/d/*"):
        data = bytearray(f.read_bytes())
        data[:64] = bytes(b ^ 0xFF for b in data[:64])
        f.write_bytes(data)
    with pytest.raises(ValueError, match="the checkpoint at step 4 is damaged") as e:
        evaluate_run(run, step=4, **QUIET)
    assert "TensorStore details" not in str(e.value) and "bound method" not in str(e.value), e.value
    assert evaluate_run(run, **QUIET).step == 2
    # A read abandoned so, as Python reports it when the coroutine is collected (in 2 of 6
    # runs), goes with asyncio's reports to the run dir's log under the command line's hooks.
    import asyncio
    import logging
    import sys
    import types

    async def read():
        pass

    abandoned, records = read(), []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("asyncio").addHandler(handler)
    restore = stopping.stop_on_signals()
    try:
        failure = Exception("Encountered error while reading array index")
        args = types.SimpleNamespace(exc_type=Exception, exc_value=failure, exc_traceback=None, err_msg=None)
        sys.unraisablehook(types.SimpleNamespace(**vars(args), object=abandoned))
    finally:
        restore()
        logging.getLogger("asyncio").removeHandler(handler)
        abandoned.close()
    assert "Exception ignored" not in capfd.readouterr().err and len(records) == 1
    assert asyncio.iscoroutine(abandoned)
