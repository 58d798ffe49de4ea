"""The libraries' logging kept out of a notebook's output and its process-wide state."""

import asyncio
import logging
import resource
import subprocess
import sys
import types

import pytest

from dlrm_jax.train.library_log import closed_loops_logged, library_logs_in


def _closed_loop_error() -> BaseException:
    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(lambda: None)
    except RuntimeError as e:
        return e
    raise AssertionError("a closed loop took a callback")


def _unraisable(exc: BaseException, obj=None):
    return types.SimpleNamespace(
        exc_type=type(exc), exc_value=exc, exc_traceback=exc.__traceback__, err_msg=None, object=obj
    )


def test_callbacks_into_a_closed_loop_go_to_the_asyncio_log_and_nothing_else_does(caplog):
    """Before: a failed checkpoint write printed 0-40 'Event loop is closed' tracebacks from
    tensorstore's native threads before the one-line error."""
    seen = []
    before, record = sys.unraisablehook, seen.append
    sys.unraisablehook = record
    try:
        with caplog.at_level(logging.ERROR, "asyncio"), closed_loops_logged():
            sys.unraisablehook(_unraisable(_closed_loop_error()))
            other = _unraisable(RuntimeError("something else"))
            sys.unraisablehook(other)
            assert sys.unraisablehook is not record
        assert sys.unraisablehook is record  # as it was
    finally:
        sys.unraisablehook = before
    assert seen == [other]
    assert [r.getMessage() for r in caplog.records] == ["a callback into a closed event loop"]


def test_library_logs_in_the_run_dir_then_the_loggers_as_they_were(tmp_path):
    absl = logging.getLogger("absl")
    handlers, propagate = list(absl.handlers), absl.propagate
    with library_logs_in(tmp_path, 0):
        absl.error("from orbax")
        with library_logs_in(tmp_path, 0):  # (the command line's already in place: no second copy)
            absl.error("again")
    assert absl.handlers == handlers and absl.propagate == propagate
    lines = (tmp_path / "dlrm-jax.log").read_text().splitlines()
    assert [line.split(": ", 1)[1] for line in lines] == ["from orbax", "again"]
    with library_logs_in(tmp_path, 3):
        absl.error("process 3")
    assert "process 3" in (tmp_path / "dlrm-jax.3.log").read_text()


@pytest.mark.slow  # about 15 s on 2 cores
def test_a_checkpoint_that_cannot_be_written_from_python_is_one_error_and_no_tracebacks(tmp_path):
    """Before: train_and_evaluate under a file size limit printed 324 lines of orbax's thread
    tracebacks (its absl logger, which only the command line sent to the run dir's log) before
    raising CheckpointWriteError."""
    code = (
        "import dlrm_jax\n"
        "cfg = dlrm_jax.load_config('default', ['train.steps=2', 'train.checkpoint_every=2', 'mesh.devices=1'])\n"
        "try:\n"
        f"    dlrm_jax.train_and_evaluate(cfg, {str(tmp_path / 'run')!r}, log=None)\n"
        "except OSError as e:\n"
        "    print(type(e).__name__)\n"
    )
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # noqa: E731
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, preexec_fn=limit)
    assert out.stdout.strip() == "CheckpointWriteError", out.stderr
    # (orbax's reports name the error; a straggler tensorstore calls back with after the run's
    # handlers are gone, at the interpreter's exit, may still print: see the closing note)
    assert "File too large" not in out.stderr and "_SignalingThread" not in out.stderr, out.stderr
    assert "File too large" in (tmp_path / "run" / "dlrm-jax.log").read_text()


def test_the_root_loggers_stand_in_prints_only_what_no_handler_took(capfd):
    """While a run works the root logger holds a stand-in for Python's last resort (absl would
    configure it otherwise): a logger with a handler of its own was printed on stderr as well."""
    from dlrm_jax.jax_settings import root_logging_untouched

    root, own = logging.getLogger(), logging.getLogger("has_its_own")
    saved, root.handlers = root.handlers, []
    kept = []
    handler = logging.Handler()
    handler.emit = kept.append
    own.addHandler(handler)
    try:
        with root_logging_untouched():
            assert root.handlers  # (absl's basicConfig() does nothing)
            own.warning("to its own handler")
            logging.getLogger("has_none").warning("to stderr")
            logging.getLogger("has_none").info("nowhere")
        assert root.handlers == []
    finally:
        own.removeHandler(handler)
        root.handlers = saved
    assert [r.getMessage() for r in kept] == ["to its own handler"]
    assert capfd.readouterr().err == "to stderr\n"


def test_overlapping_runs_keep_the_stand_in_until_the_last_one_ends():
    """Before: a run evaluating while another trained (two threads) took the other's stand-in for
    the notebook's handler; the first to end removed it while the second worked, and absl's next
    message configured the root logger for good."""
    from dlrm_jax.jax_settings import root_logging_untouched

    root = logging.getLogger()
    saved, root.handlers = root.handlers, []
    try:
        first, second = root_logging_untouched(), root_logging_untouched()
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        assert len(root.handlers) == 1  # (the second still works under it)
        second.__exit__(None, None, None)
        assert root.handlers == []
    finally:
        root.handlers = saved


def test_the_command_line_called_in_a_notebook_leaves_its_loggers_and_sigusr1(tmp_path, capsys):
    """Before: each in-process dlrm_jax.cli.main(...) left a handler on absl's and asyncio's
    loggers for good (their messages into an old run's log) and SIGUSR1 taken for stack dumps."""
    import os
    import signal

    from dlrm_jax.cli import main

    got = []
    before = signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
    try:
        for run in ("a", "b"):  # (refused after its run dir's log was set up)
            argv = ["train", "--set", "mesh.devices=8", "--set", "data.host_memory=pinned", "--run-dir"]
            assert main([*argv, str(tmp_path / run)]) == 2
        os.kill(os.getpid(), signal.SIGUSR1)
    finally:
        signal.signal(signal.SIGUSR1, before)
    assert got == [signal.SIGUSR1]
    for name in ("absl", "asyncio"):
        assert logging.getLogger(name).handlers == [] and logging.getLogger(name).propagate


def test_no_progress_bar_is_made_without_a_terminal():
    """tqdm's bar, even disabled, fixed the process's multiprocessing start method (a notebook's
    set_start_method('spawn') then refused) and left its monitor thread."""
    import io

    from dlrm_jax.train.display import StepDisplay

    shown = StepDisplay(
        10, 0, bar=True, shown=True, batch=4, epoch_rows=None, log=lambda *_: None, stream=io.StringIO()
    )
    assert shown.bar is None
    shown.update(1)
    shown.close()


def test_a_run_dirs_log_that_cannot_take_its_last_lines_closes_without_raising(tmp_path):
    from dlrm_jax.train.library_log import RunDirLog

    class Full:
        def write(self, _):
            raise OSError(28, "No space left on device")

        def flush(self):
            raise OSError(28, "No space left on device")

        def close(self):
            pass

    handler = RunDirLog(tmp_path / "dlrm-jax.log")
    handler.stream = Full()
    handler.close()  # (a bare OSError replaced the run's own error before)
