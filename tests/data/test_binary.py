"""`BinarySource` on a small sharded synthetic dataset: determinism, process streams, the
block shuffle's epochs, evaluation, the max_rows cap, error messages, and agreement with
`CriteoTSVSource`."""

import dataclasses
import gc
import json
import os
import pickle
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm_jax.config import ConfigError, load_config
from dlrm_jax.data.batch import Batch
from dlrm_jax.data.packed import PackedLayout, packed_reader
from dlrm_jax.data.pipeline import InputPipeline
from dlrm_jax.data.preprocessing.criteo_preprocess import preprocess_criteo
from dlrm_jax.data.preprocessing.synthetic_dataset import write_synthetic_dataset
from dlrm_jax.data.reader_processes import ProcessReaders
from dlrm_jax.data.shards import load_split
from dlrm_jax.data.sources import make_source, resolve_data_config
from dlrm_jax.data.sources.binary import BinaryFormatError, BinarySource, IdRanges, read_meta
from dlrm_jax.data.sources.criteo import CriteoTSVSource, parse_lines, write_criteo_tsv
from dlrm_jax.data.sources.synthetic import TRAIN_STREAM, SyntheticGenerator, SyntheticSource

M, N, B = 97, 1000, 64  # hashing range, lines, global batch
N_TRAIN, N_VAL = 800, 200  # val_fraction 0.2; 800 = 12.5 batches, so batches straddle epochs
BLOCK = 16  # data.shuffle_block: 800 = 50 blocks


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(tsv path, dataset path, {split: {name: array}}) of N synthetic lines."""
    tmp = tmp_path_factory.mktemp("binary")
    gen = SyntheticGenerator(
        seed=5, num_dense=13, table_rows=(50, 500) * 13, bag_sizes=(1,) * 26, zipf_exponent=1.1, positive_rate=0.3
    )
    write_criteo_tsv(tmp / "day.tsv", gen.raw(0, 0, 0, N), missing_cat_rate=0.05)
    preprocess_criteo(
        [str(tmp / "day.tsv")],
        str(tmp / "ds"),
        max_ind_range=M,
        val_fraction=0.2,
        vocab_from="all",
        shuffle_seed=None,
        shard_mb=0.02,
        workers=1,
        progress=False,
    )  # 131-row shards; every value has its own id, as the TSV source's
    arrays = {s: load_split(tmp / "ds", s) for s in ("train", "val")}
    return tmp / "day.tsv", tmp / "ds", arrays


def make_cfg(path, *extra, source="binary"):
    return load_config(
        None,
        [
            f"data.source={source}",
            f"data.path={path}",
            "data.max_rows=0",
            f"data.cardinalities={[M] * 26}",
            f"train.batch_size={B}",
            "train.eval_batches=0",
            "data.val_fraction=0.2",
            f"data.shuffle_block={BLOCK}",
            *extra,
        ],
    )


def assert_batches_equal(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def concat(batches):
    return [np.concatenate(parts) for parts in zip(*batches, strict=True)]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("shards,process", [(1, (0, 1)), (8, (0, 1)), (4, (1, 2))])
def test_packed_reads_are_the_batches_step_by_step(data, shuffle, shards, process):
    """The packed feed reads each shard's rows straight into its place in the buffer; the
    batch it holds is the source's batch, bit for bit, step by step past two epochs, shuffled
    or not, on 1 and 8 devices and as process 1 of 2."""
    source = BinarySource(make_cfg(data[1], f"data.shuffle={shuffle}"), *process)
    layout = PackedLayout(shards, B // process[1] // shards, 26, 13)
    read = packed_reader(source, layout)
    for step in range(45):
        packed, want = read(step), source.train_batch(step)
        assert_batches_equal(joined(packed), want)
        np.testing.assert_array_equal(np.asarray(packed.ids), want.ids)


def test_worker_processes_read_the_same_batches_and_never_overwrite_one_handed_on(data):
    """data.reader_processes: 3 reader threads share 2 worker processes (each thread waits for
    an idle one); every batch handed on is kept (a consumer slower than the readers) and
    compared once all are read: one a worker wrote into again would differ. Shuffled, as
    process 1 of 2, 4 shards, past two epochs; a worker that dies is named."""
    source = BinarySource(make_cfg(data[1], "data.shuffle=true"), 1, 2)
    layout = PackedLayout(4, B // 2 // 4, 26, 13)
    read = packed_reader(source, layout)
    with ProcessReaders(source, layout, 2) as workers:
        with InputPipeline(workers, range(30), readers=3, depth=6) as pipeline:
            kept = []
            for item in pipeline:
                kept.append(item)
                time.sleep(0.005)
        assert [k.step for k in kept] == list(range(30))
        for k in kept:
            assert k.host.layout == layout
            np.testing.assert_array_equal(k.host.buf, read(k.step).buf)
        for w in workers._workers:
            w.process.kill()
            w.process.wait()  # (gone before the call: its send breaks, as a worker dead between steps)
        with pytest.raises(  # an OSError: the commands give one line, not a traceback
            ChildProcessError,
            match=r"input reader process \d+ ended \(killed by SIGKILL, perhaps by the kernel for want of "
            r"memory\) while reading training step 4; run the same command to resume",
        ):
            workers(4)


def test_read_meta(data):
    meta = read_meta(data[1])
    assert meta["train_rows"] == N_TRAIN and meta["val_rows"] == N_VAL
    assert all(0 < c <= M for c in meta["cardinalities"]) and meta["num_dense"] == 13
    assert meta["bag_sizes"] == [1] * 26 and sum(meta["shards"]["train"]) == N_TRAIN


def test_batches_are_deterministic_per_step(data):
    first, second = BinarySource(make_cfg(data[1])), BinarySource(make_cfg(data[1]))
    for step in (7, 30, 12, 7):  # revisiting after other epochs are cached
        assert_batches_equal(first.train_batch(step), second.train_batch(step))
    other = BinarySource(make_cfg(data[1], "train.seed=1"))
    assert not np.array_equal(other.train_batch(7).labels, first.train_batch(7).labels)


@pytest.mark.parametrize("processes", [1, 2, 3])
def test_process_streams_are_disjoint_and_complete(data, processes):
    """Shuffled, each process cycles over its own contiguous rows; one epoch of every stream
    reads every train row exactly once, and a second epoch visits the blocks in another order."""
    shuffle = True
    cfg = make_cfg(data[1], f"data.shuffle={str(shuffle).lower()}", f"train.batch_size={8 * processes}")
    sources = [BinarySource(cfg, p, processes) for p in range(processes)]
    epochs = []
    for p, source in enumerate(sources):
        lo, hi = N_TRAIN * p // processes, N_TRAIN * (p + 1) // processes
        steps = -(-2 * (hi - lo) // 8)
        rows = np.concatenate([source.train_rows(step) for step in range(steps)])[: 2 * (hi - lo)]
        first, second = rows[: hi - lo], rows[hi - lo :]
        np.testing.assert_array_equal(np.sort(first), np.arange(lo, hi))
        np.testing.assert_array_equal(np.sort(second), np.arange(lo, hi))
        assert np.array_equal(first, second) != shuffle
        if shuffle:  # contiguous blocks (at most BLOCK rows, cut where the epoch's turn puts them), not single rows
            k = source._block
            assert 1 < k <= BLOCK
            blocks = (first[: (hi - lo) // k * k] - lo).reshape(-1, k)
            assert (np.diff(blocks, axis=1) % (hi - lo) == 1).all()
        epochs.append(first)
    np.testing.assert_array_equal(np.sort(np.concatenate(epochs)), np.arange(N_TRAIN))


@pytest.mark.parametrize("processes", [1, 2, 3, 4])
def test_in_order_every_global_batch_is_the_next_rows_whatever_the_processes(data, processes):
    """data.shuffle=false: global batch s is the split's rows [s*B, (s+1)*B), cycling, each
    process reading its slice of them (rows in the order they were written, as time-ordered
    training needs), past two epochs."""
    cfg = make_cfg(data[1], "data.shuffle=false", f"train.batch_size={24 * processes}")
    sources = [BinarySource(cfg, p, processes) for p in range(processes)]
    batch = 24 * processes
    for step in range(2 * N_TRAIN // batch + 2):
        got = np.concatenate([source.train_rows(step) for source in sources])
        np.testing.assert_array_equal(got, (step * batch + np.arange(batch)) % N_TRAIN)
    whole = BinarySource(make_cfg(data[1], "data.shuffle=false", f"train.batch_size={batch}"))
    for step in (0, 33, 34):  # the slices together are one process's batch
        parts = [source.train_batch(step) for source in sources]
        assert_batches_equal(concat(parts), whole.train_batch(step))


GOLDEN_RUNS = Path(__file__).parent.parent / "golden" / "data" / "binary_train_runs.json"


class StreamOnly(BinarySource):
    """A binary source's stream logic alone: which rows each step reads, without files."""

    def __init__(self, rows, batch, processes, process, seed, block, shuffle):
        self._lo, self._hi = rows * process // processes, rows * (process + 1) // processes
        self._process, self._seed, self._shuffle, self._batch = process, seed, shuffle, batch
        self._keep_places()
        per = batch // processes
        self._rows = slice(process * per, (process + 1) * per)
        self._block = max(1, min(block, (self._hi - self._lo) // 64))


def test_the_rows_each_step_reads_are_those_of_before_the_places_were_kept():
    """The shuffled block places are now computed a chunk at a time and kept, not per step:
    every step of every case (1-4 processes, shuffled or not, epochs' boundaries, steps far
    into a run) reads exactly the rows the per-step computation of 2026-11-27 read."""
    for case in json.loads(GOLDEN_RUNS.read_text()):
        source = StreamOnly(*case["case"])
        got = [[list(r) for r in source.train_runs(step)] for step in case["steps"]]
        assert got == case["runs"], case["case"]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 700),
    bags=st.sampled_from([(1, 1, 1), (3, 1, 2), (1,) * 26]),
    bad=st.one_of(st.none(), st.tuples(st.floats(0, 0.999), st.floats(0, 0.999), st.sampled_from([-2, -1, 0, 1]))),
    seed=st.integers(0, 2**16),
)
def test_the_id_check_agrees_with_a_plain_comparison(n, bags, bad, seed):
    """The id check compares CHECK_ROWS rows at a time; any batch length (whole chunks and a
    tail), one-hot and multi-hot columns (PAD_ID valid only in bags), one bad id anywhere."""
    rng = np.random.default_rng(seed)
    rows = tuple(int(r) for r in rng.integers(1, 50, len(bags)))
    ranges = IdRanges(rows, bags)
    ids = rng.integers(ranges.lower, ranges.upper, (n, sum(bags))).astype(np.int32)
    if bad is not None and n:
        r, c, which = int(bad[0] * n), int(bad[1] * sum(bags)), bad[2]
        ids[r, c] = {-2: -2, -1: ranges.lower[c] - 1, 0: ranges.upper[c], 1: 2**31 - 1}[which]
    plain = bool(((ids >= ranges.lower) & (ids < ranges.upper)).all())
    assert ranges.hold(ids) == plain
    if not plain:
        assert ranges.first_bad(ids) == (r, c)


