"""The launch supervisor (dlrm_jax/parallel/launch.py) on stand-in processes: who it names."""

import sys

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
