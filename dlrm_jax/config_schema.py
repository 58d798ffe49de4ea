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
    BagExchange,
    ControlFlow,
    CrossLayers,
    DotPairs,
    DramPolicy,
    EvictionPolicy,
    HostMemory,
    Ids,
    IdsExchange,
    Interaction,
    MlpParallel,
    NewRows,
    Pooling,
    RowLayoutChoice,
    Sharding,
    Storage,
    Sync,
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


PATHS = {"paths": True}  # a path or comma-separated paths: a leading ``~`` is the home folder


def doc(meaning: str) -> dict:
    """A key's meaning (markdown): docs/configs.md's tables and configs/default.yaml are
    generated from it (``python -m dlrm_jax.config_doc``)."""
    return {"doc": meaning}


@dataclass(frozen=True)
class TrainConfig:
    steps: int = field(default=1000, metadata=POS | doc("training steps"))
    epochs: float = field(
        default=0.0,
        metadata=NONNEG
        | doc(
            "> 0: train this many passes over the train split (binary data, Criteo text): it sets "
            "`train.steps` (which gives way, and the run says so); a run prints its split's rows and "
            "steps an epoch, and the progress line the epoch"
        ),
    )
    batch_size: int = field(
        default=1024,
        metadata=_bound("[1, 2147483647]", " (samples are counted in 32 bits)")
        | doc("global batch: samples per step over every device and process"),
    )
    seed: int = field(
        default=0,
        metadata=_bound("[0, 4294967295]", " (a 32-bit seed)")
        | doc("seed of the parameters, the synthetic data and the shuffles"),
    )
    learning_rate: float = field(
        default=0.001, metadata=POS | doc("the dense part's learning rate (the tables take `embedding.learning_rate`)")
    )
    optimizer: str = field(
        default="adam",
        metadata=_choices("sgd", "adagrad", "adam")
        | doc("the dense part's optimizer (optax's; `adagrad` as torch's and the tables': g / (sqrt(sum g^2) + 1e-8))"),
    )
    warmup_steps: int = field(
        default=0,
        metadata=NONNEG
        | doc(
            "linear warmup over the first steps: step k (from 1) at k / warmup_steps of the rate, the "
            "full rate from step warmup_steps on"
        ),
    )
    decay_steps: int = field(
        default=0,
        metadata=NONNEG
        | doc("polynomial decay to 0 over this many steps (the run's last unless `train.decay_start`); 0 = none"),
    )
    decay_start: int = field(
        default=0,
        metadata=NONNEG
        | doc(
            "> 0: the decay starts after this many steps (HugeCTR's and MLPerf's reference `decay_start`; "
            "the decay may go on past the run's end, but must start before it: a run trained in stages gives it "
            "once its `train.steps` pass it); 0: it takes the run's last `train.decay_steps` steps"
        ),
    )
    # (a power below 0 would make the "decay" raise the rate)
    decay_power: float = field(default=2.0, metadata=POS | doc("the decay's power (> 0)"))
    compute_dtype: str = field(
        default="float32",
        metadata=_choices("float32", "bfloat16") | doc("`bfloat16`: MLP compute in bf16 with float32 master weights"),
    )
    log_every: int = field(
        default=50,
        metadata=NONNEG
        | doc(
            "steps between log events in `metrics.jsonl` (a checkpoint's save, an evaluation and a progressive "
            "window end a log window too: a resumed run re-logs the windows it lost exactly); 0 = only those"
        ),
    )
    eval_every: int = field(
        default=250,
        metadata=_bound("[-1, inf)")
        | doc(
            "steps between evaluations; 0 = only at the end; -1 = never (not even at the end: the run "
            "reads no val split, for data preprocessed with `--val-fraction 0`; its final line gives "
            "`auc=nan`)"
        ),
    )
    progressive_window: int | str = field(
        default=0,
        metadata=_int_or("data")
        | NONNEG
        | doc(
            "> 0: progressive validation in windows of this many steps: after each window the next "
            "window's training batches are scored before they are trained on (a `progressive` event "
            "with its AUC and logloss); for data read in time order (`data.shuffle: false`); `data`: the "
            "dataset's own windows (binary data preprocessed with `--no-shuffle`: each input file, such as "
            "a Criteo day, or `--window-seconds` of a time column); 0 = off "
            "([time order](dynamic-tables.md#time-order-and-progressive-validation))"
        ),
    )
    evals_per_epoch: int = field(
        default=0,
        metadata=NONNEG
        | doc(
            "> 0 (binary data, Criteo text): evaluate this many times an epoch; it sets "
            "`train.eval_every` (which gives way)"
        ),
    )
    eval_batches: int = field(
        default=0,
        metadata=NONNEG
        | doc(
            "global batches per evaluation; 0 = the whole val split (binary data, Criteo text; synthetic "
            "data: 16 batches); every evaluation says how many samples it scored"
        ),
    )
    checkpoint_every: int = field(default=250, metadata=NONNEG | doc("steps between checkpoints; 0 = only at the end"))
    keep_checkpoints: int = field(
        default=3, metadata=POS | doc("checkpoints kept in `RUN_DIR/checkpoints/` (older ones are deleted)")
    )
    keep_best: str = field(
        default="",
        metadata=_choices("", "auc", "logloss")
        | doc(
            "keep the best evaluation's checkpoint beyond `keep_checkpoints` (`--step best`); '' = off "
            "([keeping the best](run-dirs.md#keeping-the-best-checkpoint-stopping-early))"
        ),
    )
    target_auc: float = field(
        default=0.0, metadata=_bound("[0, 1]", " (0 = off)") | doc("stop once an evaluation reaches this AUC; 0 = off")
    )
    early_stop_evals: int = field(
        default=0,
        metadata=NONNEG | doc("stop after N evaluations without a better `keep_best` metric (AUC if off); 0 = off"),
    )
    max_loss_ratio: float = field(
        default=10.0,
        metadata=NONNEG
        | doc(
            "stop (before any checkpoint of that state) when the loss exceeds this multiple of the first "
            "step's loss or is not finite; 0 = off"
        ),
    )
    trace_steps: int = field(
        default=0,
        metadata=NONNEG
        | doc(
            "> 0: trace this many train steps of the run with `jax.profiler` (from the step after the "
            "first log window: compiling is not in it) into `RUN_DIR/trace/process_N/` (TensorBoard's "
            "profile tab or ui.perfetto.dev), and log a `trace` event of where a step's time went: the "
            "devices' kernels and idle share, host-to-device copies, the dispatching thread's launching "
            "and waiting, the input threads ([a trace of the training loop](observe.md#a-trace-of-the-training-loop)); "
            "traced steps run a little slower; 0 = off"
        ),
    )
    progress_bar: bool = field(default=True, metadata=doc("a progress bar on the terminal"))
    tensorboard: bool = field(
        default=False,
        metadata=doc("also write the metrics as TensorBoard scalars under `RUN_DIR/tensorboard/` (process 0)"),
    )
    hang_timeout_s: float = field(
        default=900.0,
        metadata=NONNEG
        | doc(
            "several processes: one that makes no progress (train step, evaluation, checkpoint) for this "
            "long exits naming where every process is, and the others follow; compiles are not timed; 0 = "
            "off"
        ),
    )

    @property
    def evaluates(self) -> bool:
        """Whether the run evaluates on the val split at all (``eval_every`` -1: never, unless
        ``evals_per_epoch`` sets it)."""
        return self.eval_every >= 0 or self.evals_per_epoch > 0


