"""The ``data`` section: what a run reads (synthetic, Criteo text, a preprocessed dataset) and how."""

from __future__ import annotations

from dataclasses import dataclass, field

from dlrm_jax.choices import (
    DATA_SOURCES,
    HostMemory,
    Pooling,
)
from dlrm_jax.config_schema.fields import NONNEG, PATHS, POS, _bound, _choices, _int_or, doc

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
