"""The preprocessing rules a serving artifact carries (``manifest["preprocessing"]`` and
``dense_transform``): how raw values become the ids and inputs the model trained on, with the
vocabularies, and a tabular schema with its join files, copied in from the dataset the run
trained on. Read back by :mod:`dlrm_jax.serving.rules`."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from dlrm_jax.data.preprocessing.multihot import rule_name
from dlrm_jax.data.preprocessing.preprocess import MISSING_ID, OOV_ID
from dlrm_jax.data.shards import VOCAB_DIR
from dlrm_jax.data.sources.binary import read_meta


def rules(work: Path, cfg) -> dict:
    """How raw values become ids, with the vocabularies (and a schema with its join files)
    copied in (see dlrm_jax.serving.rules)."""
    source = cfg.data.source
    if source == "criteo":
        return {"format": "criteo", "kind": "hash"}
    if source != "binary":
        return {"kind": "none", "why": f"trained on data.source={source}: no raw values"}
    root = Path(cfg.data.path)
    meta = read_meta(root)
    (work / "rules").mkdir()
    files = []
    for f, vocabulary in enumerate(vocabularies(cfg)):
        name = f"rules/feature_{f}.npy"
        shutil.copyfile(vocabulary, work / name)
        files.append(name)
    modulus = int(meta.get("max_ind_range") or 0)
    spec = {
        "format": "tabular" if "schema" in meta else "criteo",
        "kind": "compact" if modulus else "vocabulary",
        "max_ind_range": modulus,
        "cardinalities": [int(c) for c in meta["cardinalities"]],
        "table_rows": list(cfg.table_rows),  # the ids' range (a dynamic table's rows are its map's)
        "raw_values": bool(meta.get("raw_values")),  # dynamic tables mapped the values, not the ids
        "files": files,
    }
    bags = [int(b) for b in meta["bag_sizes"]]
    if max(bags) > 1:  # preprocess --multi-hot: MLPerf's rule, fixed by its seed (the only one it draws)
        spec["multi_hot"] = {
            "bag_sizes": bags,
            **meta.get("multi_hot", rule_name()),
        }
    if modulus:  # the compacted tables' row for hashed values training never counted, if any
        spec["oov_rows"] = [_oov_row(np.load(work / name)) for name in files]
    else:
        spec |= vocabulary_ids(root, meta)
    if "schema" in meta:  # the schema and its join files, as preprocessing read them
        # (copied into the dataset; one preprocessed before that names them where they were)
        side = meta.get("side_files") or {"schema": meta["schema"], "joins": meta.get("joins", {})}
        spec["schema"] = "rules/schema.yaml"
        if meta.get("header_columns"):  # (a schema naming its columns only in the files' header lines)
            spec["header_columns"] = list(meta["header_columns"])
        _copy_side_file(_schema_file(cfg, meta), work / spec["schema"], cfg)
        spec["joins"] = {}
        for name, path in side["joins"].items():
            spec["joins"][name] = f"rules/joins/{name}/{Path(path).name}"
            (work / spec["joins"][name]).parent.mkdir(parents=True)
            _copy_side_file(root / path, work / spec["joins"][name], cfg)
    return spec


def vocabularies(cfg) -> list[Path]:
    """A binary dataset's vocabulary files, each there (a bare "[Errno 2]" before)."""
    if cfg.data.source != "binary":
        return []
    root = Path(cfg.data.path)
    files = [root / VOCAB_DIR / f"feature_{f}.npy" for f in range(len(read_meta(root)["cardinalities"]))]
    for vocabulary in files:
        if not vocabulary.is_file():
            raise FileNotFoundError(
                f"{vocabulary}: missing from the dataset the run trained on (data.path={cfg.data.path}); a "
                f"serving artifact carries its vocabularies: put the dataset back whole, or export without --serving"
            )
    return files


def vocabulary_ids(root: Path, meta: dict) -> dict:
    """The ids a vocabulary dataset gave (the serving rules' ``missing_id``, ``oov_id`` and
    ``first_id``, the id of a vocabulary's first value), told by its tables' rows: K values
    and 2 more (missing, out of the vocabulary) since 2026-11-25; K and 1 before (missing and
    out of the vocabulary one id, the values from 1), a layout whose meta.json is the same."""
    extra = {
        int(card) - len(np.load(root / VOCAB_DIR / f"feature_{f}.npy", mmap_mode="r"))
        for f, card in enumerate(meta["cardinalities"])
    }
    if extra == {2}:
        return {"missing_id": MISSING_ID, "oov_id": OOV_ID, "first_id": OOV_ID + 1}
    if extra == {1}:
        return {"missing_id": MISSING_ID, "oov_id": MISSING_ID, "first_id": 1}
    raise ValueError(
        f"{root}: its vocabularies do not match its tables' rows (meta.json's cardinalities): a damaged or "
        f"edited dataset; preprocess the data again"
    )


def _schema_file(cfg, meta: dict) -> Path:
    """A tabular dataset's schema as preprocessing read it: its copy in the dataset (one
    preprocessed before the copies: where it was then)."""
    side = meta.get("side_files") or {"schema": meta["schema"]}
    return Path(cfg.data.path) / side["schema"]


def _copy_side_file(source: Path, dest: Path, cfg) -> None:
    if not source.is_file():  # (a bare "[Errno 2]" before)
        raise FileNotFoundError(
            f"{source}: the tabular schema or a join file the dataset was preprocessed with (data.path="
            f"{cfg.data.path}) is gone; a serving artifact carries them: put it back, or preprocess the data again"
        )
    shutil.copyfile(source, dest)


def dense_transform(cfg) -> dict:
    """What turns a raw dense value into the model's input, per dense feature."""
    if cfg.data.source == "binary":
        meta = read_meta(Path(cfg.data.path))
        if "schema" in meta:
            from dlrm_jax.data.preprocessing.tabular_schema import load_schema

            return {
                "features": {f.name: f.transform for f in load_schema(_schema_file(cfg, meta)).dense},
                "log1p": "log1p(max(x, 0)), missing 0",
                "none": "x as it is, missing 0",
                **({"zero_column": True} if not meta["num_dense"] else {}),
            }
    if cfg.data.source == "synthetic":
        return {"all": "none: synthetic features are model inputs as drawn"}
    return {"all": "log1p(max(x, 0)), missing 0 (Criteo's integer counts)"}


def _oov_row(kept: np.ndarray) -> int | None:
    """A compacted vocabulary's last row is the unseen values' when its count is 0."""
    return len(kept) - 1 if len(kept) and int(kept[-1, 1]) == 0 else None
