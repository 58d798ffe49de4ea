"""Typed configuration: dataclass defaults, YAML override files, dotted ``--set`` overrides.

The defaults (:mod:`dlrm_jax.config_schema`) *are* the embedded default configuration;
``configs/default.yaml`` spells them out for reading and a test keeps the two identical.
Other YAML files only list the keys they change. Every value is checked
(:mod:`dlrm_jax.config_checks`) before JAX is imported or anything compiles, and a bad one
raises :class:`ConfigError` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from dlrm_jax.config_checks import check_features, check_rows_or_fraction, validate  # noqa: F401 - re-exported
from dlrm_jax.config_renames import RENAMED_KEYS, with_current_keys  # noqa: F401 - RENAMED_KEYS re-exported
from dlrm_jax.config_schema import (  # noqa: F401 - re-exported: the config's one public home
    CONFIG_DIR,
    CRITEO_KAGGLE_CARDINALITIES,
    ClusterConfig,
    Config,
    ConfigError,
    DataConfig,
    DynamicConfig,
    EmbeddingConfig,
    HotConfig,
    MeshConfig,
    ModelConfig,
    TierConfig,
    TrainConfig,
)
from dlrm_jax.wording import said, setting

# ---------------------------------------------------------------- coercion of raw values


def _coerce(key: str, value: Any, annotation: Any, choices: tuple[str, ...] | None, words: tuple[str, ...] = ()) -> Any:
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):  # a sweep's np.int64(5), np.arange(3)
        value = value.tolist()
    if words:  # int | str: an integer or one of the words
        if isinstance(value, str) and value in words:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer or {' or '.join(words)}, got {value!r}")
        return value
    origin = typing.get_origin(annotation)
    if origin is tuple:
        (item_type, _) = typing.get_args(annotation)
        if isinstance(value, str) and "," in value:  # --set model.bottom_mlp=64,32,8: YAML's list is [64,32,8]
            parts = value.split(",")
            parts = parts[:-1] if not parts[-1].strip() else parts  # "64,": a list of one
            if not all(v.strip() for v in parts):  # (32,,8 became [32, 8] without a word)
                raise ConfigError(f"{key}: an empty entry in {value!r}; expected comma-separated {item_type.__name__}s")
            value = [load_yaml(v) for v in parts]
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list of {item_type.__name__}, got {value!r}")
        return tuple(_coerce(f"{key}[{i}]", v, item_type, None) for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        raise TypeError(f"unsupported annotation for {key}")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, str):  # YAML 1.1 reads '1e-3' (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if annotation is str:
        value = "" if value is None else value
        if not isinstance(value, str):
            allowed = f"one of {', '.join(c or repr(c) for c in choices)}" if choices else "a string"
            raise ConfigError(f"{key}: expected {allowed}, got {value!r}")
        if choices and value not in choices:
            raise ConfigError(
                f"{key}: {value!r} is not one of {', '.join(c or repr(c) for c in choices)}{_elsewhere(key, value)}"
            )
        return value
    raise TypeError(f"unsupported annotation {annotation!r} for {key}")


def _build(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(_unknown_key(fields, unknown[0], prefix))
    kwargs = {}
    for name, f in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        if dataclasses.is_dataclass(hints[name]):
            sub = raw.get(name, {})
            if not isinstance(sub, dict):
                raise ConfigError(f"{key}: expected a mapping of keys, got {sub!r}")
            kwargs[name] = _build(hints[name], sub, key)
        elif name in raw:
            kwargs[name] = _coerce(key, raw[name], hints[name], f.metadata.get("choices"), f.metadata.get("words", ()))
            if f.metadata.get("paths"):  # (a config file's '~/data' was looked for as a folder named '~')
                kwargs[name] = ",".join(os.path.expanduser(p.strip()) for p in kwargs[name].split(","))
    return cls(**kwargs)


def _unknown_key(fields, name: str, prefix: str) -> str:
    """'unknown config key K' with the nearest known key, and the keys allowed there."""
    where = f"{prefix}." if prefix else ""
    near = difflib.get_close_matches(name, list(fields), n=1, cutoff=0.6)
    hint = f" (did you mean {where}{near[0]}?)" if near else ""
    return f"unknown config key {where}{name}{hint}; allowed keys: {', '.join(f'{where}{k}' for k in fields)}"


def _elsewhere(key: str, value: str) -> str:
    """A hint when ``value``, refused for ``key``, is (nearly) a value of another key: the
    DCNv2 cross network is model.interaction=dcn, not a model.kind."""
    others = {}
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(typing.get_type_hints(Config)[section.name]):
            name = f"{section.name}.{f.name}"
            if name != key:
                others.update({c: name for c in f.metadata.get("choices", ()) if c})
    near = difflib.get_close_matches(value, list(others), n=1, cutoff=0.7)
    return f"; {near[0]} is a value of {others[near[0]]}: {setting(others[near[0]], near[0])}" if near else ""


def _merge(base: dict[str, Any], over: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``over``'s keys into ``base``; a mapping is never merged into (and so never silently
    replaces) a value that is not one."""
    out = dict(base)
    for k, v in over.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k in out and not isinstance(out[k], dict):
            inner = f"{key}.{next(iter(v), '')}"
            raise ConfigError(
                f"{key}: is {out[k]!r}, not a mapping of keys, so {setting(inner, '...')} cannot go into it"
            )
        out[k] = _merge(out[k], v, f"{key}.") if isinstance(v, dict) and k in out else v
    return out


