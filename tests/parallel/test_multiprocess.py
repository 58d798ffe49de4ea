"""Two local processes with 4 simulated devices each train exactly like one process with 8,
hot rows included: statistics from the global batches, a refresh every two steps."""

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.child_env import child_env
from tests.helpers import REPO as REPO_PATH
from tests.parallel.readme_launch import readme_launch_line
from tests.train.damage import change_saved_element

pytestmark = pytest.mark.slow  # every test here starts processes

ARGS = [
    "train",
    "--config",
    "smoke",
    "--set",
    "train.progress_bar=false",
    "--set",
    "mesh.devices=8",
    "--set",
    "embedding.sharding=row",
    "--set",
    "train.steps=6",
    "--set",
    "train.log_every=1",
    "--set",
    "train.eval_every=3",
    "--set",
    "train.checkpoint_every=3",
    "--set",
    "embedding.hot.rows=16",
    "--set",
    "embedding.hot.refresh_every=2",
    "--set",
    "embedding.hot.stats_batches=1",
    "--set",
    "train.hang_timeout_s=120",
]  # a stuck process exits naming where each one is


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(run_dir):
    return [
        (e["step"], e["loss"], e.get("auc"), e["hot_hit_rate"])
        for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    ]


def launch_processes(args, env, cwd, count=2):
    """``count`` processes (two unless told) of one run, on local ports."""
    port = free_port()
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dlrm_jax",
                *args,
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                str(count),
                "--process-id",
                str(i),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=cwd,
        )
        for i in range(count)
    ]


def communicate(procs, timeout):
    """Every process's (stdout, stderr); past ``timeout``, a failure with each live process's
    thread stacks (the CLI dumps them on SIGUSR1) and the tail of its output."""
    deadline = time.time() + timeout
    try:
        try:
            return [p.communicate(timeout=max(1.0, deadline - time.time())) for p in procs]
        except subprocess.TimeoutExpired:
            stuck = [i for i, p in enumerate(procs) if p.poll() is None]
            for i in stuck:
                procs[i].send_signal(signal.SIGUSR1)
            time.sleep(3)
            for p in procs:
                p.kill()
            outs = [p.communicate() for p in procs]  # (retrying communicate loses no output)
            pytest.fail(
                "\n".join(
                    f"process {i} {'stuck' if i in stuck else f'exit {p.returncode}'}:\n{out[-1500:]}\n{err[-6000:]}"
                    for i, (p, (out, err)) in enumerate(zip(procs, outs, strict=True))
                )
            )
    finally:
        for p in procs:
            p.kill()


