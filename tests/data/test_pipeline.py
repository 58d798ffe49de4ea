"""The input pipeline: steps in order from several threads, errors where their step comes,
bounded look-ahead; training on a binary dataset through it resumes bitwise; `bench input`."""

import json
import os
import threading
import time

import jax
import numpy as np
import pytest

from dlrm_jax.bench.input import bench_input
from dlrm_jax.data.pipeline import MAX_AUTO_READERS, InputPipeline, input_readers
from dlrm_jax.data.preprocessing.criteo_preprocess import preprocess_criteo
from dlrm_jax.data.sources.criteo import write_criteo_tsv
from dlrm_jax.data.sources.synthetic import SyntheticGenerator
from dlrm_jax.parallel.launch import LOCAL_PROCESSES_ENV, cores_of_this_process
from dlrm_jax.train.trainer import train_and_evaluate
from tests.helpers import QUIET


def test_steps_come_in_order_whatever_thread_finishes_first():
    def read(step):
        time.sleep(0.001 * (step % 3))  # later steps often finish first
        return step * 10

    with InputPipeline(read, range(3, 40), to_device=lambda x: -x, readers=4, depth=6) as p:
        got = [(i.step, i.host, i.device) for i in p]
    assert got == [(s, 10 * s, -10 * s) for s in range(3, 40)]
    assert p.times.steps == 37 and set(p.times.take()) == {"input_read_ms", "input_h2d_ms", "input_wait_ms"}


def test_a_readers_error_is_raised_at_its_step_and_lookahead_is_bounded():
    started, lock = [], threading.Lock()

    def read(step):
        with lock:
            started.append(step)
        if step == 5:
            raise ValueError("bad row in step 5")
        return step

    p = InputPipeline(read, range(100), readers=2, depth=3)
    assert [next(p).step for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="step 5"):
        next(p)
    p.close()
    assert max(started) <= 5 + 3  # never more than depth steps past the one taken


def test_every_reader_has_a_step_however_small_the_prefetch():
    """Each reader takes a whole step: with data.prefetch below data.readers, the readers past
    it would wait idle."""
    started, go = [], threading.Event()

    def read(step):
        started.append(step)
        go.wait(10)
        return step

    with InputPipeline(read, range(20), readers=6, depth=2) as p:
        deadline = time.time() + 10
        while len(started) < 6 and time.time() < deadline:
            time.sleep(0.01)
        assert sorted(started) == list(range(6))
        go.set()
        assert [i.step for i in p] == list(range(20))


def test_auto_readers_are_this_processs_share_of_the_cores_less_two(monkeypatch):
    assert input_readers(3) == 3
    assert [input_readers("auto", cores=c) for c in (1, 2, 4, 16, 64)] == [2, 2, 2, 14, MAX_AUTO_READERS]
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(32)))
    monkeypatch.setenv(LOCAL_PROCESSES_ENV, "4")  # the supervisor started 4 processes on this host
    assert cores_of_this_process() == 8 and input_readers("auto") == 6
    monkeypatch.delenv(LOCAL_PROCESSES_ENV)
    assert cores_of_this_process() == 32 and input_readers("auto") == MAX_AUTO_READERS
    with InputPipeline(lambda s: s, range(0), readers="auto") as p:
        assert p.readers == MAX_AUTO_READERS


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    gen = SyntheticGenerator(
        seed=1,
        num_dense=13,
        table_rows=(40, 300, 7, 1000) * 6 + (5, 60),
        bag_sizes=(1,) * 26,
        zipf_exponent=1.1,
        positive_rate=0.3,
    )
    write_criteo_tsv(tmp / "day.tsv", gen.raw(0, 0, 0, 3000))
    preprocess_criteo(
        [str(tmp / "day.tsv")], str(tmp / "ds"), val_fraction=0.1, shard_mb=0.1, workers=1, progress=False
    )
    return tmp / "ds"


