"""Dynamic tables when serving: each table's id map, frozen at the exported step, from raw
ids to rows (``embedding.ids=dynamic``; embedding/dynamic/idmap.py).

The artifact keeps, per dynamic table, the ids that held a row and their rows (``maps/<table>.npy``,
uint64 [k, 2], sorted by id) and the map's shape. An id found there reads its row; any other id
reads its shard's shared row, as evaluation does (``resolve.resolve`` with ``learn=False``): a new
user is scored like the average one not yet admitted. A delta carries its step's maps whole.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dlrm_jax.embedding.dynamic.idmap import MapSpec, shard_of, split_ids
from dlrm_jax.ids import PAD_ID

MAPS_DIR = "maps"


def write_maps(work: Path, maps: dict[str, tuple[MapSpec, dict]]) -> dict:
    """Write each table's map ({table name: (its MapSpec, its arrays as numpy)}) under
    ``work/maps``; returns the manifest's ``id_maps`` section."""
    if not maps:
        return {}
    (work / MAPS_DIR).mkdir()
    out = {}
    for name, (spec, m) in maps.items():
        used = np.flatnonzero(m["used"])
        keys = (m["key_hi"][used].astype(np.uint64) << np.uint64(32)) | m["key_lo"][used].astype(np.uint64)
        order = np.argsort(keys, kind="stable")
        file = f"{MAPS_DIR}/{name}.npy"
        np.save(work / file, np.stack([keys[order], used[order].astype(np.uint64)], axis=1))
        out[name] = {"file": file, "rows": spec.rows, "vshards": spec.vshards, "ids_held": len(used)}
    return out


class IdMaps:
    """The artifact's maps: ``rows(feature, raw)`` turns a dynamic feature's raw ids into rows."""

    def __init__(self, root: Path, section: dict, features: list[dict]):
        self.features = {f: e["table"] for f, e in enumerate(features) if e["table"] in section}
        self._keys, self._rows, self._spec = {}, {}, {}
        for name, s in section.items():
            held = np.load(Path(root) / s["file"])
            self._keys[name], self._rows[name] = held[:, 0], held[:, 1].astype(np.int32)
            self._spec[name] = MapSpec(int(s["rows"]), int(s["vshards"]), probes=1)

    def __bool__(self) -> bool:
        return bool(self.features)

    def rows(self, feature: int, raw: np.ndarray, valid: np.ndarray) -> np.ndarray:
        """Raw ids (uint64, any shape) of ``feature`` -> int32 rows; PAD_ID where not ``valid``."""
        name = self.features[feature]
        raw = np.asarray(raw).astype(np.uint64)
        keys, spec = self._keys[name], self._spec[name]
        at = np.minimum(np.searchsorted(keys, raw), max(len(keys) - 1, 0))
        found = keys[at] == raw if len(keys) else np.zeros(raw.shape, bool)
        shared = shard_of(spec, *split_ids(raw), np) * spec.slots
        rows = np.where(found, self._rows[name][at] if len(keys) else 0, shared)
        return np.where(valid, rows, PAD_ID).astype(np.int32)
