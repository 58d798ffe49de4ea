"""The ``dlrm-jax`` command end to end, as a user runs it (subprocesses, real files)."""

import json
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.child_env import child_env
from tests.child_env import cli as run_cli
from tests.helpers import REPO

pytestmark = pytest.mark.slow  # every test here starts processes

FINAL = re.compile(r"^final step=(\d+) loss=(\S+) auc=(\S+) logloss=(\S+) samples_per_s=(\S+)$")
SMOKE = ["--config", "smoke", "--set", "train.progress_bar=false"]


def cli(*args, timeout=300, check=True):
    return run_cli(*args, timeout=timeout, check=check)


def final_line(proc):
    last = proc.stdout.strip().splitlines()[-1]
    m = FINAL.match(last)
    assert m, last
    return m


def test_train_writes_the_contract_files_and_resumes(tmp_path):
    run = tmp_path / "run"
    proc = cli("train", *SMOKE, "--set", "mesh.devices=4", "--run-dir", str(run))
    m = final_line(proc)
    assert int(m.group(1)) == 40 and 0.5 < float(m.group(3)) <= 1.0
    assert (run / "config.yaml").exists() and "cat_0" in (run / "plan.txt").read_text()
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all({"step", "loss", "samples_per_s"} <= set(e) for e in events)
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [20, 40] and all({"auc", "logloss"} <= set(e) for e in evals)
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["20", "40"]
    # The same command again: nothing left to train, the recorded final line, nothing recomputed.
    again = cli("train", *SMOKE, "--set", "mesh.devices=4", "--run-dir", str(run))
    assert "run already finished at step 40" in again.stdout
    assert final_line(again).group(0) == m.group(0)
    ev = cli("eval", "--run-dir", str(run))
    assert f"auc={float(m.group(3)):.6f}" in ev.stdout.strip().splitlines()[-1]


def test_early_stop_keep_best_and_step_best_from_the_command_line(tmp_path):
    """train.target_auc ends the run with rc 0, one line saying why, a checkpoint at that step,
    and the best evaluation printed beside the last (above the contract's final line); eval and
    export take --step best."""
    run = tmp_path / "run"
    args = [
        "train",
        *SMOKE,
        "--set",
        "mesh.devices=2",
        "--set",
        "train.eval_every=5",
        "--set",
        "train.keep_best=auc",
        "--set",
        "train.keep_checkpoints=1",
        "--set",
        "train.target_auc=0.6",
        "--run-dir",
        str(run),
    ]
    lines = cli(*args).stdout.strip().splitlines()
    last = FINAL.match(lines[-1])
    step = int(last.group(1))
    assert step < 40
    assert [line for line in lines if line.startswith("early stop")] == [
        f"early stop at step {step}: auc {last.group(3)} at step {step} reached train.target_auc=0.6"
    ]
    best = re.match(r"^best step=(\d+) auc=(\S+) logloss=(\S+)$", lines[-2])
    assert best and int(best.group(1)) <= step
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == sorted(
        {best.group(1), str(step)}
    )
    again = cli(*args).stdout.strip().splitlines()  # stays stopped, says so, and prints the same lines
    assert any(f"run stopped early at step {step}" in line for line in again) and again[-2:] == lines[-2:]
    ev = cli("eval", "--run-dir", str(run), "--step", "best").stdout.strip().splitlines()[-1]
    assert ev == f"eval step={best.group(1)} auc={best.group(2)} logloss={best.group(3)} samples={4 * 128}"
    out = cli("export", "--run-dir", str(run), "--step", "best", "--output", str(tmp_path / "tables"))
    assert out.stdout.strip().splitlines()[-1] == f"exported step={best.group(1)} to {tmp_path / 'tables'}"
    bad = cli("eval", "--run-dir", str(run), "--step", "latest", check=False)
    assert bad.returncode == 2 and "'best'" in bad.stderr


