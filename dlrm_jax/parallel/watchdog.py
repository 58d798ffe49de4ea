"""The watchdog of a run's processes: ends a process whose peer is gone, that a peer's failure
took with it, or whose main thread made no progress (hang reports), each with one line; and the
orderly leave at exit. It only talks to the coordination service's key-value store and liveness,
never to a device."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator


def _orderly_shutdown(watchdog: PeerWatchdog, timeout_s: int = 120) -> None:
    """Leave the coordination service in order: in recoverable mode nothing else makes process 0
    (which hosts the service) outlive the others' shutdown calls, and a shutdown that finds the
    service gone aborts its process."""
    import jax
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        return
    watchdog.leaving = True
    if watchdog.failed:  # its peers may wait for it inside a collective: no barrier they would reach
        _leave_failed(watchdog, client)
    try:
        client.wait_at_barrier("dlrm_jax_exit", timeout_s * 1000)
        watchdog.stopping = True  # every process passed the barrier: from here on peers leave
        if jax.process_index() == 0:  # the others leave first
            deadline = time.time() + timeout_s
            while len(client.get_live_nodes(list(range(jax.process_count())))) > 1 and time.time() < deadline:
                time.sleep(0.1)
        jax.distributed.shutdown()
    except Exception:  # noqa: BLE001 - a peer already gone: nothing left to coordinate
        os._exit(1)


def _leave_failed(watchdog: PeerWatchdog, client) -> None:
    """Ends a process that failed (:func:`announce_failure`) with its status. Process 0 holds the
    key-value store the others read the failure from: it waits until each has read it or failed
    too (their watchdogs read it within a round or two). (Not until they have left: the
    service counts a process that ended without its shutdown as live until its heartbeat
    times out, 30 s.)"""
    if watchdog.me == 0:
        deadline = time.monotonic() + 3 * watchdog.every_s + 5
        others = set(range(1, watchdog.count))
        with contextlib.suppress(Exception):  # (the service gone: nothing to wait for)
            while time.monotonic() < deadline:
                if others <= set(_by_process(client, _FAILED_KEY)) | set(_by_process(client, _FAILURE_READ_KEY)):
                    break
                time.sleep(0.1)
    sys.stderr.flush()
    os._exit(watchdog.failed)


def _by_process(client, prefix: str) -> dict[int, str]:
    """The values under ``prefix`` of the key-value store, by the process index ending each key."""
    return {int(k.rsplit("/", 1)[-1]): v for k, v in client.key_value_dir_get(prefix)}


def peer_failure() -> str:
    """A peer's failure as :func:`announce_failure` told it, for this process's own line ("" if
    none): a collective that failed under this one because that peer ended."""
    if _watchdog is None:
        return ""
    from jax._src import distributed

    return _watchdog.peer_failure(distributed.global_state.client)


def failing(status: int) -> None:
    """This process is about to say its error and end with ``status``: from now on its watchdog
    says nothing of a peer's failure (one line per process: its own). Before
    :func:`announce_failure`."""
    if _watchdog is not None:
        with _watchdog.deciding:  # (a watchdog ending the process for a peer now: it ends it)
            _watchdog.failed = status


def say_once(line: str) -> None:
    """Says this process's error line ``line`` (a collective failed under it, cause unknown), the
    only one it says: a watchdog that ends it later (the peer's loss found, the exit barrier
    never passed) says no second one. Unlike :func:`failing`, the process still leaves through
    the exit barrier (its peers may be stopping in order, having nothing to say)."""
    if _watchdog is None:
        print(line, file=sys.stderr, flush=True)
        return
    with _watchdog.deciding:
        print(line, file=sys.stderr, flush=True)
        _watchdog.said = True


def announce_failure(line: str) -> None:
    """This process ends with its one-line error ``line``, as said on its stderr (after
    :func:`failing`, which took its status).
    Its peers may be waiting for it in a collective or for a value it will not give: their
    watchdogs end them within a few seconds, naming this process and its line (before: it
    waited up to two minutes at the exit barrier while its heartbeat kept them waiting, and
    then they called it a lost peer, advising a restart that fails the same way). A no-op
    with one process."""
    from jax._src import distributed

    if _watchdog is None or distributed.global_state.client is None:
        return
    with contextlib.suppress(Exception):  # (the service gone: the peers find this process lost)
        distributed.global_state.client.key_value_set(f"{_FAILED_KEY}{_watchdog.me}", line, allow_overwrite=True)


_watchdog: PeerWatchdog | None = None
_PROGRESS_KEY = "dlrm_jax/progress/"
_AGAIN_KEY = "dlrm_jax/started_again/"
_FAILED_KEY = "dlrm_jax/failed/"
_FAILURE_READ_KEY = "dlrm_jax/failure_read/"


def watch_for_hangs(timeout_s: float) -> None:
    """From now on, a process whose main thread reports no progress (:func:`report_progress`)
    for ``timeout_s`` exits, naming where every process is (0: not watched). A process stuck
    while its heartbeat thread lives (an input read that never returns, a collective a peer
    never joins) would otherwise keep the others waiting: they follow once it is gone."""
    if _watchdog is not None:
        _watchdog.hang_timeout_s = timeout_s
        _watchdog.progress(*_watchdog.last[1:])


def report_progress(step: int, doing: str, timed: bool = True) -> None:
    """The main thread starts ``doing`` (a train step, evaluation, a checkpoint) at ``step``.

    ``timed=False`` (compiling) takes it out of the hang watch, and every process with it: a
    compile's length grows with the model and the machine's load, not with a peer or the input,
    and its peers wait for it in their first step's collectives."""
    if _watchdog is not None:
        _watchdog.progress(step, doing, timed)


