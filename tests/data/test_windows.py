"""Time order: a dataset preprocessed without shuffling records its train rows' windows (each
input file, such as a Criteo day, or spans of a tabular time column), and the binary source
turns them into the steps progressive validation scores (``train.progressive_window=data``)."""

import numpy as np
import pytest

from dlrm_jax.config import ConfigError, load_config
from dlrm_jax.data.preprocessing.criteo_preprocess import preprocess_criteo
from dlrm_jax.data.preprocessing.tabular import preprocess_tabular
from dlrm_jax.data.shards import load_split
from dlrm_jax.data.sources import resolve_data_config
from dlrm_jax.data.sources.binary import BinaryFormatError, BinarySource, read_meta
from dlrm_jax.data.sources.criteo import write_criteo_tsv
from dlrm_jax.data.sources.synthetic import SyntheticGenerator

DAYS = (300, 250, 200)  # train lines of each day file
B = 64


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    """Three Criteo day files and a validation day, preprocessed in order and shuffled."""
    tmp = tmp_path_factory.mktemp("days")
    gen = SyntheticGenerator(
        seed=3, num_dense=13, table_rows=(50, 500) * 13, bag_sizes=(1,) * 26, zipf_exponent=1.1, positive_rate=0.3
    )
    paths = []
    for d, lines in enumerate((*DAYS, 100)):
        paths.append(tmp / f"day_{d}.tsv")
        write_criteo_tsv(paths[-1], gen.raw(0, d, 0, lines), missing_cat_rate=0.05)
    kw = dict(val_inputs=[str(paths[-1])], max_ind_range=97, shard_mb=0.02, workers=2, progress=False)
    preprocess_criteo([str(p) for p in paths[:-1]], str(tmp / "ordered"), shuffle_seed=None, **kw)
    preprocess_criteo([str(p) for p in paths[:-1]], str(tmp / "shuffled"), **kw)
    return tmp


def cfg(path, *extra):
    return load_config(
        None,
        [
            "data.source=binary",
            f"data.path={path}",
            "data.max_rows=0",
            f"data.cardinalities={[97] * 26}",
            f"train.batch_size={B}",
            "data.shuffle=false",
            *extra,
        ],
    )


def test_each_input_file_is_a_window_of_the_unshuffled_train_rows(days):
    meta = read_meta(days / "ordered")
    assert meta["windows"] == {
        "by": "input",
        "starts": [0, 300, 550],
        "labels": ["day_0.tsv", "day_1.tsv", "day_2.tsv"],
    }
    assert "windows" not in read_meta(days / "shuffled")  # shuffled rows have no time order


def test_a_window_begins_at_the_first_batch_whose_first_row_is_in_it_and_comes_round_each_epoch(days):
    """Rows 0, 300 and 550 begin the days; batches of 64 rows: steps 0, 5 (row 320) and 9 (row
    576); 750 rows an epoch, so step 12 (row 768 = 18) begins day 0 again."""
    source = BinarySource(cfg(days / "ordered"))
    got = source.window_steps(15)
    assert got == [(0, "day_0.tsv"), (5, "day_1.tsv"), (9, "day_2.tsv"), (12, "day_0.tsv")]
    assert source.window_end(15) == 17  # (row 1,050 = 300 of the second epoch: day 1 again)
    train = load_split(days / "ordered", "train")
    for (step, _), start in zip(got[1:3], (300, 550), strict=True):  # the batches are those rows
        np.testing.assert_array_equal(source.train_batch(step).ids, train["ids"][step * B : (step + 1) * B])
        assert (step - 1) * B < start <= step * B


def test_windows_need_rows_in_order_and_say_so(days):
    with pytest.raises(BinaryFormatError, match=r"meta.json: records no windows .* --no-shuffle"):
        BinarySource(cfg(days / "shuffled")).window_steps(10)
    # Before: train found out after compiling its steps, leaving the run dir it had made.
    with pytest.raises(BinaryFormatError, match=r"meta.json: records no windows .* --no-shuffle"):
        resolve_data_config(cfg(days / "shuffled", "train.progressive_window=data", "data.shuffle=false"))
    with pytest.raises(ConfigError, match=r"train.progressive_window=data: .*\(data.shuffle=false\)"):
        cfg(days / "ordered", "train.progressive_window=data", "data.shuffle=true")
    with pytest.raises(ConfigError, match=r"data.source=binary"):
        load_config(None, ["train.progressive_window=data", "data.shuffle=false"])
    # Several processes read their slices of the same batches: the same windows.
    assert BinarySource(cfg(days / "ordered"), 1, 2).window_steps(15) == BinarySource(
        cfg(days / "ordered")
    ).window_steps(15)


