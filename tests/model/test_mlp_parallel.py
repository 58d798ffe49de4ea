"""model.mlp_parallel: tensor-parallel and pipelined dense layers train exactly like data
parallelism on 1, 2, 4 and 8 devices, hold only their share of the weights, and checkpoints
restore across the modes."""

import itertools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm_jax.config import ConfigError
from dlrm_jax.data.sources import make_source
from dlrm_jax.model.mlp_parallel import _balanced_cuts
from dlrm_jax.parallel.mesh import MODEL_AXIS, make_mesh
from dlrm_jax.train.build import build, mesh_from_config
from dlrm_jax.train.checkpoint import Checkpoints
from dlrm_jax.train.restore import restore_state
from dlrm_jax.train.trainer import train_and_evaluate
from tests.helpers import QUIET, examples, losses

# Widths that split over 8 devices; a low-rank cross network (its U, V pair up too); a top MLP
# deep enough for 4 pipeline stages.
MODEL = (
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 16, 8, 1]",
    "model.interaction=dcn",
    "model.dcn_rank=8",
    "model.dcn_layers=1",
    "train.optimizer=adam",
    "train.learning_rate=0.01",
    "train.steps=4",
    "train.log_every=1",
)


def saved_dense(cfg, run_dir):
    """The dense parameters and optimizer state as checkpoints hold them (every mode alike)."""
    _, steps = build(cfg, mesh_from_config(cfg))
    state = restore_state(steps, Checkpoints(run_dir / "checkpoints", 3), **QUIET)
    saved = steps.checkpoint_form(state)
    return saved["params"], saved["opt_state"]


def trajectory(cfg):
    """Losses of cfg's train steps and the final dense state (as checkpoints hold it)."""
    source = make_source(cfg)
    _, steps = build(cfg, mesh_from_config(cfg), source, **QUIET)
    state, out = steps.init_state(), []
    for i in range(cfg.train.steps):
        state, metrics, _ = steps.train_step(state, steps.device_batch(source.train_batch(i)))
        out.append(float(metrics["loss"]))
    saved = steps.checkpoint_form(state)
    return out, (saved["params"], saved["opt_state"])


