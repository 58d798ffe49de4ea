"""One array of a checkpoint read row by row, without restoring it whole (tables saved under
another plan, re-laid out one new shard at a time: :mod:`dlrm_jax.embedding.exchange.relayout`)."""

from __future__ import annotations

import numpy as np
import tensorstore as ts

OCDBT_CACHE = {"cache_pool#ocdbt": {"total_bytes_limit": 2**26}}  # the index's nodes, as orbax sets


class SavedArray:
    """One array of a checkpoint, read on demand: ``a[rows]`` -> numpy array of those rows.

    Reads go one saved chunk (one device shard, as saved) at a time: a read spanning every
    chunk would otherwise decode them all at once, the whole array."""

    def __init__(self, store: ts.TensorStore):
        self._store = store
        self.shape = tuple(store.shape)
        self.ndim = len(self.shape)
        self.dtype = np.dtype(store.dtype.numpy_dtype)
        self._chunk_rows = max(1, int(store.chunk_layout.read_chunk.shape[0]))
        self.chunk_bytes = int(np.prod(store.chunk_layout.read_chunk.shape)) * self.dtype.itemsize

    @classmethod
    def open(cls, spec: dict, context: ts.Context) -> SavedArray:
        return cls(ts.open(spec, read=True, context=context).result())

    def __getitem__(self, rows) -> np.ndarray:
        rows = np.asarray(rows)
        out = np.empty((len(rows), *self.shape[1:]), self.dtype)
        chunk = rows // self._chunk_rows
        order = np.argsort(chunk, kind="stable")
        for part in np.split(order, np.flatnonzero(np.diff(chunk[order])) + 1):
            if len(part):
                out[part] = self._store[rows[part]].read().result()
        return out
