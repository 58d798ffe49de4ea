"""Dynamic tables (embedding.ids=dynamic) through training: the run's events, a resumed run
equal to an uninterrupted one bit for bit (maps included), a checkpoint restored onto another
device count, and the config's refusals. The step itself against one device, step by step:
test_step_invariance.py; the map against a dictionary: tests/embedding/test_idmap.py."""

import json
import re
import shutil

import jax
import numpy as np
import pytest
import tensorstore as ts

from dlrm_jax.config import ConfigError
from dlrm_jax.data.sources.synthetic import SyntheticGenerator, SyntheticSource
from dlrm_jax.embedding.plan.stats import collective_bytes
from dlrm_jax.parallel.mesh import make_mesh
from dlrm_jax.train.build import build
from dlrm_jax.train.export import export_run
from dlrm_jax.train.saved_run import evaluate_run
from dlrm_jax.train.trainer import train_and_evaluate
from dlrm_jax.train.wiring import dynamic_maps, plan_from_config
from tests.helpers import QUIET, losses
from tests.train.test_step_invariance import by_table
from tests.train.test_train import final_state

DYNAMIC = (
    "embedding.table_ids=[cat_0=dynamic, cat_2=dynamic]",
    "embedding.dynamic.rows=0.2",
    "embedding.dynamic.vshards=8",
    "embedding.dynamic.probes=3",
    "embedding.dynamic.admit=2",
    "embedding.dynamic.sketch_width=64",
    "embedding.optimizer=rowwise_adagrad",
)


def test_plan_and_events_leave_out_the_row_ids_a_routed_lookup_does_not_send(tiny):
    """Every table dynamic on 8 devices at a batch whose ids are routed: the lookups reuse the
    maps' routing, so the plan says how many bytes of row ids a step does not send and the
    events' routed paths count that many fewer, and (no hot rows, no wide part) without the
    rows sent back; with two tables dynamic in a group shared with row-wise tables of
    vocabulary ids, nothing is left out."""
    from dlrm_jax.embedding.dynamic.sizing import resolution_paths
    from dlrm_jax.train.wiring import config_plan_report

    common = ("mesh.devices=8", "train.batch_size=512", *DYNAMIC[1:])
    for ids_of, reused in ((("embedding.ids=dynamic",), True), ((DYNAMIC[0], "embedding.sharding=row"), False)):
        cfg = tiny(*common, *ids_of)
        plan, steps = build(cfg, make_mesh(8), SyntheticSource(cfg))
        assert (steps.dynamic.routed_group is not None) == reused
        unsent = steps.dynamic.unsent_row_id_bytes()
        assert (unsent > 0) == reused
        ids = 512 * sum(cfg.bag_sizes[t] for t in steps.dynamic.maps)
        assert steps.dynamic.rows_back == (not reused)
        plain_paths = resolution_paths(ids, 8, rows_back=not reused)
        for got, plain in zip(steps.dynamic.resolution_paths(512), plain_paths, strict=True):
            assert got == ({**plain, "all-to-all": plain["all-to-all"] - unsent} if "all-to-all" in plain else plain)
        report = config_plan_report(cfg, plan)
        assert (f"{unsent / 2**10:,.1f} KiB a step fewer than the all-to-all above" in report) == reused, report


