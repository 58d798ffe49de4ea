"""How fast the host resolves tiered dynamic tables' ids (embedding/dynamic/host_maps.py), alone.

The planner thread runs it on each batch before planning the device caches, so it must keep
ahead of the step. Every dynamic table of the config (configs/stream.yaml, all 26 tables
dynamic, unless --set says otherwise) is resolved as if tiered:

    python scripts/bench_host_maps.py [KEY=VALUE ...]
    python scripts/bench_host_maps.py embedding.ids=vocab "embedding.table_ids=[cat_2=dynamic]" train.batch_size=65536

Prints ms a batch and samples/s (the planner thread; XLA:CPU may use more cores), and the cost of the maps as of an earlier
step (what checkpoints and evaluation ask for).
"""

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np

from dlrm_jax.config import load_config
from dlrm_jax.data.sources import make_source
from dlrm_jax.embedding.dynamic.host_maps import HostMaps
from dlrm_jax.ids import PAD_ID
from dlrm_jax.train.wiring import dynamic_maps

WARMUP, TIMED = 10, 50


def main(overrides: list[str]) -> None:
    cfg = load_config("stream", overrides)
    maps = HostMaps(dynamic_maps(cfg))
    source = make_source(cfg, 0, 1)
    starts = np.cumsum([0, *cfg.bag_sizes])

    def ids_of(step: int) -> list[np.ndarray]:
        ids, parts = source.train_batch(step).ids, []
        for j, f in enumerate(maps.tables):
            sub = ids[:, starts[f] : starts[f + 1]].reshape(-1)
            parts.append(
                (np.full(sub.size, j, np.int32), np.zeros(sub.size, np.uint32), sub.astype(np.uint32), sub != PAD_ID)
            )
        return [np.concatenate(x) for x in zip(*parts, strict=True)]

    batches = [ids_of(i) for i in range(WARMUP + TIMED)]
    for i in range(WARMUP):
        maps.learn(i, *batches[i])
    t0 = time.perf_counter()
    for i in range(WARMUP, WARMUP + TIMED):
        maps.learn(i, *batches[i])
        maps.forget_before(i - 3)  # a lookahead of 3 batches
    per_batch = (time.perf_counter() - t0) / TIMED
    batch = cfg.train.batch_size
    print(
        f"batch {batch:,}, {batches[0][0].size:,} ids of {len(maps.tables)} tables: "
        f"{1e3 * per_batch:.2f} ms a batch, {batch / per_batch:,.0f} samples/s"
    )
    t0 = time.perf_counter()
    maps.maps_at(WARMUP + TIMED - 3)
    print(f"maps as of 3 batches back: {1e3 * (time.perf_counter() - t0):.1f} ms for {maps.rows:,} rows")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides (of configs/stream.yaml)")
    main(parser.parse_args().overrides)
