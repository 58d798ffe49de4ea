"""Benchmarks run, write JSON, and the plan's byte prediction matches the compiled HLO."""

import json

from dlrm_jax.bench import bench_train
from dlrm_jax.bench_embedding import bench_embedding, hlo_collective_bytes

QUIET = dict(log=lambda *_: None)


def test_embedding_bench_bytes_match_hlo(tiny, tmp_path):
    cfg = tiny("mesh.devices=8", "train.batch_size=64", "data.cardinalities=[300, 40, 1000, 7, 64]")
    out = tmp_path / "emb.json"
    report = bench_embedding(cfg, steps=1, strategies=["replicated", "table", "row", "column", "auto"],
                             output=str(out), **QUIET)
    assert json.loads(out.read_text())["results"].keys() == report["results"].keys()
    for name in ("replicated", "table", "row", "column", "auto"):
        r = report["results"][name]
        # Exactly the predicted bytes, give or take the one-word overflow flags.
        assert abs(r["hlo_bytes"] - r["predicted_bytes"]) <= 64, (name, r)
    assert report["results"]["dense_gradient"]["hlo_bytes"] > report["results"]["row"]["hlo_bytes"]


def test_hlo_parser():
    text = ("%a = f32[8,10,4]{2,1,0} all-to-all(f32[8,10,4]{2,1,0} %x), dimensions={0}\n"
            "%b = s32[8,99]{1,0} all-to-all(s32[8,99]{1,0} %y), dimensions={0}\n"
            "%c = (f32[16]{0}, s32[4]{0}) all-reduce-start(f32[16]{0} %p, s32[4]{0} %q)\n")
    got = hlo_collective_bytes(text, 8, skip_dims={99})
    assert got == {"all-to-all": 8 * 10 * 4 * 4 * 7 / 8, "all-reduce": 2 * 7 / 8 * (64 + 16)}


def test_train_bench_writes_json(tiny, tmp_path):
    out = tmp_path / "train.json"
    bench_train({"tiny": tiny("mesh.devices=2")}, steps=2, warmup=1, output=str(out), **QUIET)
    r = json.loads(out.read_text())["results"]["tiny"]
    assert r["samples_per_s"] > 0 and r["ratio_to_first"] == 1.0
