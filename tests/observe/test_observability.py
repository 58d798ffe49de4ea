"""TensorBoard events and `dlrm-jax report` plots carry exactly what metrics.jsonl holds."""

import dataclasses
import json
import os
import re
import struct

import pytest

from dlrm_jax.observe.metrics import tensorboard_tag
from dlrm_jax.train.trainer import train_and_evaluate
from tests.child_env import child_env
from tests.helpers import QUIET, REPO


def read_scalars(folder) -> dict[tuple[str, int], float]:
    """(tag, step) -> value over every event file in ``folder``, later files winning (a resumed
    run's file is newer); records are TFRecord framed: length, crc, Event proto, crc."""
    from tensorboardX.proto.event_pb2 import Event

    scalars = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for v in event.summary.value:
                scalars[v.tag, event.step] = v.simple_value
    return scalars


@pytest.mark.slow
def test_tensorboard_scalars_match_metrics_jsonl_across_a_resume(tiny, tmp_path):
    overrides = [
        "mesh.devices=2",
        "train.log_every=1",
        "train.eval_every=3",
        "train.checkpoint_every=3",
        "train.tensorboard=true",
        "embedding.sharding=row",
    ]
    train_and_evaluate(tiny(*overrides, "train.steps=3"), tmp_path, **QUIET)
    train_and_evaluate(tiny(*overrides, "train.steps=6"), tmp_path, **QUIET)
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scalars = read_scalars(tmp_path / "tensorboard")
    expected = {
        (tensorboard_tag(k), e["step"]): v
        for e in events
        for k, v in e.items()
        if k not in ("step", "event", "wall_s") and isinstance(v, int | float)
    }
    assert {
        "train/loss",
        "train/samples_per_s",
        "eval/auc",
        "eval/logloss",
        "exchange/a2a_bytes",
        "exchange/exchange_overflows",
    } <= {tag for tag, _ in expected}
    assert set(scalars) == set(expected)
    for key, value in expected.items():
        assert scalars[key] == pytest.approx(value, rel=1e-6), key
    assert sorted({s for t, s in scalars if t == "eval/auc"}) == [3, 6]


