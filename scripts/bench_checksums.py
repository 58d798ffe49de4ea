"""What the checkpoints' content checksums (dlrm_jax/train/state_digest.py) cost a save and a
restore: the first call (its compile) and the median of later ones, over a config's whole state
as a checkpoint holds it, beside the state's bytes.

    python scripts/bench_checksums.py CONFIG DEVICES [KEY=VALUE ...] [--json FILE]
    python scripts/bench_checksums.py default 8
    python scripts/bench_checksums.py criteo_kaggle 8 data.max_rows=200000 --json checksums.json

Runs on simulated CPU devices unless a GPU is there (XLA_FLAGS set before JAX starts).
"""

import argparse
import json
import os
import statistics
import sys
import time

# as many simulated devices as the devices argument asks, at least 8 (read before JAX starts)
os.environ.setdefault(
    "XLA_FLAGS", f"--xla_force_host_platform_device_count={max([8, *(int(a) for a in sys.argv[2:3] if a.isdigit())])}"
)

import jax

from dlrm_jax.cli.args import POSITIVE
from dlrm_jax.config import load_config
from dlrm_jax.data.sources import make_source
from dlrm_jax.parallel.mesh import make_mesh
from dlrm_jax.train.build import build
from dlrm_jax.train.state_digest import process_sums

REPEATS = 9


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("config", help="a config name or file")
    p.add_argument("devices", type=POSITIVE, help="devices of the mesh (simulated on CPU)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args(argv)
    name, devices, overrides, out = args.config, args.devices, args.overrides, args.json
    cfg = load_config(name, [f"mesh.devices={devices}", *overrides])
    _, steps = build(cfg, make_mesh(devices), make_source(cfg, 0, 1), log=lambda *_: None)
    saved = steps.checkpoint_form(steps.init_state())
    arrays = [x for x in jax.tree.leaves(saved) if isinstance(x, jax.Array)]
    jax.block_until_ready(arrays)
    start = time.perf_counter()
    process_sums(saved)
    first = time.perf_counter() - start
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        process_sums(saved)
        times.append(time.perf_counter() - start)
    later = statistics.median(times)
    nbytes = sum(x.nbytes for x in arrays)
    report = {
        "config": name,
        "devices": devices,
        "overrides": overrides,
        "platform": jax.default_backend(),
        "arrays": len(arrays),
        "state_mib": nbytes / 2**20,
        "first_call_s": first,
        "later_call_ms": later * 1e3,
        "gib_per_s": nbytes / 2**30 / later,
    }
    print(
        f"{name} on {devices} {report['platform']} devices: {len(arrays)} arrays, {report['state_mib']:.1f} MiB; "
        f"first call {first:.2f} s (its compile), then {later * 1e3:.1f} ms ({report['gib_per_s']:.2f} GiB/s)"
    )
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
