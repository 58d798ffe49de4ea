"""Criteo TSV parsing, `preprocess_criteo` and `CriteoTSVSource`, on synthetic TSV files."""

import gzip
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm_jax.config import load_config
from dlrm_jax.data.preprocessing import criteo_preprocess
from dlrm_jax.data.preprocessing.criteo_preprocess import preprocess_criteo
from dlrm_jax.data.shards import load_split as load_dataset_split
from dlrm_jax.data.sources.binary import BinarySource
from dlrm_jax.data.sources.criteo import (
    CriteoFormatError,
    CriteoTSVSource,
    criteo_windows,
    parse_lines,
    scramble_id,
    write_criteo_tsv,
)
from dlrm_jax.data.sources.drifting import DriftingStream
from dlrm_jax.data.sources.synthetic import SyntheticGenerator, normalise_dense
from tests.child_env import REPO, child_env
from tests.helpers import examples

ROWS = (2, 5, 17, 60, 300, 1000) * 4 + (3, 40)  # 26 small tables: repeated values, min_count
N = 1200
M = 97  # max_ind_range of the hashing tests


def synthetic_raw(n=N, seed=3):
    gen = SyntheticGenerator(
        seed=seed, num_dense=13, table_rows=ROWS, bag_sizes=(1,) * 26, zipf_exponent=1.1, positive_rate=0.3
    )
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
    return load_dataset_split(out, split)


def load_all(out):
    """Train then val rows concatenated: the valid lines in input order."""
    train, val = load_split(out, "train"), load_split(out, "val")
    return {k: np.concatenate([train[k], val[k]]) for k in train}


def preprocess(inputs, out, **kw):
    """In input order (no shuffle) and in this process unless a test asks otherwise."""
    kw = {"shuffle_seed": None, "workers": 1, **kw}
    return preprocess_criteo([str(p) for p in inputs], str(out), progress=False, **kw)


def leftovers(folder):
    return sorted(p.name for p in Path(folder).iterdir() if p.name.startswith("."))


def hashed(raw, empty, rows=M):
    """The TSV source's ids: value % rows (empty: 0)."""
    return np.where(empty, 0, scramble_id(raw.ids).astype(np.uint64) % np.uint64(rows))


def compacted(raw, empty, rows=M, n_train=None):
    """preprocess's ids: each feature's hashed values numbered in ascending order; with
    ``n_train``, those of the first n_train rows (the train split), values seen only after
    them sharing one more row, the last (not hashed value 0's, the missing values')."""
    h = hashed(raw, empty, rows)
    if n_train is None:
        return np.stack([np.unique(h[:, f], return_inverse=True)[1].reshape(-1) for f in range(26)], 1)
    out = np.zeros(h.shape, np.int64)
    for f in range(26):
        seen = np.unique(h[:n_train, f])
        out[:, f] = np.where(np.isin(h[:, f], seen), np.searchsorted(seen, h[:, f]), len(seen))
    return out


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
    return load_config(
        None,
        [
            "data.source=criteo",
            f"data.path={path}",
            "data.max_rows=0",
            f"data.cardinalities={[M] * 26}",
            "train.batch_size=16",
            "train.eval_batches=0",
            *extra,
        ],
    )


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


def test_preprocess_skips_and_names_the_lines_the_text_source_does(tmp_path, tsv):
    """Before: a lone \\r was a line break to preprocess alone (two lines it joined were kept as
    rows, and later lines were named one too far on), and its fast parser kept a 22-digit integer
    (as 5) that the strict rule refuses, unless a bad line elsewhere in the block sent the block
    to the strict parser."""
    path, _ = tsv
    lines = path.read_bytes().split(b"\n")[:200]
    lines[9] = lines[9] + b"\r" + lines[10]  # lines 10 and 11 joined by a lone \r
    del lines[10]
    fields = lines[29].split(b"\t")
    fields[3] = b"0000000000000000000005"  # line 30, I3: 22 digits
    lines[29] = b"\t".join(fields)
    odd = tmp_path / "odd.tsv"
    odd.write_bytes(b"\n".join(lines) + b"\n")
    for block_mb in (1.0, 0.001):  # (one block; many, each through the fast parser first)
        report = preprocess([odd], tmp_path / f"out{block_mb}", skip_bad_lines=True, max_ind_range=M, block_mb=block_mb)
        assert report.skipped_examples[:2] == (
            f"{odd}:10: expected 40 tab-separated fields, found 79",
            f"{odd}:30: integer field I3 has over 18 digits: '0000000000000000000005'",
        ), report.skipped_examples
        assert report.lines_read == 199 and report.train_rows + report.val_rows == 197
    source = CriteoTSVSource(criteo_config(odd, "data.skip_bad_lines=true"))
    assert source.skipped.examples[:2] == list(report.skipped_examples[:2])
    assert source.num_train + source.num_val == 197


