"""Device mesh construction (processes coordinate in :mod:`dlrm_jax.parallel.coordination`).

The mesh is (``data``, ``model``): ``model`` (mesh.model, default 1) groups neighbouring
devices that share the dense MLPs' layers when model.mlp_parallel is tensor or pipeline
(model/mlp_parallel.py); the batch is split over every device. ``AXIS``, the pair, names every
device: model-parallel embedding tables are split over all of them, and their shard_maps and
collectives run over it. With embedding.sync=per_host the mesh is (``hosts``, ``data``,
``model``): each host's tables are split over its own devices only.
"""

from __future__ import annotations

import os
import re
import sys

from dlrm_jax.config import ConfigError

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
    check_available(n, len(available), jax.default_backend())
    check_mesh_shape(n, jax.process_count(), model, hosts)
    per_process = n // jax.process_count()
    chosen = [
        d for p in range(jax.process_count()) for d in [x for x in available if x.process_index == p][:per_process]
    ]
    if not hosts:
        return jax.make_mesh((n // model, model), AXIS, axis_types=(AxisType.Auto,) * 2, devices=chosen)
    return jax.make_mesh(
        (hosts, n // hosts // model, model), (HOST_AXIS, *AXIS), axis_types=(AxisType.Auto,) * 3, devices=chosen
    )


def check_available(n: int, available: int, backend: str) -> None:
    """A ConfigError when this machine cannot give ``n`` devices of ``backend`` (exit status 2,
    as every refused key)."""
    if backend == "cpu" and n > MAX_SIMULATED_DEVICES:
        raise ConfigError(
            f"mesh.devices={n}: at most {MAX_SIMULATED_DEVICES} simulated CPU devices (each "
            f"one adds compile time and threads on this host's cores); use fewer, or a "
            f"GPU host"
        )
    if n > available:
        hint = ""
        if backend == "cpu":
            hint = (
                " (set mesh.devices before JAX starts: the CLI does this; in Python call "
                "dlrm_jax.request_cpu_devices(N) before importing jax)"
            )
            given = re.search(r"--xla_force_host_platform_device_count=(\S+)", os.environ.get("XLA_FLAGS", ""))
            if given:  # (request_cpu_devices leaves a count the user set: it was asked for in vain)
                hint = (
                    f" (XLA_FLAGS sets --xla_force_host_platform_device_count={given.group(1)}, which "
                    f"request_cpu_devices leaves as it is: set that flag to {n} or more, before JAX starts)"
                )
        raise ConfigError(f"mesh.devices={n} but only {available} {backend} devices are available{hint}")


def check_mesh_shape(n: int, processes: int, model: int, hosts: int = 0) -> None:
    """A ConfigError when ``n`` devices cannot form the mesh: an equal share of each of the
    ``processes``, groups of ``model``, and (per-host tables) ``hosts`` hosts."""
    if n % processes:
        raise ConfigError(f"mesh.devices={n} must be a multiple of the {processes} processes")
    if model < 1 or n % model:
        raise ConfigError(f"mesh.model={model} must divide the {n} devices")
    if hosts and (hosts % processes or n % (hosts * model)):
        raise ConfigError(
            f"mesh.hosts={hosts} must be a multiple of the {processes} processes "
            f"and divide the {n} devices (in groups of mesh.model={model})"
        )


def varying(x, axes=AXIS):
    """``x`` typed as differing per device inside a ``shard_map`` (a loop carry, or a branch's
    result, that is device-specific on another path) over ``axes`` (the devices; with
    agree_over, the hosts too: what every replica gathered)."""
    import jax
    from jax import lax

    missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
    return lax.pcast(x, missing, to="varying") if missing else x


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
