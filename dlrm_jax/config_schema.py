"""The configuration's schema: one frozen dataclass per section, whose defaults *are* the
embedded default configuration (``configs/default.yaml`` spells them out; a test keeps the
two identical). Field metadata lists the words a key takes; :mod:`dlrm_jax.config` loads,
coerces and checks values against it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlrm_jax.choices import (
    DATA_SOURCES,
    MODEL_KINDS,
    SPARSE_OPTIMIZER_KINDS,
    DramPolicy,
    Pooling,
    RowLayout,
    Storage,
    Strategy,
)

# Published per-feature cardinalities of Criteo Kaggle (facebookresearch/dlrm).
CRITEO_KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
)

AUTO_ROW_CAP = 20000  # data.max_rows=auto for synthetic data and Criteo text

CONFIG_DIR = Path(__file__).resolve().parent / "configs"  # package data; the checkout's configs/ links here


class ConfigError(ValueError):
    """A configuration key or value that cannot be used; the message names the key."""


def _choices(*values: str) -> dict:
    return {"choices": values}


def _int_or(*words: str) -> dict:
    """An integer key that also takes these words (e.g. ``auto``)."""
    return {"words": words}


def _bound(rule: str, note: str = "", each: bool = False) -> dict:
    """A numeric key's allowed values, declared beside it and checked by ``config.validate``:
    ``>0``, ``>=0``, or an interval such as ``(0, 1]``; ``note`` follows the rule in the error;
    ``each``: the rule holds for every element of a list."""
    return {"bound": rule, "bound_note": note, "bound_each": each}


POS, NONNEG = _bound(">0"), _bound(">=0")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = field(default=1000, metadata=POS)
    epochs: float = field(
        default=0.0, metadata=NONNEG
    )  # > 0: train this many passes over the train split (real data); train.steps gives way
    batch_size: int = field(default=1024, metadata=POS)  # global, over all processes and devices
    seed: int = 0
    learning_rate: float = field(default=0.001, metadata=POS)  # dense part; the embeddings take embedding.learning_rate
    optimizer: str = field(default="adam", metadata=_choices("sgd", "adagrad", "adam"))
    warmup_steps: int = field(default=0, metadata=NONNEG)
    decay_steps: int = field(
        default=0, metadata=NONNEG
    )  # polynomial decay to 0 over the last `decay_steps` steps; 0 = none
    decay_power: float = field(default=2.0, metadata=POS)  # below 0 the "decay" would raise the rate
    compute_dtype: str = field(default="float32", metadata=_choices("float32", "bfloat16"))
    log_every: int = field(default=50, metadata=NONNEG)
    eval_every: int = field(default=250, metadata=NONNEG)  # 0 = only at the end
    evals_per_epoch: int = field(
        default=0, metadata=NONNEG
    )  # > 0 (real data): evaluate this many times an epoch; train.eval_every gives way
    eval_batches: int = field(
        default=0, metadata=NONNEG
    )  # global batches per evaluation; 0 = the whole val split (synthetic data: 16)
    checkpoint_every: int = field(default=250, metadata=NONNEG)  # 0 = only at the end
    keep_checkpoints: int = field(default=3, metadata=POS)
    # auc or logloss: the checkpoint of the best evaluation by that metric is kept beyond the
    # newest keep_checkpoints (an evaluation that improves on it is saved); '' = off.
    keep_best: str = field(default="", metadata=_choices("", "auc", "logloss"))
    target_auc: float = field(
        default=0.0, metadata=_bound("[0, 1]", " (0 = off)")
    )  # stop once an evaluation's AUC reaches this; 0 = off
    # Stop after this many evaluations in a row without a better keep_best metric (auc when
    # keep_best is ''); 0 = off.
    early_stop_evals: int = field(default=0, metadata=NONNEG)
    max_loss_ratio: float = field(
        default=10.0, metadata=NONNEG
    )  # stop when the loss exceeds this x its starting value; 0 = off
    progress_bar: bool = True
    tensorboard: bool = False  # also write metrics as TensorBoard events under RUN_DIR/tensorboard
    # Several processes: one that makes no progress (a step, evaluation or checkpoint) for this
    # long exits naming where every process is, and the others follow; 0 = off.
    hang_timeout_s: float = field(default=900.0, metadata=NONNEG)


@dataclass(frozen=True)
class DataConfig:
    source: str = field(default="synthetic", metadata={"choices": DATA_SOURCES})  # a live registry
    path: str = ""  # criteo: TSV file(s), comma separated; binary: `dlrm-jax preprocess` output
    num_dense: int = field(default=13, metadata=POS)
    cardinalities: tuple[int, ...] = field(default=CRITEO_KAGGLE_CARDINALITIES, metadata=_bound(">0", each=True))
    # Cap on rows per table, larger ones hashed into it; 0 = no cap; auto = 20000 for synthetic
    # data and Criteo text (sized by data.cardinalities), none for binary data (its own sizes).
    max_rows: int | str = field(default="auto", metadata=_int_or("auto") | NONNEG)
    bag_sizes: tuple[int, ...] = field(
        default=(1,), metadata=_bound(">0", each=True)
    )  # max ids per feature; one value for all, or one per feature
    pooling: str = field(default="sum", metadata=_choices(*Pooling))
    zipf_exponent: float = field(default=1.1, metadata=NONNEG)  # synthetic id popularity; larger = more skewed
    # synthetic: "permuted" scatters popular ids over each table; "frequency_ordered" numbers
    # them by popularity (id 0 the most frequent), as `preprocess` vocabularies do.
    id_layout: str = field(default="permuted", metadata=_choices("permuted", "frequency_ordered"))
    positive_rate: float = field(default=0.26, metadata=_bound("(0, 1)"))  # synthetic: target click-through rate
    shuffle: bool = True  # binary: visit each process's blocks of rows in a new order every epoch
    shuffle_block: int = field(
        default=4096, metadata=POS
    )  # binary: rows read contiguously (the unit the epochs shuffle)
    # Threads that read and check batches and copy them to the devices, ahead of the step (also
    # the hot-row counting threads); auto: this process's share of the host's cores less two
    # (the dispatching thread, XLA's own), between 2 and 16.
    readers: int | str = field(default="auto", metadata=_int_or("auto") | POS)
    prefetch: int = field(
        default=4, metadata=POS
    )  # steps of input prepared ahead, at least data.readers (host and device memory: this many batches)
    skip_bad_lines: bool = False  # criteo: skip and count malformed lines instead of failing
    val_fraction: float = field(
        default=0.1, metadata=_bound("(0, 1)")
    )  # criteo: the last fraction of lines held out for evaluation


@dataclass(frozen=True)
class ModelConfig:
    # The model trained: choices.MODEL_KINDS says what each is (dlrm; wide_deep, whose deep part
    # takes the dense features as they are, bottom_mlp empty, beside a linear wide part over the ids).
    # The registry itself is the choices, read when a value is checked: a registered model is valid.
    kind: str = field(default="dlrm", metadata={"choices": MODEL_KINDS})
    embedding_dim: int = field(default=16, metadata=POS)
    bottom_mlp: tuple[int, ...] = field(
        default=(128, 64, 16), metadata=_bound(">0", each=True)
    )  # output widths; the last must be embedding_dim for dot
    top_mlp: tuple[int, ...] = field(
        default=(256, 128, 1), metadata=_bound(">0", each=True)
    )  # output widths; the last must be 1
    interaction: str = field(default="dot", metadata=_choices("dot", "cat", "dcn"))
    dcn_layers: int = field(default=3, metadata=POS)  # interaction=dcn: cross layers (DCNv2)
    dcn_rank: int = field(
        default=0, metadata=NONNEG
    )  # interaction=dcn: rank of each layer's weight (U V); 0 = full d x d
    # wide_deep: the wide part's own optimizer (FTRL-Proximal as in the Wide&Deep paper) and its
    # constant learning rate; l1 / l2: FTRL's regularisation strengths.
    wide_optimizer: str = field(
        default="ftrl", metadata=_choices(*(k.name for k in SPARSE_OPTIMIZER_KINDS.values() if k.wide))
    )
    wide_learning_rate: float = 0.05
    wide_l1: float = 0.0
    wide_l2: float = 0.0
    # The dense layers over mesh.model devices (model/mlp_parallel.py): data (each device all
    # of them), tensor (Megatron column/row pairs), pipeline (GPipe stages, microbatches).
    mlp_parallel: str = field(default="data", metadata=_choices("data", "tensor", "pipeline"))
    microbatches: int = field(
        default=4, metadata=POS
    )  # mlp_parallel=pipeline: microbatches a model group's rows are split into


@dataclass(frozen=True)
class HotConfig:
    """Hot-row replication: the most looked-up rows live on every device (embedding/hot/)."""

    rows: int | str = field(default=0, metadata=_int_or("auto") | NONNEG)  # 0 = off; auto = the cost model
    memory_mb: float = field(default=64.0, metadata=POS)  # per device: hot rows plus their optimizer state
    stats_batches: int = field(default=8, metadata=POS)  # batches counted to choose the rows (and before each refresh)
    refresh_every: int = field(default=0, metadata=NONNEG)  # steps between re-choosing the rows; 0 = never
    decay: float = field(default=0.5, metadata=_bound("[0, 1]"))  # counts kept from before a refresh, as a fraction
    # All-to-all over all-reduce bandwidth (`dlrm-jax bench collectives`); 0 = per backend.


@dataclass(frozen=True)
class TierConfig:
    """Tiered storage: tables in a tensorstore array on local disk, DRAM and device caches in
    front (embedding/tiers/)."""

    path: str = ""  # the disk tier's folder; '' = RUN_DIR/tier
    # Device cache per owner of each tiered table: rows, or 0 = device_cache_fraction of them.
    device_cache_rows: int = field(default=0, metadata=NONNEG)
    device_cache_fraction: float = field(default=0.1, metadata=_bound("(0, 1]"))
    host_cache_rows: int = field(
        default=0, metadata=NONNEG
    )  # DRAM cache per tiered table: rows, or 0 = host_cache_fraction
    # DRAM cache as a share of each tiered table's rows; 0 = from the machine: the caches
    # together take at most half the memory available when the run plans (all rows if that fits).
    host_cache_fraction: float = field(default=0.0, metadata=_bound("[0, 1]", " (0 = from the memory available)"))
    policy: str = field(default="lru", metadata=_choices(*DramPolicy))  # the DRAM cache's
    lookahead: int = field(default=2, metadata=NONNEG)  # batches planned ahead; their rows are never evicted early
    fill_rows: int = field(default=0, metadata=NONNEG)  # rows one step may fill per device and group; 0 = measured
    # Size of the disk tier's chunk files: 64 MiB keeps a 30 GiB tier at ~1,000 files (each
    # reading thread keeps its own open); a snapshot's copy-on-write copies a chunk at a time.
    chunk_mb: float = field(default=64.0, metadata=POS)


@dataclass(frozen=True)
class EmbeddingConfig:
    sharding: str = field(default="auto", metadata=_choices("auto", *Strategy))
    optimizer: str = field(
        default="rowwise_adagrad", metadata=_choices(*(k.name for k in SPARSE_OPTIMIZER_KINDS.values() if k.tables))
    )
    learning_rate: float = field(default=0.05, metadata=NONNEG)  # 0 = use train.learning_rate
    adagrad_eps: float = field(default=1e-8, metadata=NONNEG)
    adagrad_initial_accumulator: float = field(default=0.0, metadata=NONNEG)
    table_sharding: tuple[str, ...] = ()  # per-table overrides, e.g. ["cat_2=row", "cat_9=table"]
    row_layout: str = field(default="block", metadata=_choices(*RowLayout, "auto"))
    capacity_from: str = field(default="measured", metadata=_choices("measured", "batch"))
    bag_exchange: str = field(default="auto", metadata=_choices("auto", "ids", "pooled"))
    # The ids exchange on several hosts: a host's requests merged before they cross hosts
    # (two_level), or every device to every owner (flat); auto: the faster predicted.
    ids_exchange: str = field(default="auto", metadata=_choices("auto", "flat", "two_level"))
    capacity_factor: float = field(
        default=1.25, metadata=POS
    )  # headroom of the all-to-all buckets over the busiest owner's load
    dtype: str = field(default="float32", metadata=_choices("float32", "bfloat16"))  # table storage
    exchange_dtype: str = field(default="float32", metadata=_choices("float32", "bfloat16", "float8"))
    # Duplicate rows' gradients summed exactly (embedding/exchange/sums.py): bit-identical runs on GPUs,
    # whose scatter-adds use atomics in any order. Costs a few percent (BENCHMARKS.md).
    deterministic: bool = False
    # The sparse update: xla (rows sorted once, each row's lookups summed, one scatter per table
    # and state array), or fused (Pallas kernels that sum each row's lookups and apply the
    # optimizer in one pass, in a fixed order: GPUs; elsewhere interpreted, for tests only).
    sparse_update: str = field(default="xla", metadata=_choices("xla", "fused"))
    memory_budget_gb: float = field(
        default=0.0, metadata=NONNEG
    )  # per device, for tables, optimizer state, buffers; 0 = no check
    hot: HotConfig = HotConfig()
    # Where tables live: on their devices, or in the host tier behind caches (sharded tables
    # only: a replicated table is small by choice). table_storage overrides it per table.
    storage: str = field(default="device", metadata=_choices(*Storage))
    table_storage: tuple[str, ...] = ()  # e.g. ["cat_2=tiered", "cat_9=device"]
    tier: TierConfig = TierConfig()
    # global: one set of tables sharded over every device. per_host: each host keeps its own
    # set, sharded over its local devices and trained on its own data only (no cross-host
    # embedding traffic; the MLP gradients are still all-reduced over every device), averaged
    # over hosts every sync_every steps (0 = never: independent embeddings). host_replicas:
    # each host keeps a replica, sharded over its local devices, so the lookups' all-to-all
    # stays inside the host; every replica applies the gradients of every host (gathered over
    # hosts), so training is global's (up to the order of float sums), at the hosts' count
    # times the table memory.
    sync: str = field(default="global", metadata=_choices("global", "per_host", "host_replicas"))
    sync_every: int = field(default=0, metadata=NONNEG)

    @property
    def tables_per_host(self) -> bool:
        """Each host holds its own copy of the tables (per_host or host_replicas)."""
        return self.sync != "global"


@dataclass(frozen=True)
class MeshConfig:
    devices: int = field(
        default=0, metadata=NONNEG
    )  # 0 = every device; on a host without accelerators, 8 simulated CPU devices
    # Hosts of the (hosts, data, model) mesh that embedding.sync=per_host uses: 0 = one per process;
    # more than the processes splits each process's devices into simulated hosts.
    hosts: int = field(default=0, metadata=NONNEG)
    # Neighbouring devices that share the dense MLPs' layers (model.mlp_parallel tensor or
    # pipeline); the mesh is (data, model), the batch and the embedding tables over both.
    model: int = field(default=1, metadata=POS)


@dataclass(frozen=True)
class ClusterConfig:
    """The machines embedding.sharding=auto prices a plan for (embedding/plan/cost.py has the
    model and the sources of the profiles' numbers); 0 = the profile's value."""

    # auto: cpu when training on simulated CPU devices, else h100 (8 GPUs a host, NVLink within,
    # one 400 Gb/s InfiniBand NIC per GPU between hosts)
    profile: str = field(default="auto", metadata=_choices("auto", "h100", "cpu"))
    devices_per_host: int = field(default=0, metadata=NONNEG)
    intra_host_gbps: float = field(default=0.0, metadata=NONNEG)  # GB/s each way per device between devices of one host
    inter_host_gbps: float = field(default=0.0, metadata=NONNEG)  # GB/s each way per device between hosts
    hbm_gbps: float = field(default=0.0, metadata=NONNEG)  # device memory bandwidth
    tflops: float = field(default=0.0, metadata=NONNEG)  # dense matmul peak at bfloat16 (float32: half)
    device_memory_gb: float = field(
        default=0.0, metadata=NONNEG
    )  # the planner's budget when embedding.memory_budget_gb is 0 (90% of it)


@dataclass(frozen=True)
class Config:
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    embedding: EmbeddingConfig = EmbeddingConfig()
    mesh: MeshConfig = MeshConfig()
    cluster: ClusterConfig = ClusterConfig()

    @property
    def num_features(self) -> int:
        return len(self.data.cardinalities)

    @property
    def table_rows(self) -> tuple[int, ...]:
        """Rows of each feature's table after the ``data.max_rows`` cap."""
        cap = self.row_cap
        return tuple(min(c, cap) if cap else c for c in self.data.cardinalities)

    @property
    def row_cap(self) -> int:
        """``data.max_rows`` as a number (0: no cap): ``auto`` caps synthetic data and Criteo
        text at 20,000 rows a table and leaves a preprocessed dataset its own sizes."""
        cap = self.data.max_rows
        if cap == "auto":
            return 0 if self.data.source == "binary" else AUTO_ROW_CAP
        return cap

    @property
    def bag_sizes(self) -> tuple[int, ...]:
        """Maximum ids per sample for each feature (1 = one-hot)."""
        b = self.data.bag_sizes
        return tuple(b) * self.num_features if len(b) == 1 else tuple(b)

    @property
    def embedding_learning_rate(self) -> float:
        return self.embedding.learning_rate or self.train.learning_rate

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(dataclasses.asdict(self))


def _to_plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(v) for v in obj]
    return obj
