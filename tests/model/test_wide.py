"""Wide&Deep's wide part (model/wide.py) against plain NumPy: its logit, and one train step of
its FTRL update on 1, 2, 4 and 8 devices from a state where every weight is already nonzero."""

import jax
import numpy as np
import pytest

from dlrm_jax.config import ConfigError
from dlrm_jax.data.sources import make_source
from dlrm_jax.parallel.mesh import make_mesh
from dlrm_jax.train.build import build
from tests.reference import dense_reference

WIDE_DEEP = ("model.kind=wide_deep", "model.bottom_mlp=[]", "model.interaction=cat", "model.wide.learning_rate=0.1")


def wide_numpy(steps, state):
    wide, part = state.parts["wide"], steps.parts["wide"]
    values, slots = part.collection.logical_tables(wide.tables)
    return (
        [np.asarray(v, np.float64)[:, 0] for v in values],
        [{k: np.asarray(v, np.float64)[:, 0] for k, v in s.items()} for s in slots],
        np.asarray(wide.linear, np.float64)[:, 0],
    )


@pytest.mark.parametrize("devices", [1, 8])  # 2 and 4: the trajectory test (test_train)
def test_wide_logit_and_ftrl_step_match_numpy(tiny, devices):
    cfg = tiny(*WIDE_DEEP, f"mesh.devices={devices}")
    _, steps = build(cfg, make_mesh(devices))
    source = make_source(cfg)
    state = steps.init_state()
    for i in range(2):  # away from the zero start: the update's -sigma * w term matters
        state, _, _ = steps.train_step(state, steps.device_batch(source.train_batch(i)))
    tables, slots, linear = wide_numpy(steps, state)
    assert all(np.count_nonzero(t) for t in tables) and np.count_nonzero(linear) == linear.size
    batch = source.train_batch(2)
    ids, dense, labels = batch.ids, batch.dense.astype(np.float64), batch.labels.astype(np.float64)

    deep = jax.jit(lambda s, b: steps._forward(s.params, steps.collection.lookup(s.emb, b.ids)[0], b))(
        state, steps.device_batch(batch)
    )
    wide = sum(t[ids[:, f]] for f, t in enumerate(tables)) + dense @ linear[:-1] + linear[-1]
    p = np.asarray(steps.eval_step(state, steps.device_batch(batch))[0])
    np.testing.assert_allclose(p, 1 / (1 + np.exp(-(np.asarray(deep) + wide))), rtol=1e-5, atol=1e-6)

    d_logit = (p - labels) / len(labels)  # mean binary cross-entropy
    lr = cfg.model.wide.learning_rate
    old_linear_slots = [np.asarray(state.parts["wide"].linear_slots[k], np.float64) for k in ("z", "n")]
    state, _, _ = steps.train_step(state, steps.device_batch(batch))
    new_tables, new_slots, new_linear = wide_numpy(steps, state)
    for f in range(len(tables)):
        acc = (slots[f]["z"][:, None], slots[f]["n"][:, None])
        want, (z, n) = dense_reference("ftrl", tables[f][:, None], acc, ids[:, f], d_logit[:, None], lr)
        np.testing.assert_allclose(new_tables[f], want[:, 0], rtol=2e-4, atol=1e-6)
        np.testing.assert_allclose(new_slots[f]["n"], n[:, 0], rtol=1e-5, atol=1e-7)
    # The dense features' weights and the bias: every element takes a gradient each step.
    grad_linear = np.concatenate([dense.T @ d_logit, [d_logit.sum()]])[:, None]
    want, _ = dense_reference("ftrl", linear[:, None], old_linear_slots, np.arange(linear.size), grad_linear, lr)
    np.testing.assert_allclose(new_linear, want[:, 0], rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.bottom_mlp=[8]", "model.bottom_mlp: must be empty"),
        ("model.interaction=dot", "model.interaction: model.kind=wide_deep has no dot interaction"),
        ("embedding.sync=per_host", "model.kind=wide_deep: per-host tables"),
    ],
)
def test_wide_deep_config_errors_name_the_key(tiny, override, message):
    with pytest.raises(ConfigError, match=message):
        tiny(*WIDE_DEEP, override)
