"""Processes of one run coordinating: joining the distributed runtime (then the watchdog,
:mod:`dlrm_jax.parallel.watchdog`, watches them), and every process agreeing on outcomes and
settings (through the coordination service's key-value store)."""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import signal
import socket
import sys
import threading
import time

from dlrm_jax import stopping
from dlrm_jax.config import ConfigError
from dlrm_jax.parallel.watchdog import start_watchdog, tell_started_again

PEER_TIMEOUT_S = 30  # a process whose peer has sent no heartbeat for this long exits (see below)
JOIN_TIMEOUT_S = 300  # how long processes wait for all of them to join (jax.distributed's default)


_JOINED_KEY = "dlrm_jax/joined/"
CLUSTER_VARIABLES = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS")  # JAX detects these


def check_processes(
    coordinator: str | None, num_processes: int | None, process_id: int | None, mesh_devices: int = 0
) -> None:
    """The multi-process flags, before JAX starts: one line (a ConfigError) for a set that
    cannot make one run. Without a coordinator and a cluster environment JAX never joins the
    others, so each process would train a model of its own alone (into the same run dir);
    ``mesh_devices`` (0: every device of every process) must split evenly over the processes."""
    if num_processes is not None and num_processes < 1:
        raise ConfigError(f"--num-processes {num_processes}: expected an integer >= 1")
    if coordinator:
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ConfigError(f"--coordinator {coordinator}: expected HOST:PORT with a port from 1 to 65535")
    if coordinator and (num_processes is None or process_id is None):
        raise ConfigError(
            f"--coordinator {coordinator}: also give --num-processes N (every process the same) and "
            f"--process-id I (this process's, 0 to N-1)"
        )
    if not coordinator and not any(k in os.environ for k in CLUSTER_VARIABLES):
        if (num_processes or 1) > 1 or process_id:
            given = f"--num-processes {num_processes}" if num_processes else f"--process-id {process_id}"
            raise ConfigError(
                f"{given} without --coordinator: this process would train alone, a model of its own; give "
                f"every process --coordinator HOST:PORT (process 0's address; SLURM and Open MPI need none)"
            )
    if num_processes and process_id is not None and not 0 <= process_id < num_processes:
        raise ConfigError(
            f"--process-id {process_id}: expected 0 to {num_processes - 1} (--num-processes {num_processes})"
        )
    if num_processes and mesh_devices and mesh_devices % num_processes:
        raise ConfigError(
            f"mesh.devices={mesh_devices} does not split over --num-processes {num_processes}: every process "
            f"takes an equal share of the devices; use a multiple of {num_processes} devices, or a process "
            f"count that divides {mesh_devices}"
        )


