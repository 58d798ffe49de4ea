"""Property-based tests of routing and bucketing, the heart of the exchange.

For any ids (random, all equal, all distinct, empty bags, table edges) and any layout:
every id is owned by exactly one device at a row inside that device's shard; each distinct
(owner, row) is requested once; every request finds its own answer in the reply; and the
counts say exactly when a capacity is too small; and the rounds that replace an overflowing
exchange send every request exactly once, within capacity, each row in one round everywhere.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm_jax import sorting
from dlrm_jax.data.batch import PAD_ID
from dlrm_jax.embedding.exchange import routing
from dlrm_jax.embedding.exchange.routing import (
    Buckets,
    Window,
    bucket,
    next_round_limit,
    requests_below,
    route,
    send_buffer,
    slot_index,
)
from dlrm_jax.embedding.plan.layout import KIND_BLOCK, KIND_CYCLIC, KIND_FIXED
from dlrm_jax.sorting import packs, sort_with_order
from tests.helpers import examples

# Jitted, as the exchange runs them: one compilation per example's shapes, where eager calls
# compiled every primitive on its own (700 compilations, 80% of these tests' time).
route = jax.jit(route, static_argnums=5)
bucket = jax.jit(bucket, static_argnums=(3, 4))
send_buffer = jax.jit(send_buffer, static_argnums=(2, 3, 4))
slot_index = jax.jit(slot_index)
next_round_limit = jax.jit(next_round_limit, static_argnums=(2, 3))
requests_below = jax.jit(requests_below, static_argnums=2)


def first_window(capacity: int, n: int) -> Window:
    """One exchange of each owner's first ``capacity`` requests."""
    return Window(jnp.zeros(n, jnp.int32), jnp.full(n, capacity, jnp.int32))


