"""Leases that keep a checkpoint out of a training run's rotation while another process reads it.

``eval`` and ``export`` read a run's checkpoints while the run may still be training, and the
run removes all but its newest ``train.keep_checkpoints`` after each save: at a save every few
seconds, a restore that takes longer would read a folder being deleted. So a reader takes a
shared ``flock`` on ``checkpoints/.readers/STEP`` before it reads step STEP and holds it until
it is done, and the rotation takes an exclusive one on each step while it removes it, keeping
(for a later rotation) every step whose lock a reader holds. The kernel drops a dead process's
locks, so a reader killed midway holds nothing. A lease file is removed only by the writer, once
its step is gone; a folder where none can be made (read-only) has no writer rotating it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from pathlib import Path

LEASES = ".readers"
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def _open_lease(directory: Path, step: int) -> int:
    (directory / LEASES).mkdir(exist_ok=True)
    return os.open(directory / LEASES / str(step), os.O_RDWR | os.O_CREAT, 0o644)


def _lock(fd: int, kind: int) -> bool:
    """Whether ``fd`` got the lock at once; closed when not."""
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        os.close(fd)
        return False


class ReaderLeases:
    """A reader's shared leases on the steps of ``directory`` it reads."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._fds: dict[int, int] = {}

    def hold(self, step: int) -> bool:
        """Whether step ``step`` is on disk and now held; False: gone, or being removed."""
        if step in self._fds:
            return True
        try:
            fd = _open_lease(self.directory, step)
        except OSError as e:
            if e.errno not in NOT_WRITABLE:
                raise
            return (self.directory / str(step)).is_dir()  # a folder nothing can rotate
        if not _lock(fd, fcntl.LOCK_SH):
            return False  # the rotation holds it: being removed
        if not (self.directory / str(step)).is_dir():  # removed before the lock was taken
            os.close(fd)
            return False
        self._fds[step] = fd
        return True

    def release(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def remove_unheld(directory: Path, steps: list[int]) -> list[int]:
    """Removes each of ``steps`` that no reader holds (an exclusive lock on its lease while its
    folder goes); returns those removed. A held step stays, for a later rotation."""
    removed = []
    for step in steps:
        fd = _open_lease(directory, step)
        if not _lock(fd, fcntl.LOCK_EX):
            continue
        try:
            shutil.rmtree(directory / str(step), ignore_errors=True)
            (directory / LEASES / str(step)).unlink(missing_ok=True)  # while still locked
            removed.append(step)
        finally:
            os.close(fd)
    return removed
