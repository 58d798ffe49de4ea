"""The id conventions every layer shares: what a batch's ids hold and the table rows they name.

A batch's ids are table-local row numbers, each feature's bag after the previous feature's;
``PAD_ID`` marks an empty slot of a bag (never a valid row). Data sources write them, the
exchange routes them, serving reads them: this module, at the bottom, is the one home of the
convention, so the exchange needs nothing of ``data/``.

A dynamic table's feature (``embedding.ids=dynamic``) holds placeholders there (any row, or
``PAD_ID`` for an empty slot): its raw 64-bit ids travel beside them (:func:`raw_columns`), or,
where a source has none, the placeholders themselves are the raw ids, and the step's id map
turns them into rows.
"""

import numpy as np

PAD_ID = -1


def integer_ids(ids, what: str) -> np.ndarray:
    """``ids`` as integers: an integer (or bool) array as it is; floats (ids read from a CSV or a
    DataFrame) only where every one is a whole number, else a ValueError naming ``what`` and the
    row (3.7 was read as 3, NaN as -2**63)."""
    a = np.asarray(ids)
    if a.dtype.kind in "iub":
        return a
    if a.dtype.kind != "f":
        raise ValueError(f"{what}: ids must be integers, got {a.dtype}")
    bad = ~np.isfinite(a) | (a != np.round(a))
    if bad.any():
        at = np.argwhere(bad)[0]
        raise ValueError(f"{what}: id {a[tuple(at)].item()!r} in row {int(at[0])} is not a whole number")
    return a.astype(np.int64)


def raw_columns(values):
    """A batch's raw 64-bit ids of its dynamic tables' features (numpy int64/uint64 [B, R], the
    bags one after another in table order) as the batch carries them: uint32 [B, 2, R], the
    high halves then the low ones (devices hold 32-bit words)."""
    u = np.asarray(values).astype(np.uint64)
    return np.stack([(u >> np.uint64(32)).astype(np.uint32), (u & np.uint64(0xFFFFFFFF)).astype(np.uint32)], axis=1)


def raw_values(columns):
    """The inverse of :func:`raw_columns`: uint32 [B, 2, R] -> the raw ids, uint64 [B, R]."""
    words = np.asarray(columns).astype(np.uint64)
    return (words[:, 0] << np.uint64(32)) | words[:, 1]
