"""Criteo TSV parsing, `preprocess_criteo` and `CriteoTSVSource`, on synthetic TSV files."""

import gzip
import json
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm_jax.config import load_config
from dlrm_jax.data import criteo
from dlrm_jax.data.binary import BinarySource
from dlrm_jax.data.criteo import (
    CriteoFormatError,
    CriteoTSVSource,
    parse_lines,
    preprocess_criteo,
    scramble_id,
    write_criteo_tsv,
)
from dlrm_jax.data.synthetic import SyntheticGenerator, normalise_dense

ROWS = (2, 5, 17, 60, 300, 1000) * 4 + (3, 40)  # 26 small tables: repeated values, min_count
N = 1200
M = 97  # max_ind_range of the hashing tests


def synthetic_raw(n=N, seed=3):
    gen = SyntheticGenerator(seed=seed, num_dense=13, table_rows=ROWS, bag_sizes=(1,) * 26,
                             zipf_exponent=1.1, positive_rate=0.3)  # fmt: skip
    return gen.raw(0, 0, 0, n)


@pytest.fixture(scope="module")
def raw():
    return synthetic_raw()


@pytest.fixture(scope="module")
def tsv(raw, tmp_path_factory):
    """(path, empty categoricals bool [N, 26]) of the synthetic samples as one TSV file."""
    path = tmp_path_factory.mktemp("tsv") / "day_0.tsv"
    return path, write_criteo_tsv(path, raw, missing_cat_rate=0.05, seed=1)


def load_split(out, split):
    return {k: np.load(Path(out) / split / f"{k}.npy") for k in ("dense", "ids", "labels")}


def load_all(out):
    """Train then val rows concatenated: the valid lines in input order."""
    train, val = load_split(out, "train"), load_split(out, "val")
    return {k: np.concatenate([train[k], val[k]]) for k in train}


def preprocess(inputs, out, **kw):
    return preprocess_criteo([str(p) for p in inputs], str(out), progress=False, **kw)


def leftovers(folder):
    return sorted(p.name for p in Path(folder).iterdir() if p.name.startswith("."))


def hashed(raw, empty, rows=M):
    return np.where(empty, 0, scramble_id(raw.ids).astype(np.uint64) % np.uint64(rows))


def test_parse_lines_recovers_raw_samples(raw, tsv):
    path, empty = tsv
    p = parse_lines(path.read_bytes().splitlines(keepends=True))
    assert not p.bad and len(p.rows) == N
    np.testing.assert_array_equal(p.missing, raw.missing)
    np.testing.assert_array_equal(p.counts[~p.missing], raw.counts[~raw.missing])
    np.testing.assert_array_equal(p.empty, empty)
    np.testing.assert_array_equal(p.values, np.where(empty, 0, scramble_id(raw.ids)))
    np.testing.assert_array_equal(p.labels, raw.labels)


def test_parse_lines_hex_widths_and_case():
    cats = ["", "0", "F", "aBc", "ffffffffffffffff", "0000000000000001"] + ["1"] * 20
    (p_values,) = parse_lines(["\t".join(["1", *[""] * 13, *cats])]).values
    want = [0, 0, 15, 0xABC, 2**64 - 1, 1] + [1] * 20
    assert p_values.tolist() == want


GOOD = "\t".join(["0", "1", "", "-2", *["3"] * 10, *["0a1b2c3d"] * 25, ""])


def with_field(index, value):
    fields = GOOD.split("\t")
    fields[index] = value
    return "\t".join(fields)


BAD_LINES = {  # kind -> (line, message)
    "field count": (GOOD.rsplit("\t", 1)[0], "expected 40 tab-separated fields, found 39"),
    "field count+": (GOOD + "\tab", "expected 40 tab-separated fields, found 41"),
    "label": (with_field(0, "2"), "label is '2', expected 0 or 1"),
    "integer field": (with_field(3, "1.5"), "integer field I3 is not an integer: '1.5'"),
    "categorical field": (
        with_field(18, "0a1b2x3d"),
        "categorical field C5 is not hex: '0a1b2x3d'",
    ),
    "empty line": ("", "empty line"),
}


