"""The JAX settings the library's programs are written, tested and checkpointed for, held around
each entry point whatever the process has set (a notebook's other cells, ``JAX_ENABLE_X64=1``).

With ``jax_enable_x64`` on, the dense parameters and their optimizer state became float64 (a
float32 array times a NumPy scalar) and checkpoints of either kind read as damaged in the other;
a notebook-wide ``jax_threefry_partitionable=False`` or another ``jax_default_prng_impl`` drew
other initial weights from the same seed (AUC 0.741 or 0.478 where 0.578 is the run's); rank or
dtype promotion set to ``raise``/``strict`` failed deep in the step. A mesh set with
``jax.set_mesh`` and ``jax_disable_jit`` cannot be set aside here: they are refused in one line.

The process's root logger is left as it was (:func:`root_logging_untouched`): absl, through which
orbax logs, configures it on its first message where it has no handler.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Iterator

__all__ = ["library_settings", "root_logging_untouched", "with_library_settings"]


@contextlib.contextmanager
def root_logging_untouched() -> Iterator[None]:
    """The ``with`` body's messages through the logging module printed as they would be, and the
    root logger left without handlers where it had none. absl (orbax logs through it, from its
    import on) calls ``logging.basicConfig()`` on any message while the root logger has no
    handler: a notebook's own ``basicConfig(level=...)`` after a run then did nothing, and every
    library's warnings gained a ``WARNING:name:`` prefix. Python's last resort, which prints a
    warning where no handler takes it, stands in on the root logger meanwhile (:class:`_LastResort`)."""
    global _stand_in, _users
    root = logging.getLogger()
    # (counted: calls overlapping in threads, a run training while another evaluates, each
    # took the other's stand-in for a handler of the notebook's, and the first to end removed
    # it while the other still worked: absl then configured the root logger after all)
    with _users_lock:
        if _stand_in is None and not root.handlers:
            _stand_in = _LastResort()
            root.addHandler(_stand_in)
        _users += 1
    try:
        yield
    finally:
        with _users_lock:
            _users -= 1
            if not _users and _stand_in is not None:
                root.removeHandler(_stand_in)
                _stand_in = None


_users_lock = threading.Lock()
_users = 0  # the calls inside root_logging_untouched now
_stand_in: logging.Handler | None = None


class _LastResort(logging.Handler):
    """Python's last-resort handling as a handler on the root logger: a message that no other
    handler on its way takes goes to ``logging.lastResort`` (stderr, warnings and up); one
    that another took is not printed again (``lastResort`` itself there printed every
    message of a logger with a file of its own a second time, on stderr)."""

    def handle(self, record) -> bool:
        logger = logging.getLogger(record.name) if record.name != "root" else logging.getLogger()
        while logger is not None:
            if any(h is not self for h in logger.handlers):
                return False
            if not logger.propagate:
                break
            logger = logger.parent
        last = logging.lastResort
        if last is not None and record.levelno >= last.level:
            last.handle(record)
        return True

    def emit(self, record) -> None:  # (handle does the work)
        pass


@contextlib.contextmanager
def library_settings() -> Iterator[None]:
    """32-bit arrays, NumPy's rank and dtype promotion, the partitionable threefry PRNG, for the
    ``with`` body; a RuntimeError where a context mesh or ``jax_disable_jit`` is set."""
    import jax

    if jax.config.jax_disable_jit:
        raise RuntimeError(
            "jax_disable_jit is on: dlrm_jax's steps are compiled ahead of time, which that setting "
            "forbids; turn it off (jax.config.update('jax_disable_jit', False)) for the call"
        )
    if not jax.sharding.get_abstract_mesh().empty:
        raise RuntimeError(
            "a mesh is set in JAX's context (jax.set_mesh): dlrm_jax builds its own from the config's "
            "mesh.* keys; call it outside that context"
        )
    with (
        root_logging_untouched(),
        jax.enable_x64(False),
        jax.numpy_rank_promotion("allow"),
        jax.numpy_dtype_promotion("standard"),
        jax.threefry_partitionable(True),
        jax.default_prng_impl("threefry2x32"),
    ):
        yield


def with_library_settings(fn):
    """``fn`` run inside :func:`library_settings`."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with library_settings():
            return fn(*args, **kwargs)

    return wrapped
