"""The JAX settings the library's programs are written, tested and checkpointed for, held around
each entry point whatever the process has set (a notebook's other cells, ``JAX_ENABLE_X64=1``).

With ``jax_enable_x64`` on, the dense parameters and their optimizer state became float64 (a
float32 array times a NumPy scalar) and checkpoints of either kind read as damaged in the other;
a notebook-wide ``jax_threefry_partitionable=False`` or another ``jax_default_prng_impl`` drew
other initial weights from the same seed (AUC 0.741 or 0.478 where 0.578 is the run's); rank or
dtype promotion set to ``raise``/``strict`` failed deep in the step. A mesh set with
``jax.set_mesh`` and ``jax_disable_jit`` cannot be set aside here: they are refused in one line.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

__all__ = ["library_settings", "with_library_settings"]


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
