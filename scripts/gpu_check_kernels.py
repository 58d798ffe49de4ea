#!/usr/bin/env python3
"""The Pallas kernels as a GPU compiles them, against the XLA forms they replace, before any
timing of them means anything (the tests run the kernels in Pallas's interpreter only).

    python scripts/gpu_check_kernels.py --json FILE     # on a GPU: the shapes the configs run
    python scripts/gpu_check_kernels.py --small         # small shapes (off GPUs always: Pallas's
                                                        # interpreter, a try-out of the plumbing)

Checks: the fused sparse update (``row_update_kernel``) for every sparse optimizer, a table 16
and one 128 wide, Zipf ids whose hot rows take thousands of lookups (the chunk kernel's pieces)
with weights and padding, against ``SparseOptimizer.update``; the same update twice (the same
bits); the cross layer's kernel against XLA's layer, values and gradient (``cross_kernel``);
the dot interaction's pairs by the kernels against XLA's (``pairs_kernel``). Each check's
largest error relative to the largest value it is compared with goes to the JSON; the exit
status is 1 where one is over its tolerance.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from gpu_bench import write_json  # noqa: E402

from dlrm_jax.embedding.exchange import optimizers, row_update_kernel  # noqa: E402
from dlrm_jax.embedding.exchange.row_grads import Lookups  # noqa: E402
from dlrm_jax.model import cross_kernel  # noqa: E402
from dlrm_jax.model.interaction import dot_interaction  # noqa: E402

OPTIMIZERS = {
    "sgd": optimizers.sgd(),
    "adagrad": optimizers.adagrad(),
    "rowwise_adagrad": optimizers.rowwise_adagrad(),
    "ftrl": optimizers.ftrl(),
}
# float32 sums in another order: a few roundings of the largest value; bfloat16: one of its own
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(float(np.max(np.abs(want))), 1e-30)
    return float(np.max(np.abs(got - want))) / scale


def sparse_update_checks(rows: int, width: int, samples: int, bag: int, dtypes: tuple[str, ...]) -> list[dict]:
    """Every sparse optimizer's fused update against its XLA form on one Zipf batch."""
    rng = np.random.default_rng(width)
    ids = np.minimum(rng.zipf(1.2, (samples, 2 * bag)) - 1, rows).astype(np.int32)  # rows: padding
    ids[:, 0] = 3  # one row in every sample's first bag: a long row (chunked)
    weights = rng.uniform(0.1, 1.0, ids.shape).astype(np.float32)
    lookups = Lookups.of_bags(jnp.asarray(ids), np.repeat(np.arange(2), bag), 2, jnp.asarray(weights))
    pooled = jnp.asarray(rng.normal(size=(samples * 2, width)).astype(np.float32))
    hot = int(np.bincount(ids.ravel()).max())
    out = []
    for name, opt in OPTIMIZERS.items():
        for dtype in dtypes:
            table = jnp.asarray(rng.normal(size=(rows, width)).astype(np.float32)).astype(dtype)
            state = opt.init(table)
            t0 = time.perf_counter()
            # (the batch an argument, not a constant of the programs)
            fused = jax.jit(
                lambda t, s, lk, p, opt=opt: row_update_kernel.fused_row_update(opt.step, t, s, lk, p, 0.05)
            )
            got = fused(table, state, lookups, pooled)
            again = fused(table, state, lookups, pooled)
            want = jax.jit(lambda t, s, lk, p, opt=opt: opt.update(t, s, lk, p, 0.05))(table, state, lookups, pooled)
            error = max(relative_error(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
            same = all(
                np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(again), strict=True)
            )
            out.append(
                {
                    "check": f"sparse_update/{name}/{dtype}/width{width}",
                    "relative_error": error,
                    "tolerance": TOLERANCE[dtype],
                    "same_bits_twice": same,
                    "hottest_row_lookups": hot,
                    "ok": error <= TOLERANCE[dtype] and same,
                    "seconds": time.perf_counter() - t0,
                }
            )
    return out


def _against_xla(check: str, xla, kernel, *args) -> list[dict]:
    """One check: ``kernel`` against ``xla`` on ``args``, values and gradient (bfloat16)."""
    want, want_vjp = jax.vjp(jax.jit(xla), *args)
    got, got_vjp = jax.vjp(jax.jit(kernel), *args)
    g = jnp.asarray(np.random.default_rng(3).standard_normal(want.shape), want.dtype)
    errors = [relative_error(got, want)] + [relative_error(a, b) for a, b in zip(got_vjp(g), want_vjp(g), strict=True)]
    error, tolerance = max(errors), TOLERANCE["bfloat16"]
    return [{"check": check, "relative_error": error, "tolerance": tolerance, "ok": error <= tolerance}]


def cross_checks(batch: int, rank: int, width: int) -> list[dict]:
    """The cross layer's kernel against XLA's layer, bfloat16 (DLRM-DCNv2's compute)."""
    rng = np.random.default_rng(1)
    shapes = [(batch, rank), (rank, width), (width,), (batch, width), (batch, width)]
    args = [jnp.asarray(rng.standard_normal(s) * (0.1 if i == 1 else 1.0), jnp.bfloat16) for i, s in enumerate(shapes)]
    xla = lambda h, v, b, x0, x: x0 * (h @ v + b) + x
    return _against_xla(f"cross/{batch}x{rank}x{width}", xla, cross_kernel.fused_cross, *args)


def pairs_checks(batch: int, features: int, dim: int) -> list[dict]:
    """The dot interaction's pairs by the kernels against XLA's, values and gradient."""
    rng = np.random.default_rng(2)
    bottom = jnp.asarray(rng.normal(size=(batch, dim)), jnp.bfloat16)
    emb = jnp.asarray(rng.normal(size=(batch, features, dim)), jnp.bfloat16)
    xla = lambda b, e: dot_interaction(b, e, "xla")
    fused = lambda b, e: dot_interaction(b, e, "fused")
    return _against_xla(f"pairs/{batch}x{features}x{dim}", xla, fused, bottom, emb)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the checks here")
    ap.add_argument("--small", action="store_true", help="small shapes (the default off GPUs: the interpreter)")
    args = ap.parse_args(argv)
    if args.small or jax.default_backend() != "gpu":  # LONG lowered so the chunk kernel's pieces are taken at this size
        row_update_kernel.LONG = 8
        groups = [
            lambda: sparse_update_checks(500, 16, 64, 3, ("float32",)),
            lambda: cross_checks(64, 32, 48),
            lambda: pairs_checks(16, 5, 8),
        ]
    else:  # criteo_kaggle's and DLRM-DCNv2's widths at a batch of 65,536 samples
        groups = [
            lambda: sparse_update_checks(200_000, 16, 65_536, 1, ("float32",)),
            lambda: sparse_update_checks(200_000, 128, 16_384, 4, ("float32", "bfloat16")),
            lambda: cross_checks(8_192, 512, 3_456),
            lambda: pairs_checks(65_536, 26, 16),
        ]
    report = {"backend": jax.default_backend(), "device": str(jax.devices()[0]), "checks": []}
    for group in groups:  # the JSON rewritten after each (a run cut short keeps what it checked)
        checks = group()
        report["checks"] += checks
        report["all_ok"] = all(c["ok"] for c in report["checks"])
        for c in checks:
            print(
                f"{'ok  ' if c['ok'] else 'FAIL'} {c['check']:42} relative error {c['relative_error']:.2e}"
                f" (<= {c['tolerance']:g})",
                flush=True,
            )
        if args.json:
            write_json(args.json, report)
    return 0 if report["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