@pytest.mark.parametrize("kind", ["bz2", "lzma"])
def test_a_file_compressed_but_not_with_gzip_is_named_so(tmp_path, tsv, kind):
    """Before: read as text, 'expected 40 tab-separated fields, found 1' of its line 1 (and with
    skip_bad_lines, 'no training rows' without a count of what was skipped)."""
    import bz2
    import lzma

    path, _ = tsv
    packed = tmp_path / f"day.tsv.{kind}"
    packed.write_bytes({"bz2": bz2, "lzma": lzma}[kind].compress(path.read_bytes()[:20000]))
    with pytest.raises(ValueError, match=rf"{packed}: compressed with (bzip2|xz); only plain text and gzip are read"):
        preprocess([packed], tmp_path / "out", skip_bad_lines=True, max_ind_range=M)


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


@pytest.mark.slow
def test_killed_preprocess_leftovers_are_removed(tmp_path, tsv):
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    for kind in ("tmp", "old"):
        (tmp_path / f".out.{kind}-{dead.pid}" / "train").mkdir(parents=True)
    (tmp_path / f".out.tmp-{os.getppid()}").mkdir()  # a live writer's folder stays
    preprocess([tsv[0]], tmp_path / "out", max_ind_range=M)
    assert leftovers(tmp_path) == [f".out.tmp-{os.getppid()}"]


@pytest.mark.parametrize("vocab_from", ["train", "all"])
def test_hashing_mode_compacts_ids_to_the_distinct_values(tmp_path, raw, tsv, vocab_from):
    """--max-ind-range N: value % N, then numbered by hashed value, so a table has as many
    rows as the counted rows have distinct hashed values; vocab/ maps each id back to its
    value. Counted on train rows, the values seen only in val rows share a last row of their
    own: out of the vocabulary, not missing."""
    path, empty = tsv
    report = preprocess([path], tmp_path / "out", max_ind_range=M, vocab_from=vocab_from)
    n_train = 1080 if vocab_from == "train" else N
    h = hashed(raw, empty)
    unseen = np.array([np.isin(h[:, f], h[:n_train, f], invert=True) for f in range(26)]).T  # [N, 26]
    distinct = [len(np.unique(h[:n_train, f])) + int(unseen[:, f].any()) for f in range(26)]
    assert report.cardinalities == tuple(distinct) and min(distinct) < M and max(distinct) <= M
    assert unseen.any() == (vocab_from == "train")
    ids = load_all(tmp_path / "out")["ids"]
    np.testing.assert_array_equal(ids, compacted(raw, empty, n_train=n_train if vocab_from == "train" else None))
    for f in range(26):
        vocab = np.load(tmp_path / "out" / "vocab" / f"feature_{f}.npy")
        np.testing.assert_array_equal(vocab[ids[:, f], 0], np.where(unseen[:, f], 0, h[:, f]))  # id -> its value
    with pytest.raises(ValueError, match="max_ind_range"):
        preprocess([path], tmp_path / "neg", max_ind_range=-1)


@pytest.mark.parametrize("min_count,vocab_from", [(1, "train"), (4, "train"), (1, "all")])
def test_vocabulary_mode_ids(tmp_path, raw, tsv, min_count, vocab_from):
    """Frequency-ordered vocabularies counted on the train rows (the first 1080) or on all rows:
    id 0 for missing values, id 1 for values out of the vocabulary (rare, or seen only in the
    val rows), then by decreasing count."""
    path, empty = tsv
    report = preprocess([path], tmp_path / "out", min_count=min_count, vocab_from=vocab_from)
    ids = load_all(tmp_path / "out")["ids"]
    values = scramble_id(raw.ids)
    counted = 1080 if vocab_from == "train" else N
    for f in range(26):
        seen = values[:counted][~empty[:counted, f], f].tolist()
        counts = {v: seen.count(v) for v in set(seen)}
        ranked = sorted((v for v in counts if counts[v] >= min_count), key=lambda v: (-counts[v], v))
        id_of = {v: i + 2 for i, v in enumerate(ranked)}
        want = [0 if e else id_of.get(v, 1) for v, e in zip(values[:, f].tolist(), empty[:, f], strict=True)]
        assert ids[:, f].tolist() == want, f"feature {f}"
        assert report.cardinalities[f] == 2 + len(ranked)
        vocab = np.load(tmp_path / "out" / "vocab" / f"feature_{f}.npy")
        assert vocab[:, 0].tolist() == ranked and vocab[:, 1].tolist() == [counts[v] for v in ranked]
    assert (ids[empty] == 0).all()
    if min_count > 1:
        assert report.cardinalities[-3] < 2 + len(set(values[:, -3].tolist()))  # some were rare


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


