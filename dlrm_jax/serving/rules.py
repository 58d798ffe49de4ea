"""Raw values -> model inputs, by the rules preprocessing (or the text source) trained with.

``manifest["preprocessing"]`` names one kind:

- ``criteo_vocabulary``: a feature's values counted in training get ids 2.. (``rules/feature_<f>.npy``
  lists (value, count) by id); a missing value is id 0, any other value id 1.
- ``criteo_compact`` (``--max-ind-range M``): value % M, then the rank of that among the hashed
  values training kept; a hashed value training never counted takes the table's last row when
  it has one for them (``oov_rows``), else the row of hashed value 0 (a missing value's).
- ``criteo_hash`` (``data.source=criteo``): value % the table's rows.
- ``none`` (synthetic data): there are no raw values; use ``predict(dense, ids)``.

Ids then wrap into a table trained with fewer rows than the data's (``data.max_rows``), as
training did. Dense counts become log1p(max(x, 0)), missing 0, as in training.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dlrm_jax.data.criteo import NUM_CATEGORICAL, NUM_FIELDS, ParsedLines, parse_lines
from dlrm_jax.data.preprocess import MISSING_ID, OOV_ID
from dlrm_jax.data.synthetic import normalise_dense
from dlrm_jax.serving.artifact import ArtifactError

CRITEO_KINDS = ("criteo_vocabulary", "criteo_compact", "criteo_hash")


class CriteoRules:
    """The id of every raw Criteo value, feature by feature, and the dense transform."""

    def __init__(self, root: Path, spec: dict, table_rows: Sequence[int]):
        self.kind, self.table_rows = spec["kind"], [int(r) for r in table_rows]
        self.modulus = int(spec.get("max_ind_range") or 0)
        self.cards = [int(c) for c in spec.get("cardinalities", self.table_rows)]
        self._sorted, self._ids, self._unseen = [], [], []
        for f, name in enumerate(spec.get("files", [])):
            kept = np.load(Path(root) / name)
            if self.kind == "criteo_compact":
                has_oov = f < len(spec["oov_rows"]) and spec["oov_rows"][f] is not None
                values = kept[: len(kept) - has_oov, 0]  # ascending: a value's id is its rank
                self._sorted.append(values)
                self._ids.append(np.arange(len(values), dtype=np.int32))
                zero = np.searchsorted(values, 0)
                fallback = len(values) if has_oov else (zero if zero < len(values) and values[zero] == 0 else 0)
                self._unseen.append(int(fallback))
            else:
                order = np.argsort(kept[:, 0], kind="stable")
                self._sorted.append(kept[order, 0])
                self._ids.append((order + 2).astype(np.int32))
                self._unseen.append(OOV_ID)

    def ids(self, values: np.ndarray, empty: np.ndarray) -> np.ndarray:
        """uint64 [n, 26] values and bool [n, 26] missing -> int32 [n, 26] table rows."""
        out = np.empty(values.shape, np.int32)
        for f in range(values.shape[1]):
            v = values[:, f]
            if self.kind == "criteo_hash":
                out[:, f] = (v % np.uint64(self.table_rows[f])).astype(np.int32)
                continue
            if self.kind == "criteo_compact":
                v = v % np.uint64(self.modulus)
            table = self._sorted[f]
            slot = np.minimum(np.searchsorted(table, v), max(len(table) - 1, 0))
            found = (table[slot] == v) if len(table) else np.zeros(len(v), bool)
            ids = np.where(found, self._ids[f][slot] if len(table) else 0, self._unseen[f])
            if self.kind == "criteo_vocabulary":
                ids = np.where(empty[:, f], MISSING_ID, ids)
            out[:, f] = ids
        for f, (card, rows) in enumerate(zip(self.cards, self.table_rows, strict=True)):
            if card > rows:  # data.max_rows capped the table: its ids were hashed into it
                out[:, f] %= rows
        return out

    def inputs(self, parsed: ParsedLines) -> tuple[np.ndarray, np.ndarray]:
        """Parsed lines -> (dense float32 [n, 13], ids int32 [n, 26])."""
        return normalise_dense(parsed.counts, parsed.missing), self.ids(parsed.values, parsed.empty)


def parse_criteo(lines: Sequence[bytes | str]) -> ParsedLines:
    """Criteo lines with their label (40 fields) or without it (39): parsed as training parses
    them; a line of neither shape is a bad line, reported by index."""
    lines = [s.encode() if isinstance(s, str) else s for s in lines]
    unlabeled = NUM_FIELDS - 2  # tabs in a line without its label
    return parse_lines([b"0\t" + s if s.count(b"\t") == unlabeled else s for s in lines])


def raw_rules(root: Path, manifest: dict):
    """The rules of an artifact, or an ArtifactError saying why raw rows cannot be scored."""
    spec = manifest.get("preprocessing") or {"kind": "none"}
    kind = spec.get("kind")
    if kind in CRITEO_KINDS:
        if len(manifest["features"]) != NUM_CATEGORICAL:
            raise ArtifactError(f"{root}: preprocessing {kind} needs {NUM_CATEGORICAL} features")
        return CriteoRules(root, spec, [f["rows"] for f in manifest["features"]])
    why = spec.get("why") or f"its preprocessing is {kind!r}"
    raise ArtifactError(f"{root}: raw rows cannot be scored with this model ({why}); "
                        f"pass ids: predict(dense, ids)")
