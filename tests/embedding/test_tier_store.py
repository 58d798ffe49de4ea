"""The disk tier: row I/O through chunk memmaps, copy-on-write snapshots, crash recovery, export."""

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm_jax.embedding.tiers import store as tier_store
from dlrm_jax.embedding.tiers.format import TierError, default_chunk_rows, numpy_dtype
from dlrm_jax.embedding.tiers.store import TierStore
from tests.embedding.tier_store_cases import CHUNK_ROWS, TABLES, assert_equal, contents, full, new_values, reference
from tests.helpers import examples


def read_with_tensorstore(path: Path) -> np.ndarray:
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}
    return ts.open(spec, open=True).result().read().result()


def tables_at(directory: Path) -> dict[str, dict[str, np.ndarray]]:
    return {t: {f: read_with_tensorstore(directory / t / f) for f in fields} for t, (_, fields) in TABLES.items()}


@pytest.fixture
def store(tmp_path):
    s = TierStore.create(tmp_path / "tier", TABLES, reference, CHUNK_ROWS)
    yield s
    s.close()


def test_create_reads_the_initial_rows(store, tmp_path):
    rows = np.array([36, 0, 5, 5, 17, 8, 7, 36])  # any order, repeats, chunk edges
    for table in TABLES:
        rows_t = rows % store.rows(table)
        got = store.read(table, rows_t)
        assert_equal(got, {f: v[rows_t] for f, v in full(table).items()})
    assert store.fields("cat_1") == {"values": ((4,), "bfloat16")}
    assert store.read("cat_1", rows % 20)["values"].dtype == numpy_dtype("bfloat16")
    # Plain zarr3 arrays: tensorstore reads them on its own; every chunk file is full size.
    assert_equal(tables_at(tmp_path / "tier" / "work"), {t: full(t) for t in TABLES})
    assert (tmp_path / "tier/work/cat_0/values/c.4.0").stat().st_size == 8 * 16 * 4
    assert (tmp_path / "tier/work/cat_0/accumulator/c.4").stat().st_size == 8 * 4


def test_a_path_through_a_parent_folder_opens(tmp_path):
    """``--run-dir ../runs/x`` or ``export --output ../models/x``: tensorstore's file driver
    refused a path with ``..`` in it ("Invalid file path"), so training or exporting failed."""
    (tmp_path / "sub").mkdir()
    made = TierStore.create(tmp_path / "sub" / ".." / "tier", TABLES, reference, CHUNK_ROWS)
    made.close()
    with TierStore.open(tmp_path / "sub" / ".." / "tier", TABLES) as again:
        assert_equal(again.read("cat_0", np.arange(3)), {f: v[:3] for f, v in full("cat_0").items()})


def test_chunk_rows_default_to_about_4_mib_and_shrink_to_small_tables(tmp_path):
    assert default_chunk_rows(64) == 65536
    assert default_chunk_rows(100) == 32768  # a power of two that fits
    assert default_chunk_rows(8 * 2**20) == 1
    with TierStore.create(tmp_path / "tier", TABLES, reference) as store:
        assert store.chunk_rows("cat_0") == 37
        assert (tmp_path / "tier/work/cat_0/values/c.0.0").stat().st_size == 37 * 16 * 4
        assert_equal(contents(store), {t: full(t) for t in TABLES})