class YAMLKeyError(yaml.YAMLError):
    """A key given twice in one YAML mapping: ``line`` (1-based) of the second, ``first`` of the first."""

    def __init__(self, key: Any, line: int, first: int):
        super().__init__(f"key {key!r} is given twice (lines {first} and {line}); YAML would keep only the last")
        self.key, self.line, self.first = key, line, first


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue  # '<<' merges keys on purpose; complex keys: the base loader decides
                key, line = self.construct_object(key_node), key_node.start_mark.line + 1
                if key in seen:
                    raise YAMLKeyError(key, line, seen[key])
                seen[key] = line
        return super().construct_mapping(node, deep)


# Integers as YAML 1.2 reads them: PyYAML's YAML 1.1 took a leading zero for octal, so
# `--set train.steps=010` trained 8 steps and cardinalities [1000, 0300] made a table of 192 rows.
_INT = re.compile(r"^[-+]?(?:[0-9][0-9_]*|0x[0-9a-fA-F_]+|0o[0-7_]+)$")
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != "tag:yaml.org,2002:int"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_UniqueKeyLoader.add_implicit_resolver("tag:yaml.org,2002:int", _INT, list("-+0123456789"))


def _yaml_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node).replace("_", "")
    sign, digits = (-1 if text[0] == "-" else 1), text.lstrip("+-")
    base = {"0x": 16, "0o": 8}.get(digits[:2].lower(), 10)
    return sign * int(digits[2:] if base != 10 else digits, base)


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _yaml_int)


def load_yaml(text: str) -> Any:
    """YAML ``text`` as Python values, like ``yaml.safe_load``, but a key given twice in one
    mapping is a :class:`YAMLKeyError` instead of the last one silently winning."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def yaml_problem(e: yaml.YAMLError) -> tuple[int | None, str]:
    """(1-based line or None, one-line description) of a YAML error, whose own text spans lines."""
    if isinstance(e, YAMLKeyError):
        return e.line, str(e)
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        text = "; ".join(t for t in (e.context, e.problem) if t)
        return (mark.line + 1 if mark else None), text or type(e).__name__
    return None, " ".join(str(e).split())


def parse_override(text: str) -> dict[str, Any]:
    """``'a.b=3'`` -> ``{'a': {'b': 3}}``; the value is read as YAML (``[1,2]``, ``true``)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"{said('--set', 'override')} {text!r}: expected KEY=VALUE, for example train.steps=100")
    try:
        if " #" in value or value.lstrip().startswith("#"):  # a literal '#' (a path), not a YAML comment
            parsed = value.strip()
        else:
            parsed = load_yaml(value) if value.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(
            f"{said('--set', 'override')} {text!r}: value is not valid YAML ({yaml_problem(e)[1]})"
        ) from None
    out: dict[str, Any] = {}
    node = out
    parts = key.strip().split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = parsed
    return out