@dataclass(frozen=True)
class DataConfig:
    # The registry itself is the choices: a registered source is valid.
    source: str = field(
        default="synthetic",
        metadata={"choices": DATA_SOURCES}
        | doc("`synthetic` (generated on the devices), `criteo` (raw TSV), `binary` (made by `dlrm-jax preprocess`)"),
    )
    path: str = field(
        default="",
        metadata=PATHS
        | doc(
            "`criteo`: TSV file(s), comma separated; `binary`: the `preprocess` output folder (`~` is the home folder)"
        ),
    )
    num_dense: int = field(
        default=13,
        metadata=POS
        | doc(
            "dense features per sample (binary data: taken from `meta.json`; a value other than the "
            "default must agree with it)"
        ),
    )
    cardinalities: tuple[int, ...] = field(
        default=CRITEO_KAGGLE_CARDINALITIES,
        metadata=_bound("[1, 2147483647]", " (a table's rows are numbered in 32 bits)", each=True)
        | doc("rows of each feature's table (default: Criteo Kaggle's 26; binary data: taken from `meta.json`)"),
    )
    max_rows: int | str = field(
        default="auto",
        metadata=_int_or("auto")
        | NONNEG
        | doc(
            "cap on rows per table, larger ones hashed into it (a run says so in one line); 0 = none; "
            "`auto`: 20,000 for synthetic data and Criteo text (sized by `data.cardinalities`), none for "
            "binary data (the dataset's own sizes)"
        ),
    )
    bag_sizes: tuple[int, ...] = field(
        default=(1,),
        metadata=_bound(">0", each=True)
        | doc(
            "most ids per sample of each feature (one value for all, or one per feature); 1 = one-hot "
            "(binary data: taken from `meta.json`; a value other than the default must agree with it)"
        ),
    )
    pooling: str = field(default="sum", metadata=_choices(*Pooling) | doc("how a bag's vectors are pooled"))
    zipf_exponent: float = field(
        default=1.1, metadata=NONNEG | doc("synthetic: id popularity skew (larger = more skewed)")
    )
    id_layout: str = field(
        default="permuted",
        metadata=_choices("permuted", "frequency_ordered")
        | doc(
            "synthetic: `permuted` scatters popular ids over each table, `frequency_ordered` numbers them "
            "by popularity (id 0 the most frequent, as `preprocess` vocabularies do)"
        ),
    )
    positive_rate: float = field(
        default=0.26, metadata=_bound("(0, 1)") | doc("synthetic: click-through rate of the labels")
    )
    shuffle: bool = field(
        default=True,
        metadata=doc(
            "binary data and arrays given in Python: visit the rows in a new order every epoch (binary: "
            "each process's blocks of rows); false: in the order written, as time-ordered training wants"
        ),
    )
    shuffle_block: int = field(
        default=4096,
        metadata=POS
        | doc(
            "binary: rows read contiguously, the unit each epoch reorders (at most 1/64 of a process's "
            "rows; 1 = a full per-row reshuffle)"
        ),
    )
    # auto keeps two cores for the dispatching thread and XLA's own
    readers: int | str = field(
        default="auto",
        metadata=_int_or("auto")
        | POS
        | doc(
            "threads that read and check batches and copy them to the devices ahead of the step (also the "
            "hot-row counting threads); `auto`: this process's share of the host's cores (its CPU "
            "affinity, divided among the processes `launch` started on the host) less two, between 2 and "
            "16 ([data](data.md#the-data-path))"
        ),
    )
    prefetch: int = field(
        default=4,
        metadata=POS
        | doc(
            "steps of input prepared ahead, at least `data.readers` (each reader takes a whole step; this "
            "many batches in host and device memory)"
        ),
    )
    reader_processes: bool = field(
        default=False,
        metadata=doc(
            "binary: each reader thread's batches read and checked by a worker process of its own, into "
            "shared memory, so that reading holds none of the training process's GIL (the dispatching "
            "thread waits for it at every step); the same batches, bit for bit "
            "([data](data.md#the-data-path))"
        ),
    )
    host_memory: str = field(
        default="auto",
        metadata=_choices(*HostMemory)
        | doc(
            "the batches' host buffers, reused from step to step: `pinned` (page-locked and registered with "
            "the devices' runtime, so each transfer reads them directly instead of the runtime first copying "
            "the batch into a staging buffer), `pageable`, or `auto`: pinned where the devices are GPUs "
            "([data](data.md#the-data-path))"
        ),
    )
    skip_bad_lines: bool = field(
        default=False, metadata=doc("criteo: skip and count malformed lines instead of stopping at the first")
    )
    val_fraction: float = field(
        default=0.1, metadata=_bound("(0, 1)") | doc("criteo: the last fraction of lines held out for evaluation")
    )


