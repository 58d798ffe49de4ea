"""Small helpers for the files the project writes: folders that say which one a file stands in
the way of, and JSON that is JSON (no ``NaN`` or ``Infinity``).

Imports nothing of the project, so every layer may use it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import shutil
import socket
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def as_paths(paths) -> list[str]:
    """``paths`` (files given to a function taking several) as a list: one path, a string or a
    Path, is a list of one (a string was read as its characters, '/' first)."""
    if isinstance(paths, str | os.PathLike):
        return [os.fspath(paths)]
    return [os.fspath(p) for p in paths]


def file_key(path: str | Path) -> tuple | str:
    """What tells a file apart however it is named (its device and inode; a path that does not
    resolve: its absolute form)."""
    try:
        st = os.stat(path)
        return st.st_dev, st.st_ino
    except OSError:
        return str(Path(path).resolve())


def check_each_once(paths: list[str], what: str) -> None:
    """A ValueError where one file is given twice in ``paths`` (``what``: "--input"), however
    it is named: its rows would be read twice."""
    seen: dict = {}
    for p in paths:
        if (k := file_key(p)) in seen:
            raise ValueError(
                f"{what} {p}: given twice ({seen[k]} is the same file): its rows would be read twice; give it once"
            )
        seen[k] = p


SAMPLED = 1 << 16  # bytes of each end of a file that :func:`add_sampled` reads


def add_sampled(h, path: str | Path) -> int:
    """Feed hash ``h`` the file's size and its first and last 64 KiB (a file's identity for a
    few reads, however large it is, wherever it lies); returns its size."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(f"{size}:".encode() + f.read(SAMPLED))
        f.seek(max(size - SAMPLED, 0))
        h.update(f.read(SAMPLED))
    return size


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


def check_new_folder(dest: str | Path, what: str) -> Path:
    """``dest`` if it is new or an empty folder (where :func:`new_folder` may write), else a
    FileExistsError: ``what`` never mixes its files with others. A symbolic link is followed (the
    folder it points at, made or not yet: a link cannot be renamed over as a folder is)."""
    dest = Path(os.path.realpath(dest)) if Path(dest).is_symlink() else Path(dest)
    if dest.exists() and not dest.is_dir():
        raise FileExistsError(f"{dest}: is a file, not a folder; {what} into a new folder")
    if dest.exists() and any(dest.iterdir()):
        raise FileExistsError(f"{dest}: exists and is not empty; {what} into a new folder")
    if os.path.ismount(dest):  # (the folder is made beside it and renamed into place: not over a mount)
        raise FileExistsError(f"{dest}: a mount point; {what} into a new folder inside it, e.g. {dest / 'out'}")
    return dest


@contextlib.contextmanager
def full_disk_as(message: Callable[[], str]) -> Iterator[None]:
    """A full disk in the ``with`` body (an OSError's ENOSPC, which names no file, or a
    library's that says it in its message only) raised as one OSError(ENOSPC) whose text is
    ``message()``, asked for then (it may say what the failure left behind)."""
    try:
        yield
    except Exception as e:
        if errno.ENOSPC not in (getattr(e, "errno", None), os_error_code(e)):
            raise
        error = OSError(message())
        error.errno = errno.ENOSPC
        raise error from None


@contextlib.contextmanager
def written_whole(path: str | Path, mode: str = "w") -> Iterator[Any]:
    """A file at ``path`` that appears whole or not at all: the ``with`` body writes a
    temporary file beside it (``mode``: "w" or "wb"), flushed to disk and renamed over ``path``
    when the body ends, removed when it raises (the old file stays)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def new_folder(dest: str | Path, what: str) -> Iterator[Path]:
    """A folder that appears at ``dest`` whole or not at all: ``dest`` must be new or empty;
    the ``with`` body writes into ``dest.partial`` (returned), renamed to ``dest`` when it
    ends, removed when it raises. A full disk is one error naming ``what`` and ``dest``. A
    symbolic link at ``dest`` (to an empty folder, or to none yet) is written through: the
    folder appears where it points."""
    dest = check_new_folder(dest, what)
    work = dest.with_name(dest.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    make_dir(work, what)
    full = lambda: f"{what} {dest}: no space left on device; nothing was written: free space or choose another folder"
    with full_disk_as(full):
        try:
            yield work
            if dest.exists():
                dest.rmdir()
            work.rename(dest)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)  # nothing half-written is left to be taken for the whole
            raise


class FolderLock:
    """An exclusive ``flock`` on ``FOLDER/.lock`` held by one process at a time (a run on its
    run dir, or on its disk tier); the file names the holder, who removes it when it lets go, so
    a ``.lock`` on disk means a live holder. :meth:`take` refuses (``refusal(holder)``, a
    RunDirError or the like) while another holds it."""

    def __init__(self, folder: str | Path, name: str = ".lock"):
        self.path, self.fd = Path(folder) / name, None

    def take(self, refusal: Callable[[str], Exception]) -> FolderLock:
        """Lock (whoever locked a file the holder removed meanwhile tries again on the new one)."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 512).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise refusal(holder) from None
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # the file we locked was removed by its last holder: lock the new one
        self.fd = fd
        os.ftruncate(fd, 0)
        os.write(
            fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode()
        )
        return self

    def release(self) -> None:
        """Let go (removing the file while still holding it: no stale lock is left behind)."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            os.close(self.fd)  # releases the flock
            self.fd = None


def os_error_code(e: BaseException | str) -> int | None:
    """The OS error a library reported in its message only (tensorstore: ``[os_error_code='28']``;
    ``e``: the exception or its text)."""
    text = str(e)
    if "No space left on device" in text:
        return errno.ENOSPC
    at = text.find("os_error_code='")
    if at < 0:
        return None
    digits = text[at + len("os_error_code='") :].split("'", 1)[0]
    return int(digits) if digits.isdigit() else None


def numbered_folders(directory: str | Path) -> list[int]:
    """The numbers of ``directory``'s folders named by a number, sorted (a checkpoint's step:
    orbax names its folder so only once it is whole); [] without the directory."""
    d = Path(directory)
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def new_run_dir() -> str:
    """The run dir a training run without ``--run-dir`` gets: ``runs/<local time>``, made here
    so that it is this run's alone: runs started in the same second (a sweep's ``&``, a job
    array) take ``-2``, ``-3``, ... after it (they shared one, and all but one were refused as
    'in use' though none was given a run dir)."""
    base, k = Path("runs") / time.strftime("%Y%m%d-%H%M%S"), 1
    while True:
        path = base if k == 1 else base.with_name(f"{base.name}-{k}")
        try:
            make_dir(base.parent, "runs folder")
            path.mkdir()
            return str(path)
        except FileExistsError:
            k += 1
        except FileNotFoundError:  # (runs/ taken away meanwhile, empty, by a refused run beside this one)
            continue


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
