"""The launch supervisor (dlrm_jax/parallel/launch.py) on stand-in processes: who it names."""

import sys
import time

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
    assert "process(es) 0 aborted natively on losing it" in line and "run `RESUME` to resume" in line
    assert rc == 128 + 9


def test_native_log_lines_go_to_the_log_not_the_terminal(tmp_path, capsys):
    noisy = [sys.executable, "-c", "import sys; print('F1124 22:23:43.551884     617 client.h:80] Terminating', "
             "file=sys.stderr); print('    @     0x7f2a60840634  absl::LogMessage', file=sys.stderr); "
             "print('dlrm-jax: error: one line', file=sys.stderr); sys.exit(1)"]
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


def test_signal_pending_reads_the_kernels_masks():
    import signal
    import subprocess

    from dlrm_jax.parallel.launch import signal_pending

    # A pending SIGKILL cannot be held back on purpose (only a thread asleep in the kernel
    # delays it); a blocked SIGUSR2 stays pending the same way.
    proc = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.pthread_sigmask("
                             "signal.SIG_BLOCK, {signal.SIGUSR2}); print(flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
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
