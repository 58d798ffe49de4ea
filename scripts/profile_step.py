#!/usr/bin/env python3
"""Where the compiled train step's time goes, per XLA operation, on this host's devices.

Traces a few steps with ``jax.profiler`` (XLA:CPU records one event per executed thunk:
fusions, library dots, scatters, collectives), then sums the events by operation and prints
the largest with their share of the step. The names match the step's optimized HLO, which
``--hlo FILE`` writes for reading alongside.

    .venv/bin/python scripts/profile_step.py configs/bench/c1.yaml --set mesh.devices=1
    .venv/bin/python scripts/profile_step.py configs/bench/c1.yaml --set mesh.devices=8 --top 30

Time per step is the summed thunk time divided by the traced steps; with several simulated
devices it is summed over devices, so compare shares, not totals, across device counts.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
import time

from dlrm_jax.cli.args import POSITIVE


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=POSITIVE, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--hlo", help="write the optimized HLO of the step here")
    args = ap.parse_args()

    from dlrm_jax.config import load_config
    from dlrm_jax.parallel.mesh import request_cpu_devices

    cfg = load_config(args.config, args.overrides)
    request_cpu_devices(cfg.mesh.devices or 8)
    os.environ["XLA_FLAGS"] += " --xla_cpu_enable_xprof_traceme=true"
    import jax
    from jax._src.lib import _profile_data

    from dlrm_jax.data.sources import make_source, resolve_data_config
    from dlrm_jax.parallel.mesh import make_mesh
    from dlrm_jax.train.build import build

    cfg = resolve_data_config(cfg)
    mesh = make_mesh(cfg.mesh.devices)
    source = make_source(cfg, 0, 1)
    _, fns = build(cfg, mesh, source)
    batches = [fns.device_batch(source.train_batch(i)) for i in range(4)]
    state = fns.init_state()
    compiled = fns.train_step.lower(state, batches[0]).compile()
    if args.hlo:
        with open(args.hlo, "w") as f:
            f.write(compiled.as_text())
    for i in range(5):
        state, out, _ = compiled(state, batches[i % 4])
    jax.block_until_ready(state)

    trace_dir = tempfile.mkdtemp(prefix="dlrm-profile-")
    start = time.perf_counter()
    with jax.profiler.trace(trace_dir):
        for i in range(args.steps):
            state, out, _ = compiled(state, batches[i % 4])
            jax.block_until_ready((state, out))
    wall_ms = 1e3 * (time.perf_counter() - start) / args.steps

    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    data = _profile_data.ProfileData.from_file(path)
    per_op = collections.Counter()
    count = collections.Counter()
    for plane in data.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            for ev in line.events:
                # Thunk events are named after their HLO instruction; skip Python/runtime spans.
                if re.match(r"^[a-z_\-]+(\.\d+)?$", ev.name) and not ev.name.startswith(("thunk", "pjit")):
                    per_op[ev.name] += ev.duration_ns
                    count[ev.name] += 1
    total = sum(per_op.values())
    print(
        f"{args.config} {' '.join(args.overrides)}: {mesh.size} device(s), wall {wall_ms:.1f} ms/step "
        f"(traced), thunk time {total / 1e6 / args.steps:.1f} ms/step summed over devices"
    )
    print(f"{'operation':<44}{'ms/step':>9}{'share':>8}{'calls/step':>12}")
    for name, ns in per_op.most_common(args.top):
        print(f"{name:<44}{ns / 1e6 / args.steps:>9.2f}{ns / total:>8.1%}{count[name] / args.steps:>12.1f}")
    kinds = collections.Counter()
    for name, ns in per_op.items():
        kinds[re.sub(r"(\.\d+)$", "", name)] += ns
    print("\nby kind:", ", ".join(f"{k} {v / total:.0%}" for k, v in kinds.most_common(12)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