@pytest.mark.slow
def test_binary_training_through_the_pipeline_resumes_bitwise(tiny, tmp_path, dataset):
    """Cut at step 28 and resumed, the run logs the losses and scores of one that was not;
    the cut run reads in worker processes (data.reader_processes), the whole one in threads."""

    def cfg(steps, *more):
        return tiny(
            *more,
            "data.source=binary",
            f"data.path={dataset}",
            "mesh.devices=4",
            f"train.steps={steps}",
            "train.log_every=1",
            "train.checkpoint_every=4",
            "data.shuffle_block=16",
            "data.readers=3",
            "data.prefetch=5",
        )

    whole = train_and_evaluate(cfg(60), tmp_path / "whole", **QUIET)  # 60 x 64 rows: past an epoch
    train_and_evaluate(cfg(28, "data.reader_processes=true"), tmp_path / "cut", **QUIET)
    resumed = train_and_evaluate(cfg(60, "data.reader_processes=true"), tmp_path / "cut", **QUIET)
    lines = [
        [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        for d in (tmp_path / "whole", tmp_path / "cut")
    ]
    assert [e["loss"] for e in lines[0]] == [e["loss"] for e in lines[1]]
    assert (resumed.auc, resumed.logloss) == (whole.auc, whole.logloss)
    assert all(e["input_wait_ms"] >= 0 and e["input_read_ms"] > 0 for e in lines[0])


@pytest.mark.slow
def test_bench_input_reports_every_case_beside_the_step(tiny, tmp_path, dataset):
    cfg = tiny("data.source=binary", f"data.path={dataset}", "mesh.devices=2", "train.batch_size=128")
    report = bench_input(cfg, steps=4, step_steps=2, output=str(tmp_path / "in.json"), **QUIET)
    cases = json.loads((tmp_path / "in.json").read_text())["cases"]
    assert [(c["source"], c["shuffle"]) for c in cases] == [("binary", True), ("binary", False), ("synthetic", None)]
    for c in cases:
        assert c["batch"] == 128 and c["samples_per_s"] > 0 and c["step_samples_per_s"] > 0
        assert np.isclose(c["ratio"], c["samples_per_s"] / c["step_samples_per_s"])
        assert c["gil_wait"]["busy"]["wakes"] >= 1 and c["gil_wait"]["idle"]["wakes"] >= 1
    assert report["machine"]["device_count"] == len(jax.devices())


def test_bench_input_benches_the_criteo_text_it_is_given(tiny, tmp_path, dataset):
    """Before: data.source=criteo benched synthetic data alone, without a word for the text."""
    cards = f"data.cardinalities={[40, 300, 7, 1000] * 6 + [5, 60]}"
    cfg = tiny("data.source=criteo", f"data.path={dataset.parent / 'day.tsv'}", cards, "mesh.devices=1")
    bench_input(cfg, steps=3, step_steps=0, output=str(tmp_path / "in.json"), **QUIET)
    cases = json.loads((tmp_path / "in.json").read_text())["cases"]
    assert [c["source"] for c in cases] == ["criteo", "synthetic"] and cases[0]["samples_per_s"] > 0


def test_a_run_whose_data_was_replaced_is_not_exported_with_the_new_datas_rules(tiny, tmp_path, dataset):
    """Before: export --serving read the vocabularies of whatever data.path held now (every
    score of the export differed from the trained model's, without a word), and eval scored
    other data as the run's own."""
    import shutil

    from dlrm_jax.train.saved_run import evaluate_run
    from dlrm_jax.train.serving_export import export_serving

    lines = (dataset.parent / "day.tsv").read_text().splitlines()
    other = lambda v: f"{int(v, 16) ^ 0x1234567:08x}" if v else v  # other values, counted alike
    (tmp_path / "a.tsv").write_text("".join(line + "\n" for line in lines))
    (tmp_path / "b.tsv").write_text(
        "".join("\t".join(f[:14] + [other(v) for v in f[14:]]) + "\n" for f in (line.split("\t") for line in lines))
    )  # the same shards (ids by frequency), other vocabularies
    data, run = tmp_path / "data", tmp_path / "run"
    prep = dict(val_fraction=0.1, shard_mb=0.1, workers=1, progress=False)
    preprocess_criteo([str(tmp_path / "a.tsv")], str(data), **prep)
    train_and_evaluate(tiny("data.source=binary", f"data.path={data}", "mesh.devices=1", "train.steps=2"), run, **QUIET)
    shutil.rmtree(data)
    preprocess_criteo([str(tmp_path / "b.tsv")], str(data), **prep)
    with pytest.raises(
        ValueError, match=f"run dir {run} trained on other data .* export with data.path set to the data"
    ):
        export_serving(run, tmp_path / "art", **QUIET)
    assert not (tmp_path / "art").exists()
    logs = []
    evaluate_run(run, log=logs.append)
    assert [line for line in logs if line.startswith(f"warning: run dir {run} trained on other data")], logs
    shutil.rmtree(data)  # its own data, preprocessed again: exported
    preprocess_criteo([str(tmp_path / "a.tsv")], str(data), **prep)
    export_serving(run, tmp_path / "art", **QUIET)


def test_criteo_text_grown_under_a_run_is_named_at_its_resume(tiny, tmp_path, dataset):
    """Before: lines appended to data.source=criteo's file between runs were trained on without
    a word, the held-out lines of before among them (binary data was already checked)."""
    from dlrm_jax.train.rundir import RunDirError

    text = (dataset.parent / "day.tsv").read_text().splitlines(keepends=True)
    day = tmp_path / "day.tsv"
    day.write_text("".join(text[:2000]))
    cards = f"data.cardinalities={[40, 300, 7, 1000] * 6 + [5, 60]}"
    common = ("data.source=criteo", f"data.path={day}", cards, "mesh.devices=1", "train.checkpoint_every=2")
    train_and_evaluate(tiny(*common, "train.steps=2"), tmp_path / "steps", **QUIET)
    train_and_evaluate(tiny(*common, "train.epochs=0.05"), tmp_path / "epochs", **QUIET)
    day.write_text("".join(text))
    logs = []
    train_and_evaluate(tiny(*common, "train.steps=4"), tmp_path / "steps", log=logs.append)
    assert [line for line in logs if "trained on other data" in line and "bytes" in line], logs
    with pytest.raises(RunDirError, match="a run counted in epochs .* cannot go on over it"):
        train_and_evaluate(tiny(*common, "train.epochs=0.1"), tmp_path / "epochs", **QUIET)
    # its serving rules hash the values, reading nothing of the data: exported all the same
    from dlrm_jax.train.serving_export import export_serving

    assert export_serving(tmp_path / "steps", tmp_path / "art", **QUIET) == 4


def test_a_dataset_s_digest_with_a_shard_gone(tmp_path, dataset):
    """Hosts may hold only the shards they read: the digest they compare leaves the shards'
    checksums out (it read every shard.json: FileNotFoundError before training), and the run
    dir's record of a copy missing a shard is another digest, not a crash."""
    import shutil

    from dlrm_jax.data.shards import content_digest

    shutil.copytree(dataset, tmp_path / "part")
    shutil.rmtree(tmp_path / "part" / "train" / "00000")
    assert content_digest(tmp_path / "part", shards=False) == content_digest(dataset, shards=False)
    assert content_digest(tmp_path / "part") != content_digest(dataset)
    # A dataset of this version records its headers' columns (serving reads records without one
    # by them): the same data, preprocessed before that record, is the same data.
    import json

    shutil.copytree(dataset, tmp_path / "named")
    meta = json.loads((tmp_path / "named" / "meta.json").read_text())
    (tmp_path / "named" / "meta.json").write_text(json.dumps({**meta, "header_columns": ["y", "a"]}))
    assert content_digest(tmp_path / "named") == content_digest(dataset)


def test_the_gil_wait_probe_sees_a_thread_that_holds_the_gil():
    """A thread running Python without a pause keeps the GIL for the switch interval (here 50
    ms) each time: the probe's wake-ups wait for it, far beyond the OS's own latency."""
    import sys

    from dlrm_jax.bench.gil_wait import GilWait

    old, stop = sys.getswitchinterval(), threading.Event()

    def hog():
        while not stop.is_set():
            pass

    sys.setswitchinterval(0.05)
    try:
        with GilWait(idle_s=0.05) as probe:
            hogging = threading.Thread(target=hog)
            hogging.start()
            time.sleep(0.4)
            stop.set()
            hogging.join()
    finally:
        sys.setswitchinterval(old)
    got = probe.result()
    assert got["busy"]["wakes"] >= 1 and got["idle"]["wakes"] >= 1
    assert got["busy"]["p90_ms"] > 10 > got["idle"]["p50_ms"]


def test_reading_memory_does_not_grow_with_the_dataset(tiny, tmp_path_factory, dataset):
    """Ten times the rows (in as many shards, ten times larger): the same allocations to open
    the dataset and read 30 shuffled batches (nothing per epoch or per row is held; reads are
    pread's into the batch)."""
    import tracemalloc

    from dlrm_jax.data.sources import resolve_data_config
    from dlrm_jax.data.sources.binary import BinarySource

    tmp = tmp_path_factory.mktemp("tenfold")
    day = (dataset.parent / "day.tsv").read_bytes()
    (tmp / "days.tsv").write_bytes(day * 10)
    preprocess_criteo(
        [str(tmp / "days.tsv")], str(tmp / "ds"), val_fraction=0.1, shard_mb=1.0, workers=1, progress=False
    )
    peaks = []
    for path in (dataset, tmp / "ds"):
        cfg = resolve_data_config(
            tiny("data.source=binary", f"data.path={path}", "train.batch_size=256", "data.shuffle_block=16")
        )
        tracemalloc.start()
        source = BinarySource(cfg)
        for step in range(30):
            source.train_batch(step)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] < 1.5 * peaks[0], peaks