@pytest.mark.timeout(400)
def test_two_processes_equal_one(tmp_path):
    env = child_env()
    single = subprocess.run(
        [sys.executable, "-m", "dlrm_jax", *ARGS, "--run-dir", str(tmp_path / "one")],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert single.returncode == 0, single.stderr
    # No --run-dir: process 0 picks runs/<time> and every process uses it.
    (tmp_path / "cwd").mkdir()
    procs = launch_processes(ARGS, env, tmp_path / "cwd")
    outs = communicate(procs, 240)
    for i, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, err[-3000:]
        assert out.strip().splitlines()[-1].startswith("final step=6") == (i == 0)  # process 0's alone
        assert "on 8 cpu devices in 2 process(es)" in out
    run_dirs = list((tmp_path / "cwd" / "runs").iterdir())
    assert len(run_dirs) == 1 and all(f"run dir: runs/{run_dirs[0].name}" in out for out, _ in outs)
    assert sorted(p.name for p in (run_dirs[0] / "checkpoints").iterdir()) == ["3", "6"]
    one, two = losses(tmp_path / "one"), losses(run_dirs[0])
    assert [s for s, _, _, _ in one] == [s for s, _, _, _ in two]
    for (_, a, auc_a, hits_a), (_, b, auc_b, hits_b) in zip(one, two, strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (a, b)
        assert (auc_a is None) == (auc_b is None) and (auc_a is None or abs(auc_a - auc_b) < 1e-6)
        assert hits_a == hits_b and 0 < hits_a < 1  # the same hot rows, chosen from the global batches

    # The run dir in use (its lock held here): both processes refuse at once, in one line each.
    with open(run_dirs[0] / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        started = time.time()
        procs = launch_processes([*ARGS, "--run-dir", str(run_dirs[0])], env, tmp_path / "cwd")
        outs = communicate(procs, 120)
    assert time.time() - started < 90
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode != 0 and "is in use by" in err, err[-2000:]
        assert len([line for line in err.splitlines() if "error" in line.lower()]) == 1, err[-2000:]

    # Only process 1's shards of the newest checkpoint damaged: the processes agree to skip it
    # (each reading alone, process 0 would wait forever in orbax's restore barrier).
    before = losses(run_dirs[0])
    for f in (run_dirs[0] / "checkpoints" / "6" / "state" / "ocdbt.process_1" / "d").iterdir():
        f.write_bytes(b"\0garbage")
    procs = launch_processes([*ARGS, "--set", "train.steps=9", "--run-dir", str(run_dirs[0])], env, tmp_path / "cwd")
    for p, (out, err) in zip(procs, communicate(procs, 240), strict=True):
        assert p.returncode == 0, err[-3000:]
        warnings = [line for line in out.splitlines() if line.startswith("warning:")]
        assert len(warnings) == 1 and "checkpoints/6 is damaged" in warnings[0], out[-2000:]
        assert "on process 1" in warnings[0] and "resuming from checkpoint at step 3" in out
    assert losses(run_dirs[0])[: len(before)] == before  # steps 4 to 6 trained again, bitwise

    # Every process reads its files of the newest checkpoint, but a value in them is not what was
    # saved: the processes add their parts of its checksums and skip it together.
    change_saved_element(run_dirs[0] / "checkpoints" / "9", "params.top.layers.0.bias")
    procs = launch_processes([*ARGS, "--set", "train.steps=12", "--run-dir", str(run_dirs[0])], env, tmp_path / "cwd")
    for p, (out, err) in zip(procs, communicate(procs, 240), strict=True):
        assert p.returncode == 0, err[-3000:]
        warnings = [line for line in out.splitlines() if line.startswith("warning:")]
        assert len(warnings) == 1 and "checkpoints/9 is damaged (params.top.layers.0.bias's contents" in warnings[0]
        assert "resuming from checkpoint at step 6" in out, out[-2000:]


REPO = str(REPO_PATH)
PEER_BOUND_S = 45  # the README's bound (heartbeat timeout 30 s + the watchdog's poll) plus slack


def launch_local(args, cwd, env):
    return subprocess.Popen(
        [os.path.join(REPO, args[0]), *args[1:]],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=cwd,
        env=env,
    )


def test_readme_launch_a_lost_process_and_a_restart(tmp_path):
    """The README's launch_local line trains; SIGKILL of process 1 makes process 0 exit
    non-zero within the bound, naming it; the same command again resumes and ends bitwise
    where the uninterrupted run ended."""
    env = child_env()
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    line = readme_launch_line()
    whole = launch_local(line, tmp_path, env)
    out, _ = whole.communicate(timeout=300)
    assert whole.returncode == 0, out[-3000:]
    final = [x for x in out.splitlines() if x.startswith("[p0] final step=")]
    assert final and "[p1] final step=" not in out  # one summary, from process 0
    (reference,) = [p for p in (tmp_path / "runs").iterdir()]
    (launched,) = (reference / "launch").iterdir()  # this launch's logs, in a folder of its own
    assert sorted(p.name for p in launched.iterdir()) == ["p0.log", "p1.log"]  # not left in /tmp

    cut_args = [*line, "--set", "train.checkpoint_every=10", "--run-dir", str(tmp_path / "cut")]
    cut = launch_local(cut_args, tmp_path, env)
    pids, lines = {}, []
    for text in cut.stdout:  # "[launch] process i: pid P" come first
        lines.append(text)
        if text.startswith("[launch] process"):
            pids[int(text.split()[2].rstrip(":"))] = int(text.split()[-1])
        if len(pids) == 2:
            break
    deadline = time.time() + 240
    while not (tmp_path / "cut" / "checkpoints" / "10").is_dir() and time.time() < deadline:
        time.sleep(0.02)
    os.kill(pids[1], 9)
    killed = time.time()
    rest, _ = cut.communicate(timeout=PEER_BOUND_S + 30)
    took = time.time() - killed
    out = "".join(lines) + rest
    assert cut.returncode != 0 and took < PEER_BOUND_S, (took, out[-3000:])
    # The supervisor stops process 0 and says, in one line, who was lost and how to resume;
    # jaxlib's native abort reports (if any came) stay out of the terminal.
    ends = [x for x in out.splitlines() if x.startswith("[launch] process 1 was ended by SIGKILL")]
    logs = "".join(
        f"\n--- {p.name}, its end:\n" + p.read_text()[-1500:]
        for p in sorted((tmp_path / "cut" / "launch").glob("*/p*.log"))
    )
    assert len(ends) == 1 and "the newest checkpoint is intact: run `" in ends[0] and "to resume" in ends[0], (
        f"killed {killed - deadline + 240:.2f} s after the wait began\n" + out[-3000:] + logs
    )
    assert not [
        x for x in out.splitlines() if "Check failure stack trace" in x or x.lstrip("[p01] ").startswith("@ 0x")
    ]

    again = launch_local(cut_args, tmp_path, env)
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out[-3000:]
    resumed = [x for x in out.splitlines() if x.startswith("[p0] resuming from checkpoint at step ")]
    assert resumed and int(resumed[0].split()[-1]) < 40, out[-3000:]  # the kill did cut the run
    assert [x for x in out.splitlines() if x.startswith("[p0] final step=")][0].split()[:4] == final[0].split()[:4]
    assert losses(tmp_path / "cut") == losses(reference)


SUPERVISOR_STOP_BOUND_S = 120  # docs/multi-host.md: up to 10 steps, an evaluation and a save (seconds), with CI's slack


def gone(pid: int) -> bool:
    """Whether ``pid`` has ended (a zombie nobody reaps, once its supervisor is gone, counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


def last_logged_step(run) -> int:
    """The newest step in ``run``'s metrics (-1 before any, or while a line is half written)."""
    try:
        return json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    except (OSError, IndexError, ValueError):
        return -1


@pytest.mark.timeout(400)
def test_killing_the_supervisor_saves_and_stops_every_process_within_the_bound(tmp_path):
    """SIGKILL of scripts/launch_local.sh's supervisor: its processes get SIGTERM. Before the fix
    process 0 died on its next line of output (EPIPE: nobody read the supervisor's pipe) while
    process 1 waited in the save's barrier; both lived 2 more minutes and ended with no
    checkpoint and no message. Now both save at the step they agree on, say so in their logs,
    and exit within the bound."""
    env = child_env()
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    run = tmp_path / "run"
    args = [*readme_launch_line(), "--set", "train.steps=100000", "--set", "train.log_every=5", "--run-dir", str(run)]
    supervisor = launch_local(args, tmp_path, env)
    trainers = {}  # pid -> its log, from "[launch] process I: output also in LOG, pid P"
    for text in supervisor.stdout:
        if text.startswith("[launch] process"):
            trainers[int(text.split()[-1])] = Path(text.split(" output also in ")[1].split(",")[0])
        if len(trainers) == 2:
            break
    deadline = time.time() + 240
    while last_logged_step(run) < 20:
        assert supervisor.poll() is None and time.time() < deadline
        time.sleep(0.1)
    supervisor.kill()
    killed = time.time()
    supervisor.wait()
    supervisor.stdout.close()
    while not all(gone(pid) for pid in trainers):
        assert time.time() - killed < SUPERVISOR_STOP_BOUND_S, [log.read_text()[-2000:] for log in trainers.values()]
        time.sleep(0.2)
    ends = []
    for log in trainers.values():
        text = log.read_text()
        assert "the run finishes what it is doing" in text, text[-2000:]
        ends += [x for x in text.splitlines() if x.startswith("dlrm-jax: stopped by SIGTERM after step ")]
    steps = {int(x.split("after step ")[1].split(";")[0]) for x in ends}
    assert len(ends) == 2 and len(steps) == 1, ends  # both, at the step they agreed on
    (step,) = steps
    assert step >= 20 and step % 10 == 0 and (run / "checkpoints" / str(step)).is_dir()


@pytest.mark.timeout(400)
def smoke_train(*sets: str) -> list[str]:
    """``dlrm-jax train`` on the smoke config, 8 devices, 6 steps logged every step."""
    base = ["train.progress_bar=false", "mesh.devices=8", "train.steps=6", "train.log_every=1", *sets]
    return ["train", "--config", "smoke", *[a for kv in base for a in ("--set", kv)]]


def one_and_more_processes(tmp_path, single: list[str], two: list[str], read, count=2) -> tuple[list, list]:
    """``read`` of the run dirs of ``single`` in one process and ``two`` over ``count``."""
    env = child_env()
    one = subprocess.run(
        [sys.executable, "-m", "dlrm_jax", *single, "--run-dir", str(tmp_path / "one")],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    procs = launch_processes([*two, "--run-dir", str(tmp_path / "two")], env, tmp_path, count)
    for p, (_, err) in zip(procs, communicate(procs, 240), strict=True):
        assert p.returncode == 0, err[-3000:]
    return read(tmp_path / "one"), read(tmp_path / "two")


def metrics(run_dir, *keys) -> list[tuple]:
    return [
        tuple(e.get(k) for k in keys) for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    ]


@pytest.mark.parametrize("sync", ["per_host", "host_replicas"])
def test_per_host_tables_over_two_processes_equal_one_process(tmp_path, sync):
    """Per-host tables over 2 processes x 4 devices (a host each). per_host trains exactly like
    one process whose 8 devices form 2 simulated hosts (each process's tables see its own
    rows); host_replicas exactly like one global set of tables on 8 devices in one process, its
    replicas never drifting apart."""
    common = ["train.eval_every=3", "embedding.sharding=row"]
    sets = [*common, f"embedding.sync={sync}", *(["embedding.sync_every=4"] if sync == "per_host" else [])]
    single = smoke_train(*sets, "mesh.hosts=2") if sync == "per_host" else smoke_train(*common)
    a, b = one_and_more_processes(
        tmp_path, single, smoke_train(*sets), lambda d: metrics(d, "step", "loss", "auc", "table_divergence")
    )
    a, b = ([(s, loss, auc, d or 0.0) for s, loss, auc, d in x] for x in (a, b))
    assert [s for s, *_ in a] == [s for s, *_ in b]
    for (_, la, auc_a, da), (_, lb, auc_b, db) in zip(a, b, strict=True):
        assert abs(la - lb) <= 1e-5 * abs(la) and abs(da - db) <= 1e-5 * max(da, 1e-6)
        assert (auc_a is None) == (auc_b is None) and (auc_a is None or abs(auc_a - auc_b) < 1e-6)
    if sync == "per_host":
        assert a[3][3] == 0.0 and a[2][3] > 0  # averaged at step 4
    else:
        assert all(d == 0.0 for *_, d in b)


def test_tables_within_hosts_over_processes_equal_one_process(tmp_path):
    """Tables split by rows within a host of 4 devices, and one row-wise over all 8 whose ids
    go in two levels, over 4 processes of 2 devices, two a host (as with one process per GPU):
    the exchange between hosts crosses processes, and each process measures the two stages'
    buckets on its own rows (holding half a host's rows, it doubles its count of the host's
    merged requests: an upper bound). Training matches one process of 8 devices, and no step
    overflows into the one-level form (without the doubling, step 1 does)."""
    args = smoke_train(
        "embedding.sharding=host_row",
        "embedding.table_sharding=[cat_3=row]",
        "embedding.ids_exchange=two_level",
        "cluster.devices_per_host=4",
    )
    read = lambda d: metrics(d, "step", "loss", "exchange_overflows")
    a, b = one_and_more_processes(tmp_path, args, args, read, 4)
    assert [s for s, *_ in a] == [s for s, *_ in b] and len(a) == 6
    for (_, la, _), (_, lb, overflows) in zip(a, b, strict=True):
        assert abs(la - lb) <= 1e-5 * abs(la) and overflows == 0, (la, lb, overflows)
    for run in ("one", "two"):  # the same placement, buckets measured on each process's own rows
        plan = (tmp_path / run / "plan.txt").read_text()
        assert "host_row x4" in plan and "in two levels over 2 hosts of 4" in plan


# Process 1's input for step 11 (batch 10) never comes (a hung file system, say); its heartbeat
# thread lives on, so only the hang watch can end it. (data.prefetch=1: batch 10 is asked for
# when step 11 needs it.)
STALL_INPUT = """
import sys, threading
from dlrm_jax.data.sources import synthetic
device_batches = synthetic.SyntheticSource.device_batches
def stalling(self, sharding):
    make = device_batches(self, sharding)
    def batch(step):
        if step == 10 and sys.argv[sys.argv.index("--process-id") + 1] == "1":
            threading.Event().wait()
        return make(step)
    return batch
synthetic.SyntheticSource.device_batches = stalling
from dlrm_jax.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(300)
def test_a_hung_process_ends_every_process_naming_where_each_is(tmp_path):
    """A process stuck with its heartbeat alive exits after train.hang_timeout_s naming where
    every process is; the other (stuck in a collective with it) does too, or follows it."""
    env = child_env()
    script = tmp_path / "stall.py"
    script.write_text(STALL_INPUT)
    port = free_port()
    args = [
        "train",
        "--config",
        "smoke",
        "--set",
        "train.progress_bar=false",
        "--set",
        "mesh.devices=8",
        "--set",
        "train.hang_timeout_s=10",
        "--set",
        "data.prefetch=1",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                *args,
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    outs = communicate(procs, 200)
    assert all(p.returncode != 0 for p in procs), [err[-2000:] for _, err in outs]
    errors = "".join(err for _, err in outs)
    assert "no progress for" in errors and "process 1: reading input at step 11" in errors, errors[-3000:]
    assert "train.hang_timeout_s=10" in errors


def test_processes_with_different_configs_refuse_in_one_line(tmp_path):
    """Every process compares its resolved config with the others' before anything is used:
    each refuses with one line naming the differing keys and both values (before: gloo's
    collective mismatch aborted both, or one waited 120 s and exited silently)."""
    env = child_env()
    base = [
        "train",
        "--config",
        "smoke",
        "--set",
        "train.progress_bar=false",
        "--set",
        "mesh.devices=8",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dlrm_jax",
                *base,
                "--set",
                f"train.steps={steps}",
                "--set",
                f"train.learning_rate={lr}",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i, (steps, lr) in enumerate([(40, 0.1), (60, 0.2)])
    ]
    for p, (_, err) in zip(procs, communicate(procs, 120), strict=True):
        mine = [line for line in err.splitlines() if line.startswith("dlrm-jax:")]
        assert p.returncode == 1 and len(mine) == 1, err[-2000:]
        assert (
            "the processes' configs differ" in mine[0]
            and "train.learning_rate: process 0 0.1, process 1 0.2" in mine[0]
            and "train.steps: process 0 40, process 1 60" in mine[0]
        ), mine[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_process_that_fails_alone_ends_its_peer_in_seconds_with_its_line(tmp_path):
    """A process that fails after the join (here: told another --num-processes than the run
    has) tells the others, who end with its line within seconds. Before: it waited two minutes
    at the exit barrier, its heartbeat keeping the others waiting inside a collective, which
    then called it a lost peer and advised a restart; a wrong --num-processes or mesh.devices
    failed with advice about XLA_FLAGS, which the user never set."""
    env = child_env()
    port = free_port()
    base = ["train", "--config", "smoke", "--set", "mesh.devices=4", "--run-dir", str(tmp_path / "run")]
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "dlrm_jax", *base, "--coordinator", f"127.0.0.1:{port}"]
            + ["--num-processes", str(count), "--process-id", str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i, count in enumerate([2, 4])
    ]
    (_, err0), (_, err1) = communicate(procs, 90)
    mine = [[x for x in err.splitlines() if x.startswith("dlrm-jax:")] for err in (err0, err1)]
    told = "--num-processes 4: the coordinator's run has 2 processes; give every process the same --num-processes"
    assert procs[1].returncode == 2 and mine[1] == [f"dlrm-jax: config error: {told}"], err1[-2000:]
    assert procs[0].returncode == 1 and len(mine[0]) == 1, err0[-2000:]
    assert (
        mine[0][0] == f"dlrm-jax: error: process 0: process 1 failed, and this one stops with it: config error: {told}"
    )
    assert time.monotonic() - start < 60  # (two starts of JAX, then seconds)


def test_a_process_restarted_alone_is_refused_and_the_run_stops_at_once_naming_it(tmp_path):
    """Process 1 stopped and started again alone while process 0 trains on: the coordination
    service (recoverable) follows the newcomer in process 1's place. Before: the newcomer
    failed on a raw 'ALREADY_EXISTS' of a key-value entry, and process 0 ended 30 s or more
    later with 'lost process(es) 1' (its live check waits for every live process to ask)."""
    env, port = {**child_env(), "PYTHONUNBUFFERED": "1"}, free_port()  # (its log read as it trains)
    base = ["train", "--config", "smoke", "--set", "mesh.devices=4", "--set", "train.steps=100000"]
    base += ["--set", "train.progress_bar=false", "--run-dir", str(tmp_path / "run")]
    base += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id"]
    logs = [tmp_path / f"p{i}.log" for i in range(3)]

    def start(i, log):
        with open(log, "w") as out:
            cmd = [sys.executable, "-m", "dlrm_jax", *base, str(i)]
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)

    procs = [start(0, logs[0]), start(1, logs[1])]
    try:
        deadline = time.monotonic() + 150
        while "step 10/" not in logs[0].read_text() and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), logs[0].read_text()[-2000:]
            time.sleep(0.5)
        # Stopped, not killed: its connections stay open, so process 0 waits inside a collective
        # (a kill would break it there first, sometimes) and the service's live check waits for it.
        procs[1].send_signal(signal.SIGSTOP)
        restarted = time.monotonic()
        procs.append(start(1, logs[2]))
        assert procs[2].wait(timeout=60) == 2, logs[2].read_text()[-2000:]
        assert procs[0].wait(timeout=60) == 1, logs[0].read_text()[-2000:]
        took = time.monotonic() - restarted
    finally:
        for p in procs:
            p.kill()
    (newcomer,) = [x for x in logs[2].read_text().splitlines() if x.startswith("dlrm-jax:")]
    assert newcomer.startswith("dlrm-jax: error: process 1 has already joined the run at 127.0.0.1:"), newcomer
    lines = [x for x in logs[0].read_text().splitlines() if x.startswith("dlrm-jax:")]
    assert len(lines) == 1, logs[0].read_text()[-3000:]
    assert lines[0].startswith("dlrm-jax: error: process 0: process 1 was started again while this run trained"), lines
    assert took < 25, took  # (the heartbeat timeout is 30 s: the old code's bound)


def test_a_stop_signal_while_waiting_for_the_others_to_join_ends_the_process(tmp_path):
    """Before: the main thread waits inside jaxlib, where no Python signal handler runs: Ctrl-C
    and SIGTERM did nothing until --join-timeout (300 s by default)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlrm_jax", "train", "--config", "smoke", "--set", "mesh.devices=4"]
        + ["--run-dir", str(tmp_path / "run"), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
        + ["--process-id", "0", "--join-timeout", "200"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the coordination service listens: the join has begun
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.2)
    time.sleep(1)
    proc.send_signal(signal.SIGINT)
    ((_, err),) = communicate([proc], 30)
    assert proc.returncode == 130, err[-2000:]
    assert "dlrm-jax: stopped by SIGINT while waiting for process 1 to join (nothing to save)" in err, err[-2000:]


def test_processes_given_different_run_dirs_refuse_in_one_line(tmp_path):
    """Before: a run dir given to process 0 alone hung both (process 1 waited for a choice of run
    dir process 0 never made); different ones failed at the first checkpoint."""
    env = child_env()
    base = ["train", "--config", "smoke", "--set", "mesh.devices=8"]
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "dlrm_jax", *base, *extra]
            + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        for i, extra in enumerate([["--run-dir", "A"], []])
    ]
    for p, (_, err) in zip(procs, communicate(procs, 120), strict=True):
        mine = [line for line in err.splitlines() if line.startswith("dlrm-jax:")]
        assert p.returncode == 1 and len(mine) == 1, err[-2000:]
        assert "the processes' --run-dir arguments differ" in mine[0], mine[0]
        assert f"--run-dir: process 0 {tmp_path / 'A'}, process 1 (not given)" in mine[0], mine[0]
    assert not (tmp_path / "A").exists() and not (tmp_path / "runs").exists()
    # One relative --run-dir from two working directories is two folders. Before: accepted, one
    # process failed with '[Errno 2] No such file or directory: .../cwdB/rel/checkpoints' and the
    # other waited 2.5 minutes to learn it had lost its peer.
    for i in range(2):
        (tmp_path / f"cwd{i}").mkdir()
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "dlrm_jax", *base, "--run-dir", "rel"]
            + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path / f"cwd{i}",
        )
        for i in range(2)
    ]
    for p, (_, err) in zip(procs, communicate(procs, 120), strict=True):
        mine = [line for line in err.splitlines() if line.startswith("dlrm-jax:")]
        assert p.returncode == 1 and len(mine) == 1, err[-2000:]
        assert f"process 0 {tmp_path / 'cwd0' / 'rel'}, process 1 {tmp_path / 'cwd1' / 'rel'}" in mine[0], mine[0]