@pytest.mark.slow
def test_chunking_and_line_endings_give_identical_bytes(tmp_path, tsv):
    path, _ = tsv
    crlf = tmp_path / "crlf.tsv"
    crlf.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    preprocess([path], tmp_path / "one", max_ind_range=0, min_count=2)
    preprocess([path], tmp_path / "seven", max_ind_range=0, min_count=2, block_mb=0.002)
    preprocess([crlf], tmp_path / "crlf", max_ind_range=0, min_count=2, block_mb=0.002)
    files = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*.npy"))
    assert len(files) == 6 + 26
    for f in files:
        assert (tmp_path / "seven" / f).read_bytes() == (tmp_path / "one" / f).read_bytes(), f
        assert (tmp_path / "crlf" / f).read_bytes() == (tmp_path / "one" / f).read_bytes(), f


@pytest.mark.slow
@settings(max_examples=examples(15))
@given(chunk=st.integers(1, 60), val_fraction=st.floats(0.0, 0.9), split_at=st.integers(1, 119), hashing=st.booleans())
def test_any_chunking_split_and_file_boundary(tsv, chunk, val_fraction, split_at, hashing):
    lines = tsv[0].read_text().splitlines(keepends=True)[:120]
    with tempfile.TemporaryDirectory() as tmp:
        a, b = Path(tmp) / "a.tsv", Path(tmp) / "b.tsv"
        a.write_text("".join(lines[:split_at]))
        b.write_text("".join(lines[split_at:]))
        (Path(tmp) / "all.tsv").write_text("".join(lines))
        kw = {"max_ind_range": M if hashing else 0, "val_fraction": val_fraction}
        report = preprocess([a, b], Path(tmp) / "out", block_mb=chunk * 250 / 2**20, **kw)
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

    monkeypatch.setattr(criteo_preprocess, "parse_block", broken)
    with pytest.raises(OSError, match="disk full"):
        preprocess([path], tmp_path / "new", max_ind_range=M)
    with pytest.raises(OSError, match="disk full"):  # an earlier dataset survives intact
        preprocess([path], tmp_path / "out", max_ind_range=M, overwrite=True)
    assert not (tmp_path / "new").exists() and leftovers(tmp_path) == []
    assert {p: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()} == before
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"not a preprocessed dataset \(it holds notes.txt\)"):
        preprocess([path], tmp_path / "other")


def test_overwrite_through_a_link_replaces_the_dataset_it_points_to_and_keeps_the_link(tmp_path, tsv):
    """Before: the link was renamed aside and deleted as a folder (``Cannot call rmtree on a
    symbolic link``) after the whole run, leaving a folder where the link was, a stray link
    beside it, and the linked dataset as it was."""
    path, _ = tsv
    preprocess([path], tmp_path / "real", max_ind_range=M, val_fraction=0.5)
    (tmp_path / "link").symlink_to("real")
    preprocess([path], tmp_path / "link", max_ind_range=M, val_fraction=0.25, overwrite=True)
    assert (tmp_path / "link").is_symlink() and os.readlink(tmp_path / "link") == "real"
    assert json.loads((tmp_path / "real" / "meta.json").read_text())["val_rows"] == 300
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


def test_two_preprocess_runs_into_one_new_folder_do_not_replace_each_other(tmp_path, tsv):
    """Before: both passed the check of a new output, and the second's commit replaced the first's
    dataset; both said they had written it."""
    from dlrm_jax.data.shards import DatasetDir

    path, _ = tsv
    with DatasetDir(tmp_path / "out"):  # (another run, writing it now)
        with pytest.raises(FileExistsError, match=r"^output .*out: another preprocess is writing it \(pid \d+"):
            preprocess([path], tmp_path / "out", max_ind_range=M)
    preprocess([path], tmp_path / "out", max_ind_range=M)  # (that one gone: this one writes it)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # (no lock or temporary left)


