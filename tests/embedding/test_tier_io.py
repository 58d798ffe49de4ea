"""The disk tier's I/O: coalesced reads many in flight, reads made ahead, writes made behind."""

import errno
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm_jax.embedding.tiers import chunk_io
from dlrm_jax.embedding.tiers.dram_cache import HostCache
from dlrm_jax.embedding.tiers.format import TierError
from dlrm_jax.embedding.tiers.store import TierStore
from dlrm_jax.embedding.tiers.tier_io import ReadAhead, WriteBehind
from tests.embedding.tier_store_cases import CHUNK_ROWS, TABLES, assert_equal, new_values, reference
from tests.helpers import examples


@pytest.fixture
def store(tmp_path):
    s = TierStore.create(tmp_path / "tier", TABLES, reference, CHUNK_ROWS)
    yield s
    s.close()


@settings(max_examples=examples(40), deadline=None)
@given(
    rows=st.lists(st.integers(0, 36), min_size=1, max_size=60),
    gap=st.sampled_from([0, 64, 4096]),
    threads=st.sampled_from([1, 3, 32]),
)
def test_coalesced_reads_return_every_row(tmp_path_factory, rows, gap, threads):
    s = TierStore.create(tmp_path_factory.mktemp("t") / "tier", TABLES, reference, CHUNK_ROWS)
    s._files.gap_bytes, s._files.threads = gap, threads
    rows = np.array(rows)
    got = s.read("cat_0", rows)
    want = reference("cat_0", 0, 37)
    assert_equal(got, {k: v[rows] for k, v in want.items()})
    distinct = np.unique(rows)
    chunks = len(np.unique(distinct // CHUNK_ROWS))
    arrays = 3  # two fields and their row checksums
    if gap == 4096:  # 64-byte rows: a chunk's rows are one request per array
        assert s.io_stats.reads == arrays * chunks
    else:  # neighbours join, never more requests than rows
        assert arrays * chunks <= s.io_stats.reads <= arrays * len(distinct)
    s.close()


def test_writes_join_adjacent_rows_and_read_back(store):
    rows = np.array([3, 4, 5, 9, 17, 16])
    values = new_values(store, "cat_0", len(rows), seed=1)
    store.write("cat_0", rows, values)
    # chunks of 8: [3, 4, 5] one request, [9], [16, 17]: 3 per array, 2 fields and their checksums
    assert store.io_stats.writes == 9
    assert_equal(store.read("cat_0", rows), values)


def test_a_failed_read_names_the_file_and_rows(store, monkeypatch):
    def broken(fd, buffers, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(chunk_io.os, "preadv", broken)
    with pytest.raises(TierError) as e:
        store.read("cat_0", np.array([9, 10, 11]))
    said = str(e.value)
    assert "cat_0/" in said and "Input/output error" in said and "cat_0 rows 9..11" in said and "\n" not in said


def test_a_short_read_is_an_error_never_zeros(store, tmp_path):
    store.read("cat_0", np.array([0]))  # the files are open now
    chunk = tmp_path / "tier/work/cat_0/values/c.1.0"
    os.truncate(chunk, 100)  # cut short behind the store's back
    with pytest.raises(TierError) as e:
        store.read("cat_0", np.array([8, 12]))
    said = str(e.value)
    assert str(chunk) in said and "short read" in said and "rows 8..12" in said


def test_write_behind_errors_reach_the_next_call(store, monkeypatch):
    writer = WriteBehind(store)

    def full(table, rows, values):
        raise TierError(store.root / "work" / table, "no space left on device", errno.ENOSPC)

    monkeypatch.setattr(store, "write", full)
    writer.put("cat_1", np.array([2]), new_values(store, "cat_1", 1, seed=0))
    with pytest.raises(TierError, match="no space left"):
        writer.drain()
    monkeypatch.undo()  # the run stops: every later call says so, nothing is read past it
    with pytest.raises(TierError, match="no space left"):
        writer.pending("cat_1", np.array([2]))
    with pytest.raises(TierError, match="no space left"):
        writer.close()


# One op: ("put", rows): newer rows from the devices (dirty in DRAM); ("stage", rows): a read
# begun ahead for a later get; ("get", rows): a step takes rows, with the oldest staged read.
OPS = st.lists(
    st.tuples(st.sampled_from(["put", "stage", "get"]), st.sets(st.integers(0, 36), min_size=1, max_size=12)),
    min_size=1,
    max_size=30,
)


@settings(max_examples=examples(60), deadline=None)
@given(ops=OPS, capacity=st.sampled_from([3, 8, 40]), policy=st.sampled_from(["lru", "lfu"]))
def test_rows_read_ahead_or_queued_are_never_stale(tmp_path_factory, ops, capacity, policy):
    """Against a dict of each row's newest contents: a cache whose evictions are written
    behind and whose misses come from reads made ahead (stale ones among them: written after
    they were read) returns the newest rows; its DRAM holds the same rows, in the same order
    of eviction, as a cache that reads and writes the tier at once (reads made ahead never
    evict anything before their step)."""
    root = tmp_path_factory.mktemp("t")
    plain_store = TierStore.create(root / "plain", TABLES, reference, CHUNK_ROWS)
    store = TierStore.create(root / "ahead", TABLES, reference, CHUNK_ROWS)
    writer, ahead = WriteBehind(store), ReadAhead(store)
    cache = HostCache(store, "cat_0", capacity, policy, writer)
    plain = HostCache(plain_store, "cat_0", capacity, policy)
    newest = reference("cat_0", 0, 37)
    staged = []
    for k, (op, rows) in enumerate(ops):
        rows = np.array(sorted(rows))
        if op == "put":
            values = new_values(store, "cat_0", len(rows), seed=k)
            cache.put(rows, values)
            plain.put(rows, values)
            for f, v in values.items():
                newest[f][rows] = v
        elif op == "stage":
            staged.append(ahead.submit({"cat_0": rows}))
        else:
            reads = staged.pop(0) if staged else None
            got = cache.get(rows, ahead.take(reads).get("cat_0"))
            assert_equal(got, {f: v[rows] for f, v in newest.items()})
            assert_equal(plain.get(rows), {f: v[rows] for f, v in newest.items()})
        np.testing.assert_array_equal(cache.row_of, plain.row_of)
    cache.flush()
    writer.drain()
    assert_equal(store.read("cat_0", np.arange(37)), newest)
    writer.close()
    ahead.close()
    store.close()
    plain_store.close()


def test_a_row_written_after_its_read_ahead_is_taken_again(store):
    """Row 1 is read ahead, then updated, evicted and written to the disk before its step:
    the step gets the update, not the staged copy."""
    writer, ahead = WriteBehind(store), ReadAhead(store)
    cache = HostCache(store, "cat_0", 2, "lru", writer)
    reads = ahead.submit({"cat_0": np.array([1, 2])})
    reads.result(timeout=60)  # read ahead before the update (a reader thread late under load read it after)
    update = new_values(store, "cat_0", 1, seed=3)
    cache.put(np.array([1]), update)
    cache.put(np.array([20, 21]), new_values(store, "cat_0", 2, seed=4))  # evicts row 1, dirty
    writer.drain()
    got = cache.get(np.array([1, 2]), ahead.take(reads)["cat_0"])
    assert_equal({k: v[:1] for k, v in got.items()}, update)
    assert_equal({k: v[1:] for k, v in got.items()}, {k: v[2:3] for k, v in reference("cat_0", 0, 37).items()})
    assert (cache.rows_read_ahead, cache.tier_rows_read) == (1, 1)  # row 2 staged, row 1 read again
    writer.close()
    ahead.close()
