"""The dynamic tables' resolution alone (``resolve.resolve_fused``), on CPU, as a step would run it.

Twenty-six lfu tables with admission (configs/stream.yaml's map), Zipf batches whose ids drift
step by step, each size of batch resolved ``--steps`` times through the same maps (the first
five untimed), for each size of map (``--values``: each table's, a row per value). With ``--against REV`` the module as it was at that git revision runs beside this
checkout's, alternating which goes first, and every output of every step must be equal: a
change to the resolution timed side by side, its bits checked on the way.

    python scripts/bench_resolution.py [--places 13824,106496] [--values 20000] [--steps 80]
        [--against REV] [--out F]

Prints each size's median ms a resolution (and the ratio to the revision's) and writes JSON.
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax
import jax.numpy as jnp
import numpy as np

from dlrm_jax.cli.args import bounded
from dlrm_jax.embedding.dynamic import resolve
from dlrm_jax.embedding.dynamic.idmap import MapSpec, init_map, split_ids
from dlrm_jax.embedding.dynamic.sharded import fuse_maps, resolution_chunk

TABLES, WARMUP = 26, 5
REPO = Path(__file__).resolve().parents[1]


def module_at(rev: str):
    """``resolve`` as it was at git revision ``rev`` (imported from a copy of that file)."""
    text = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:dlrm_jax/embedding/dynamic/resolve.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "resolve_at_rev.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("resolve_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def map_specs(values: int) -> list[MapSpec]:
    """The 26 tables' maps, ``values`` rows each (configs/stream.yaml's settings)."""
    return [MapSpec.sized(values, vshards=8, policy="lfu", half_life=64, admit=2, probes=8)] * TABLES


def time_size(modules: dict, places: int, steps: int, values: int = 20_000, seed: int = 0) -> dict:
    """Median seconds a resolution of ``places`` ids through maps of ``values`` rows a table
    for each module, every output compared."""
    specs = map_specs(values)
    first, chunk = jnp.zeros(TABLES, jnp.int32), resolution_chunk("cpu", places)

    def runner(module):
        layout = module.Maps(tuple(specs), tuple(s.vshards for s in specs))
        # the map written in place, as a train step does (else XLA copies it whole each call)
        return jax.jit(
            lambda m, t, hi, lo, v, s: module.resolve_fused(layout, m, t, hi, lo, v, s, first, chunk=chunk),
            donate_argnums=0,
        )

    runs = {name: runner(module) for name, module in modules.items()}
    maps = {name: fuse_maps(specs, 8, [init_map(s) for s in specs]) for name in runs}  # (each its own)
    seconds = {name: [] for name in runs}
    rng = np.random.default_rng(seed)
    table = jnp.asarray(np.arange(places) % TABLES, jnp.int32)
    for step in range(steps):
        ids = (rng.zipf(1.15, places) + step * 300).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        hi, lo = split_ids(ids)
        batch = (table, jnp.asarray(hi), jnp.asarray(lo), jnp.ones(places, bool), step)
        outs = {}
        for name in list(runs)[:: 1 if step % 2 else -1]:
            t0 = time.perf_counter()
            outs[name] = jax.block_until_ready(runs[name](maps[name], *batch))
            if step >= WARMUP:
                seconds[name].append(time.perf_counter() - t0)
            maps[name] = outs[name].map
        want = jax.tree.leaves(outs["this"])
        for name, out in outs.items():
            for a, b in zip(want, jax.tree.leaves(out), strict=True):
                if not np.array_equal(np.asarray(a), np.asarray(b)):
                    raise SystemExit(
                        f"{name} differs from this checkout at step {step} ({places} places, {values} rows)"
                    )
    return {name: statistics.median(s) for name, s in seconds.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--places", default="13824,106496", help="comma-separated batch sizes (ids of all tables)")
    p.add_argument("--values", default="20000", help="comma-separated map sizes (rows of each of the 26 tables)")
    p.add_argument("--steps", type=bounded(int, WARMUP + 1), default=80, help=f"steps, the first {WARMUP} untimed")
    p.add_argument("--against", default="", help="a git revision to time beside this checkout")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    modules = {"this": resolve}
    if a.against:
        modules[a.against] = module_at(a.against)
    report = {"device": str(jax.devices()[0]), "against": a.against, "steps": a.steps, "sizes": []}
    for values in (int(x) for x in a.values.split(",")):
        for places in (int(x) for x in a.places.split(",")):
            median = time_size(modules, places, a.steps, values)
            rows = sum(s.rows for s in map_specs(values))
            row = {"places": places, "map_rows": rows, **{f"{k}_ms": 1e3 * v for k, v in median.items()}}
            if a.against:
                row["ratio"] = median["this"] / median[a.against]
            report["sizes"].append(row)
            print(json.dumps(row))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    sys.exit(main() and 0)