def test_an_input_that_changes_while_it_is_read_is_refused(tmp_path, tsv, monkeypatch):
    """Before: a file rewritten during preprocess made a dataset of some of each version, no error."""
    import shutil

    from dlrm_jax.data.preprocessing import prep_driver

    path = tmp_path / "day.tsv"
    shutil.copy(tsv[0], path)
    scan = prep_driver._scan_all

    def scan_then_append(*args):
        results = scan(*args)
        with open(path, "ab") as f:  # (still being written by another program)
            f.write(tsv[0].read_bytes()[:1000])
        return results

    monkeypatch.setattr(prep_driver, "_scan_all", scan_then_append)
    with pytest.raises(ValueError, match=rf"{path}: changed while it was read \([\d,]+ bytes, now [\d,]+\)"):
        preprocess([path], tmp_path / "out", max_ind_range=M)
    assert not (tmp_path / "out").exists()


def test_a_file_edited_under_a_run_names_the_file_and_the_lines_byte(tmp_path, tsv):
    """Before: ``['a.tsv', ...]: changed since indexed``, the whole list of paths and no place."""
    import shutil

    path = tmp_path / "day.tsv"
    shutil.copy(tsv[0], path)
    source = CriteoTSVSource(criteo_config(path, "data.shuffle=false"))
    data = bytearray(path.read_bytes())
    data[0:1] = b"x"  # the first line's label, in place
    path.write_bytes(bytes(data))
    with pytest.raises(CriteoFormatError, match=rf"^{path}: the line at byte 0 changed since the run indexed the file"):
        source.train_batch(0)


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
    np.testing.assert_array_equal(np.concatenate([h.ids for h in halves]), source.train_batch(56).ids)
    evals = list(source.eval_batches())
    assert [b.size for b in evals] == [16] * 18 + [12]
    np.testing.assert_array_equal(np.concatenate([b.ids for b in evals]), ids[900:])


# ---------------------------------------------------------------- the parallel, sharded layout


@pytest.mark.parametrize("hashing", [True, False])
def test_one_and_two_workers_write_the_same_bytes(tmp_path, tsv, hashing):
    """Output independent of the number of workers (and of how the input is cut in blocks),
    shuffled and sharded."""
    path, _ = tsv
    kw = {"max_ind_range": M if hashing else 0, "shuffle_seed": 3, "shard_mb": 0.03}
    preprocess([path], tmp_path / "one", workers=1, **kw)
    preprocess([path], tmp_path / "two", workers=2, block_mb=0.02, **kw)
    files = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file())
    assert len([f for f in files if f.name == "shard.json"]) > 2  # several shards per split
    assert files == sorted(p.relative_to(tmp_path / "two") for p in (tmp_path / "two").rglob("*") if p.is_file())
    for f in files:
        assert (tmp_path / "two" / f).read_bytes() == (tmp_path / "one" / f).read_bytes(), f


def test_global_shuffle_permutes_train_rows_and_keeps_val_in_order(tmp_path, tsv):
    path, _ = tsv
    preprocess([path], tmp_path / "plain", max_ind_range=M)
    preprocess([path], tmp_path / "shuffled", max_ind_range=M, shuffle_seed=0, shard_mb=0.03)
    plain, shuffled = load_split(tmp_path / "plain", "train"), load_split(tmp_path / "shuffled", "train")
    key = lambda a: np.lexsort(np.column_stack([a["ids"], a["dense"], a["labels"]]).T)
    for k in plain:  # the same rows, once each, in another order
        np.testing.assert_array_equal(plain[k][key(plain)], shuffled[k][key(shuffled)])
    assert not np.array_equal(plain["ids"], shuffled["ids"])
    for k, v in load_split(tmp_path / "plain", "val").items():
        np.testing.assert_array_equal(load_split(tmp_path / "shuffled", "val")[k], v)
    meta = json.loads((tmp_path / "shuffled" / "meta.json").read_text())
    assert meta["shuffled"] and sum(meta["shards"]["train"]) == meta["train_rows"] == 1080


