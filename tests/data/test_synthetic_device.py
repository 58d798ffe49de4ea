"""The synthetic data's one definition, evaluated by numpy on the host and jitted on the devices.

Ids, counts and labels are integer arithmetic on hashed words (plus exactly rounded float32
multiplies) and the dense features come from one float32 log1p table, so the device batch must
equal the host batch bit for bit. Then: rows depend on their global index only, batches are a
pure function of (seed, stream, step), and the distributions are the documented ones.
"""

import numpy as np
import pytest
from jax.sharding import NamedSharding

from dlrm_jax.data.batch import PAD_ID
from dlrm_jax.data.sources import synthetic
from dlrm_jax.data.sources.synthetic import (
    EVAL_STREAM,
    TRAIN_STREAM,
    SyntheticGenerator,
    SyntheticSource,
    normalise_dense,
    zipf_ids,
)
from dlrm_jax.parallel.mesh import batch_spec, make_mesh
from tests.helpers import tiny_config

ROWS = (10, 97, 1000, 10000)
ONE_HOT, MULTI_HOT = (1, 1, 1, 1), (1, 4, 1, 3)
CARDS = "data.cardinalities=[10, 97, 1000, 10000]"
B = 512


def generator(bags=ONE_HOT, layout="permuted", seed=3):
    return SyntheticGenerator(
        seed=seed, num_dense=13, table_rows=ROWS, bag_sizes=bags, zipf_exponent=1.1, positive_rate=0.3, id_layout=layout
    )


@pytest.fixture(scope="module")
def multi_hot():
    return generator(MULTI_HOT)


@pytest.fixture(scope="module")
def big(multi_hot):
    """40,000 rows of the multi-hot generator, for the distribution checks."""
    return multi_hot.raw(TRAIN_STREAM, 0, 0, 40_000)


def batch_sharding(devices, hosts=0):
    mesh = make_mesh(devices, hosts)
    return NamedSharding(mesh, batch_spec(mesh))


def assert_batches_equal(device, host):
    for got, want in zip(device, host, strict=True):
        assert (got.shape, got.dtype) == (want.shape, want.dtype)
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("bags", [ONE_HOT, MULTI_HOT], ids=["one_hot", "multi_hot"])
@pytest.mark.parametrize("layout", ["permuted", "frequency_ordered"])
@pytest.mark.parametrize(("devices", "hosts"), [(1, 0), (8, 0), (8, 2)])
def test_device_batch_equals_host_batch(bags, layout, devices, hosts):
    gen, sharding = generator(bags, layout), batch_sharding(devices, hosts)
    device = gen.device_batches(TRAIN_STREAM, B, sharding)(7)
    host = gen.batch(TRAIN_STREAM, 7, 0, B)
    assert_batches_equal(device, host)
    for got, want in zip(device, host, strict=True):
        assert got.sharding.is_equivalent_to(sharding, got.ndim)
        for shard in got.addressable_shards:  # each device holds (and made) its own rows
            assert shard.data.shape[0] == B // devices
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])


@pytest.mark.parametrize("bags", [ONE_HOT, MULTI_HOT], ids=["one_hot", "multi_hot"])
def test_the_gpus_one_program_makes_the_same_batch(bags, monkeypatch):
    """GPUs make a batch in one program, CPUs in five (``FIVE_PROGRAMS_ON``): the same bits."""
    monkeypatch.setattr(synthetic, "FIVE_PROGRAMS_ON", ())
    gen = generator(bags)
    for devices, hosts in [(1, 0), (8, 2)]:
        make = gen.device_batches(TRAIN_STREAM, B, batch_sharding(devices, hosts))
        assert make.whole is not None
        assert_batches_equal(make(7), gen.batch(TRAIN_STREAM, 7, 0, B))


def test_source_device_batches_equal_train_batch():
    cfg = tiny_config("train.batch_size=512", CARDS, "data.bag_sizes=[1, 4, 1, 3]")
    source = SyntheticSource(cfg)
    make = source.device_batches(batch_sharding(8))
    for step in (0, 3):
        assert_batches_equal(make(step), source.train_batch(step))