def test_sigkill_then_rerun_is_bitwise_identical(tmp_path):
    """Two processes from one seed (one killed and resumed) give the same bits at every logged
    step: bags of several ids and row-wise Adagrad, whose update sums a row's lookups in a
    fixed order."""
    args = [
        *SMOKE,
        "--set",
        "data.bag_sizes=[3, 1, 5, 2]",
        "--set",
        "train.steps=120",
        "--set",
        "train.checkpoint_every=40",
        "--set",
        "train.log_every=10",
        "--set",
        "train.eval_every=60",
    ]
    whole = final_line(cli("train", *args, "--run-dir", str(tmp_path / "whole")))
    cut = tmp_path / "cut"
    env = child_env(drop=())
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlrm_jax", "train", *args, "--run-dir", str(cut)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    deadline = time.time() + 240
    while not (cut / "checkpoints" / "80").exists():
        assert proc.poll() is None and time.time() < deadline, "no checkpoint before the run ended"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = cli("train", *args, "--run-dir", str(cut))
    assert "resuming from checkpoint" in resumed.stdout
    m = final_line(resumed)
    assert m.groups()[:4] == whole.groups()[:4]
    as_steps = lambda run: {
        (e["step"], e["event"]): e["loss"] for e in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    }
    assert as_steps(cut) == as_steps(tmp_path / "whole")


def test_loss_trajectories_agree_across_strategies(tmp_path):
    """ARCHITECTURE.md section 3: the plan never changes the math (relative 1e-4, 30 steps).
    In this process, through the function ``train`` calls (the command itself is tested above):
    the programs the strategies share are compiled once."""
    from dlrm_jax.config import load_config
    from dlrm_jax.train.trainer import train_and_evaluate

    curves = {}
    for s in ("replicated", "table", "row", "column", "auto"):
        run = tmp_path / s
        cfg = load_config(
            REPO / "configs" / "smoke.yaml",
            [
                "train.progress_bar=false",
                f"embedding.sharding={s}",
                "mesh.devices=8",
                "embedding.optimizer=adagrad",
                "train.steps=30",
                "train.log_every=3",
                "train.eval_every=0",
                "train.checkpoint_every=0",
            ],
        )
        train_and_evaluate(cfg, run, log=lambda *_: None)
        curves[s] = [e["loss"] for e in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]
        assert s == "auto" or f" {s}" in (run / "plan.txt").read_text()
    for s, curve in curves.items():
        assert len(curve) == 10
        assert max(abs(a - b) / abs(b) for a, b in zip(curve, curves["replicated"], strict=True)) < 1e-4, s


@pytest.mark.parametrize(
    "override,needle",
    [
        ("train.stepz=1", "train.stepz"),
        ("embedding.sharding=diagonal", "embedding.sharding"),
        ("model.interaction=mul", "dot, cat"),
    ],
)
def test_config_errors_are_one_line_not_tracebacks(override, needle):
    proc = cli("train", "--set", override, check=False, timeout=60)
    assert proc.returncode == 2
    assert needle in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("config", ["mlperf_dlrm_v1", "mlperf_dlrm_dcnv2"])
@pytest.mark.parametrize("devices", [8, 64])
def test_plan_command_for_mlperf_without_allocating(devices, config):
    proc = cli("plan", "--config", config, "--set", f"mesh.devices={devices}", timeout=60)
    out = proc.stdout
    assert f"{devices} devices" in out and "Predicted exchange per step per device" in out
    assert len([line for line in out.splitlines() if line.startswith("cat_")]) == 26
    if devices != 8:
        return
    # The 40M-row tables cannot be replicated or placed whole on one of 8 x 80 GB devices (nor
    # on one of 64: a replica is as large).
    budget = cli(
        "plan",
        "--config",
        config,
        "--set",
        f"mesh.devices={devices}",
        "--set",
        "embedding.sharding=replicated",
        "--set",
        "embedding.memory_budget_gb=80",
        check=False,
        timeout=60,
    )
    assert budget.returncode == 1 and "cat_" in budget.stderr and "budget" in budget.stderr


