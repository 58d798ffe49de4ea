"""Damage to a file as a failing disk does it, shared by test_tier_damage and the training it
runs as a child process (which damages the tier mid-run)."""

import numpy as np


def damage(path) -> None:
    """Same size, random bytes, written in place (every hard link of the file sees them)."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.write(np.random.default_rng(0).integers(0, 256, size, np.uint8).tobytes())