@pytest.mark.timeout(300)
def test_a_sigterm_before_the_first_step_of_a_multi_process_run_stops_it(tmp_path):
    """Before: JAX's preemption service put its own SIGTERM handler in place of ours when the
    processes joined, so a SIGTERM while they planned or compiled was swallowed (one line in the
    process's native log) and both trained on to the end, exit 0."""
    env = child_env()
    args = ["train", "--config", "smoke", "--set", "mesh.devices=8", "--set", "train.steps=100000"]
    procs = launch_processes([*args, "--run-dir", str(tmp_path / "run")], env, tmp_path)
    deadline = time.time() + 120
    while not (tmp_path / "run" / "config.yaml").exists() and time.time() < deadline:
        time.sleep(0.05)  # (written once the state is restored: the train step then compiles)
    procs[1].send_signal(signal.SIGTERM)
    outs = communicate(procs, 150)
    assert procs[1].returncode == 128 + signal.SIGTERM, outs[1][1][-2000:]
    assert "dlrm-jax: stopped by SIGTERM" in outs[1][1], outs[1][1][-2000:]
    assert procs[0].returncode != 0 and not any("final step=" in out for out, _ in outs)


def test_a_peer_that_never_joins_is_named_within_the_bound(tmp_path):
    """Process 1 never starts: process 0 exits after --join-timeout with one line naming it
    (before: 300 s, then jaxlib's abort with a C++ stack naming no process)."""
    start = time.time()
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "dlrm_jax",
            "train",
            "--config",
            "smoke",
            "--set",
            "mesh.devices=8",
            "--run-dir",
            str(tmp_path / "run"),
            "--coordinator",
            f"127.0.0.1:{free_port()}",
            "--num-processes",
            "2",
            "--process-id",
            "0",
            "--join-timeout",
            "5",
        ],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )
    mine = [line for line in p.stderr.splitlines() if line.startswith("dlrm-jax:")]
    assert p.returncode == 1 and time.time() - start < 60, p.stderr[-2000:]
    assert mine == [
        f"dlrm-jax: error: process 0: process 1 did not join 127.0.0.1:{p.args[p.args.index('--coordinator') + 1].split(':')[1]} "
        "within 5 s (--join-timeout): start every process with the same command, or see the missing "
        "one's own output for why it stopped"
    ], p.stderr[-2000:]


