"""What a train step leaves behind (its state, batch and metrics) is freed on the release
thread: a jax.Array's destructor gives up the GIL, and the dispatching thread should not."""

import threading
import weakref

import jax

from dlrm_jax.train import loop as loop_module
from dlrm_jax.train.release import ReleaseThread
from dlrm_jax.train.trainer import train_and_evaluate
from tests.helpers import QUIET, tiny_config


def test_held_objects_are_freed_on_the_release_thread():
    freed = []

    class Tracked:
        def __del__(self):
            freed.append(threading.current_thread().name)

    with ReleaseThread() as release:
        release.hold(Tracked(), [Tracked()])
        release.release()
        release.hold(Tracked())  # handed over by close
    assert freed == ["release"] * 3


def test_every_steps_state_batch_and_metrics_are_freed_off_the_dispatching_thread(monkeypatch):
    freed = []
    dispatch = loop_module.TrainingLoop.dispatch

    def tracking(self, state, step, item):
        for leaf in jax.tree.leaves((state, item)):
            if isinstance(leaf, jax.Array):
                weakref.finalize(leaf, lambda: freed.append(threading.current_thread().name))
        return dispatch(self, state, step, item)

    monkeypatch.setattr(loop_module.TrainingLoop, "dispatch", tracking)
    train_and_evaluate(tiny_config("train.steps=12", "train.log_every=4", "train.eval_every=0"), None, **QUIET)
    assert len(freed) > 12 * 10 and set(freed) == {"release"}