@pytest.mark.slow  # 6-10 s on 2 cores
def test_no_tensorboard_folder_unless_asked(tiny, tmp_path):
    train_and_evaluate(tiny("train.steps=2"), tmp_path, **QUIET)
    assert (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tensorboard").exists()


def fake_run(path, losses, rate, profile=None):
    path.mkdir()
    events = []
    for i, loss in enumerate(losses, 1):
        events.append({"event": "train", "step": 10 * i, "loss": loss, "samples_per_s": rate, "wall_s": 1.5 * i})
        if i % 2 == 0:
            events.append({**events[-1], "event": "eval", "auc": 0.6 + 0.01 * i, "logloss": loss - 0.05})
    (path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if profile:
        (path / "profile.json").write_text(json.dumps({"phases": [{"name": n, "ms": ms} for n, ms in profile]}))
    return events


def test_report_draws_every_runs_metrics_on_shared_axes(tmp_path):
    from PIL import Image

    from dlrm_jax.cli import main
    from dlrm_jax.observe.report import figures

    a = fake_run(tmp_path / "a", [0.7, 0.6, 0.55, 0.52], 1000.0, [("input pipeline", 1.0), ("dense", 4.0)])
    b = fake_run(tmp_path / "b", [0.69, 0.58, 0.5], 2000.0, [("dense", 2.5), ("gradient all-reduce", 0.5)])
    figs = figures([tmp_path / "a", tmp_path / "b"])
    assert set(figs) == {"loss", "eval", "throughput", "phases"}  # no divergence data: no figure
    for events, index in ((a, 0), (b, 1)):
        train = [e for e in events if e["event"] == "train"]
        evals = [e for e in events if e["event"] == "eval"]
        by_step, by_wall = (ax.lines[index].get_xydata().tolist() for ax in figs["loss"].axes)
        assert by_step == [[e["step"], e["loss"]] for e in train]
        assert by_wall == [[e["wall_s"], e["loss"]] for e in train]
        auc_lines = figs["eval"].axes[0].lines  # per run: its curve, then a star on its best evaluation
        assert auc_lines[2 * index].get_xydata().tolist() == [[e["step"], e["auc"]] for e in evals]
        best = max(evals, key=lambda e: e["auc"])
        assert auc_lines[2 * index + 1].get_xydata().tolist() == [[best["step"], best["auc"]]]
        assert [line.get_label() for line in figs["loss"].axes[0].lines] == ["a", "b"]
    assert all(ax.get_visible() and ax.get_legend() is not None for ax in figs["eval"].axes)  # no empty panel
    stars = [line.get_label() for line in figs["eval"].axes[2].lines[1::2]]  # the wall-time panel's
    assert all(label.endswith(" s)") and "wall_s" not in label for label in stars), stars
    assert figs["throughput"].axes[0].get_ylim()[0] == 0 and figs["throughput"].axes[0].get_ylabel() == "samples/s"
    bars = figs["phases"].axes[0].containers
    assert [[r.get_width() for r in c] for c in bars] == [[1.0, 4.0, 0.0], [0.0, 2.5, 0.5]]

    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--output", str(tmp_path / "png")]) == 0
    for name in ("loss", "eval", "throughput", "phases"):
        with Image.open(tmp_path / "png" / f"{name}.png") as im:
            assert im.format == "PNG" and im.size[0] > 500


def test_report_names_a_bad_metrics_line(tmp_path, capsys):
    from dlrm_jax.cli import main

    fake_run(tmp_path / "a", [0.7], 1.0)
    with open(tmp_path / "a" / "metrics.jsonl", "a") as f:
        f.write("{not json\n")
    assert main(["report", str(tmp_path / "a")]) == 1
    assert f"{tmp_path / 'a' / 'metrics.jsonl'}:2: not a JSON object" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing")]) == 1
    assert "is " + str(tmp_path / "missing") + " a run directory" in capsys.readouterr().err
    # one run given twice (plotted twice under one label, before); a run dir that cannot be written
    fake_run(tmp_path / "b", [0.7], 1.0)
    assert main(["report", str(tmp_path / "b"), f"{tmp_path}/./b"]) == 1
    assert f"{tmp_path}/./b: given twice ({tmp_path / 'b'} is the same run dir)" in capsys.readouterr().err
    writable = os.access
    with pytest.MonkeyPatch.context() as m:
        m.setattr(os, "access", lambda p, mode: os.fspath(p) != str(tmp_path / "b") and writable(p, mode))
        assert main(["report", str(tmp_path / "b")]) == 1
    assert (
        "cannot be written to (a read-only run dir?); give the plots a folder: --output DIR" in capsys.readouterr().err
    )


@pytest.mark.slow
def test_profile_prints_phases_writes_a_trace_and_report_draws_them(tmp_path):
    import subprocess
    import sys

    env = child_env()
    run = tmp_path / "prof"
    (run / "profile-trace" / "process_0").mkdir(parents=True)  # a last profile's trace, replaced
    (run / "profile-trace" / "process_0" / "last.xplane.pb").write_text("last")
    (run / "profile-trace" / "process_0.partial").mkdir()  # one a stopped profile left
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dlrm_jax",
            "profile",
            "--config",
            "smoke",
            "--set",
            "mesh.devices=2",
            "--set",
            "embedding.sharding=row",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--run-dir",
            str(run),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    profile = json.loads((run / "profile.json").read_text())
    ms = {p["name"]: p["ms"] for p in profile["phases"]}
    # Synthetic batches are made on the devices, as training makes them: no host phase (before,
    # the profile read them on the host and said they cost 47% of the step, which training never pays).
    assert "input pipeline" not in ms and "host->device" not in ms
    for phase in (
        "batches made",
        "exchange forward",
        "dense forward+backward",
        "gradient all-reduce",
        "exchange backward",
        "sparse update",
        "dense optimizer",
    ):
        assert ms[phase] > 0, phase
        assert any(line.startswith(phase) for line in proc.stdout.splitlines()), proc.stdout
    # The device phases are per-device means of events inside the blocking step: together about
    # its wall time, not twice it (containers such as while loops are not counted twice). The
    # simulated devices share two cores with the other test worker, so the means wander by tens
    # of percent around it (1.51x once in a full suite run, 2026-12-04).
    device = sum(p["ms"] for p in profile["phases"] if p["how"] == "trace")
    assert 0 < device < 2 * profile["step_wall_ms"]
    assert profile["memory_per_device"]["peak"] > 0 and "per-device memory" in proc.stdout
    trace = run / "profile-trace" / "process_0"
    assert list(trace.glob("**/*.xplane.pb")) and list(trace.glob("**/*.trace.json.gz"))
    assert not (trace / "last.xplane.pb").exists() and sorted(p.name for p in trace.parent.iterdir()) == ["process_0"]
    # The trace line says how to get what reads it: the project's tensorboard extra, which has both.
    assert "pip install 'dlrm-jax[tensorboard]'" in proc.stdout
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {re.split("[<>=~ ]", r)[0] for r in extras["tensorboard"]} == {"tensorboard", "tensorboard-plugin-profile"}

    from dlrm_jax.observe.report import figures

    fake_run(tmp_path / "prof_metrics", [0.7], 1.0)
    (tmp_path / "prof_metrics" / "profile.json").write_text((run / "profile.json").read_text())
    bars = figures([tmp_path / "prof_metrics"])["phases"].axes[0].containers[0]
    assert [r.get_width() for r in bars] == [p["ms"] for p in profile["phases"]]


def test_every_instruction_of_the_step_gets_its_phase(tiny):
    from dlrm_jax.data.sources import make_source, resolve_data_config
    from dlrm_jax.observe.trace import instruction_phases
    from dlrm_jax.parallel.mesh import make_mesh
    from dlrm_jax.train.build import build

    cfg = resolve_data_config(tiny("mesh.devices=4", "embedding.sharding=row"))
    source = make_source(cfg)
    _, fns = build(cfg, make_mesh(4), source, log=lambda *_: None)
    hlo = fns.train_step.lower(fns.init_state(), fns.device_batch(source.train_batch(0))).compile().as_text()
    phases = instruction_phases(hlo)
    by_phase = {}
    for name, phase in phases.items():
        by_phase.setdefault(phase, []).append(name)
    assert {
        "exchange forward",
        "dense forward+backward",
        "gradient all-reduce",
        "exchange backward",
        "sparse update",
        "dense optimizer",
    } <= set(by_phase)
    assert all(n.startswith("all-reduce") for n in by_phase["gradient all-reduce"])
    assert any(n.startswith("all-to-all") for n in by_phase["exchange backward"])
    assert any(n.startswith("all-to-all") for n in by_phase["exchange forward"])


@pytest.mark.slow
def test_profile_runs_tiered_tables_as_training_does(tiny, tmp_path):
    """Tiered tables (with hot rows refreshed inside the profiled steps, which must release the
    planner thread): the device caches' fill is a traced phase and the dispatching thread's
    tier work has rows of its own. Profiled into a tiered training run's dir (as `profile
    --help` suggests, for the report), it leaves every file of the run as it was: before, it
    restored the initial tables over the run's disk tier (its snapshots gone: the run could
    neither resume nor be evaluated) and replaced its train.trace_steps trace."""
    from dlrm_jax.bench.profile import profile

    lines = []
    cfg = tiny(
        "mesh.devices=2",
        "embedding.sharding=row",
        "embedding.table_storage=[cat_0=tiered, cat_2=tiered]",
        "embedding.tier.device_cache_fraction=0.05",
        "embedding.tier.host_cache_fraction=0.05",
        "embedding.tier.lookahead=2",
        "embedding.hot.rows=16",
        "embedding.hot.refresh_every=2",
        "embedding.hot.stats_batches=2",
    )
    run = tmp_path / "run"
    train_and_evaluate(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, trace_steps=1)), run, **QUIET)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "dlrm-jax.log"}
    assert any("/trace/" in str(p) for p in before) and any("/tier/snapshots/" in str(p) for p in before)
    result = profile(cfg, run, steps=4, warmup=1, log=lines.append)
    ms = {p["name"]: p["ms"] for p in result["phases"]}
    assert result["tiered"] and ms["cache fill"] > 0 and ms["exchange forward"] > 0
    assert ms["input pipeline"] > 0 and "batches made" not in ms  # tiered tables read on the host
    assert {"tier planner wait", "tier fill assembly + h2d", "tier write-back"} <= set(ms)
    assert ms["tier fill assembly + h2d"] > 0
    assert any(line.startswith("tier write-back") for line in lines) and "tier rows" in "\n".join(lines)
    assert {p: p.read_bytes() for p in before} == before  # the run's files, every byte
    made = {p.relative_to(run).parts[0] for p in run.rglob("*") if p.is_file() and p not in before}
    assert made <= {"profile.json", "profile-trace", "dlrm-jax.log"}, made  # the profile's tier removed


