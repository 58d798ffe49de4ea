"""Benchmarks behind ``dlrm-jax bench``: each compares variants side by side in one run, prints
a table and writes JSON (``common`` holds what they share).

train        train-step samples/s of several configs
embedding    the embedding step of every sharding strategy against XLA baselines
exchange     the compiled train step's exchange bytes against the plan and the lower bound
collectives  all-to-all against all-reduce bandwidth on the current mesh
hot          hot-row replication against none, on skewed and frequency-ordered ids
mlp_parallel the dense layers data- vs tensor- vs pipeline-parallel over model groups
"""

from dlrm_jax.config import ConfigError


def check_device_step(suite: str, cfg, name: str | None = None) -> None:
    """Refuses a config (named ``name``, if it has one) with tiered tables in a suite that runs the device step alone
    (``suite``): their step takes the fills the tier's host work plans each batch, so the
    device step alone neither runs nor says anything of their speed."""
    tiered = [f"cat_{f}" for f in cfg.tiered_tables]
    if tiered:
        raise ConfigError(
            f"{'config ' + name if name else 'the config'} keeps tables in the disk tier ({', '.join(tiered[:3])}{' ...' if len(tiered) > 3 else ''}: "
            f"embedding.storage / embedding.table_storage), and bench {suite} runs the device step alone; "
            "time them with `dlrm-jax bench tiers` or `dlrm-jax train`"
        )
