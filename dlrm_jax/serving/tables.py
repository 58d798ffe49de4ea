"""An artifact's tables for lookups: whole in memory, or behind a row cache over the chunk files.

A table that fits the memory budget is read whole; a larger one is read through the disk
tier's own machinery, a read-only :class:`~dlrm_jax.embedding.tiers.store.TierStore` view of
its chunk files (coalesced `pread`s) behind a :class:`~dlrm_jax.embedding.tiers.dram_cache.HostCache`
of ``cache_rows`` rows, so a host need not hold it. Deltas replace rows: in place for a table
in memory, in an overlay in front of the cache for the others.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from dlrm_jax.embedding.tiers.dram_cache import HostCache
from dlrm_jax.embedding.tiers.format import ArrayLayout, TierError, numpy_dtype
from dlrm_jax.embedding.tiers.store import TierStore
from dlrm_jax.ids import PAD_ID
from dlrm_jax.serving.artifact import ROWS_FIELD, ArtifactError, check_files, decode_rows, table_fields


def table_bytes(t: dict) -> int:
    return sum(
        t["rows"] * int(np.prod(shape, dtype=np.int64)) * numpy_dtype(d).itemsize
        for shape, d in table_fields(t["rows"], t["dim"], t["dtype"]).values()
    )


def open_store(directory: Path, tables: list[dict], with_rows: bool = False) -> TierStore:
    """A read-only view of ``tables`` (manifest entries: name, rows, dim, dtype) under ``directory``."""
    specs = {}
    for t in tables:
        fields = dict(table_fields(t["rows"], t["dim"], t["dtype"]))
        if with_rows:
            fields[ROWS_FIELD] = ((), "int64")
        specs[t["name"]] = (t["rows"], fields)
    try:
        return TierStore.open_directory(directory, specs)
    except TierError as e:
        raise ArtifactError(str(e)) from None


class ChunkCheck:
    """Each chunk file of an artifact's tables checked against the manifest's sha256 the first
    time any of its rows is read: a damaged table is an ArtifactError naming the file before a
    score comes from it, at the cost of reading each chunk used once more (``load``'s
    ``verify_tables`` checks them all up front instead)."""

    def __init__(self, root: Path, manifest: dict, store: TierStore):
        self.root, self.manifest, self.store = Path(root), manifest, store
        self.checked: set[str] = set()

    def rows(self, table: str, rows: np.ndarray) -> None:
        chunk_rows = self.store.chunk_rows(table)
        chunks = np.unique(np.asarray(rows, np.int64) // chunk_rows).tolist()
        names = [
            f"tables/{table}/{field}/{ArrayLayout(0, chunk_rows, shape, dtype).chunk_name(c)}"
            for field, (shape, dtype) in self.store.fields(table).items()
            for c in chunks
        ]
        todo = [n for n in names if n not in self.checked]
        if todo:
            check_files(self.root, self.manifest, todo)
            self.checked.update(todo)


class ServingTables:
    """Every table of an artifact: ``rows(name, ids)`` -> float32 [n, D]. Chunk files are
    checked against ``manifest`` as they are first read (:class:`ChunkCheck`). Safe to read
    from several threads (a server's): a table behind a row cache is read by one at a time."""

    def __init__(self, root: Path, manifest: dict, tables: list[dict], memory_bytes: int, cache_rows: int):
        self.specs = {t["name"]: t for t in tables}
        self.store = open_store(Path(root) / "tables", tables)
        self.check = ChunkCheck(root, manifest, self.store)
        self.whole: dict[str, dict[str, np.ndarray]] = {}  # table -> its fields, every row
        self.caches: dict[str, HostCache] = {}
        # a cache's lookup moves rows in and out of its slots: two threads at once gave rows of
        # other ids (7-11 wrong scores in 960 a thread, 4 threads) or a shape error
        self._cache_locks: dict[str, threading.Lock] = {}
        self.overlay: dict[str, tuple[np.ndarray, dict[str, np.ndarray]]] = {}  # sorted rows, fields
        for t in sorted(tables, key=table_bytes):  # the small ones in memory first
            if table_bytes(t) <= memory_bytes:
                memory_bytes -= table_bytes(t)
                every = np.arange(t["rows"])
                self.check.rows(t["name"], every)
                self.whole[t["name"]] = self.store.read(t["name"], every)
            else:
                self.caches[t["name"]] = HostCache(self.store, t["name"], min(cache_rows, t["rows"]))
                self._cache_locks[t["name"]] = threading.Lock()

    def fields(self, name: str, rows: np.ndarray) -> dict[str, np.ndarray]:
        """The stored fields of table ``name``'s ``rows`` (int64 [n], any order)."""
        if name in self.whole:
            return {k: v[rows] for k, v in self.whole[name].items()}
        distinct, inverse = np.unique(rows, return_inverse=True)
        with self._cache_locks[name]:
            self.check.rows(name, distinct)  # before the cache reads any of them
            got = self.caches[name].get(distinct)
        if name in self.overlay:
            changed, values = self.overlay[name]
            at = np.minimum(np.searchsorted(changed, distinct), max(len(changed) - 1, 0))
            hit = changed[at] == distinct if len(changed) else np.zeros(len(distinct), bool)
            for k in got:
                got[k][hit] = values[k][at[hit]]
        return {k: v[inverse] for k, v in got.items()}

    def lookup(self, name: str, ids: np.ndarray) -> np.ndarray:
        """float32 [n, D] rows of ``ids`` (PAD_ID: a zero row)."""
        valid = ids != PAD_ID
        out = decode_rows(self.fields(name, np.where(valid, ids, 0).astype(np.int64)))
        out[~valid] = 0.0
        return out

    def apply_delta(self, name: str, rows: np.ndarray, fields: dict[str, np.ndarray]) -> None:
        """Rows ``rows`` of table ``name`` now hold ``fields`` (a delta export's)."""
        if name in self.whole:
            for k, v in self.whole[name].items():
                v[rows] = fields[k]
            return
        if name in self.overlay:  # newer rows win over older ones
            old_rows, old = self.overlay[name]
            keep = ~np.isin(old_rows, rows)
            rows = np.concatenate([old_rows[keep], rows])
            fields = {k: np.concatenate([old[k][keep], fields[k]]) for k in fields}
        order = np.argsort(rows, kind="stable")
        self.overlay[name] = (rows[order], {k: v[order] for k, v in fields.items()})

    def table_fields(self, name: str) -> dict[str, np.ndarray]:
        """Every row's stored fields of table ``name`` (for comparing exports; reads it all)."""
        return self.fields(name, np.arange(self.specs[name]["rows"]))

    def close(self) -> None:
        self.store.close()