@pytest.mark.slow
def test_a_profile_that_fails_or_stops_leaves_the_last_profile_as_it_was(tiny, tmp_path, monkeypatch):
    """Before: the last profile's trace was deleted before the steps ran, so a profile stopped
    (or failing) in them left profile.json naming a trace that was gone."""
    from dlrm_jax.bench import profile as module

    run = tmp_path / "run"
    cfg = tiny("mesh.devices=2")
    module.profile(cfg, run, steps=2, warmup=1, log=lambda *_: None)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert any("profile-trace/process_0/" in str(p) for p in before)

    def fails(*args):
        raise RuntimeError("the trace could not be read")

    monkeypatch.setattr(module, "device_phase_ns", fails)
    with pytest.raises(RuntimeError, match="could not be read"):
        module.profile(cfg, run, steps=2, warmup=1, log=lambda *_: None)
    assert {p: p.read_bytes() for p in before} == before
    assert {p for p in run.rglob("*") if p.is_file() and "/process_0.partial/" not in str(p)} == set(before)


def test_a_stop_during_a_profile_waits_for_the_step_under_way(tiny, tmp_path, monkeypatch):
    """Before: a Ctrl-C inside the traced steps left the process hung for good in the
    profiler's stop (only SIGKILL ended it), and one while it compiled crashed the exit
    (rc 139). The stop is kept until a step boundary outside the trace, then ends with 130."""
    import os
    import signal
    import time

    from dlrm_jax.cli import main
    from dlrm_jax.cli.commands import profile as command

    done = []

    def profiling(cfg, run_dir, **kw):
        os.kill(os.getpid(), signal.SIGINT)  # in the traced steps, say
        time.sleep(0.2)
        done.append(True)

    monkeypatch.setattr(command, "start_jax", lambda *a: None)
    monkeypatch.setattr(command, "library_logs_to", lambda *a: None)
    monkeypatch.setattr("dlrm_jax.bench.profile.profile", profiling)
    assert main(["profile", "--config", "smoke", "--run-dir", str(tmp_path / "p")]) == 128 + signal.SIGINT
    assert done == [True]