def write_events(path, times, files):
    """CSV files of (y, a, t) rows, ``files`` rows each."""
    for k, at in enumerate(range(0, len(times), files)):
        rows = "".join(f"{k % 2},a{i % 7},{t}\n" for i, t in enumerate(times[at : at + files]))
        (path / f"e{k}.csv").write_text("y,a,t\n" + rows)
    return [str(path / f"e{k}.csv") for k in range(-(-len(times) // files))]


def test_window_seconds_cuts_the_time_column_into_spans(tmp_path):
    """--window-seconds 100 over times 0..599 in order (two files, the last 10% held out by
    time): windows of 100 seconds, each beginning at its first row; out of order, the file is
    named; shuffled rows or a format without times are refused."""
    (tmp_path / "s.yaml").write_text("label: y\ncategorical: [a]\nsplit_by: t\n")
    times = [i * 2 for i in range(300)]  # 0, 2, ..., 598
    inputs = write_events(tmp_path, times, 150)
    kw = dict(val_fraction=0.1, workers=2, progress=False, shuffle_seed=None, chunk_lines=40)
    preprocess_tabular(tmp_path / "s.yaml", inputs, str(tmp_path / "out"), window_seconds=100, **kw)
    windows = read_meta(tmp_path / "out")["windows"]
    assert windows == {
        "by": "seconds",
        "column": "t",
        "seconds": 100,
        "starts": [0, 50, 100, 150, 200, 250],
        "labels": [0, 100, 200, 300, 400, 500],
    }  # the last window ends at the val split: 270 train rows, t < 540
    back = write_events(tmp_path, [*times[:100], 5, *times[101:]], 150)
    with pytest.raises(ValueError, match=rf"{back[0]}: rows are not in t order \(within the file\)"):
        preprocess_tabular(tmp_path / "s.yaml", back, str(tmp_path / "bad"), window_seconds=100, **kw)
    swapped = write_events(tmp_path, [*times[150:], *times[:150]], 150)
    with pytest.raises(ValueError, match=rf"{swapped[1]}: rows are not in t order \(earlier than rows of"):
        preprocess_tabular(tmp_path / "s.yaml", swapped, str(tmp_path / "bad"), window_seconds=100, **kw)
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ValueError, match="--window-seconds 100: needs --no-shuffle"):
        preprocess_tabular(
            tmp_path / "s.yaml", inputs, str(tmp_path / "bad"), window_seconds=100, **kw | {"shuffle_seed": 0}
        )
    (tmp_path / "plain.yaml").write_text("label: y\ncategorical: [a]\n")
    with pytest.raises(ValueError, match=r"needs a time column \(a tabular schema's split_by\)"):
        preprocess_tabular(tmp_path / "plain.yaml", inputs, str(tmp_path / "bad"), window_seconds=100, **kw)


def test_a_time_windows_label_gives_its_start_in_full(tmp_path):
    """Unix seconds, as Taobao's and most logs' time columns are: each window named by its
    first second (they read ``t 1.494e+09`` alike, every one of them)."""
    (tmp_path / "s.yaml").write_text("label: y\ncategorical: [a]\nsplit_by: t\n")
    inputs = write_events(tmp_path, [1_494_000_000 + 2 * i for i in range(300)], 150)
    kw = dict(val_fraction=0.1, workers=1, progress=False, shuffle_seed=None)
    preprocess_tabular(tmp_path / "s.yaml", inputs, str(tmp_path / "out"), window_seconds=100, **kw)
    run = load_config(
        None, ["data.source=binary", f"data.path={tmp_path / 'out'}", "train.batch_size=10", "data.shuffle=false"]
    )
    labels = [label for _, label in BinarySource(resolve_data_config(run)).window_steps(27)]
    assert labels == [f"t {1_494_000_000 + 100 * w}" for w in range(6)]


def test_progressive_validation_scores_each_day_before_training_on_it(days, tmp_path):
    """``train.progressive_window=data`` over 15 steps of the three days: days 1 and 2 and the
    second epoch's day 0 are each scored, all their batches, before they are trained on: the
    last one whole (steps 12-16), though the run ends inside it."""
    import json

    from dlrm_jax.train.trainer import train_and_evaluate
    from tests.helpers import QUIET, TINY

    run = cfg(
        days / "ordered",
        *[o for o in TINY if not o.startswith(("data.cardinalities", "train.steps"))],
        "train.steps=15",
        "train.progressive_window=data",
    )
    train_and_evaluate(run, tmp_path / "run", **QUIET)
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    got = [
        (e["step"], e["window"], e["window_label"], e["progressive_samples"])
        for e in events
        if e["event"] == "progressive"
    ]
    assert got == [(5, 1, "day_1.tsv", 4 * B), (9, 2, "day_2.tsv", 3 * B), (12, 3, "day_0.tsv", 5 * B)]
