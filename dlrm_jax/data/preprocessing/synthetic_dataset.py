"""A binary dataset of synthetic rows: what ``dlrm-jax preprocess`` would write, drawn by the
synthetic source's generator, so that a run on it trains on the same kind of data (the
config's tables, bags, id skew and click rate) as the same config's synthetic run, through the
input pipeline instead of the devices' own generator. Benchmarks of the feed use it
(``scripts/gpu_bench.py``'s end-to-end cases); a Criteo-format text file and ``preprocess``
would take minutes for the same rows.

Train shard k holds the generator's training batch k of ``shard_rows`` rows; the val split is
its evaluation batches. Rows are written in generation order (``shuffled`` false in meta.json).
"""

from __future__ import annotations

from pathlib import Path

from dlrm_jax.data.shards import DatasetDir, shard_name, write_shard
from dlrm_jax.data.sources.synthetic import EVAL_STREAM, TRAIN_STREAM, SyntheticSource


def write_synthetic_dataset(
    cfg, output: str | Path, train_rows: int, val_rows: int, shard_rows: int = 1 << 20, overwrite: bool = False
) -> Path:
    """Write ``train_rows`` + ``val_rows`` rows of ``cfg``'s synthetic data (its seed, tables
    as capped, bags, ``data.zipf_exponent``, ``data.positive_rate``) as a binary dataset at
    ``output``; train with ``data.source=binary data.path=OUTPUT``. Returns ``output``."""
    gen = SyntheticSource(cfg).generator
    sizes = {}
    with DatasetDir(output, overwrite=overwrite) as out:
        for split, stream, rows in (("train", TRAIN_STREAM, train_rows), ("val", EVAL_STREAM, val_rows)):
            sizes[split] = []
            for k, lo in enumerate(range(0, rows, shard_rows)):
                n = min(shard_rows, rows - lo)
                batch = gen.batch(stream, k, 0, n)
                write_shard(out.root / split / shard_name(k), batch._asdict())
                sizes[split].append(n)
        out.commit(
            {
                "num_dense": cfg.data.num_dense,
                "cardinalities": list(cfg.table_rows),
                "bag_sizes": list(cfg.bag_sizes),
                "train_rows": train_rows,
                "val_rows": val_rows,
                "shard_rows": shard_rows,
                "shards": sizes,
                "shuffled": False,
                "inputs": [f"synthetic: seed {cfg.train.seed}, zipf {cfg.data.zipf_exponent}"],
                "skipped": 0,
            }
        )
    return Path(output)
