"""``dlrm-jax config``: the resolved config, as train writes it."""

from __future__ import annotations

from dlrm_jax.cli.args import add_config_args
from dlrm_jax.config import load_config

NAME = "config"
HELP = (
    "print the resolved config (the default or --config, with every --set applied) as YAML, "
    "as train writes it to RUN_DIR/config.yaml"
)


def add_arguments(p) -> None:
    add_config_args(p)


def run(args) -> int:
    """The resolved config as YAML (binary data's features from its meta.json, as training
    takes them), after a comment naming where it came from and the keys that differ from the
    default; every key is checked as train checks it. Touches no device."""
    from dlrm_jax.config import dump_config
    from dlrm_jax.data.sources import resolve_data_config
    from dlrm_jax.train.rundir import config_differences

    cfg = resolve_data_config(load_config(args.config, args.overrides))
    changed = [key for key, _, _ in config_differences(load_config(None), cfg)]
    source = args.config or "the embedded default"
    print(f"# dlrm-jax config of {source}{''.join(f' --set {o}' for o in args.overrides)}")
    print(f"# differs from the default in: {', '.join(changed) if changed else 'nothing'}")
    print(dump_config(cfg), end="")
    return 0