@settings(max_examples=examples(25))
@given(
    st.lists(
        st.one_of(
            st.tuples(
                st.just("write"),
                st.sampled_from(list(TABLES)),
                st.sets(st.integers(0, 99), max_size=12),
                st.integers(0, 2**31),
            ),
            st.tuples(st.just("snapshot")),
            st.tuples(st.just("restore"), st.integers(0, 99)),
        ),
        max_size=12,
    )
)
def test_snapshots_and_restores_match_a_numpy_model(ops):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "tier"
        store = TierStore.create(root, TABLES, reference, CHUNK_ROWS)
        store.max_open_chunks = 3  # fewer than the chunks: maps are evicted and reopened
        model = {t: full(t) for t in TABLES}
        saved = {}
        for step, op in enumerate(ops):
            if op[0] == "write":
                _, table, picks, seed = op
                rows = np.unique(np.array(sorted(picks), np.int64) % store.rows(table))
                values = new_values(store, table, len(rows), seed)
                store.write(table, rows, values)
                for f, v in values.items():
                    model[table][f][rows] = v
            elif op[0] == "snapshot":
                store.snapshot(step)
                saved[step] = {t: {f: v.copy() for f, v in fields.items()} for t, fields in model.items()}
            elif saved:
                restored = sorted(saved)[op[1] % len(saved)]
                store.restore(restored)
                model = {t: {f: v.copy() for f, v in fields.items()} for t, fields in saved[restored].items()}
            assert_equal(contents(store), model)
        assert store.snapshots() == sorted(saved)
        for step, expected in saved.items():  # later writes never reached a snapshot
            assert_equal(tables_at(root / "snapshots" / str(step)), expected)
        store.close()
        with TierStore.open(root, TABLES) as reopened:
            assert_equal(contents(reopened), model)


def test_write_copies_a_shared_chunk_and_leaves_the_snapshot_bytes(store, tmp_path):
    store.snapshot(1)
    chunk = tmp_path / "tier/snapshots/1/cat_0/values/c.0.0"
    before = chunk.read_bytes()
    assert chunk.stat().st_nlink == 2  # shared with work/
    store.write("cat_0", np.array([1, 2]), new_values(store, "cat_0", 2, seed=0))
    assert chunk.read_bytes() == before
    assert chunk.stat().st_nlink == 1 and (tmp_path / "tier/work/cat_0/values/c.0.0").stat().st_nlink == 1
    assert (tmp_path / "tier/work/cat_0/values/c.1.0").stat().st_nlink == 2  # untouched: still shared
    store.write("cat_0", np.array([3]), new_values(store, "cat_0", 1, seed=1))  # now private: no copy
    assert chunk.read_bytes() == before


def test_a_crash_mid_snapshot_leaves_the_older_snapshot(store, tmp_path, monkeypatch):
    root = tmp_path / "tier"
    store.snapshot(1)
    store.write("cat_0", np.array([4, 30]), new_values(store, "cat_0", 2, seed=0))
    with monkeypatch.context() as m:  # the process dies before renaming 2.tmp to 2
        m.setattr(tier_store.os, "replace", crash)
        with pytest.raises(SystemExit):
            store.snapshot(2)
    assert (root / "snapshots/2.tmp").is_dir()
    reopened = TierStore.open(root, TABLES)
    assert reopened.snapshots() == [1] and not (root / "snapshots/2.tmp").exists()
    reopened.restore(1)
    assert_equal(contents(reopened), {t: full(t) for t in TABLES})


@pytest.mark.parametrize("crash_at", ["link", "swap"])
def test_a_crash_mid_restore_is_recovered(store, tmp_path, monkeypatch, crash_at):
    root = tmp_path / "tier"
    store.write("cat_1", np.array([3]), new_values(store, "cat_1", 1, seed=0))
    store.snapshot(1)
    expected = contents(store)
    store.write("cat_1", np.array([3, 19]), new_values(store, "cat_1", 2, seed=1))
    with monkeypatch.context() as m:
        if crash_at == "link":  # while building work.tmp
            m.setattr(tier_store.os, "link", crash)
        else:  # between renaming work away and work.tmp into place
            real = os.replace
            m.setattr(tier_store.os, "replace", lambda a, b: crash() if Path(a).name == "work.tmp" else real(a, b))
        with pytest.raises(SystemExit):
            store.restore(1)
    assert (root / "work.tmp").is_dir()
    if crash_at == "swap":
        assert not (root / "work").exists()
    assert TierStore.exists(root)
    reopened = TierStore.open(root, TABLES)  # finishes the swap, or drops the half-built work.tmp
    if crash_at == "swap":  # the restore had built work.tmp whole: recovery completes it
        assert_equal(contents(reopened), expected)
    reopened.restore(1)
    assert_equal(contents(reopened), expected)
    assert sorted(p.name for p in root.iterdir()) == ["snapshots", "work"]


