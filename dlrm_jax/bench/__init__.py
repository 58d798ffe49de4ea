"""Benchmarks behind ``dlrm-jax bench``: each compares variants side by side in one run, prints
a table and writes JSON (``common`` holds what they share).

train        train-step samples/s of several configs
embedding    the embedding step of every sharding strategy against XLA baselines
exchange     the compiled train step's exchange bytes against the plan and the lower bound
collectives  all-to-all against all-reduce bandwidth on the current mesh
hot          hot-row replication against none, on skewed and frequency-ordered ids
mlp_parallel the dense layers data- vs tensor- vs pipeline-parallel over model groups

Here: what the suites refuse of a config, in one line (no JAX imported: the command line
checks before JAX starts).
"""

from dlrm_jax.config import ConfigError


def check_device_step(suite: str, cfg, name: str | None = None) -> None:
    """Refuses a config (named ``name``, if it has one) with tiered tables in a suite that
    runs the device step alone (``suite``): their step takes the fills the tier's host work
    plans each batch, so the device step alone neither runs nor says anything of their speed."""
    tiered = [f"cat_{f}" for f in cfg.tiered_tables]
    if tiered:
        which = f"config {name}" if name else "the config"
        tables = ", ".join(tiered[:3]) + (" ..." if len(tiered) > 3 else "")
        raise ConfigError(
            f"{which} keeps tables in the disk tier ({tables}: embedding.storage / embedding.table_storage), "
            f"and bench {suite} runs the device step alone; "
            "time them with `dlrm-jax bench tiers` or `dlrm-jax train`"
        )


def check_stream_config(cfg) -> None:
    """Refuses, in one line, a key the stream's cases cannot follow: each is a DLRM whose
    tables are row-wise on the devices, data-parallel, at a constant learning rate (the same
    model for every way of ids to rows; the model's and both optimizers' keys are followed)."""
    e, t = cfg.embedding, cfg.train
    refused = {
        "model.kind": (cfg.model.kind, "dlrm"),
        "model.mlp_parallel": (cfg.model.mlp_parallel, "data"),
        "mesh.model": (cfg.mesh.model, 1),
        "embedding.storage": (e.storage, "device"),
        "embedding.table_storage": (list(e.table_storage), []),
        "embedding.sharding": (e.sharding if e.sharding != "auto" else "row", "row"),
        "embedding.table_sharding": (list(e.table_sharding), []),
        "embedding.row_layout": (e.row_layout, "block"),
        "embedding.hot.rows": (e.hot.rows, 0),
        "embedding.sync": (e.sync, "global"),
        "train.warmup_steps": (t.warmup_steps, 0),
        "train.decay_steps": (t.decay_steps, 0),
    }
    for key, (value, only) in refused.items():
        if value != only:
            raise ConfigError(
                f"{key}={value}: bench stream trains each case as a DLRM with row-wise tables on the devices, "
                f"data-parallel, at a constant learning rate ({key}={only}); compare such settings with "
                "`dlrm-jax train` on a time-ordered dataset (train.progressive_window)"
            )