@pytest.mark.parametrize("bags", ["[1, 1, 1, 1]", "[1, 4, 1, 3]"], ids=["one_hot", "multi_hot"])
def test_train_ids_are_the_train_batchs_ids(bags):
    cfg = tiny_config("train.batch_size=512", CARDS, f"data.bag_sizes={bags}")
    for process in (0, 1):
        source = SyntheticSource(cfg, process, 2)
        for step in (0, 5):
            want = source.train_batch(step).ids
            got = source.train_ids(step)
            assert (got.shape, got.dtype) == (want.shape, want.dtype)
            np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_rows_do_not_depend_on_the_split(multi_hot, monkeypatch):
    whole = multi_hot.raw(TRAIN_STREAM, 2, 0, B)
    for lo, hi in [(0, 100), (100, 333), (333, B), (511, B)]:
        for got, want in zip(multi_hot.raw(TRAIN_STREAM, 2, lo, hi), whole, strict=True):
            np.testing.assert_array_equal(got, want[lo:hi])
    monkeypatch.setattr(synthetic, "CHUNK", 7)  # the host's evaluation block is no part of the data
    for got, want in zip(multi_hot.raw(TRAIN_STREAM, 2, 0, B), whole, strict=True):
        np.testing.assert_array_equal(got, want)
    cfg = tiny_config("train.batch_size=512", CARDS)
    full = SyntheticSource(cfg).train_batch(4)
    for p in range(4):  # process p of 4 feeds rows [p * B / 4, (p + 1) * B / 4)
        rows = slice(p * B // 4, (p + 1) * B // 4)
        for got, want in zip(SyntheticSource(cfg, p, 4).train_batch(4), full, strict=True):
            np.testing.assert_array_equal(got, want[rows])


def test_pure_function_of_seed_stream_and_step(multi_hot):
    make = multi_hot.device_batches(TRAIN_STREAM, B, batch_sharding(8))
    assert_batches_equal(make(11), multi_hot.batch(TRAIN_STREAM, 11, 0, B))
    assert_batches_equal(make(11), multi_hot.batch(TRAIN_STREAM, 11, 0, B))
    ids = multi_hot.raw(TRAIN_STREAM, 11, 0, B).ids
    for other in (
        multi_hot.raw(TRAIN_STREAM, 12, 0, B),
        multi_hot.raw(EVAL_STREAM, 11, 0, B),
        generator(MULTI_HOT, seed=4).raw(TRAIN_STREAM, 11, 0, B),
    ):
        assert np.mean(other.ids == ids) < 0.5  # only popular ids coincide


def test_labels_positive_rate_and_hidden_model(multi_hot, big):
    assert abs(big.labels.mean() - 0.3) < 0.02
    logits = multi_hot.logits(TRAIN_STREAM, 0, 0, len(big.labels))
    ranks = np.empty(len(logits))
    ranks[np.argsort(logits)] = np.arange(len(logits))
    pos = big.labels == 1
    auc = (ranks[pos].sum() - pos.sum() * (pos.sum() - 1) / 2) / (pos.sum() * (~pos).sum())
    assert auc > 0.85  # labels are Bernoulli(sigmoid(logit)) of a strong hidden model


def test_dense_counts(multi_hot, big):
    assert abs(big.missing.mean() - 0.1) < 0.01
    negative = big.counts < 0
    assert not negative[:, [0, *range(2, 13)]].any()
    assert abs(negative[:, 1].mean() - 0.05) < 0.01
    assert set(np.unique(big.counts[negative])) == {-1, -2, -3}
    counts = big.counts[:, 2:]  # floor(exp(N(mu, 1.4))): median floor(exp(mu)), log-spread 1.4
    median = np.floor(np.exp(multi_hot._count_mu[2:]))
    assert np.all(np.abs(np.median(counts, 0) - median) <= np.maximum(1, 0.15 * median))
    log = np.log(counts + 0.5)
    spread = np.percentile(log, 84, 0) - np.percentile(log, 16, 0)
    wide = multi_hot._count_mu[2:] > 2.5  # flooring squeezes small counts
    np.testing.assert_allclose(spread[wide], 2 * 1.4, rtol=0.1)
    np.testing.assert_array_equal(normalise_dense(big.counts, big.missing)[big.missing], 0.0)


def test_bags_pad_ids_and_ranges(big):
    starts = np.cumsum((0, *MULTI_HOT))
    for f, (rows, bag) in enumerate(zip(ROWS, MULTI_HOT, strict=True)):
        block = big.ids[:, starts[f] : starts[f] + bag]
        valid = block != PAD_ID
        assert np.all((block[valid] >= 0) & (block[valid] < rows))
        lengths = valid.sum(1)
        np.testing.assert_array_equal(valid, np.arange(bag) < lengths[:, None])  # PAD past the end
        if bag == 1:
            assert valid.all()
        else:  # lengths uniform in [0, bag]
            share = np.bincount(lengths, minlength=bag + 1) / len(lengths)
            np.testing.assert_allclose(share, 1 / (bag + 1), atol=0.015)


def test_id_popularity(big):
    ids = big.ids[:, 5]  # feature 2: 1000 rows, one-hot, zipf 1.1
    top = np.sort(np.bincount(ids, minlength=1000))[::-1]
    for r in (1, 10, 100):  # bounded power law: P(rank < r) = (1 - (r+1)**-0.1) / (1 - 1001**-0.1)
        expected = (1 - (r + 1) ** -0.1) / (1 - 1001**-0.1)
        np.testing.assert_allclose(top[:r].sum() / len(ids), expected, rtol=0.03)
    assert set(np.argsort(np.bincount(ids))[::-1][:10]) != set(range(10))  # hot ids scattered
    ordered = generator(MULTI_HOT, "frequency_ordered").raw(TRAIN_STREAM, 0, 0, len(ids)).ids[:, 5]
    by_id = np.bincount(ordered, minlength=1000)
    assert by_id.argmax() == 0 and np.all(np.diff(by_id[:6]) < 0)  # id 0 the most frequent
    np.testing.assert_array_equal(np.sort(by_id)[::-1], top)  # the permutation is a bijection


def test_zipf_ids_helper():
    rng = np.random.default_rng(0)
    ids = zipf_ids(rng, 1000, 1.1, (20_000,), feature=2, permuted=False)
    assert ids.min() >= 0 and ids.max() < 1000 and np.bincount(ids).argmax() == 0
    scattered = zipf_ids(rng, 1000, 1.1, 20_000, feature=2)
    assert scattered.max() < 1000 and np.bincount(scattered).argmax() != 0