def test_good_line_template_is_valid():
    assert not parse_lines([GOOD]).bad


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_malformed_line_names_file_and_line(raw, tmp_path, kind):
    line, message = BAD_LINES[kind]
    first, second = tmp_path / "a.tsv", tmp_path / "b.tsv"
    write_criteo_tsv(first, synthetic_raw(30))
    lines = synthetic_tsv_lines(tmp_path, 20)
    lines.insert(6, line + "\r\n")  # line 7 of the second file
    second.write_text("".join(lines))
    with pytest.raises(CriteoFormatError) as e:
        preprocess([first, second], tmp_path / "out")
    assert str(e.value) == f"{second}:7: {message}"
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
    cfg = criteo_config(f"{first},{second}")
    with pytest.raises(CriteoFormatError, match=f"^{second}:7: "):
        CriteoTSVSource(cfg)


def synthetic_tsv_lines(tmp_path, n, seed=3):
    path = tmp_path / f"lines_{n}_{seed}.tsv"
    write_criteo_tsv(path, synthetic_raw(n, seed))
    return path.read_text().splitlines(keepends=True)


def criteo_config(path, *extra):
    return load_config(None, ["data.source=criteo", f"data.path={path}", "data.max_rows=0",
                              f"data.cardinalities={[M] * 26}", "train.batch_size=16",
                              "train.eval_batches=0", *extra])  # fmt: skip


def test_skip_mode_counts_bad_lines_by_reason(tmp_path, raw, tsv):
    path, _ = tsv
    lines = path.read_text().splitlines(keepends=True)
    bad = [(kind, BAD_LINES[kind][0]) for kind in sorted(BAD_LINES)] * 2
    for i, (_, line) in enumerate(bad):  # spread over the file, in order
        lines.insert(1 + i * 50, line + "\n")
    dirty = tmp_path / "dirty.tsv"
    dirty.write_text("".join(lines))
    report = preprocess([dirty], tmp_path / "out", skip_bad_lines=True, max_ind_range=M)
    want = {
        "field count": 4,
        "label": 2,
        "integer field": 2,
        "categorical field": 2,
        "empty line": 2,
    }
    assert report.skipped_by_reason == want and report.skipped == 12
    assert report.lines_read == N + 12 and report.train_rows + report.val_rows == N
    assert report.skipped_examples[0].startswith(f"{dirty}:2: ")
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["skipped"] == 12 and meta["skipped_by_reason"] == want
    preprocess([path], tmp_path / "clean", max_ind_range=M)
    for k, v in load_all(tmp_path / "clean").items():
        np.testing.assert_array_equal(load_all(tmp_path / "out")[k], v)
    assert "12 skipped" in report.summary() and "label: 2" in report.summary()
    source = CriteoTSVSource(criteo_config(dirty, "data.skip_bad_lines=true"))
    assert source.skipped.by_reason == want and source.num_train + source.num_val == N
    # Every source reports what was skipped, in one line.
    assert source.skip_report().startswith("skipped 12 malformed line(s) (categorical field: 2")
    assert f"{dirty}:2:" in source.skip_report()
    binary = BinarySource(criteo_config(tmp_path / "out", "data.source=binary"))
    assert "skipped 12 malformed line(s)" in binary.skip_report() and "label: 2" in binary.skip_report()
    assert BinarySource(criteo_config(tmp_path / "clean", "data.source=binary")).skip_report() == ""


