"""What a config needs of the devices, processes and data it would run on, checked before a run
dir is made or anything compiles. ``dlrm-jax plan``, ``dlrm-jax train`` (before it names its run
dir) and :func:`~dlrm_jax.train.trainer.train_and_evaluate` call the same
:func:`check_runnable`, so a plan is printed only for a config that trains. What only the plan
or the data's batches can tell (a memory budget, a bucket) is refused later, and a run dir that
refusal leaves empty is removed (:class:`~dlrm_jax.train.rundir.RunDir`)."""

from __future__ import annotations

from dlrm_jax.config import Config, ConfigError
from dlrm_jax.model.mlp_parallel import check_microbatches, check_tensor_widths
from dlrm_jax.parallel.mesh import check_mesh_shape
from dlrm_jax.train.planning import why_not_two_levels
from dlrm_jax.train.wiring import cluster_from_config

EPOCHS_NEED_A_SPLIT = (
    "train.epochs, train.evals_per_epoch: synthetic data has no train split to count epochs of; "
    "use train.steps and train.eval_every"
)


def check_runnable(
    cfg: Config, num_devices: int, processes: int = 1, *, simulated: bool, source_given: bool = False
) -> None:
    """A ConfigError naming the keys when ``cfg`` cannot train on a mesh of ``num_devices``
    devices over ``processes`` processes (``simulated``: priced as simulated CPU devices, as
    the plan is). ``source_given``: the data comes from the caller, not ``data.*``."""
    hosts = (cfg.mesh.hosts or processes) if cfg.embedding.tables_per_host else 0
    check_mesh_shape(num_devices, processes, cfg.mesh.model, hosts)
    check_batch(cfg, num_devices)
    check_tiers_in_one_process(cfg, processes)
    if cfg.embedding.ids_exchange == "two_level":
        _check_two_levels(cfg, num_devices, simulated)
    if not source_given:
        _check_data(cfg)


def check_tiers_in_one_process(cfg: Config, processes: int) -> None:
    """Tables in the disk tier train in one process (its host tiers are one process's)."""
    if cfg.tiered_tables and processes > 1:
        raise ConfigError(
            f"embedding.storage / embedding.table_storage: tables in the disk tier (cat_{cfg.tiered_tables[0]}"
            f"{' ...' if len(cfg.tiered_tables) > 1 else ''}) train in one process for now, not {processes} "
            "(several local devices are fine)"
        )


def check_batch(cfg: Config, num_devices: int) -> None:
    """Every device gets an equal share of the batch (and a pipeline's model group, whole
    microbatches)."""
    if cfg.train.batch_size % num_devices:
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} must be divisible by the {num_devices} devices of the "
            f"mesh (mesh.devices)"
        )
    m = cfg.model
    if m.mlp_parallel == "pipeline" and num_devices % cfg.mesh.model == 0:
        check_microbatches(cfg.train.batch_size, num_devices, cfg.mesh.model, m.microbatches)
    if m.mlp_parallel == "tensor" and cfg.mesh.model > 1:
        rank = m.dcn_rank if m.interaction == "dcn" else 0
        check_tensor_widths({"bottom": list(m.bottom_mlp), "top": list(m.top_mlp)}, rank, cfg.mesh.model)


def _check_two_levels(cfg: Config, num_devices: int, simulated: bool) -> None:
    """Asked for, two levels that this mesh cannot have are refused: they were the flat
    exchange, without a word (``auto`` is the form that goes flat where two levels cannot)."""
    cluster = cluster_from_config(cfg, simulated)
    why = why_not_two_levels(cfg, num_devices, cluster.devices_per_host)
    if not why:
        return
    sizes = [d for d in range(2, num_devices // 2 + 1) if num_devices % d == 0]
    if cfg.embedding.tables_per_host:
        fix = "set embedding.sync=global, or "
    elif sizes:
        why += "" if cfg.cluster.devices_per_host else f", the {cluster.name} profile's"
        fix = f"set cluster.devices_per_host to {' or '.join(map(str, sizes))}, or "
    else:  # (2, 3 or a prime number of devices cannot be split into such hosts)
        fix = f"{num_devices} devices cannot make them: set "
    raise ConfigError(
        f"embedding.ids_exchange=two_level: {why}; two levels need 2 or more hosts of 2 or more devices; "
        f"{fix}embedding.ids_exchange=auto (two levels where they can go) or flat"
    )


def _check_data(cfg: Config) -> None:
    """Epochs need a train split to count; binary data's splits (meta.json) must hold a batch
    to train and rows to evaluate."""
    t = cfg.train
    if (t.epochs or t.evals_per_epoch) and cfg.data.source == "synthetic":
        raise ConfigError(EPOCHS_NEED_A_SPLIT)
    if cfg.data.source == "binary":
        from dlrm_jax.data.sources import check_splits
        from dlrm_jax.data.sources.binary import read_meta

        meta = read_meta(cfg.data.path)
        check_splits(cfg, int(meta["train_rows"]), int(meta["val_rows"]), trains=True, evaluates=cfg.train.evaluates)