@dataclass(frozen=True)
class WideConfig:
    """Wide&Deep's wide part (`model.kind: wide_deep`; [models](models.md#widedeep))."""

    optimizer: str = field(
        default="ftrl",
        metadata=_choices(*(k.name for k in SPARSE_OPTIMIZER_KINDS.values() if k.wide))
        | doc("the wide part's own optimizer (`ftrl`: FTRL-Proximal)"),
    )
    learning_rate: float = field(default=0.05, metadata=doc("the wide part's constant learning rate"))
    l1: float = field(default=0.0, metadata=doc("`ftrl`: L1 strength (exact zeros)"))
    l2: float = field(default=0.0, metadata=doc("`ftrl`: L2 strength"))


@dataclass(frozen=True)
class ModelConfig:
    # The registry itself is the choices (read when a value is checked): a registered model is valid.
    kind: str = field(
        default="dlrm",
        metadata={"choices": MODEL_KINDS}
        | doc(
            "`dlrm`, or `wide_deep`: Wide&Deep (`model.bottom_mlp: []`, interaction `cat` or `dcn`, plus "
            "a wide linear part; [models](models.md#widedeep))"
        ),
    )
    embedding_dim: int = field(default=16, metadata=POS | doc("width of every embedding vector"))
    bottom_mlp: tuple[int, ...] = field(
        default=(128, 64, 16),
        metadata=_bound(">0", each=True)
        | doc("output widths of the bottom MLP over the dense features; the last must be `embedding_dim` for `dot`"),
    )
    top_mlp: tuple[int, ...] = field(
        default=(256, 128, 1),
        metadata=_bound(">0", each=True) | doc("output widths of the top MLP; the last must be 1"),
    )
    interaction: str = field(
        default="dot",
        metadata=_choices(*Interaction)
        | doc(
            "`dot` (DLRM's pairwise dot products), `cat` (concatenation), `dcn` (DLRM-DCNv2: the "
            "concatenation through a cross network)"
        ),
    )
    dot_pairs: str = field(
        default="auto",
        metadata=_choices(*DotPairs)
        | doc(
            "`dot`: how the pairs' dot products are made; `xla`: each sample's N x N products (a batched "
            "GEMM), then a gather of the pairs; `fused`: Pallas kernels that write the pairs, and their "
            "gradient, with no N x N products in memory (interpreted off GPUs, for tests; not with "
            "`model.mlp_parallel=pipeline`); `auto`: `xla` (the kernels are not yet measured on a GPU) "
            "([models](models.md#the-dot-interactions-pairs))"
        ),
    )
    cross_layers: str = field(
        default="auto",
        metadata=_choices(*CrossLayers)
        | doc(
            "`dcn` with `dcn_rank` > 0: how each cross layer's second product and its elementwise work run; "
            "`xla`: XLA's GEMM writes the product, a fusion reads it back beside x0 and x; `fused`: one "
            "Pallas kernel does both, each tile's product never written (interpreted off GPUs, for tests; "
            "not with `model.mlp_parallel=tensor` or `pipeline`, whose layers stay XLA's); `auto`: `xla` (the "
            "kernel is not yet measured on a GPU) ([models](models.md#the-cross-layers-products-and-their-elementwise-work))"
        ),
    )
    dcn_layers: int = field(default=3, metadata=POS | doc("`dcn`: cross layers"))
    dcn_rank: int = field(
        default=0, metadata=NONNEG | doc("`dcn`: rank r of each cross layer's weight U V; 0 = full width x width")
    )
    wide: WideConfig = WideConfig()
    mlp_parallel: str = field(
        default="data",
        metadata=_choices(*MlpParallel)
        | doc(
            "how the dense layers use a model group's `mesh.model` devices: `data` (each holds all), "
            "`tensor` (Megatron pairs), `pipeline` (GPipe stages) ([models](models.md#mlp-parallelism))"
        ),
    )
    microbatches: int = field(
        default=4, metadata=POS | doc("`pipeline`: microbatches a model group's rows are split into")
    )


