#!/usr/bin/env python3
"""How fast a run's checkpoint is evaluated: the held-out split scored ``--repeats`` times in
one process, as ``dlrm-jax eval`` and training's evaluations score it (the batches read ahead
by ``data.readers`` threads, the scores read a few steps behind), each evaluation timed (the
first compiles the eval step).

    python scripts/bench_eval.py --run-dir RUN [--set train.eval_batches=0] [--out eval.json]

Prints one line per evaluation and, with ``--out``, JSON: ``evaluations`` (samples, seconds,
samples/s each), ``readers``, the device kind. ``--set`` overrides the run's saved config as
``dlrm-jax eval --set`` does (``data.readers=1`` to time one reader).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import dlrm_jax


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args(argv)

    from dlrm_jax.cli.runtime import devices_for
    from dlrm_jax.config import load_run_config

    cfg = load_run_config(args.run_dir, args.overrides)
    dlrm_jax.request_cpu_devices(devices_for(cfg))  # (before JAX starts)
    import jax

    from dlrm_jax.data.pipeline import input_readers
    from dlrm_jax.parallel.mesh import host_scalar
    from dlrm_jax.train.saved_run import restored

    state, driver = restored(args.run_dir, args.overrides, log=print)
    evaluations = []
    try:
        for i in range(args.repeats):
            t = time.perf_counter()
            auc, logloss, samples = driver.evaluate(state)
            seconds = time.perf_counter() - t
            evaluations.append({"samples": samples, "seconds": seconds, "samples_per_s": samples / seconds, "auc": auc})
            first = " (compiles the eval step)" if i == 0 else ""
            print(f"evaluation {i}: {samples:,} samples in {seconds:.2f} s, {samples / seconds:,.0f} samples/s{first}")
    finally:
        driver.close()
    report = {
        "benchmark": "eval",
        "run_dir": args.run_dir,
        "step": int(host_scalar(state.step)),
        "device_kind": jax.devices()[0].device_kind,
        "readers": input_readers(cfg.data.readers),
        "evaluations": evaluations,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    from dlrm_jax import wording

    with wording.command_line():  # (its advice names its --run-dir and --set)
        main()