def test_dynamic_tables_over_two_processes_equal_one_process(tmp_path):
    """Every smoke table dynamic over 2 processes x 4 devices: each device's distinct raw ids
    cross processes to their owners and their rows come back (the routed resolution: 128
    samples x 4 tables a device, more than its largest buffer), and training equals one
    process of 8 devices in every step's loss, evaluation and the maps' counts."""
    from dlrm_jax.embedding.dynamic.sizing import route_capacities

    assert route_capacities(1024 // 8 * 4, 8)
    args = smoke_train(
        "embedding.ids=dynamic", "embedding.dynamic.vshards=8", "train.batch_size=1024", "train.eval_every=3"
    )
    keys = ("step", "loss", "auc", "ids_lookups", "ids_found", "ids_admitted", "ids_held_back", "map_fill")
    a, b = one_and_more_processes(tmp_path, args, args, lambda d: metrics(d, *keys))
    assert [x[:1] + x[3:] for x in a] == [x[:1] + x[3:] for x in b]
    assert a[0][5] > 0 and a[-1][4] > 0  # ids admitted, then found
    for (_, la, auc_a, *_), (_, lb, auc_b, *_) in zip(a, b, strict=True):
        assert abs(la - lb) <= 1e-5 * abs(la)
        assert (auc_a is None) == (auc_b is None) and (auc_a is None or abs(auc_a - auc_b) < 1e-6)