@dataclass(frozen=True)
class HotConfig:
    """Hot-row replication: the most looked-up rows live on every device (embedding/hot/)."""

    rows: int | str = field(
        default=0,
        metadata=_int_or("auto")
        | NONNEG
        | doc(
            "rows replicated on every device: 0 = none, `auto` = the cost model decides, or a number (at "
            "most the tables' rows; counted in the memory budget) ([hot rows](hot-rows.md))"
        ),
    )
    memory_mb: float = field(
        default=64.0, metadata=POS | doc("per device, for the hot rows and their optimizer state (`auto`'s limit)")
    )
    stats_batches: int = field(
        default=8, metadata=POS | doc("batches counted to choose the hot rows, and before every refresh")
    )
    refresh_every: int = field(default=0, metadata=NONNEG | doc("steps between re-choosing the hot rows; 0 = never"))
    decay: float = field(default=0.5, metadata=_bound("[0, 1]") | doc("share of the older counts kept at each refresh"))
    # All-to-all over all-reduce bandwidth (`dlrm-jax bench collectives`); 0 = per backend.


@dataclass(frozen=True)
class TierConfig:
    """Tiered storage: tables in a tensorstore array on local disk, DRAM and device caches in
    front (embedding/tiers/)."""

    path: str = field(default="", metadata=PATHS | doc("the disk tier's folder; `''` = `RUN_DIR/tier`"))
    device_cache_rows: int = field(
        default=0,
        metadata=NONNEG
        | doc("device cache per owner of each tiered table, in rows; 0 = `device_cache_fraction` of the rows it owns"),
    )
    device_cache_fraction: float = field(
        default=0.1, metadata=_bound("(0, 1]") | doc("device cache as a share of an owner's rows")
    )
    host_cache_rows: int = field(
        default=0, metadata=NONNEG | doc("DRAM cache per tiered table, in rows; 0 = `host_cache_fraction` of its rows")
    )
    host_cache_fraction: float = field(
        default=0.0,
        metadata=_bound("[0, 1]", " (0 = from the memory available)")
        | doc(
            "DRAM cache as a share of a table's rows; 0 = from the machine: the DRAM caches together take "
            "at most half the memory available when the run plans (all rows if that fits)"
        ),
    )
    policy: str = field(
        default="lru",
        metadata=_choices(*DramPolicy) | doc("the DRAM cache's eviction policy (dirty rows are written back)"),
    )
    lookahead: int = field(
        default=2, metadata=NONNEG | doc("batches the planner thread plans ahead; their rows are never evicted early")
    )
    fill_rows: int = field(
        default=0,
        metadata=NONNEG
        | doc(
            "rows one step may fill per device and group; 0 = measured on the first batches (more fills "
            "run in extra rounds)"
        ),
    )
    # 64 MiB keeps a 30 GiB tier at ~1,000 files (each reading thread keeps its own open)
    chunk_mb: float = field(
        default=64.0,
        metadata=POS | doc("size of the disk tier's chunk files (a snapshot's copy-on-write copies one at a time)"),
    )