def test_readers_of_a_snapshot_leave_a_writers_work_in_progress_alone(store, tmp_path):
    """eval/export beside a training run: opening a snapshot (or asking whether a store exists)
    removed the snapshot the run was making (snapshots/<step>.tmp), which the run then committed
    without its files; and the halves of a restore's swap."""
    root = tmp_path / "tier"
    store.snapshot(1)
    store.write("cat_1", np.array([3]), new_values(store, "cat_1", 1, seed=0))
    shutil.copytree(root / "snapshots" / "1", root / "snapshots" / "2.tmp")  # a snapshot being made
    shutil.copytree(root / "work", root / "work.tmp")  # a restore's new working files being built
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    assert TierStore.exists(root)
    with TierStore.open_snapshot(root, TABLES, 1) as view:
        assert_equal(contents(view), {t: full(t) for t in TABLES})
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before
    with pytest.raises(TierError, match="no such snapshot"):
        TierStore.open_snapshot(root, TABLES, 2)


def crash(*_):
    raise SystemExit("simulated crash")


def damage_missing(work: Path) -> Path:
    (work / "cat_0/values/c.2.0").unlink()
    return work / "cat_0/values/c.2.0"


def damage_truncated(work: Path) -> Path:
    os.truncate(work / "cat_0/values/c.2.0", 100)
    return work / "cat_0/values/c.2.0"


def damage_dtype(work: Path) -> Path:
    meta = json.loads((work / "cat_1/values/zarr.json").read_text())
    (work / "cat_1/values/zarr.json").write_text(json.dumps(meta | {"data_type": "float64"}))
    return work / "cat_1/values/zarr.json"


def damage_shape(work: Path) -> Path:
    meta = json.loads((work / "cat_0/accumulator/zarr.json").read_text())
    (work / "cat_0/accumulator/zarr.json").write_text(json.dumps(meta | {"shape": [36]}))
    return work / "cat_0/accumulator/zarr.json"


@pytest.mark.parametrize(
    "damage, says",
    [
        (damage_missing, "missing"),
        (damage_truncated, "truncated (100 of 512 bytes)"),
        (damage_dtype, "data_type"),
        (damage_shape, "shape"),
    ],
)
def test_damaged_files_are_named(store, tmp_path, damage, says):
    store.close()
    bad = damage(tmp_path / "tier/work")
    with pytest.raises(TierError) as e:
        TierStore.open(tmp_path / "tier", TABLES)
    assert str(bad) in str(e.value) and says in str(e.value) and "\n" not in str(e.value)


def test_other_table_specs_and_missing_stores_are_refused(store, tmp_path):
    wider = TABLES | {"cat_1": (20, {"values": ((8,), "bfloat16")})}
    with pytest.raises(TierError, match="cat_1/values/zarr.json"):
        TierStore.open(tmp_path / "tier", wider)
    with pytest.raises(TierError, match=str(tmp_path / "elsewhere")):
        TierStore.open(tmp_path / "elsewhere", TABLES)
    with pytest.raises(TierError, match="already holds"):
        TierStore.create(tmp_path / "tier", TABLES, reference, CHUNK_ROWS)
    with pytest.raises(TierError, match="no such snapshot"):
        store.restore(7)


def test_snapshots_without_their_store_are_refused_saying_what_to_do(store, tmp_path):
    store.snapshot(3)
    store.close()
    shutil.rmtree(tmp_path / "tier" / "work")
    with pytest.raises(TierError) as e:
        TierStore.create(tmp_path / "tier", TABLES, reference, CHUNK_ROWS)
    said = str(e.value)
    assert f"remove {tmp_path / 'tier' / 'snapshots'}" in said and "run_dir" in said and "\n" not in said
    assert (tmp_path / "tier" / "snapshots" / "3").is_dir()  # refused: nothing removed


