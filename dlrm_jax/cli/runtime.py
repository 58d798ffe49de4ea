"""What ``dlrm-jax``'s commands share when they run: starting JAX with the simulated devices and
processes a config asks for, the libraries' logs into the run dir, the log line, a row cap."""

from __future__ import annotations

import os
from pathlib import Path

from dlrm_jax.config import Config, ConfigError
from dlrm_jax.files import check_dir
from dlrm_jax.parallel.mesh import SIMULATED_DEVICES_DEFAULT, request_cpu_devices


def devices_for(cfg: Config) -> int:
    return cfg.mesh.devices or SIMULATED_DEVICES_DEFAULT


def start_jax(devices: int, args, mesh_devices: int = 0) -> None:
    """Check the multi-process flags (``mesh_devices``: the config's mesh.devices, which they
    must split), shape the CPU backend and join the distributed runtime; imports JAX."""
    from dlrm_jax.parallel.coordination import check_processes, initialize_distributed

    flags = [getattr(args, k, None) for k in ("coordinator", "num_processes", "process_id")]
    check_processes(*flags, mesh_devices)
    request_cpu_devices(max(1, devices // (flags[1] or 1)))  # simulated devices of this process
    initialize_distributed(
        *flags, join_timeout_s=getattr(args, "join_timeout", 300), bind=getattr(args, "coordinator_bind", None)
    )
    check_backend()
    _check_same_command(args, flags[1], mesh_devices)


def _check_same_command(args, num_processes: int | None, mesh_devices: int) -> None:
    """With several processes, the flags every one must share, compared first: a process given
    another --num-processes joined the others' run, and another mesh.devices asked for another
    share of devices, refused (before) for a lack of devices with advice about XLA_FLAGS; eval's
    --step, different on each, read different checkpoints, called damaged."""
    import jax

    from dlrm_jax.parallel.coordination import check_same_everywhere

    if jax.process_count() == 1:
        return
    if num_processes and num_processes != jax.process_count():
        raise ConfigError(
            f"--num-processes {num_processes}: the coordinator's run has {jax.process_count()} processes; "
            f"give every process the same --num-processes"
        )
    shared = {"mesh.devices": str(mesh_devices)}
    if getattr(args, "step", None) is not None:
        shared["--step"] = str(args.step)
    check_same_everywhere(shared, what="command lines")


def check_backend() -> None:
    """One line when JAX cannot start the platform asked for (JAX_PLATFORMS=cuda with a CPU-only
    jaxlib fails deep inside JAX with a bare AssertionError)."""
    import jax

    try:
        jax.devices()
    except (AssertionError, RuntimeError) as e:
        asked = os.environ.get("JAX_PLATFORMS", "")
        gpu = any(p in asked for p in ("cuda", "gpu"))
        how = (
            'this JAX has no CUDA backend: install the GPU build with `pip install -e ".[cuda12]"` '
            "(or unset JAX_PLATFORMS to train on the CPU)"
            if gpu
            else f"{type(e).__name__} {e}".strip()
        )
        raise ConfigError(f"JAX_PLATFORMS={asked or '(unset)'}: JAX could not start it; {how}") from None


def library_logs_to(run_dir: Path) -> None:
    """Send the libraries' own logging (orbax's absl logger) to ``run_dir/dlrm-jax.log``
    (:mod:`dlrm_jax.train.library_log`). Every command with a run dir calls this (the others
    use no library that logs through absl)."""
    import jax

    from dlrm_jax.train.library_log import send_library_logs

    check_dir(run_dir, "run dir")  # a file in the way is named; an unwritable dir only loses the log
    send_library_logs(run_dir, jax.process_index())


def log(msg: str) -> None:
    print(msg, flush=True)


def tighten_cap(cfg: Config, max_rows: int) -> Config:
    import dataclasses

    own = cfg.row_cap
    cap = own if not max_rows else (min(own, max_rows) if own else max_rows)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_rows=cap))
