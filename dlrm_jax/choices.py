"""The named choices the config offers and the planner acts on, defined once: the config's
allowed values, its error messages and the plan all read these enums and registries."""

from __future__ import annotations

import enum
from dataclasses import dataclass


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


def _or_auto(name: str, values: type[enum.StrEnum], doc: str) -> type[enum.StrEnum]:
    """An enum of ``values``' members and AUTO (``"auto"``): the planner chooses per table."""
    choice = enum.StrEnum(name, [("AUTO", "auto"), *((m.name, m.value) for m in values)], module=__name__)
    choice.__doc__ = doc
    return choice


# What the config asks of the planner: one strategy (layout) for every table, or AUTO, the
# search's choice per table from the cost model.
Sharding = _or_auto("Sharding", Strategy, "``embedding.sharding``: a Strategy for every table, or AUTO.")
RowLayoutChoice = _or_auto("RowLayoutChoice", RowLayout, "``embedding.row_layout``: a RowLayout, or AUTO.")


class BagExchange(enum.StrEnum):
    """How table- and column-wise tables exchange (``embedding.bag_exchange``)."""

    AUTO = "auto"  # the planner's choice under sharding=auto, else pooled bags and one-hot ids
    IDS = "ids"  # distinct rows travel, the requester pools
    POOLED = "pooled"  # every bag goes to its owner, which pools it


class IdsExchange(enum.StrEnum):
    """How the ids exchange crosses hosts (``embedding.ids_exchange``)."""

    AUTO = "auto"  # whichever the cost model predicts faster
    FLAT = "flat"  # every device to every owner
    TWO_LEVEL = "two_level"  # a host's requests merged before they cross hosts


class Sync(enum.StrEnum):
    """How many sets of the tables there are and how they agree (``embedding.sync``)."""

    GLOBAL = "global"  # one set over every device
    PER_HOST = "per_host"  # each host its own, trained on its own rows, averaged every sync_every
    HOST_REPLICAS = "host_replicas"  # equal replicas per host, every host's gradients applied to each


class Interaction(enum.StrEnum):
    """How DLRM's top MLP sees the features (``model.interaction``)."""

    DOT = "dot"  # pairwise dot products of the vectors (DLRM)
    CAT = "cat"  # their concatenation
    DCN = "dcn"  # the concatenation through a DCNv2 cross network (DLRM-DCNv2)


class MlpParallel(enum.StrEnum):
    """How the dense layers use a model group's devices (``model.mlp_parallel``)."""

    DATA = "data"  # each device holds all of them
    TENSOR = "tensor"  # Megatron column/row pairs
    PIPELINE = "pipeline"  # GPipe stages over microbatches


class Pooling(enum.StrEnum):
    """How a bag's vectors combine into its feature's one vector (``data.pooling``)."""

    SUM = "sum"
    MEAN = "mean"


class Storage(enum.StrEnum):
    """Where a table's rows live (``embedding.table_storage``)."""

    DEVICE = "device"
    TIERED = "tiered"


class Ids(enum.StrEnum):
    """How a categorical value becomes a table row (``embedding.ids``, ``embedding.table_ids``)."""

    VOCAB = "vocab"  # the data's row ids as they come (a vocabulary or a hash, fixed before training)
    DYNAMIC = "dynamic"  # raw 64-bit ids mapped to rows as training runs: no collisions, eviction


class EvictionPolicy(enum.StrEnum):
    """Which id a dynamic table's full probes give up (``embedding.dynamic.policy``)."""

    LRU = "lru"  # the id seen least recently
    LFU = "lfu"  # the id seen least often, counts halving every half_life steps


class DotPairs(enum.StrEnum):
    """How the dot interaction's pairs are computed (``model.dot_pairs``)."""

    AUTO = "auto"  # xla until the kernels are measured on a GPU
    XLA = "xla"  # each sample's N x N products (a batched GEMM), then a gather of the pairs
    FUSED = "fused"  # Pallas kernels: the pairs and their gradient, no N x N products in memory


class CrossLayers(enum.StrEnum):
    """How a low-rank cross layer's second product and elementwise work run (``model.cross_layers``)."""

    AUTO = "auto"  # xla until the kernel is measured on a GPU
    XLA = "xla"  # XLA's GEMM, then a fusion reading its product back beside x0 and x
    FUSED = "fused"  # a Pallas kernel: the product and the elementwise work in one pass