@st.composite
def layouts(draw):
    n = draw(st.sampled_from([1, 2, 3, 4, 8]))
    rows = draw(st.integers(1, 40))
    kind = draw(st.sampled_from([KIND_FIXED, KIND_BLOCK, KIND_CYCLIC]))
    block = -(-rows // n)
    device = draw(st.integers(0, n - 1)) if kind == KIND_FIXED else 0
    offset = draw(st.integers(0, 5))
    local_rows = offset + (rows if kind == KIND_FIXED else block) + draw(st.integers(0, 3))
    return n, rows, kind, block, device, offset, local_rows


@st.composite
def id_batches(draw, rows):
    shape = (draw(st.integers(1, 6)), draw(st.integers(1, 4)))
    style = draw(st.sampled_from(["random", "equal", "distinct", "edges", "empty"]))
    if style == "equal":
        ids = np.full(shape, draw(st.integers(0, rows - 1)))
    elif style == "distinct":
        ids = np.arange(np.prod(shape)).reshape(shape) % rows
    elif style == "edges":
        ids = np.array(
            draw(
                st.lists(
                    st.sampled_from([0, rows - 1, PAD_ID]), min_size=shape[0] * shape[1], max_size=shape[0] * shape[1]
                )
            )
        ).reshape(shape)
    elif style == "empty":
        ids = np.full(shape, PAD_ID)
    else:
        ids = np.array(
            draw(st.lists(st.integers(PAD_ID, rows - 1), min_size=shape[0] * shape[1], max_size=shape[0] * shape[1]))
        ).reshape(shape)
    return ids.astype(np.int32)


@settings(max_examples=examples(20))
@given(data=st.data())
def test_routing_and_bucketing(data):
    n, rows, kind, block, device, offset, local_rows = data.draw(layouts())
    ids = data.draw(id_batches(rows))
    v = ids.shape[1]
    params = [jnp.full((v,), x, jnp.int32) for x in (kind, device, offset, block)]
    owner, row, valid = (np.asarray(a) for a in route(jnp.asarray(ids), *params, n))

    # Ownership: a bijection from the table's ids onto (owner, row) places inside the shards.
    all_ids = jnp.arange(rows, dtype=jnp.int32)[:, None]
    o_all, r_all, _ = (np.asarray(a).ravel() for a in route(all_ids, *[p[:1] for p in params], n))
    assert ((0 <= o_all) & (o_all < n)).all() and ((offset <= r_all) & (r_all < local_rows)).all()
    assert len(set(zip(o_all.tolist(), r_all.tolist(), strict=True))) == rows
    np.testing.assert_array_equal(valid, ids != PAD_ID)

    b = bucket(jnp.asarray(owner), jnp.asarray(row), jnp.asarray(valid), n, local_rows)
    wanted = {(o, r) for o, r, ok in zip(owner.ravel(), row.ravel(), valid.ravel(), strict=True) if ok}
    counts = np.asarray(b.counts)
    assert counts.sum() == len(wanted)
    for d in range(n):
        assert counts[d] == sum(1 for o, _ in wanted if o == d)

    for capacity in (1, max(1, int(counts.max(initial=0))), ids.size):
        buf = np.asarray(send_buffer(b, first_window(capacity, n), capacity, n, local_rows))
        fits = counts.max(initial=0) <= capacity
        sent = {(d, int(r)) for d in range(n) for r in buf[d] if r != local_rows}
        if fits:
            assert sent == {(int(o), int(r)) for o, r in wanted}  # each distinct request once
            assert all(len(set(buf[d][buf[d] != local_rows])) == (buf[d] != local_rows).sum() for d in range(n))
        else:
            assert sent < {(int(o), int(r)) for o, r in wanted}
        # Every usable request finds its own row at (owner, rank) of the reply.
        o, k, usable = (np.asarray(a) for a in slot_index(b, first_window(capacity, n)))
        for i in np.flatnonzero(usable):
            assert (o[i], buf[o[i], k[i]]) == (owner.ravel()[i], row.ravel()[i])
        if fits:
            np.testing.assert_array_equal(usable, valid.ravel())


@pytest.mark.slow
@settings(max_examples=examples(15))
@given(data=st.data())
def test_rounds_send_each_request_once_and_each_row_in_one_round(data):
    """Several devices' buckets for the same owners, a capacity too small: the agreed rounds
    (pmin of the proposals, as the exchange computes it) terminate, never exceed the capacity,
    send every request exactly once, and put each owner row in the same round on every device."""
    n, rows, kind, block, device, offset, local_rows = data.draw(layouts())
    params = [jnp.full((1,), x, jnp.int32) for x in (kind, device, offset, block)]
    buckets, wanted = [], []
    for _ in range(data.draw(st.integers(1, 4))):  # requesting devices
        ids = data.draw(id_batches(rows)).reshape(-1, 1)
        owner, row, valid = route(jnp.asarray(ids), *params, n)
        buckets.append(bucket(owner, row, valid, n, local_rows))
        wanted.append(
            {(int(o), int(r)) for o, r, ok in zip(np.ravel(owner), np.ravel(row), np.ravel(valid), strict=True) if ok}
        )
    capacity = data.draw(st.integers(1, 3))
    done = [np.zeros(n, np.int32) for _ in buckets]
    sent = [set() for _ in buckets]
    round_of_row = {}
    for round_no in range(sum(len(w) for w in wanted) + 1):
        limit = np.min(
            [
                np.asarray(next_round_limit(b, jnp.asarray(d), capacity, local_rows))
                for b, d in zip(buckets, done, strict=True)
            ],
            axis=0,
        )
        for i, b in enumerate(buckets):
            end = np.asarray(requests_below(b, jnp.asarray(limit), local_rows))
            assert (end - done[i] <= capacity).all() and (end >= done[i]).all()
            window = (jnp.asarray(done[i]), jnp.asarray(end))
            buf = np.asarray(send_buffer(b, Window(*window), capacity, n, local_rows))
            for o in range(n):
                for r in buf[o][buf[o] != local_rows].tolist():
                    assert (o, r) not in sent[i]  # never sent twice
                    sent[i].add((o, r))
                    assert round_of_row.setdefault((o, r), round_no) == round_no  # one round everywhere
            done[i] = end
        if (limit == local_rows).all():
            break
    else:
        raise AssertionError("rounds did not terminate")
    assert sent == wanted


@settings(max_examples=examples(30))
@given(
    seed=st.integers(0, 2**16), k=st.integers(0, 40), pad=st.integers(0, 5), rows=st.sampled_from([1, 7, 50, 2**31 - 2])
)
def test_split_hot_matches_a_lookup_table(seed, k, pad, rows):
    """Every id is hot exactly when its (table, id) pair is in the hot set, at the pair's row
    in the sorted keys; table edges (first, last row, ids near 2**31) included."""
    from dlrm_jax.embedding.hot.index import hot_index, hot_keys, split_hot

    rng = np.random.default_rng(seed)
    v = 5
    table = rng.integers(0, 3, v).astype(np.int32)
    picks = {(int(rng.integers(0, 3)), int(rng.choice([0, rows - 1, rng.integers(0, rows)]))) for _ in range(k)}
    keys = hot_keys([np.array(sorted(i for t, i in picks if t == tt), np.int64) for tt in range(3)], len(picks) + pad)
    pairs = sorted(picks)
    ids = rng.integers(0, rows, (7, v)).astype(np.int32)
    ids[rng.random(ids.shape) < 0.2] = PAD_ID
    ids[0, :] = rows - 1  # the table's last row
    ids[1, :] = 0  # its first
    index, seeds = hot_index(keys)
    hot_row, cold = split_hot(jnp.asarray(ids), jnp.asarray(table), jnp.asarray(index), jnp.asarray(seeds))
    row_of = {p: i for i, p in enumerate(pairs)}
    want_row = np.array(
        [[row_of.get((int(table[j]), int(x)), -1) if x != PAD_ID else -1 for j, x in enumerate(r)] for r in ids]
    )
    np.testing.assert_array_equal(np.asarray(hot_row), want_row)
    np.testing.assert_array_equal(np.asarray(cold), np.where(want_row >= 0, PAD_ID, ids))


@settings(max_examples=examples(30))
@given(seed=st.integers(0, 2**16), buckets=st.sampled_from([1, 2, 8, 32]), load=st.floats(0.0, 0.9))
def test_cuckoo_placement_puts_every_key_in_one_of_its_buckets(seed, buckets, load):
    """Up to 90% full (the index stays under 50%): every key gets its own entry in one of
    its two buckets, moving others as needed; a failure only where no placement exists (some
    set of buckets is all that more keys than it holds may use) or, with many buckets, when
    nearly full."""
    import itertools

    from dlrm_jax.embedding.hot.index import HOT_BUCKET, _place

    n = int(load * buckets * HOT_BUCKET)
    choices = np.random.default_rng(seed).integers(0, buckets, (n, 2))
    where = _place(choices, buckets)
    if where is None:
        if buckets > 8:
            assert load > 0.8
            return
        subsets = (set(c) for r in range(1, buckets + 1) for c in itertools.combinations(range(buckets), r))
        assert any(sum(set(ch) <= sub for ch in choices.tolist()) > HOT_BUCKET * len(sub) for sub in subsets)
        return
    assert len(set(where.tolist())) == n
    assert all(where[k] // HOT_BUCKET in choices[k] for k in range(n))


@pytest.mark.slow
@settings(max_examples=examples(30))
@given(data=st.data())
def test_tiered_hot_rows_split_on_the_host_reach_the_same_hot_rows(data):
    """A tiered table's hot ids, split on the host into step ids (cache rows + hot row), are
    found by the step's ``split_hot`` at the hot row the logical pair has; every other id is
    left to the cache, and device tables keep their logical pairs."""
    from dlrm_jax.embedding.hot.index import (
        hot_index,
        hot_keys,
        hot_step_keys,
        split_hot,
        split_hot_host,
        tiered_hot_maps,
    )

    rows = [data.draw(st.integers(1, 60)) for _ in range(3)]
    hot = [np.array(sorted(data.draw(st.sets(st.integers(0, r - 1), max_size=min(r, 8)))), np.int64) for r in rows]
    keys = hot_keys(hot, data.draw(st.integers(sum(map(len, hot)), 30)))
    view = {1: data.draw(st.integers(1, 40))}  # table 1 is tiered: its devices hold `view` cache rows
    maps = tiered_hot_maps(keys, view)
    ids = np.array(data.draw(st.lists(st.integers(-1, rows[1] - 1), min_size=1, max_size=20)), np.int32)
    is_hot, step = split_hot_host(ids, maps.get(1))
    np.testing.assert_array_equal(is_hot, np.isin(ids, hot[1]) & (ids != PAD_ID))
    index, seeds = hot_index(hot_step_keys(keys, view))
    logical_index, logical_seeds = hot_index(keys)
    want, _ = split_hot(jnp.asarray(ids), jnp.full(ids.shape, 1, jnp.int32), logical_index, logical_seeds)
    cache_ids = np.where(ids == PAD_ID, PAD_ID, np.abs(ids) % view[1])  # what the cold ones become
    got, _ = split_hot(jnp.asarray(np.where(is_hot, step, cache_ids)), jnp.full(ids.shape, 1, jnp.int32), index, seeds)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # cache ids are never hot
    for t in (0, 2):  # device tables: found by their logical ids in the same index
        t_ids = jnp.asarray(hot[t].astype(np.int32)) if hot[t].size else jnp.zeros(1, jnp.int32) + PAD_ID
        a, _ = split_hot(t_ids, jnp.full(t_ids.shape, t, jnp.int32), index, seeds)
        b, _ = split_hot(t_ids, jnp.full(t_ids.shape, t, jnp.int32), logical_index, logical_seeds)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@settings(max_examples=examples(40), deadline=None)
@given(
    rows=st.integers(1, 300),
    n=st.sampled_from([1, 2, 3, 8]),
    bags=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_table_stats_count_what_the_routing_sends(rows, n, bags, seed):
    """The planner's statistics (distinct rows a device looks up; per owner and at the
    busiest, the distinct requests one device and one host of 2 send it under a block and a
    cyclic row split; a whole batch's distinct rows) equal what the step's own routing sends."""
    from dlrm_jax.embedding.exchange.capacity import table_stats
    from dlrm_jax.embedding.plan.specs import TableSpec

    specs = [TableSpec(f"t{i}", rows, 8, bag) for i, bag in enumerate(bags)]
    rng = np.random.default_rng(seed)
    local, batches = 5, 2
    ids = rng.integers(0, rows, (batches * n * local, sum(bags))).astype(np.int32)
    ids[rng.random(ids.shape) < 0.2] = PAD_ID
    per_host = 2 if n % 2 == 0 else 1
    got = table_stats(specs, [ids[: n * local], ids[n * local :]], n, local, per_host)
    starts = np.cumsum([0, *bags])
    for t in range(len(specs)):
        block = -(-rows // n)
        distinct = []
        most = {kind: np.zeros(n) for kind in (KIND_BLOCK, KIND_CYCLIC)}
        host_most = {kind: np.zeros(n) for kind in most}
        for c in range(0, len(ids), local * per_host):
            host = {kind: [] for kind in most}
            for d in range(c, c + local * per_host, local):
                sub = ids[d : d + local, starts[t] : starts[t + 1]]
                for kind in most:
                    owner, row, valid = (np.asarray(x) for x in route(sub, kind, 0, 0, block, n))
                    pairs = np.unique(owner[valid].astype(np.int64) * block + row[valid])
                    most[kind] = np.maximum(most[kind], np.bincount(pairs // block, minlength=n))
                    host[kind].append(pairs)
                distinct.append(len(pairs))
            for kind in most:
                merged = np.unique(np.concatenate(host[kind]))
                host_most[kind] = np.maximum(host_most[kind], np.bincount(merged // block, minlength=n))
        assert got[t].distinct == pytest.approx(np.mean(distinct))
        assert (got[t].row_owner, got[t].cyclic_owner) == (most[KIND_BLOCK].max(), most[KIND_CYCLIC].max())
        assert got[t].by_owner == (tuple(most[KIND_BLOCK]), tuple(most[KIND_CYCLIC]))
        if per_host > 1:
            assert got[t].by_owner_host == (tuple(host_most[KIND_BLOCK]), tuple(host_most[KIND_CYCLIC]))
        in_batches = [
            np.setdiff1d(ids[b : b + n * local, starts[t] : starts[t + 1]], [PAD_ID]).size for b in (0, n * local)
        ]
        assert got[t].batch_distinct == pytest.approx(np.mean(in_batches))


@settings(max_examples=examples(15))
@given(
    hosts=st.sampled_from([1, 2, 4]),
    per_host=st.sampled_from([1, 2, 4]),
    rows=st.integers(1, 12),
    n=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_two_level_stage_one_ranks_requests_per_local_index(hosts, per_host, rows, n, seed):
    """The two-level exchange's first stage: every distinct (owner, row) request gets one
    place among the requests to owners of its local index, the places of one local index are
    0 .. count - 1, and each request's slot finds the place of its own (owner, row)."""
    from dlrm_jax.embedding.exchange.host_ids import stage_counts

    rng = np.random.default_rng(seed)
    owner = rng.integers(0, hosts * per_host, n).astype(np.int32)
    row = rng.integers(0, rows, n).astype(np.int32)
    valid = rng.random(n) < 0.8
    b, rank, slot_rank = jax.jit(stage_counts, static_argnums=(3, 4, 5))(owner, row, valid, hosts, per_host, rows)
    b, rank, slot_rank = jax.tree.map(np.asarray, (b, rank, slot_rank))
    key = (b.unique_owner % hosts) * per_host + b.unique_owner // hosts  # back to the owner index
    pairs = {(int(o), int(r)) for o, r, v in zip(owner, row, valid, strict=True) if v}
    got = {(int(key[i]), int(b.unique_row[i])) for i in np.flatnonzero(b.unique_valid)}
    assert got == pairs  # each distinct request once
    local = b.unique_owner // hosts
    for k in range(per_host):
        at = np.flatnonzero(b.unique_valid & (local == k))
        assert sorted(rank[at]) == list(range(at.size))
    for i in np.flatnonzero(valid):
        j = np.flatnonzero(b.unique_valid & (rank == slot_rank[i]) & (local == b.slot_owner[i] // hosts))
        assert j.size == 1 and (key[j[0]], b.unique_row[j[0]]) == (owner[i], row[i])


@settings(max_examples=examples(40))
@given(
    batch=st.integers(1, 60),
    rows=st.integers(1, 12),
    width=st.integers(1, 5),
    span=st.integers(1, 50),
    chunk=st.sampled_from([1, 3, 16, 1 << 14]),
    wide=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_distinct_by_share_is_each_shares_distinct_values(batch, rows, width, span, chunk, wide, seed):
    """The planner's measurements take every device's distinct ids at once, many shares to a
    sort or one share a sort (``_SORT_CHUNK``): the same pairs as each share on its own."""
    from dlrm_jax.embedding.exchange import capacity

    rng = np.random.default_rng(seed)
    value = rng.integers(0, span, (batch, width)).astype(np.int64 if wide else np.int32)
    valid = rng.random((batch, width)) < 0.7
    saved, capacity._SORT_CHUNK = capacity._SORT_CHUNK, chunk
    try:
        share, got = capacity.distinct_by_share(value, valid, rows, span)
    finally:
        capacity._SORT_CHUNK = saved
    want = [
        (s, v) for s, a in enumerate(range(0, batch, rows)) for v in np.unique(value[a : a + rows][valid[a : a + rows]])
    ]
    assert list(zip(share.tolist(), got.tolist(), strict=True)) == [(s, int(v)) for s, v in want]


@settings(max_examples=examples(20))
@given(data=st.data(), bound=st.sampled_from([41, 2**20, 2**31 - 1, 2**32]), n=st.sampled_from([1, 7, 300, 70_000]))
def test_sort_with_order_is_a_stable_sort_packed_by_digits_or_with_a_payload(data, bound, n):
    """Keys and positions packed in 32 bits (small bounds), a digit at a time (larger ones;
    70,000 keys below 2^31 take three passes; uint32 keys, the id maps' hashes, any value) or
    with a payload (any other platform's form): the same stable order as numpy's, repeated keys
    included."""
    distinct = data.draw(st.lists(st.integers(0, bound - 1), min_size=1, max_size=50))
    picks = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))).integers(0, len(distinct), n)
    key = np.array(distinct, np.uint32 if bound > 2**31 else np.int32)[picks]
    assert packs(bound, key.size) == (bound * 2 ** max(key.size - 1, 1).bit_length() <= 2**32)
    want = np.argsort(key, kind="stable")
    for form in (sort_with_order, lambda k, b: sorting.sort_with_payload(k)):
        sorted_key, order = (np.asarray(a) for a in jax.jit(form, static_argnums=1)(jnp.asarray(key), bound))
        np.testing.assert_array_equal(order, want)
        np.testing.assert_array_equal(sorted_key, key[want])


@settings(max_examples=examples(10))
@given(data=st.data())
def test_bucketing_is_the_same_with_owner_and_row_as_one_key_or_two(data):
    n, rows, kind, block, device, offset, local_rows = data.draw(layouts())
    ids = data.draw(id_batches(rows))
    params = [jnp.full((ids.shape[1],), x, jnp.int32) for x in (kind, device, offset, block)]
    owner, row, valid = route(jnp.asarray(ids), *params, n)
    one_key = bucket(owner, row, valid, n, local_rows)
    original = routing.one_key
    routing.one_key = lambda bound: False  # the two-key sort of meshes too large for an int32
    try:
        two_keys = jax.jit(lambda *a: routing.bucket(*a), static_argnums=(3, 4))(owner, row, valid, n, local_rows)
    finally:
        routing.one_key = original
    for field, a, b in zip(Buckets._fields, one_key, two_keys, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=field)


@settings(max_examples=examples(20))
@given(data=st.data())
def test_the_busiest_owner_is_the_same_measured_a_few_devices_at_a_time(data):
    """`plan` of a large global batch measures the busiest owner a few devices' shares at a
    time (it held every routed id of the batch: 11.4 GB at 512 devices and 1M samples): the
    same count as each device's shares measured alone, the most of them."""
    from dlrm_jax.embedding.exchange import capacity
    from dlrm_jax.embedding.plan.layout import build_groups
    from dlrm_jax.embedding.plan.planner import plan_embeddings
    from dlrm_jax.embedding.plan.specs import TableSpec

    n = data.draw(st.sampled_from([2, 4, 8]), "devices")
    local = data.draw(st.integers(1, 6), "rows a device")
    rows = data.draw(st.sampled_from([3, 17, 64]), "table rows")
    specs = [TableSpec("a", rows, 8, 2), TableSpec("b", rows, 8, 1)]
    plan = plan_embeddings(specs, data.draw(st.sampled_from(["row", "table"])), n, "sgd", n * local)
    size = n * local * 3
    ids = np.array(data.draw(st.lists(st.integers(PAD_ID, rows - 1), min_size=size, max_size=size)), np.int32)
    ids = ids.reshape(n * local, 3)
    chunk = data.draw(st.integers(1, 3 * local * 3), "ids at a time")
    for g in build_groups(plan):
        alone = max(capacity.busiest_owner(g, ids[d * local : (d + 1) * local], local) for d in range(n))
        whole, capacity._MEASURE_CHUNK = capacity._MEASURE_CHUNK, chunk
        try:
            assert capacity.busiest_owner(g, ids, local) == alone
        finally:
            capacity._MEASURE_CHUNK = whole
