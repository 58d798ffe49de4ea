"""The training driver: device-count invariance, bitwise resume, restore onto another mesh."""

import jax
import numpy as np
import pytest

from dlrm_jax.parallel.mesh import make_mesh
from dlrm_jax.train.build import build, mesh_from_config
from dlrm_jax.train.checkpoint import Checkpoints
from dlrm_jax.train.restore import restore_state
from dlrm_jax.train.saved_run import evaluate_run
from dlrm_jax.train.trainer import train_and_evaluate
from tests.helpers import QUIET, losses


def final_state(cfg, run_dir, source=None):
    """``source``: the data, where building needs it (hot rows are chosen from it)."""
    _, steps = build(cfg, make_mesh(cfg.mesh.devices), source)
    return restore_state(steps, Checkpoints(run_dir / "checkpoints", 3), **QUIET)


def logical_state(cfg, run_dir):
    """Dense params, optimizer state and every table's values and slots, whatever the plan."""
    _, steps = build(cfg, make_mesh(cfg.mesh.devices))
    state = restore_state(steps, Checkpoints(run_dir / "checkpoints", 3), **QUIET)
    wide = state.parts.get("wide")
    wide = steps.parts["wide"].collection.logical_tables(wide.tables) + wide[1:] if wide else ()
    return state.params, state.opt_state, steps.collection.logical_tables(state.emb), wide


# Per-element Adagrad's device-count invariance is pinned at the embedding level (test_embedding);
# here the stateful pair (row-wise Adagrad + Adam) and the stateless one, end to end, and
# DLRM-DCNv2's model (a low-rank cross network) with Adagrad MLPs and row-wise Adagrad tables.
# Wide&Deep adds its FTRL-trained wide part (replicated, all-gathered updates) to an Adam deep part.
@pytest.mark.slow
@pytest.mark.parametrize(
    "optimizer,dense_opt,model",
    [
        ("rowwise_adagrad", "adam", ()),
        ("sgd", "sgd", ()),
        ("rowwise_adagrad", "adagrad", ("model.interaction=dcn", "model.dcn_rank=4")),
        ("rowwise_adagrad", "adam", ("model.kind=wide_deep", "model.bottom_mlp=[]", "model.interaction=cat")),
    ],
    ids=["rowwise_adam", "sgd", "dcn", "wide_deep"],
)
def test_loss_trajectory_independent_of_device_count(tiny, tmp_path, optimizer, dense_opt, model):
    runs = {}
    for n in (1, 2, 4, 8):
        cfg = tiny(
            f"mesh.devices={n}",
            "train.steps=12",
            "train.log_every=1",
            f"train.optimizer={dense_opt}",
            f"embedding.optimizer={optimizer}",
            "train.learning_rate=0.01",
            *model,
        )
        train_and_evaluate(cfg, tmp_path / str(n), **QUIET)
        runs[n] = (losses(tmp_path / str(n)), logical_state(cfg, tmp_path / str(n)))
    ref_loss, ref_state = runs[1]
    for n in (2, 4, 8):
        np.testing.assert_allclose(runs[n][0], ref_loss, rtol=1e-4)
        for a, b in zip(jax.tree.leaves(runs[n][1]), jax.tree.leaves(ref_state), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_resume_is_bitwise_identical(tiny, tmp_path):
    cfg = tiny("mesh.devices=8", "train.steps=8", "train.log_every=1", "train.checkpoint_every=4")
    whole = train_and_evaluate(cfg, tmp_path / "whole", **QUIET)
    # Interrupted after the step-4 checkpoint: a first run stops at 4, the same run dir resumes.
    train_and_evaluate(tiny("mesh.devices=8", "train.steps=4", "train.log_every=1"), tmp_path / "cut", **QUIET)
    resumed = train_and_evaluate(cfg, tmp_path / "cut", **QUIET)
    assert losses(tmp_path / "cut") == losses(tmp_path / "whole")  # every step, bit for bit
    assert (resumed.auc, resumed.logloss, resumed.step) == (whole.auc, whole.logloss, whole.step)
    a, b = final_state(cfg, tmp_path / "whole"), final_state(cfg, tmp_path / "cut")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [("row", "row"), ("table", "column"), ("auto", "replicated")])
