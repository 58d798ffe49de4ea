"""What a user meets first, one line each (issue 45's small items): the resolved config, hints
for near misses, a help text for every flag, readable sizes and differences, a note when the
batch is large for the data."""

import argparse

import pytest
import yaml

from dlrm_jax.cli import build_parser, main
from dlrm_jax.config import ConfigError, config_from_dict, load_config


def test_config_prints_the_resolved_config_and_the_keys_that_differ(capsys):
    assert main(["config", "--config", "smoke", "--set", "train.steps=7"]) == 0
    out = capsys.readouterr().out
    first, second, *_ = out.splitlines()
    assert first == "# dlrm-jax config of smoke --set train.steps=7"
    assert second.startswith("# differs from the default in: train.steps, train.batch_size, ")
    assert config_from_dict(yaml.safe_load(out)) == load_config("smoke", ["train.steps=7"])


def test_near_misses_get_the_key_or_value_meant(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key train\.stepz \(did you mean train\.steps\?\)"):
        load_config(None, ["train.stepz=3"])
    (tmp_path / "c.yaml").write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"config file .*c\.yaml: unknown config key train\.stepz \(did you mean"):
        load_config(tmp_path / "c.yaml")
    with pytest.raises(
        ConfigError, match=r"'dcnv2' is not one of dlrm, wide_deep; dcn is a value of model\.interaction"
    ):
        load_config(None, ["model.kind=dcnv2"])
    assert load_config(None, ["model.bottom_mlp=64,32,16"]).model.bottom_mlp == (64, 32, 16)  # as [64,32,16]


def test_advice_names_the_flags_in_a_command_and_the_arguments_in_python(capsys):
    """The same refusal in each caller's words (dlrm_jax/wording.py): the command's --set and its
    hint, the Python API's override (before: a notebook was told to pass flags)."""
    assert main(["config", "--config", "smoke", "--set", "train.steps", "--set", "model.kind=dcnv2"]) == 2
    assert "config error: --set 'train.steps': expected KEY=VALUE" in capsys.readouterr().err
    assert main(["config", "--config", "smoke", "--set", "model.kind=dcnv2"]) == 2
    assert "dcn is a value of model.interaction: --set model.interaction=dcn" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"^override 'train.steps': expected KEY=VALUE"):
        load_config("smoke", ["train.steps"])
    with pytest.raises(
        ConfigError, match=r"dcn is a value of model\.interaction: the override 'model\.interaction=dcn'"
    ):
        load_config("smoke", ["model.kind=dcnv2"])


def test_every_flag_of_every_command_says_what_it_does():
    missing = []

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])
            elif action.help is None and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                missing.append(f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), ["dlrm-jax"])
    assert not missing, missing


def test_every_flag_with_a_default_shows_it_in_help():
    """docs/cli.md: --help lists the flags with their defaults. Before: 30 flags did not (bench
    train's --steps 30, export's --tables float32, preprocess's --block-mb 64, ...)."""
    silent = []

    def walk(parser, path):
        helper = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])
            elif action.option_strings and action.default not in (None, False, argparse.SUPPRESS, [], ""):
                if "default" not in helper._expand_help(action) and path != ["dlrm-jax"]:
                    silent.append(f"{' '.join(path)} {'/'.join(action.option_strings)}")

    walk(build_parser(), ["dlrm-jax"])
    assert not silent, silent


def test_sizes_and_config_differences_read_as_a_person_would_write_them():
    from dlrm_jax.train.rundir import describe_changes

    old, new = [1460, 583, 10131227, 2202608, 305, 24], [1460, 583, 40000, 40000, 305, 24]
    assert describe_changes([("data.cardinalities", old, new), ("model.embedding_dim", 16, 8)]) == (
        "data.cardinalities[2], [3] of 6: 10131227 -> 40000, 2202608 -> 40000; model.embedding_dim 16 -> 8"
    )
    from dlrm_jax.embedding.plan.stats import fmt_bytes

    assert fmt_bytes(22_528) == "22.0 KiB"  # the budget error said "0.00 GiB needed"


def test_a_batch_large_for_the_data_is_said_with_a_smaller_one():
    from types import SimpleNamespace

    from dlrm_jax.train.trainer import epoch_note

    cfg = load_config(None, ["train.batch_size=2048"])
    note = epoch_note(cfg, SimpleNamespace(num_train=8_000))
    assert "3.9 steps of 2,048 an epoch" in note and "e.g. train.batch_size=64: 125 steps" in note
    assert "note:" not in epoch_note(load_config(None, ["train.batch_size=64"]), SimpleNamespace(num_train=8_000))


def test_progress_bars_stay_out_of_redirected_logs(capsys):
    """preprocess and predict drew tqdm frames into logs; train already printed plain lines."""
    from dlrm_jax.data.preprocessing.preprocess import byte_progress

    with byte_progress([__file__], "predict", progress=True) as bar:  # stderr is captured: not a terminal
        bar.update(10)
    assert bar.disable and capsys.readouterr().err == ""


def test_a_config_changed_in_code_is_checked_when_it_trains(tiny, tmp_path):
    """Before: dataclasses.replace(cfg.train, steps=-5) trained to 'final step=0 loss=nan',
    leaving a run dir whose config.yaml said steps: -5."""
    import dataclasses

    import pytest

    from dlrm_jax.config import ConfigError
    from dlrm_jax.train.trainer import train_and_evaluate

    cfg = tiny()
    bad = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=-5))
    with pytest.raises(ConfigError, match="train.steps: must be > 0, got -5"):
        train_and_evaluate(bad, tmp_path / "run", log=lambda *_: None)
    assert not (tmp_path / "run").exists()