class PeerWatchdog(threading.Thread):
    """Polls the coordination service for live processes; ends this one when a peer is gone,
    or when its own main thread has made no progress for ``hang_timeout_s`` (0: not checked).

    It only talks to the coordination service: it never touches a device or launches a program.
    """

    def __init__(self, count: int, me: int, every_s: float = 2.0):
        super().__init__(name="peer-watchdog", daemon=True)
        self.count, self.me, self.every_s = count, me, every_s
        # leaving: the main thread waits in the exit barrier (a peer that died before reaching it
        # would keep it there); stopping: everyone passed it, so peers may now disconnect.
        self.leaving = self.stopping = False
        self.failed = 0  # this process's exit status once it failed (failing)
        self.deciding = threading.RLock()  # the main thread's failing against this thread's exit for a peer
        self.said = False  # the main thread said the process's error line (say_once): an exit says no other
        self.hang_timeout_s = 0.0
        self.last = (time.monotonic(), 0, "starting", True)  # (since, step, doing, timed): main thread's
        self._published = None
        self._excused = 0.0  # when a peer was last seen in an untimed phase (compiling)

    def progress(self, step: int, doing: str, timed: bool = True) -> None:
        self.last = (time.monotonic(), step, doing, timed)  # one tuple: read whole by the watchdog thread

    def run(self) -> None:
        from jax._src import distributed

        # The live check waits for every live process to ask too (the service's GetAliveTasks):
        # a process killed but not yet timed out holds it 30 s. What peers said is read beside it.
        threading.Thread(target=self._watch_what_peers_said, name="peer-failure-watch", daemon=True).start()
        everyone = list(range(self.count))
        while not self.stopping:
            time.sleep(self.every_s)
            if self.stopping or self.failed:  # (a failed process says its own line: _leave_failed)
                return
            try:
                live = set(distributed.global_state.client.get_live_nodes(everyone))
                why = ""
            except Exception as e:  # noqa: BLE001 - the coordinator itself is unreachable
                live, why = set(), f"lost the coordinator (process 0): {str(e).splitlines()[0][:160]}"
            missing = sorted(set(everyone) - live)
            if missing and self.leaving:  # the peer may have passed the exit barrier just now
                time.sleep(self.every_s)
            if missing and not self.stopping:
                self._exit(why or f"lost process(es) {', '.join(map(str, missing))} of {self.count}")
            if not self.leaving:
                try:
                    self._check_progress(distributed.global_state.client)
                except Exception:  # noqa: BLE001 - the coordinator going away is the check above's
                    pass

    def _watch_what_peers_said(self) -> None:
        from jax._src import distributed

        while not (self.stopping or self.failed):
            time.sleep(self.every_s)
            client = distributed.global_state.client
            failure = self.peer_failure(client)
            if failure:
                with self.deciding:
                    if self.failed:
                        return
                    with contextlib.suppress(Exception):  # (process 0, if it failed, waits for this)
                        client.key_value_set(f"{_FAILURE_READ_KEY}{self.me}", "", allow_overwrite=True)
                    self._exit(failure, advice=False)

    def peer_failure(self, client) -> str:
        """A peer's failure, as it said it (:func:`announce_failure`); "" if none."""
        try:
            said = sorted(_by_process(client, _FAILED_KEY).items())
            again = sorted(_by_process(client, _AGAIN_KEY))
        except Exception:  # noqa: BLE001 - the coordinator unreachable: the live check's to say
            return ""
        if again:  # (this process's own index too: the service follows the newer one)
            p = again[0]
            who = f"another process {p} was started" if p == self.me else f"process {p} was started again"
            return (
                f"{who} while this run trained (a second process given --process-id {p}, "
                f"or process {p} restarted alone); the coordination service follows the new one, so this run "
                f"stops; {lost_peer_advice()}"
            )
        said = [(p, line) for p, line in said if p != self.me]
        if not said:
            return ""
        p, line = said[0]
        return f"process {p} failed, {STOPS_WITH_IT}: {line.removeprefix('dlrm-jax: ')}"

    def _check_progress(self, client) -> None:
        since, step, doing, timed = self.last
        if (step, doing) != self._published:  # where this process is, for the others' messages
            client.key_value_set(
                f"{_PROGRESS_KEY}{self.me}", f"{int(timed)} {doing} at step {step}", allow_overwrite=True
            )
            self._published = (step, doing)
        now = time.monotonic()
        stalled = now - max(since, self._excused)
        if not (self.hang_timeout_s and timed and stalled > self.hang_timeout_s):
            return
        where = {int(k.rsplit("/", 1)[-1]): v.split(" ", 1) for k, v in client.key_value_dir_get(_PROGRESS_KEY)}
        if any(flag == "0" for flag, _ in where.values()):  # a peer compiles: we wait for it, untimed
            self._excused = now
            return
        self._exit(
            f"no progress for {stalled:.0f} s ({doing} at step {step}; train.hang_timeout_s="
            f"{self.hang_timeout_s:g}); where each process is: "
            + "; ".join(f"process {i}: {what}" for i, (_, what) in sorted(where.items()))
        )

    def _exit(self, why: str, advice: bool = True) -> None:
        with self.deciding:  # (not while the main thread says its line: :func:`say_once`)
            if self.failed:  # (it found its own error first: its line and status, not a lost peer's)
                return
            if not self.said:
                line = f"dlrm-jax: error: process {self.me}: {why}{'; ' + lost_peer_advice() if advice else ''}"
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
            os._exit(1)


