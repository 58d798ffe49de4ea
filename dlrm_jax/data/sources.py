"""Choosing the data source named by ``data.source``, and fitting the config to the data."""

from __future__ import annotations

import dataclasses

from dlrm_jax.data.batch import DataSource


def resolve_data_config(cfg):
    """For ``binary`` data, take the number of dense features, the tables' cardinalities and
    the bag sizes from the dataset's meta.json (Criteo's 13 + 26, MLPerf's multi-hot bags, or
    what a tabular schema made; a dataset without dense features is read as one all-zero
    column)."""
    if cfg.data.source != "binary":
        return cfg
    from dlrm_jax.data.binary import model_num_dense, read_meta

    meta = read_meta(cfg.data.path)
    cards = tuple(int(c) for c in meta["cardinalities"])
    num_dense = model_num_dense(int(meta["num_dense"]))
    bags = tuple(int(b) for b in meta["bag_sizes"])
    bags = bags[:1] if len(set(bags)) == 1 else bags  # the config's short form for equal bags
    if (num_dense, cards, bags) == (cfg.data.num_dense, cfg.data.cardinalities, cfg.data.bag_sizes):
        return cfg
    data = dataclasses.replace(cfg.data, num_dense=num_dense, cardinalities=cards, bag_sizes=bags)
    return dataclasses.replace(cfg, data=data)


def make_source(cfg, process_index: int = 0, process_count: int = 1) -> DataSource:
    """The data source for ``cfg.data.source``; each process reads its slice of every batch."""
    if cfg.data.source == "synthetic":
        from dlrm_jax.data.synthetic import SyntheticSource

        return SyntheticSource(cfg, process_index, process_count)
    if cfg.data.source == "binary":
        from dlrm_jax.data.binary import BinarySource

        return BinarySource(cfg, process_index, process_count)
    from dlrm_jax.data.criteo import CriteoTSVSource

    return CriteoTSVSource(cfg, process_index, process_count)