@pytest.mark.slow
def test_resume_is_bitwise_identical_and_restores_onto_fewer_devices_with_its_maps(tiny, tmp_path):
    # With hot rows refreshed every 2 steps: the maps' rows become hot once counted (none is at
    # first), and a resumed run refreshes as the uninterrupted one did.
    hot = ("embedding.hot.rows=16", "embedding.hot.refresh_every=2", "embedding.hot.stats_batches=2")
    cfg = tiny("mesh.devices=8", "train.steps=8", "train.log_every=2", "train.checkpoint_every=4", *DYNAMIC, *hot)
    whole = train_and_evaluate(cfg, tmp_path / "whole", **QUIET)
    train_and_evaluate(tiny("mesh.devices=8", "train.steps=4", *DYNAMIC, *hot), tmp_path / "cut", **QUIET)
    resumed = train_and_evaluate(cfg, tmp_path / "cut", **QUIET)
    assert losses(tmp_path / "cut") == losses(tmp_path / "whole")
    assert (resumed.auc, resumed.logloss) == (whole.auc, whole.logloss)
    plan8, steps8 = build(cfg, make_mesh(8), SyntheticSource(cfg))
    a, b = (by_table(steps8, final_state(cfg, tmp_path / d, SyntheticSource(cfg))) for d in ("whole", "cut"))
    assert set(a.maps) == {"cat_0", "cat_2"}
    assert int(np.asarray(a.maps["cat_0"].used).sum()) > 0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # The run's events count what the maps did in each window.
    events = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    first = events[0]
    assert first["ids_lookups"] == 2 * 64 * 2  # two steps of 64 samples, one id in each of two tables
    assert 0 < first["ids_admitted"] and first["ids_held_back"] > 0 and 0 < first["map_fill"] < 1
    assert first["ids_found_rate"] == first["ids_found"] / first["ids_lookups"]
    # what the raw ids' resolution sends is in the bytes: 8 ids a device, gathered (no route pays)
    (gathered,) = steps8.dynamic.resolution_paths(64)
    sent = collective_bytes(plan8, steps8.collection.table_copies)
    assert first["allgather_bytes"] == sent["all-gather"] + gathered["all-gather"] > 0
    assert first["allreduce_bytes"] == sent["all-reduce"] + gathered["all-reduce"]
    assert events[-1]["hot_hit_rate"] > 0
    hot_tables = np.asarray(a.emb.hot.keys)[0]  # the last refresh made rows of the dynamic tables hot
    assert {0, 2} & set(hot_tables.tolist()), hot_tables
    # The checkpoint onto 4 devices: the same maps and tables, the same scores.
    cfg4 = tiny("mesh.devices=4", "train.steps=8", *DYNAMIC, *hot)
    _, steps4 = build(cfg4, make_mesh(4), SyntheticSource(cfg4))
    s4 = by_table(steps4, final_state(cfg4, tmp_path / "whole", SyntheticSource(cfg4)))
    for x, y in zip(
        jax.tree.leaves((a.maps, steps8.collection.logical_tables(a.emb))),
        jax.tree.leaves((s4.maps, steps4.collection.logical_tables(s4.emb))),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert all(len(x.sharding.device_set) == 4 for x in jax.tree.leaves(s4.maps))
    on4 = evaluate_run(tmp_path / "whole", ["mesh.devices=4"], **QUIET)
    np.testing.assert_allclose(on4.auc, whole.auc, rtol=1e-6)
    # And onto one device, where dynamic tables are replicated, not row-wise.
    on1 = evaluate_run(tmp_path / "whole", ["mesh.devices=1"], **QUIET)
    np.testing.assert_allclose(on1.auc, whole.auc, rtol=1e-6)
    # `dlrm-jax export` writes each map beside its table.
    export_run(tmp_path / "whole", tmp_path / "export", **QUIET)
    for field, want in a.maps["cat_2"]._asdict().items():
        path = tmp_path / "export" / "cat_2" / "map" / field
        got = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}).result().read().result()
        np.testing.assert_array_equal(got, np.asarray(want))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ("embedding.table_sharding=[cat_2=table]",),
            "embedding.table_sharding: 'cat_2=table': table cat_2 takes raw ids",
        ),
        (("embedding.sync=per_host",), "per-host tables (embedding.sync=per_host) are not supported yet"),
        (("embedding.dynamic.vshards=6",), "embedding.dynamic.vshards=6: a power of two"),
        (("embedding.table_ids=[cat_2=hashed]",), "embedding.table_ids[0]: 'cat_2=hashed' must be TABLE=IDS"),
        # (every table dynamic, so every table row-wise whatever it said: it changed nothing, silently)
        (
            ("embedding.ids=dynamic", "embedding.sharding=column"),
            "embedding.sharding=column: every table takes raw ids",
        ),
    ],
    ids=["not-row", "per-host", "vshards", "value", "all-dynamic-not-row"],
)
def test_config_refuses_what_dynamic_tables_cannot_do(tiny, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        tiny("embedding.table_ids=[cat_2=dynamic]", *overrides)


def test_control_flow_reaches_every_map(tiny):
    """``embedding.dynamic.control_flow`` is every map's (the form its resolution compiles to:
    tests/embedding/test_idmap.py)."""
    for form in ("auto", "one_path"):
        _, steps = build(tiny(*DYNAMIC, f"embedding.dynamic.control_flow={form}"), make_mesh(1))
        assert {spec.control_flow for spec in steps.dynamic.maps.values()} == {form}


def test_a_map_that_does_not_split_over_the_devices_is_refused_naming_its_table(tiny):
    """By training and by ``plan`` alike (a plan for 16 devices of the default 8 shards would
    have promised a run that cannot start)."""
    cfg = tiny("mesh.devices=8", "embedding.table_ids=[cat_2=dynamic]", "embedding.dynamic.vshards=4")
    with pytest.raises(
        ConfigError, match=r"embedding.dynamic.vshards: table cat_2: a map of 4 shards cannot be split over 8 devices"
    ):
        build(cfg, make_mesh(8))
    with pytest.raises(ConfigError, match=r"table cat_1: a map of 8 shards cannot be split over 16 devices.*of 16"):
        plan_from_config(tiny("embedding.table_ids=[cat_1=dynamic]"), 16)
    # 6 devices: shard counts are powers of two (before: "... (a multiple of 6)", which none is)
    with pytest.raises(ConfigError, match=r"over 6 devices in whole shards; dynamic tables need a power-of-two device"):
        plan_from_config(tiny("embedding.table_ids=[cat_1=dynamic]", "train.batch_size=1200"), 6)


def test_the_default_shards_split_every_table_over_eight_devices(tiny):
    """``embedding.dynamic.vshards: 0`` gives even a table of 7 values (one shard before) as many
    shards as 8 devices need, the same maps whatever the mesh (a checkpoint keeps its rows)."""
    cfg = tiny("mesh.devices=8", "embedding.ids=dynamic")
    _, steps = build(cfg, make_mesh(8))
    specs = steps.dynamic.maps
    assert [s.vshards for s in specs.values()] == [8, 8, 16, 8]
    assert [s.rows for s in specs.values()] == [304, 72, 1008, 72]  # whole shards of probes + 1 slots or more
    assert specs == dynamic_maps(tiny("mesh.devices=1", "embedding.ids=dynamic"))


def test_a_table_ids_override_naming_no_table_is_refused(tiny):
    """A typo would leave the table on vocabulary ids without a word (train, plan, export and
    serving all size the maps through ``dynamic_maps``)."""
    with pytest.raises(
        ConfigError, match=r"embedding.table_ids: 'cat_9=dynamic': no table named 'cat_9' \(tables: cat_0 to cat_3\)"
    ):
        dynamic_maps(tiny("embedding.table_ids=[cat_1=dynamic, cat_9=dynamic]"))


def test_progressive_validation_scores_each_next_window_before_training_on_it(tiny, tmp_path):
    """train.progressive_window=4 over 12 steps: after steps 4 and 8 (not at the end) the state
    scores the next window's training batches (dynamic tables reading their maps); each event
    equals scoring those batches with the checkpoint of that step, and the training is the
    same as without them."""
    from dlrm_jax.data.sources import make_source
    from dlrm_jax.train.evaluate import evaluate

    run = ("mesh.devices=2", "train.log_every=4", "train.eval_every=0", *DYNAMIC)
    cfg = tiny(*run, "train.steps=12", "train.progressive_window=4")
    train_and_evaluate(cfg, tmp_path / "run", **QUIET)
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    windows = [e for e in events if e["event"] == "progressive"]
    assert [(e["step"], e["window"], e["progressive_samples"]) for e in windows] == [(4, 1, 4 * 64), (8, 2, 4 * 64)]
    assert [e["step"] for e in events if e["event"] != "progressive"] == [4, 8, 12]  # the windows' own events unchanged
    # The first window's score from a run cut at step 4: the same numbers.
    cut = tiny(*run, "train.steps=4")
    train_and_evaluate(cut, tmp_path / "cut", **QUIET)
    _, steps = build(cut, make_mesh(2))
    state = final_state(cut, tmp_path / "cut")
    source = make_source(cut)
    auc, logloss, scored = evaluate(steps, state, source, batches=(source.train_batch(i) for i in range(4, 8)))
    assert (auc, logloss, scored) == (windows[0]["progressive_auc"], windows[0]["progressive_logloss"], 4 * 64)
    # The cut run raised to 12 steps scores the window at its old end before training on it (the
    # window was skipped: its run had no next window there, and the resumed one began after it).
    train_and_evaluate(cfg, tmp_path / "cut", **QUIET)
    scores = lambda d: [{k: v for k, v in e.items() if k != "wall_s"} for e in events_of(d)]
    again = [e for e in scores(tmp_path / "cut") if e["event"] == "progressive"]
    assert again == [e for e in scores(tmp_path / "run") if e["event"] == "progressive"]
    # A run cut inside a window (at 10, in 8-11) scored all of it at 8, so raised to 12 it has
    # the uninterrupted run's scores (before: 2 batches of it, and never again).
    train_and_evaluate(tiny(*run, "train.steps=10", "train.progressive_window=4"), tmp_path / "inside", **QUIET)
    train_and_evaluate(cfg, tmp_path / "inside", **QUIET)
    inside = [e for e in scores(tmp_path / "inside") if e["event"] == "progressive"]
    assert inside == [e for e in scores(tmp_path / "run") if e["event"] == "progressive"]
    # Scoring changes nothing the training does.
    train_and_evaluate(tiny(*run, "train.steps=12"), tmp_path / "plain", **QUIET)
    plain = [json.loads(line)["loss"] for line in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
    assert [e["loss"] for e in events if e["event"] != "progressive"] == plain


def test_the_last_progressive_window_stops_at_the_end_of_its_pass(tiny):
    """Scored whole past train.steps (above), the last window stops where the pass over the data
    it is in ends: the batches after it wrap to rows trained on (train.epochs=1 scored them)."""
    import dataclasses
    import types

    from dlrm_jax.train.loop import progressive_windows

    t = tiny("train.steps=10", "train.batch_size=64", "train.progressive_window=4").train
    ten_batches = types.SimpleNamespace(num_train=640)
    assert progressive_windows(t, ten_batches) == {4: (1, 8, "steps 4-7"), 8: (2, 10, "steps 8-9")}
    assert progressive_windows(t, types.SimpleNamespace())[8] == (2, 12, "steps 8-11")  # (endless: synthetic)
    assert progressive_windows(dataclasses.replace(t, steps=9), ten_batches)[8] == (2, 10, "steps 8-9")
    assert progressive_windows(dataclasses.replace(t, steps=14), ten_batches)[12] == (3, 16, "steps 12-15")  # (pass 2)


def events_of(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def exported_arrays(root) -> dict:
    """Every array ``dlrm-jax export`` wrote under ``root``, by path."""
    out = {}
    for meta in sorted(root.rglob("zarr.json")):
        if meta.parent == root or not any(p.name == "zarr.json" for p in meta.parent.iterdir()):
            continue
        try:
            array = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(meta.parent)}}).result()
        except ValueError:  # a group
            continue
        out[str(meta.parent.relative_to(root))] = array.read().result()
    return out


