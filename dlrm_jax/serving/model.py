"""A serving artifact loaded for predictions: :func:`load` and :class:`ServingModel`."""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

from dlrm_jax.data.preprocessing.preprocess import DataFormatError, SkipLog
from dlrm_jax.data.sources.criteo import CriteoFormatError, ParsedLines
from dlrm_jax.files import as_paths
from dlrm_jax.ids import PAD_ID, integer_ids
from dlrm_jax.serving.artifact import (
    FUNCTION_FILE,
    INT8_FIELD,
    MANIFEST,
    PARAMS_FILE,
    ROWS_FIELD,
    ArtifactError,
    check_files,
    read_manifest,
)
from dlrm_jax.serving.id_maps import IdMaps
from dlrm_jax.serving.rules import LAYOUT_LINES, parse_criteo, raw_rules
from dlrm_jax.serving.tables import ServingTables, open_store

DEFAULT_BATCH = 1024
# Calls are padded to a power of two of at least this many rows: one program per size, and on
# XLA:CPU a row's score then does not depend on the batch it came in (smaller or odd-sized
# matrix products take other kernels, whose sums differ in the last bit).
MIN_CALL_ROWS = 128


def available_memory() -> int:
    """Bytes of memory available now (MemAvailable), or 4 GiB where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


@functools.lru_cache(maxsize=8)
def _dense_function(blob: bytes) -> tuple[jax.export.Exported, Callable]:
    """The dense part's function, deserialized and jitted once for each distinct file: a run's
    exports and deltas share one (their parameters are the function's inputs), so a server
    that loads the next delta keeps its compiled programs, where each load compiled them
    again and left JAX's caches about 40 KB larger."""
    exported = jax.export.deserialize(bytearray(blob))
    return exported, jax.jit(exported.call)


class ServingModel:
    """A trained model for predictions, from :func:`load` (``dlrm_jax.load_serving``).

    ``predict(dense, ids)``: dense float32 [n, num_dense] (transformed as in training, e.g.
    log1p of Criteo's counts) and ids int32 [n, S], each feature's bag of table rows one after
    another (``PAD_ID`` = -1 for an empty slot; [n, F] when every bag holds one id) ->
    probabilities float32 [n]. ``predict_raw(lines)``: raw Criteo lines (with or without the
    label) -> probabilities, through the preprocessing the model trained with.
    ``manifest``: what the artifact says of itself (step, evaluation, features, rules).
    """

    def __init__(self, root: Path, manifest: dict, memory_bytes: int, cache_rows: int):
        self.root, self.manifest = Path(root), manifest
        self.folders = [self.root]  # the artifact's, then each applied delta's
        self.features, self.part_features = manifest["features"], part_entries(manifest)
        every = self.features + [e for entries in self.part_features.values() for e in entries]
        self.tables = ServingTables(self.root, manifest, every, memory_bytes, cache_rows)
        self.bag_sizes = [int(f["bag_size"]) for f in self.features]
        self._starts = np.cumsum([0, *self.bag_sizes])  # each feature's first slot in a row's ids
        self.id_maps = IdMaps(self.root, manifest.get("id_maps") or {}, self.features)
        self._rules = None
        self._load_function(self.root)

    def _load_function(self, root: Path) -> None:
        self._exported, self._call = _dense_function((root / FUNCTION_FILE).read_bytes())
        with np.load(root / PARAMS_FILE) as npz:
            self._params = [jax.device_put(npz[f"arr_{k}"]) for k in range(len(npz.files))]
        self._check_function(root)

    def _check_function(self, root: Path) -> None:
        """The manifest's dense width, features and dim against what the function takes: an
        edited or mismatched manifest is refused naming both, not met at the first batch."""
        avals = self._exported.in_avals[len(self._params) :]  # dense [b, num_dense], pooled [b, F, D], ...
        takes = {
            "num_dense": avals[0].shape[1],
            "features": avals[1].shape[1],
            "embedding dim": avals[1].shape[2],
        }
        says = {
            "num_dense": self.manifest["num_dense"],
            "features": len(self.manifest["features"]),
            "embedding dim": int(self.manifest["features"][0]["dim"]) if self.manifest["features"] else 0,
        }
        for what, n in takes.items():
            if says[what] != n:
                raise ArtifactError(
                    f"{self.root / MANIFEST}: {what} {says[what]}, but its dense function {root / FUNCTION_FILE} "
                    f"takes {n}: the manifest was edited or belongs to another export"
                )

    @property
    def step(self) -> int:
        """The training step the artifact (with its deltas) holds."""
        return int(self.manifest["step"])

    def pooled(self, ids: np.ndarray, raw: dict | None = None) -> list[np.ndarray]:
        """ids int32 [n, S] -> pooled vectors float32 [n, F, D], then each extra sparse part's
        (Wide&Deep's wide part: [n, F, 1]). Dynamic tables' features: their ids are raw ids,
        or ``raw`` gives them ({feature: uint64 [n, bag]}), turned into rows by the maps."""
        ids = self._map_rows(np.asarray(ids), raw)
        if ids.ndim != 2 or ids.shape[1] != sum(self.bag_sizes):
            raise ValueError(
                f"ids must have shape [n, {sum(self.bag_sizes)}] (bag sizes {self.bag_sizes}), got {list(ids.shape)}"
            )
        starts, out = self._starts, []
        for entries in (self.features, *self.part_features.values()):
            pooled = np.empty((len(ids), len(entries), int(entries[0]["dim"])), np.float32)
            for f, e in enumerate(entries):
                bag = ids[:, starts[f] : starts[f + 1]]
                if ((bag < PAD_ID) | (bag >= e["rows"])).any():
                    raise ValueError(f"feature {f} (table {e['table']}, {e['rows']} rows): an id out of range")
                rows = self.tables.lookup(e["table"], bag.reshape(-1)).reshape(*bag.shape, -1)
                if bag.shape[1] == 1:
                    pooled[:, f] = rows[:, 0]
                    continue
                w = (bag != PAD_ID).astype(np.float32)
                if e["pooling"] == "mean":
                    w /= np.maximum(w.sum(axis=1, keepdims=True), 1.0)
                pooled[:, f] = np.einsum("bl,bld->bd", w, rows)
            out.append(pooled)
        return out

    def _map_rows(self, ids: np.ndarray, raw: dict | None) -> np.ndarray:
        if not self.id_maps or ids.ndim != 2 or ids.shape[1] != sum(self.bag_sizes):
            return ids
        # every 64 bits kept: dynamic features' ids are raw ids (a cast to int32 made 2**40 + 5
        # read as 5), and an id too large for a vocabulary table is refused, not wrapped
        out, starts = ids.view(np.int64).copy() if ids.dtype == np.uint64 else ids.astype(np.int64), self._starts
        for f in self.id_maps.features:
            bag = out[:, starts[f] : starts[f + 1]]  # (its rows replace it only once read)
            given = bag.view(np.uint64) if raw is None else raw[f]
            bag[...] = self.id_maps.rows(f, given, bag != PAD_ID)
        return out

    def predict(
        self, dense: np.ndarray, ids: np.ndarray, batch_size: int = DEFAULT_BATCH, raw: dict | None = None
    ) -> np.ndarray:
        """Probabilities float32 [n] of ``dense`` [n, num_dense] and ``ids`` [n, S], ``batch_size``
        at a time. Dynamic tables (``manifest["id_maps"]``): their features' ids are raw ids, or
        ``raw`` gives them whole ({feature: uint64 [n, bag]}); an id the map does not hold
        reads its shard's shared row, as evaluation does."""
        if not isinstance(batch_size, int | np.integer) or batch_size < 1:  # (-1 returned np.empty's bytes)
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        ids = integer_ids(ids, "predict")
        given = np.asarray(dense)
        with np.errstate(over="ignore"):  # (checked below: 1e300 as float32 is inf)
            dense = given.astype(np.float32)
        if dense.ndim == 2 and dense.shape[1] == 0 and self.manifest["num_dense"] == 1:
            dense = np.zeros((len(dense), 1), np.float32)  # data without dense features: one zero column, as trained
        if dense.ndim != 2 or dense.shape[1] != self.manifest["num_dense"]:
            raise ValueError(f"dense must have shape [n, {self.manifest['num_dense']}], got {list(dense.shape)}")
        if len(dense) != len(ids):
            raise ValueError(f"{len(dense)} dense rows and {len(ids)} id rows")
        if not np.isfinite(dense).all():  # (before: NaN predictions; training refuses such rows)
            r, c = (int(i) for i in np.argwhere(~np.isfinite(dense))[0])
            raise ValueError(f"dense row {r}, column {c}: {given[r, c].item()!r} is not a finite float32")
        out = np.empty(len(dense), np.float32)
        for s in range(0, len(dense), batch_size):
            part = None if raw is None else {f: r[s : s + batch_size] for f, r in raw.items()}
            args = [dense[s : s + batch_size], *self.pooled(ids[s : s + batch_size], part)]
            n = len(args[0])
            rows = max(MIN_CALL_ROWS, 1 << (n - 1).bit_length())
            args = [np.concatenate([a, np.zeros((rows - n, *a.shape[1:]), a.dtype)]) if rows > n else a for a in args]
            out[s : s + n] = np.asarray(self._call(self._params, *args))[:n]
        return out

    def predict_raw(
        self,
        lines: Sequence[bytes | str] | bytes | str,
        skip_bad_lines: bool = False,
        batch_size: int = DEFAULT_BATCH,
        labeled: bool | None = None,
    ) -> np.ndarray:
        """Probabilities float32 [len(lines)] of raw lines in the training files' layout (Criteo:
        label first or absent; a tabular schema's: one record a line, the label column present or
        absent, its header line optional); a malformed line is an error naming it, or
        (``skip_bad_lines``) scores NaN. ``lines``: a sequence of lines, or text holding them.
        ``labeled``: whether the lines carry the label (None: most of them tell; a server
        scoring one request at a time says it, or a line that lost a field reads as one
        without its label, its fields shifted)."""
        rules = self.rules  # a model without rules refuses before any line is read
        if isinstance(lines, str | bytes):  # (one line was read as its characters)
            lines = lines.splitlines(keepends=True)
        if not len(lines):
            return np.zeros(0, np.float32)
        if rules.format == "tabular":
            return self._predict_tabular(lines, skip_bad_lines, batch_size, labeled)
        parsed = parse_criteo(lines, labeled)
        if parsed.bad and not skip_bad_lines:
            bad = parsed.bad[0]
            raise CriteoFormatError(f"line {bad.index + 1}: {bad.message}")  # (numbered from 1, as files are)
        out = np.full(len(lines), np.nan, np.float32)
        out[parsed.rows] = self.predict_values(rules.dense(parsed), parsed.values, parsed.empty, batch_size)
        return out

    def predict_values(
        self, dense: np.ndarray, values: np.ndarray, empty: np.ndarray, batch_size: int = DEFAULT_BATCH
    ) -> np.ndarray:
        """Probabilities float32 [n] of rows of raw values (dense as the model takes them;
        ``values`` uint64 [n, F] as preprocessing reads them, ``empty`` where missing), by the
        artifact's rules: their ids, and where dynamic tables mapped the values themselves in
        training (the text source, ``preprocess --raw-values``), those values, 0 where
        missing, as the batches carried them."""
        raw = self._mapped_values(values, empty)
        return self.predict(dense, self.rules.ids(values, empty), batch_size, raw=raw)

    def _mapped_values(self, values: np.ndarray, empty: np.ndarray) -> dict | None:
        """Where dynamic tables mapped the values themselves in training: each such feature's
        values, {feature: uint64 [n, 1]}, 0 where missing, as the batches carried them; else None."""
        if not (self.rules.maps_values and self.id_maps):
            return None
        kept = np.where(empty, np.uint64(0), values)
        return {f: kept[:, f : f + 1] for f in self.id_maps.features}

    def _predict_tabular(
        self, lines: Sequence[bytes | str], skip_bad_lines: bool, batch_size: int, labeled: bool | None
    ) -> np.ndarray:
        """A tabular model's records (one a line here), in order; nan for a skipped one."""
        encoding = self.rules.schema.layout.encoding  # (as the file was: utf-8 hashed latin-1's values apart)
        data = [s.encode(encoding) if isinstance(s, str) else s for s in lines]
        data = [s if s.endswith(b"\n") else s + b"\n" for s in data]
        log = SkipLog(skip_bad_lines, DataFormatError)
        chunks = self.rules.chunks(
            io.BytesIO(b"".join(data)), None, "rows", data[:LAYOUT_LINES], log, max(len(data), 1), labeled=labeled
        )
        return np.concatenate([np.zeros(0, np.float32), *self.score_records(chunks, batch_size)])

    def score_records(self, chunks, batch_size: int = DEFAULT_BATCH):
        """Per chunk of a tabular model's records (``rules.chunks``): their probabilities in
        order, nan for a skipped one."""
        for records, keep, dense, values, empty in chunks:
            probs = np.full(len(records), np.nan, np.float32)
            if len(keep):
                probs[keep] = self.predict_values(dense, values, empty, batch_size)
            yield probs

    def raw_inputs(self, parsed: ParsedLines) -> tuple[np.ndarray, np.ndarray]:
        """Parsed raw lines -> (dense, ids) by the artifact's preprocessing rules, as
        :meth:`predict` takes them: where dynamic tables mapped the values themselves in
        training, their features' ids are those values (0 where missing), as ``predict_raw``
        gives them (the rules' ids there scored up to 0.055 away from it)."""
        dense, ids = self.rules.inputs(parsed)
        raw = self._mapped_values(parsed.values, parsed.empty)
        if raw is None:
            return dense, ids
        out, starts = ids.astype(np.int64), self._starts
        for f, values in raw.items():
            bag = out[:, starts[f] : starts[f + 1]]
            bag[...] = np.where(bag == PAD_ID, PAD_ID, values.view(np.int64))
        return dense, out

    @property
    def rules(self):
        """The artifact's raw-value rules (:mod:`dlrm_jax.serving.rules`); an ArtifactError
        saying why when it has none."""
        if self._rules is None:
            self._rules = raw_rules(self.root, self.manifest)
        return self._rules

    def close(self) -> None:
        self.tables.close()

    def __enter__(self) -> ServingModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(
    dest: str | Path,
    deltas: Sequence[str | Path] = (),
    *,
    memory_bytes: int | None = None,
    cache_rows: int = 1 << 20,
    verify_tables: bool = False,
) -> ServingModel:
    """Load the serving artifact ``dest`` (``dlrm-jax export --serving``), then each delta of
    ``deltas`` in order (``export --serving --since``; each must start at the step the one
    before it ends at). Needs only numpy, jax and tensorstore.

    Tables up to ``memory_bytes`` in all (default: half the memory available) are read whole;
    larger ones through a row cache of ``cache_rows`` rows each over memory-mapped chunk files.
    The dense function and the rules are checked against the manifest's sha256, each chunk
    file of the tables as its rows are first read (a delta's, whole, as it is applied), and
    every table file up front when ``verify_tables``."""
    deltas = as_paths(deltas)  # (one delta's path was read as its characters)
    root = Path(dest)
    manifest = read_manifest(root)
    if manifest.get("kind") != "full":
        raise ArtifactError(
            f"{root}: a delta (since step {manifest.get('base_step')}); load its base with it (`predict --model BASE "
            f"--delta {root}`; in Python, load(BASE, deltas=[...]))"
        )
    _check(root, manifest, verify_tables)
    if memory_bytes is None:
        memory_bytes = available_memory() // 2
    model = ServingModel(root, manifest, memory_bytes, cache_rows)
    for d in deltas:
        _apply_delta(model, Path(d), verify_tables)
    return model


def _check(root: Path, manifest: dict, verify_tables: bool) -> None:
    names = [n for n in manifest.get("files", {}) if verify_tables or not n.startswith("tables/")]
    check_files(root, manifest, names)
    ids_range = (manifest.get("preprocessing") or {}).get("table_rows")
    mapped = manifest.get("id_maps") or {}  # (a dynamic table's rows are its map's, not the ids' range)
    for f, e in enumerate(manifest["features"] if ids_range and manifest.get("kind") == "full" else ()):
        if e["table"] not in mapped and int(e["rows"]) < int(ids_range[f]):
            raise ArtifactError(  # (exports of tiered tables before 2026-12-06 held only the devices' cache rows)
                f"{root}: table {e['table']} holds {e['rows']:,} rows where its rules give ids up to "
                f"{int(ids_range[f]):,}: an incomplete export by an older dlrm_jax; export the run again with this version"
            )


def _apply_delta(model: ServingModel, root: Path, verify_tables: bool) -> None:
    delta = read_manifest(root)
    if delta.get("kind") != "delta":
        raise ArtifactError(f"{root}: not a delta export (export --serving --since STEP writes one)")
    if delta["base_step"] != model.step:
        raise ArtifactError(
            f"{root}: a delta from step {delta['base_step']} to {delta['step']}, applied to a model "
            f"at step {model.step}: apply the deltas in order, from the base's step"
        )
    if not delta.get("base_state") or not model.manifest.get("state"):
        raise ArtifactError(
            f"{root}: cannot tell whether this delta was exported from the state of {model.folders[-1]} "
            f"(one of them was exported by an older dlrm_jax, without a state fingerprint): export both again"
        )
    if delta["base_state"] != model.manifest["state"]:
        raise ArtifactError(
            f"{root}: a delta from another trained state than {model.folders[-1]} (both at step "
            f"{model.step}, from different runs or a run resumed elsewhere): export the base and its "
            f"deltas from the same run"
        )
    if delta.get("tables_dtype") != model.manifest.get("tables_dtype"):
        raise ArtifactError(
            f"{root}: tables {delta.get('tables_dtype')}, the base's {model.manifest.get('tables_dtype')}"
        )
    _check(root, delta, verify_tables=True)  # its tables are read whole just below
    parts = [e for entries in part_entries(delta).values() for e in entries]
    entries = [{**e, "rows": e["rows_changed"]} for e in delta["features"] + parts]
    store = open_store(root / "tables", entries, with_rows=True)
    try:
        for e in entries:
            fields = store.read(e["name"], np.arange(e["rows"]))
            rows = fields.pop(ROWS_FIELD)
            model.tables.apply_delta(e["name"], rows, {k: v for k, v in fields.items() if k in ("values", INT8_FIELD)})
    finally:
        store.close()
    model._load_function(root)
    if delta.get("id_maps"):  # the delta's step's maps replace the base's
        model.id_maps = IdMaps(root, delta["id_maps"], model.features)
    model.manifest = {
        **model.manifest,
        "step": delta["step"],
        "state": delta["state"],
        "evaluation": delta.get("evaluation"),
    }
    model.folders.append(root)


load_serving = load  # the name dlrm_jax re-exports

__all__ = ["ServingModel", "available_memory", "load", "load_serving"]


def part_entries(manifest: dict) -> dict[str, list]:
    """Each extra sparse part's table entries by part name; artifacts written before parts
    were named hold Wide&Deep's under ``wide``."""
    if "parts" in manifest:
        return manifest["parts"]
    return {"wide": manifest["wide"]} if manifest.get("wide") else {}