def test_restore_onto_fewer_devices(tiny, tmp_path, before, after):
    cfg8 = tiny("mesh.devices=8", "train.steps=4", f"embedding.sharding={before}", "embedding.optimizer=adagrad")
    trained = train_and_evaluate(cfg8, tmp_path, **QUIET)
    state8 = logical_state(cfg8, tmp_path)
    cfg4 = tiny("mesh.devices=4", "train.steps=4", f"embedding.sharding={after}", "embedding.optimizer=adagrad")
    state4 = logical_state(cfg4, tmp_path)
    for x, y in zip(jax.tree.leaves(state8), jax.tree.leaves(state4), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert all(len(x.sharding.device_set) == 4 for x in jax.tree.leaves(final_state(cfg4, tmp_path)))
    on4 = evaluate_run(tmp_path, ["mesh.devices=4", f"embedding.sharding={after}"], **QUIET)
    assert on4.step == 4
    np.testing.assert_allclose(on4.auc, trained.auc, rtol=1e-6)
    # Training goes on from the restored state on the smaller mesh.
    more = train_and_evaluate(
        tiny("mesh.devices=4", "train.steps=6", f"embedding.sharding={after}", "embedding.optimizer=adagrad"),
        tmp_path,
        **QUIET,
    )
    assert more.step == 6


def test_learns_above_chance(tiny, tmp_path):
    cfg = tiny("train.steps=60", "train.batch_size=256", "train.eval_batches=8")
    result = train_and_evaluate(cfg, None, **QUIET)
    assert result.auc > 0.6, result


def test_nan_loss_stops_training(tiny, tmp_path):
    cfg = tiny(
        "train.learning_rate=1e30",
        "embedding.learning_rate=1e30",
        "train.optimizer=sgd",
        "embedding.optimizer=sgd",
        "train.steps=20",
        "train.log_every=1",
    )
    with pytest.raises(FloatingPointError, match="step"):
        train_and_evaluate(cfg, tmp_path, **QUIET)


def test_bfloat16_compute_trains(tiny):
    result = train_and_evaluate(tiny("train.compute_dtype=bfloat16", "train.steps=4"), None, **QUIET)
    assert np.isfinite(result.loss)


@pytest.mark.parametrize(
    "sets,want",
    [
        (["train.compute_dtype=bfloat16"], "bfloat16"),
        ([], "float32"),
        (["train.compute_dtype=bfloat16", "model.mlp_parallel=pipeline", "mesh.model=2", "mesh.devices=2"], "float32"),
    ],
    ids=["bfloat16", "float32", "bfloat16-pipeline"],
)
def test_the_sparse_update_gets_the_gradient_in_the_dtype_the_model_read_the_vectors_in(tiny, sets, want, monkeypatch):
    """The train step differentiates the loss w.r.t. the pooled vectors as the model reads them
    (``DLRMDense.pooled_dtype``: its compute dtype), so a bfloat16 model's sparse update reads
    half the bytes (the same bits: tests/embedding/test_embedding.py); the pipeline gathers
    them before its stages cast, so it takes float32."""
    from dlrm_jax.data.sources import make_source, resolve_data_config
    from dlrm_jax.embedding.exchange.collection import EmbeddingCollection

    cfg = resolve_data_config(tiny(*sets))
    seen = []
    apply = EmbeddingCollection.apply_gradients
    monkeypatch.setattr(
        EmbeddingCollection,
        "apply_gradients",
        lambda self, s, r, g, lr: seen.append(g.dtype) or apply(self, s, r, g, lr),
    )
    source = make_source(cfg, 0, 1)
    _, fns = build(cfg, mesh_from_config(cfg), source, **QUIET)
    state, out, _ = fns.train_step(fns.init_state(), fns.device_batch(source.train_batch(0)))
    assert seen == [np.dtype(want)] and np.isfinite(float(out["loss"]))


def test_a_stop_while_the_last_checkpoint_commits_waits_for_it(tiny, tmp_path, monkeypatch):
    """A notebook's Ctrl-C while the run's last checkpoint was committing (the loop's handlers
    gone) interrupted the wait and let the run dir's lock go with the write in flight; the
    re-run the docs advise then wrote over it: no checkpoint, or a damaged one. Now the stop
    waits for the commit and raises Interrupted, and the re-run finds the run done."""
    import os
    import signal

    from dlrm_jax.train.stop_signals import Interrupted

    real, sent = Checkpoints.wait, []

    def wait(self):
        if self._saving == 4 and not sent:  # (the last save's commit, awaited at the run's end)
            sent.append(os.kill(os.getpid(), signal.SIGINT))
        real(self)

    monkeypatch.setattr(Checkpoints, "wait", wait)
    cfg = tiny("mesh.devices=1", "train.steps=4", "train.checkpoint_every=2")
    with pytest.raises(Interrupted) as e:
        train_and_evaluate(cfg, tmp_path / "run", **QUIET)
    assert sent and (e.value.step, e.value.saved) == (4, True)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]
    assert evaluate_run(tmp_path / "run", log=lambda *_: None).step == 4
    assert train_and_evaluate(cfg, tmp_path / "run", **QUIET).step == 4
