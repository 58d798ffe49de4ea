"""Device mesh construction and multi-process start-up.

The mesh is (``data``, ``model``): ``model`` (mesh.model, default 1) groups neighbouring
devices that share the dense MLPs' layers when model.mlp_parallel is tensor or pipeline
(model/mlp_parallel.py); the batch is split over every device. ``AXIS``, the pair, names every
device: model-parallel embedding tables are split over all of them, and their shard_maps and
collectives run over it. With embedding.sync=per_host the mesh is (``hosts``, ``data``,
``model``): each host's tables are split over its own devices only.
"""

from __future__ import annotations

import atexit
import itertools
import os
import sys
import threading
import time

DATA_AXIS, MODEL_AXIS = "data", "model"
AXIS = (DATA_AXIS, MODEL_AXIS)  # every device (of a host): embedding shards, the batch
HOST_AXIS = "hosts"  # embedding.sync=per_host: the mesh is (hosts, data, model), devices within a host
SIMULATED_DEVICES_DEFAULT = 8
# Simulated CPU devices each run their share of every program on the same few cores, and
# compile time grows with their number (1024 took over 5 minutes to compile the default step).
MAX_SIMULATED_DEVICES = 64


def request_cpu_devices(count: int) -> None:
    """Ask XLA's CPU backend for ``count`` devices; must run before JAX starts its devices
    (importing JAX is fine; ``jax.devices()`` or any computation starts them).

    Harmless on a GPU host: the flag only shapes the CPU backend, and the GPUs stay the default.
    A flag the user already set wins. Once the devices have started, asking for more CPU
    devices than there are raises a RuntimeError saying to restart the kernel (XLA reads its
    flags once)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    started = sys.modules.get("jax._src.xla_bridge")
    if started is not None and started.backends_are_initialized():
        import jax

        have = len(jax.devices("cpu"))
        if have < count:
            raise RuntimeError(
                f"request_cpu_devices({count}): JAX has already started its devices with {have} "
                f"CPU device(s), and XLA reads its flags once; restart the kernel (or process) "
                f"and call dlrm_jax.request_cpu_devices({count}) before anything runs on JAX"
            )


PEER_TIMEOUT_S = 30  # a process whose peer has sent no heartbeat for this long exits (see below)
JOIN_TIMEOUT_S = 300  # how long processes wait for all of them to join (jax.distributed's default)


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
    elif not any(k in os.environ for k in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS")):
        return
    jax.config.update("jax_enable_recoverability", True)
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

    def bound_the_wait() -> None:
        if not joined.wait(join_timeout_s):
            sys.stderr.write(
                f"dlrm-jax: error: process {me}: {who} did not join {coordinator or 'the coordinator'} "
                f"within {join_timeout_s} s (--join-timeout): start every process with the same "
                f"command, or see the missing one's own output for why it stopped\n"
            )
            sys.stderr.flush()
            os._exit(1)

    threading.Thread(target=bound_the_wait, name="join-timeout", daemon=True).start()
    jax.distributed.initialize(**kwargs, initialization_timeout=join_timeout_s + 60)  # ours fires first
    joined.set()
    global _watchdog
    watchdog = _watchdog = PeerWatchdog(jax.process_count(), jax.process_index())
    watchdog.start()
    atexit.register(_orderly_shutdown, watchdog)  # runs before JAX's own exit handler


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


_watchdog: PeerWatchdog | None = None
_PROGRESS_KEY = "dlrm_jax/progress/"


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
        self.hang_timeout_s = 0.0
        self.last = (time.monotonic(), 0, "starting", True)  # (since, step, doing, timed): main thread's
        self._published = None
        self._excused = 0.0  # when a peer was last seen in an untimed phase (compiling)

    def progress(self, step: int, doing: str, timed: bool = True) -> None:
        self.last = (time.monotonic(), step, doing, timed)  # one tuple: read whole by the watchdog thread

    def run(self) -> None:
        from jax._src import distributed

        everyone = list(range(self.count))
        while not self.stopping:
            time.sleep(self.every_s)
            if self.stopping:
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

    def _exit(self, why: str) -> None:
        sys.stderr.write(
            f"dlrm-jax: error: process {self.me}: {why}; the newest checkpoint is intact, "
            f"restart every process with the same command to resume\n"
        )
        sys.stderr.flush()
        os._exit(1)


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


def make_mesh(devices: int = 0, hosts: int = 0, model: int = 1):
    """A (``data``, ``model``) mesh over ``devices`` devices of the default backend (0 = all),
    ``model`` neighbouring devices (of one process when it divides their count) to a group.

    Every process takes the same number of its local devices, so each feeds an equal slice of
    the global batch. ``hosts``: a (``hosts``, ``data``, ``model``) mesh over the same devices in
    the same order instead, each host's devices inside one process (``hosts`` a multiple of the
    process count; more hosts than processes simulate several hosts per process).
    """
    import jax
    from jax.sharding import AxisType

    available = jax.devices()
    n = devices or len(available)
    if jax.default_backend() == "cpu" and n > MAX_SIMULATED_DEVICES:
        raise ValueError(
            f"mesh.devices={n}: at most {MAX_SIMULATED_DEVICES} simulated CPU devices (each "
            f"one adds compile time and threads on this host's cores); use fewer, or a "
            f"GPU host"
        )
    if n > len(available):
        hint = ""
        if jax.default_backend() == "cpu":
            hint = (
                " (set mesh.devices before JAX starts: the CLI does this; in Python call "
                "dlrm_jax.request_cpu_devices(N) before importing jax)"
            )
        raise ValueError(
            f"mesh.devices={n} but only {len(available)} {jax.default_backend()} devices are available{hint}"
        )
    if n % jax.process_count():
        raise ValueError(f"mesh.devices={n} must be a multiple of the {jax.process_count()} processes")
    per_process = n // jax.process_count()
    chosen = [
        d for p in range(jax.process_count()) for d in [x for x in available if x.process_index == p][:per_process]
    ]
    if model < 1 or n % model:
        raise ValueError(f"mesh.model={model} must divide the {n} devices")
    if not hosts:
        return jax.make_mesh((n // model, model), AXIS, axis_types=(AxisType.Auto,) * 2, devices=chosen)
    if hosts % jax.process_count() or n % (hosts * model):
        raise ValueError(
            f"mesh.hosts={hosts} must be a multiple of the {jax.process_count()} processes "
            f"and divide the {n} devices (in groups of mesh.model={model})"
        )
    return jax.make_mesh(
        (hosts, n // hosts // model, model), (HOST_AXIS, *AXIS), axis_types=(AxisType.Auto,) * 3, devices=chosen
    )


def host_scalar(x) -> float:
    """A replicated scalar's value; works when the array spans other processes' devices too."""
    import jax
    import numpy as np

    return float(np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else x)


def hosts_of(mesh) -> int:
    """The hosts of a per-host mesh; 1 otherwise."""
    return mesh.shape.get(HOST_AXIS, 1)


def batch_spec(mesh):
    """The batch axis's PartitionSpec: over every device, in host order on a per-host mesh."""
    from jax.sharding import PartitionSpec as P

    return P((HOST_AXIS, *AXIS) if HOST_AXIS in mesh.shape else AXIS)


