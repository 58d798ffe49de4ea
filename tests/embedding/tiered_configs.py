"""Tiered tables in a small run: the tables and batch (BASE) and the settings that put two of
them in the disk tier with caches far smaller than the working set (TIERED). Shared by
test_tiered and the run-dir, keep-best and damage tests of tiered runs in tests/train/."""

BASE = ["data.cardinalities=[3000, 400, 10000, 70]", "train.batch_size=32"]
TIERED = [
    "embedding.table_storage=[cat_0=tiered, cat_2=tiered]",
    "embedding.tier.device_cache_fraction=0.03",
    "embedding.tier.host_cache_fraction=0.02",
]
