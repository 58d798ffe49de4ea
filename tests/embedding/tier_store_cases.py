"""The small disk tier the tier tests share: two tables (one float32 with an accumulator, one
bfloat16) in chunks of 8 rows, whose initial rows are a formula, and the checks on their
contents. Used by test_tier_store, test_tier_io and test_tier_checksums."""

import numpy as np

from dlrm_jax.embedding.tiers.format import numpy_dtype
from dlrm_jax.embedding.tiers.store import TierStore

TABLES = {
    "cat_0": (37, {"values": ((16,), "float32"), "accumulator": ((), "float32")}),
    "cat_1": (20, {"values": ((4,), "bfloat16")}),
}
CHUNK_ROWS = 8  # cat_0: chunks of 8 rows, the last holding 5


def reference(table: str, start: int, stop: int) -> dict[str, np.ndarray]:
    """Row r, column c holds r * 1000 + c (r * 8 + c in bfloat16, exact below 256); field k adds k / 4."""
    out = {}
    for k, (field, (shape, dtype)) in enumerate(TABLES[table][1].items()):
        scale = 8 if dtype == "bfloat16" else 1000
        cols = np.arange(int(np.prod(shape)))
        rows = np.arange(start, stop)[:, None] * scale + cols[None, :] + k / 4
        out[field] = rows.reshape(stop - start, *shape).astype(numpy_dtype(dtype))
    return out


def full(table: str) -> dict[str, np.ndarray]:
    return reference(table, 0, TABLES[table][0])


def contents(store: TierStore) -> dict[str, dict[str, np.ndarray]]:
    return {t: store.read(t, np.arange(store.rows(t))) for t in TABLES}


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_equal(a[k], b[k])
        else:
            np.testing.assert_array_equal(np.asarray(a[k], np.float32), np.asarray(b[k], np.float32), err_msg=k)


def new_values(store: TierStore, table: str, n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)  # small integers: exact in bfloat16
    return {
        f: rng.integers(-100, 100, (n, *shape)).astype(numpy_dtype(dtype))
        for f, (shape, dtype) in store.fields(table).items()
    }