def initialize_distributed(
    coordinator: str | None,
    num_processes: int | None,
    process_id: int | None,
    peer_timeout_s: int = PEER_TIMEOUT_S,
    join_timeout_s: int = JOIN_TIMEOUT_S,
    bind: str | None = None,
) -> None:
    """Start JAX's multi-controller runtime when more than one process takes part.

    With no coordinator given, JAX's own cluster auto-detection (SLURM, Open MPI, ...) decides;
    on a single host without a cluster environment nothing happens.

    Process 0's coordination service listens on ``bind``, by default the coordinator's own
    address (jaxlib listens on every interface otherwise: anyone who reaches the host could
    talk to an unauthenticated coordinator).

    A lost peer: the coordination service marks a process dead after ``peer_timeout_s``
    without heartbeats. By default JAX then aborts every other process from a native thread
    with a stack dump; here the service runs in recoverable mode and :class:`PeerWatchdog`
    turns the loss into a one-line error and exit status 1, within about ``peer_timeout_s`` + 2
    seconds (the main thread may be blocked inside a collective with the dead peer, so the
    watchdog ends the process itself).
    """
    import jax

    kwargs = dict(heartbeat_timeout_seconds=peer_timeout_s)
    if coordinator:
        kwargs.update(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            coordinator_bind_address=bind or coordinator,
        )
    elif not any(k in os.environ for k in CLUSTER_VARIABLES):
        return
    jax.config.update("jax_enable_recoverability", True)
    # JAX's preemption service installs a native SIGTERM handler of its own, in place of
    # dlrm_jax.stopping's: a SIGTERM before the loop's handlers (planning, compiling) was
    # swallowed, and the run trained on to its end. Stops are agreed by the loop instead.
    jax.config.update("jax_enable_preemption_service", False)
    joined = threading.Event()
    count, me = num_processes or 0, process_id or 0
    others = [p for p in range(count) if p != me]
    who = (
        f"process {others[0]}"
        if len(others) == 1
        else f"one of processes {', '.join(map(str, others))}"
        if others
        else "a peer"
    )

    # The main thread waits for the others inside jaxlib, where Python runs no signal handler: a
    # Ctrl-C or SIGTERM there did nothing until the join timed out. Python's own handler (C)
    # still writes the signal's number to the wakeup fd: this thread reads it and ends the
    # process, which has nothing to save yet.
    signals = _signals_while_joining()

    def bound_the_wait() -> None:
        signum = _first_signal(signals, joined, join_timeout_s)
        if signum:
            name = signal.Signals(signum).name
            sys.stderr.write(f"dlrm-jax: stopped by {name} while waiting for {who} to join (nothing to save)\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        if not joined.is_set():
            sys.stderr.write(
                f"dlrm-jax: error: process {me}: {who} did not join {coordinator or 'the coordinator'} "
                f"within {join_timeout_s} s (--join-timeout): start every process with the same "
                f"command, or see the missing one's own output for why it stopped\n"
            )
            sys.stderr.flush()
            os._exit(1)

    threading.Thread(target=bound_the_wait, name="join-timeout", daemon=True).start()
    try:
        if coordinator and me == 0:  # (process 0 hosts the service)
            _check_listenable(bind or coordinator, coordinator)
        jax.distributed.initialize(**kwargs, initialization_timeout=join_timeout_s + 60)  # ours fires first
    finally:
        joined.set()
        if signals is not None:
            signal.set_wakeup_fd(signals[1])  # (a signal from here on: the handlers' as usual)
            with contextlib.suppress(OSError):  # (a thread already gone closed its end)
                os.write(signals[0][1], b"\0")  # wakes the waiting thread
            os.close(signals[0][1])
    _join_once(coordinator, jax.process_index())
    start_watchdog(jax.process_count(), jax.process_index())


def _join_once(coordinator: str | None, me: int) -> None:
    """Ends a process whose index has already joined this coordination service, before it does
    anything: in recoverable mode the service takes it as that process restarted. A second
    ``--process-id`` for a running one then failed on a key of the store (a raw
    'ALREADY_EXISTS'), and a process restarted alone left the others waiting for the one they
    lost. It leaves with ``os._exit``: a shutdown in its index's name would be the running
    one's."""
    from jax._src import distributed

    client = distributed.global_state.client
    try:
        client.key_value_set(f"{_JOINED_KEY}{me}", str(os.getpid()))
        return
    except Exception as e:  # noqa: BLE001 - jaxlib's error type is private
        if "ALREADY_EXISTS" not in str(e):
            raise
    # The service now follows this process in its index's place (the one that joined first sends
    # heartbeats it ignores): once this one is gone, the run loses that index. Its processes
    # are told at once, and stop with the cause (before: 'lost process 1' 30 s or more later).
    tell_started_again(client, me)
    sys.stderr.write(
        f"dlrm-jax: error: process {me} has already joined the run at {coordinator or 'the coordinator'} "
        f"(a second process given --process-id {me}, or process {me} restarted alone while the others ran "
        f"on); the coordination service follows the newer one, so that run stops: each process needs its own "
        f"--process-id, and a run resumes with every process restarted together\n"
    )
    sys.stderr.flush()
    # (at once: the service keeps the key for the others' watchdogs, which read it within a
    # poll; this one waiting for them met process 0's end, which jaxlib aborts a client on)
    os._exit(2)


def _signals_while_joining():
    """A pipe that Python's signal handling writes each signal's number to (``set_wakeup_fd``),
    with the wakeup fd it replaced; None off the main thread (where it cannot be set) and
    outside the command line."""
    if threading.current_thread() is not threading.main_thread() or not stopping.handling_stops():
        return None  # (a notebook's kernel: a Ctrl-C must not end it)
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        return (r, w), signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:
        os.close(r)
        os.close(w)
        return None


def _first_signal(signals, joined: threading.Event, timeout_s: float) -> int:
    """Waits until the join ends (0) or a stop signal arrives (its number; 0 past the timeout)."""
    if signals is None:
        joined.wait(timeout_s)
        return 0
    (r, _), _ = signals
    deadline = time.monotonic() + timeout_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([r], [], [], left)[0]:
                return 0
            for signum in os.read(r, 64):
                if signum == 0 or joined.is_set():
                    return 0
                if signum in stopping.STOP_SIGNALS:
                    return signum
        return 0
    finally:
        os.close(r)


def _check_listenable(address: str, coordinator: str) -> None:
    """Refuses (ConfigError) an address process 0's coordination service could not listen on:
    jaxlib's service crashes the process (a segmentation fault) when its port is taken. The
    probe allows a port in TIME_WAIT (SO_REUSEADDR), as the service's own socket does."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        family = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, int(port)))
    except OSError as e:
        raise ConfigError(
            f"--coordinator {coordinator}: process 0 cannot listen on {address} ({e.strerror or e}: the port is "
            f"in use, or the address is not one of this host's, see --coordinator-bind); choose another port"
        ) from None


_shared_keys = itertools.count()


def _client_and_key():
    from jax._src import distributed

    return distributed.global_state.client, f"dlrm_jax/outcome/{next(_shared_keys)}"  # same order everywhere


def outcome_of_process_0(outcome: str, timeout_s: int = 300) -> str:
    """Process 0's ``outcome`` (what the others pass is ignored), given to every process through
    the coordination service's key-value store: no device is touched, so it is safe before a
    mesh exists and decides together whether a run goes on. One process: ``outcome``."""
    import jax

    if jax.process_count() == 1:
        return outcome
    client, key = _client_and_key()
    if jax.process_index() == 0:
        client.key_value_set(key, outcome)
        return outcome
    return client.blocking_key_value_get(key, timeout_s * 1000)


def outcomes_of_every_process(outcome: str, timeout_s: int = 300) -> list[str]:
    """Every process's ``outcome``, indexed by process, through the key-value store (as
    :func:`outcome_of_process_0`): lets processes that each tried something locally (read their
    shards of a checkpoint) decide together. One process: ``[outcome]``."""
    import jax

    if jax.process_count() == 1:
        return [outcome]
    client, key = _client_and_key()
    client.key_value_set(f"{key}/{jax.process_index()}", outcome)
    return [client.blocking_key_value_get(f"{key}/{p}", timeout_s * 1000) for p in range(jax.process_count())]


def check_same_everywhere(settings: dict[str, str], what: str = "config") -> None:
    """Refuses, on every process, to go on when ``settings`` (name -> value, as text) differ
    between processes, naming each differing key with its values: processes that trained with
    different settings would fail later inside a collective (a shape mismatch that aborts) or,
    worse, silently train different models. One process: nothing to compare."""
    import json

    import jax

    if jax.process_count() == 1:
        return
    every = [json.loads(s) for s in outcomes_of_every_process(json.dumps(settings, sort_keys=True))]
    differ = sorted({k for theirs in every for k in set(theirs) | set(settings) if theirs.get(k) != settings.get(k)})
    if differ:
        shown = "; ".join(
            f"{k}: " + ", ".join(f"process {p} {v.get(k, '(unset)')}" for p, v in enumerate(every)) for k in differ[:6]
        )
        more = f" (and {len(differ) - 6} more)" if len(differ) > 6 else ""
        raise ValueError(f"the processes' {what} differ, every process must run the same command: {shown}{more}")