def test_gzipped_input_is_streamed_and_reported_by_line(tmp_path, tsv):
    path, _ = tsv
    gz = tmp_path / "day_0.gz"
    gz.write_bytes(gzip.compress(path.read_bytes() + b"1\t2\n"))
    with pytest.raises(CriteoFormatError, match=f"{gz}:{N + 1}: expected 40"):
        preprocess([gz], tmp_path / "bad", max_ind_range=M)
    preprocess([gz], tmp_path / "from_gz", max_ind_range=M, skip_bad_lines=True)
    preprocess([path], tmp_path / "from_tsv", max_ind_range=M)
    for k, v in load_all(tmp_path / "from_tsv").items():
        np.testing.assert_array_equal(load_all(tmp_path / "from_gz")[k], v)
    with pytest.raises(CriteoFormatError, match="gzipped.*preprocess"):
        CriteoTSVSource(criteo_config(gz))


def test_killed_preprocess_leftovers_are_removed(tmp_path, tsv):
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    for kind in ("tmp", "old"):
        (tmp_path / f".out.{kind}-{dead.pid}" / "train").mkdir(parents=True)
    (tmp_path / f".out.tmp-{os.getppid()}").mkdir()  # a live writer's folder stays
    preprocess([tsv[0]], tmp_path / "out", max_ind_range=M)
    assert leftovers(tmp_path) == [f".out.tmp-{os.getppid()}"]


def test_hashing_mode_ids(tmp_path, raw, tsv):
    path, empty = tsv
    report = preprocess([path], tmp_path / "out", max_ind_range=M)
    assert report.cardinalities == (M,) * 26
    np.testing.assert_array_equal(load_all(tmp_path / "out")["ids"], hashed(raw, empty))
    assert not (tmp_path / "out" / "vocab").exists()


@pytest.mark.parametrize("min_count", [1, 4])
def test_vocabulary_mode_ids(tmp_path, raw, tsv, min_count):
    path, empty = tsv
    report = preprocess([path], tmp_path / "out", min_count=min_count)
    ids = load_all(tmp_path / "out")["ids"]
    values = scramble_id(raw.ids)
    for f in range(26):
        seen = values[~empty[:, f], f].tolist()
        counts = {v: seen.count(v) for v in set(seen)}
        ranked = sorted(
            (v for v in counts if counts[v] >= min_count), key=lambda v: (-counts[v], v)
        )
        id_of = {v: i + 1 for i, v in enumerate(ranked)}
        want = [
            0 if e else id_of.get(v, 0)
            for v, e in zip(values[:, f].tolist(), empty[:, f], strict=True)
        ]
        assert ids[:, f].tolist() == want, f"feature {f}"
        assert report.cardinalities[f] == 1 + len(ranked)
        vocab = np.load(tmp_path / "out" / "vocab" / f"feature_{f}.npy")
        assert vocab[:, 0].tolist() == ranked and vocab[:, 1].tolist() == [
            counts[v] for v in ranked
        ]
    assert (ids[empty] == 0).all()
    if min_count > 1:
        assert report.cardinalities[-3] < 1 + len(set(values[:, -3].tolist()))  # some were rare


def test_dense_labels_and_split_sizes(tmp_path, raw, tsv):
    path, _ = tsv
    report = preprocess([path], tmp_path / "out", max_ind_range=M, val_fraction=0.25)
    assert (report.train_rows, report.val_rows) == (900, 300)
    train, val = load_split(tmp_path / "out", "train"), load_split(tmp_path / "out", "val")
    assert train["dense"].dtype == np.float32 and train["ids"].dtype == np.int32
    dense = normalise_dense(raw.counts, raw.missing)
    np.testing.assert_array_equal(train["dense"], dense[:900])
    np.testing.assert_array_equal(val["dense"], dense[900:])
    np.testing.assert_array_equal(val["labels"], raw.labels[900:].astype(np.float32))


