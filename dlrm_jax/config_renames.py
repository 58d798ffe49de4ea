"""Config keys that moved, and the one function that reads a config written with their former
names (a file, a ``--set``, a run dir's saved config) as the current ones."""

from __future__ import annotations

from typing import Any

from dlrm_jax.config_schema import ConfigError

# Keys that moved: a config (or a run dir's saved one) written with the former name still loads.
RENAMED_KEYS = {
    "model.wide_optimizer": "model.wide.optimizer",
    "model.wide_learning_rate": "model.wide.learning_rate",
    "model.wide_l1": "model.wide.l1",
    "model.wide_l2": "model.wide.l2",
}


def with_current_keys(raw: dict[str, Any], where: str = "") -> dict[str, Any]:
    """A copy of ``raw`` (nested dicts) with every key of RENAMED_KEYS under its current name;
    both names given at once is an error naming them (``where``: the file, if any)."""
    copy = lambda d: {k: copy(v) if isinstance(v, dict) else v for k, v in d.items()}
    out = copy(raw)
    for old, new in RENAMED_KEYS.items():
        *path, name = old.split(".")
        node = out
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or name not in node:
            continue
        value = node.pop(name)
        *new_path, new_name = new.split(".")
        node = out
        for k, part in enumerate(new_path):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{where}{old} is now {new}, but {'.'.join(new_path[: k + 1])} is not a mapping")
        if new_name in node:
            raise ConfigError(f"{where}{old} and {new} both given: {old} is the former name of {new}")
        node[new_name] = value
    return out
