"""The libraries' own logging (orbax's, through absl; asyncio's) kept in the run dir's
``dlrm-jax.log``: their multi-line reports of a failure the run reports in one line (a
checkpoint that could not be written: 324 lines of orbax's thread tracebacks) stay out of the
terminal and the notebook. A run dir that cannot be written loses them rather than printing
them."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

LIBRARIES = ("absl", "asyncio")  # asyncio: "Task exception was never retrieved" of a failed restore


def log_path(run_dir: Path, process_index: int) -> Path:
    return run_dir / ("dlrm-jax.log" if process_index == 0 else f"dlrm-jax.{process_index}.log")


def send_library_logs(run_dir: Path, process_index: int) -> RunDirLog:
    """Send the libraries' messages to ``run_dir``'s log from now on (the command line's
    commands: the process ends with them); returns the handler."""
    handler = RunDirLog(log_path(run_dir, process_index))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in LIBRARIES:
        library = logging.getLogger(name)
        library.addHandler(handler)
        library.propagate = False
    return handler


@contextlib.contextmanager
def library_logs_in(run_dir: Path, process_index: int) -> Iterator[None]:
    """:func:`send_library_logs` for the ``with`` body (a run from Python), then the loggers as
    they were. Where they already write to this log (the command line's), nothing changes."""
    path = os.path.abspath(log_path(run_dir, process_index))  # (as FileHandler holds it)
    loggers = [logging.getLogger(name) for name in LIBRARIES]
    if any(isinstance(h, RunDirLog) and h.baseFilename == path for h in loggers[0].handlers):
        yield
        return
    before = [lg.propagate for lg in loggers]
    handler = send_library_logs(run_dir, process_index)
    try:
        yield
    finally:
        for lg, propagate in zip(loggers, before, strict=True):
            lg.removeHandler(handler)
            lg.propagate = propagate
        handler.close()


@contextlib.contextmanager
def closed_loops_logged() -> Iterator[None]:
    """For the ``with`` body, tensorstore's callbacks into an event loop orbax has closed go to
    the asyncio logger (so to the run dir's log, :func:`library_logs_in`), not the terminal.
    When a checkpoint's write fails, orbax closes the write's loop while tensorstore's other
    writes are still finishing; each then calls ``call_soon_threadsafe`` from a native thread
    and Python reports its RuntimeError as unraisable: 0-40 tracebacks ("Event loop is closed",
    6 lines each) before the one-line error that says what failed."""
    before = sys.unraisablehook

    def hook(info):
        if _into_a_closed_loop(info):
            logging.getLogger("asyncio").error("a callback into a closed event loop", exc_info=info.exc_value)
            return
        before(info)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = before


def _into_a_closed_loop(info) -> bool:
    """Whether an unraisable error is asyncio's refusal of a callback into a closed loop."""
    if not isinstance(info.exc_value, RuntimeError) or info.object is not None:
        return False
    tb = info.exc_traceback
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return (
        tb is not None and tb.tb_frame.f_code.co_name == "_check_closed" and "asyncio" in tb.tb_frame.f_code.co_filename
    )


def detach_library_logs() -> None:
    """The libraries' loggers as they were before :func:`send_library_logs` (the command line's,
    at its end: ``dlrm_jax.cli.main`` called in a notebook left a handler per command, and the
    loggers' own messages went into old runs' logs)."""
    for name in LIBRARIES:
        library = logging.getLogger(name)
        for handler in [h for h in library.handlers if isinstance(h, RunDirLog)]:
            library.removeHandler(handler)
            handler.close()
        library.propagate = True


class RunDirLog(logging.FileHandler):
    """A log file, and its run dir, made by the first message: a run that logs none leaves
    none, and a run refused before its run dir is made leaves no empty one. A file that cannot
    be written (read-only, another user's dir) loses the messages."""

    def __init__(self, path: Path):
        super().__init__(path, delay=True)

    def emit(self, record) -> None:
        try:
            Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
            super().emit(record)  # opens the file on the first message (delay)
        except OSError:
            pass

    def close(self) -> None:
        with contextlib.suppress(OSError):  # (buffered lines a full disk cannot take: lost, as above)
            super().close()

    def handleError(self, record) -> None:
        """A write that failed inside logging's own handler (a full disk): the message is lost,
        as above; logging's default printed each one's traceback to the terminal (hundreds of
        lines over a checkpoint that could not be written, which says so in one)."""