def test_a_full_disk_under_the_library_log_prints_no_tracebacks(tmp_path, capsys):
    """Before: each library message that could not be written to RUN/dlrm-jax.log printed
    '--- Logging error ---' and a traceback (512-783 lines over one failed checkpoint)."""
    import errno
    import logging

    from dlrm_jax.train.library_log import RunDirLog

    class Full:
        def write(self, _):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

    handler = RunDirLog(tmp_path / "dlrm-jax.log")
    handler.stream = Full()
    handler.emit(logging.LogRecord("orbax", logging.ERROR, __file__, 1, "write failed", None, None))
    assert capsys.readouterr().err == ""


def test_a_failed_background_save_names_its_step(tmp_path, monkeypatch):
    """Before: 'could not write the checkpoint in ...: no space left on device', no step."""
    import errno

    import jax
    import numpy as np
    import pytest
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from dlrm_jax.train.checkpoint import Checkpoints, CheckpointWriteError

    on_mesh = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("d",)), PartitionSpec())
    ckpts = Checkpoints(tmp_path / "checkpoints", 3)
    ckpts.save(30, {"w": jax.device_put(np.zeros(4, np.float32), on_mesh)}, "{}")
    ckpts._manager.wait_until_finished()

    def full():
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpts._manager, "wait_until_finished", full)
    with pytest.raises(CheckpointWriteError, match=r"could not write the checkpoint at step 30 in .*no space left"):
        ckpts.wait()

    def too_large():  # (a file size limit or a quota: tensorstore's text, named no remedy and no step)
        raise ValueError("OUT_OF_RANGE: Error writing ...: File too large [os_error_code='27']")

    ckpts._saving = 30
    monkeypatch.setattr(ckpts._manager, "wait_until_finished", too_large)
    with pytest.raises(
        CheckpointWriteError, match=r"could not write the checkpoint at step 30 in .*: File too large; "
    ):
        ckpts.wait()
    # The run dir moved away while the run trained: its checkpoints are not "intact" at the old
    # path (before: 'older checkpoints intact (steps [30])', which had gone with it).
    (tmp_path / "checkpoints").rename(tmp_path / "moved")
    ckpts._saving = 40
    with pytest.raises(CheckpointWriteError, match=r"; the checkpoints folder is gone \(moved or removed"):
        ckpts.wait()


def test_a_checkpoint_folder_that_cannot_be_made_fails_the_save_at_once(tmp_path, monkeypatch):
    """Before: orbax made a save's folders in the background; when that failed (a full disk, no
    inodes left), its other writer threads waited 5 minutes for the folders' signal, and the
    process could not exit until then (then printed their stacks)."""
    import errno
    import threading
    import time

    import jax
    import numpy as np
    import pytest
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from orbax.checkpoint._src.path import async_path

    from dlrm_jax.train.checkpoint import Checkpoints, CheckpointWriteError

    on_mesh = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("d",)), PartitionSpec())
    ckpts = Checkpoints(tmp_path / "checkpoints", 3)
    before = set(threading.enumerate())

    async def no_inodes_left(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(async_path, "mkdir", no_inodes_left)
    with pytest.raises(CheckpointWriteError, match=r"could not write the checkpoint at step 30 in .*no space left"):
        ckpts.save(30, {"w": jax.device_put(np.zeros(4, np.float32), on_mesh)}, "{}")
        ckpts.wait()
    deadline = time.monotonic() + 10
    while (waiting := [t.name for t in set(threading.enumerate()) - before if not t.daemon and t.is_alive()]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert not waiting, waiting  # (orbax's writers still waiting: the process cannot exit)


def test_more_devices_than_the_machine_gives_is_a_config_error():
    """Before: a ValueError, exit status 1 where every refused key exits 2."""
    import pytest

    from dlrm_jax.config import ConfigError
    from dlrm_jax.parallel.mesh import check_available

    with pytest.raises(ConfigError, match="mesh.devices=128: at most 64 simulated CPU devices"):
        check_available(128, 8, "cpu")
    with pytest.raises(ConfigError, match="mesh.devices=16 but only 8 gpu devices are available"):
        check_available(16, 8, "gpu")
    # a count the user's XLA_FLAGS set, which request_cpu_devices leaves: named (its advice was in vain)
    import os

    with pytest.MonkeyPatch.context() as m:
        m.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
        with pytest.raises(ConfigError, match="XLA_FLAGS sets --xla_force_host_platform_device_count=2, which"):
            check_available(8, 2, "cpu")
    assert "count=2" not in os.environ.get("XLA_FLAGS", "")


def test_the_plan_of_one_device_says_nothing_crosses_devices(capsys):
    """Before: 'Pooled-exchange bound ...: 0 B (predicted / bound: 0.00)', a ratio of 0 to 0."""
    from dlrm_jax.cli import main

    assert main(["plan", "--config", "smoke", "--set", "mesh.devices=1"]) == 0
    out = capsys.readouterr().out
    assert "Pooled-exchange bound (no dedup) per step per device: 0 B (nothing crosses devices)" in out, out


def test_plan_runs_trains_checks_of_the_process_split(capsys):
    """Before: `plan` took no --num-processes, so a mesh that two processes cannot split, or
    per-host tables over a run's processes, were planned as if one process ran them."""
    from dlrm_jax.cli import main

    assert main(["plan", "--config", "smoke", "--set", "mesh.devices=8", "--num-processes", "3"]) == 2
    assert "mesh.devices=8 must be a multiple of the 3 processes" in capsys.readouterr().err
    per_host = ["--set", "mesh.devices=8", "--set", "embedding.sync=per_host"]
    assert main(["plan", "--config", "smoke", *per_host, "--num-processes", "2"]) == 0
    assert "the plan of one host's 4 devices (mesh.hosts=2;" in capsys.readouterr().out
