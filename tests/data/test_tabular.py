"""`preprocess tabular` on small synthetic files in the public layouts of the shipped schemas
(MovieLens 1M, Avazu, Taobao ad clicks, Yelp reviews): exact outputs, joins, bad lines, schema
errors, and training on the result."""

import csv
import gzip
import io
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import dlrm_jax
from dlrm_jax.config import load_config
from dlrm_jax.data.preprocessing.preprocess import DataFormatError
from dlrm_jax.data.preprocessing.tabular import preprocess_tabular
from dlrm_jax.data.preprocessing.tabular_columns import category_values
from dlrm_jax.data.preprocessing.tabular_schema import SchemaError, load_schema
from dlrm_jax.data.shards import load_split
from dlrm_jax.data.sources import resolve_data_config
from tests.child_env import child_env
from tests.data.public_layouts import AVAZU_HEADER, N, log1p32, make_avazu, make_movielens, make_taobao, make_yelp
from tests.helpers import examples

M = 61  # max_ind_range of the hashing runs


# ---------------------------------------------------------------- a reference, in plain Python


def splitmix64(h: int) -> int:
    mask = 2**64 - 1
    h ^= h >> 30
    h = (h * 0xBF58476D1CE4E5B9) & mask
    h ^= h >> 27
    h = (h * 0x94D049BB133111EB) & mask
    return h ^ (h >> 31)


def ref_hash(text: str) -> int:
    """category_values' definition: the UTF-8 bytes' length, then each little-endian 8-byte
    word (zero-padded), mixed in by splitmix64."""
    data = text.encode("utf-8", "surrogatepass")
    h = splitmix64(len(data) ^ 0x9E3779B97F4A7C15)
    for k in range(0, len(data), 8):
        h = splitmix64(h ^ int.from_bytes(data[k : k + 8].ljust(8, b"\0"), "little"))
    return h


def vocab_ids(texts, min_count=1, n_train=None):
    """Expected vocabulary ids of one feature's texts (None or '' = missing: id 0; rare or never
    counted: id 1, out of the vocabulary) and its ranking, counted on the first ``n_train``
    (the train split; None: all)."""
    counts = Counter(t for t in texts[:n_train] if t)
    ranked = sorted((t for t in counts if counts[t] >= min_count), key=lambda t: (-counts[t], ref_hash(t)))
    id_of = {t: i + 2 for i, t in enumerate(ranked)}
    return [id_of.get(t, 1) if t else 0 for t in texts], ranked


def expected_ids(cats, max_ind_range=0, min_count=1, n_train=None):
    """int [n, F] ids of the expected categorical texts (rows of lists), counted on the first
    ``n_train`` rows (None: all)."""
    cols = list(zip(*cats, strict=True))
    if max_ind_range:
        hashed = [[ref_hash(t) % max_ind_range if t else 0 for t in r] for r in cats]
        return np.array(compacted(hashed, n_train), np.int32)
    out = [vocab_ids(col, min_count, n_train)[0] for col in cols]
    return np.array(out, dtype=np.int32).T


def load_all(out):
    """Train then val rows concatenated: the valid rows in input order."""
    arrays = {s: load_split(out, s) for s in ("train", "val")}
    return {k: np.concatenate([arrays["train"][k], arrays["val"][k]]) for k in arrays["train"]}


def check_output(out, want, vocab_from="train", **ids_kw):
    """The dataset at ``out`` holds the expected rows (train then val in input order), ids
    counted on its train rows (the default) or on all."""
    got = load_all(out)
    n_train = len(load_split(out, "train")["labels"]) if vocab_from == "train" else None
    np.testing.assert_array_equal(got["labels"], np.array(want["labels"], np.float32))
    np.testing.assert_array_equal(got["dense"], np.array(want["dense"], np.float32).reshape(len(want["labels"]), -1))
    np.testing.assert_array_equal(got["ids"], expected_ids(want["cats"], n_train=n_train, **ids_kw))
    return got


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tabular")
    return {
        "movielens": (root / "ml", make_movielens(root / "ml")),
        "avazu": (root / "avazu.csv", make_avazu(root / "avazu.csv")),
        "taobao": (root / "tb", make_taobao(root / "tb")),
        "yelp": (root / "yelp.json", make_yelp(root / "yelp.json")),
    }


def run(dataset, files, out, where=None, **kw):
    """preprocess_tabular on one of the generated datasets (or a copy ``where``), as its
    schema's comment shows."""
    where = where or files[dataset][0]
    args = {
        "movielens": (
            "movielens_1m",
            [where / "ratings.dat"],
            {"users": where / "users.dat", "movies": where / "movies.dat"},
        ),
        "avazu": ("avazu", [where], {}),
        "taobao": (
            "taobao_ad",
            [where / "raw_sample.csv"],
            {"ad": where / "ad_feature.csv", "user": where / "user_profile.csv"},
        ),
        "yelp": ("yelp_reviews", [where], {}),
    }[dataset]
    schema, inputs, joins = kw.pop("schema", args[0]), kw.pop("inputs", args[1]), kw.pop("joins", args[2])
    kw = {"shuffle_seed": None, "workers": 1, **kw}  # input order, in this process
    return preprocess_tabular(
        schema, [str(p) for p in inputs], str(out), joins={k: str(v) for k, v in joins.items()}, progress=False, **kw
    )