@dataclass(frozen=True)
class DynamicConfig:
    """Dynamic tables (``embedding.ids=dynamic``): raw 64-bit ids mapped to rows on their owners
    as training runs (embedding/dynamic/; [dynamic tables](dynamic-tables.md))."""

    rows: float = field(
        default=0.0,
        metadata=NONNEG
        | doc(
            "rows of each dynamic table: a number (>= 1) or a fraction (< 1) of its feature's values "
            "(`data.cardinalities`); 0 = one row per value. Rounded up to whole `vshards`"
        ),
    )
    policy: str = field(
        default="lru",
        metadata=_choices(*EvictionPolicy)
        | doc("which id a new one evicts when its probes are full: seen least recently (`lru`) or least often (`lfu`)"),
    )
    half_life: int = field(
        default=0, metadata=NONNEG | doc("`lfu`: steps after which an id's count halves unless it is seen; 0 = never")
    )
    admit: int = field(
        default=0,
        metadata=NONNEG
        | doc(
            "sightings before a new id gets a row of its own (0 or 1: at once); until then it shares its "
            "shard's row for new ids"
        ),
    )
    probes: int = field(default=8, metadata=POS | doc("slots an id may live in, after its home slot"))
    vshards: int = field(
        default=0,
        metadata=NONNEG
        | doc(
            "virtual shards per table, a power of two (each has its own shared row; a device holds whole "
            "ones, so a checkpoint restores onto any device count dividing them); 0 = up to 256, at "
            "least 4 x (probes + 1) rows each, and at least 8 whatever the table's size (so every table "
            "splits over 1, 2, 4 or 8 devices; more devices need a multiple of their count)"
        ),
    )
    sketch_width: int = field(
        default=1024, metadata=POS | doc("`admit` > 1: counters per row of each shard's count-min sketch (4 rows)")
    )
    new_rows: str = field(
        default="shared",
        metadata=_choices(*NewRows)
        | doc(
            "what a row given to a new id starts from: the id's own initial vector (`initializer`), or that plus "
            "its shard's shared row, which the id trained until it had a row (`shared`)"
        ),
    )
    control_flow: str = field(
        default="auto",
        metadata=_choices(*ControlFlow)
        | doc(
            "how the step takes work whose size the batch decides: `branches` (a switch among sizes of the "
            "batch's distinct ids, loops that end when done: the least work, but XLA's GPU runtime reads each "
            "loop predicate, and the index of each switch holding a loop, on the host unless "
            "`--xla_gpu_enable_command_buffer` holds `WHILE`), `one_path` (every id, no loop: the distinct ids "
            "found by sorting, the placement's rounds after the first as switches, which XLA decides on the "
            "GPU), `prefixes` (one path with the switch among sizes: the work of the branches, no loop), or "
            "`auto`: branches on CPUs, prefixes on GPUs (read from the programs, not yet timed against one "
            "path on a GPU). The same results every way"
        ),
    )