def test_plan_prints_what_crosses_hosts():
    """On more devices than one host has, `plan` says what crosses the links between hosts
    beside the bound's share of them; tables within hosts say so."""
    sets = ["--config", "smoke", "--set", "mesh.devices=8", "--set", "cluster.devices_per_host=4"]
    out = cli("plan", *sets, "--set", "embedding.sharding=host_row", timeout=60).stdout
    line = next(x for x in out.splitlines() if x.startswith("Between hosts (4 devices a host): "))
    assert "the bound's" in line and "within hosts" in line
    assert "host_row x4" in out and "split by rows within each of 2 host(s)" in out
    assert "Between hosts" not in cli("plan", "--config", "smoke", "--set", "mesh.devices=8", timeout=60).stdout


def test_plan_of_per_host_tables_is_one_hosts(tmp_path):
    """Per-host tables: every device holds its host's share of a whole set, so `plan` prints
    one host's plan (twice the bytes per device of the global plan on 2 hosts)."""
    sets = ["--config", "smoke", "--set", "mesh.devices=8", "--set", "embedding.sharding=row"]
    one = cli("plan", *sets, timeout=60).stdout
    two = cli("plan", *sets, "--set", "mesh.hosts=2", "--set", "embedding.sync=host_replicas", timeout=60).stdout
    assert "the plan of one host's 4 devices (mesh.hosts=2" in two and "on 4 devices" in two and "on 8 devices" in one
    total = lambda out: float(next(x for x in out.splitlines() if x.startswith("0 ")).split()[-2])
    assert total(two) > 1.5 * total(one)


def test_mlperf_dcnv2_trains_end_to_end_with_capped_rows(tmp_path):
    """The DLRM-DCNv2 config as shipped (multi-hot bags up to 100, rank-512 cross layers over
    27 x 128, Adagrad), its tables capped to fit here; a short warmup, since Adagrad's first
    step at a batch of 256 would otherwise trip the divergence guard. 12 steps: after 6 its AUC
    was chance's, 0.39-0.45 or above 0.5 by the seed's and the schedule's luck."""
    run = tmp_path / "dcnv2"
    proc = cli(
        "train",
        "--config",
        "mlperf_dlrm_dcnv2",
        "--set",
        "data.max_rows=2000",
        "--set",
        "train.batch_size=256",
        "--set",
        "train.steps=12",
        "--set",
        "train.warmup_steps=4",
        "--set",
        "train.eval_every=12",
        "--set",
        "train.eval_batches=2",
        "--set",
        "train.checkpoint_every=12",
        "--set",
        "mesh.devices=2",
        "--run-dir",
        str(run),
    )
    step, loss, auc, *_ = final_line(proc).groups()
    assert int(step) == 12 and float(auc) > 0.5 and float(loss) < 1.0
    assert " 100 " in (run / "plan.txt").read_text()  # the 100-id bag of cat_20


def test_wide_deep_config_trains_end_to_end_and_exports_its_wide_part(tmp_path):
    """configs/wide_deep.yaml as shipped (no bottom MLP, FTRL wide part, Adam deep part), its
    tables capped to fit here; its export holds every wide table and the wide linear weights."""
    run = tmp_path / "wd"
    proc = cli(
        "train",
        "--config",
        "wide_deep",
        "--set",
        "data.max_rows=2000",
        "--set",
        "train.batch_size=256",
        "--set",
        "train.steps=6",
        "--set",
        "train.eval_every=6",
        "--set",
        "train.eval_batches=2",
        "--set",
        "train.checkpoint_every=6",
        "--set",
        "mesh.devices=2",
        "--run-dir",
        str(run),
    )
    step, loss, auc, *_ = final_line(proc).groups()
    assert int(step) == 6 and float(auc) > 0.5 and float(loss) < 1.0
    assert "Wide part: 26 tables" in (run / "plan.txt").read_text()
    cli("export", "--run-dir", str(run), "--output", str(tmp_path / "out"))
    import tensorstore as ts

    read = lambda *p: (
        ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path.joinpath(*p))}})
        .result()
        .read()
        .result()
    )
    linear = read("out", "wide_linear", "values")
    assert linear.shape == (14, 1) and np.count_nonzero(linear) == 14  # 13 dense weights and the bias
    assert read("out", "wide_20", "values").shape == (2000, 1) and read("out", "wide_20", "z").shape == (2000, 1)
    assert read("out", "cat_20", "values").shape == (2000, 16)


