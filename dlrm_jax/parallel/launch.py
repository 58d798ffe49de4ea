"""A supervisor for multi-process runs: starts the processes, watches them, and turns the way a
run ends into one line.

    python -m dlrm_jax.parallel.launch N [train|eval|profile] [dlrm-jax arguments...]
    python -m dlrm_jax.parallel.launch --process-id I [dlrm-jax command and arguments...]

The first form runs N processes on 127.0.0.1 (``scripts/launch_local.sh`` calls it); the second
wraps the one process of this host in a cluster launch (the command's own ``--coordinator``,
``--num-processes`` and ``--process-id`` given by the scheduler).

Why a supervisor: when a process dies, jaxlib 0.10.2's coordination client aborts some of the
survivors from a native thread (the coordinator's host lost, or a collective that a peer left
half done) with a C++ stack, which no Python code in that process can intercept (a Python
``missed_heartbeat_callback`` cannot receive the status: std::bad_cast). The supervisor sees
every child's end: on the first abnormal one it stops the others (what they hold is lost either
way; checkpoints are committed atomically) and prints one line naming the lost process and the
command that resumes. Native log lines (absl's ``F1124 12:00:00.0 ...`` format and the stack
frames after them) go to a log file per process, named in that line, not to the terminal.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from dlrm_jax.files import new_run_dir, numbered_folders
from dlrm_jax.parallel.watchdog import PEER_LOST_ADVICE, STOPS_WITH_IT

# absl's native log lines ("E1125 12:00:00.123 ..." or, from gRPC, "E0000 00:00:1764070003.12 ..."),
# stack frames, and a C++ abort's words: to the per-process log, not the terminal.
_NATIVE = re.compile(
    r"^([FEWI]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ \S+:\d+\]|\*\*\* |\s+@\s+0x|terminate called|  what\(\):"
    r"|\[Gloo\] |Additional GRPC error information|:UNKNOWN:Error received from peer"
    # Gloo's line written by two native threads at once: "[Gloo] Rank " and "1 is connected ..." apart
    r"|\d+ is connected to \d+ peer ranks|\d+$)"
)
_ARGPARSE_ERROR = re.compile(r"^dlrm-jax [\w-]+(?: [\w-]+)?: error: ")
_SUBCOMMANDS = ("train", "eval", "profile")
_ONE_PROCESS = ("export", "predict", "plan", "config", "preprocess", "report", "bench")  # dlrm-jax's others
# The command that resumes the run, for the processes' own lines (a run dir the supervisor chose
# is not in the user's command: "re-run the same command" would start another run).
RESUME_ENV = "DLRM_JAX_RESUME"
# How many processes the supervisor started on this host: they share its cores (read by
# :func:`cores_of_this_process`; a cluster launch's one process a host leaves it unset).
LOCAL_PROCESSES_ENV = "DLRM_JAX_LOCAL_PROCESSES"


def cores_of_this_process() -> int:
    """The cores this process may run on (its CPU affinity), divided among the processes the
    supervisor started on this host."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        share = max(1, int(os.environ.get(LOCAL_PROCESSES_ENV, "1")))
    except ValueError:
        share = 1
    return max(1, cores // share)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli() -> list[str]:
    found = shutil.which("dlrm-jax")
    return [found] if found else [sys.executable, "-m", "dlrm_jax"]


def _how_it_ended(rc: int) -> str:
    if rc < 0:
        try:
            return f"was ended by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was ended by signal {-rc}"
    return f"exited with status {rc}"


class _Child:
    """One process: its output relayed with a ``[pI]`` prefix, native log lines to ``log``."""

    def __init__(self, index: int, argv: list[str], log: Path, local_processes: int, resume: str):
        self.index, self.log = index, log
        # start_new_session: our signals only; DLRM_JAX_PARENT: it stops (saves) if we end, even
        # by SIGKILL, and DLRM_JAX_LOG: it then writes on into its log (our pipes have no reader)
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
            env={
                **os.environ,
                "DLRM_JAX_PARENT": str(os.getpid()),
                "DLRM_JAX_LOG": str(log.absolute()),
                LOCAL_PROCESSES_ENV: str(local_processes),  # they share this host's cores (data.readers=auto)
                RESUME_ENV: resume,
            },
        )
        self.native = 0
        self.last_error = ""
        self._log = open(log, "w")  # noqa: SIM115 - closed in join()
        self._relays = [
            threading.Thread(target=self._relay, args=(stream, out), daemon=True)
            for stream, out in ((self.proc.stdout, sys.stdout), (self.proc.stderr, sys.stderr))
        ]
        for r in self._relays:
            r.start()

    def _relay(self, stream, out) -> None:
        for line in stream:
            self._log.write(line)
            if _NATIVE.match(line):
                self.native += 1
                continue
            if line.startswith("dlrm-jax: ") or _ARGPARSE_ERROR.match(line):  # (argparse: "dlrm-jax eval: error: ...")
                self.last_error = line.strip()
            out.write(f"[p{self.index}] {line}")
            out.flush()

    def join(self) -> None:
        for r in self._relays:
            r.join(timeout=5)
        self._log.close()


