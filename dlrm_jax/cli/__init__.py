"""``dlrm-jax``: the commands (``commands``, one module each), their shared flags (``args``) and
run-time helpers (``runtime``), the parser that lists them (``parser``); here, the program
itself: the huge-pages restart, signals, and one line per kind of failure.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys

from dlrm_jax import hostmem, stopping, wording
from dlrm_jax.cli.commands import by_name
from dlrm_jax.cli.parser import build_parser
from dlrm_jax.config import ConfigError

__all__ = ["build_parser", "main", "run"]


def run() -> int:
    """The ``dlrm-jax`` program: restarts itself once so that host memory (tables, and every
    buffer of simulated devices) gets transparent huge pages (:mod:`dlrm_jax.hostmem`), then
    runs :func:`main`. ``DLRM_JAX_HUGE_PAGES=0`` skips the restart."""
    env = hostmem.huge_pages_environment(dict(os.environ))
    if env is not None:
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "dlrm_jax", *sys.argv[1:]], env)
    status = _program()
    stopping.exiting(status)  # (a stop signal now ends the exit's clean-up, quietly)
    return status


def main(argv: list[str] | None = None) -> int:
    """``dlrm-jax`` with ``argv`` (default ``sys.argv[1:]``) in this process; its exit status.
    Called from Python (a notebook), it leaves the process as it found it: the libraries'
    loggers (their messages went into an old run's log, a handler per command) and SIGUSR1
    (taken for stack dumps, for good)."""
    try:
        return _program(argv)
    finally:
        from dlrm_jax.train.library_log import detach_library_logs

        detach_library_logs()
        with contextlib.suppress(AttributeError, ValueError, RuntimeError):
            faulthandler.unregister(signal.SIGUSR1)


def _program(argv: list[str] | None = None) -> int:
    """The program's work: the command, its signals and its one line per kind of failure."""
    args = build_parser().parse_args(argv)
    # `kill -USR1 PID` prints every thread's Python stack to stderr: where a stuck run waits.
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    except (AttributeError, ValueError):  # no stderr file (main() called in an embedding process)
        pass
    restore_signals = stopping.stop_on_signals()
    stopping.die_with_launcher()  # a launch supervisor that ends, even by SIGKILL, stops us (a SIGTERM)
    hostmem.keep_freed_memory()
    try:
        with wording.command_line():  # (advice names the flags, not the Python API's arguments)
            status = by_name()[args.command].run(args)
        stopping.raise_if_stopped()  # a signal whose exception Python swallowed (see stopping)
        return status
    except ConfigError as e:
        return _failed(f"dlrm-jax: config error: {e}", 2)
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"dlrm-jax: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:  # the reader of our output went (`predict --output - | head`): quietly
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no second error at exit's flush)
        return 128 + signal.SIGPIPE
    except (ValueError, OSError, NotImplementedError, FloatingPointError) as e:
        if os.environ.get("DLRM_JAX_DEBUG"):
            raise
        return _failed(f"dlrm-jax: error: {e}", 1)
    except Exception as e:
        if type(e).__name__ != "JaxRuntimeError" or os.environ.get("DLRM_JAX_DEBUG"):
            raise
        # A collective failed under us: in a multi-process run, a peer died or disconnected,
        # or ended with an error of its own (which it told: then that is the reason).
        first = str(e).strip().splitlines()[0][:300]
        from dlrm_jax.parallel.watchdog import lost_peer_advice, peer_failure, say_once

        if said := peer_failure():
            import jax

            return _failed(f"dlrm-jax: error: process {jax.process_index()}: {said}", 1)
        # (once: the watchdog, finding why later, said a second line)
        say_once(f"dlrm-jax: error: {first}; if another process died, {lost_peer_advice()}")
        return 1
    finally:
        restore_signals()


def _failed(line: str, status: int) -> int:
    """Says ``line`` and returns ``status``; in a run of several processes, the others are told
    (they may wait for this one inside a collective: they end with its line, in seconds)."""
    if "jax" not in sys.modules:  # (JAX never started: no other process to tell)
        print(line, file=sys.stderr)
        return status
    from dlrm_jax.parallel import watchdog

    watchdog.failing(status)
    print(line, file=sys.stderr, flush=True)
    watchdog.announce_failure(line)
    return status
