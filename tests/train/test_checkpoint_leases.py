"""A training run's rotation never removes a checkpoint that eval or export is reading.

Before: the run removed all but its newest train.keep_checkpoints after each save, and an
eval started while it trained failed 4 times in 4 ('checkpoints/54/plan/metadata not found'),
or, with keep_checkpoints=1, read as damage ('none of the 1 checkpoints restores')."""

import fcntl
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dlrm_jax.train.checkpoint import Checkpoints
from dlrm_jax.train.checkpoint_leases import LEASES
from dlrm_jax.train.checkpoint_reader import CheckpointReader, reading

ON_MESH = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("d",)), PartitionSpec())
ABSTRACT = {"w": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=ON_MESH)}


def _save(ckpts: Checkpoints, step: int) -> None:
    ckpts.save(step, {"w": jax.device_put(jnp.full((4,), float(step)), ON_MESH)}, "{}")
    ckpts.wait()


def _read(reader: CheckpointReader, step: int) -> float:
    return float(reader.restore(ABSTRACT, step)["w"][0])


def _restore(reader: CheckpointReader, log=print):
    return reader.restore_newest_intact(lambda s: _read(reader, s), log)


def test_a_held_step_outlives_the_rotation_until_its_reader_is_done(tmp_path):
    d = tmp_path / "checkpoints"
    ckpts = Checkpoints(d, keep=1)
    _save(ckpts, 1)
    with reading(d):  # eval starts: step 1 is the newest
        _save(ckpts, 2)
        _save(ckpts, 3)  # the rotation would remove 1 and 2: 1 is held
        assert ckpts.all_steps() == [1, 3]
        assert CheckpointReader(d).all_steps() == [1, 3]
    _save(ckpts, 4)  # released: the next rotation removes it, and its lease file
    assert ckpts.all_steps() == [4] and os.listdir(d / LEASES) == []
    ckpts.close()


def test_a_step_being_removed_is_skipped_not_taken_for_damage(tmp_path):
    d = tmp_path / "checkpoints"
    ckpts = Checkpoints(d, keep=3)
    for step in (1, 2):
        _save(ckpts, step)
    ckpts.close()
    (d / LEASES).mkdir(exist_ok=True)
    fd = os.open(d / LEASES / "2", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as the rotation holds a step while it removes it
    try:
        reader, said = CheckpointReader(d), []
        step, w = _restore(reader, said.append)
        assert (step, w, said) == (1, 1.0, [])  # the older one, no warning of damage
    finally:
        os.close(fd)
    reader = CheckpointReader(d)
    assert _restore(reader) == (2, 2.0)
    reader.release()
    np.testing.assert_array_equal(sorted(os.listdir(d)), [LEASES, "1", "2"])  # a reader removes nothing
