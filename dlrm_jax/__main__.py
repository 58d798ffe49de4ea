import sys

from dlrm_jax.cli import run

sys.exit(run())