def test_profile_of_a_run_dir_profiles_its_config_unless_told(tiny, tmp_path, monkeypatch):
    """Before: `profile --run-dir RUN` profiled the default config, whose phase bars the report
    then drew beside RUN's metrics as if they were its model's."""
    from dlrm_jax.cli import main
    from dlrm_jax.cli.commands import profile as command
    from dlrm_jax.config import dump_config

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(dump_config(tiny("model.embedding_dim=4", "model.bottom_mlp=[16,4]")))
    got = []
    monkeypatch.setattr(command, "start_jax", lambda *a: None)
    monkeypatch.setattr(command, "library_logs_to", lambda *a: None)
    monkeypatch.setattr("dlrm_jax.bench.profile.profile", lambda cfg, run_dir, **kw: got.append(cfg))
    assert main(["profile", "--run-dir", str(tmp_path / "run"), "--set", "train.steps=7"]) == 0
    assert got[-1].model.embedding_dim == 4 and got[-1].train.steps == 7
    assert main(["profile", "--run-dir", str(tmp_path / "run"), "--config", "smoke"]) == 0
    assert got[-1].model.embedding_dim != 4


@pytest.mark.parametrize(
    "text,message",
    [
        ("", "metrics.jsonl is empty: the run logged no events yet"),
        ("\n  \n", "metrics.jsonl is empty"),
        ('{"step": 1, "loss": 0.5}\n3\n', "metrics.jsonl:2: not a JSON object (got 3)"),
    ],
)
def test_report_refuses_a_metrics_file_with_nothing_to_plot(tmp_path, capsys, text, message):
    """Before its fix: an empty metrics.jsonl gave rc 0, no PNG and no word."""
    from dlrm_jax.cli import main

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text(text)
    assert main(["report", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err
    assert message in err and str(tmp_path / "a") in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "a" / "report").exists()


def test_report_of_events_without_plottable_keys_says_so(tmp_path, capsys):
    from dlrm_jax.cli import main

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text('{"event": "note"}\n')
    assert main(["report", str(tmp_path / "a")]) == 1
    assert "nothing to plot" in capsys.readouterr().err


def test_report_folder_that_is_a_file_is_named(tmp_path, capsys):
    from dlrm_jax.cli import main

    fake_run(tmp_path / "a", [0.7], 1.0)
    (tmp_path / "f").write_text("x")
    assert main(["report", str(tmp_path / "a"), "--output", str(tmp_path / "f")]) == 1
    assert f"report folder {tmp_path / 'f'} is a file, not a directory" in capsys.readouterr().err


def test_report_of_a_profile_only_run_draws_its_phases(tmp_path):
    from dlrm_jax.observe.report import write_report

    (tmp_path / "a").mkdir()  # what `dlrm-jax profile --run-dir` writes: no metrics.jsonl
    (tmp_path / "a" / "profile.json").write_text(json.dumps({"phases": [{"name": "dense", "ms": 1.0}]}))
    assert [p.name for p in write_report([tmp_path / "a"], tmp_path / "out")] == ["phases.png"]


def test_runs_of_other_batch_sizes_compare_by_samples_and_each_gets_a_summary(tmp_path, capsys):
    from dlrm_jax.cli import main
    from dlrm_jax.observe.report import figures

    for name, batch in (("a", 128), ("b", 512)):
        fake_run(tmp_path / name, [0.7, 0.6, 0.55], 1000.0)
        (tmp_path / name / "config.yaml").write_text(f"train:\n  batch_size: {batch}\n")
    figs = figures([tmp_path / "a", tmp_path / "b"])
    steps = [
        e["step"]
        for e in map(json.loads, (tmp_path / "a" / "metrics.jsonl").read_text().splitlines())
        if e["event"] == "train"
    ]
    assert figs["loss"].axes[0].get_xlabel() == "samples seen"
    assert [x for x, _ in figs["loss"].axes[0].lines[1].get_xydata()] == [512 * s for s in steps]
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--output", str(tmp_path / "png")]) == 0
    out = capsys.readouterr().out
    assert "a: best AUC 0.6" in out and "b: best AUC 0.6" in out and "samples/s over" in out


def test_summary_gives_the_mean_progressive_auc_of_the_last_half_of_the_windows(tmp_path):
    from dlrm_jax.observe.report import load_run, summary

    fake_run(tmp_path / "a", [0.7, 0.6], 1000.0)
    windows = [
        {"event": "progressive", "step": 10 * w, "window": w, "progressive_auc": a}
        for w, a in ((1, 0.6), (2, 0.7), (3, 0.8))
    ]
    with (tmp_path / "a" / "metrics.jsonl").open("a") as f:
        f.write("".join(json.dumps(e) + "\n" for e in windows))
    assert "progressive AUC 0.7500 (mean of the last 2 of 3 windows)" in summary(load_run(tmp_path / "a"), "a")


def test_the_report_of_progressive_windows_of_one_class_leaves_them_out(tmp_path, capsys):
    """Before: a window whose labels were all one class (its AUC null) crashed the report after
    it drew the plots: TypeError: unsupported operand type(s) for +: 'int' and 'NoneType'."""
    from dlrm_jax.cli import main

    fake_run(tmp_path / "a", [0.7, 0.6], 1000.0)
    windows = [
        {"event": "progressive", "step": 10 * w, "window": w, "progressive_auc": a}
        for w, a in ((1, 0.6), (2, None), (3, 0.8), (4, None))
    ]
    with (tmp_path / "a" / "metrics.jsonl").open("a") as f:
        f.write("".join(json.dumps(e) + "\n" for e in windows))
    assert main(["report", str(tmp_path / "a"), "--output", str(tmp_path / "png")]) == 0
    out = capsys.readouterr().out
    assert "progressive AUC 0.8000 (mean of the last 2 of 4 windows; 1 without an AUC, of one class only)" in out


def test_the_report_line_gives_the_median_of_an_even_number_of_windows():
    from dlrm_jax.observe.report import summary

    events = [{"samples_per_s": r} for r in (5_599.0, 1_795.0)]
    assert "median 3,697 samples/s over 2 windows" in summary({"events": events}, "run")
    # before: "run: no evaluation with an AUC median 5,599 samples/s over 1 windows"
    assert (
        summary({"events": events[:1]}, "run") == "run: no evaluation with an AUC; median 5,599 samples/s over 1 window"
    )


def test_report_reads_what_real_runs_write_null_metrics_a_cut_last_line_a_changed_batch(tmp_path, capsys):
    """Before: an AUC written as null (one class in the held-out batches) made `report` fail with
    'max() arg is an empty sequence', put the logloss panels' star on the wrong evaluation, or
    (a null logloss) raised a TypeError; a last line cut by a crash refused the whole run; a run
    resumed at another batch size had every step's samples counted at the new size; the same
    run given twice got two identical labels."""
    from dlrm_jax.cli import main
    from dlrm_jax.observe.report import figures

    run = tmp_path / "a"
    run.mkdir()
    (run / "config.yaml").write_text("train:\n  batch_size: 512\n")  # the size after the resume
    events = [
        {"event": "train", "step": 10, "loss": 0.7, "samples_per_s": 1.0, "batch_size": 128, "wall_s": 1.0},
        {"event": "eval", "step": 10, "loss": 0.7, "auc": None, "logloss": 0.69, "wall_s": 1.0},
        {"event": "train", "step": 20, "loss": 0.6, "samples_per_s": 1.0, "batch_size": 128, "wall_s": 2.0},
        {"event": "eval", "step": 20, "loss": 0.6, "auc": 0.7, "logloss": None, "wall_s": 2.0},
        {"event": "train", "step": 30, "loss": 0.5, "samples_per_s": 1.0, "batch_size": 512, "wall_s": 3.0},
        {"event": "eval", "step": 30, "loss": 0.5, "auc": 0.6, "logloss": 0.5, "wall_s": 3.0},
    ]
    text = "\ufeff" + "".join(json.dumps(e) + "\n" for e in events) + '{"event": "train", "st'
    (run / "metrics.jsonl").write_text(text, encoding="utf-8")
    figs = figures([run, tmp_path / "." / "a"])
    loss_by_samples = figs["loss"].axes[0]
    assert len(loss_by_samples.lines) == 1 and [x for x, _ in loss_by_samples.lines[0].get_xydata()] == [
        1280,
        2560,
        2560 + 10 * 512,
    ]
    auc, logloss = figs["eval"].axes[0], figs["eval"].axes[1]
    assert auc.lines[1].get_xydata().tolist() == [[2560, 0.7]]  # the best AUC, step 20
    assert len(logloss.lines) == 1  # step 20's logloss is not finite: no star on another point
    assert main(["report", str(run), "--output", str(tmp_path / "png")]) == 0
    assert "a: best AUC 0.7000 at step 20 (logloss not finite)" in capsys.readouterr().out
    (run / "metrics.jsonl").write_text(json.dumps({**events[1], "auc": None}) + "\n")  # no AUC at all
    assert main(["report", str(run), "--output", str(tmp_path / "png2")]) == 0
    assert "a: no evaluation with an AUC" in capsys.readouterr().out


def test_a_collective_combined_from_several_scopes_is_the_dense_gradients_all_reduce():
    """With hot rows XLA combines the dense gradients' all-reduce with the hot rows' (and the
    exchange's counts'): before, the first scope of the table that the name held won, and the
    profile put the whole all-reduce under "exchange forward", with no gradient all-reduce row."""
    from dlrm_jax.observe.trace import instruction_phases

    op = "jit(_train_step)/(phase_dense_fwd_bwd/x:phase_sparse_update/y:phase_exchange_forward/z)"
    hlo = "\n".join(
        [
            f'  %all-reduce.3 = (f32[8]{{0}}, f32[4]{{0}}) all-reduce(%a, %b), metadata={{op_name="{op}"}}',
            '  %fusion.1 = f32[8]{0} fusion(%c), metadata={op_name="jit(f)/(phase_sparse_update/q:phase_dense_fwd_bwd/r)"}',
            '  %all-to-all.2 = f32[8]{0} all-to-all(%d), metadata={op_name="jit(f)/phase_exchange_forward/s"}',
        ]
    )
    assert instruction_phases(hlo) == {
        "all-reduce.3": "gradient all-reduce",
        "fusion.1": "sparse update",
        "all-to-all.2": "exchange forward",
    }


def test_the_first_hot_row_refresh_of_a_process_is_left_out_of_its_windows_speed(tiny, tmp_path, monkeypatch):
    """Before: the first refresh compiled its program inside a logging window: a run resumed
    at a step off the windows' grid showed 584 samples/s in its first window against 33,157,
    and a run_samples_per_s of 3,576 against 22,347 (observe.md: compiles are left out)."""
    import time

    from dlrm_jax.train.driver import DeviceDriver

    refresh, slept = DeviceDriver._refresh_hot, []

    def compiling_once(self, state, keys, step):
        if not slept:  # as a compile on the first call
            time.sleep(1.0)
            slept.append(step)
        return refresh(self, state, keys, step)

    monkeypatch.setattr(DeviceDriver, "_refresh_hot", compiling_once)
    cfg = tiny(
        "mesh.devices=2",
        "train.steps=4",
        "train.log_every=4",
        "train.eval_every=0",
        "embedding.hot.rows=8",
        "embedding.hot.refresh_every=2",
        "embedding.hot.stats_batches=2",
    )
    train_and_evaluate(cfg, tmp_path / "run", **QUIET)
    (window,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert slept == [2] and window["samples_per_s"] > 4 * cfg.train.batch_size / 1.0, window


def test_a_profile_over_processes_prints_one_table(tiny, tmp_path, monkeypatch):
    """Before: every process printed its own table (a launch's terminal showed them one after
    another, prefixed), where profile.json holds process 0's. Process 1 here: no table."""
    import dlrm_jax.bench.profile as bench_profile

    lines = []
    monkeypatch.setattr(bench_profile.jax, "process_index", lambda: 1)
    result = bench_profile.profile(tiny(), tmp_path / "p", steps=1, warmup=0, log=lines.append)
    assert result["step_wall_ms"] > 0 and lines == []
    assert (tmp_path / "p" / "profile-trace" / "process_1").is_dir()
