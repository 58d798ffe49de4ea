"""All-to-all against all-reduce on the current mesh: the bandwidths the hot-row model weighs.

For each message size, both collectives run inside one ``shard_map`` over the mesh, repeated
within the compiled program so that dispatch stays out of the timing, and each is reported as
the bytes one device sends per second: all-to-all sends (N-1)/N of its buffer, a ring
all-reduce 2(N-1)/N of it. The ratio of the two at the sizes a step uses is what
``embedding/hot/choice.py`` needs (a replicated row trades all-to-all bytes for all-reduce
bytes).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlrm_jax.bench.common import each_case, machine_description, write_report
from dlrm_jax.parallel.mesh import AXIS, make_mesh

REPEATS_IN_PROGRAM = 8


def _program(kind: str, mesh, n: int):
    def local(x):  # x: this device's [N, C] float32 buffer
        def body(_, acc):
            if kind == "all_to_all":
                out = jax.lax.all_to_all(acc, AXIS, 0, 0, tiled=True)
            else:
                # psum's result is the same on every device; the loop carries a per-device value.
                out = jax.lax.pcast(jax.lax.psum(acc, AXIS) * (1.0 / n), AXIS, to="varying")
            return out

        return jax.lax.fori_loop(0, REPEATS_IN_PROGRAM, body, x)

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


def _sent_bytes(kind: str, buffer_bytes: int, n: int) -> float:
    """Bytes one device sends for one collective over a buffer of ``buffer_bytes`` per device."""
    return buffer_bytes * (n - 1) / n * (1 if kind == "all_to_all" else 2)


def bench_collectives(devices: int, sizes_kib: list[int], repeats: int, output: str | None, log=print) -> dict:
    """Time all-to-all and all-reduce per message size; print a table; JSON out."""
    mesh = make_mesh(devices)
    n = mesh.size
    sharding = NamedSharding(mesh, P(AXIS))
    rows = []
    for kib in each_case(sizes_kib):
        per_device = max(n, (kib * 1024 // 4) // n * n)  # float32 elements, a multiple of N
        x = jax.device_put(jnp.ones((n * n, per_device // n), jnp.float32), sharding)
        row = {"buffer_bytes_per_device": 4 * per_device}
        for kind in ("all_to_all", "all_reduce"):
            fn = _program(kind, mesh, n)
            jax.block_until_ready(fn(x))
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                jax.block_until_ready(fn(x))
                times.append((time.perf_counter() - t) / REPEATS_IN_PROGRAM)
            seconds = statistics.median(times)
            row[f"{kind}_s"] = seconds
            row[f"{kind}_bytes_per_s"] = _sent_bytes(kind, 4 * per_device, n) / seconds if n > 1 else 0.0
        row["all_to_all_over_all_reduce"] = (
            row["all_to_all_bytes_per_s"] / row["all_reduce_bytes_per_s"] if n > 1 else 1.0
        )
        rows.append(row)
    report = {
        "benchmark": "collectives",
        "devices": n,
        "repeats": repeats,
        "machine": machine_description(),
        "results": rows,
    }
    log(f"{'buffer/device':>14}{'all-to-all MB/s':>17}{'all-reduce MB/s':>17}{'a2a / all-reduce':>18}")
    for r in rows:
        log(
            f"{r['buffer_bytes_per_device'] / 1024:>11,.0f} KiB{r['all_to_all_bytes_per_s'] / 1e6:>17,.1f}"
            f"{r['all_reduce_bytes_per_s'] / 1e6:>17,.1f}{r['all_to_all_over_all_reduce']:>18.2f}"
        )
    write_report(report, output)
    return report