@dataclass(frozen=True)
class EmbeddingConfig:
    sharding: str = field(
        default="auto",
        metadata=_choices(*Sharding)
        | doc(
            "every table's strategy, or `auto`: per table the cheapest under the memory budget "
            "([sharding](sharding.md))"
        ),
    )
    optimizer: str = field(
        default="rowwise_adagrad",
        metadata=_choices(*(k.name for k in SPARSE_OPTIMIZER_KINDS.values() if k.tables))
        | doc("the tables' sparse optimizer, applied on the owners to the looked-up rows only"),
    )
    learning_rate: float = field(
        default=0.05, metadata=NONNEG | doc("the tables' learning rate; 0 = `train.learning_rate`")
    )
    adagrad_eps: float = field(default=1e-8, metadata=NONNEG | doc("Adagrad's epsilon"))
    adagrad_initial_accumulator: float = field(
        default=0.0, metadata=NONNEG | doc("Adagrad's starting accumulator value")
    )
    table_sharding: tuple[str, ...] = field(
        default=(), metadata=doc("per-table strategy overrides, e.g. `[cat_2=row, cat_9=replicated]`")
    )
    row_layout: str = field(
        default="block",
        metadata=_choices(*RowLayoutChoice)
        | doc(
            "row-wise tables: contiguous `block`s of rows per device, `cyclic` (id mod N) to spread hot "
            "ids, or `auto`: per table, whichever gives the smaller busiest bucket on the first batches "
            "(ids in frequency order, as preprocessing writes them, go cyclic; blocks on a tie or without "
            "data)"
        ),
    )
    capacity_from: str = field(
        default="measured",
        metadata=_choices("measured", "batch")
        | doc(
            "all-to-all bucket size: `measured` on the first batches, or from the `batch` size (capacity_factor "
            "x the busiest owner's share of uniform ids: skewed ids overflow into exact extra rounds)"
        ),
    )
    bag_exchange: str = field(
        default="auto",
        metadata=_choices(*BagExchange)
        | doc(
            "how table- and column-wise tables exchange: `pooled` (every bag goes to its owner, which "
            "pools it: one vector per sample each way), `ids` (distinct rows travel, the requester "
            "pools); `auto`: the planner's choice under `sharding=auto`, else pooled bags and one-hot "
            "ids. Row-wise tables always send ids"
        ),
    )
    ids_exchange: str = field(
        default="auto",
        metadata=_choices(*IdsExchange)
        | doc(
            "how the ids exchange crosses hosts (`cluster.devices_per_host` devices each, more than one "
            "host): `two_level` (each device's distinct requests go to the device of its host with the "
            "owner's local index, which merges the host's requests and sends each owner host one bucket; "
            "[sharding](sharding.md)), `flat` (every device to every owner); `auto`: whichever the cost "
            "model predicts faster with the measured buckets. `two_level` where the mesh cannot have two "
            "levels (the devices fit one host or do not split into hosts, or per-host tables) is refused; "
            "where no part of the plan can go in two levels (none sends ids; a plan with tiered tables; "
            "column slices with row-wise Adagrad), the plan says so and why"
        ),
    )
    capacity_factor: float = field(
        default=1.25, metadata=POS | doc("headroom of the buckets over the busiest owner's measured requests")
    )
    dtype: str = field(
        default="float32",
        metadata=_choices("float32", "bfloat16") | doc("table storage; `bfloat16` halves table memory"),
    )
    exchange_dtype: str = field(
        default="float32",
        metadata=_choices("float32", "bfloat16", "float8")
        | doc(
            "vectors and gradients in the all-to-all; `bfloat16` halves the bytes, `float8` (e4m3 with a "
            "float32 scale per vector) sends W + 4 bytes a vector ([precision](sharding.md#the-exchange))"
        ),
    )
    deterministic: bool = field(
        default=False,
        metadata=doc(
            "exact, order-independent sums of duplicate rows' gradients for the `xla` sparse update: the "
            "same bits on every GPU run (0.6-0.7x the speed on one H100; [benchmarks](benchmarks-log.md"
            "#determinism-on-gpu)); the fused update, the default on GPUs, gives the same bits at no cost"
        ),
    )
    sparse_update: str = field(
        default="auto",
        metadata=_choices("auto", "xla", "fused")
        | doc(
            "the sparse update: `xla` sorts the lookups by row once, sums each row's in their order and "
            "writes each row and its state once; `fused` does the sums and the optimizer in Pallas "
            "kernels, one pass, the same bits every run (interpreted off GPUs, for tests); `auto`: `fused` "
            "on GPUs (3.27x `xla` on DLRM-DCNv2, 1.18x on criteo_kaggle, one H200), `xla` elsewhere "
            "([sharding](sharding.md#the-sparse-update))"
        ),
    )
    fused_programs: int = field(
        default=65536,
        metadata=NONNEG
        | doc(
            "the fused update's row kernel: at most this many programs, each taking rows until the "
            "batch's distinct rows run out (the same bits at any count); 0: one program per 4 lookups, most "
            "of them idle where rows repeat (the form measured on 2026-12-04: on one H200 the kernel's time "
            "followed its programs, 90% of them idle; the capped default is not yet timed on a GPU)"
        ),
    )
    ids: str = field(
        default="vocab",
        metadata=_choices(*Ids)
        | doc(
            "how a value becomes a row: the data's ids as they are (`vocab`: a vocabulary or a hash fixed "
            "before training) or `dynamic`: raw 64-bit ids mapped to rows without collisions, evicting "
            "ids that stopped appearing ([dynamic tables](dynamic-tables.md))"
        ),
    )
    table_ids: tuple[str, ...] = field(
        default=(), metadata=doc("per-table overrides of `ids`, e.g. `[cat_2=dynamic, cat_9=vocab]`")
    )
    dynamic: DynamicConfig = DynamicConfig()
    memory_budget_gb: float = field(
        default=0.0,
        metadata=NONNEG
        | doc(
            "per device, for tables, optimizer state and buffers; 0 = 90% of an accelerator's memory as it "
            "reports it, else of `cluster.device_memory_gb` (none on CPU by default)"
        ),
    )
    hot: HotConfig = HotConfig()
    storage: str = field(
        default="device",
        metadata=_choices(*Storage)
        | doc(
            "where sharded tables live: on their `device`s, or `tiered` (disk tier behind DRAM and device "
            "caches; [tiered tables](tiered-tables.md))"
        ),
    )
    table_storage: tuple[str, ...] = field(
        default=(), metadata=doc("per-table storage overrides, e.g. `[cat_2=tiered, cat_9=device]`")
    )
    tier: TierConfig = TierConfig()
    sync: str = field(
        default="global",
        metadata=_choices(*Sync)
        | doc(
            "`global`: one set of tables over every device; `per_host`: each host trains its own tables "
            "on its own rows; `host_replicas`: equal replicas per host, the all-to-all inside each host "
            "([multi-host](multi-host.md#per-host-embeddings))"
        ),
    )
    sync_every: int = field(
        default=0,
        metadata=NONNEG
        | doc("`per_host`: average the tables and their optimizer state over hosts every N steps; 0 = never"),
    )

    def ids_of(self, table: str) -> str:
        """How the table named ``table`` takes ids: its ``table_ids`` override, else ``ids``."""
        return dict(item.partition("=")[::2] for item in self.table_ids).get(table, self.ids)

    def storage_of(self, table: str) -> str:
        """Where the table named ``table`` is asked to live: its ``table_storage`` override, else ``storage``."""
        return dict(item.partition("=")[::2] for item in self.table_storage).get(table, self.storage)

    @property
    def tables_per_host(self) -> bool:
        """Each host holds its own copy of the tables (per_host or host_replicas)."""
        return self.sync != "global"