def devices_per_host(mesh) -> int:
    """The devices one host's tables are split over (all of them without per-host tables)."""
    return mesh.shape[DATA_AXIS] * mesh.shape[MODEL_AXIS]


def over_hosts(fn, mesh):
    """``fn`` (written for one host's arrays, with shard_maps over ``AXIS``) applied to
    arrays with a leading ``hosts`` axis, each host on its own devices: a shard_map over
    ``hosts`` only, inside which ``fn``'s own shard_maps use the mesh of
    :func:`host_local_mesh`. Every argument and output has the leading axis.

    check_vma off: the embedding code types values varying over ``AXIS``; across hosts
    every value differs anyway (each host its own tables and data), and no collective inside
    names ``hosts``.
    """
    import jax
    from jax.sharding import PartitionSpec as P

    def local(*args):
        out = fn(*jax.tree.map(lambda x: x[0], args))
        return jax.tree.map(lambda x: x[None], out)

    return jax.shard_map(
        local, mesh=mesh, in_specs=P(HOST_AXIS), out_specs=P(HOST_AXIS), axis_names={HOST_AXIS}, check_vma=False
    )


def host_local_mesh(mesh):
    """The mesh an embedding collection's shard_maps use inside :func:`over_hosts`: the same
    devices, with ``hosts`` already manual."""
    from jax.sharding import AxisType

    return mesh.abstract_mesh.update_axis_types({HOST_AXIS: AxisType.Manual})
