"""Device mesh construction and multi-process start-up.

One mesh axis, ``devices``, spans every device of every process: the batch (and so the MLPs) is
data-parallel over it, and model-parallel embedding tables are split over the same devices.
"""

from __future__ import annotations

import os

AXIS = "devices"
SIMULATED_DEVICES_DEFAULT = 8
# Simulated CPU devices each run their share of every program on the same few cores, and
# compile time grows with their number (1024 took over 5 minutes to compile the default step).
MAX_SIMULATED_DEVICES = 64


def request_cpu_devices(count: int) -> None:
    """Ask XLA's CPU backend for ``count`` devices; must run before JAX is imported.

    Harmless on a GPU host: the flag only shapes the CPU backend, and the GPUs stay the default.
    A flag the user already set wins.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def initialize_distributed(coordinator: str | None, num_processes: int | None,
                           process_id: int | None) -> None:
    """Start JAX's multi-controller runtime when more than one process takes part.

    With no coordinator given, JAX's own cluster auto-detection (SLURM, Open MPI, ...) decides;
    on a single host without a cluster environment nothing happens.
    """
    import jax

    if coordinator:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id)
    elif any(k in os.environ for k in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS")):
        jax.distributed.initialize()


def make_mesh(devices: int = 0):
    """A 1-D mesh named ``devices`` over ``devices`` devices of the default backend (0 = all).

    Every process takes the same number of its local devices, so each feeds an equal slice of
    the global batch.
    """
    import jax
    from jax.sharding import AxisType

    available = jax.devices()
    n = devices or len(available)
    if jax.default_backend() == "cpu" and n > MAX_SIMULATED_DEVICES:
        raise ValueError(f"mesh.devices={n}: at most {MAX_SIMULATED_DEVICES} simulated CPU devices (each "
                         f"one adds compile time and threads on this host's cores); use fewer, or a "
                         f"GPU host")
    if n > len(available):
        hint = ""
        if jax.default_backend() == "cpu":
            hint = (" (set mesh.devices before JAX starts: the CLI does this; in Python call "
                    "dlrm_jax.request_cpu_devices(N) before importing jax)")
        raise ValueError(f"mesh.devices={n} but only {len(available)} {jax.default_backend()} "
                         f"devices are available{hint}")
    if n % jax.process_count():
        raise ValueError(f"mesh.devices={n} must be a multiple of the {jax.process_count()} processes")
    per_process = n // jax.process_count()
    chosen = [d for p in range(jax.process_count())
              for d in [x for x in available if x.process_index == p][:per_process]]
    return jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Auto,), devices=chosen)