@pytest.mark.slow
def test_tiered_dynamic_tables_resume_bitwise_evaluate_and_export_their_maps(tiny, tmp_path):
    """Tiered dynamic tables through train_and_evaluate, read ahead 2 batches, evaluated mid-run
    (the host maps ahead of the state), hot rows refreshed every 2 steps (rows of the maps
    become hot once counted): a run cut after its step-4 checkpoint and resumed
    equals the uninterrupted one (scores, exported tables and maps), which equals the same run
    with the tables on the devices (losses, scores); the checkpoint evaluates on another device
    count. Fresh rows start from their shared rows (``new_rows=shared``), which the planner
    places in the caches with each batch, across hot-set refreshes and the resume."""
    tiered = ("embedding.table_storage=[cat_2=tiered]", "embedding.tier.lookahead=2")
    hot = ("embedding.hot.rows=16", "embedding.hot.refresh_every=2", "embedding.hot.stats_batches=2")
    run = ("mesh.devices=4", "train.log_every=2", "train.checkpoint_every=4", "train.eval_every=4", *DYNAMIC, *hot)
    run += ("embedding.dynamic.new_rows=shared",)
    cfg = tiny(*run, "train.steps=8", *tiered)
    whole = train_and_evaluate(cfg, tmp_path / "whole", **QUIET)
    # Resumed from the step-4 checkpoint, saved while the planner had resolved batches ahead.
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    for newer in (tmp_path / "cut" / "checkpoints" / "8", tmp_path / "cut" / "tier" / "snapshots" / "8"):
        shutil.rmtree(newer)
    resumed = train_and_evaluate(cfg, tmp_path / "cut", **QUIET)
    assert (resumed.auc, resumed.logloss) == (whole.auc, whole.logloss)
    train_and_evaluate(tiny(*run, "train.steps=8"), tmp_path / "device", **QUIET)
    assert losses(tmp_path / "device") == losses(tmp_path / "whole")
    # the hot sets too: counted by rows (before: cat_0's, a dynamic table left on the devices,
    # by its raw ids in the tiered run, so other rows went hot)
    hits = lambda d: [e["hot_hit_rate"] for e in events_of(tmp_path / d) if "hot_hit_rate" in e]
    assert hits("whole") == hits("device") and len(hits("whole")) >= 4
    scores = lambda d: [(e["step"], e["auc"]) for e in events_of(tmp_path / d) if "auc" in e]
    assert len(scores("whole")) == 2  # evaluated mid-run too (step 4), the host maps read as of it
    np.testing.assert_allclose(scores("whole"), scores("device"), rtol=1e-5)
    for d in ("whole", "cut"):  # (the same maps and rows as on the devices: test_tiered_dynamic.py)
        export_run(tmp_path / d, tmp_path / f"export-{d}", **QUIET)
    a, b = (exported_arrays(tmp_path / f"export-{d}") for d in ("whole", "cut"))
    assert {"cat_0/map/key_lo", "cat_2/map/used", "cat_2/values"} <= set(a)
    assert int(a["cat_2/map/used"].sum()) > 0
    for path, want in a.items():
        np.testing.assert_array_equal(b[path], want, err_msg=path)
    assert events_of(tmp_path / "whole")[-1]["hot_hit_rate"] > 0
    first = [e for e in events_of(tmp_path / "whole") if "ids_lookups" in e][0]
    assert first["ids_lookups"] == 2 * 64 * 2 and 0 < first["map_fill"] < 1
    on2 = evaluate_run(tmp_path / "whole", ["mesh.devices=2"], **QUIET)
    np.testing.assert_allclose(on2.auc, whole.auc, rtol=1e-6)