def resolve_config_path(path: str | Path) -> Path:
    """A path as given, or a bare name such as ``criteo_kaggle`` from the shipped ``configs/``."""
    p = Path(path)
    if p.exists():
        return p
    for candidate in (CONFIG_DIR / p, CONFIG_DIR / f"{p}.yaml"):
        if candidate.exists():
            return candidate
    shipped = sorted(f.stem for f in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError(
        f"config file {path} does not exist; shipped configs: {', '.join(shipped)} (or a YAML file's path)"
    )


def config_layers(path: str | Path) -> list[str | Path]:
    """The config files ``path`` names, in order: itself, or where no file has that name and it
    joins names with ``+`` (``criteo_kaggle+stream``), each of them."""
    if isinstance(path, Path) or "+" not in path or Path(path).exists():
        return [path]
    if "" in path.split("+"):
        raise ConfigError(f"config {path}: a name on each side of '+' (e.g. criteo_kaggle+stream)")
    return path.split("+")


def load_raw(path: str | Path) -> dict[str, Any]:
    """The YAML file at ``path`` as nested dicts, its sections checked to be mappings; any
    problem is a one-line ConfigError naming the file (and the line, where YAML knows it)."""
    p = resolve_config_path(path)
    try:
        raw = load_yaml(p.read_bytes().decode("utf-8")) or {}
    except OSError as e:
        raise ConfigError(f"config file {p}: cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {p}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
            f"a config is a YAML text file"
        ) from None
    except yaml.YAMLError as e:
        line, problem = yaml_problem(e)
        raise ConfigError(f"config file {p}{f':{line}' if line else ''}: cannot be read as YAML: {problem}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {p}: expected a mapping at the top level")
    raw = with_current_keys(raw, f"config file {p}: ")
    _check_sections(Config, raw, "", p)
    return raw


def _check_sections(cls: type, raw: dict[str, Any], prefix: str, path: Path) -> None:
    """Every section of ``raw`` (a dataclass field of ``cls``) must be a mapping of keys: a list
    or a scalar there would be silently replaced by a ``--set`` into the section."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields), key=str)
    if unknown:
        raise ConfigError(f"config file {path}: {_unknown_key(fields, str(unknown[0]), prefix.rstrip('.'))}")
    for f in dataclasses.fields(cls):
        if f.name in raw and dataclasses.is_dataclass(hints[f.name]):
            key, sub = f"{prefix}{f.name}", raw[f.name]
            if not isinstance(sub, dict):
                what = "nothing" if sub is None else repr(sub)
                raise ConfigError(
                    f"config file {path}: {key} must be a mapping of keys (e.g. {key}: {{KEY: VALUE}}), got {what}"
                )
            _check_sections(hints[f.name], sub, f"{key}.", path)


def load_config(path: str | Path | None = None, overrides: list[str] | dict[str, Any] | str = ()) -> Config:
    """Defaults, then the YAML file at ``path`` (if any: a file, or a shipped config's name such
    as ``"smoke"``; ``"a+b"``: b's keys over a's, where no file has that name), then the
    overrides: ``KEY=VALUE`` strings as ``--set`` takes them (a list, or one string), or a dict
    of dotted keys to values (``{"train.steps": 100}``)::

        cfg = dlrm_jax.load_config("criteo_kaggle", {"train.steps": 500, "mesh.devices": 8})
        dynamic = dlrm_jax.load_config("criteo_kaggle+stream")  # the same model, stream's id maps
    """
    if path is not None and not isinstance(path, str | Path):  # (a Config: "argument of type 'Config' is not iterable")
        raise TypeError(
            f"load_config takes a config's name or file path, got {type(path).__name__}"
            + (": to change a Config, dlrm_jax.with_overrides(cfg, overrides)" if isinstance(path, Config) else "")
        )
    raw: dict[str, Any] = {}
    files = [(resolve_config_path(layer), load_raw(layer)) for layer in (config_layers(path) if path else ())]
    sets = _override_dicts(overrides)
    for layer in [d for _, d in files] + sets:
        raw = _merge(raw, layer)
    try:
        built = _build(Config, raw, "")
    except ConfigError as e:
        raise _located(e, files, sets) from None
    return validate(built)


def _located(error: ConfigError, files: list[tuple[Path, dict]], sets: list[dict]) -> ConfigError:
    """``error`` (a bad value: "KEY: ...") named by the file and line that gave the value, where
    a config file did (not an override, nor a default)."""
    key = str(error).split(":", 1)[0].split("[", 1)[0].split(" ", 1)[0].split(".")

    def gives(raw: dict) -> bool:
        for k in key:
            if not isinstance(raw, dict) or k not in raw:
                return False
            raw = raw[k]
        return True

    if any(map(gives, sets)):
        return error
    for file, raw in reversed(files):
        if gives(raw):
            line = _line_of(file, key)
            return ConfigError(f"config file {file}{f':{line}' if line else ''}: {error}")
    return error


def _line_of(file: Path, key: list[str]) -> int | None:
    """The 1-based line of ``key``'s value in the YAML ``file`` (None where it cannot tell)."""
    try:
        node = yaml.compose(file.read_text())
    except (OSError, yaml.YAMLError):
        return None
    for k in key:
        found = [v for n, v in getattr(node, "value", []) if isinstance(node, yaml.MappingNode) and n.value == k]
        if not found:
            return None
        node = found[0]
    return node.start_mark.line + 1


def load_run_config(run_dir: str | Path, overrides: list[str] | dict[str, Any] | str = ()) -> Config:
    """A training run's config (``run_dir/config.yaml``) with ``overrides``; a folder without
    one is named as no run directory (not as a config file missing among the shipped ones)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: is {run_dir} a run directory?")
    return load_config(path, overrides)


def with_overrides(cfg: Config, overrides: list[str] | dict[str, Any] | str) -> Config:
    """A copy of ``cfg`` with ``overrides`` (as :func:`load_config` takes them) applied and
    checked again: the way to derive a changed config (``Config`` is frozen)::

        longer = dlrm_jax.with_overrides(cfg, {"train.steps": 5000})
    """
    if not isinstance(cfg, Config):  # ("'str' object has no attribute 'to_dict'")
        raise TypeError(f"with_overrides takes a Config (dlrm_jax.load_config makes one), got {type(cfg).__name__}")
    raw = cfg.to_dict()
    for override in _override_dicts(overrides):
        raw = _merge(raw, override)
    return validate(_build(Config, raw, ""))


def with_absolute_paths(cfg: Config) -> Config:
    """``cfg`` with its relative paths (``data.path``, each of its comma-separated Criteo files, and
    ``embedding.tier.path``) made absolute against the current directory: what a run dir's
    ``config.yaml`` records, so that ``eval`` and ``export`` find them from any directory."""

    def absolute(text: str, listed: bool) -> str:  # (only Criteo's text files are a list: a comma is a folder's own)
        parts = [p.strip() for p in text.split(",")] if listed else [text]
        return ",".join(str(Path(p).absolute()) if p else p for p in parts) if text else text

    data = dataclasses.replace(cfg.data, path=absolute(cfg.data.path, cfg.data.source == "criteo"))
    tier = dataclasses.replace(cfg.embedding.tier, path=absolute(cfg.embedding.tier.path, False))
    if (data, tier) == (cfg.data, cfg.embedding.tier):
        return cfg
    return dataclasses.replace(cfg, data=data, embedding=dataclasses.replace(cfg.embedding, tier=tier))


def _override_dicts(overrides) -> list[dict[str, Any]]:
    if overrides is None:
        return []
    if isinstance(overrides, str):  # one KEY=VALUE, not a sequence of characters
        overrides = [overrides]
    if not isinstance(overrides, dict) and not all(isinstance(o, str) for o in overrides):
        bad = next(o for o in overrides if not isinstance(o, str))
        raise TypeError(
            f"overrides: a dict of keys to values, or KEY=VALUE strings; got a {type(bad).__name__} among "
            f"the strings: {bad!r}"
        )
    if isinstance(overrides, dict):
        out = []
        for key, value in overrides.items():
            node: dict[str, Any] = {}
            top = node
            parts = str(key).split(".")
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = list(value) if isinstance(value, tuple) else value
            out.append(with_current_keys(top))
        return out
    return [with_current_keys(parse_override(text)) for text in overrides]


def validated(cfg: Config) -> Config:
    """``cfg`` checked as :func:`load_config` checks what it builds: a Config made in code
    (``Config(train={"steps": 10})``, ``dataclasses.replace(cfg.train, steps="10")``) gets each
    value coerced, or an error naming its key, where a deep AttributeError or TypeError named none."""
    if not isinstance(cfg, Config):
        return validate(cfg)  # (its TypeError says what to do)
    return validate(_build(Config, cfg.to_dict(), ""))


def config_from_dict(raw: dict[str, Any]) -> Config:
    """The config of nested dicts ``raw`` (a run dir's saved one, say; former key names read)."""
    return validate(_build(Config, with_current_keys(raw), ""))


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
