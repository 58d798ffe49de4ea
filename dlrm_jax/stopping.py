"""SIGINT, SIGTERM and SIGHUP outside the training loop (loading, compiling, restoring): one line
and exit status 128 + signal, where SIGTERM's (and a closed terminal's SIGHUP's) default action
would end the process without a word. Inside the loop the trainer's own handlers finish the step,
save and exit on the same three. :func:`die_with_parent` ends a process with the one that
started it (a launch supervisor, preprocessing's parent), even when that one is SIGKILLed; a
process whose supervisor is gone writes on into its log file (:func:`divert_if_orphaned`).

The handler raises :class:`Stopped` where the main thread happens to be. Python swallows an
exception raised inside a garbage-collection or ``__del__`` callback (JAX runs one at every
collection), so the stop is also kept here, and honoured at the next :func:`raise_if_stopped`:
the training loop's start, and the command's end.

Not while JAX works natively (:func:`deferred`): jaxlib compiles on its client's thread pool
and waits for the compile in a way a signal interrupts; the stop's exception then ends the
process, whose exit tears the client down under the compile still running, which touches it:
a segfault after "stopped by SIGTERM" (rc -11; seen 4 times in 8 stops during start-up on a
machine at load 15-22). Inside :func:`deferred` a stop is kept and honoured at the block's
end or at the next :func:`raise_if_stopped`, after a line saying so; a second one ends the
process at once (:func:`exit_now`), without tearing anything down.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import inspect
import logging
import os
import signal
import sys
import threading

__all__ = [
    "STOP_SIGNALS",
    "Stopped",
    "deferred",
    "die_with_launcher",
    "die_with_parent",
    "divert_if_orphaned",
    "launcher_gone",
    "repeats_parent_death",
    "exit_now",
    "keep_output_going",
    "say",
    "stop_lines_to",
    "signal_words",
    "raise_if_stopped",
    "stop_on_signals",
    "take_pending",
]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_SIGNALS = STOP_SIGNALS
_pending: int | None = None
_installed = False  # stop_on_signals' handlers are in place (the command line, not a notebook)


class Stopped(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP outside the training loop (whose own handlers finish the step
    and save)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_deferring: list[str] = []  # what each open deferred() block waits for, innermost last
_AT_ONCE = "at once"  # a block whose work keeps nothing (eval): a stop ends it without waiting


def _stop(signum, frame):
    global _pending
    diverted_now = divert_if_orphaned()  # SIGTERM from a supervisor's death: its pipes are gone
    if _pending is not None and repeats_parent_death(signum):
        if diverted_now:  # the first one's line went to the dead supervisor's pipe
            say(f"dlrm-jax: {signal_words(signum)[0]}: the launch supervisor ended; stopping as said")
        return
    if not _deferring:
        _pending = signum
        raise Stopped(signum)
    if _pending is not None or _deferring[-1] == _AT_ONCE:  # asked twice, or nothing to wait for
        exit_now(signum, saves="nothing to save" if _deferring[-1] == _AT_ONCE else None)
    _pending = signum
    name, again = signal_words(signum)
    say(
        f"dlrm-jax: {name}: stopping once {_deferring[-1]} is done (native work under way there "
        f"cannot be abandoned safely); {again} to stop at once without saving"
    )


def take_pending() -> int | None:
    """The stop signal kept by :func:`deferred` (None: none), now forgotten: for a block whose
    work was done whole when it came (an export), so the command ends as done, not stopped."""
    global _pending
    signum, _pending = _pending, None
    return signum


def raise_if_stopped() -> None:
    """Raise :class:`Stopped` if a signal arrived and its exception was swallowed on the way,
    or was kept by :func:`deferred`: a point where nothing native is waited for."""
    if _pending is not None:
        raise Stopped(_pending)


@contextlib.contextmanager
def deferred(what: str, keeps_nothing: bool = False):
    """Within the block a stop signal is kept, not raised (see the module's docstring), and
    raised as :class:`Stopped` when the block ends; ``what``: what the stop waits for, in the
    line printed at once (e.g. "the run's start"). ``keeps_nothing``: the block's work is lost
    by a stop anyway (an evaluation's scores), so the first signal ends the process at once, as
    a second one does elsewhere. A no-op where :func:`stop_on_signals` has not installed the
    handlers (a notebook keeps Python's own KeyboardInterrupt)."""
    _deferring.append(_AT_ONCE if keeps_nothing else what)
    try:
        yield
    finally:
        _deferring.pop()
    raise_if_stopped()


def exit_now(signum: int, saves: str | None = None) -> None:
    """A second stop signal: one line and exit status 128 + signal, at once. No exception
    unwinds and nothing is torn down (a native compile, a step or a save in flight could
    crash the exit); checkpoints already committed stay intact, the run dir's lock goes with
    the process. ``saves``: what the line says of saving (default: nothing since the last checkpoint).

    Called from Python (a notebook: :func:`stop_on_signals` not installed), the process is the
    user's kernel and lives on: :class:`Stopped` is raised instead, as Python's own Ctrl-C
    would be (it ended the kernel, and every variable with it)."""
    saves = saves or "nothing saved since the last checkpoint"
    say(f"dlrm-jax: stopped at once by {signal.Signals(signum).name}: {saves}")
    if not _installed:
        raise Stopped(signum)
    os._exit(128 + signum)


def handling_stops() -> bool:
    """Whether :func:`stop_on_signals`' handlers are in place: the command line's process,
    which a stop signal may end, not a notebook's kernel."""
    return _installed


def exiting(status: int) -> None:
    """The program's work is done and said, and it exits with ``status``: from here a stop
    signal ends it at once with that status, quietly. (At exit JAX's distributed runtime takes
    leave of its peers, which can wait on them; Python's own handler, back by then, raised
    KeyboardInterrupt inside that clean-up: a traceback after the run's last line.) A no-op off
    the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return

    def end(signum, frame):
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)

    for sig in _SIGNALS:
        signal.signal(sig, end)


def signal_words(signum: int) -> tuple[str, str]:
    """The signal's name, and how to send it again."""
    name = signal.Signals(signum).name
    return name, "press Ctrl-C again" if signum == signal.SIGINT else f"send {name} again"


def say(line: str) -> None:
    """Writes ``line`` to stderr at once, safe inside a signal handler: to the terminal's where
    fd 2 is pointed at a log for a while (:func:`stop_lines_to`), and where stderr is gone (a
    closed terminal, a reader that ended) to where the output was diverted."""
    # os.write, not print: a handler may run in the middle of another write to stderr.
    data = (line + "\n").encode()
    if (_say_fd is not None and _written(_say_fd, data)) or _written(2, data):
        return
    if divert_if_orphaned() or _divert_output(2):
        _written(2, data)


def _written(fd: int, data: bytes) -> bool:
    try:
        os.write(fd, data)
        return True
    except OSError:
        return False


_say_fd: int | None = None  # where say() writes first (stop_lines_to); None: fd 2


@contextlib.contextmanager
def stop_lines_to(fd: int):
    """:func:`say` writes to ``fd`` in the ``with`` body: the terminal's stderr, kept while fd 2
    is pointed at a log (a restore's native noise). Its lines went to the log: a stop during a
    restore printed nothing, and a second Ctrl-C then ended the run without a word."""
    global _say_fd
    before, _say_fd = _say_fd, fd
    try:
        yield
    finally:
        _say_fd = before


def stop_on_signals():
    """Install the handlers; returns the function that puts the old ones (and the old
    ``sys.unraisablehook``) back. A no-op off the main thread, where handlers cannot be set."""
    global _pending, _installed
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    _pending, _installed = None, True
    old = {sig: signal.signal(sig, _stop) for sig in _SIGNALS}
    old_hook = sys.unraisablehook

    def unraisable(info):  # "Exception ignored in ...": the stop is pending, not lost; say nothing
        if isinstance(info.exc_value, Stopped):
            return
        if inspect.iscoroutine(info.object):
            # A library's read abandoned when a sibling failed (orbax's, of a damaged checkpoint,
            # whose failure is reported in one line): with asyncio's own such reports, to the run
            # dir's log (train.library_log), not 60 lines each on the terminal.
            logging.getLogger("asyncio").error(
                "Exception ignored in %r", info.object, exc_info=(info.exc_type, info.exc_value, info.exc_traceback)
            )
            return
        old_hook(info)

    sys.unraisablehook = unraisable

    def restore():
        global _pending, _installed
        for sig, handler in old.items():
            signal.signal(sig, handler)
        sys.unraisablehook = old_hook
        _pending, _installed = None, False

    return restore


PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGTERM, parent: int | None = None, owner: int | None = None) -> None:
    """Have the kernel send this process ``signum`` when its parent ends, however it ends
    (Linux; a no-op elsewhere). The kernel sends nothing for a parent that ended before this
    call, so: ``parent``, the pid expected as parent: if it is no longer ours, the signal is
    sent now; ``owner``, a process this one must not outlive (the parent itself, or the one a
    fork server that is the parent ends with): if it has ended, the signal is sent now."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if (parent is not None and os.getppid() != parent) or (owner is not None and ended(owner)):
        os.kill(os.getpid(), signum)


def ended(pid: int) -> bool:
    """Whether process ``pid`` has ended: gone, or a zombie not yet reaped (Linux's /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X", "x")


_launch: tuple[int, str] | None = None  # (the supervisor's pid, this process's log file)
_diverted: set[int] = set()  # the standard descriptors (1, 2) pointed at a log


def die_with_launcher() -> None:
    """In a process a launch supervisor started (``DLRM_JAX_PARENT`` holds its pid): SIGTERM,
    the save-and-stop signal, when the supervisor ends, even by SIGKILL; from then on the
    process's output goes to its log file (``DLRM_JAX_LOG``), see :func:`divert_if_orphaned`."""
    global _launch
    parent = os.environ.get("DLRM_JAX_PARENT", "")
    if not parent.isdigit():
        return
    _launch = (int(parent), os.environ.get("DLRM_JAX_LOG", ""))
    sys.stdout, sys.stderr = _Relayed(sys.stdout), _Relayed(sys.stderr)
    die_with_parent(signal.SIGTERM, int(parent))


def launcher_gone() -> bool:
    """Whether the launch supervisor that started this process has ended or is ending. Its pid
    stays our parent's until its last thread ends: a killed process loses its threads one by
    one, and Linux sends the parent-death signal as each parent *thread* ends (the child is
    handed to a sibling thread first). So its main thread's end (a zombie leader) counts too."""
    if _launch is None:
        return False
    return os.getppid() != _launch[0] or ended(_launch[0])


def repeats_parent_death(signum: int) -> bool:
    """A SIGTERM while the launch supervisor is gone, after a first stop signal: the kernel's
    parent-death signal again (once per supervisor thread that ends), not a second request to
    stop at once. SIGINT (or SIGKILL) still stops such a process at once."""
    return signum == signal.SIGTERM and launcher_gone()


def divert_if_orphaned() -> bool:
    """When the launch supervisor is gone, nothing reads the pipes it gave this process: the
    next line written would fail (EPIPE) and end the run wherever it happens to print, before
    it saves, while its peers wait for it in the save's barrier. Points standard output and
    error (file descriptors 1 and 2: native output too) at the process's log file instead
    (``/dev/null`` without one). Only system calls: safe in a signal handler. Returns whether
    it diverted them now."""
    if _launch is None or {1, 2} <= _diverted or not launcher_gone():
        return False
    _divert_to(_launch[1], (1, 2))
    return True


_output_log: str | None = None  # keep_output_going's file


@contextlib.contextmanager
def keep_output_going(log_path: str):
    """In the ``with`` body of a command whose work must outlive its output (``train``): a
    write to stdout or stderr that finds them gone (EPIPE: the reader ended, as ``| tee`` does
    on the Ctrl-C that stops the run; EIO: a closed terminal) diverts both to ``log_path`` and
    is made again there. It raised where the run happened to print, after the stop's line and
    before its save: the run ended without the checkpoint that line promised."""
    global _output_log
    streams = sys.stdout, sys.stderr
    _output_log = log_path
    if not isinstance(sys.stdout, _Relayed):
        sys.stdout, sys.stderr = _Relayed(sys.stdout), _Relayed(sys.stderr)
    try:
        yield
    finally:
        _output_log = None
        sys.stdout, sys.stderr = streams


def _divert_output(fd: int) -> bool:
    """:func:`keep_output_going`'s diversion of ``fd`` (1 or 2) alone, once: stdout gone with
    its reader (``| tee``) leaves stderr on the terminal; whether it diverted now."""
    if _output_log is None or fd in _diverted:
        return False
    _divert_to(_output_log, (fd,))
    return True


def _divert_to(path: str, fds: tuple[int, ...]) -> None:
    """``fds`` onto ``path`` (appended; ``/dev/null`` where it cannot be opened)."""
    try:
        fd = os.open(path or os.devnull, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
        fd = os.open(os.devnull, os.O_WRONLY)
    for standard in fds:
        os.dup2(fd, standard)
        _diverted.add(standard)
    os.close(fd)


_GONE = (errno.EPIPE, errno.EIO)  # a reader that ended; a terminal that hung up


class _Relayed:
    """``sys.stdout`` / ``sys.stderr`` of a launched process (or one that keeps its output
    going): a write or flush that finds the pipe or terminal gone diverts the output
    (:func:`divert_if_orphaned`, :func:`_divert_output`) and is made again there, instead of
    raising (a line may then appear twice in the log)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            return self._again(text, e)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            self._again("", e)

    def _again(self, text: str, error: OSError) -> int:
        fd = self._fd()
        if error.errno in _GONE and fd not in _diverted:
            divert_if_orphaned() or _divert_output(fd)
        if (
            error.errno not in _GONE or fd not in _diverted
        ):  # (a pipe closed with the supervisor alive: not ours to hide)
            raise error
        self._stream.write(text)
        self._stream.flush()
        return len(text)

    def _fd(self) -> int:
        try:
            return self._stream.fileno()
        except (OSError, ValueError, AttributeError):  # (a stream without one: taken as stderr)
            return 2

    def __getattr__(self, name):
        return getattr(self._stream, name)
