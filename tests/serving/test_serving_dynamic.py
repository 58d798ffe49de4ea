"""Serving a model with dynamic tables (embedding.ids=dynamic): the maps travel with the
artifact, raw Criteo lines score as eval scores them (an id the map does not hold reads its
shard's shared row, in both), and a delta carries its step's maps; a Wide&Deep model, whose
wide weights of a dynamic table are looked up at the rows its map gives. The maps take what
training gave them: the values themselves (the text source, ``preprocess --raw-values``, Criteo
or tabular), read from raw lines by every path that scores them."""

import jax
import numpy as np
import pytest

from dlrm_jax import serving
from dlrm_jax.config import load_config
from dlrm_jax.data.sources.criteo import parse_lines, write_criteo_tsv
from dlrm_jax.data.sources.synthetic import SyntheticGenerator
from dlrm_jax.parallel.mesh import make_mesh
from dlrm_jax.serving.files import predict_files
from dlrm_jax.serving.rules import parse_criteo
from dlrm_jax.train.build import build
from dlrm_jax.train.serving_export import export_serving
from dlrm_jax.train.trainer import train_and_evaluate
from tests.helpers import QUIET
from tests.serving.test_serving import (
    assert_scores_of_eval,
    criteo_sample,
    movielens_sample,
    scores_of,
    smoke_run,
    train_and_export,
)
from tests.train.test_step_invariance import by_table
from tests.train.test_train import final_state

LINES, VAL = 1200, 256


@pytest.mark.slow
def test_raw_lines_score_as_eval_and_a_delta_carries_the_maps(tmp_path):
    gen = SyntheticGenerator(
        seed=5, num_dense=13, table_rows=(40, 400) * 13, bag_sizes=(1,) * 26, zipf_exponent=1.1, positive_rate=0.3
    )
    write_criteo_tsv(tmp_path / "day.tsv", gen.raw(0, 0, 0, LINES), missing_cat_rate=0.05)
    cfg = load_config(
        None,
        [
            "data.source=criteo",
            f"data.path={tmp_path / 'day.tsv'}",
            f"data.val_fraction={VAL / LINES}",
            "data.max_rows=0",
            f"data.cardinalities={[40, 400] * 13}",
            "embedding.table_ids=[cat_1=dynamic, cat_3=dynamic]",
            "embedding.dynamic.rows=0.25",
            "embedding.dynamic.vshards=4",
            "embedding.dynamic.probes=3",
            "train.batch_size=64",
            "train.steps=16",
            "train.checkpoint_every=8",
            "train.eval_every=0",
            "train.eval_batches=0",
            "train.keep_checkpoints=3",
            "train.progress_bar=false",
            "mesh.devices=2",
            "model.embedding_dim=8",
            "model.top_mlp=[16, 1]",
            # Wide&Deep: the maps' rows serve the deep tables and the wide weights alike
            "model.kind=wide_deep",
            "model.bottom_mlp=[]",
            "model.interaction=cat",
        ],
    )
    train_and_evaluate(cfg, tmp_path / "run", **QUIET)
    # Training mapped the values themselves (the packed feed carries them beside the batch),
    # never the placeholder ids ``value % rows`` that travel in the ids' slots.
    lines = (tmp_path / "day.tsv").read_bytes().splitlines(keepends=True)
    values = parse_lines(lines[:-VAL]).values
    _, steps = build(cfg, make_mesh(2))
    maps = by_table(steps, final_state(cfg, tmp_path / "run")).maps
    for name, f in (("cat_1", 1), ("cat_3", 3)):
        m = jax.tree.map(np.asarray, maps[name])
        held = (m.key_hi[m.used].astype(np.uint64) << np.uint64(32)) | m.key_lo[m.used]
        assert len(held) > 20 and np.isin(held, values[:, f]).all(), name
    for name, step, kw in (("f8", 8, {}), ("f16", 16, {}), ("d", 16, {"since": 8})):
        export_serving(tmp_path / "run", tmp_path / name, step=step, **kw, **QUIET)
    probs, _, _ = scores_of(tmp_path / "run")
    val_lines = (tmp_path / "day.tsv").read_bytes().splitlines(keepends=True)[-VAL:]
    with serving.load(tmp_path / "f16") as model:
        maps = model.manifest["id_maps"]
        assert set(maps) == {"cat_1", "cat_3"} and all(0 < m["ids_held"] <= m["rows"] for m in maps.values())
        full = model.predict_raw(val_lines)
        # By ids, dynamic features' ids are their raw 64-bit ids (before: cast to int32 first)
        parsed = parse_criteo(val_lines)
        ids = model.rules.ids(parsed.values, parsed.empty).astype(np.uint64)
        for f in (1, 3):
            ids[:, f] = np.where(parsed.empty[:, f], np.uint64(0), parsed.values[:, f])
        assert (ids[:, [1, 3]] >= 2**31).any()
        np.testing.assert_array_equal(model.predict(model.rules.dense(parsed), ids), full)
        # raw_inputs gives them so (it gave the rules' ids: up to 0.055 away)
        dense, given = model.raw_inputs(parsed)
        np.testing.assert_array_equal(given.view(np.uint64), ids)
        np.testing.assert_array_equal(model.predict(dense, given), full)
    assert_scores_of_eval(full, probs)
    (tmp_path / "val.tsv").write_bytes(b"".join(val_lines))
    with serving.load(tmp_path / "f16") as model:  # as `dlrm-jax predict` reads a file
        predict_files(model, [str(tmp_path / "val.tsv")], tmp_path / "p.txt", progress=False)
    np.testing.assert_array_equal(np.loadtxt(tmp_path / "p.txt", dtype=np.float32), full)
    with serving.load(tmp_path / "f8") as base:
        at8 = base.predict_raw(val_lines)
    with serving.load(tmp_path / "f8", deltas=[tmp_path / "d"]) as model:
        np.testing.assert_array_equal(model.predict_raw(val_lines), full)
    assert not np.array_equal(at8, full)  # the maps and rows moved between the steps


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["criteo", "tabular"])
def test_a_dataset_of_raw_values_scores_raw_lines_as_eval(tmp_path, layout):
    """``preprocess --raw-values``: training's dynamic tables mapped each value's 64-bit number
    (0 where missing), not its vocabulary id. Raw lines must reach the maps the same way, from
    ``predict_raw`` and from files (`dlrm-jax predict`); they had been given the ids, scoring
    the held-out lines up to 0.16 away from evaluation."""
    if layout == "criteo":
        lines = criteo_sample(tmp_path, seed=6, lines=LINES, val=VAL, raw_values=True)
        dynamic = "embedding.table_ids=[cat_1=dynamic, cat_3=dynamic]"
    else:
        lines = movielens_sample(tmp_path, raw_values=True)
        dynamic = "embedding.ids=dynamic"
    probs, _, _ = train_and_export(smoke_run(tmp_path, dynamic, "embedding.dynamic.vshards=2"), tmp_path)
    val = lines[-len(probs) :]  # held out in input order (the latest ratings: in time order)
    (tmp_path / "val.txt").write_bytes(b"".join(val))
    with serving.load(tmp_path / "art") as model:
        assert model.rules.maps_values and model.id_maps
        by_raw = model.predict_raw(val)
        predict_files(model, [str(tmp_path / "val.txt")], tmp_path / "p.txt", progress=False)
    assert_scores_of_eval(by_raw, probs)
    np.testing.assert_array_equal(np.loadtxt(tmp_path / "p.txt", dtype=np.float32), by_raw)