@pytest.mark.slow
def test_a_run_resumed_over_another_dataset_says_so_and_an_epoch_run_is_refused(tiny, tmp_path, dataset):
    """Before: a dataset replaced under a run (the same cardinalities, another val split) was
    resumed without a word, and a run counted in epochs called 36 steps of one dataset and 4
    of another '2 epochs', its best evaluation chosen across two val splits."""
    import shutil

    from dlrm_jax.train.rundir import RunDirError

    data, day = tmp_path / "data", str(dataset.parent / "day.tsv")
    preprocess_criteo([day], str(data), val_fraction=0.1, vocab_from="all", shard_mb=0.1, workers=1, progress=False)
    common = ("data.source=binary", f"data.path={data}", "mesh.devices=1", "train.checkpoint_every=2")
    train_and_evaluate(tiny(*common, "train.steps=2"), tmp_path / "steps", **QUIET)
    train_and_evaluate(tiny(*common, "train.epochs=0.05"), tmp_path / "epochs", **QUIET)
    shutil.rmtree(data)
    preprocess_criteo([day], str(data), val_fraction=0.5, vocab_from="all", shard_mb=0.1, workers=1, progress=False)
    logs = []
    train_and_evaluate(tiny(*common, "train.steps=4"), tmp_path / "steps", log=logs.append)
    warned = [line for line in logs if line.startswith(f"warning: run dir {tmp_path / 'steps'} trained on other data")]
    assert len(warned) == 1 and "2,700 train and 300 val rows" in warned[0] and "1,500 train" in warned[0], logs
    with pytest.raises(RunDirError, match="a run counted in epochs .* cannot go on over it"):
        train_and_evaluate(tiny(*common, "train.epochs=0.1"), tmp_path / "epochs", **QUIET)
    shutil.rmtree(data)  # the same data preprocessed again the same way is the same dataset,
    (tmp_path / "elsewhere").mkdir()  # from wherever its input lies (meta.json names its folder)
    shutil.copy(day, tmp_path / "elsewhere" / "day.tsv")
    again = [str(tmp_path / "elsewhere" / "day.tsv")]
    preprocess_criteo(again, str(data), val_fraction=0.5, vocab_from="all", shard_mb=0.1, workers=1, progress=False)
    logs.clear()
    train_and_evaluate(tiny(*common, "train.steps=6"), tmp_path / "steps", log=logs.append)
    assert not [line for line in logs if "other data" in line], logs