def test_chunking_and_line_endings_give_identical_bytes(tmp_path, tsv):
    path, _ = tsv
    crlf = tmp_path / "crlf.tsv"
    crlf.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    preprocess([path], tmp_path / "one", max_ind_range=0, min_count=2)
    preprocess([path], tmp_path / "seven", max_ind_range=0, min_count=2, chunk_lines=7)
    preprocess([crlf], tmp_path / "crlf", max_ind_range=0, min_count=2, chunk_lines=7)
    files = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*.npy"))
    assert len(files) == 6 + 26
    for f in files:
        assert (tmp_path / "seven" / f).read_bytes() == (tmp_path / "one" / f).read_bytes(), f
        assert (tmp_path / "crlf" / f).read_bytes() == (tmp_path / "one" / f).read_bytes(), f


@settings(max_examples=15, deadline=None)
@given(chunk=st.integers(1, 60), val_fraction=st.floats(0.0, 0.9), split_at=st.integers(1, 119),
       hashing=st.booleans())  # fmt: skip
def test_any_chunking_split_and_file_boundary(tsv, chunk, val_fraction, split_at, hashing):
    lines = tsv[0].read_text().splitlines(keepends=True)[:120]
    with tempfile.TemporaryDirectory() as tmp:
        a, b = Path(tmp) / "a.tsv", Path(tmp) / "b.tsv"
        a.write_text("".join(lines[:split_at]))
        b.write_text("".join(lines[split_at:]))
        (Path(tmp) / "all.tsv").write_text("".join(lines))
        kw = {"max_ind_range": M if hashing else 0, "val_fraction": val_fraction}
        report = preprocess([a, b], Path(tmp) / "out", chunk_lines=chunk, **kw)
        preprocess([Path(tmp) / "all.tsv"], Path(tmp) / "ref", **kw)
        n_val = int(120 * val_fraction + 0.5)
        assert (report.train_rows, report.val_rows) == (120 - n_val, n_val)
        assert len(load_split(Path(tmp) / "out", "val")["labels"]) == n_val
        ref = load_all(Path(tmp) / "ref")
        for k, v in load_all(Path(tmp) / "out").items():
            np.testing.assert_array_equal(v, ref[k])


def test_failure_while_writing_leaves_nothing(tmp_path, tsv, monkeypatch):
    path, _ = tsv
    preprocess([path], tmp_path / "out", max_ind_range=M)
    before = {p: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()}

    def broken(*a):
        raise OSError("disk full")

    monkeypatch.setattr(criteo, "normalise_dense", broken)
    with pytest.raises(OSError, match="disk full"):
        preprocess([path], tmp_path / "new", max_ind_range=M)
    with pytest.raises(OSError, match="disk full"):  # an earlier dataset survives intact
        preprocess([path], tmp_path / "out", max_ind_range=M)
    assert not (tmp_path / "new").exists() and leftovers(tmp_path) == []
    assert {p: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()} == before
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a preprocessed dataset"):
        preprocess([path], tmp_path / "other")


def test_tsv_source_cycles_over_train_lines(tmp_path, raw, tsv):
    path, empty = tsv
    cfg = criteo_config(path, "data.val_fraction=0.25")
    source = CriteoTSVSource(cfg)
    assert (source.num_train, source.num_val) == (900, 300)
    ids, dense = hashed(raw, empty), normalise_dense(raw.counts, raw.missing)
    for step in (0, 56, 57):  # 900 = 56 * 16 + 4: step 56 wraps around
        rows = (step * 16 + np.arange(16)) % 900
        batch = source.train_batch(step)
        np.testing.assert_array_equal(batch.ids, ids[rows])
        np.testing.assert_array_equal(batch.dense, dense[rows])
        np.testing.assert_array_equal(batch.labels, raw.labels[rows])
    halves = [CriteoTSVSource(cfg, p, 2).train_batch(56) for p in (0, 1)]
    np.testing.assert_array_equal(
        np.concatenate([h.ids for h in halves]), source.train_batch(56).ids
    )
    evals = list(source.eval_batches())
    assert [b.size for b in evals] == [16] * 18 + [12]
    np.testing.assert_array_equal(np.concatenate([b.ids for b in evals]), ids[900:])
