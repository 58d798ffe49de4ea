"""``dlrm-jax bench serving``: a trained model served from its artifact, against the training code.

On a Criteo-format sample it preprocesses, trains (a checkpoint half-way and one at the end),
and then measures, side by side:

- raw lines -> probabilities: ``predict`` of the held-out lines (their own file) against
  ``preprocess`` of that file plus ``eval`` of as many rows, lines/s and the ratio;
- latency of ``predict_raw`` in Python at batch 1 and 1024 (p50, p99);
- float32 against int8 and bfloat16 tables: AUC on the held-out rows and the tables' bytes;
- a delta since the half-way checkpoint: its bytes against the changed rows' bytes plus the
  manifest, and that base + delta equals the final full export table by table.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from dlrm_jax import serving
from dlrm_jax.bench.common import machine_description, write_report
from dlrm_jax.config import CRITEO_KAGGLE_CARDINALITIES, load_config
from dlrm_jax.data.preprocessing.criteo_preprocess import preprocess_criteo
from dlrm_jax.data.sources.criteo import write_criteo_tsv
from dlrm_jax.data.sources.synthetic import TRAIN_STREAM, SyntheticGenerator
from dlrm_jax.files import check_new_folder
from dlrm_jax.observe.metrics import roc_auc
from dlrm_jax.serving.files import predict_files
from dlrm_jax.serving.model import part_entries
from dlrm_jax.serving.tables import table_bytes
from dlrm_jax.train.driver import TieredDriver
from dlrm_jax.train.evaluate import eval_scores
from dlrm_jax.train.saved_run import restored
from dlrm_jax.train.serving_export import export_serving
from dlrm_jax.train.trainer import train_and_evaluate


def _bytes(root: Path, pattern: str = "*") -> int:
    return sum(p.stat().st_size for p in root.rglob(pattern) if p.is_file())


def _latency_ms(fn, lines: list[bytes], batch: int, calls: int) -> dict:
    """p50 and p99 of ``calls`` calls of ``fn`` on ``batch`` lines each (the held-out lines
    repeated where there are fewer: each call gets the batch it is reported at)."""
    lines = lines * -(-(batch + 1) // max(len(lines), 1))
    fn(lines[:batch])  # compiled once
    times = []
    for k in range(calls):
        start = (k * batch) % max(1, len(lines) - batch)
        t = time.perf_counter()
        fn(lines[start : start + batch])
        times.append((time.perf_counter() - t) * 1e3)
    q = statistics.quantiles(times, n=100)
    return {"batch": batch, "calls": calls, "p50_ms": round(q[49], 4), "p99_ms": round(q[98], 4)}


def bench_serving(
    lines: int,
    config: str,
    overrides: list[str],
    steps: int,
    workdir: str | None = None,
    output: str | None = None,
    log=print,
) -> dict:
    """Run the comparison on a ``lines``-line sample; returns (and writes) the JSON report."""
    if workdir:  # (its own folder: the sample, datasets and artifacts are written over what is there)
        check_new_folder(workdir, "the benchmark writes its files")
    tmp = Path(workdir or tempfile.mkdtemp(prefix="dlrm-bench-serving-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        report = _bench_serving(tmp, lines, config, overrides, steps)
    finally:
        if workdir is None:  # (a temporary folder: gone however the benchmark ends)
            shutil.rmtree(tmp, ignore_errors=True)
    log(write_report(report, output))
    return report


def _bench_serving(tmp: Path, lines: int, config: str, overrides: list[str], steps: int) -> dict:
    val = lines // 10
    gen = SyntheticGenerator(
        seed=0,
        num_dense=13,
        table_rows=tuple(min(c, 100_000) for c in CRITEO_KAGGLE_CARDINALITIES),
        bag_sizes=(1,) * 26,
        zipf_exponent=1.1,
        positive_rate=0.26,
    )
    write_criteo_tsv(tmp / "day.tsv", gen.raw(TRAIN_STREAM, 0, 0, lines), missing_cat_rate=0.02)
    raw = (tmp / "day.tsv").read_bytes().splitlines(keepends=True)
    (tmp / "val.tsv").write_bytes(b"".join(raw[-val:]))
    held_out = raw[-val:]
    bags = tuple(load_config(config, overrides).data.bag_sizes)  # DLRM-DCNv2's: MLPerf's multi-hot rule
    multi_hot = bags if max(bags) > 1 else None
    preprocess_criteo(
        [str(tmp / "day.tsv")],
        str(tmp / "ds"),
        val_fraction=val / lines,
        shuffle_seed=None,
        multi_hot=multi_hot,
        progress=False,
        overwrite=True,
    )
    cfg = load_config(
        config,
        [
            "data.source=binary",
            f"data.path={tmp / 'ds'}",
            f"train.steps={steps}",
            f"train.checkpoint_every={steps // 2}",
            "train.eval_every=0",
            "train.eval_batches=0",
            "train.progress_bar=false",
            "train.keep_checkpoints=3",  # (half, its double and the last: an odd count's three)
            *overrides,
        ],
    )
    train_and_evaluate(cfg, tmp / "run", log=lambda *_: None)
    report = {
        "machine": machine_description(),
        "lines": lines,
        "held_out_lines": val,
        "config": config,
        "overrides": overrides,
        "steps": steps,
    }

    # The training code's way: preprocess the file, then eval as many rows.
    t = time.perf_counter()
    preprocess_criteo(
        [str(tmp / "val.tsv")],
        str(tmp / "val_ds"),
        val_fraction=0.0,
        multi_hot=multi_hot,
        progress=False,
        overwrite=True,
    )
    pre_s = time.perf_counter() - t
    state, driver = restored(tmp / "run", log=lambda *_: None)  # (as `dlrm-jax eval` scores it: tiers too)
    try:
        runner = driver.runner if isinstance(driver, TieredDriver) else None
        list(eval_scores(driver.steps, state, driver.source, runner))  # compiled
        t = time.perf_counter()
        scored = list(eval_scores(driver.steps, state, driver.source, runner))
        eval_s = time.perf_counter() - t
    finally:
        driver.close()
    probs = np.concatenate([p[m] for p, _, m in scored])
    labels = np.concatenate([y[m] for _, y, m in scored])

    arts = {}
    for name, kw in (
        ("float32", {}),
        ("int8", {"tables": "int8"}),
        ("bfloat16", {"tables": "bfloat16"}),
        ("half", {"step": steps // 2}),
        ("delta", {"since": steps // 2}),
    ):
        t = time.perf_counter()
        export_serving(tmp / "run", tmp / f"art_{name}", log=lambda *_: None, **kw)
        arts[name] = (tmp / f"art_{name}", time.perf_counter() - t)
    report["export_s"] = round(arts["float32"][1], 2)

    with serving.load(arts["float32"][0]) as model:
        predict_files(model, [str(tmp / "val.tsv")], tmp / "pred.txt", progress=False)  # compiled, files cached
        t = time.perf_counter()
        got = predict_files(model, [str(tmp / "val.tsv")], tmp / "pred.txt", progress=False, overwrite=True)
        predict_s = time.perf_counter() - t
        scores = np.loadtxt(tmp / "pred.txt", dtype=np.float32)
        report["raw_lines"] = {
            "predict_lines_per_s": round(val / predict_s),
            "preprocess_s": round(pre_s, 3),
            "eval_s": round(eval_s, 3),
            "preprocess_plus_eval_lines_per_s": round(val / (pre_s + eval_s)),
            "ratio": round((pre_s + eval_s) / predict_s, 2),
            "scored": got.scored,
            "equal_to_eval_bitwise": bool(np.array_equal(scores, probs)),
            "max_ulps_from_eval": int(np.abs(scores.view(np.int32).astype(np.int64) - probs.view(np.int32)).max()),
        }
        report["latency"] = [_latency_ms(model.predict_raw, held_out, b, c) for b, c in ((1, 300), (1024, 40))]
    base_bytes = _bytes(arts["float32"][0] / "tables", "c.*")
    report["tables"] = {}
    for name in ("float32", "int8", "bfloat16"):
        with serving.load(arts[name][0]) as model:
            p = model.predict_raw(held_out)
        report["tables"][name] = {
            "auc": round(roc_auc(labels, p), 6),
            "auc_minus_float32": round(roc_auc(labels, p) - roc_auc(labels, probs), 6),
            "bytes": _bytes(arts[name][0] / "tables", "c.*"),
            "size_ratio": round(_bytes(arts[name][0] / "tables", "c.*") / base_bytes, 4),
        }
    report["delta"] = _delta_report(arts["half"][0], arts["delta"][0], arts["float32"][0])
    return report


def _delta_report(base: Path, delta: Path, full: Path) -> dict:
    import json

    manifest = json.loads((delta / "manifest.json").read_text())
    entries = manifest["features"] + [e for part in part_entries(manifest).values() for e in part]
    row_bytes = {e["name"]: table_bytes({**e, "rows": 1}) for e in entries}
    touched = sum(e["rows_changed"] * (row_bytes[e["name"]] + 8) for e in entries)  # + its row number
    dense = _bytes(delta / "dense") + (delta / "manifest.json").stat().st_size
    with serving.load(base, [delta]) as merged, serving.load(full) as whole:
        equal = all(
            np.array_equal(merged.tables.table_fields(e["name"])[k], v)
            for e in entries
            for k, v in whole.tables.table_fields(e["name"]).items()
        )
    tables = _bytes(delta / "tables", "c.*")
    return {
        "rows_changed": sum(e["rows_changed"] for e in entries),
        "rows": sum(e["rows"] for e in entries),
        "table_bytes": tables,
        "touched_rows_bytes": touched,
        "dense_and_manifest_bytes": dense,
        "delta_bytes": _bytes(delta),
        "size_over_touched_plus_dense": round((tables + dense) / (touched + dense), 4),
        "base_plus_delta_equals_full": equal,
    }
