"""Grain against the hand-written input pipeline, side by side, on the same binary dataset.

    pip install grain   # not a dependency of the project: the benchmark compares against it
    python scripts/bench_grain_input.py --data DATASET --batch 65536 --steps 30 --out grain.json

Every variant yields this process's batches of the same ``BinarySource`` (shuffled, the
default), the host batches and then on the devices:

- ``pipeline``: :class:`dlrm_jax.data.pipeline.InputPipeline` (``readers`` threads read and
  copy to the devices, ``prefetch`` steps ahead) -- what ``dlrm-jax train`` uses;
- ``grain threads``: ``grain.MapDataset.range(steps).map(train_batch)`` as an IterDataset with
  ``ReadOptions(num_threads=readers)``, then ``grain.experimental.device_put``;
- ``grain processes``: the same through ``mp_prefetch`` with ``readers`` worker processes;
- ``grain records``: Grain's own idiom, one record per row (``MapDataset.source`` over the
  rows, ``shuffle``, ``batch``), on fewer steps: it is per-row Python.

Each is timed from its creation to its last batch on the devices (start-up included: threads,
worker processes, the first batch). Variants take turns (``--repeats``) so a drifting machine
slows them alike; samples/s is the median over repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--batch", type=int, default=65536)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--record-steps", type=int, default=2)
    p.add_argument("--readers", type=int, default=2)
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--out")
    args = p.parse_args(argv)
    import dlrm_jax

    dlrm_jax.request_cpu_devices(args.devices)
    try:
        import grain
    except ImportError:
        p.error("needs Grain, which the project does not depend on: pip install grain")
    import jax
    from absl import flags

    flags.FLAGS.mark_as_parsed()  # Grain's worker processes read absl flags

    from dlrm_jax.data.batch import Batch
    from dlrm_jax.data.pipeline import InputPipeline
    from dlrm_jax.data.sources import resolve_data_config
    from dlrm_jax.data.sources.binary import BinarySource
    from dlrm_jax.train.build import build, mesh_from_config

    cfg = resolve_data_config(
        dlrm_jax.load_config(
            "criteo_kaggle",
            [
                "data.source=binary",
                f"data.path={args.data}",
                f"train.batch_size={args.batch}",
                "data.max_rows=0",
                f"mesh.devices={args.devices}",
                f"data.readers={args.readers}",
                f"data.prefetch={args.prefetch}",
            ],
        )
    )
    source = BinarySource(cfg)
    _, fns = build(cfg, mesh_from_config(cfg), source, log=lambda *_: None)
    sharding = fns.batch_sharding

    def pipeline(steps, on_device):
        return (
            x.device if on_device else x.host
            for x in InputPipeline(
                source.train_batch,
                steps,
                to_device=fns.device_batch if on_device else None,
                readers=args.readers,
                depth=args.prefetch,
            )
        )

    def grain_batches(steps, processes=False):
        ds = grain.MapDataset.range(steps.start, steps.stop).map(source.train_batch)
        it = ds.to_iter_dataset(
            grain.ReadOptions(num_threads=0 if processes else args.readers, prefetch_buffer_size=args.prefetch)
        )
        if processes:
            it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=args.readers))
        return it

    def grain_threads(steps, on_device, processes=False):
        it = grain_batches(steps, processes)
        if on_device:
            it = grain.experimental.device_put(it, sharding, cpu_buffer_size=args.prefetch)
        return iter(it)

    class Rows:  # Grain's random-access source: one row per record
        def __len__(self):
            return source.num_train

        def __getitem__(self, i):
            b = source._batch_of(source.train, [(int(i), 1)], "grain record")
            return {"dense": b.dense[0], "ids": b.ids[0], "labels": b.labels[0]}

    def grain_records(steps, on_device):
        per = args.batch
        ds = grain.MapDataset.source(Rows()).shuffle(seed=0).slice(slice(steps.start * per, steps.stop * per))
        it = ds.batch(per).to_iter_dataset(
            grain.ReadOptions(num_threads=args.readers, prefetch_buffer_size=args.prefetch)
        )
        it = it.map(lambda d: Batch(d["dense"], d["ids"], d["labels"]))
        if on_device:
            it = grain.experimental.device_put(it, sharding, cpu_buffer_size=args.prefetch)
        return iter(it)

    variants = {
        "pipeline": pipeline,
        "grain threads": grain_threads,
        "grain processes": lambda s, d: grain_threads(s, d, processes=True),
        "grain records": grain_records,
    }
    results = {f"{name} ({where})": [] for name in variants for where in ("host", "devices")}
    for rep in range(args.repeats):
        for name, make in variants.items():
            n = args.record_steps if name == "grain records" else args.steps
            for on_device in (False, True):
                first = 0 if name == "grain records" else 1000 * rep  # records: rows of the split
                steps = range(first, first + n)
                t0 = time.perf_counter()  # from the start: workers, the first batch, every batch
                it = make(steps, on_device)
                count = sum(1 for x in it if jax.block_until_ready(x) is not None)
                dt = time.perf_counter() - t0
                results[f"{name} ({'devices' if on_device else 'host'})"].append(count * args.batch / dt)
        print(f"repeat {rep}: " + ", ".join(f"{k} {v[-1] / 1e6:.2f}M/s" for k, v in results.items()), flush=True)
    base = statistics.median(results["pipeline (devices)"])
    table = {
        k: {"samples_per_s": statistics.median(v), "ratio_to_pipeline_devices": statistics.median(v) / base, "runs": v}
        for k, v in results.items()
    }
    report = {
        "data": args.data,
        "batch": args.batch,
        "readers": args.readers,
        "prefetch": args.prefetch,
        "devices": args.devices,
        "grain": grain.__version__ if hasattr(grain, "__version__") else "0.2.x",
        "variants": table,
        "check": bool(np.isfinite(base)),
    }
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
