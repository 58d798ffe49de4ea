"""The named choices the config offers and the planner acts on, defined once: the config's
allowed values, its error messages and the plan all read these enums."""

from __future__ import annotations

import enum


class Strategy(enum.StrEnum):
    """How a table is placed on the devices (``embedding.sharding``, ``embedding.table_sharding``)."""

    REPLICATED = "replicated"  # every device holds the table; gradients gathered to all
    TABLE = "table"  # the whole table on one device
    ROW = "row"  # rows split over all devices (contiguous blocks or id mod N)
    COLUMN = "column"  # columns split into slices, each slice on one device
    # rows split over the devices of one host (cluster.devices_per_host); the owners pool each
    # bag's rows and add their partial sums within the host, so one vector per bag crosses hosts
    HOST_ROW = "host_row"
    # columns split over the devices of one host, one slice each; every device of the host
    # pools its columns of each bag, and the slices meet inside the host
    HOST_COLUMN = "host_column"


class RowLayout(enum.StrEnum):
    """Which rows a row-wise table's device owns (``embedding.row_layout``)."""

    BLOCK = "block"  # device d owns rows [d*blk, (d+1)*blk)
    CYCLIC = "cyclic"  # device d owns rows with id % N == d: spreads hot ids


class Pooling(enum.StrEnum):
    """How a bag's vectors combine into its feature's one vector (``data.pooling``)."""

    SUM = "sum"
    MEAN = "mean"


class Storage(enum.StrEnum):
    """Where a table's rows live (``embedding.table_storage``)."""

    DEVICE = "device"
    TIERED = "tiered"


class DramPolicy(enum.StrEnum):
    """How a tiered table's DRAM cache chooses what to keep (``embedding.tier.policy``)."""

    LRU = "lru"  # evicts the least recently used
    LFU = "lfu"  # evicts the least often used (recency breaks ties)
    TINYLFU = "tinylfu"  # LRU behind a frequency admission filter
