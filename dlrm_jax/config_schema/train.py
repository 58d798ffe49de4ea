"""The ``train`` section: the schedule, the optimizer's dense settings, evaluation and checkpoints."""

from __future__ import annotations

from dataclasses import dataclass, field

from dlrm_jax.config_schema.fields import F32, NONNEG, POS, _bound, _choices, _int_or, doc


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
        default=0.001,
        metadata=POS | F32 | doc("the dense part's learning rate (the tables take `embedding.learning_rate`)"),
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