def assert_same(a, b):
    """Adam, compared across reduction orders: a near-zero gradient's sign can differ, and Adam's
    first steps are about lr * sign(g), so an element may be ~1e-4 off (ARCHITECTURE.md 3)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_tensor_and_pipeline_train_like_data_parallel(tiny):
    """On 2, 4 and 8 devices (on one, both are data parallelism: the reference itself). Tensor
    parallel: one model group over every device (the hardest split); pipelined: two stages
    (four: test_checkpoints_restore_across_modes). The reference is data parallelism on one
    device (which every device count matches: test_train)."""
    ref_losses, ref_state = trajectory(tiny("mesh.devices=1", *MODEL))
    for devices in (2, 4, 8):
        for mode, model in (("tensor", devices), ("pipeline", min(devices, 2))):
            got_losses, got_state = trajectory(
                tiny(f"mesh.devices={devices}", f"mesh.model={model}", f"model.mlp_parallel={mode}", *MODEL)
            )
            np.testing.assert_allclose(got_losses, ref_losses, rtol=1e-5, err_msg=f"{mode} on {devices}")
            assert_same(got_state, ref_state)


@pytest.mark.slow
def test_wide_and_deep_trains_tensor_and_pipeline_like_data_parallel(tiny):
    """Wide&Deep's bottom MLP is empty, so it has no parameters: tensor-parallel and pipelined
    runs failed with "KeyError: 'bottom'" (after the run dir was made)."""
    kept = [o for o in MODEL if not o.startswith(("model.bottom", "model.interaction", "model.dcn"))]
    wide_deep = ("model.kind=wide_deep", "model.bottom_mlp=[]", "model.interaction=cat", *kept)
    ref_losses, ref_state = trajectory(tiny("mesh.devices=1", *wide_deep))
    for mode, model in (("tensor", 4), ("pipeline", 2)):
        got_losses, got_state = trajectory(
            tiny("mesh.devices=4", f"mesh.model={model}", f"model.mlp_parallel={mode}", *wide_deep)
        )
        np.testing.assert_allclose(got_losses, ref_losses, rtol=1e-5, err_msg=mode)
        assert_same(got_state, ref_state)


@pytest.mark.slow
def test_each_device_holds_its_share_of_the_dense_layers(tiny):
    cfg = tiny("mesh.devices=8", "mesh.model=4", "model.mlp_parallel=tensor", *MODEL)
    _, steps = build(cfg, make_mesh(8, model=4))
    state = steps.init_state()
    first = state.params["top"]["layers"][0]["kernel"]  # column-parallel: [in, 16] split by columns
    assert first.sharding.spec == jax.P(None, MODEL_AXIS)
    assert {s.data.shape for s in first.addressable_shards} == {(first.shape[0], 4)}
    second = state.params["top"]["layers"][1]["kernel"]  # row-parallel: split by rows
    assert {s.data.shape for s in second.addressable_shards} == {(4, 16)}
    assert {s.data.shape for s in state.opt_state[0].mu["top"]["layers"][1]["kernel"].addressable_shards} == {(4, 16)}
    assert state.params["cross"]["u"][0].sharding.spec == jax.P(None, MODEL_AXIS)

    cfg = tiny("mesh.devices=8", "mesh.model=4", "model.mlp_parallel=pipeline", *MODEL)
    _, steps = build(cfg, make_mesh(8, model=4))
    packed = steps.init_state().params["stages"]
    plan = steps.pipeline
    assert packed.shape == (4, plan.length) and {s.data.shape for s in packed.addressable_shards} == {(1, plan.length)}
    params = plan.unpack({"stages": packed})
    assert plan.length < sum(x.size for x in jax.tree.leaves(params))  # each device a stage, not the whole model
    # Packing is lossless: unpack(pack(p)) == p.
    assert_same(plan.unpack(plan.pack(params)), params)


@pytest.mark.slow
def test_checkpoints_restore_across_modes(tiny, tmp_path):
    """Two steps pipelined over four stages, two more tensor-parallel from its checkpoint, end
    where four data-parallel steps end."""
    base = ("mesh.devices=4", "mesh.model=4", "train.checkpoint_every=2", *MODEL)
    train_and_evaluate(tiny(*base, "model.mlp_parallel=data"), tmp_path / "whole", **QUIET)
    train_and_evaluate(tiny(*base, "model.mlp_parallel=pipeline", "train.steps=2"), tmp_path / "mixed", **QUIET)
    cfg = tiny(*base, "model.mlp_parallel=tensor")
    train_and_evaluate(cfg, tmp_path / "mixed", **QUIET)
    np.testing.assert_allclose(losses(tmp_path / "mixed"), losses(tmp_path / "whole"), rtol=1e-5)
    assert_same(saved_dense(cfg, tmp_path / "mixed"), saved_dense(cfg, tmp_path / "whole"))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (("mesh.devices=8", "mesh.model=3"), "mesh.model=3 must divide mesh.devices=8"),
        (("mesh.devices=8", "mesh.model=4", "model.mlp_parallel=tensor", "model.top_mlp=[6, 1]"), "model.top_mlp[0]=6"),
        (
            ("mesh.devices=8", "mesh.model=4", "model.mlp_parallel=pipeline", "model.top_mlp=[8, 1]"),
            "model.top_mlp has 2 layers",
        ),
        (
            ("mesh.devices=8", "mesh.model=2", "model.mlp_parallel=pipeline", "model.microbatches=5"),
            "model.microbatches=5 must divide the 16 rows",
        ),
        (("mesh.devices=8", "mesh.model=2", "embedding.sync=per_host"), "mesh.model > 1"),
    ],
)
def test_impossible_splits_are_refused_naming_the_key(tiny, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        cfg = tiny(*overrides)
        build(cfg, mesh_from_config(cfg))


@settings(max_examples=examples(60))
@given(head=st.integers(0, 50), costs=st.lists(st.integers(1, 50), min_size=1, max_size=7), stages=st.integers(1, 5))
def test_stage_cuts_are_contiguous_and_the_best_balance(head, costs, stages):
    if len(costs) < stages - 1:
        return
    cuts = _balanced_cuts(head, costs, stages)
    assert len(cuts) == stages and cuts[0] == 0
    bounds = [*cuts, len(costs)]
    assert all(bounds[s] < bounds[s + 1] for s in range(1, stages))  # stages after the first: a layer each

    def heaviest(bounds):
        return max(head * (s == 0) + sum(costs[bounds[s] : bounds[s + 1]]) for s in range(stages))

    candidates = ([0, *inner, len(costs)] for inner in itertools.combinations(range(len(costs) + 1), stages - 1))
    every = [b for b in candidates if all(b[s] < b[s + 1] for s in range(1, stages))]
    assert heaviest(bounds) == min(heaviest(b) for b in every)


def test_plan_refuses_the_microbatches_that_training_refuses(tiny):
    """Before: `dlrm-jax plan` printed a plan for model.microbatches=3 on a model group of 64
    rows, which `train` then refused after naming its run dir (docs/cli.md: plan prints a
    plan only for a config that trains)."""
    from dlrm_jax.train.checks import check_runnable

    cfg = tiny("mesh.devices=4", "mesh.model=2", "model.mlp_parallel=pipeline", "model.microbatches=3")
    with pytest.raises(ConfigError, match="model.microbatches=3 must divide the"):
        check_runnable(cfg, 4, simulated=True)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (("model.top_mlp=[30, 1]",), r"model.top_mlp\[0\]=30: model.mlp_parallel=tensor splits"),
        (("model.top_mlp=[16, 6, 8, 1]",), None),  # (a row layer's width is free)
        (("model.interaction=dcn", "model.dcn_rank=6"), "model.dcn_rank=6: model.mlp_parallel=tensor splits"),
    ],
)
def test_plan_refuses_the_tensor_widths_that_training_refuses(tiny, overrides, message):
    """Before: `dlrm-jax plan` printed a plan for a top layer of 30 split over 4 devices, and
    `train` refused it only once the model was built, after naming its run dir."""
    from dlrm_jax.train.checks import check_runnable

    cfg = tiny("mesh.devices=4", "mesh.model=4", "model.mlp_parallel=tensor", *overrides)
    if message is None:
        check_runnable(cfg, 4, simulated=True)
        return
    with pytest.raises(ConfigError, match=message):
        check_runnable(cfg, 4, simulated=True)
