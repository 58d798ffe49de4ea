"""A command's work outlives its output: stdout and stderr that go (a reader that ended, a
terminal closed) are diverted to the run dir's log, not an error where the run happens to print."""

import os
import subprocess
import sys

import pytest

CHILD = """
import sys
from dlrm_jax import stopping
with stopping.keep_output_going(sys.argv[1]):
    print("a", flush=True)
    sys.stdin.readline()  # (the parent closes its end of our output meanwhile)
    for k in range(2000):  # (more than a pipe's buffer)
        print("line", k)
    sys.stdout.flush()
    stopping.say("the stop's line")
    print("done", file=sys.stderr)
"""


def test_stdout_gone_alone_leaves_stderr_on_the_terminal(tmp_path):
    """`dlrm-jax train ... | tee`: the Ctrl-C ends tee, not the terminal: the stop's lines on
    stderr still reach it (both were diverted to the log)."""
    log = tmp_path / "dlrm-jax.log"
    out_r, out_w = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(log)], stdin=subprocess.PIPE, stdout=out_w, stderr=subprocess.PIPE
    )
    os.close(out_w)
    assert os.read(out_r, 100).strip() == b"a"
    os.close(out_r)
    _, err = child.communicate(b"\n", timeout=60)
    assert child.returncode == 0 and err == b"the stop's line\ndone\n", err
    assert "line 1999\n" in log.read_text() and "done" not in log.read_text()


@pytest.mark.parametrize("gone", ["pipe", "terminal"])
def test_output_that_goes_is_diverted_to_the_log_and_the_work_goes_on(tmp_path, gone):
    """Before: a Ctrl-C that also ended `dlrm-jax train ... | tee` (or a closed terminal) ended
    the run with BrokenPipeError (EIO) at its next line, after the stop's notice and before the
    save it promised; the checkpoint was lost."""
    log = tmp_path / "dlrm-jax.log"
    if gone == "pipe":
        reader, writer = os.pipe()
    else:
        reader, writer = os.openpty()  # (the terminal's side, the program's side)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(log)], stdin=subprocess.PIPE, stdout=writer, stderr=writer
    )
    os.close(writer)
    assert os.read(reader, 100).strip() == b"a"
    os.close(reader)  # the reader ends; the terminal hangs up
    child.communicate(b"\n", timeout=60)
    assert child.returncode == 0
    text = log.read_text()
    assert "line 1999\n" in text and "the stop's line\n" in text and text.endswith("done\n"), text[-300:]


def test_a_stop_line_during_a_restore_reaches_the_terminal_not_the_log(tmp_path, capfd):
    """A restore points fd 2 at the run dir's log (tensorstore's native noise); a stop's line
    went there too: a Ctrl-C during a restore printed nothing, and a second one then ended the
    run without a word."""
    from dlrm_jax import stopping
    from dlrm_jax.train.checkpoint_reader import _native_noise_to

    with _native_noise_to(tmp_path / "dlrm-jax.log"):
        os.write(2, b"native noise\n")
        stopping.say("dlrm-jax: SIGINT: stopping once restoring the state is done")
    err = capfd.readouterr().err
    assert "stopping once restoring" in err and "native noise" not in err
    assert (tmp_path / "dlrm-jax.log").read_text() == "native noise\n"


def test_a_stop_while_an_export_is_made_ends_it_done_with_the_export_whole(monkeypatch, tmp_path, capsys):
    """Before: the stop waited for the export, which was written whole, then the command exited
    128 + signal, and a re-run into the same --output was refused as not empty."""
    import signal
    import types

    from dlrm_jax import stopping
    from dlrm_jax.cli.commands import export as command
    from dlrm_jax.train import export

    def exported(*args, **kwargs):
        stopping._stop(signal.SIGTERM, None)  # (a SIGTERM while it writes: kept by the command's deferral)
        return 7

    monkeypatch.setattr(command, "load_run_config", lambda *a: None)
    monkeypatch.setattr(command, "devices_for", lambda cfg: 1)
    monkeypatch.setattr(command, "start_jax", lambda *a: None)
    monkeypatch.setattr(command, "library_logs_to", lambda *a: None)
    monkeypatch.setattr(export, "export_run", exported)
    args = types.SimpleNamespace(run_dir=str(tmp_path), output=str(tmp_path / "out"), overrides=[], step=None)
    args.serving, args.since, args.tables = False, None, "float32"
    assert command.run(args) == 0
    stopping.raise_if_stopped()  # (nothing left pending)
    out, err = capsys.readouterr()
    assert out.endswith("exported step=7 to " + str(tmp_path / "out") + "\n")
    assert "SIGTERM came while the export was made; it is whole" in err
