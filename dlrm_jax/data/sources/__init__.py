"""Choosing the data source named by ``data.source``, and fitting the config to the data."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from dlrm_jax.config import ConfigError, DataConfig, check_features
from dlrm_jax.data.batch import DataSource
from dlrm_jax.files import add_sampled, check_each_once


def check_data_path(cfg) -> None:
    """One line (a ConfigError) when ``data.path`` is not what ``data.source`` reads: binary
    data is a folder made by ``dlrm-jax preprocess`` (with its meta.json), Criteo text is one
    or more files (comma-separated). Called before a run dir is made."""
    source_kind(cfg).check_path(cfg)


def _check_binary_path(cfg) -> None:
    d = cfg.data
    path = Path(d.path)
    if not path.exists():
        raise ConfigError(
            f"data.path={d.path}: no such folder; data.source=binary reads a folder made by `dlrm-jax preprocess`"
        )
    if not path.is_dir():
        raise ConfigError(
            f"data.path={d.path}: a file, and data.source=binary reads a folder made by "
            f"`dlrm-jax preprocess`; for a Criteo text file use data.source=criteo, or "
            f"preprocess it first"
        )
    if not (path / "meta.json").is_file():
        raise ConfigError(
            f"data.path={d.path}: no meta.json in this folder; data.source=binary reads a "
            f"folder made by `dlrm-jax preprocess`"
        )


def _check_criteo_path(cfg) -> None:
    d = cfg.data
    if (d.num_dense, cfg.num_features, max(cfg.bag_sizes)) != (13, 26, 1):
        raise ConfigError(
            f"data.source=criteo reads Criteo's 13 dense and 26 one-hot features; this config has "
            f"data.num_dense={d.num_dense}, {cfg.num_features} tables (data.cardinalities) and bags of up to "
            f"{max(cfg.bag_sizes)} (data.bag_sizes): use --config criteo_kaggle or default, or set those keys"
        )
    paths = criteo_paths(cfg.data.path)
    for p in paths:
        if Path(p).is_dir():
            raise ConfigError(
                f"data.path={p}: a folder, and data.source=criteo reads Criteo text files; "
                f"for a folder made by `dlrm-jax preprocess` use data.source=binary"
            )
        if not Path(p).is_file():
            raise ConfigError(f"data.path={p}: no such file (data.source=criteo reads Criteo text files)")
    try:  # (the held-out lines of one copy were trained on in the other)
        check_each_once(paths, "data.path: the file")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def data_identity(cfg) -> dict | None:
    """What a run records of the data it reads to know it again (``dataset.json``): a binary
    dataset's :func:`~dlrm_jax.data.shards.dataset_identity`; Criteo text files' paths, bytes
    and a digest of their sizes and ends (lines appended, or other files in their place, show);
    None for data made on the fly, or files that cannot be read."""
    if cfg.data.source == "binary":
        from dlrm_jax.data.shards import dataset_identity

        return dataset_identity(cfg.data.path)
    if cfg.data.source == "criteo":
        h, paths = hashlib.sha256(), criteo_paths(cfg.data.path)
        try:
            size = sum(add_sampled(h, p) for p in paths)
        except OSError:  # (not there: the source names it; nothing to know again)
            return None
        return {
            "path": ",".join(str(Path(p).absolute()) for p in paths),
            "content_sha256": h.hexdigest(),
            "bytes": size,
        }
    return None


def criteo_paths(data_path: str) -> list[str]:
    """``data.source=criteo``'s files: ``data.path``'s comma-separated paths, in order."""
    return [p.strip() for p in data_path.split(",") if p.strip()]


def resolve_data_config(cfg):
    """For ``binary`` data, take the number of dense features, the tables' cardinalities and
    the bag sizes from the dataset's meta.json (Criteo's 13 + 26, MLPerf's multi-hot bags, or
    what a tabular schema made; a dataset without dense features is read as one all-zero
    column). A data.num_dense or data.bag_sizes set to other than its default must agree with
    the dataset's. Keys that depend on the features (model.dcn_rank) are checked against the data's.
    Returns the config to use (a new one where the dataset changed it); other sources' configs
    come back as they are, their data path checked."""
    check_data_path(cfg)
    return source_kind(cfg).resolve(cfg)


def _resolve_binary(cfg):
    from dlrm_jax.data.sources.binary import check_windows, model_num_dense, read_meta

    meta = read_meta(cfg.data.path)
    if cfg.train.progressive_window == "data":  # before any run dir is made or program compiled
        check_windows(meta, cfg.data.path)
    cards = tuple(int(c) for c in meta["cardinalities"])
    num_dense = model_num_dense(int(meta["num_dense"]))
    bags = tuple(int(b) for b in meta["bag_sizes"])
    bags = bags[:1] if len(set(bags)) == 1 else bags  # the config's short form for equal bags
    _check_given(cfg.data, int(meta["num_dense"]), num_dense, bags, len(cards))
    if (num_dense, cards, bags) != (cfg.data.num_dense, cfg.data.cardinalities, cfg.data.bag_sizes):
        data = dataclasses.replace(cfg.data, num_dense=num_dense, cardinalities=cards, bag_sizes=bags)
        cfg = dataclasses.replace(cfg, data=data)
    try:
        return check_features(cfg)
    except ConfigError as e:
        raise ConfigError(
            f"{e} (with the {num_dense} dense and {len(cards)} categorical features of data.path={cfg.data.path})"
        ) from None


def _check_given(d, stored_dense: int, num_dense: int, bags: tuple[int, ...], features: int) -> None:
    """A ConfigError when a data.num_dense or data.bag_sizes given (other than its default)
    disagrees with the dataset's, which would replace it: the model would not be the one asked."""
    default = DataConfig()
    where = f"the dataset data.path={d.path}"
    if d.num_dense not in (default.num_dense, num_dense):
        read_as = f" (read as {num_dense} all-zero column)" if stored_dense != num_dense else ""
        raise ConfigError(
            f"data.num_dense={d.num_dense} disagrees with {where}, which has {stored_dense} dense features"
            f"{read_as}; binary data takes the dataset's: remove the key or set data.num_dense={num_dense}"
        )
    given = d.bag_sizes * features if len(d.bag_sizes) == 1 else d.bag_sizes
    if d.bag_sizes != default.bag_sizes and given != (bags * features if len(bags) == 1 else bags):
        raise ConfigError(
            f"data.bag_sizes={list(d.bag_sizes)} disagrees with {where}, whose {features} features have bags of "
            f"{list(bags)}; binary data takes the dataset's: remove the key or set data.bag_sizes={list(bags)}"
        )