def compacted(hashed_rows, n_train=None):
    """preprocess's hashing-mode ids: each column's hashed values numbered in ascending order;
    with ``n_train``, those of the first n_train rows (the train split), values seen only
    after them sharing one more row, the last."""
    h = np.asarray(hashed_rows, dtype=np.uint64).reshape(len(hashed_rows), -1)
    out = np.zeros(h.shape, np.int64)
    for f in range(h.shape[1]):
        col = h[:, f].tolist()
        kept = sorted(set(col[:n_train]))
        out[:, f] = [kept.index(v) if v in kept else len(kept) for v in col]
    return out.tolist()


# ---------------------------------------------------------------- exact outputs


def test_movielens_joins_vocabularies_and_split(files, tmp_path):
    folder, want = files["movielens"]
    report = run("movielens", files, tmp_path / "out", val_fraction=0.2)
    assert (report.train_rows, report.val_rows, report.skipped) == (240, 60, 0)
    got = check_output(tmp_path / "out", want)
    assert got["dense"].shape == (N, 0)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["num_dense"] == 0 and meta["categorical_features"][2:] == [
        "users.gender",
        "users.age",
        "users.occupation",
        "users.zip",
        "movies.genres",
    ]
    assert meta["join_misses"] == {"users": sum(c[2] is None for c in want["cats"]), "movies": 0}
    assert meta["join_misses"]["users"] > 0
    missed = meta["join_misses"]["users"]  # (said: before, only meta.json had it)
    assert f"warning: join users: {missed:,} of {N:,} rows found no row of " in report.summary()
    assert "join movies" not in report.summary() and "none matched" not in report.summary()
    # One row by hand: its user's and movie's attributes arrive through the joins.
    row = next(i for i, c in enumerate(want["cats"]) if c[1] == "7" and c[2] is not None)
    user, movie = want["cats"][row][0], "7"
    users = {ln.split("::")[0]: ln.split("::") for ln in (folder / "users.dat").read_text("latin-1").splitlines()}
    genres = (folder / "movies.dat").read_text("latin-1").splitlines()[6].split("::")[2]
    for f, text in ((2, users[user][1]), (5, users[user][4]), (6, genres)):
        vocab = np.load(tmp_path / "out" / "vocab" / f"feature_{f}.npy")
        assert vocab[got["ids"][row, f] - 2, 0] == ref_hash(text)  # ids 0 and 1: missing, out of the vocabulary
    assert report.cardinalities[6] == 2 + len({c[6] for c in want["cats"][:240]})  # train rows, plus missing and OOV
    assert vocab_ids([c[1] for c in want["cats"]], n_train=240)[0][row] == got["ids"][row, 1] and movie == "7"
    # Chunking changes nothing, byte for byte.
    run("movielens", files, tmp_path / "chunked", val_fraction=0.2, chunk_lines=7)
    for f in sorted((tmp_path / "out").rglob("*.npy")):
        assert (tmp_path / "chunked" / f.relative_to(tmp_path / "out")).read_bytes() == f.read_bytes(), f
    # Raw values (--raw-values): the same shards, and beside each id its value's hash (0: missing).
    run("movielens", files, tmp_path / "raw", val_fraction=0.2, raw_values=True)
    for f in sorted((tmp_path / "out").rglob("*.npy")):
        assert (tmp_path / "raw" / f.relative_to(tmp_path / "out")).read_bytes() == f.read_bytes(), f
    split = load_split(tmp_path / "raw", "train")
    for f in range(split["ids"].shape[1]):
        ids, raw = split["ids"][:, f], split["raw"][:, f]
        vocab = np.load(tmp_path / "raw" / "vocab" / f"feature_{f}.npy")[:, 0]
        assert (raw[ids == 0] == 0).all() and (raw[ids >= 2] == vocab[ids[ids >= 2] - 2]).all()
        assert (ids >= 2).any()


