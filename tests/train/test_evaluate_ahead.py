"""Evaluation reads its batches ahead (train/evaluate.py): the held-out batches read by several
readers (binary and Criteo-text sources, progressive validation's training batches) or by one
thread ahead (other sources), the scores read a few steps behind their dispatch, give every
batch's scores in order, bit for bit those of reading, placing and scoring one batch at a time;
a damaged held-out shard still names its file and row."""

import random
import time

import jax
import numpy as np
import pytest

from dlrm_jax.data.batch import padded
from dlrm_jax.data.preprocessing.synthetic_dataset import write_synthetic_dataset
from dlrm_jax.data.sources import make_source
from dlrm_jax.data.sources.binary import BinaryFormatError
from dlrm_jax.observe.metrics import log_loss_of_logits, roc_auc
from dlrm_jax.train.build import build, mesh_from_config
from dlrm_jax.train.evaluate import Indexed, eval_scores, evaluate, held_out
from tests.helpers import tiny_config


def one_at_a_time(steps, state, batches):
    """The scores as evaluation took them before: read, place, score and wait, a batch at a time."""
    state = state._replace(emb=steps.collection.model_tables(state.emb))
    per_process = steps.spec.batch_size // jax.process_count()
    for batch in batches:
        out, _ = steps.eval_step(state, steps.device_batch(padded(batch, per_process)))
        yield np.concatenate(
            [np.asarray(s.data) for s in sorted(out.addressable_shards, key=lambda s: s.index[0].start)]
        )


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "ds"
    write_synthetic_dataset(
        tiny_config("train.batch_size=64"), path, train_rows=640, val_rows=64 * 9 + 24, shard_rows=100
    )
    return path


def built(tiny, dataset, devices: int):
    cfg = tiny(
        f"mesh.devices={devices}",
        "train.batch_size=64",
        "train.eval_batches=0",
        "data.source=binary",
        f"data.path={dataset}",
    )
    source = make_source(cfg, 0, 1)
    _, steps = build(cfg, mesh_from_config(cfg), source, log=lambda *_: None)
    return source, steps, steps.init_state()


@pytest.mark.parametrize("devices", [1, 8])
def test_held_out_batches_read_ahead_score_as_one_at_a_time(tiny, dataset, devices):
    source, steps, state = built(tiny, dataset, devices)
    held = held_out(source)
    assert isinstance(held, Indexed) and held.count == 10  # 600 rows: 9 batches of 64 and one of 24
    want = list(one_at_a_time(steps, state, source.eval_batches()))
    for readers, depth in ((1, 1), (4, 2), (3, 8)):
        got = list(eval_scores(steps, state, source, readers=readers, depth=depth))
        assert len(got) == len(want)
        for (p, labels, valid), w, batch in zip(got, want, source.eval_batches(), strict=True):
            np.testing.assert_array_equal(p, w)
            np.testing.assert_array_equal(labels[: batch.size], batch.labels)
            assert valid.sum() == batch.size and valid[: batch.size].all()
    # batches that come as an iterable (other sources) are read ahead by one thread: the same
    got = [p for p, _, _ in eval_scores(steps, state, source, batches=iter(list(source.eval_batches())))]
    for p, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(p, w)
    auc, logloss, n = evaluate(steps, state, source, readers=4)
    assert n == 600 and (auc, logloss) == evaluate(steps, state, source, readers=1)[:2]


def test_confident_scores_are_ranked_by_their_logits(tiny, dataset):
    """AUC and logloss are of the logits: a float32 sigmoid rounds every logit above 16.6 to 1.0,
    and ranked so, a model confident on many samples scored ties (a different AUC)."""
    source, steps, state = built(tiny, dataset, 1)
    state = state._replace(params=jax.tree.map(lambda w: w * 6, state.params))  # (confident: huge logits)
    per_process = steps.spec.batch_size
    probs, logits, labels = [], [], []
    for batch in source.eval_batches():
        p, z = steps.eval_step(state, steps.device_batch(padded(batch, per_process)))
        probs.append(np.asarray(p)[: batch.size])
        logits.append(np.asarray(z)[: batch.size])
        labels.append(batch.labels)
    p, z, y = (np.concatenate(a) for a in (probs, logits, labels))
    saturated = p == 1.0
    assert saturated.sum() > 20 and len(np.unique(y[saturated])) == 2  # ties of both labels
    auc, logloss, n = evaluate(steps, state, source)
    assert n == len(y) and auc == roc_auc(y, z) != roc_auc(y, p)
    assert logloss == log_loss_of_logits(y, z)
    np.testing.assert_allclose(logloss, np.mean(np.logaddexp(0, z.astype(np.float64)) - y * z), rtol=1e-12)


def test_readers_finishing_out_of_order_keep_the_batches_order(tiny, dataset):
    source, steps, state = built(tiny, dataset, 2)
    rng = random.Random(3)

    def slow(i):
        time.sleep(rng.random() * 0.01)
        return source.train_batch(i)

    want = list(one_at_a_time(steps, state, map(source.train_batch, range(12))))
    got = [p for p, _, _ in eval_scores(steps, state, source, batches=Indexed(12, slow), readers=6, depth=6)]
    for p, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(p, w)


def test_a_damaged_held_out_shard_names_its_file_and_row(tiny, dataset, tmp_path):
    import shutil

    shutil.copytree(dataset, tmp_path / "ds")
    labels = np.load(tmp_path / "ds" / "val" / "00003" / "labels.npy", mmap_mode="r+")
    labels[5] = 3.0  # the split's row 305: evaluation batch 4
    labels.flush()
    source, steps, state = built(tiny, tmp_path / "ds", 1)
    with pytest.raises(BinaryFormatError, match=r"val/00003/labels.npy: row 305 .*evaluation batch 4"):
        evaluate(steps, state, source, readers=3)


def test_training_evaluating_and_exporting_leave_no_file_open(tiny, dataset, tmp_path):
    """A run, its evaluation and its export close the dataset's shard files they opened: a
    notebook's calls each left 6 open here (up to 384 on a large dataset)."""
    import gc
    import os

    import dlrm_jax

    cfg = tiny("mesh.devices=2", "train.batch_size=64", "train.steps=3", "data.source=binary", f"data.path={dataset}")
    open_files = lambda: len(os.listdir("/proc/self/fd"))
    quiet = dict(log=lambda *_: None)
    dlrm_jax.train_and_evaluate(cfg, tmp_path / "warm", **quiet)  # (the libraries' own files, opened once)
    gc.collect()  # (what the tests before left to be collected)
    before = open_files()
    dlrm_jax.train_and_evaluate(cfg, tmp_path / "run", **quiet)
    dlrm_jax.evaluate_run(tmp_path / "run", **quiet)
    dlrm_jax.export_run(tmp_path / "run", tmp_path / "tables", **quiet)
    assert open_files() == before