def cap_note(cfg) -> str:
    """One line when ``data.max_rows`` hashes the values of a preprocessed dataset's tables, or
    of Criteo text's (``data.cardinalities``), into fewer rows ("" otherwise, and for synthetic
    data, whose ids are drawn within the capped tables)."""
    if cfg.data.source not in ("binary", "criteo") or not cfg.row_cap:
        return ""
    capped = [(c, f) for f, c in enumerate(cfg.data.cardinalities) if c > cfg.row_cap]
    if not capped:
        return ""
    largest, f = max(capped)
    whose = "the dataset's" if cfg.data.source == "binary" else "data.cardinalities'"
    return (
        f"data.max_rows={cfg.row_cap:,} hashes {len(capped)} of {whose} {cfg.num_features} tables into "
        f"{cfg.row_cap:,} rows (the largest, cat_{f}, has {largest:,} values); data.max_rows=0 keeps every "
        f"table at its own size"
    )


def dynamic_input(cfg) -> str | None:
    """What dynamic tables' maps are given for a lookup by ``cfg``'s data: ``"raw values"``
    (Criteo text; binary data preprocessed with ``--raw-values``) or ``"ids"`` (the data's own
    ids); None where it cannot be told (a dataset no longer there). A run's maps hold keys of
    one kind: read with the other, almost nothing is found, silently."""
    if cfg.data.source == "criteo":
        return "raw values"
    if cfg.data.source != "binary":
        return "ids"
    from dlrm_jax.data.shards import read_meta

    try:
        meta = read_meta(cfg.data.path)
    except (OSError, ValueError):
        return None
    return "raw values" if meta.get("raw_values") else "ids"