def test_a_full_disk_names_the_file_and_changes_nothing(store, tmp_path, monkeypatch):
    store.snapshot(1)
    before = contents(store)
    copies = []

    def copy_then_fill_the_disk(src, dst):
        copies.append(src)
        if len(copies) == 2:  # the second chunk of the write
            Path(dst).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        Path(dst).write_bytes(Path(src).read_bytes())

    monkeypatch.setattr(tier_store, "_copy_file", copy_then_fill_the_disk)
    with pytest.raises(TierError) as e:
        store.write("cat_0", np.array([0, 9]), new_values(store, "cat_0", 2, seed=0))
    assert e.value.errno == errno.ENOSPC and str(copies[1]) in str(e.value)
    assert "no space left" in str(e.value)
    assert_equal(contents(store), before)
    assert not list((tmp_path / "tier/work").rglob("*.cow"))
    monkeypatch.undo()  # space freed: the same write goes through
    store.write("cat_0", np.array([0, 9]), new_values(store, "cat_0", 2, seed=0))
    assert_equal(tables_at(tmp_path / "tier/snapshots/1"), before)


def test_a_tier_made_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """Before: tensorstore's text of the failed write, and a half-built work.tmp left behind."""
    from dlrm_jax.embedding.tiers import snapshots

    made = []

    def fill_then_full(path, table, fields, init):
        if made:
            raise ValueError(f"Error writing {path}: [os_error_code='28'] No space left on device")
        made.append(table)
        real(path, table, fields, init)

    real = snapshots.bulk_load
    monkeypatch.setattr(snapshots, "bulk_load", fill_then_full)
    with pytest.raises(
        OSError, match=f"tier path {tmp_path / 'tier'}: no space left on device for the tiered tables' "
    ):
        TierStore.create(tmp_path / "tier", TABLES, reference, CHUNK_ROWS)
    assert made and list((tmp_path / "tier").iterdir()) == []


def test_export_writes_compressed_arrays_of_work_or_a_snapshot(store, tmp_path):
    store.snapshot(1)
    at_1 = contents(store)
    store.write("cat_0", np.arange(0, 37, 3), new_values(store, "cat_0", 13, seed=0))
    store.export(tmp_path / "now")
    store.export(tmp_path / "at_1", snapshot=1)
    store.export(tmp_path / "one", table="cat_1")
    assert_equal(tables_at(tmp_path / "now"), contents(store))
    assert_equal(tables_at(tmp_path / "at_1"), at_1)
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["cat_1"]
    codecs = json.loads((tmp_path / "now/cat_0/values/zarr.json").read_text())["codecs"]
    assert [c["name"] for c in codecs] == ["bytes", "zstd"]
    with pytest.raises(TierError, match=str(tmp_path / "now")):
        store.export(tmp_path / "now")


def test_keep_snapshots_deletes_the_others(store, tmp_path):
    for step in (1, 2, 3):
        store.write("cat_1", np.array([step]), new_values(store, "cat_1", 1, seed=step))
        store.snapshot(step)
    at_3 = contents(store)
    store.keep_snapshots([3])
    assert store.snapshots() == [3]
    assert sorted(p.name for p in (tmp_path / "tier/snapshots").iterdir()) == ["3"]
    store.write("cat_1", np.array([0]), new_values(store, "cat_1", 1, seed=9))
    store.restore(3)
    assert_equal(contents(store), at_3)


def test_bad_rows_are_refused(store):
    with pytest.raises(IndexError):
        store.read("cat_0", np.array([37]))
    with pytest.raises(ValueError, match="distinct"):
        store.write("cat_0", np.array([1, 1]), new_values(store, "cat_0", 2, seed=0))
    with pytest.raises(ValueError, match="shape"):
        store.write("cat_0", np.array([1]), {"values": np.zeros((1, 8), np.float32)})