def make_ratings_by_user(folder: Path, users=60, seed=4):
    """MovieLens files whose ratings.dat is sorted by user, as the real one is, with times
    drawn at random (many equal); returns (user, time, rating) per line."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "users.dat").write_text("".join(f"{u}::F::25::7::{10000 + u}\n" for u in range(1, users + 1)))
    (folder / "movies.dat").write_text("".join(f"{m}::Movie {m} (2000)::Drama\n" for m in range(1, 21)))
    rows = [
        (u, 978300000 + int(rng.integers(0, 60)), int(rng.integers(1, 6)))
        for u in range(1, users + 1)
        for _ in range(int(rng.integers(2, 9)))
    ]
    (folder / "ratings.dat").write_text("".join(f"{u}::{1 + i % 20}::{r}::{t}\n" for i, (u, t, r) in enumerate(rows)))
    return rows


def test_movielens_holds_out_the_latest_ratings_by_time(tmp_path):
    """ratings.dat is sorted by user: split_by: timestamp holds out the latest ratings in time
    (ties: the later lines), so validation users were seen in training; the file's tail
    would hold out the last few users, never seen."""
    folder = tmp_path / "ml"
    rows = make_ratings_by_user(folder)
    n, n_val = len(rows), int(len(rows) * 0.2 + 0.5)
    latest = sorted(range(n), key=lambda i: (rows[i][1], i))[n - n_val :]  # (time, line)
    want_val = sorted(latest)
    want_train = sorted(set(range(n)) - set(latest))
    report = run("movielens", {}, tmp_path / "out", where=folder, val_fraction=0.2)
    assert (report.train_rows, report.val_rows) == (n - n_val, n_val)
    threshold = rows[latest[0]][1]
    assert f"by timestamp (from timestamp {threshold}; ties: later lines)" in report.summary()
    assert max(rows[i][1] for i in want_train) <= threshold <= min(rows[i][1] for i in want_val)
    assert any(rows[i][1] == threshold for i in want_train)  # the tie rule is exercised
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert (meta["split"], meta["split_by"], meta["split_threshold"]) == ("time", "timestamp", threshold)
    vocab = np.load(tmp_path / "out" / "vocab" / "feature_0.npy")[:, 0].tolist()
    for split, want in (("train", want_train), ("val", want_val)):
        got = load_split(tmp_path / "out", split)  # in input order (shuffle_seed None)
        assert got["labels"].tolist() == [float(rows[i][2] >= 4) for i in want]
        users = [vocab[k - 2] if k > 1 else None for k in got["ids"][:, 0].tolist()]
        assert users == [ref_hash(str(rows[i][0])) for i in want] or split == "val"
    train_users, val_users = {rows[i][0] for i in want_train}, [rows[i][0] for i in want_val]
    assert np.mean([u in train_users for u in val_users]) > 0.9
    # Cut in two files and small chunks, on two workers: the same bytes.
    lines = (folder / "ratings.dat").read_text().splitlines(keepends=True)
    (folder / "a.dat").write_text("".join(lines[:100]))
    (folder / "b.dat").write_text("".join(lines[100:]))
    run(
        "movielens",
        {},
        tmp_path / "cut",
        where=folder,
        inputs=[folder / "a.dat", folder / "b.dat"],
        val_fraction=0.2,
        chunk_lines=9,
        workers=2,
    )
    assert dataset_bytes(tmp_path / "cut") == dataset_bytes(tmp_path / "out")
    # Without split_by the tail is held out: mostly users the training split never saw.
    schema = tmp_path / "tail.yaml"
    schema.write_text(Path(load_schema("movielens_1m").path).read_text().replace("\nsplit_by:", "\n# split_by:"))
    run("movielens", {}, tmp_path / "tail", where=folder, schema=schema, val_fraction=0.2)
    tail_train_users = {u for u, _, _ in rows[: n - n_val]}
    assert np.mean([u in tail_train_users for u, _, _ in rows[n - n_val :]]) < 0.2
    assert json.loads((tmp_path / "tail" / "meta.json").read_text())["split"] == "tail"


def test_taobao_dense_price_null_brand_and_missing_profiles(files, tmp_path):
    _, want = files["taobao"]
    report = run("taobao", files, tmp_path / "out", min_count=2)
    assert (report.train_rows, report.val_rows) == (270, 30)
    got = check_output(tmp_path / "out", want, min_count=2)
    assert got["dense"].shape == (N, 1)
    no_ad = [i for i, c in enumerate(want["cats"]) if c[1] == "99"]
    assert no_ad and (got["ids"][no_ad, 3:7] == 0).all() and (got["dense"][no_ad] == 0).all()
    null_brand = [i for i, c in enumerate(want["cats"]) if c[1] != "99" and int(c[1]) % 5 == 0]
    assert null_brand and (got["ids"][null_brand, 6] == 0).all()
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["join_misses"] == {"ad": len(no_ad), "user": sum(c[7] is None for c in want["cats"])}
    assert meta["categorical_features"][-1] == "user.new_user_class_level"  # header name had a trailing space


def test_yelp_json_lines_label_above_four_stars(files, tmp_path):
    _, want = files["yelp"]
    run("yelp", files, tmp_path / "out", max_ind_range=M, val_fraction=0.25)
    got = check_output(tmp_path / "out", want, max_ind_range=M)
    assert got["dense"].shape == (N, 3) and 0 < got["labels"].mean() < 1
    assert len(load_split(tmp_path / "out", "val")["labels"]) == 75
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    hashed = [[ref_hash(t) % M if t else 0 for t in c] for c in want["cats"]]
    assert meta["cardinalities"] == [1 + max(col) for col in zip(*compacted(hashed, N - 75), strict=True)]
    first_val = json.loads(files["yelp"][0].read_text().splitlines()[N - 75])["date"]  # "YYYY-MM-DD HH:MM:SS"
    since_1970 = (np.datetime64(first_val.replace(" ", "T")) - np.datetime64("1970-01-01T00:00:00")) // np.timedelta64(
        1, "s"
    )
    assert (meta["split"], meta["split_by"], meta["split_threshold"]) == ("time", "date", since_1970)
    # A UTF-8 byte-order mark before the first line (no header to strip it with): not part of
    # its first value (before: a line that was not JSON; in CSV, a category of its own).
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + files["yelp"][0].read_bytes())
    run("yelp", files, tmp_path / "bom", where=bom, max_ind_range=M, val_fraction=0.25)
    for split in ("train", "val"):
        for k, v in load_split(tmp_path / "out", split).items():
            np.testing.assert_array_equal(load_split(tmp_path / "bom", split)[k], v)


@pytest.mark.slow
def test_avazu_gzipped_through_the_cli(files, tmp_path):
    path, want = files["avazu"]
    gz = tmp_path / "train.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dlrm_jax",
            "preprocess",
            "tabular",
            "--schema",
            "avazu",
            "--input",
            str(gz),
            "--output",
            str(tmp_path / "out"),
            "--max-ind-range",
            str(M),
            "--no-progress",
            "--no-shuffle",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(drop=()),
    )
    assert proc.returncode == 0, proc.stderr
    assert f"{tmp_path / 'out'}: 270 train + 30 val rows from 300 lines, 0 skipped" in proc.stdout
    assert (
        "ids counted on train rows (values seen only in val rows: out of the vocabulary)" in proc.stdout
    )  # the default
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["vocab_from"] == "train"
    got = check_output(tmp_path / "out", want, max_ind_range=M)
    assert got["ids"].shape == (N, 22) and (got["ids"] < M).all()
    hours = [c[0] for c in want["cats"]]
    assert got["ids"][:, 0].tolist() == [r[0] for r in compacted([[ref_hash(h) % M] for h in hours], 270)]
    assert len(set(hours)) == 24
    # A malformed line: one line naming file and line, exit 1, nothing written.
    bad, lines = tmp_path / "bad.csv", path.read_text().splitlines(keepends=True)
    bad.write_text("".join(lines[:5] + ["1,2,3\n"] + lines[5:]))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dlrm_jax",
            "preprocess",
            "tabular",
            "--schema",
            "avazu",
            "--input",
            str(bad),
            "--output",
            str(tmp_path / "bad_out"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(drop=()),
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"dlrm-jax: error: {bad}:6: expected 24 fields separated by ',', found 3"
    assert not (tmp_path / "bad_out").exists()


# ---------------------------------------------------------------- bad lines


BAD = {  # name -> (dataset, file, line, text, kind, message)
    "ml fields": (
        "movielens",
        "ratings.dat",
        7,
        "1::2::3",
        "field count",
        "expected 4 fields separated by '::', found 3",
    ),
    "ml label": (
        "movielens",
        "ratings.dat",
        9,
        "1::2::x::978300760",
        "label",
        "label column rating is 'x', expected a number (label = value >= 4)",
    ),
    "ml empty": ("movielens", "ratings.dat", 2, "", "empty line", "empty line"),
    "ml time": (
        "movielens",
        "ratings.dat",
        5,
        "1::2::3::yesterday",
        "split_by",
        "split_by column timestamp is 'yesterday', expected a number or a date (YYYY-MM-DD[ HH:MM:SS])",
    ),
    "avazu click": (
        "avazu",
        "",
        4,
        "1," + "2," + ",".join(["9"] * 22),
        "label",
        "label column click is '2', expected 0 or 1",
    ),
    "avazu quote": (
        "avazu",
        "",
        3,
        '1,0,14102100,"1005,7"' + ",x" * 19,
        "field count",  # quoted: one field
        "expected 24 fields separated by ',', found 23",
    ),
    "avazu open quote": (  # one stray quote: that line is bad, never the rest of the file
        "avazu",
        "",
        3,
        '1,0,14102100,"1005' + ",x" * 21,
        "csv",
        "a quoted field is still open after 64 lines",
    ),
    "avazu open quote at the end": (
        "avazu",
        "",
        N + 2,
        '1,0,14102100,"1005' + ",x" * 21,
        "csv",
        "not valid CSV: unexpected end of data",
    ),
    "taobao price": (
        "taobao",
        "ad_feature.csv",
        5,
        "77,1,100,1000,5000,abc",
        "dense field",
        "dense column ad.price is 'abc', expected a finite number",
    ),
    "taobao duplicate": (
        "taobao",
        "user_profile.csv",
        10,
        "3,1,1,1,1,1,1,1,1",
        "join key",
        "join key '3' repeats line 4",
    ),
    "yelp json": (
        "yelp",
        "",
        5,
        '{"review_id": "x",',
        "json",
        "not valid JSON: Expecting property name enclosed in double quotes (column 19)",
    ),
    "yelp key": (
        "yelp",
        "",
        6,
        '{"user_id": "u", "business_id": "b", "useful": 1, "funny": 0, "cool": 0, "date": "2012"}',
        "missing column",
        "no 'stars' in the JSON object",
    ),
    "yelp nan": (
        "yelp",
        "",
        3,
        '{"user_id": "u", "business_id": "b", "stars": 5, "useful": NaN, "funny": 0, "cool": 0, "date": "2012"}',
        "dense field",
        "dense column useful is 'nan', expected a finite number",
    ),
    "yelp bytes": ("yelp", "", 8, '{"user_id": "\xff"}', "encoding", "not valid utf-8 text"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_line_names_file_and_line_or_is_skipped(files, tmp_path, case):
    dataset, name, line, text, kind, message = BAD[case]
    src = files[dataset][0]
    copy = tmp_path / "data"
    if src.is_dir():
        copy.mkdir()
        for f in src.iterdir():
            (copy / f.name).write_bytes(f.read_bytes())
        target = copy / name
    else:
        copy.write_bytes(src.read_bytes())
        target = copy
    lines = target.read_bytes().splitlines(keepends=True)
    lines.insert(line - 1, text.encode("latin-1" if "bytes" in case else "utf-8") + b"\n")
    target.write_bytes(b"".join(lines))
    with pytest.raises(DataFormatError) as e:
        run(dataset, files, tmp_path / "out", where=copy)
    assert str(e.value) == f"{target}:{line}: {message}"
    assert not (tmp_path / "out").exists()
    report = run(dataset, files, tmp_path / "out", where=copy, skip_bad_lines=True)
    assert report.skipped_by_reason == {kind: 1} and report.skipped_examples == (f"{target}:{line}: {message}",)
    assert report.train_rows + report.val_rows == N
    run(dataset, files, tmp_path / "clean")
    for k, v in load_all(tmp_path / "clean").items():  # the skipped line changed nothing else
        np.testing.assert_array_equal(load_all(tmp_path / "out")[k], v)


def test_stray_quotes_cost_their_own_lines_and_quoted_newlines_are_kept(tmp_path):
    """A quote opened on one line and closed by another stray one lines later: two bad lines,
    every line between them read; a quoted field that holds a newline is one record."""
    (tmp_path / "s.yaml").write_text("label: y\ncategorical: [a, b]\n")
    lines = [f"{i % 2},a{i},b{i % 3}\n" for i in range(40)]
    lines[5] = '1,"stray,x\n'
    lines[9] = 'x",0,y\n'
    lines[20] = '0,"two\nlines",b0\n'
    (tmp_path / "t.csv").write_text("y,a,b\n" + "".join(lines))
    kw = dict(max_ind_range=M, val_fraction=0.0, progress=False, shuffle_seed=None, workers=1)
    with pytest.raises(DataFormatError, match=re.escape(f"{tmp_path / 't.csv'}:7: a quoted field runs over 5 lines")):
        preprocess_tabular(tmp_path / "s.yaml", [str(tmp_path / "t.csv")], str(tmp_path / "out"), **kw)
    report = preprocess_tabular(
        tmp_path / "s.yaml", [str(tmp_path / "t.csv")], str(tmp_path / "out"), skip_bad_lines=True, **kw
    )
    assert report.skipped_by_reason == {"csv": 1, "label": 1}  # line 11 alone: its label is x"
    assert report.train_rows == 38
    texts = [["two\nlines", "b0"] if i == 20 else [f"a{i}", f"b{i % 3}"] for i in range(40) if i not in (5, 9)]
    assert load_all(tmp_path / "out")["ids"].tolist() == compacted([[ref_hash(t) % M for t in r] for r in texts])


def test_columns_by_position_without_header_tab_separated(tmp_path):
    """Label, dense and categorical columns given by 0-based position; transform none; op <."""
    (tmp_path / "s.yaml").write_text(
        'format: csv\ndelimiter: "\\t"\nheader: false\nquoting: false\n'
        'label: {column: 3, op: "<", threshold: 0.5}\n'
        "dense: [{column: 1, transform: none}, 0]\ncategorical: [2, {column: 2, substr: [0, 1]}]\n"
    )
    rows = [("7", "-2.5", '"ab', "0.25"), ("", "1e39", "x", "1"), ("-3", "", "", "0.75"), ("12", "3", "ab", "0.5")]
    (tmp_path / "t.tsv").write_text("".join("\t".join(r) + "\n" for r in rows))
    report = preprocess_tabular(
        tmp_path / "s.yaml",
        [str(tmp_path / "t.tsv")],
        str(tmp_path / "out"),
        max_ind_range=M,
        val_fraction=0.0,
        skip_bad_lines=True,
        progress=False,
        shuffle_seed=None,
        workers=1,
    )
    assert report.skipped_examples == (f"{tmp_path / 't.tsv'}:2: dense column 1 is '1e39', expected a finite number",)
    got = load_all(tmp_path / "out")
    assert got["labels"].tolist() == [1.0, 0.0, 0.0]
    np.testing.assert_array_equal(got["dense"], np.array([[-2.5, log1p32(7)], [0, 0], [3, log1p32(12)]], np.float32))
    texts = [['"ab', '"'], [None, None], ["ab", "a"]]  # quoting: false keeps the quote character
    assert got["ids"].tolist() == compacted([[ref_hash(t) % M if t else 0 for t in r] for r in texts])


# ---------------------------------------------------------------- schema errors


SCHEMA_ERRORS = {  # name -> (edit of movielens_1m.yaml, key and words the message must name)
    "unknown side column": (("users.zip", "users.zipcode"), "categorical[5]: unknown column 'zipcode' of join 'users'"),
    "unknown main column": (
        ("  - movie_id\n", "  - film\n"),
        "categorical[1]: unknown column 'film' of the input file",
    ),
    "label op": (('op: ">="', 'op: "=>"'), "label.op: '=>' is not one of"),
    "threshold": ((", threshold: 4", ""), "label: give both op and threshold"),
    "bare on": (("{column: user_id,", "{on: user_id,"), "joins.users.True: unknown key (YAML reads a bare on/off"),
    "typo key": (("header: false", "headers: false"), "headers: unknown key; known: format"),
    "multi-char quoting": (("header: false", "header: false\nquoting: true"), "quoting: quoting needs a one-character"),
    "encoding": (("latin-1", "latin-9000"), "encoding: unknown text encoding 'latin-9000'"),
    # (its files are split into lines at the byte \n before decoding: before, "not valid utf-16" of valid ones)
    "utf-16": (("latin-1", "utf-16"), "encoding: 'utf-16': its line break is not the byte \\n"),
    "split_by": (("\nsplit_by: timestamp", "\nsplit_by: stamp"), "split_by: unknown column 'stamp' of the input file"),
}


@pytest.mark.parametrize("case", sorted(SCHEMA_ERRORS))
def test_schema_errors_name_the_file_and_key(tmp_path, case):
    (old, new), words = SCHEMA_ERRORS[case]
    text = load_schema("movielens_1m").path
    text = Path(text).read_text()
    assert old in text
    path = tmp_path / "s.yaml"
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(SchemaError) as e:
        load_schema(path)
    assert str(e.value).startswith(f"{path}: ") and words in str(e.value), str(e.value)


SMALL_SCHEMAS = {  # a whole schema -> key and words the message must name
    "label: y\ncategorical: []\n": "categorical: at least one categorical column is needed",
    "label: y\ncategorical: [a, {column: b, name: a}]\n": "dense/categorical: feature name 'a' is used twice",
    "format: json_lines\nlabel: 0\ncategorical: [a]\n": "label: the input file is JSON lines: name its columns",
    "header: false\nlabel: y\ncategorical: [a]\n": "label: column 'y': the input file has no header",
    "label: {column: y, op: '>', threshold: high}\ncategorical: [a]\n": "label.threshold: expected a number",
    "label: y\ncategorical: [{column: a, substr: [2]}]\n": "categorical[0].substr: expected [start, stop]",
    "label: y\ndense: [{column: a, transform: log}]\ncategorical: [b]\n": "dense[0].transform: 'log' is not one of",
    "label: y\ncategorical: [u.a]\njoins: {u: {column: k, header: false}}\n": "joins.u.key: column 'k': join 'u' has no header",
    "label: y\n": "categorical: required",
    "header: auto\nlabel: y\ncategorical: [a]\n": "header: auto needs columns:",
    "header: maybe\ncolumns: [y, a]\nlabel: y\ncategorical: [a]\n": "header: expected true, false or auto, got 'maybe'",
    "": "expected a mapping, got None",
    "label: y\ncategorical: [a]\nna_values: [NULL]\n": "na_values: expected a list of strings, got [None]; quote them",
}


@pytest.mark.parametrize("text", sorted(SMALL_SCHEMAS))
def test_small_schema_errors(tmp_path, text):
    (tmp_path / "s.yaml").write_text(text)
    with pytest.raises(SchemaError) as e:
        load_schema(tmp_path / "s.yaml")
    assert str(e.value).startswith(f"{tmp_path / 's.yaml'}: {SMALL_SCHEMAS[text]}"), str(e.value)


def test_header_without_a_schema_column_and_missing_joins(files, tmp_path):
    schema = tmp_path / "t.yaml"
    schema.write_text(Path(load_schema("taobao_ad").path).read_text().replace("  - pid\n", "  - pidx\n"))
    sample = files["taobao"][0] / "raw_sample.csv"
    header = (
        rf"^{re.escape(str(sample))}:1: column 'pidx' \(named in the schema\) is not in the header: user, time_stamp,"
    )
    with pytest.raises(DataFormatError, match=header):
        run("taobao", files, tmp_path / "out", schema=schema)
    schema.write_text(Path(load_schema("avazu").path).read_text().replace("  - C21", "  - C22"))
    with pytest.raises(
        SchemaError, match=r"categorical\[21\]: unknown column 'C22' of the input file; its columns: id,"
    ):
        load_schema(schema)  # avazu lists its columns: caught before any file is read
    with pytest.raises(SchemaError, match=r"joins: the schema joins \['ad', 'user'\]; .* got \['ad'\]"):
        run("taobao", files, tmp_path / "out", joins={"ad": files["taobao"][0] / "ad_feature.csv"})
    with pytest.raises(
        SchemaError, match="no such file .*shipped schemas: avazu, movielens_1m, taobao_ad, yelp_reviews"
    ):
        load_schema("criteo_tabular")
    assert not (tmp_path / "out").exists()


def dataset_bytes(out):
    """Every file of a dataset, and meta.json without the input files it records (their paths,
    and the windows they make of rows kept in order)."""
    got = {str(f.relative_to(out)): f.read_bytes() for f in sorted(out.rglob("*")) if f.is_file()}
    meta = json.loads(got.pop("meta.json"))
    return got, {k: v for k, v in meta.items() if k not in ("inputs", "val_inputs", "windows")}


def test_header_auto_reads_files_with_and_without_a_header(files, tmp_path):
    """Avazu's schema lists its columns with header: auto: a header-less piece and a headered
    one give the same bytes as two headered pieces (or the whole file)."""
    lines = files["avazu"][0].read_text().splitlines(keepends=True)
    head, rows = lines[0], lines[1:]
    pieces = {
        "a.csv": head + "".join(rows[:140]),
        "b.csv": head + "".join(rows[140:]),
        "b_bare.csv": "".join(rows[140:]),
        "a_bare.csv": "".join(rows[:140]),
    }
    for name, text in pieces.items():
        (tmp_path / name).write_text(text)
    kw = {"max_ind_range": M, "shuffle_seed": 5}
    run("avazu", files, tmp_path / "both", inputs=[tmp_path / "a.csv", tmp_path / "b.csv"], **kw)
    want = dataset_bytes(tmp_path / "both")
    for inputs in (["a.csv", "b_bare.csv"], ["a_bare.csv", "b.csv"], ["a_bare.csv", "b_bare.csv"]):
        out = tmp_path / "_".join(inputs)
        report = run("avazu", files, out, inputs=[tmp_path / i for i in inputs], **kw)
        assert report.lines_read == N and dataset_bytes(out) == want, inputs
    run("avazu", files, tmp_path / "whole", **kw)
    assert dataset_bytes(tmp_path / "whole") == want


def test_a_header_that_differs_from_the_schema_columns_names_the_file(files, tmp_path):
    lines = files["avazu"][0].read_text().splitlines(keepends=True)
    columns = AVAZU_HEADER.split(",")
    cases = {  # header line -> what the error says is wrong
        ",".join(c for c in columns if c != "click"): "missing click",  # Avazu's test.gz
        ",".join([columns[0], columns[2], columns[1], *columns[3:]]): "column 1 is hour, expected click",
        AVAZU_HEADER.replace("C21", "C22"): "missing C21; unexpected C22",
    }
    for k, (header, what) in enumerate(cases.items()):
        path = tmp_path / f"h{k}.csv"
        path.write_text(header + "\n" + "".join(lines[1:]))
        with pytest.raises(DataFormatError) as e:
            run("avazu", files, tmp_path / "out", inputs=[files["avazu"][0], path])
        assert (
            str(e.value)
            == f"{path}:1: the header does not match the schema's columns ({what}); expected: {', '.join(columns)}"
        )
        assert not (tmp_path / "out").exists()


def test_ids_counted_on_train_rows_val_only_values_are_out_of_the_vocabulary(tmp_path):
    """--vocab-from train (the default): a value seen only in val rows is out of the
    vocabulary: id 1 (with the rare values; id 0 is the missing values'), hashing: a last row of
    its own; meta.json and the summary say which rows were counted; the bytes do not depend on
    workers or chunks."""
    (tmp_path / "s.yaml").write_text("label: y\ncategorical: [a, b]\nsplit_by: t\n")
    times = [(i * 37) % 60 for i in range(60)]  # the latest 12 (t >= 48) are spread over both files
    rows = [(i % 2, "new" if t >= 48 else f"a{i % 5}", f"b{i % 3}") for i, t in enumerate(times)]
    for name, part in (("one.csv", slice(0, 30)), ("two.csv", slice(30, 60))):
        text = "y,a,b,t\n" + "".join(f"{y},{a},{b},{t}\n" for (y, a, b), t in zip(rows[part], times[part], strict=True))
        (tmp_path / name).write_text(text)
    inputs = [str(tmp_path / "one.csv"), str(tmp_path / "two.csv")]

    def prep(out, **kw):
        kw = {"val_fraction": 0.2, "shuffle_seed": 1, "progress": False, "workers": 1, **kw}
        return preprocess_tabular(tmp_path / "s.yaml", inputs, str(tmp_path / out), **kw)

    for hashing in (0, M):
        report = prep(f"train{hashing}", max_ind_range=hashing)
        assert "ids counted on train rows (values seen only in val rows: out of the vocabulary)" in report.summary()
        meta = json.loads((tmp_path / f"train{hashing}" / "meta.json").read_text())
        assert meta["vocab_from"] == "train" and meta["split"] == "time"
        val, train = (load_split(tmp_path / f"train{hashing}", s)["ids"] for s in ("val", "train"))
        a_rows = len({ref_hash(f"a{k}") % M for k in range(5)}) if hashing else 5
        oov = a_rows if hashing else 1  # hashing: the row after the counted ones; vocabularies: id 1
        assert len(val) == 12 and (val[:, 0] == oov).all() and (train[:, 0] != oov).all()
        vocab = np.load(tmp_path / f"train{hashing}" / "vocab" / "feature_0.npy")[:, 0].tolist()
        assert ref_hash("new") not in vocab and ref_hash("new") % M not in vocab
        assert meta["cardinalities"][0] == a_rows + (1 if hashing else 2)  # + the unseen values' row (and missing)
        hist = np.load(tmp_path / f"train{hashing}" / "train" / "id_counts.npz")  # hot rows' hint: train rows
        counted = hist["counts_0"] > 0
        assert [hist["ids_0"][counted].tolist(), hist["counts_0"][counted].tolist()] == [
            a.tolist() for a in np.unique(train[:, 0], return_counts=True)
        ]
        assert vocab[-1] == 0 or not hashing  # hashing: the last row, added for "new", maps to no value
        # all rows counted: "new" has a row of its own
        prep(f"all{hashing}", max_ind_range=hashing, vocab_from="all")
        meta = json.loads((tmp_path / f"all{hashing}" / "meta.json").read_text())
        assert meta["vocab_from"] == "all" and meta["cardinalities"][0] == a_rows + 1 + 2 * (not hashing)
        val, train = (load_split(tmp_path / f"all{hashing}", s)["ids"][:, 0].tolist() for s in ("val", "train"))
        assert len(set(val)) == 1 and val[0] not in train and (val[0] > 0 or hashing)
        # two workers, small chunks: the same bytes
        prep(f"two{hashing}", max_ind_range=hashing, workers=2, chunk_lines=4)
        assert dataset_bytes(tmp_path / f"two{hashing}") == dataset_bytes(tmp_path / f"train{hashing}")
    with pytest.raises(ValueError, match="vocab_from 'train' or 'all'"):
        prep("bad", vocab_from="val")


# ---------------------------------------------------------------- properties


@settings(max_examples=examples(30))
@given(st.lists(st.text(max_size=30), max_size=30))
@example(["a\x00b", "", "\x00", "ünï😀", "12345678", "123456789"])  # NULs take the slow path
def test_category_values_match_the_plain_python_hash(texts):
    assert category_values(texts).tolist() == [ref_hash(t) for t in texts]


CELLS = st.sampled_from(["", "a", "b", "a,b", 'say "hi"', "x\ny", "ü", "NULL", " a", "1", "01"])


@settings(max_examples=examples(20))
@given(
    rows=st.lists(st.tuples(st.sampled_from(["0", "1"]), CELLS, CELLS), min_size=1, max_size=40),
    min_count=st.integers(1, 3),
    chunk=st.integers(1, 50),
)
def test_hashing_and_vocabulary_ids_are_consistent_with_the_texts(rows, min_count, chunk):
    schema = "label: y\ncategorical: [p, q]\nna_values: ['NULL']\n"
    with tempfile.TemporaryDirectory() as tmp:
        path, text = Path(tmp) / "t.csv", io.StringIO()
        csv.writer(text).writerows([("y", "p", "q"), *rows])
        path.write_text(text.getvalue())
        (Path(tmp) / "s.yaml").write_text(schema)
        kw = {"val_fraction": 0.0, "chunk_lines": chunk, "shuffle_seed": None, "workers": 1}
        preprocess_tabular(
            Path(tmp) / "s.yaml", [str(path)], str(Path(tmp) / "h"), max_ind_range=M, progress=False, **kw
        )
        report = preprocess_tabular(
            Path(tmp) / "s.yaml", [str(path)], str(Path(tmp) / "v"), min_count=min_count, progress=False, **kw
        )
        hashed, vocab = load_all(Path(tmp) / "h")["ids"], load_all(Path(tmp) / "v")["ids"]
    texts = [[None if t in ("", "NULL") else t for t in r[1:]] for r in rows]
    assert hashed.tolist() == compacted([[ref_hash(t) % M if t else 0 for t in r] for r in texts])
    assert ((0 <= hashed) & (hashed < M)).all()
    for f in range(2):
        col = [r[f] for r in texts]
        ids, ranked = vocab_ids(col, min_count)
        assert vocab[:, f].tolist() == ids and report.cardinalities[f] == 2 + len(ranked)
        kept = {t: i for t, i in zip(col, ids, strict=True) if i > 1}  # 0 missing, 1 out of the vocabulary
        assert len(set(kept.values())) == len(kept)  # distinct kept texts, distinct ids


# ---------------------------------------------------------------- training on the output


@pytest.mark.parametrize("dataset", ["movielens", "yelp"])  # 0 dense + 7 tables; 3 dense + 4 tables
def test_training_on_a_tabular_dataset(files, tmp_path, dataset, tiny):
    run(dataset, files, tmp_path / "data", val_fraction=0.2)
    cfg = tiny(
        "data.source=binary",
        f"data.path={tmp_path / 'data'}",
        "train.steps=3",
        "train.eval_batches=0",
        "mesh.devices=2",
        "train.batch_size=32",
    )
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    resolved = resolve_data_config(cfg)  # the model takes its widths from the data
    assert list(resolved.data.cardinalities) == meta["cardinalities"]
    assert meta["num_dense"] == {"movielens": 0, "yelp": 3}[dataset]
    assert resolved.data.num_dense == max(meta["num_dense"], 1)  # none at all: one zero column
    # MovieLens also saves a checkpoint (its dense part sees only that zero column).
    run_dir = tmp_path / "run" if dataset == "movielens" else None
    summary = dlrm_jax.train_and_evaluate(cfg, run_dir, log=lambda *_: None)
    assert summary.step == 3 and np.isfinite(summary.loss) and 0.0 <= summary.auc <= 1.0
    if run_dir:
        assert load_config(run_dir / "config.yaml").data.num_dense == 1


@pytest.mark.parametrize(
    "column,text,words",
    [
        ("y", "0_1", "label column y is '0_1', expected 0 or 1"),
        ("y", "\u0661", "label column y is '\u0661', expected 0 or 1"),
        ("t", "now", "split_by column t is 'now', expected a number or a date"),
        ("t", "Today", "split_by column t is 'Today', expected a number or a date"),
    ],
)
def test_numbers_and_dates_are_read_as_written_not_as_python_would(tmp_path, column, text, words):
    """Before: Python's float() read the label '0_1' and the Arabic digit one as 1, and numpy
    read a split_by of 'now' or 'today' as this moment (that row went to the held-out split)."""
    (tmp_path / "s.yaml").write_text("label: y\ncategorical: [a]\nsplit_by: t\n")
    rows = [{"y": str(i % 2), "a": f"a{i % 3}", "t": str(i)} for i in range(20)]
    rows[7][column] = text
    (tmp_path / "in.csv").write_text("y,a,t\n" + "".join(f"{r['y']},{r['a']},{r['t']}\n" for r in rows))
    with pytest.raises(DataFormatError, match=re.escape(f"in.csv:9: {words}")):
        preprocess_tabular(tmp_path / "s.yaml", [str(tmp_path / "in.csv")], str(tmp_path / "out"), progress=False)
