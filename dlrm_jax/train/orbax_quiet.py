"""orbax's checkpointing, imported without configuring the process's root logger: its import
logs through absl, which would (:func:`~dlrm_jax.jax_settings.root_logging_untouched`). The
modules that use orbax import it from here."""

from dlrm_jax.jax_settings import root_logging_untouched

with root_logging_untouched():
    import orbax.checkpoint as ocp

__all__ = ["ocp"]