@dataclass(frozen=True)
class MeshConfig:
    devices: int = field(
        default=0,
        metadata=NONNEG
        | doc("devices in the mesh, over all hosts; 0 = all (8 simulated CPU devices without accelerators)"),
    )
    hosts: int = field(
        default=0,
        metadata=NONNEG
        | doc(
            "hosts of the (`hosts`, `data`, `model`) mesh for per-host tables; 0 = one per process, more "
            "splits each process's devices into simulated hosts"
        ),
    )
    model: int = field(
        default=1,
        metadata=POS | doc("neighbouring devices per model group that share the dense layers (`model.mlp_parallel`)"),
    )


@dataclass(frozen=True)
class ClusterConfig:
    """The machines embedding.sharding=auto prices a plan for (embedding/plan/cost.py has the
    model and the sources of the profiles' numbers); 0 = the profile's value."""

    profile: str = field(
        default="auto",
        metadata=_choices("auto", "h100", "cpu")
        | doc(
            "the machines `embedding.sharding=auto` prices plans for ([the cost "
            "model](sharding.md#the-cost-model)): `h100` (8 GPUs a host, NVLink within, one 400 Gb/s "
            "InfiniBand NIC per GPU between hosts), `cpu` (simulated CPU devices of one host); `auto`: "
            "`cpu` when training on simulated CPU devices, else `h100`"
        ),
    )
    devices_per_host: int = field(
        default=0,
        metadata=NONNEG | doc("devices that share the fast links of one host (0: the profile's: 8 for `h100`)"),
    )
    intra_host_gbps: float = field(
        default=0.0,
        metadata=NONNEG | doc("GB/s each way per device between devices of one host (0: the profile's: 450, NVLink 4)"),
    )
    inter_host_gbps: float = field(
        default=0.0,
        metadata=NONNEG | doc("GB/s each way per device between hosts (0: the profile's: 50, a 400 Gb/s NIC per GPU)"),
    )
    hbm_gbps: float = field(
        default=0.0,
        metadata=NONNEG
        | doc("device memory bandwidth in GB/s, for lookups and updates (0: the profile's: 3350, HBM3)"),
    )
    tflops: float = field(
        default=0.0,
        metadata=NONNEG
        | doc("dense matmul peak in TFLOP/s at bfloat16, half of it at float32 (0: the profile's: 990)"),
    )
    device_memory_gb: float = field(
        default=0.0,
        metadata=NONNEG
        | doc(
            "the planner's memory budget is 90% of it when `embedding.memory_budget_gb` is 0 and the devices "
            "do not report their memory (`plan`, CPU devices) (0: the profile's: 80 for `h100`, none for `cpu`)"
        ),
    )


@dataclass(frozen=True)
class Config:
    """A whole, validated configuration, frozen: build one with ``dlrm_jax.load_config`` (a
    shipped config's name or a YAML file, and ``KEY=VALUE`` overrides) and derive another with
    ``dlrm_jax.with_overrides``; its sections are train, data, model, embedding, mesh and
    cluster, each key documented in docs/configs.md. One changed with ``dataclasses.replace``
    is checked again when it trains."""

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
    def dynamic_tables(self) -> tuple[int, ...]:
        """The features whose tables take raw ids (``embedding.ids``, ``embedding.table_ids``)."""
        return tuple(f for f in range(self.num_features) if self.embedding.ids_of(f"cat_{f}") == Ids.DYNAMIC)

    @property
    def tiered_tables(self) -> tuple[int, ...]:
        """The features whose tables live in the disk tier (``embedding.storage``, ``embedding.table_storage``)."""
        return tuple(f for f in range(self.num_features) if self.embedding.storage_of(f"cat_{f}") == Storage.TIERED)

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
