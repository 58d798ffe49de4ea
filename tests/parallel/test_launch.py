"""The launch supervisor (dlrm_jax/parallel/launch.py) on stand-in processes: who it names."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlrm_jax.parallel.launch import supervise


def test_a_killed_process_is_named_before_the_survivor_that_the_runtime_aborted(tmp_path, capsys):
    """jaxlib or gloo can abort a survivor (SIGABRT) before the killed peer is even reaped: the
    one line must still name the process ended from outside, and the abort as a consequence."""
    aborts_first = [sys.executable, "-c", "import os, time; time.sleep(0.2); os.abort()"]
    killed_later = ["sh", "-c", "sleep 0.6; kill -9 $$"]
    rc = supervise([aborts_first, killed_later], "RESUME", tmp_path / "logs")
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("[launch] process ") and "pid" not in x]
    assert line.startswith("[launch] process 1 was ended by SIGKILL;"), line
    assert "process(es) 0 aborted natively on losing it" in line and "the others ended too" in line
    assert "run `RESUME` again" in line  # (no run dir known, no checkpoint to name)
    assert rc == 128 + 9


def test_native_log_lines_go_to_the_log_not_the_terminal(tmp_path, capsys):
    noisy = [
        sys.executable,
        "-c",
        "import sys; print('F1124 22:23:43.551884     617 client.h:80] Terminating', "
        "file=sys.stderr); print('    @     0x7f2a60840634  absl::LogMessage', file=sys.stderr); "
        "print('dlrm-jax: error: one line', file=sys.stderr); sys.exit(1)",
    ]
    assert supervise([noisy], "RESUME", tmp_path / "logs") == 1
    err = capsys.readouterr().err
    assert "Terminating" not in err and "0x7f2a" not in err and "[p0] dlrm-jax: error: one line" in err
    assert "Terminating" in (tmp_path / "logs" / "p0.log").read_text()


def test_a_killed_process_that_ends_late_is_still_the_one_named(tmp_path, capsys, monkeypatch):
    """CI: SIGKILL reached process 1 while a thread of it waited in the kernel (a checkpoint's
    fsync), so it ended after gloo had aborted process 0 and after the supervisor looked again:
    process 0 was named, and process 1 was counted among those the supervisor stopped."""
    import dlrm_jax.parallel.launch as launch

    aborts_first = [sys.executable, "-c", "import os, time; time.sleep(0.2); os.abort()"]
    killed_later = ["sh", "-c", "sleep 2.5; kill -9 $$"]  # the SIGKILL already waits on it
    pending = {}
    monkeypatch.setattr(launch, "signal_pending", lambda pid: pending.setdefault("pid", pid) == pid)
    rc = launch.supervise([aborts_first, killed_later], "RESUME", tmp_path / "logs")
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("[launch] process ")]
    assert line.startswith("[launch] process 1 was ended by SIGKILL;"), line
    assert rc == 128 + 9


@pytest.mark.slow
def test_signal_pending_reads_the_kernels_masks():
    import signal
    import subprocess

    from dlrm_jax.parallel.launch import signal_pending

    # A pending SIGKILL cannot be held back on purpose (only a thread asleep in the kernel
    # delays it); a blocked SIGUSR2 stays pending the same way.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.pthread_sigmask("
            "signal.SIG_BLOCK, {signal.SIGUSR2}); print(flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        proc.stdout.readline()
        assert not signal_pending(proc.pid, signal.SIGUSR2)
        proc.send_signal(signal.SIGUSR2)
        deadline = time.time() + 10
        while not signal_pending(proc.pid, signal.SIGUSR2):
            assert time.time() < deadline
            time.sleep(0.01)
        assert not signal_pending(proc.pid)  # SIGKILL: not sent
        assert not signal_pending(2**22 + 12345)  # no such process
    finally:
        proc.kill()
        proc.wait()


def test_errors_that_are_not_faults_get_no_resume_advice(tmp_path, capsys):
    """A config error (every process exits 2) is relayed as it is: no 'run ... to resume'."""
    config_error = [
        sys.executable,
        "-c",
        "import sys; print('dlrm-jax: config error: train.stepz', file=sys.stderr); sys.exit(2)",
    ]
    assert supervise([config_error, config_error], "RESUME", tmp_path / "logs", tmp_path / "run") == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("[launch] process ")]
    assert "config error: train.stepz" in line and "RESUME" not in line and "resume" not in line
    assert not (tmp_path / "run").exists()  # no run dir (and no run/launch) made for it


def test_gloo_and_grpc_lines_stay_off_the_terminal(tmp_path, capsys):
    noisy = [
        sys.executable,
        "-c",
        "import sys; print('[Gloo] Rank 0 is connected to 1 peer ranks.'); print('1'); "
        "print('1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1'); "
        "print('Additional GRPC error information from remote target coordinator', file=sys.stderr); "
        "print('E0000 00:00:1764070003.123456   12345 socket_utils.cc:9] Socket closed', file=sys.stderr); "
        "print(':UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:\"Socket closed\"}', file=sys.stderr)",
    ]
    assert supervise([noisy], "RESUME", tmp_path / "logs") == 0
    out = capsys.readouterr()
    assert "Gloo" not in out.out and "Socket closed" not in out.err
    assert "peer ranks" not in out.out and "[p0] 1" not in out.out and "GRPC" not in out.err
    assert "grpc_status" not in out.err  # (a lost peer's line, after kill -9 of process 0)


@pytest.mark.slow
def kill_and_outlive(supervisor, pid: int, deadline: float) -> None:
    """SIGKILL ``supervisor`` and wait (until ``deadline``) for its child ``pid`` to end."""
    import os
    import signal

    supervisor.send_signal(signal.SIGKILL)
    supervisor.wait(timeout=10)
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError("the child outlived its supervisor")


def test_a_process_ends_with_the_supervisor_even_when_that_is_sigkilled(tmp_path):
    """A child of the launch (DLRM_JAX_PARENT set) gets SIGTERM, the save-and-stop signal, when
    the supervisor dies, however it dies: before, both children trained on for 10-30 s holding
    the run-dir lock and then died without a checkpoint."""
    import subprocess

    child = (
        "import os, signal, sys, time\n"
        "from dlrm_jax import stopping\n"
        "signal.signal(signal.SIGTERM, lambda *_: (print('stopped by SIGTERM', flush=True), sys.exit(0)))\n"
        "stopping.die_with_launcher()\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = (
        "import os, subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=open({str(tmp_path / 'out')!r}, 'w'), "
        "env={**os.environ, 'DLRM_JAX_PARENT': str(os.getpid())})\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    sup = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    pid = int(sup.stdout.readline())
    deadline = time.time() + 30
    while "ready" not in (tmp_path / "out").read_text() if (tmp_path / "out").exists() else True:
        assert time.time() < deadline
        time.sleep(0.05)
    kill_and_outlive(sup, pid, deadline)
    assert "stopped by SIGTERM" in (tmp_path / "out").read_text()


def test_the_parent_death_signal_once_per_supervisor_thread_is_one_stop(tmp_path):
    """Linux sends the parent-death signal as each thread of the parent ends (the child is
    handed to a sibling thread until the last): a SIGKILLed supervisor on a loaded machine can
    deliver two SIGTERMs, and the second one ended the run at once, unsaved ("stopped at once
    by SIGTERM" in a full test run, never alone). Here the thread that started the child ends
    first (one signal, the supervisor alive), then the supervisor is killed (another): the
    child stops once, as the first notice said."""
    import subprocess

    out = tmp_path / "out"
    child = (
        "import time\n"
        "from dlrm_jax import stopping\n"
        "from dlrm_jax.train.stop_signals import StopSignals\n"
        "stopping.die_with_launcher()\n"
        "with StopSignals() as s:\n"
        "    print('ready', flush=True)\n"
        "    t = time.time()\n"
        "    while time.time() - t < 30 and not (s.signum and stopping.launcher_gone()):\n"
        "        time.sleep(0.05)\n"
        "    time.sleep(1.0)  # the supervisor's other threads end meanwhile\n"
        "    print(f'stopping as asked by signal {s.signum}', flush=True)\n"
    )
    parent = (
        "import os, subprocess, sys, threading, time\n"
        "box = []\n"
        "def start():  # this thread is the child's parent thread: its end sends the signal once\n"
        f"    f = open({str(out)!r}, 'w')\n"
        "    env = {**os.environ, 'DLRM_JAX_PARENT': str(os.getpid()), "
        f"'DLRM_JAX_LOG': {str(out)!r}}}\n"
        f"    box.append(subprocess.Popen([sys.executable, '-c', {child!r}], stdout=f, stderr=f, env=env))\n"
        f"    while 'ready' not in open({str(out)!r}).read():\n"
        "        time.sleep(0.05)\n"
        "t = threading.Thread(target=start)\n"
        "t.start()\n"
        "t.join()\n"
        "print(box[0].pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    sup = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    pid = int(sup.stdout.readline())
    deadline = time.time() + 30
    while "the run finishes what it is doing" not in out.read_text():  # the first signal, noted
        assert time.time() < deadline, out.read_text()
        time.sleep(0.05)
    kill_and_outlive(sup, pid, deadline)
    text = out.read_text()
    assert "stopping as asked by signal 15" in text and "stopped at once" not in text, text


BIND = """
import socket
from dlrm_jax.parallel.coordination import initialize_distributed
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
initialize_distributed(f"127.0.0.1:{port}", 1, 0, join_timeout_s=30)
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A" and int(local.split(":")[1], 16) == port:  # a listener on the coordinator's port
            print(local.split(":")[0])
"""


@pytest.mark.slow
def test_the_coordination_service_listens_only_where_it_was_told():
    """Before its fix: process 0's coordinator listened on every interface (*:PORT) although every
    process was told 127.0.0.1:PORT; anyone reaching the host could talk to it."""
    import subprocess

    from tests.child_env import child_env

    out = subprocess.run(
        [sys.executable, "-c", BIND],
        capture_output=True,
        text=True,
        timeout=120,
        env={**child_env(drop=()), "JAX_PLATFORMS": "cpu"},
    )
    listeners = out.stdout.split()
    assert listeners, out.stderr
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, and as IPv4-mapped IPv6
    assert set(listeners) <= loopback, listeners


CLUSTER = ("JAX_PLATFORMS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS")


@pytest.mark.parametrize(
    "flags,says",
    [
        # Before: trained alone on its own devices and exited 0 (on a cluster: a model per host)
        ((None, 2, 0), "--num-processes 2 without --coordinator: this process would train alone"),
        ((None, None, 1), "--process-id 1 without --coordinator"),
        # Before: JAX's bare "Number of processes must be defined."
        (
            ("h:1", None, None),
            "--coordinator h:1: also give --num-processes N (every process the same) and --process-id",
        ),
        (("h:1", 2, None), "--coordinator h:1: also give --num-processes N"),
        (("h:1", 2, 2), "--process-id 2: expected 0 to 1 (--num-processes 2)"),
        (("h:1", 0, 0), "--num-processes 0: expected an integer >= 1"),
        # Before: "process 1 did not join 127.0.0.1:99999 within 300 s"
        (("127.0.0.1:99999", 2, 0), "--coordinator 127.0.0.1:99999: expected HOST:PORT with a port from 1 to 65535"),
        (("nohost", 2, 0), "--coordinator nohost: expected HOST:PORT"),
    ],
)
def test_process_flags_that_cannot_make_one_run_are_one_line(monkeypatch, flags, says):
    from dlrm_jax.config import ConfigError
    from dlrm_jax.parallel.coordination import check_processes

    for k in CLUSTER[1:]:
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ConfigError, match=f"^{re.escape(says)}"):
        check_processes(*flags)
    check_processes("h:1", 2, 1, 8)
    check_processes(None, 1, 0)  # one process: nothing to join
    monkeypatch.setenv("SLURM_JOB_ID", "7")  # the cluster's environment says who joins
    check_processes(None, 2, 0)


@pytest.mark.slow
def test_devices_that_do_not_split_over_the_processes_are_named(tmp_path):
    """Before: `launch_local.sh 3 --set mesh.devices=8` said each process had only 6 devices and
    blamed request_cpu_devices, which the CLI had called: 8 devices do not split over 3."""
    from tests.child_env import child_env

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dlrm_jax.parallel.launch",
            "3",
            "--set",
            "mesh.devices=8",
            "--run-dir",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(drop=CLUSTER),
    )
    says = (
        "mesh.devices=8 does not split over --num-processes 3: every process takes an equal share of the "
        "devices; use a multiple of 3 devices, or a process count that divides 8"
    )
    assert proc.returncode == 2, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("[launch] process ") and "pid" not in x]
    assert re.match(rf"\[launch\] process \d exited with status 2: config error: {re.escape(says)}; the others", line)
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_several_processes_without_a_coordinator_are_refused_before_a_run_dir(tmp_path):
    from tests.child_env import cli

    proc = cli("train", "--num-processes", "2", "--process-id", "0", "--run-dir", str(tmp_path / "r"), drop=CLUSTER)
    assert proc.returncode == 2 and proc.stderr.startswith("dlrm-jax: config error: --num-processes 2 without")
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "args, chosen",
    [
        (["--config", "smoke"], True),
        (["train", "--config", "smoke", "--run-dir", "mine"], False),
        (["--config", "smoke", "--run-dir=mine"], False),
        (["--config", "smoke", "--run", "mine"], False),  # argparse's abbreviation
        (["eval", "--run-dir", "mine"], False),
    ],
)
def test_a_local_launch_names_the_run_dir_it_trains_in_and_the_resume_command_names_it(
    tmp_path, monkeypatch, args, chosen
):
    """Without --run-dir every process used process 0's runs/<time>, so the logs stayed in /tmp
    and the command that the supervisor gave to resume after a fault started afresh instead."""
    from dlrm_jax.parallel import launch

    seen = {}
    monkeypatch.setattr(
        launch, "supervise", lambda argvs, resume, log_dir, run_dir, resumes: seen.update(locals()) or 0
    )
    monkeypatch.setattr(launch.tempfile, "mkdtemp", lambda prefix: str(tmp_path / prefix))
    monkeypatch.setenv("DLRM_JAX_LAUNCH_AS", "scripts/launch_local.sh 2 " + " ".join(args))
    assert launch.main(["2", *args]) == 0
    run_dir = seen["run_dir"]
    if not chosen:
        assert seen["resume"] == "scripts/launch_local.sh 2 " + " ".join(args)
        assert run_dir == Path("mine")
        return
    assert seen["resumes"] == (args[:1] != ["eval"])
    assert re.fullmatch(r"runs/\d{8}-\d{6}", str(run_dir))
    assert seen["resume"] == f"scripts/launch_local.sh 2 --config smoke --run-dir {run_dir}"
    for argv in seen["argvs"]:  # every process trains in it
        assert argv[argv.index("--run-dir") + 1] == str(run_dir)


def test_each_launch_keeps_its_logs_and_a_lost_peer_or_a_stop_gets_the_resume_command(tmp_path, capsys):
    """Before: a resume's (or an eval's) logs replaced the logs of the launch before it, which
    the fault's line had named; a peer lost to the watchdog ("lost process(es) 1 of 2") or a
    Ctrl-C gave no command to resume (without --run-dir, "the same command" started afresh) and
    left the logs in /tmp."""
    import signal

    from dlrm_jax.parallel.launch import RESUME_ENV
    from dlrm_jax.parallel.watchdog import PEER_LOST_ADVICE

    run = tmp_path / "run"
    (run / "checkpoints" / "20").mkdir(parents=True)
    lost = [
        sys.executable,
        "-c",
        "import sys; print('dlrm-jax: error: process 0: lost process(es) 1 of 2; the newest checkpoint is "
        f"intact: {PEER_LOST_ADVICE} to resume', "
        "file=sys.stderr); sys.exit(1)",
    ]
    assert supervise([lost], "RESUME", tmp_path / "logs1", run) == 1
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("[launch] process ")]
    assert "the newest checkpoint is intact: run `RESUME` to resume" in line, line
    assert PEER_LOST_ADVICE not in line  # (the process's own advice: once, as the command to run)
    (first,) = (run / "launch").iterdir()
    assert str(first) in line and "lost process(es)" in (first / "p0.log").read_text()
    # Ctrl-C (here a child's SIGINT to the supervisor, which forwards it): each saves and stops.
    stops = [
        sys.executable,
        "-c",
        "import os, signal, sys, time; signal.signal(signal.SIGINT, lambda *a: sys.exit(130)); "
        f"print(os.environ[{RESUME_ENV!r}], flush=True); os.kill(os.getppid(), signal.SIGINT); time.sleep(30)",
    ]
    old = signal.getsignal(signal.SIGINT)
    assert supervise([stops], "RESUME --run-dir R", tmp_path / "logs2", run) == 130
    assert signal.getsignal(signal.SIGINT) is old
    out = capsys.readouterr()
    assert "[p0] RESUME --run-dir R" in out.out  # what the process's own line names
    (line,) = [x for x in out.err.splitlines() if x.startswith("[launch] process ")]
    assert "exited with status 130" in line and "run `RESUME --run-dir R` to resume" in line, line
    assert len(list((run / "launch").iterdir())) == 2 and (first / "p0.log").exists()
    # SIGTERM sent to a process, not to the supervisor: the processes stop together, saved.
    termed = [sys.executable, "-c", "import sys; sys.exit(143)"]
    assert supervise([termed], "RESUME", tmp_path / "logs5", run) == 143
    assert "run `RESUME` to resume" in capsys.readouterr().err
    # A command that does not resume (eval) is run again; one that ends well without a run dir
    # leaves no logs behind in /tmp.
    assert supervise([lost], "EVAL", tmp_path / "logs3", None, resumes=False) == 1
    assert "; run `EVAL` again" in capsys.readouterr().err
    # A stop before the run's first checkpoint: nothing to resume from, so it says to run again
    # (before: 'the newest checkpoint is intact', of none).
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert supervise([termed], "RESUME", tmp_path / "logs6", fresh) == 143
    assert "; run `RESUME` again" in capsys.readouterr().err
    assert supervise([[sys.executable, "-c", "print(1)"]], "OK", tmp_path / "logs4") == 0
    assert not (tmp_path / "logs4").exists()


def test_commands_of_one_process_are_refused_by_the_launcher(capsys):
    from dlrm_jax.parallel import launch

    assert launch.main(["2", "plan", "--config", "smoke"]) == 2
    assert "runs train, eval or profile; plan runs in one process: dlrm-jax plan" in capsys.readouterr().err


def test_help_gives_both_forms_of_the_launcher(capsys):
    """docs/multi-host.md's ``--process-id I`` form: --help gave only the local form, and
    exited 2 as for a wrong argument."""
    from dlrm_jax.parallel import launch

    assert launch.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert " N [train|eval|profile]" in out and "--process-id I dlrm-jax" in out
    assert launch.main([]) == 2 and "--process-id I" in capsys.readouterr().err


def test_a_coordinator_port_in_use_is_one_line_not_a_crash():
    """Before: process 0's coordination service crashed the process (a segmentation fault, or
    'UNKNOWN: Failed to start RPC server') when another program held its port."""
    import socket

    from dlrm_jax.config import ConfigError
    from dlrm_jax.parallel.coordination import _check_listenable

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        address = f"127.0.0.1:{held.getsockname()[1]}"
        with pytest.raises(ConfigError, match=f"--coordinator {address}: process 0 cannot listen on {address}"):
            _check_listenable(address, address)
    _check_listenable(address, address)  # free again


def test_a_cluster_launch_names_its_process_by_its_index(tmp_path, capsys):
    """Before: each host's supervisor (python -m dlrm_jax.parallel.launch --process-id I ...)
    called its process 0, in its lines' [p0] prefix, its end line and its log's name."""
    ends = [sys.executable, "-c", "import sys; print('hello'); sys.exit(1)"]
    assert supervise([ends], "R", tmp_path / "logs", first_index=3) == 1
    out = capsys.readouterr()
    assert "[p3] hello" in out.out and "[launch] process 3 exited with status 1" in out.err, out
    assert (tmp_path / "logs" / "p3.log").exists()


def test_a_processs_argument_error_is_the_launchs_reason(tmp_path, capsys):
    """Before: 'process 0 exited with status 2; the others were stopped', without argparse's
    line ('dlrm-jax eval: error: ...', which the end line did not read as an error)."""
    bad = [
        sys.executable,
        "-c",
        "import sys; print('dlrm-jax eval: error: the following arguments are required: --run-dir', file=sys.stderr); sys.exit(2)",
    ]
    assert supervise([bad], "R", tmp_path / "logs") == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("[launch] process ")]
    assert "exited with status 2: dlrm-jax eval: error: the following arguments are required: --run-dir" in line, line


def test_the_process_whose_error_it_is_is_named_not_the_one_that_stopped_with_it(tmp_path, capsys):
    """Process 0 stops with process 1's failure and says so: the end line names process 1 and
    its own line (before: process 0, the lower index, and its second-hand line)."""
    from dlrm_jax.parallel.watchdog import STOPS_WITH_IT

    said = "dlrm-jax: error: data.bin: row 7 has id 999 out of range"
    stops = f"dlrm-jax: error: process 0: process 1 failed, {STOPS_WITH_IT}: {said[10:]}"
    procs = [
        [sys.executable, "-c", f"import sys, time; time.sleep(0.3); print({stops!r}, file=sys.stderr); sys.exit(1)"],
        [sys.executable, "-c", f"import sys; print({said!r}, file=sys.stderr); sys.exit(1)"],
    ]
    assert supervise(procs, "R", tmp_path / "logs") == 1
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("[launch] process ")]
    assert line.startswith("[launch] process 1 exited with status 1: error: data.bin: row 7"), line
    assert "resume" not in line  # (the command's own failure: a restart fails the same way)


def test_a_refused_launch_leaves_no_logs_behind(tmp_path, capsys):
    """Before: a launch refused before it ran (a config error, exit 2) kept each process's
    one refusal line in a log folder in /tmp, named on its end line, one per try."""
    says = "print('dlrm-jax: config error: train.steps=-1: expected >= 1', file=sys.stderr)"
    refused = [sys.executable, "-c", f"import sys; {says}; sys.exit(2)"]
    assert supervise([refused, refused], "RESUME", tmp_path / "logs") == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("[launch] process ")]
    assert (
        line.startswith("[launch] process 0 exited with status 2: config error: train.steps=-1")
        and "output" not in line
    )
    assert not (tmp_path / "logs").exists()
    crashed = [sys.executable, "-c", "import sys; sys.exit(1)"]  # a crash keeps its logs, and names them
    assert supervise([crashed], "RESUME", tmp_path / "logs2") == 1
    assert f"(each process's full output: {tmp_path / 'logs2'})" in capsys.readouterr().err


def test_the_flags_every_process_shares_are_compared_eval_step_among_them(monkeypatch):
    """eval with another --step on each process read two checkpoints as one, called damaged."""
    import argparse

    import jax

    import dlrm_jax.parallel.coordination as coordination
    from dlrm_jax.cli import runtime
    from dlrm_jax.config import ConfigError

    compared = []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(coordination, "check_same_everywhere", lambda shared, what: compared.append((shared, what)))
    runtime._check_same_command(argparse.Namespace(step=360), 2, 4)
    runtime._check_same_command(argparse.Namespace(), None, 0)
    assert compared == [
        ({"mesh.devices": "4", "--step": "360"}, "command lines"),
        ({"mesh.devices": "0"}, "command lines"),
    ]
    with pytest.raises(ConfigError, match="--num-processes 3: the coordinator's run has 2 processes"):
        runtime._check_same_command(argparse.Namespace(), 3, 0)