def signal_pending(pid: int, signum: int = signal.SIGKILL) -> bool:
    """Whether ``signum`` (a SIGKILL) already sent to ``pid`` waits on one of its threads
    (Linux: the SigPnd/ShdPnd masks in /proc); False where that cannot be read."""
    bit = 1 << (signum - 1)
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/status") as f:
                if any(line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & bit for line in f):
                    return True
    except OSError:
        pass
    return False


def keep_logs(log_dir: Path, run_dir: Path | None, name: str) -> Path:
    """The processes' logs moved into ``RUN_DIR/launch/<name>`` (a launch's own folder: a
    resume or an eval keeps the logs of the launch before it) when the run got as far as its
    run dir; where they are now."""
    if run_dir is None or not run_dir.is_dir():
        return log_dir
    target = run_dir / "launch" / name
    for k in range(1, 1000):
        try:
            target.mkdir(parents=True)
            break
        except FileExistsError:  # (two launches in one second)
            target = run_dir / "launch" / f"{name}.{k}"
    for f in log_dir.iterdir():
        shutil.move(str(f), target / f.name)
    shutil.rmtree(log_dir, ignore_errors=True)
    return target


def supervise(
    argvs: list[list[str]],
    resume: str,
    log_dir: Path,
    run_dir: Path | None = None,
    resumes: bool = True,
    first_index: int = 0,
) -> int:
    """Runs one child per argv until all end; returns the first abnormal status (0 if none).
    Logs go to ``log_dir``, and into ``run_dir``/launch/<time> once a run there has started.
    ``resume``: the command that goes on after a fault or a stop (``resumes``: from the newest
    checkpoint; else it runs again). ``first_index``: the first child's process index (a
    cluster launch supervises its host's one process, whose index is given)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    name = time.strftime("%Y%m%d-%H%M%S")
    children = [
        _Child(first_index + i, argv, log_dir / f"p{first_index + i}.log", len(argvs), resume)
        for i, argv in enumerate(argvs)
    ]
    for c in children:
        print(f"[launch] process {c.index}: output also in {c.log}, pid {c.proc.pid}", flush=True)

    forwarded = []

    def forward(signum, _frame):  # Ctrl-C, SIGTERM, a closed terminal: every process checkpoints and stops
        forwarded.append(signum)
        for c in children:
            if c.proc.poll() is None:
                c.proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    stopped_here, stopping = set(), False
    try:
        while [c.proc.poll() for c in children].count(None):  # polls each (any() would stop early)
            if not stopping and any(c.proc.returncode not in (None, 0) for c in children):
                time.sleep(1.0)  # the others' own lines, when they already know
                for c in children:
                    # A process killed from outside while one of its threads sleeps in the
                    # kernel (an fsync) ends only when that call returns, maybe after the
                    # survivor that gloo aborted for it: dying already, not ours to stop.
                    if c.proc.poll() is None and not signal_pending(c.proc.pid):
                        c.proc.kill()
                        stopped_here.add(c.index)
                stopping = True
            time.sleep(0.1)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    for c in children:
        c.join()
    ended = [c for c in children if c.proc.returncode != 0]
    if not ended:
        if keep_logs(log_dir, run_dir, name) == log_dir:  # no run dir: the terminal had it all
            shutil.rmtree(log_dir, ignore_errors=True)
        return 0
    # the one ended from outside, before the ones the runtime aborted for it and the ones stopped here
    # (and the one whose error it is, before the ones that stopped with it)
    first = min(
        ended,
        key=lambda c: (
            c.index in stopped_here,
            c.proc.returncode == -signal.SIGABRT,
            STOPS_WITH_IT in c.last_error,
            c.index,
        ),
    )
    rc = first.proc.returncode
    because = f": {first.last_error.removeprefix('dlrm-jax: ')}" if first.last_error else ""
    others = [c for c in children if c is not first]
    aborted = [c.index for c in others if c.proc.returncode == -signal.SIGABRT]
    stopped = f"; process(es) {', '.join(map(str, aborted))} aborted natively on losing it" if aborted else ""
    lost = rc < 0 or bool(aborted) or PEER_LOST_ADVICE in first.last_error
    # a stop signal, ours or sent to a process (they stop together, each saving first)
    stopped_by_signal = forwarded or rc in {128 + s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    if lost or stopped_by_signal:  # a fault or a stop: what the run saved is intact, and it goes on from it
        log_dir = keep_logs(log_dir, run_dir, name)
        saved = resumes and run_dir is not None and bool(numbered_folders(Path(run_dir) / "checkpoints"))
        again = f"the newest checkpoint is intact: run `{resume}` to resume" if saved else f"run `{resume}` again"
        advice = f"; {again}"
        # (the process's own advice, in whichever form: ours names the command)
        because = re.sub(rf"; [^;]*{PEER_LOST_ADVICE}[^;]*$", "", because)
    else:  # the command itself failed (a config error, a run dir in use): nothing to resume
        advice = ""
    refused = not (lost or stopped_by_signal) and rc == 2  # a usage or config error: nothing ran
    if refused:  # the logs hold only the refusal the terminal showed (before: kept in /tmp)
        shutil.rmtree(log_dir, ignore_errors=True)
    where = "" if refused else f" (each process's full output: {log_dir})"
    # (the others stopped here, or ended by themselves: a stop every process took, a lost peer)
    rest = "the others were stopped" if stopped_here else "the others ended too" if others else ""
    sys.stderr.write(
        f"[launch] process {first.index} {_how_it_ended(rc)}{because}{stopped}{'; ' + rest if rest else ''}"
        f"{advice}{where}\n"
    )
    sys.stderr.flush()
    return 128 - rc if rc < 0 else rc


def given_run_dir(args: list[str]) -> str | None:
    """The ``--run-dir`` among a command's arguments as argparse reads it (``--run-dir X``,
    ``--run-dir=X``, or an abbreviation such as ``--run X``; no other option starts ``--r``),
    or None."""
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if len(name) > 2 and "--run-dir".startswith(name):
            if eq:
                return value
            if i + 1 < len(args):
                return args[i + 1]
    return None


def main(argv: list[str]) -> int:
    here = "python -m dlrm_jax.parallel.launch"
    usage = (
        f"usage: {here} N [train|eval|profile] [dlrm-jax arguments...]   (N local processes)\n"
        f"       {here} --process-id I dlrm-jax [command and arguments...]   (one of a cluster's, docs/multi-host.md)\n"
    )
    if argv[:1] in (["-h"], ["--help"]):
        sys.stdout.write(usage)
        return 0
    if argv[:1] == ["--process-id"]:  # one process of a cluster launch: the command is given whole
        if len(argv) < 3 or not argv[1].isdigit():
            sys.stderr.write(f"usage: {here} --process-id I dlrm-jax [command and arguments...]\n")
            return 2
        index, command = int(argv[1]), argv[2:]
        log_dir = Path(tempfile.mkdtemp(prefix=f"dlrm-jax-p{index}-"))
        run_dir = given_run_dir(command)
        return supervise(
            [command], shlex.join(command), log_dir, Path(run_dir) if run_dir else None, "train" in command, index
        )
    if not argv or not argv[0].isdigit() or int(argv[0]) < 1:
        sys.stderr.write(usage)
        return 2
    n, rest = int(argv[0]), argv[1:]
    if rest[:1] and rest[0] in _ONE_PROCESS:
        sys.stderr.write(
            f"{here}: runs train, eval or profile; {rest[0]} runs in one process: dlrm-jax {rest[0]} ...\n"
        )
        return 2
    sub = rest.pop(0) if rest[:1] and rest[0] in _SUBCOMMANDS else "train"
    run_dir = given_run_dir(rest)
    resume = os.environ.get("DLRM_JAX_LAUNCH_AS") or shlex.join([here, str(n), sub, *rest])
    chosen = sub == "train" and run_dir is None
    if chosen:
        # Chosen here, not by process 0, so that the logs move into it and the command that
        # resumes after a fault names it (the same command without it would start afresh).
        run_dir = new_run_dir()
        rest = [*rest, "--run-dir", run_dir]
        resume = f"{resume} --run-dir {shlex.quote(run_dir)}"
    port = _free_port()
    # Progress bars redraw with carriage returns, one endless line through the prefixer; the
    # caller's own --set train.progress_bar=true still wins (it comes later).
    argvs = [
        [
            *_cli(),
            sub,
            "--set",
            "train.progress_bar=false",
            *rest,
            "--coordinator",
            f"127.0.0.1:{port}",
            "--num-processes",
            str(n),
            "--process-id",
            str(i),
        ]
        for i in range(n)
    ]
    log_dir = Path(tempfile.mkdtemp(prefix="dlrm-jax-launch-"))
    try:
        return supervise(argvs, resume, log_dir, Path(run_dir) if run_dir else None, sub == "train")
    finally:
        if chosen:  # (made to be the run's alone: a run refused before it wrote one left it empty)
            with contextlib.suppress(OSError):
                Path(run_dir).rmdir()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