def test_val_input_files_and_gz_days(tmp_path, tsv):
    """--val-input: whole files (plain or .gz) make the val split, MLPerf's day_23."""
    path, _ = tsv
    lines = path.read_bytes().splitlines(keepends=True)
    (tmp_path / "day_0").write_bytes(b"".join(lines[:500]))
    (tmp_path / "day_1.gz").write_bytes(gzip.compress(b"".join(lines[500:1000])))
    (tmp_path / "day_23.gz").write_bytes(gzip.compress(b"".join(lines[1000:])))
    report = preprocess(
        [tmp_path / "day_0", tmp_path / "day_1.gz"],
        tmp_path / "out",
        max_ind_range=M,
        val_inputs=[str(tmp_path / "day_23.gz")],
        val_fraction=0.0,
        workers=2,
    )
    assert (report.train_rows, report.val_rows) == (1000, N - 1000)
    preprocess([path], tmp_path / "ref", max_ind_range=M, val_fraction=(N - 1000) / N)
    for split in ("train", "val"):
        for k, v in load_split(tmp_path / "ref", split).items():
            np.testing.assert_array_equal(load_split(tmp_path / "out", split)[k], v)
    (tmp_path / "cut.gz").write_bytes(gzip.compress(b"".join(lines))[:-100])
    with pytest.raises(CriteoFormatError, match=f"{tmp_path / 'cut.gz'}: truncated or damaged gzip"):
        preprocess([tmp_path / "cut.gz"], tmp_path / "cut", max_ind_range=M)


def test_each_shard_checks_alone(tmp_path, tsv):
    from dlrm_jax.data.shards import BinaryFormatError, verify_shard

    preprocess([tsv[0]], tmp_path / "out", max_ind_range=M, shard_mb=0.03)
    shards = sorted((tmp_path / "out").glob("*/0*"))
    assert sum(verify_shard(s) for s in shards) == N
    ids = np.load(shards[1] / "ids.npy", mmap_mode="r+")
    ids[0, 0] += 1
    ids.flush()
    with pytest.raises(BinaryFormatError, match=f"{shards[1] / 'ids'}.npy: does not match"):
        verify_shard(shards[1])
    (shards[2] / "shard.json").unlink()
    with pytest.raises(BinaryFormatError, match="incomplete"):
        verify_shard(shards[2])


def test_skip_counts_and_first_error_hold_with_several_workers(tmp_path, tsv):
    path, _ = tsv
    lines = path.read_text().splitlines(keepends=True)
    for i, kind in enumerate(sorted(BAD_LINES) * 2):
        lines.insert(1 + i * 100, BAD_LINES[kind][0] + "\n")
    dirty = tmp_path / "dirty.tsv"
    dirty.write_text("".join(lines))
    one = preprocess([dirty], tmp_path / "one", skip_bad_lines=True, max_ind_range=M)
    two = preprocess([dirty], tmp_path / "two", skip_bad_lines=True, max_ind_range=M, workers=2, block_mb=0.01)
    assert (one.skipped_by_reason, one.skipped_examples) == (two.skipped_by_reason, two.skipped_examples)
    assert one.skipped == 12 and two.skipped_examples[1].startswith(f"{dirty}:102: ")
    with pytest.raises(CriteoFormatError, match=f"{dirty}:2: "):
        preprocess([dirty], tmp_path / "strict", max_ind_range=M, workers=2, block_mb=0.01)


@pytest.mark.parametrize("error", ["errno", "short write"])
def test_a_full_disk_is_one_line_naming_the_output(tmp_path, monkeypatch, error):
    """A full disk while preprocessing: one line naming the output and the space it takes,
    whether the OSError carries ENOSPC or is numpy's short write (no errno), and no output."""
    import errno
    import shutil

    from dlrm_jax.data.preprocessing import prep_driver

    src = tmp_path / "day.tsv"
    src.write_text("1\t" + "\t".join(["1"] * 12 + [""] + ["0a"] * 26) + "\n")

    def full(*_):
        if error == "errno":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise OSError("200000 requested and 20448 written")

    monkeypatch.setattr(prep_driver, "_write_dataset", full)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10, 10, 0))
    with pytest.raises(
        OSError, match=r"^" + str(tmp_path / "out") + ": no space left on device .*another output; nothing was written"
    ):
        preprocess_criteo([str(src)], tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "error,left_then,says",
    [
        ("200000 requested and 20448 written", 1000, "no space left on device"),
        ("200000 requested and 20448 written", 10**12, "a limit on file sizes"),
        ("Not enough free space to write 20800000 bytes after offset 128", 10**12, "no space left on device"),
    ],
)
def test_a_short_write_is_told_by_the_space_left_when_it_failed(tmp_path, monkeypatch, error, left_then, says):
    """Before: the space was measured once the work files were gone (20 MiB free of a 20 MiB
    tmpfs), so a full disk was called a file-size limit or a quota; and numpy's own check
    before a write ('Not enough free space', no errno) reached the user bare, naming no folder."""
    import shutil

    from dlrm_jax.data.preprocessing import prep_driver

    src = tmp_path / "day.tsv"
    src.write_text("1\t" + "\t".join(["1"] * 12 + [""] + ["0a"] * 26) + "\n")

    def short(*_):
        e = OSError(error)
        e.free_at_failure = left_then  # (as DatasetDir records it before removing its files)
        raise e

    monkeypatch.setattr(prep_driver, "_write_dataset", short)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10**12, 0, 10**12))
    with pytest.raises(OSError, match=rf"^{tmp_path / 'out'}: .*{says}"):
        preprocess_criteo([str(src)], tmp_path / "out")


