import sys

from dlrm_jax.cli import main

sys.exit(main())