def make_source(
    cfg, process_index: int = 0, process_count: int = 1, *, trains: bool = True, evaluates: bool = False
) -> DataSource:
    """The data source for ``cfg.data.source``; each process reads its slice of every batch.

    ``trains``: a train split shorter than one batch is refused (each batch would hold rows more
    than once). ``evaluates``: an empty val split is refused (training evaluates at the end and
    would fail only then). A val split shorter than one batch is fine: it is evaluated as one
    partial batch, exactly."""
    kind = source_kind(cfg)
    source = kind.make(cfg, process_index, process_count)
    if kind.files:
        try:
            check_splits(cfg, source.num_train, source.num_val, trains=trains, evaluates=evaluates)
        except ConfigError:
            close_source(source)
            raise
    return source


def close_source(source) -> None:
    """Closes what a source made by :func:`make_source` holds open (a binary dataset's shard
    files); a source without ``close()`` holds nothing."""
    if (close := getattr(source, "close", None)) is not None:
        close()


def check_splits(cfg, num_train: int, num_val: int, *, trains: bool, evaluates: bool) -> None:
    """The ConfigError of a dataset too small for the run (see :func:`make_source`)."""
    where, batch = f"data.path={cfg.data.path}", cfg.train.batch_size
    if trains and num_train < batch:
        raise ConfigError(
            f"{where}: the train split has {num_train:,} rows, fewer than one batch "
            f"(train.batch_size={batch:,}), so every batch would hold rows more than once; "
            f"use train.batch_size <= {num_train:,} or more data"
        )
    if evaluates and num_val == 0:
        how = (
            "a data.val_fraction that holds out some lines"
            if cfg.data.source == "criteo"
            else "data preprocessed with a --val-fraction that holds out some rows, or --val-input"
        )
        if not trains:
            raise ConfigError(f"{where}: the val split is empty: nothing to evaluate; use {how}")
        raise ConfigError(
            f"{where}: the val split is empty, and a run evaluates (at train.eval_every and at the end); use "
            f"{how}, or train.eval_every=-1 to train without evaluating"
        )


def _synthetic(cfg, process_index: int, process_count: int) -> DataSource:
    from dlrm_jax.data.sources.synthetic import SyntheticSource

    return SyntheticSource(cfg, process_index, process_count)


def _binary(cfg, process_index: int, process_count: int) -> DataSource:
    from dlrm_jax.data.sources.binary import BinarySource

    return BinarySource(cfg, process_index, process_count)


def _criteo(cfg, process_index: int, process_count: int) -> DataSource:
    from dlrm_jax.data.sources.criteo import CriteoTSVSource

    return CriteoTSVSource(cfg, process_index, process_count)


class SourceKind(NamedTuple):
    """How one ``data.source`` is made and checked. ``make(cfg, process_index, process_count)``:
    the source (each process reads its slice of every batch); ``check_path(cfg)``: a ConfigError
    when ``data.path`` is not what it reads; ``resolve(cfg)``: the config fitted to the data
    (features, tables, bags from the dataset's own description); ``files``: it reads splits of
    files, whose sizes the run is checked against (``num_train``, ``num_val``)."""

    make: Callable[[Any, int, int], DataSource]
    check_path: Callable[[Any], None] = lambda cfg: None
    resolve: Callable[[Any], Any] = lambda cfg: cfg
    files: bool = False


# data.source -> how it is made; choices.DATA_SOURCES names the same sources for the config.
SOURCES: dict[str, SourceKind] = {
    "synthetic": SourceKind(_synthetic),
    "criteo": SourceKind(_criteo, _check_criteo_path, files=True),
    "binary": SourceKind(_binary, _check_binary_path, _resolve_binary, files=True),
}


def source_kind(cfg) -> SourceKind:
    """The registered source of ``data.source``."""
    if cfg.data.source not in SOURCES:
        raise ConfigError(f"data.source={cfg.data.source!r}: no source registered by that name ({', '.join(SOURCES)})")
    return SOURCES[cfg.data.source]