def test_dynamic_features_carry_their_raw_values_beside_the_batch(tsv):
    """With dynamic tables a Criteo batch carries each dynamic feature's value whole (a
    RawBatch), the same lines as the batch without them; the other features are unchanged."""
    path, _ = tsv
    plain = CriteoTSVSource(criteo_config(path))
    dynamic = CriteoTSVSource(criteo_config(path, "embedding.table_ids=[cat_3=dynamic, cat_7=dynamic]"))
    values = parse_lines(path.read_bytes().splitlines(keepends=True)).values
    for step in (0, 5):
        a, b = plain.train_batch(step), dynamic.train_batch(step)
        assert type(a).__name__ == "Batch" and type(b).__name__ == "RawBatch"
        for x, y in zip(a, b[:3], strict=True):
            np.testing.assert_array_equal(x, y)
        raw = (b.raw[:, 0].astype(np.uint64) << np.uint64(32)) | b.raw[:, 1].astype(np.uint64)
        assert (
            raw.shape == (16, 2) and np.isin(raw[:, 0], values[:, 3]).all() and np.isin(raw[:, 1], values[:, 7]).all()
        )
        np.testing.assert_array_equal(raw % np.uint64(M), b.ids[:, [3, 7]].astype(np.uint64))


def test_windows_are_the_lines_in_the_order_written(tsv):
    path, _ = tsv
    windows = criteo_windows([str(path)], 256)
    assert len(windows) == N // 256 and all(len(w.labels) == 256 and w.p is None for w in windows)
    parsed = parse_lines(path.read_bytes().splitlines(keepends=True))
    np.testing.assert_array_equal(np.concatenate([w.ids for w in windows]), parsed.values[: len(windows) * 256])
    np.testing.assert_array_equal(np.concatenate([w.labels for w in windows]), parsed.labels[: len(windows) * 256])
    assert len(criteo_windows([str(path)], 256, 2)) == 2
    with pytest.raises(ValueError, match="fewer than one window"):
        criteo_windows([str(path)], 10 * N)


def test_a_drifting_sample_reads_back_as_its_stream_in_time_order(tmp_path):
    """`make_criteo_sample.py --drift-windows`: the drifting stream's windows as Criteo lines, in
    order (values its ids' low words, labels its labels, dense counts that log1p turns back into
    about x + 2), so later windows bring values the first never had."""
    path = tmp_path / "drift.tsv"
    script = REPO / "scripts" / "make_criteo_sample.py"
    args = ["--lines", "4096", "--drift-windows", "4", "--born-per-window", "300", "--missing-cat-rate", "0"]
    subprocess.run(
        [sys.executable, str(script), *args, "--seed", "3", "--output", str(path)],
        check=True, capture_output=True, timeout=120, env=child_env(),
    )  # fmt: skip
    windows = criteo_windows([str(path)], 1024)
    stream = DriftingStream(
        features=26, num_dense=13, windows=4, window_samples=1024, born_per_window=300, lifetime=4, seed=3
    )
    assert len(windows) == 4
    for t, w in enumerate(windows):
        truth = stream.window(t)
        np.testing.assert_array_equal(w.ids, scramble_id(truth.ids & np.uint64(0xFFFFFFFF)))
        np.testing.assert_array_equal(w.labels, truth.labels)
        above = truth.dense > 0  # where the count is large enough to keep x's digits
        np.testing.assert_allclose(w.dense[above], truth.dense[above] + 2, atol=0.15)
    new = ~np.isin(windows[3].ids, windows[0].ids)
    assert new.mean() > 0.8  # the cohorts of windows 1-3 carry most of window 3's lookups
