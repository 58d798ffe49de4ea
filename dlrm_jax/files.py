"""Small helpers for the files the project writes: folders that say which one a file stands in
the way of, and JSON that is JSON (no ``NaN`` or ``Infinity``).

Imports nothing of the project, so every layer may use it.
"""

from __future__ import annotations

import json
import math
import stat
import time
from pathlib import Path
from typing import Any


def check_dir(path: str | Path, what: str) -> Path:
    """``path`` if it is a folder or can be made one: a file at it, or at one of its parents, is
    a NotADirectoryError that names ``what`` ("run dir", "tier path") and the file."""
    path = Path(path)
    for p in (path, *path.parents):
        # One stat per path: another process may create the folder meanwhile (processes of
        # one run make the same run dir), and separate is_dir / exists calls would then see
        # neither a folder nor a file.
        try:
            mode = p.stat().st_mode  # follows links: a link to a folder is a folder
        except (FileNotFoundError, NotADirectoryError):  # not there yet (or under a file)
            if not p.is_symlink():
                continue
            kind = "a broken link"
        else:
            if stat.S_ISDIR(mode):
                return path
            kind = "a file" if stat.S_ISREG(mode) else "a special file"
        if p == path:
            raise NotADirectoryError(f"{what} {path} is {kind}, not a directory")
        raise NotADirectoryError(f"{what} {path} cannot be created: {p} is {kind}, not a directory")
    return path


def make_dir(path: str | Path, what: str) -> Path:
    """:func:`check_dir`, then the folder and its parents are made."""
    path = check_dir(path, what)
    path.mkdir(parents=True, exist_ok=True)
    return path


def new_run_dir() -> str:
    """The run dir a training run without ``--run-dir`` gets: ``runs/<local time>``."""
    return str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))


def json_text(obj: Any, indent: int | None = None) -> str:
    """``obj`` as JSON text, with every non-finite float (NaN, inf: not JSON) as null."""
    return json.dumps(_finite(obj), indent=indent, allow_nan=False)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
