"""The ``embedding`` section and its own: hot rows, the disk tier, dynamic ids."""

from __future__ import annotations

from dataclasses import dataclass, field

from dlrm_jax.choices import (
    SPARSE_OPTIMIZER_KINDS,
    BagExchange,
    ControlFlow,
    DramPolicy,
    EvictionPolicy,
    Ids,
    IdsExchange,
    NewRows,
    RowLayoutChoice,
    Sharding,
    Storage,
    Sync,
)
from dlrm_jax.config_schema.fields import F32, NONNEG, PATHS, POS, _bound, _choices, _int_or, doc


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
            "([sharding](sharding.md)); dynamic tables (`embedding.ids`) are row-wise whatever it says"
        ),
    )
    optimizer: str = field(
        default="rowwise_adagrad",
        metadata=_choices(*(k.name for k in SPARSE_OPTIMIZER_KINDS.values() if k.tables))
        | doc("the tables' sparse optimizer, applied on the owners to the looked-up rows only"),
    )
    learning_rate: float = field(
        default=0.05, metadata=NONNEG | F32 | doc("the tables' learning rate; 0 = `train.learning_rate`")
    )
    adagrad_eps: float = field(default=1e-8, metadata=NONNEG | F32 | doc("Adagrad's epsilon"))
    adagrad_initial_accumulator: float = field(
        default=0.0, metadata=NONNEG | F32 | doc("Adagrad's starting accumulator value")
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
        """Where the table named ``table`` is asked to live: its ``table_storage`` override, else
        ``storage``, except for a replicated table (``table_sharding`` or ``sharding``), which
        stays on its devices (a replicated table asked to be tiered by name is refused)."""
        given = dict(item.partition("=")[::2] for item in self.table_storage)
        if table not in given and self.sharding_of(table) == "replicated":
            return "device"
        return given.get(table, self.storage)

    def sharding_of(self, table: str) -> str:
        """How the table named ``table`` is asked to be sharded: its ``table_sharding`` override,
        else ``sharding`` (``auto``: the planner chooses); a dynamic table is row-wise whatever
        ``sharding`` says (its id map is split with its rows)."""
        if self.ids_of(table) == "dynamic":  # (its table_sharding may only say row)
            return "row"
        return dict(item.partition("=")[::2] for item in self.table_sharding).get(table, self.sharding)

    @property
    def tables_per_host(self) -> bool:
        """Each host holds its own copy of the tables (per_host or host_replicas)."""
        return self.sync != "global"
