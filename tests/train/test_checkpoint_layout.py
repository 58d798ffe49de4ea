"""Large shards are stored with rows that checkpoint in chunks of a useful size, and checkpoints
saved before that padding still restore."""

import json

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm_jax.embedding.plan import layout
from dlrm_jax.embedding.plan.layout import CHUNK_BYTES, build_groups, storage_rows
from dlrm_jax.parallel.mesh import make_mesh
from dlrm_jax.train.build import build
from dlrm_jax.train.checkpoint import Checkpoints
from dlrm_jax.train.restore import restore_state
from dlrm_jax.train.trainer import train_and_evaluate
from tests.helpers import QUIET, examples


def largest_chunk_rows(rows: int, width: int) -> int:
    """The most rows a chunk of at most CHUNK_BYTES can hold and still divide ``rows`` (what
    orbax's chunk chooser looks for: chunks never straddle two devices' shards)."""
    cap = CHUNK_BYTES // (width * 4)
    divisors = {x for d in range(1, int(rows**0.5) + 1) if rows % d == 0 for x in (d, rows // d)}
    return max(d for d in divisors if d <= cap)


@settings(max_examples=examples(60))
@given(st.integers(1, 40_000_000), st.sampled_from([4, 8, 16, 64, 128]))
def test_stored_rows_chunk_into_large_pieces_at_little_cost(rows, width):
    stored = storage_rows(rows, width)
    assert rows <= stored <= rows * (1 + 1 / 256) + 1
    if stored * width * 4 > CHUNK_BYTES:  # checkpointed in chunks: of 1/512 of it, or half the most
        cap = CHUNK_BYTES // (width * 4)
        assert largest_chunk_rows(stored, width) * 2 >= min(cap, stored // 256)
    else:
        assert stored == rows


# 2,097,143 rows in the replicated group on one device: a prime, 67 MB at dim 8. Unpadded, its
# only chunks under CHUNK_BYTES are single rows (criteo_kaggle's 33,762,577 took minutes).
PRIME = ("mesh.devices=1", "embedding.sharding=replicated", "data.cardinalities=[2096096, 40, 1000, 7]")


def test_a_prime_row_count_is_padded_and_trains_saves_and_resumes(tiny, tmp_path):
    cfg = tiny(*PRIME, "train.steps=2")
    plan, _ = build(cfg, make_mesh(1))
    (group,) = build_groups(plan)
    assert largest_chunk_rows(2097143, 8) == 1
    assert group.local_rows == storage_rows(2097143, 8) > 2097143
    assert largest_chunk_rows(group.local_rows, 8) * 512 >= group.local_rows
    train_and_evaluate(cfg, tmp_path, **QUIET)
    assert train_and_evaluate(tiny(*PRIME, "train.steps=4"), tmp_path, **QUIET).step == 4


def logical_tables(cfg, run_dir):
    _, steps = build(cfg, make_mesh(1))
    state = restore_state(steps, Checkpoints(run_dir / "checkpoints", 3), **QUIET)
    return steps.collection.logical_tables(state.emb)


def test_a_checkpoint_saved_before_the_padding_restores_row_for_row(tiny, tmp_path, monkeypatch):
    # 2,097,144 rows (8 x 262,143): saved unpadded, as earlier versions stored them.
    cfg = tiny("mesh.devices=1", "embedding.sharding=replicated", "data.cardinalities=[2096097, 40, 1000, 7]")
    with monkeypatch.context() as m:
        m.setattr(layout, "storage_rows", lambda rows, width: rows)
        layout._groups_of.cache_clear()
        train_and_evaluate(cfg, tmp_path, **QUIET)
        before = logical_tables(cfg, tmp_path)
    layout._groups_of.cache_clear()
    # Its plan as those versions wrote it: no padded_rows key.
    (saved,) = [p for p in (tmp_path / "checkpoints").rglob("*") if p.is_file() and b"padded_rows" in p.read_bytes()]
    outer = json.loads(saved.read_text())
    plan = json.loads(outer["plan"])
    del plan["padded_rows"]
    saved.write_text(json.dumps({**outer, "plan": json.dumps(plan)}))
    after = logical_tables(cfg, tmp_path)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_checkpoint_saved_with_the_former_wide_field_restores_whole(tiny, tmp_path):
    """Before extra sparse parts were named, every checkpoint held the train state's ``wide``
    field, empty but for Wide&Deep; both kinds restore as they were saved."""
    for kind in ("dlrm", "wide_deep"):
        extra = ("model.kind=wide_deep", "model.bottom_mlp=[]", "model.interaction=cat") if kind == "wide_deep" else ()
        cfg = tiny("mesh.devices=2", *extra)
        _, steps = build(cfg, make_mesh(2))
        state = steps.init_state()
        saved = steps.checkpoint_form(state)
        if kind == "dlrm":
            saved = {**saved, "wide": {}}  # the empty field as orbax wrote it (a named tuple as a dict)
        assert kind == "dlrm" or set(saved) == {"step", "params", "opt_state", "emb", "wide"}  # where it always was
        ckpts = Checkpoints(tmp_path / kind, 3)
        ckpts.save(0, saved, steps.collection.plan.to_json())
        ckpts.wait()
        restored = restore_state(steps, ckpts, **QUIET)
        assert set(restored.parts) == set(steps.parts)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_saves_and_restores_leave_tensorstore_metrics_alone(tiny, tmp_path, monkeypatch):
    """Before: orbax counted each array's bytes by tensorstore's experimental_collect_matching_metrics,
    whose binding keeps about 3 KB of every call: host memory grew 68-87 KB a checkpoint for
    the whole run (1.7 GB over a long run saving every 50 steps)."""
    import tensorstore as ts

    calls = []
    collect = ts.experimental_collect_matching_metrics
    monkeypatch.setattr(
        ts, "experimental_collect_matching_metrics", lambda *a, **k: calls.append(a) or collect(*a, **k)
    )
    cfg = tiny("train.steps=4", "train.checkpoint_every=2", "mesh.devices=2")
    train_and_evaluate(cfg, tmp_path, **QUIET)
    assert train_and_evaluate(tiny("train.steps=6", "mesh.devices=2"), tmp_path, **QUIET).step == 6  # a restore too
    assert calls == []