# What a process says when it stops for a lost peer (or a collective that failed under it),
# in every form of its advice: the launch supervisor reads it as a fault to resume from, not
# the command's own failure.
PEER_LOST_ADVICE = "restart every process with the same command"
_checkpoints: tuple[str | None] | None = None  # (the training's checkpoint folder or None,) once told


@contextlib.contextmanager
def saves_checkpoints_in(directory) -> Iterator[None]:
    """While the training run now starting runs, it saves its checkpoints in ``directory``
    (None: nowhere): what a process stopping for a lost peer advises depends on whether one was
    saved. Untold again when it ends well (a later command in the process was advised from
    this run's checkpoints); kept when it fails, for the command's own line that follows."""
    global _checkpoints
    _checkpoints = (None if directory is None else str(directory),)
    yield
    _checkpoints = None


def lost_peer_advice() -> str:
    """What to do after a lost peer: resume from the newest checkpoint, or (none saved yet)
    start again: a resume is promised only where there is one to resume from (before the
    training says where it saves, neither is promised)."""
    from dlrm_jax.files import numbered_folders

    if _checkpoints is None:
        return f"{PEER_LOST_ADVICE} (it resumes from the newest checkpoint, if the run saved one)"
    if _checkpoints[0] is not None and numbered_folders(_checkpoints[0]):
        return f"the newest checkpoint is intact: {PEER_LOST_ADVICE} to resume"
    return f"no checkpoint was saved yet: {PEER_LOST_ADVICE} to start again"


# What a process says when it stops because a peer failed (its line follows): the launch
# supervisor names the peer's own line, not this one.
STOPS_WITH_IT = "and this one stops with it"


def start_watchdog(count: int, me: int) -> None:
    """Starts this process's watchdog, once it has joined the ``count`` processes as ``me``; it
    leaves in order at exit (before JAX's own exit handler)."""
    global _watchdog
    watchdog = _watchdog = PeerWatchdog(count, me)
    watchdog.start()
    atexit.register(_orderly_shutdown, watchdog)


def tell_started_again(client, me: int) -> None:
    """Tells the run's processes that process ``me`` was started a second time (the service now
    follows the newcomer): their watchdogs stop them within a poll, naming it."""
    with contextlib.suppress(Exception):
        client.key_value_set(f"{_AGAIN_KEY}{me}", str(os.getpid()), allow_overwrite=True)