@pytest.mark.parametrize("devices", [2, 8])
def test_the_step_copies_no_table_optimizer_state_or_id_map(tiny, devices):
    """The compiled step with dynamic tables writes its tables, their optimizer state and the
    id maps where they lie: no copy of any of them (a write inside a switch's branch made XLA
    copy the array whole every step; ``dlrm_jax/chunks.py``), on 2 devices (the ids gathered)
    and 8 (routed to their owners). The admission sketches, a fixed size per shard, are left out."""
    from dlrm_jax.data.sources import make_source, resolve_data_config

    overrides = (f"mesh.devices={devices}", "train.batch_size=512", "embedding.ids=dynamic", *DYNAMIC[1:])
    cfg = resolve_data_config(tiny(*overrides))
    source = make_source(cfg)
    _, fns = build(cfg, make_mesh(devices), source, log=lambda *_: None)
    state = fns.init_state()
    hlo = fns.train_step.lower(state, fns.device_batch(source.train_batch(0))).compile().as_text()
    dtypes = {"float32": "f32", "bfloat16": "bf16", "int32": "s32", "uint32": "u32", "bool": "pred"}
    spell = lambda x: f"{dtypes[str(x.dtype)]}[{','.join(map(str, x.addressable_shards[0].data.shape))}]"
    maps = [m._replace(sketch=None) for m in state.maps.values()]
    held = {spell(x) for x in jax.tree.leaves((state.emb.tables, state.emb.slots, maps))}
    assert any(s.startswith("u32[") for s in held) and any(s.startswith("f32[") for s in held)
    ops = dict(re.findall(r"^\s*(?:ROOT )?(%[\w.\-]+) = \S+ ([\w\-]+)\(", hlo, re.M))  # name -> its op
    copies = [
        line.strip()
        for line in hlo.splitlines()
        if " copy(" in line
        and ops.get(line.split(" copy(")[1].split(")")[0]) != "broadcast"
        and line.split(" = ")[1].split("{")[0] in held
    ]  # (a broadcast's copy is a fresh array filled, not one of these, whatever XLA named it)
    assert not copies, "\n".join(copies)


