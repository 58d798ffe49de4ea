"""Damage to a file as a failing disk does it, shared by test_tier_damage and the training it
runs as a child process (which damages the tier mid-run), and to a checkpoint's contents."""

import numpy as np


def damage(path) -> None:
    """Same size, random bytes, written in place (every hard link of the file sees them)."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.write(np.random.default_rng(0).integers(0, 256, size, np.uint8).tobytes())


def change_saved_element(checkpoint, name):
    """Adds 1 to the first element of array ``name`` in ``checkpoint``, written through
    tensorstore: files orbax reads without an error, contents it never saved (as a flipped bit
    in a compressed chunk can decode)."""
    import orbax.checkpoint as ocp
    import tensorstore as ts

    context = ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": 2**26}})
    info = ocp.type_handlers.ParamInfo(name=name, parent_dir=checkpoint / "state", use_zarr3=False, ts_context=context)
    saved = ts.open(
        ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=True), read=True, write=True, context=context
    ).result()
    saved[0] = saved[0].read().result() + 1