class ControlFlow(enum.StrEnum):
    """How a dynamic table's step takes its data-dependent work (``embedding.dynamic.control_flow``)."""

    AUTO = "auto"  # branches on CPUs, prefixes on other platforms
    BRANCHES = "branches"  # a switch among prefix sizes of the distinct ids, loops that end when done
    PREFIXES = "prefixes"  # that switch alone: the rest as on one path
    ONE_PATH = "one_path"  # every id, no switch or conditional, the map written at once, the dedup by sorts


class HostMemory(enum.StrEnum):
    """What the batches' host buffers are (``data.host_memory``)."""

    AUTO = "auto"  # pinned where the devices are GPUs, pageable elsewhere
    PINNED = "pinned"  # page-locked and registered with the devices' runtime: transferred with no staging copy
    PAGEABLE = "pageable"  # ordinary memory: the runtime copies each batch into a staging buffer of its own


class NewRows(enum.StrEnum):
    """What a row a dynamic table gives to a new id starts from (``embedding.dynamic.new_rows``)."""

    INITIALIZER = "initializer"  # the id's own initial vector (a hash of the seed, the table and the id)
    SHARED = "shared"  # that plus its shard's shared row: what the id was trained through until then


class DramPolicy(enum.StrEnum):
    """How a tiered table's DRAM cache chooses what to keep (``embedding.tier.policy``)."""

    LRU = "lru"  # evicts the least recently used
    LFU = "lfu"  # evicts the least often used (recency breaks ties)
    TINYLFU = "tinylfu"  # LRU behind a frequency admission filter


@dataclass(frozen=True)
class SparseOptimizerKind:
    """What the config and the planner know of a sparse optimizer, without its math (which
    ``embedding/exchange/optimizers.py`` registers under the same name; a test holds the two to
    each other): its state's size, and the two properties the exchange's choice of form reads."""

    name: str
    state_per_value: int  # float32 state values per element of a row (Adagrad's accumulator: 1)
    state_per_row: int  # float32 state values per row (row-wise Adagrad's accumulator: 1)
    # its step reads each row's statistic over the row's whole width: a table split by columns
    # must give every slice the whole row's
    whole_rows: bool = False
    # its update rewrites every row it is given from the state alone (FTRL's weights follow
    # from (z, n)): never as a dense update of every row
    rewrites_given_rows: bool = False
    tables: bool = True  # offered as embedding.optimizer
    wide: bool = True  # offered as model.wide.optimizer (the wide part's weights)

    def state_bytes_per_row(self, dim: int) -> int:
        """Bytes of optimizer state per table row of width ``dim``."""
        return 4 * (self.state_per_value * dim + self.state_per_row)


SPARSE_OPTIMIZER_KINDS: dict[str, SparseOptimizerKind] = {
    k.name: k
    for k in (
        SparseOptimizerKind("sgd", 0, 0),
        SparseOptimizerKind("adagrad", 1, 0),
        SparseOptimizerKind("rowwise_adagrad", 0, 1, whole_rows=True, wide=False),
        SparseOptimizerKind("ftrl", 2, 0, rewrites_given_rows=True, tables=False),
    )
}


# model.kind's values and what each is. train/wiring.MODELS builds each under the same name; the
# config reads this dict when it checks a value, so a registered model is a valid model.kind.
MODEL_KINDS: dict[str, str] = {
    "dlrm": "bottom MLP, interaction, top MLP (DLRM; DLRM-DCNv2 with model.interaction=dcn)",
    "wide_deep": "Wide&Deep: the deep part over the dense features and the pooled vectors, and a linear "
    "wide part over the ids",
}


# data.source's values and what each reads. data/sources.SOURCES makes each under the same name;
# the config checks a value against this dict, so a registered source is a valid data.source.
DATA_SOURCES: dict[str, str] = {
    "synthetic": "batches generated from the seed (no files); the tables as data.cardinalities says",
    "criteo": "Criteo-format text files (tab-separated label, 13 dense, 26 hex categorical values)",
    "binary": "a folder made by `dlrm-jax preprocess` (memory-mapped shards and meta.json)",
}