def test_tiered_dynamic_caches_hold_a_batchs_rows_from_raw_values(tmp_path):
    """Before: a tiered dynamic table's device cache was sized by the first batches' placeholder
    ids (not the raw values its map sees) and without its shards' shared rows; `plan` passed and
    the first step stopped: "table cat_0: a batch needs 8 distinct rows on device 1, the device
    cache holds 6"."""
    from dlrm_jax.config import load_config
    from dlrm_jax.data.sources.criteo import write_criteo_tsv

    gen = SyntheticGenerator(
        seed=5, num_dense=13, table_rows=(5, 400) * 13, bag_sizes=(1,) * 26, zipf_exponent=1.1, positive_rate=0.3
    )
    write_criteo_tsv(tmp_path / "day.tsv", gen.raw(0, 0, 0, 2000), missing_cat_rate=0.05)
    cfg = load_config(
        None,
        [
            "data.source=criteo",
            f"data.path={tmp_path / 'day.tsv'}",
            "data.max_rows=0",
            f"data.cardinalities={[5, 400] * 13}",
            "embedding.table_ids=[cat_0=dynamic, cat_1=dynamic]",
            "embedding.table_storage=[cat_0=tiered, cat_1=tiered]",
            "mesh.devices=2",
            "model.embedding_dim=8",
            "model.bottom_mlp=[8]",
            "model.top_mlp=[8, 1]",
            "train.batch_size=256",
            "train.steps=3",
            "train.eval_batches=1",
        ],
    )
    assert train_and_evaluate(cfg, tmp_path / "run", log=lambda *_: None).step == 3


def test_auto_hot_rows_with_every_table_dynamic_say_why_there_are_none(tiny):
    """Before: the cost model 'priced 1 set' (the empty one: no map holds an id when a run
    starts) and said nothing of why; the log now says so and what would make rows hot."""
    cfg = tiny("mesh.devices=2", "embedding.ids=dynamic", "embedding.hot.rows=auto", *DYNAMIC[1:])
    said = []
    plan, _ = build(cfg, make_mesh(2), SyntheticSource(cfg), log=said.append)
    assert plan.hot is None
    assert any("hot rows: none (every table is dynamic" in line for line in said), said