def test_missing_binary_data_is_a_clear_error(tmp_path):
    proc = cli(
        "train",
        *SMOKE,
        "--set",
        "data.source=binary",
        "--set",
        f"data.path={tmp_path / 'nope'}",
        "--run-dir",
        str(tmp_path / "r"),
        check=False,
        timeout=120,
    )
    assert proc.returncode == 2 and "nope: no such folder" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()


SCRIPTS = REPO / "scripts"


def test_preprocess_then_train_on_binary(tmp_path):
    tsv = tmp_path / "day.tsv"
    subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "make_criteo_sample.py"),
            "--lines",
            "3000",
            "--output",
            str(tsv),
            "--max-rows",
            "500",
            "--bad-lines",
            "5",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    # A malformed line stops preprocessing with its file and line number, and leaves no output.
    failed = cli(
        "preprocess", "criteo", "--input", str(tsv), "--output", str(tmp_path / "d"), "--no-progress", check=False
    )
    assert failed.returncode == 1 and f"{tsv}:3001:" in failed.stderr and "Traceback" not in failed.stderr
    assert not (tmp_path / "d").exists()
    report = cli(
        "preprocess",
        "criteo",
        "--input",
        str(tsv),
        "--output",
        str(tmp_path / "d"),
        "--skip-bad-lines",
        "--raw-values",
        "--no-progress",
    ).stdout
    assert "5 skipped" in report and "3001" in report
    run = cli(
        "train",
        *SMOKE,
        "--set",
        "embedding.table_ids=[cat_2=dynamic]",  # fed the values preprocessing kept (--raw-values)
        "--set",
        "data.source=binary",
        "--set",
        f"data.path={tmp_path / 'd'}",
        "--set",
        "data.max_rows=0",
        "--set",
        "train.epochs=0.5",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.checkpoint_every=0",
        "--set",
        "train.eval_batches=0",
        "--set",
        "train.log_every=5",
        "--run-dir",
        str(tmp_path / "run"),
    )
    # Epochs of the train split: the steps they set, said in one line, and the epoch in each progress line.
    rows, steps = re.search(
        r"^train split: ([\d,]+) rows, [\d.]+ steps of 128 an epoch; "
        r"train.epochs=0.5 sets train.steps=(\d+)$",
        run.stdout,
        re.M,
    ).groups()
    assert int(steps) == -(-int(rows.replace(",", "")) // 256) == int(final_line(run).group(1))
    assert re.search(rf"^step 5/{steps} epoch 0\.\d\d loss \S+ samples/s \S+ left", run.stdout, re.M), run.stdout
    plan = (tmp_path / "run" / "plan.txt").read_text()
    assert len([line for line in plan.splitlines() if line.startswith("cat_")]) == 26
    # The dynamic table holds the values themselves (hex numbers), not the vocabulary's ids.
    import jax

    from dlrm_jax.data.shards import load_split
    from dlrm_jax.parallel.mesh import make_mesh
    from dlrm_jax.train.build import build
    from dlrm_jax.train.checkpoint import Checkpoints
    from dlrm_jax.train.restore import restore_state, saved_run_config

    cfg = saved_run_config(tmp_path / "run")
    _, steps = build(cfg, make_mesh(cfg.mesh.devices))
    state = restore_state(steps, Checkpoints(tmp_path / "run" / "checkpoints", 3), log=lambda *a: None)
    m = jax.tree.map(np.asarray, steps.dynamic.by_table(state.maps)["cat_2"])
    held = (m.key_hi[m.used].astype(np.uint64) << np.uint64(32)) | m.key_lo[m.used]
    values = load_split(tmp_path / "d", "train")["raw"][:, 2]
    assert len(held) > 10 and np.isin(held, values).all() and held.max() > 2**20


def test_mlperf_multi_hot_days_then_dcnv2_training(tmp_path):
    """The Terabyte layout through the CLI: gz days, day_23 as the val split, ids hashed and
    compacted, MLPerf's multi-hot bags; configs/mlperf_dlrm_dcnv2.yaml trains on the output."""
    import gzip

    tsv = tmp_path / "all.tsv"
    subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "make_criteo_sample.py"),
            "--lines",
            "1200",
            "--output",
            str(tsv),
            "--max-rows",
            "300",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    lines = tsv.read_bytes().splitlines(keepends=True)
    for name, part in (("day_0.gz", lines[:500]), ("day_1.gz", lines[500:1000]), ("day_23.gz", lines[1000:])):
        (tmp_path / name).write_bytes(gzip.compress(b"".join(part)))
    out = cli(
        "preprocess",
        "criteo",
        "--input",
        str(tmp_path / "day_0.gz"),
        str(tmp_path / "day_1.gz"),
        "--val-input",
        str(tmp_path / "day_23.gz"),
        "--output",
        str(tmp_path / "mh"),
        "--max-ind-range",
        "200",
        "--vocab-from",
        "all",
        "--multi-hot",
        "mlperf",
        "--workers",
        "2",
        "--no-progress",
    ).stdout
    assert "1000 train + 200 val rows" in out and "ids counted on all rows, train and val" in out
    meta = json.loads((tmp_path / "mh" / "meta.json").read_text())
    assert sum(meta["bag_sizes"]) == 214 and max(meta["cardinalities"]) <= 200
    assert (meta["vocab_from"], meta["split"]) == ("all", "files")
    run = cli(
        "train",
        "--config",
        "mlperf_dlrm_dcnv2",
        "--set",
        "data.source=binary",
        "--set",
        f"data.path={tmp_path / 'mh'}",
        "--set",
        "train.batch_size=128",
        "--set",
        "train.steps=4",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.checkpoint_every=0",
        "--set",
        "mesh.devices=2",
        "--set",
        "model.embedding_dim=8",
        "--set",
        "model.bottom_mlp=[16, 8]",
        "--set",
        "model.top_mlp=[16, 1]",
        "--set",
        "model.dcn_rank=4",
        "--set",
        "train.progress_bar=false",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert int(final_line(run).group(1)) == 4


def test_bench_collectives_prints_both_rates(tmp_path):
    out = tmp_path / "c.json"
    proc = cli("bench", "collectives", "--devices", "2", "--sizes-kib", "16", "--repeats", "1", "--output", str(out))
    assert "a2a / all-reduce" in proc.stdout
    assert json.loads(out.read_text())["devices"] == 2


def test_without_a_terminal_train_prints_progress_lines_and_the_plan_plan_predicted(tmp_path):
    """stdout to a file (a cluster job): plain progress lines; the plan in three plain lines on
    the terminal, and what ``dlrm-jax plan`` says for the same config."""
    run = cli("train", "--config", "smoke", "--set", "train.log_every=10", "--run-dir", str(tmp_path / "run")).stdout
    assert len(re.findall(r"^step \d+/40 loss \S+ samples/s \S+ left \dm\d\ds$", run, re.M)) == 4, run
    lines = run.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("plan: "))
    summary = lines[first : first + 3]
    assert lines[first + 3].startswith("compiled the train step"), run
    assert not re.search(r"sharded_w|owner|bucket|capacit", "\n".join(summary), re.I), summary
    planned = cli("plan", "--config", "smoke").stdout  # the same plan: the same bytes and step
    sent, ratio = re.search(
        r"exchange (\S+ \S+) a step per device \((\S+)x the pooled-exchange bound\)", summary[1]
    ).groups()
    step = re.search(r"predicted step (\S+) ms", summary[2]).group(1)
    assert f"Predicted exchange per step per device: {sent}\n" in planned and f"(predicted / bound: {ratio}" in planned
    assert f": {step} ms = lookup" in planned, (summary, planned)
