"""`BinarySource` on a small preprocessed synthetic dataset: determinism, process slices,
epochs, evaluation, the max_rows cap, error messages, and agreement with `CriteoTSVSource`."""

import json
import shutil

import numpy as np
import pytest

from dlrm_jax.config import load_config
from dlrm_jax.data.binary import BinaryFormatError, BinarySource, read_meta
from dlrm_jax.data.criteo import CriteoTSVSource, preprocess_criteo, write_criteo_tsv
from dlrm_jax.data.synthetic import SyntheticGenerator

M, N, B = 97, 1000, 64  # hashing range, lines, global batch
N_TRAIN, N_VAL = 800, 200  # val_fraction 0.2; 800 = 12.5 batches, so batches straddle epochs


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(tsv path, dataset path, {split: {name: array}}) of N synthetic lines."""
    tmp = tmp_path_factory.mktemp("binary")
    gen = SyntheticGenerator(seed=5, num_dense=13, table_rows=(50, 500) * 13,
                             bag_sizes=(1,) * 26, zipf_exponent=1.1, positive_rate=0.3)  # fmt: skip
    write_criteo_tsv(tmp / "day.tsv", gen.raw(0, 0, 0, N), missing_cat_rate=0.05)
    preprocess_criteo([str(tmp / "day.tsv")], str(tmp / "ds"), max_ind_range=M,
                      val_fraction=0.2, progress=False)  # fmt: skip
    arrays = {s: {k: np.load(tmp / "ds" / s / f"{k}.npy") for k in ("dense", "ids", "labels")}
              for s in ("train", "val")}  # fmt: skip
    return tmp / "day.tsv", tmp / "ds", arrays


def make_cfg(path, *extra, source="binary"):
    return load_config(None, [f"data.source={source}", f"data.path={path}", "data.max_rows=0",
                              f"data.cardinalities={[M] * 26}", f"train.batch_size={B}",
                              "train.eval_batches=0", "data.val_fraction=0.2", *extra])  # fmt: skip


def assert_batches_equal(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def concat(batches):
    return [np.concatenate(parts) for parts in zip(*batches, strict=True)]


def test_read_meta(data):
    meta = read_meta(data[1])
    assert meta["train_rows"] == N_TRAIN and meta["val_rows"] == N_VAL
    assert meta["cardinalities"] == [M] * 26 and meta["num_dense"] == 13


def test_batches_are_deterministic_per_step(data):
    first, second = BinarySource(make_cfg(data[1])), BinarySource(make_cfg(data[1]))
    for step in (7, 30, 12, 7):  # revisiting after other epochs are cached
        assert_batches_equal(first.train_batch(step), second.train_batch(step))
    other = BinarySource(make_cfg(data[1], "train.seed=1"))
    assert not np.array_equal(other.train_batch(7).labels, first.train_batch(7).labels)


@pytest.mark.parametrize("processes", [2, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_process_slices_concatenate_to_the_global_batch(data, processes, shuffle):
    cfg = make_cfg(data[1], f"data.shuffle={str(shuffle).lower()}")
    whole = BinarySource(cfg)
    parts = [BinarySource(cfg, p, processes) for p in range(processes)]
    for step in (0, 12, 25):  # 12 straddles epochs 0 and 1
        sliced = concat(p.train_batch(step) for p in parts)
        assert_batches_equal(sliced, whole.train_batch(step))


def test_each_epoch_visits_every_train_row_once(data):
    source, train = BinarySource(make_cfg(data[1])), data[2]["train"]
    rows = np.concatenate([source.train_rows(step) for step in range(25)])  # 1600 = 2 epochs
    epochs = rows.reshape(2, N_TRAIN)
    for epoch in epochs:
        np.testing.assert_array_equal(np.sort(epoch), np.arange(N_TRAIN))
    assert not np.array_equal(epochs[0], epochs[1])
    assert not np.array_equal(epochs[0], np.arange(N_TRAIN))
    got = concat(source.train_batch(step) for step in range(25))
    for x, name in zip(got, ("dense", "ids", "labels"), strict=True):
        np.testing.assert_array_equal(x, train[name][rows])


def test_unshuffled_order_cycles_through_the_split(data):
    source, train = BinarySource(make_cfg(data[1], "data.shuffle=false")), data[2]["train"]
    for step in (0, 12, 13):
        rows = (step * B + np.arange(B)) % N_TRAIN
        got = source.train_batch(step)
        assert_batches_equal(got, [train["dense"][rows], train["ids"][rows], train["labels"][rows]])


@pytest.mark.parametrize("processes", [1, 4])
def test_eval_covers_the_val_split_once_in_order(data, processes):
    cfg, val = make_cfg(data[1]), data[2]["val"]
    per_process = [list(BinarySource(cfg, p, processes).eval_batches()) for p in range(processes)]
    assert all(len(b) == 4 for b in per_process)  # 200 = 3 * 64 + 8
    globals_ = [concat(parts) for parts in zip(*per_process, strict=True)]
    assert [len(g[2]) for g in globals_] == [64, 64, 64, 8]
    assert_batches_equal(concat(globals_), [val["dense"], val["ids"], val["labels"]])
    last = per_process[-1][-1]  # beyond the partial batch: empty, with the right shapes
    if processes > 1:
        assert last.dense.shape == (0, 13) and last.ids.shape == (0, 26) and last.size == 0
    limited = list(BinarySource(make_cfg(data[1], "train.eval_batches=2")).eval_batches())
    assert len(limited) == 2 and limited[1].size == B
    assert list(BinarySource(cfg).eval_batches())[0].ids.tolist() == val["ids"][:B].tolist()


def test_max_rows_cap_hashes_ids_into_the_table(data):
    source = BinarySource(make_cfg(data[1], "data.max_rows=10", "data.shuffle=false"))
    batch = source.train_batch(0)
    np.testing.assert_array_equal(batch.ids, data[2]["train"]["ids"][:B] % 10)
    assert batch.ids.max() < 10


@pytest.fixture
def copy(data, tmp_path):
    shutil.copytree(data[1], tmp_path / "ds")
    return tmp_path / "ds"


def test_out_of_range_id_names_the_file(copy):
    ids = np.load(copy / "train" / "ids.npy", mmap_mode="r+")
    ids[3, 5] = M
    ids.flush()
    with pytest.raises(ValueError, match=f"{copy / 'train' / 'ids.npy'}.*feature 5 .*id 97"):
        BinarySource(make_cfg(copy, "data.shuffle=false")).train_batch(0)


def test_nan_dense_value_names_the_file_and_row(copy):
    dense = np.load(copy / "val" / "dense.npy", mmap_mode="r+")
    dense[70, 2] = np.nan
    dense.flush()
    source = BinarySource(make_cfg(copy))
    with pytest.raises(BinaryFormatError, match=f"{copy / 'val' / 'dense.npy'}: row 70 "):
        list(source.eval_batches())


def test_meta_and_shape_errors_name_the_file(copy):
    with pytest.raises(BinaryFormatError, match="data.num_dense=13 and 25 data.cardinalities"):
        BinarySource(load_config(None, ["data.source=binary", f"data.path={copy}",
                                        f"data.cardinalities={[M] * 25}"]))  # fmt: skip
    np.save(copy / "val" / "labels.npy", np.zeros(N_VAL + 1, np.float32))
    with pytest.raises(BinaryFormatError, match=f"{copy / 'val' / 'labels.npy'}: expected"):
        BinarySource(make_cfg(copy))
    meta = json.loads((copy / "meta.json").read_text())
    (copy / "meta.json").write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(BinaryFormatError, match=f"{copy / 'meta.json'}: format_version 99"):
        BinarySource(make_cfg(copy))
    (copy / "meta.json").unlink()
    with pytest.raises(BinaryFormatError, match=f"{copy / 'meta.json'}: not found"):
        BinarySource(make_cfg(copy))


@pytest.mark.parametrize("processes", [1, 2])
def test_tsv_source_matches_unshuffled_binary_source(data, processes):
    tsv, ds, _ = data
    for p in range(processes):
        binary = BinarySource(make_cfg(ds, "data.shuffle=false"), p, processes)
        text = CriteoTSVSource(make_cfg(tsv, source="criteo"), p, processes)
        assert (text.num_train, text.num_val) == (N_TRAIN, N_VAL)
        for step in (0, 5, 12, 13, 40):
            assert_batches_equal(text.train_batch(step), binary.train_batch(step))
        for a, b in zip(text.eval_batches(), binary.eval_batches(), strict=True):
            assert_batches_equal(a, b)


@pytest.mark.parametrize("max_rows", [0, 13])
def test_id_histograms_count_the_train_split(data, max_rows):
    """preprocess counts every feature's ids over the train split; with data.max_rows the
    counts follow the ids into their hashed rows, as batches do; hot rows start from them."""
    from dlrm_jax.train.hot_setup import initial_counts

    cfg = make_cfg(data[1], f"data.max_rows={max_rows}", "embedding.hot.stats_batches=1")
    source = BinarySource(cfg)
    train_ids = data[2]["train"]["ids"]
    for f, (ids, counts) in enumerate(source.id_histograms()):
        column = train_ids[:, f] % max_rows if max_rows else train_ids[:, f]
        want_ids, want_counts = np.unique(column, return_counts=True)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(counts, want_counts)
    assert initial_counts(cfg, source).lookups() == N_TRAIN * 26  # the whole split, not one batch


def test_damaged_id_histograms_name_the_file(data, tmp_path):
    copy = tmp_path / "ds"
    shutil.copytree(data[1], copy)
    (copy / "train" / "id_counts.npz").write_bytes(b"not a zip")
    with pytest.raises(BinaryFormatError, match="id_counts.npz"):
        BinarySource(make_cfg(copy)).id_histograms()
