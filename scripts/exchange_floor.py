"""The exchange's floor with no padding: what each table would cost in its cheapest form if
every buffer held exactly what it carries (as a variable-size all-to-all would send), against
the issue's lower bound and the plan's fixed-size prediction.

    python scripts/exchange_floor.py --config mlperf_dlrm_dcnv2 --devices 64 512 --out floor.json

Per table, per device and step, float32 on the wire, on the config's first synthetic batch:

- ``replicated``: its dense [rows, D] gradient all-reduced (ring: 2 (N-1)/N of it);
- ``rows``: distinct rows sent to their owners and their vectors and gradients back, each
  host's requests merged first: a host's distinct rows of the table over its G devices, times
  (4 + 2 D 4) bytes, between hosts only (the stage inside a host is left out: a floor);
- ``pooled``: bags pooled by owners split R ways by rows and C by columns (R C = N): each
  column owner sees every id of its row group (4 K / R bytes a sample, K the mean bag) and each
  row group returns a partial sum of every bag and takes its gradient (8 D R / N), at the best
  R in [1, N].

The floor is the sum of each table's cheapest; beside it, the plan ``dlrm-jax plan`` makes
(its buckets measured on the same data) and its bound. About 10 s a device count.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from dlrm_jax.cli.args import bounded, new_json_file
from dlrm_jax.config import load_config
from dlrm_jax.data.sources import make_source, resolve_data_config
from dlrm_jax.embedding.exchange.capacity import count_distinct
from dlrm_jax.embedding.plan.stats import exchange_bytes_per_step, lower_bound_bytes
from dlrm_jax.ids import PAD_ID
from dlrm_jax.train.planning import plan_for_run
from dlrm_jax.train.wiring import specs_from_config

FLOAT = 4


def table_floors(ids: np.ndarray, bags, rows, dim: int, n: int, per_host: int) -> list[dict]:
    """Per table, the three forms' bytes one device sends per step for the batch ``ids``."""
    batch = ids.shape[0]
    local = batch // n
    starts = np.concatenate([[0], np.cumsum(bags)])
    host_rows = local * min(per_host, n)
    out = []
    for t, (bag, count) in enumerate(zip(bags, rows, strict=True)):
        col = ids[:, starts[t] : starts[t + 1]]
        mean_bag = float((col != PAD_ID).sum()) / batch
        per_host_distinct = [
            count_distinct(part[part != PAD_ID]) for part in np.split(col, range(host_rows, batch, host_rows))
        ]
        r = max(1.0, min(n, np.sqrt(mean_bag * n / (2 * dim))))
        forms = {
            "replicated": 2 * (n - 1) / n * count * dim * FLOAT,
            "rows": float(np.mean(per_host_distinct)) / min(per_host, n) * (4 + 2 * dim * FLOAT),
            "pooled": batch * (4 * mean_bag / r + 2 * dim * FLOAT * r / n),
        }
        best = min(forms, key=forms.get)
        out.append({"table": t, "bag": int(bag), "mean_bag": mean_bag, **forms, "cheapest": best})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="mlperf_dlrm_dcnv2")
    parser.add_argument(
        "--devices",
        type=bounded(int, 2),
        nargs="+",
        default=[64, 512],
        help="device counts, 2 or more (one exchanges nothing)",
    )
    parser.add_argument("--devices-per-host", type=int, default=8)
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE config overrides")
    parser.add_argument("--out", type=new_json_file, default="exchange_floor.json", help="a new JSON file")
    args = parser.parse_args()
    results = []
    for n in args.devices:
        cfg = resolve_data_config(load_config(args.config, [f"mesh.devices={n}", *args.set]))
        source = make_source(cfg, trains=True)
        ids = np.asarray(source.train_ids(0))
        plan = plan_for_run(cfg, n, 1, source, simulated=False)
        specs = specs_from_config(cfg)  # rows as capped, bags (1: one-hot)
        bags, rows, dim = [s.bag_size for s in specs], [s.rows for s in specs], cfg.model.embedding_dim
        tables = table_floors(ids, bags, rows, dim, n, args.devices_per_host)
        bound, planned = lower_bound_bytes(plan), exchange_bytes_per_step(plan)
        floor = sum(t[t["cheapest"]] for t in tables)
        results.append(
            {"devices": n, "floor_bytes": floor, "lower_bound_bytes": bound, "plan_bytes": planned, "tables": tables}
        )
        print(f"{args.config} on {n} devices: floor {floor / 2**20:.2f} MiB, bound {bound / 2**20:.2f} MiB, ", end="")
        print(f"floor / bound {floor / bound:.2f}, plan / bound {planned / bound:.2f}")
        for t in sorted(tables, key=lambda t: -t[t["cheapest"]])[:5]:
            costs = ", ".join(f"{k} {t[k] / 2**20:.2f}" for k in ("replicated", "rows", "pooled"))
            print(f"  table {t['table']:2d} (bag {t['bag']}, mean {t['mean_bag']:.1f}): {costs} MiB")
    with open(args.out, "w") as f:
        json.dump({"config": args.config, "cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
