"""Raw values -> model inputs, by the rules preprocessing (or the text source) trained with.

``manifest["preprocessing"]`` has a ``format`` (``criteo``: Criteo TSV; ``tabular``: files a
schema describes, copied into the artifact with its join files) and a ``kind``:

- ``vocabulary``: a feature's values counted in training get ids 2.. (``rules/feature_<f>.npy``
  lists (value, count) by id); a missing value is id 0, any other value id 1.
- ``compact`` (``--max-ind-range M``): value % M, then the rank of that among the hashed values
  training kept; a hashed value training never counted takes the table's last row when it has
  one for them (``oov_rows``), else the row of hashed value 0 (a missing value's).
- ``hash`` (``data.source=criteo``): value % the table's rows.
- ``none``: no raw values (synthetic data); use ``predict(dense, ids)``.

A dataset of ``--multi-hot`` bags (``spec["multi_hot"]``) then expands each id into its bag by
MLPerf's rule (:mod:`dlrm_jax.data.preprocessing.multihot`), drawn again from its seed when the
rules load: the same tables preprocessing drew, as large as each feature's ids times its bag.
Ids then wrap into a table trained with fewer rows than the data's (``data.max_rows``), as
training did. Dense values are transformed as in training (Criteo: log1p(max(x, 0)), missing 0).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from dlrm_jax.data.preprocessing.multihot import MultiHotRule, check_seed
from dlrm_jax.data.preprocessing.preprocess import MISSING_ID, OOV_ID, BadLine, SkipLog
from dlrm_jax.data.sources.criteo import NUM_CATEGORICAL, NUM_FIELDS, ParsedLines, parse_lines
from dlrm_jax.data.sources.synthetic import normalise_dense
from dlrm_jax.serving.artifact import ArtifactError

ID_KINDS = ("vocabulary", "compact", "hash")


class IdRules:
    """The id of every raw value (uint64, as preprocessing counts it), feature by feature."""

    def __init__(self, root: Path, spec: dict, table_rows: Sequence[int]):
        self.kind, self.table_rows = spec["kind"], [int(r) for r in table_rows]
        self.modulus = int(spec.get("max_ind_range") or 0)
        self.cards = [int(c) for c in spec.get("cardinalities", self.table_rows)]
        # dynamic tables' maps took the values themselves in training (the text source's, or a
        # dataset's kept by preprocess --raw-values), not the ids these rules give
        self.maps_values = self.kind == "hash" or bool(spec.get("raw_values"))
        self.multi_hot = None
        if "multi_hot" in spec:
            rule = spec["multi_hot"]
            try:
                check_seed(rule.get("seed"), str(root))
            except ValueError as e:
                raise ArtifactError(str(e)) from None
            self.multi_hot = MultiHotRule(self.cards, rule["bag_sizes"], rule["distribution"])
        bags = self.multi_hot.bag_sizes if self.multi_hot else (1,) * len(self.cards)
        self._starts = np.cumsum([0, *bags])  # each feature's first column in the ids
        self._sorted, self._ids, self._unseen = [], [], []
        for f, name in enumerate(spec.get("files", [])):
            kept = np.load(Path(root) / name)
            if self.kind == "compact":
                has_oov = spec["oov_rows"][f] is not None
                values = kept[: len(kept) - has_oov, 0]  # ascending: a value's id is its rank
                self._sorted.append(values)
                self._ids.append(np.arange(len(values), dtype=np.int32))
                zero = np.searchsorted(values, 0)
                fallback = len(values) if has_oov else (zero if zero < len(values) and values[zero] == 0 else 0)
                self._unseen.append(int(fallback))
            else:
                # (datasets preprocessed before 2026-11-25 numbered the values from 1, the
                # unseen ones sharing id 0 with the missing: first_id 1, oov_id 0)
                if "first_id" not in spec and self.cards[f] == len(kept) + 1:  # (such an export read them from 2)
                    raise ArtifactError(
                        f"{root}: exported from a dataset preprocessed before 2026-11-25, whose ids this export "
                        f"misreads (its values numbered from 1): export the run again with this version"
                    )
                order = np.argsort(kept[:, 0], kind="stable")
                self._sorted.append(kept[order, 0])
                self._ids.append((order + int(spec.get("first_id", OOV_ID + 1))).astype(np.int32))
                self._unseen.append(int(spec.get("oov_id", OOV_ID)))

    def ids(self, values: np.ndarray, empty: np.ndarray) -> np.ndarray:
        """uint64 [n, F] values and bool [n, F] missing -> int32 [n, F] table rows (multi-hot:
        [n, sum of the bags], each feature's bag in its columns)."""
        out = np.empty(values.shape, np.int32)
        for f in range(values.shape[1]):
            v = values[:, f]
            if self.kind == "hash":
                out[:, f] = (v % np.uint64(self.table_rows[f])).astype(np.int32)
                continue
            if self.kind == "compact":
                v = v % np.uint64(self.modulus)
            table = self._sorted[f]
            slot = np.minimum(np.searchsorted(table, v), max(len(table) - 1, 0))
            found = (table[slot] == v) if len(table) else np.zeros(len(v), bool)
            ids = np.where(found, self._ids[f][slot] if len(table) else 0, self._unseen[f])
            if self.kind == "vocabulary":
                ids = np.where(empty[:, f], MISSING_ID, ids)
            out[:, f] = ids
        if self.multi_hot is not None:
            out = self.multi_hot.expand(out)
        for f, (card, rows) in enumerate(zip(self.cards, self.table_rows, strict=True)):
            if card > rows:  # data.max_rows capped the table: its ids were hashed into it
                out[:, self._starts[f] : self._starts[f + 1]] %= rows
        return out


class CriteoRules(IdRules):
    format = "criteo"

    def inputs(self, parsed: ParsedLines) -> tuple[np.ndarray, np.ndarray]:
        """Parsed lines -> (dense float32 [n, 13], ids int32 [n, 26])."""
        return self.dense(parsed), self.ids(parsed.values, parsed.empty)

    @staticmethod
    def dense(parsed: ParsedLines) -> np.ndarray:
        """Parsed lines' dense features as the model takes them: float32 [n, 13]."""
        return normalise_dense(parsed.counts, parsed.missing)


class TabularRules(IdRules):
    """A schema's files: read as preprocessing reads them, joined with the artifact's copies of
    the side files, the label neither needed nor checked."""

    format = "tabular"

    def __init__(self, root: Path, spec: dict, table_rows: Sequence[int]):
        from dlrm_jax.data.preprocessing.tabular import load_sides
        from dlrm_jax.data.preprocessing.tabular_schema import load_schema

        super().__init__(root, spec, table_rows)
        self.schema = load_schema(Path(root) / spec["schema"])
        self.header_columns = tuple(spec.get("header_columns", ()))  # (records sent without a header)
        self.sides = load_sides(
            self.schema, {k: Path(root) / v for k, v in spec.get("joins", {}).items()}, SkipLog(True)
        )

    def chunks(
        self, f, raw, path: str, leading: Sequence[bytes], log: SkipLog, chunk_lines: int, bar=None, labeled=None
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Per chunk of records: (their lines, the usable ones' positions, dense, values,
        empty), the values uint64 as preprocessing reads them (:meth:`ids` gives their ids);
        ``labeled``: as :func:`~dlrm_jax.data.preprocessing.tabular.scoring_chunks` takes it."""
        from dlrm_jax.data.preprocessing.tabular import scoring_chunks

        yield from scoring_chunks(
            self.schema, self.sides, f, raw, path, leading, log, chunk_lines, bar, labeled, self.header_columns
        )


LAYOUT_LINES = 1000  # a tabular file's leading lines that say whether it has the label column


def criteo_labeled(lines: Sequence[bytes]) -> bool:
    """Whether Criteo lines carry their label: most of the lines of either shape have 40 fields
    (39 without it; a tie reads as labeled, the training files' layout). A file is read in one
    layout, so a line that lost a field is a bad line, not read as one without its label."""
    tabs = [s.count(b"\t") for s in lines]
    return tabs.count(NUM_FIELDS - 1) >= tabs.count(NUM_FIELDS - 2)


def parse_criteo(lines: Sequence[bytes | str], labeled: bool | None = None, of_file: bool = False) -> ParsedLines:
    """Criteo lines, all with their label (40 fields) or all without it (39; ``labeled``, by
    default :func:`criteo_labeled` of these lines), parsed as training parses them; a line not
    in that layout is a bad line, reported by index (``of_file``: ``labeled`` is what the
    file's lines tell, not the caller's word)."""
    lines = [s.encode() if isinstance(s, str) else s for s in lines]
    why = "as labeled=False says" if labeled is not None and not of_file else "as the file's other lines"
    if labeled is None:
        labeled = criteo_labeled(lines)
    if labeled:
        return parse_lines(lines)
    parsed = parse_lines([b"0\t" + s for s in lines])  # a label to parse by, not used
    return parsed._replace(bad=[_unlabeled(b, lines[b.index], why) for b in parsed.bad])


def _unlabeled(bad: BadLine, line: bytes, why: str) -> BadLine:
    """What is wrong with a line of a file without labels, counted as the file has its fields
    (the line was parsed with a label put before it)."""
    text = line.rstrip(b"\r\n")
    if not text:
        return BadLine(bad.index, "empty line", "empty line")
    if bad.kind != "field count":
        return bad
    found = text.count(b"\t") + 1
    return BadLine(
        bad.index,
        bad.kind,
        f"expected {NUM_FIELDS - 1} tab-separated fields (no label, {why}), found {found}",
    )


def raw_rules(root: Path, manifest: dict) -> CriteoRules | TabularRules:
    """The rules of an artifact, or an ArtifactError saying why raw rows cannot be scored."""
    spec = manifest.get("preprocessing") or {"kind": "none"}
    kind, rows = spec.get("kind"), spec.get("table_rows") or [f["rows"] for f in manifest["features"]]
    if manifest.get("id_maps") and kind in ("vocabulary", "compact") and "raw_values" not in spec:
        raise ArtifactError(  # (read as ids, its maps were given vocabulary ids where they hold raw values)
            f"{root}: a model with dynamic tables exported by an older dlrm_jax, which did not record whether "
            f"its maps hold raw values (preprocess --raw-values) or ids: export the run again with this version"
        )
    if kind in ID_KINDS and spec.get("format") == "tabular":
        return TabularRules(root, spec, rows)
    if kind in ID_KINDS:
        if len(rows) != NUM_CATEGORICAL:
            raise ArtifactError(f"{root}: Criteo rules need {NUM_CATEGORICAL} features, the model has {len(rows)}")
        return CriteoRules(root, spec, rows)
    why = spec.get("why") or f"its preprocessing is {kind!r}"
    if "--multi-hot" in why:  # (exports before 2026-12-06 did not keep the bags' rule; they do now)
        why += "; exporting the run again with this version keeps it"
    raise ArtifactError(f"{root}: raw rows cannot be scored with this model ({why}); pass ids: predict(dense, ids)")
