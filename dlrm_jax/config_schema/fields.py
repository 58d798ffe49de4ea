"""What every section's fields are made of: the error a bad key raises, and the metadata a
field declares beside its default (allowed words, bounds, paths, its meaning)."""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"  # package data; the checkout's configs/ links here


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
# A number the step computes with in float32: finite there and, unless 0, not rounded to 0 (a
# learning rate of 1e39 trained as inf, one of 1e-50 as 0, which the bound refuses when written 0).
F32 = {"float32": True}


PATHS = {"paths": True}  # a path or comma-separated paths: a leading ``~`` is the home folder


def doc(meaning: str) -> dict:
    """A key's meaning (markdown): docs/configs.md's tables and configs/default.yaml are
    generated from it (``python -m dlrm_jax.config_doc``)."""
    return {"doc": meaning}