@pytest.mark.parametrize("rows,block", [(8000, 4096), (40, 4096)])
def test_small_data_is_shuffled_anew_every_epoch_and_by_seed(rows, block):
    """Before its fix: 8,000 rows in blocks of 4,096 were one block and a tail, the same order every
    epoch and whatever the seed. Now every epoch reads every row once, in another order, and
    the order follows train.seed."""

    def epochs(seed, count=3):
        source = StreamOnly(rows, 32, 1, 0, seed, block, True)
        stream = np.concatenate([source.train_rows(step) for step in range(-(-count * rows // 32))])
        return stream[: count * rows].reshape(count, rows)

    first = epochs(0)
    for epoch in first:
        np.testing.assert_array_equal(np.sort(epoch), np.arange(rows))
    assert not np.array_equal(first[0], first[1]) and not np.array_equal(first[1], first[2])
    assert not np.array_equal(first[0], epochs(1)[0])


def test_batches_are_the_rows_they_name(data):
    source, train = BinarySource(make_cfg(data[1])), data[2]["train"]
    rows = np.concatenate([source.train_rows(step) for step in range(25)])  # 1600 = 2 epochs
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


def joined(packed) -> Batch:
    """A packed host batch's fields, each as one array."""
    views = packed.layout.views(packed.buf)
    return Batch(*(np.concatenate(views[k]) for k in ("dense", "ids", "labels")))


def first_batch(source, how: str):
    """Step 0's batch, read as a batch, packed in place (8 shards), or so by a worker process."""
    if how == "batch":
        return source.train_batch(0)
    if how == "process":
        with ProcessReaders(source, PackedLayout(8, B // 8, 26, 13), 1) as read:
            return read(0)
    return packed_reader(source, PackedLayout(8, B // 8, 26, 13))(0)


@pytest.mark.parametrize("how", ["batch", "packed", "process"])
@pytest.mark.parametrize("cap", [0, 10])
def test_out_of_range_id_names_the_file(copy, how, cap):
    """``cap``: data.max_rows, which folds ids into smaller tables; it used to fold the damaged
    id too (checked after the fold, against the capped table), and the run trained on it."""
    ids = np.load(copy / "train" / "00000" / "ids.npy", mmap_mode="r+")
    ids[3, 5] = M
    ids.flush()
    cfg = resolve_data_config(make_cfg(copy, "data.shuffle=false", f"data.max_rows={cap}"))
    with pytest.raises(ValueError, match=f"{copy / 'train' / '00000' / 'ids.npy'}: row 3 .*feature 5 .*id 97"):
        first_batch(BinarySource(cfg), how)


def test_a_workers_error_comes_at_its_step_and_the_worker_goes_on(copy):
    ids = np.load(copy / "train" / "00000" / "ids.npy", mmap_mode="r+")
    ids[70, 2] = M  # step 1's row 6 (in order)
    ids.flush()
    source = BinarySource(make_cfg(copy, "data.shuffle=false"))
    layout = PackedLayout(2, B // 2, 26, 13)
    with ProcessReaders(source, layout, 1) as read:
        want = packed_reader(source, layout)
        with pytest.raises(
            BinaryFormatError, match=f"{copy / 'train' / '00000' / 'ids.npy'}: row 70 .*training step 1"
        ):
            read(1)
        for step in (0, 2):
            np.testing.assert_array_equal(read(step).buf, want(step).buf)


def test_nan_dense_value_names_the_file_and_row(copy):
    dense = np.load(copy / "val" / "00001" / "dense.npy", mmap_mode="r+")
    dense[50, 2] = np.nan  # row 131 + 50 of the split
    dense.flush()
    source = BinarySource(make_cfg(copy))
    with pytest.raises(BinaryFormatError, match=f"{copy / 'val' / '00001' / 'dense.npy'}: row 181 "):
        list(source.eval_batches())


@pytest.mark.parametrize("how", ["batch", "packed", "process"])
def test_a_label_that_is_not_0_or_1_names_the_file_and_row(copy, how):
    labels = np.load(copy / "train" / "00000" / "labels.npy", mmap_mode="r+")
    labels[7] = 5.0
    labels.flush()
    with pytest.raises(
        BinaryFormatError, match=f"{copy / 'train' / '00000' / 'labels.npy'}: row 7 .*label 5.0, not 0 or 1"
    ):
        first_batch(BinarySource(make_cfg(copy, "data.shuffle=false")), how)


def test_an_inflated_row_count_or_a_truncated_shard_is_named_at_start(copy):
    meta = json.loads((copy / "meta.json").read_text())
    meta["train_rows"] += 100
    (copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(
        BinaryFormatError,
        match=f"{copy / 'meta.json'}: says {N_TRAIN + 100:,} train rows, and its train shards hold {N_TRAIN}",
    ):
        BinarySource(make_cfg(copy))
    meta["train_rows"] -= 100
    (copy / "meta.json").write_text(json.dumps(meta))
    dense = copy / "train" / "00002" / "dense.npy"
    dense.write_bytes(dense.read_bytes()[:-100])
    with pytest.raises(BinaryFormatError, match=f"{dense}: truncated: "):
        BinarySource(make_cfg(copy))


def test_meta_and_shape_errors_name_the_file(copy):
    with pytest.raises(BinaryFormatError, match="data.num_dense=13, 25 data.cardinalities"):
        BinarySource(load_config(None, ["data.source=binary", f"data.path={copy}", f"data.cardinalities={[M] * 25}"]))
    np.save(copy / "val" / "00000" / "labels.npy", np.zeros(7, np.float32))
    with pytest.raises(BinaryFormatError, match=f"{copy / 'val' / '00000' / 'labels.npy'}: expected"):
        BinarySource(make_cfg(copy))
    meta = json.loads((copy / "meta.json").read_text())
    (copy / "meta.json").write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(BinaryFormatError, match=f"{copy / 'meta.json'}: format_version 99"):
        BinarySource(make_cfg(copy))
    (copy / "meta.json").unlink()
    with pytest.raises(BinaryFormatError, match=f"{copy / 'meta.json'}: not found"):
        BinarySource(make_cfg(copy))


def test_tsv_source_matches_unshuffled_binary_source(data):
    """The same rows; the binary ids are the compacted form of the TSV source's value % M."""
    tsv, ds, _ = data
    binary = BinarySource(make_cfg(ds, "data.shuffle=false"))
    text = CriteoTSVSource(make_cfg(tsv, source="criteo"))
    value_of = [np.load(ds / "vocab" / f"feature_{f}.npy")[:, 0].astype(np.int32) for f in range(26)]

    def as_values(batch):
        return batch._replace(ids=np.stack([value_of[f][batch.ids[:, f]] for f in range(26)], 1))

    assert (text.num_train, text.num_val) == (N_TRAIN, N_VAL)
    for step in (0, 5, 12, 13, 40):
        assert_batches_equal(text.train_batch(step), as_values(binary.train_batch(step)))
    for a, b in zip(text.eval_batches(), binary.eval_batches(), strict=True):
        assert_batches_equal(a, as_values(b))
    read = packed_reader(text, PackedLayout(8, B // 8, 26, 13))  # the text source is copied in
    for step in (0, 12, 13):
        assert_batches_equal(joined(read(step)), text.train_batch(step))


@pytest.mark.parametrize("max_rows", [0, 13])
def test_id_histograms_count_every_row(data, max_rows):
    """preprocess counts every feature's ids over the rows it counted values on (all rows
    here, --vocab-from all; a placement hint for hot rows, never math); with data.max_rows the counts follow the ids into their hashed rows, as
    batches do; hot rows start from them."""
    from dlrm_jax.train.hot_setup import initial_counts

    cfg = make_cfg(data[1], f"data.max_rows={max_rows}", "embedding.hot.stats_batches=1")
    source = BinarySource(cfg)
    train_ids = np.concatenate([data[2]["train"]["ids"], data[2]["val"]["ids"]])
    for f, (ids, counts) in enumerate(source.id_histograms()):
        column = train_ids[:, f] % max_rows if max_rows else train_ids[:, f]
        want_ids, want_counts = np.unique(column, return_counts=True)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(counts, want_counts)
    assert (
        initial_counts(source, cfg.embedding.hot.stats_batches, cfg.bag_sizes).lookups() == N * 26
    )  # the whole dataset, not one batch


def test_damaged_id_histograms_name_the_file(data, tmp_path):
    copy = tmp_path / "ds"
    shutil.copytree(data[1], copy)
    (copy / "train" / "id_counts.npz").write_bytes(b"not a zip")
    with pytest.raises(BinaryFormatError, match="id_counts.npz"):
        BinarySource(make_cfg(copy)).id_histograms()


@pytest.mark.parametrize("source", ["binary", "criteo"])
def test_a_train_split_shorter_than_one_batch_is_refused_for_training_only(data, source):
    """Before its fix: a batch larger than the dataset (wide_deep's 16,384 on 8,000 rows) trained on
    rows repeated within each batch without a word. Evaluation reads the val split only, and a
    val split shorter than a batch is evaluated exactly as one partial batch."""
    path = data[0] if source == "criteo" else data[1]
    cfg = make_cfg(path, f"train.batch_size={N_TRAIN + 8}", source=source)
    with pytest.raises(
        ConfigError,
        match=rf"^data.path={path}: the train split has {N_TRAIN} rows, fewer than one "
        rf"batch \(train.batch_size={N_TRAIN + 8}\)",
    ):
        make_source(cfg)
    val = make_source(cfg, trains=False, evaluates=True)
    assert sum(b.size for b in val.eval_batches()) == N_VAL
    assert make_source(make_cfg(path, f"train.batch_size={N_TRAIN}", source=source)).num_train == N_TRAIN


def _without_val(data, folder: Path) -> Path:
    """The dataset preprocessed with --val-fraction 0: no val split."""
    preprocess_criteo(
        [str(data[0])], str(folder), max_ind_range=M, val_fraction=0.0, shuffle_seed=None, workers=1, progress=False
    )
    return folder


def test_an_empty_val_split_is_refused_before_a_run_that_evaluates(data, tmp_path):
    """It used to train every step and then fail in the final evaluation, before the final checkpoint."""
    cfg = make_cfg(_without_val(data, tmp_path / "noval"))
    with pytest.raises(
        ConfigError, match="the val split is empty, and a run evaluates.*--val-fraction.*train.eval_every=-1"
    ):
        make_source(cfg, evaluates=True)
    with pytest.raises(ConfigError, match=r"the val split is empty: nothing to evaluate; use .*--val-fraction"):
        make_source(cfg, trains=False, evaluates=True)  # eval names no training key
    assert make_source(cfg).num_val == 0  # profile and benchmarks do not evaluate


def test_a_run_that_never_evaluates_trains_on_data_without_a_val_split(data, tmp_path):
    """train.eval_every=-1: no evaluation, not even at the end, so data preprocessed with
    --val-fraction 0 trains (it could not: every run evaluated at its end). The final line says
    auc=nan and names no best evaluation; run again, the finished run gives its recorded end."""
    from dlrm_jax.config import validate
    from dlrm_jax.train.trainer import train_and_evaluate

    tiny = ["mesh.devices=1", "model.embedding_dim=8", "model.bottom_mlp=[8]", "model.top_mlp=[8, 1]"]
    cfg = make_cfg(_without_val(data, tmp_path / "noval"), "train.eval_every=-1", "train.steps=3", *tiny)
    assert not cfg.train.evaluates
    summary = train_and_evaluate(cfg, tmp_path / "run", log=lambda *_: None)
    assert summary.step == 3 and np.isfinite(summary.loss) and np.isnan(summary.auc) and summary.best is None
    assert summary.final_line().startswith(f"final step=3 loss={summary.loss:.6f} auc=nan logloss=nan")
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["train"] * len(events) and "best_step" not in events[-1]
    again = train_and_evaluate(cfg, tmp_path / "run", log=lambda *_: None)
    assert (again.step, again.loss, again.best) == (3, summary.loss, None)
    for key in ("train.keep_best=auc", "train.early_stop_evals=2", "train.eval_every=-2"):
        with pytest.raises(ConfigError, match=key.split("=")[0]):
            validate(make_cfg(tmp_path / "noval", "train.eval_every=-1", key))


def test_dcn_rank_is_checked_against_the_datas_features(data):
    """The config's own 4 features would make the cross input 8 + 8 x 4 = 40 wide; the data's 26
    make it 216: the rank is checked once meta.json gives the features."""
    over = [
        "data.cardinalities=[5, 5, 5, 5]",
        "model.embedding_dim=8",
        "model.bottom_mlp=[16, 8]",
        "model.interaction=dcn",
    ]
    assert resolve_data_config(make_cfg(data[1], *over, "model.dcn_rank=216")).model.dcn_rank == 216
    with pytest.raises(ConfigError, match=f"dcn_rank=217 exceeds .* width 216 .*data.path={data[1]}"):
        resolve_data_config(make_cfg(data[1], *over, "model.dcn_rank=217"))
    with pytest.raises(ConfigError, match="width 40"):
        make_cfg(data[0], *over, "model.dcn_rank=41", source="criteo")


def test_a_datasets_own_sizes_unless_capped_and_a_cap_says_so(data):
    """data.max_rows=auto (the default) leaves binary data its own sizes; a number caps them
    and the run says so in one line naming the key."""
    from dlrm_jax.data.sources import cap_note, resolve_data_config

    own = resolve_data_config(load_config(None, ["data.source=binary", f"data.path={data[1]}"]))
    assert own.table_rows == own.data.cardinalities and cap_note(own) == ""
    capped = resolve_data_config(load_config(None, ["data.source=binary", f"data.path={data[1]}", "data.max_rows=5"]))
    assert max(capped.table_rows) == 5
    note = cap_note(capped)
    assert note.startswith("data.max_rows=5 hashes ") and "data.max_rows=0 keeps every table" in note
    synthetic = load_config(None, [])
    assert max(synthetic.table_rows) == 20000 and cap_note(synthetic) == ""
    # Criteo text's values are hashed into the capped tables too (before: without a word)
    text = load_config(None, ["data.source=criteo", f"data.path={data[1]}", "data.max_rows=2000"])
    assert cap_note(text).startswith("data.max_rows=2,000 hashes ") and "of data.cardinalities' 26 tables" in cap_note(
        text
    )


def test_evaluation_scores_the_whole_split_by_default_and_says_how_much(data, tmp_path):
    """train.eval_batches defaults to 0: every evaluation of real data scores the whole val
    split (not 16 batches); the eval line, the metrics event and ``evaluate_run`` say how many."""
    from dlrm_jax.train.saved_run import evaluate_run
    from dlrm_jax.train.trainer import train_and_evaluate

    cfg = load_config(
        None,
        [
            "data.source=binary",
            f"data.path={data[1]}",
            f"train.batch_size={B}",
            "train.steps=2",
            "train.eval_every=2",
            "train.progress_bar=false",
            "mesh.devices=1",
            "model.embedding_dim=8",
            "model.bottom_mlp=[8]",
            "model.top_mlp=[8, 1]",
        ],
    )
    assert cfg.train.eval_batches == 0
    lines = []
    summary = train_and_evaluate(cfg, tmp_path / "run", log=lines.append)
    assert summary.eval_samples == N_VAL
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["eval_samples"] for e in events if e["event"] == "eval"] == [N_VAL]
    again = evaluate_run(tmp_path / "run", log=lambda *_: None)
    assert again.eval_samples == N_VAL and again.samples_per_s > 0 and again.auc == summary.auc


@pytest.mark.parametrize("bags", [[1], [3, 1, 2, 1]])
def test_a_synthetic_binary_dataset_holds_the_generators_rows(tmp_path, bags):
    """``write_synthetic_dataset`` (the feed benchmarks' data): shard k is the generator's
    batch k, the config's tables and bags are the dataset's, and the binary source reads it."""
    cfg = load_config("smoke", [f"data.bag_sizes={bags}", "train.batch_size=64", "data.shuffle=false"])
    write_synthetic_dataset(cfg, tmp_path / "ds", train_rows=700, val_rows=150, shard_rows=300)
    gen = SyntheticSource(cfg).generator
    want = [gen.batch(TRAIN_STREAM, k, 0, n) for k, n in enumerate([300, 300, 100])]
    split = load_split(tmp_path / "ds", "train")
    for name in ("dense", "ids", "labels"):
        np.testing.assert_array_equal(split[name], np.concatenate([getattr(b, name) for b in want]))
    binary = resolve_data_config(
        load_config(
            "smoke", ["data.source=binary", f"data.path={tmp_path / 'ds'}", "train.batch_size=64", "data.shuffle=false"]
        )
    )
    assert (binary.table_rows, binary.bag_sizes) == (cfg.table_rows, cfg.bag_sizes)
    source = make_source(binary, evaluates=True)
    np.testing.assert_array_equal(source.train_batch(2).ids, split["ids"][128:192])
    assert sum(len(b.labels) for b in source.eval_batches()) == 150
    shuffled = make_source(dataclasses.replace(binary, data=dataclasses.replace(binary.data, shuffle=True)))
    read = packed_reader(shuffled, PackedLayout(4, 16, sum(cfg.bag_sizes), cfg.data.num_dense))
    for step in range(30):  # multi-hot bags read in place, shard by shard, past two epochs
        assert_batches_equal(joined(read(step)), shuffled.train_batch(step))


DYNAMIC = "embedding.table_ids=[cat_1=dynamic, cat_3=dynamic, cat_20=dynamic]"


@pytest.fixture(scope="module")
def raw_data(data, tmp_path_factory):
    """The same lines preprocessed with ``raw_values``, shuffled, by two workers."""
    out = tmp_path_factory.mktemp("raw") / "ds"
    preprocess_criteo(
        [str(data[0])],
        str(out),
        max_ind_range=M,
        val_fraction=0.2,
        vocab_from="all",
        shard_mb=0.02,
        workers=2,
        raw_values=True,
        progress=False,
    )
    return out


def test_raw_values_are_each_rows_values_beside_the_same_ids(data, raw_data):
    """``raw_values`` adds each row's values (Criteo's ``int(hex, 16)``, 0 where missing) and
    changes nothing else: the ids, dense and labels are those of a dataset made without them
    (shuffled here, so rows are matched by their dense values)."""
    _, ds, arrays = data
    meta = read_meta(raw_data)
    assert meta["raw_values"] is True and read_meta(ds)["raw_values"] is False
    text = CriteoTSVSource(make_cfg(data[0], source="criteo"))
    lines = data[0].read_bytes().splitlines(keepends=True)
    values = parse_lines(lines).values  # 0 where missing
    for split, rows in (("train", slice(0, N_TRAIN)), ("val", slice(N_TRAIN, N))):
        got = load_split(raw_data, split)
        assert got["raw"].dtype == np.uint64 and got["raw"].shape == (rows.stop - rows.start, 26)
        plain = {k: v for k, v in arrays[split].items()}
        order = np.lexsort(got["dense"].T[::-1])
        want = np.lexsort(plain["dense"].T[::-1])
        for k in ("dense", "ids", "labels"):
            np.testing.assert_array_equal(got[k][order], plain[k][want])
        np.testing.assert_array_equal(got["raw"][order], values[rows][want])
    assert text.num_train == N_TRAIN


@pytest.mark.parametrize("shards,process", [(1, (0, 1)), (8, (0, 1)), (4, (1, 2))])
def test_dynamic_tables_read_the_raw_values_as_text_would_carry_them(data, raw_data, shards, process):
    """With dynamic tables a batch carries its dynamic features' values (a RawBatch laid out as
    the Criteo text source lays them), in training, evaluation and the packed feed, which reads
    every value of a row in place and leaves picking the dynamic ones to the device."""
    import jax
    from jax.sharding import NamedSharding

    from dlrm_jax.data.batch import RawBatch
    from dlrm_jax.data.packed import Packed, unpacked
    from dlrm_jax.ids import raw_columns
    from dlrm_jax.parallel.mesh import batch_spec, make_mesh

    values = load_split(raw_data, "train")["raw"]
    source = BinarySource(make_cfg(raw_data, DYNAMIC), *process)
    assert source.raw_layout == (26, (1, 3, 20))
    mesh = make_mesh(shards)
    spec = batch_spec(mesh)
    sharding = NamedSharding(mesh, spec)
    layout = PackedLayout(shards, B // process[1] // shards, 26, 13)
    read = packed_reader(source, layout)
    unpack = jax.jit(lambda b: unpacked(b, mesh, spec))
    for step in (0, 7, 12, 13):
        batch = source.train_batch(step)
        assert isinstance(batch, RawBatch)
        np.testing.assert_array_equal(batch.raw, raw_columns(values[source.train_rows(step)][:, [1, 3, 20]]))
        host = read(step)
        if process[1] == 1:  # one process: its buffer is the global batch
            got = unpack(Packed(jax.make_array_from_process_local_data(sharding, host.buf), host.layout))
            assert isinstance(got, RawBatch)
            assert_batches_equal([np.asarray(x) for x in got], batch)
        assert_batches_equal(joined(host), Batch(*batch[:3]))
    val = load_split(raw_data, "val")["raw"]
    first = next(iter(source.eval_batches()))
    rows = slice(process[0] * B // process[1], (process[0] + 1) * B // process[1])
    np.testing.assert_array_equal(first.raw, raw_columns(val[rows][:, [1, 3, 20]]))


def test_maps_trained_on_raw_values_are_not_read_with_ids_nor_the_reverse(data, raw_data):
    """The same lines with and without ``--raw-values`` share every state key: ``eval --set
    data.path=`` the other one read the maps with the other kind of key (AUC 0.70 -> 0.54, no
    word), and a resume admitted vocabulary ids beside raw values."""
    from dlrm_jax.data.sources import dynamic_input
    from dlrm_jax.train.rundir import state_differences

    raw, ids = make_cfg(raw_data, DYNAMIC), make_cfg(data[1], DYNAMIC)
    assert (dynamic_input(raw), dynamic_input(ids)) == ("raw values", "ids")
    assert state_differences(raw, ids) == [
        ("what the dynamic tables' maps take (data.path: preprocess --raw-values or not)", "raw values", "ids")
    ]
    assert state_differences(raw, make_cfg(raw_data, DYNAMIC)) == []
    assert state_differences(make_cfg(raw_data), make_cfg(data[1])) == []  # no dynamic tables: ids alike


def test_raw_values_are_read_only_for_dynamic_tables(data, raw_data):
    """Without dynamic tables a dataset's raw values are not read (plain batches); a dataset
    without them gives dynamic tables its ids, as plain batches too."""
    assert type(BinarySource(make_cfg(raw_data)).train_batch(0)) is Batch
    assert BinarySource(make_cfg(raw_data)).raw_layout is None
    assert type(BinarySource(make_cfg(data[1], DYNAMIC)).train_batch(0)) is Batch


def test_options_that_cannot_go_together_are_refused_before_any_work(data, tmp_path):
    """--min-count with --max-ind-range did nothing (hashing keeps every value) while meta.json
    recorded it."""
    for kw, says in (
        ({"multi_hot": (2,) * 26, "raw_values": True}, "--raw-values and --multi-hot"),
        ({"max_ind_range": 1000, "min_count": 5}, "--min-count 5 and --max-ind-range 1000: .*choose one"),
    ):
        with pytest.raises(ValueError, match=says):
            preprocess_criteo([str(data[0])], str(tmp_path / "ds"), **kw, workers=1, progress=False)
        assert not (tmp_path / "ds").exists()


def test_a_config_not_resolved_against_the_dataset_is_refused_naming_the_table(data):
    """Before: BinarySource(load_config(...)) kept the config's table sizes (Kaggle's, by default)
    and folded the dataset's ids into the smaller ones without a word (feature 8: id 4 read as 1)."""
    from dlrm_jax import resolve_data_config

    cards = read_meta(data[1])["cardinalities"]
    small = [c - 1 if f == 3 else c for f, c in enumerate(cards)]
    cfg = make_cfg(data[1], f"data.cardinalities={small}")
    with pytest.raises(
        BinaryFormatError,
        match=rf"meta.json: table cat_3 has {cards[3]:,} values there, {small[3]:,} in the config's "
        r"data.cardinalities: binary data's configs take the dataset's \(dlrm_jax.resolve_data_config",
    ):
        BinarySource(cfg)
    resolved = resolve_data_config(cfg)
    assert list(resolved.data.cardinalities) == cards
    assert np.array_equal(BinarySource(resolved).train_batch(0).ids, BinarySource(make_cfg(data[1])).train_batch(0).ids)


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_source_closes_its_shard_files_when_closed_or_dropped(data):
    """Reads keep shard files open (at most split_files._OPEN_FILES a split) and they close with the source: a
    notebook's runs, each making one, kept every file open (6 more a call here, 384 at most)."""
    gc.collect()  # (the sources of the tests before)
    before = open_files()
    source = BinarySource(make_cfg(data[1]))
    read = lambda s: (s.train_batch(3), list(s.eval_batches()))
    read(source)
    assert open_files() > before
    source.close()
    assert open_files() == before
    read(source)  # reads after it open them again
    del source
    gc.collect()  # (a source's caches refer to it: it goes at a collection)
    assert open_files() == before
    pickled = pickle.loads(pickle.dumps(BinarySource(make_cfg(data[1]))))  # a reader process's copy
    read(pickled)
    pickled.close()
    assert open_files() == before
