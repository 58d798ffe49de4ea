"""The dynamic tables' id map (embedding/dynamic/idmap.py) against a plain Python model of it,
batch by batch: random streams with repeated ids in a batch, ids colliding in their probes,
full shards, both policies, admission; and the same map on 1, 2 and 4 owners of its shards."""

import functools
import re

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dlrm_jax.chunks import by_platform
from dlrm_jax.embedding.dynamic import claims as claims_module
from dlrm_jax.embedding.dynamic.idmap import STATS, MapSpec, id_hash, init_map, shard_of, split_ids
from dlrm_jax.embedding.dynamic.resolve import distinct_sizes, resolve
from tests.embedding.dynamic_reference import DictMap
from tests.helpers import examples


@functools.cache
def resolver(spec: MapSpec, claims: str = ""):
    """``resolve`` of ``spec`` jitted (one per ``claims``: the form is fixed when it traces)."""
    return jax.jit(functools.partial(resolve, spec))


@pytest.fixture(params=["at_rows", "at_probes"])
def claims(request, monkeypatch):
    """Where a resolution marks the slots claimed in a batch, forced: at the map's rows, or at
    its probes' places (``claims.compact_claims``: the form of maps far larger than their
    batch; these maps are small, so left alone they take the first)."""
    monkeypatch.setattr(claims_module, "COMPACT_CLAIMS", 0 if request.param == "at_probes" else 1 << 40)
    return request.param


def as_arrays(batch: list[int | None]):
    ids = np.array([k if k is not None else 0 for k in batch], np.uint64)
    hi, lo = split_ids(ids)
    return jnp.asarray(hi), jnp.asarray(lo), jnp.asarray([k is not None for k in batch])


def contents(m) -> dict[int, int]:
    """{id: row} of a map's arrays."""
    used = np.flatnonzero(np.asarray(m.used))
    keys = (np.asarray(m.key_hi)[used].astype(np.uint64) << np.uint64(32)) | np.asarray(m.key_lo)[used]
    return {int(k): int(r) for k, r in zip(keys, used, strict=True)}


def step_like_the_model(spec: MapSpec, model: DictMap, m, batch: list[int | None], step: int, resolving=None):
    """One batch through the map (``resolving``, default :func:`resolver`) and the model: the
    same rows, fresh rows, counts and contents. Returns the map after it and the batch's counts."""
    want_rows, want_fresh, want_stats = model.resolve(batch, step)
    out = (resolving or resolver(spec))(m, *as_arrays(batch), step)
    assert np.asarray(out.rows).tolist() == want_rows, step
    assert set(np.flatnonzero(np.asarray(out.fresh)).tolist()) == want_fresh, step
    assert {k: int(out.stats[k]) for k in STATS} == want_stats, step
    assert contents(out.map) == model.row_of, step
    return out.map, want_stats


# A few maps (each compiles once): 1, 2 and 4 shards; one probe or every slot; both policies,
# with and without decay; admission with a sketch whose counts collide (width 2) or not.
SPECS = [
    MapSpec(4, 1, 3, "lru"),
    MapSpec(6, 2, 1, "lru"),
    MapSpec(12, 4, 2, "lfu", half_life=0),
    MapSpec(9, 1, 8, "lfu", half_life=1),
    MapSpec(16, 2, 4, "lfu", half_life=3, admit=2, sketch_depth=2, sketch_width=2),
    MapSpec(20, 4, 4, "lru", admit=3, sketch_depth=2, sketch_width=16),
    MapSpec(8, 4, 1, "lfu", half_life=1, admit=2, sketch_depth=1, sketch_width=4),
]
specs = st.sampled_from(SPECS)
# A small pool of ids (repeats, collisions in the probes) with high bits set in some.
pools = st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=40, unique=True)


@pytest.mark.slow  # 20 s on 2 cores; the fast lane keeps the worked example below
@settings(max_examples=examples(40), deadline=None)
@given(spec=specs, pool=pools, data=st.data())
def test_the_map_equals_a_python_dictionary_model_batch_by_batch(spec, pool, data):
    check_against_the_model(spec, pool, data)


@pytest.mark.slow  # the same, the claims at the probes' places
@settings(max_examples=examples(20), deadline=None)
@given(spec=specs, pool=pools, data=st.data())
def test_claims_at_the_probes_places_equal_the_python_model(spec, pool, data):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(claims_module, "COMPACT_CLAIMS", 0)
        check_against_the_model(spec, pool, data, resolver(spec, "at_probes"))


def check_against_the_model(spec, pool, data, resolving=None):
    spec.check()
    ids = st.one_of(st.none(), st.sampled_from(pool))
    batches = data.draw(st.lists(st.lists(ids, min_size=6, max_size=6), min_size=2, max_size=7))
    model, m = DictMap(spec), init_map(spec)
    for step, batch in enumerate(batches):
        m, _ = step_like_the_model(spec, model, m, batch, step, resolving)
        used = np.asarray(m.used)
        assert np.asarray(m.last_seen)[used].tolist() == [model.last_seen[r] for r in np.flatnonzero(used)]
        assert np.asarray(m.count)[used].tolist() == [model.count[r] for r in np.flatnonzero(used)]


@pytest.mark.parametrize("distinct", [40, 700, 1200, 1500, 6000])
def test_a_large_batch_resolves_on_the_prefix_its_distinct_ids_need(distinct, claims):
    """4,096 ids a batch: after the dedup the map works on the least of 256, 1,024, 1,365, 2,048
    or all 4,096 places that holds the batch's distinct ids (resolve.distinct_sizes); each
    prefix gives what the model gives, evictions and admissions included."""

    assert distinct_sizes(4096) == [256, 1024, 1365, 2048, 4096]
    spec = MapSpec(64, 8, 4, "lru", admit=2, sketch_depth=2, sketch_width=32)
    rng = np.random.default_rng(distinct)
    pool = rng.choice(2**62, size=distinct, replace=False) + (1 << 40)
    model, m = DictMap(spec), init_map(spec)
    for step in range(3):
        batch = [None if rng.random() < 0.05 else int(k) for k in rng.choice(pool, size=4096)]
        m, stats = step_like_the_model(spec, model, m, batch, step, resolver(spec, claims))
        # the prefix this batch takes: 256 places for 40 distinct ids, 1,024 for ~700, 1,365 for
        # ~1,160, 2,048 for ~1,400, 4,096 for ~2,900
        seen = len({k for k in batch if k is not None})
        least, most = {40: (0, 256), 700: (256, 1024), 1200: (1024, 1365), 1500: (1365, 2048), 6000: (2048, 4096)}[
            distinct
        ]
        assert least < seen <= most, seen
    assert stats["admitted"] + stats["found"] > 0


@pytest.mark.parametrize("control_flow", ["one_path", "prefixes"])
def test_the_gpus_straight_form_equals_the_model(control_flow):
    """On GPUs a resolution keeps to one path (``chunks.by_platform``): all N ids, not the
    least prefix that holds the distinct ones; the sketches halved every step; the map written
    at once, not in chunks of WRITE_CHUNK; or (``prefixes``) the switch among prefixes kept and
    the rest so. Forced here on CPU: 4,096 ids a batch of 700 to 6,000 distinct (every prefix
    the CPU form would take, and writes past one chunk), admission with a sketch that halves
    every other step, both policies: every step equals the model."""
    for spec, distinct in ((MapSpec(8192, 8, 4, "lfu", half_life=2, admit=2, sketch_depth=2, sketch_width=64), 6000),
                           (MapSpec(64, 8, 4, "lru", admit=2, sketch_depth=2, sketch_width=32), 700)):  # fmt: skip
        spec = spec._replace(control_flow=control_flow)
        straight = jax.jit(functools.partial(resolve, spec))
        text = straight.lower(init_map(spec), *as_arrays([1] * 4096), 0).as_text()
        assert "stablehlo.while" not in text  # no loop, whose predicate a GPU reads on the host
        # the placement's rounds after its first, each a switch (in the one before); ``prefixes``:
        # in each branch of the switch among sizes
        rounds = spec.probes - 1
        expected = 1 + len(distinct_sizes(4096)) * rounds if control_flow == "prefixes" else rounds
        assert text.count("stablehlo.case") == expected
        rng = np.random.default_rng(distinct)
        pool = rng.choice(2**62, size=distinct, replace=False) + (1 << 40)
        model, m = DictMap(spec), init_map(spec)
        for step in range(4):
            batch = [None if rng.random() < 0.05 else int(k) for k in rng.choice(pool, size=4096)]
            m, stats = step_like_the_model(spec, model, m, batch, step, straight)
        assert stats["admitted"] + stats["found"] > 0


def test_control_flow_picks_each_platforms_form():
    """``embedding.dynamic.control_flow``: the resolution as lowered for CPUs and for CUDA (no GPU
    needed to lower): ``auto`` takes the branches' loops (the dedup's rounds, the placement's,
    the map written a chunk at a time, one of each per prefix size) on CPUs and ``prefixes`` on
    CUDA; ``branches`` and ``one_path`` take theirs on both (one path: no loop, its dedup sorts,
    the placement's rounds after the first are switches, each in the one before); ``prefixes``
    keeps the switch among sizes (each branch with its placement's rounds as switches) and
    nothing else of the branches (no loop of chunks, no conditional halving)."""
    whiles, cases = {}, {}
    for control_flow in ("auto", "branches", "prefixes", "one_path"):
        spec = MapSpec(
            8192, 8, 4, "lfu", half_life=2, admit=2, sketch_depth=2, sketch_width=64, control_flow=control_flow
        )
        f = jax.jit(functools.partial(resolve, spec))
        args = (init_map(spec), *as_arrays([1] * 4096), 0)
        for platform in ("cpu", "cuda"):
            text = jax.export.export(f, platforms=[platform])(*args).mlir_module()
            whiles[control_flow, platform] = text.count("stablehlo.while")
            cases[control_flow, platform] = text.count("stablehlo.case")
    assert whiles["one_path", "cpu"] == whiles["one_path", "cuda"] == 0, whiles
    assert whiles["prefixes", "cpu"] == whiles["prefixes", "cuda"] == whiles["auto", "cuda"] == 0, whiles
    assert whiles["branches", "cpu"] == whiles["branches", "cuda"] == whiles["auto", "cpu"] > 0, whiles
    rounds = spec.probes - 1  # the placement's rounds after its first: a switch each
    assert cases["one_path", "cpu"] == cases["one_path", "cuda"] == rounds, cases
    sizes = len(distinct_sizes(4096))  # the switch among sizes, and in each branch the rounds
    assert cases["prefixes", "cpu"] == cases["prefixes", "cuda"] == 1 + sizes * rounds, cases
    # ``auto`` lowers its platform choices as switches of their own: its choice among sizes is
    # the branches' everywhere, so on CUDA it is ``prefixes``
    assert by_platform(lambda: "branches", lambda: "one path", "auto", sizes=True) == "branches"


@pytest.mark.parametrize("control_flow", ["branches", "prefixes", "one_path"])
def test_the_placements_rounds_make_no_pass_over_the_maps_rows(control_flow):
    """A round of the placement costs its claims: no array the size of the map's rows is filled
    or copied inside a loop of the compiled resolution (a round once filled two, and XLA
    copied them: two passes over 33.8M rows a round for criteo_kaggle on one device), and none
    is copied anywhere (the map read again after the rounds was copied twice)."""
    spec = MapSpec(
        8 * 8191, 8, 4, "lfu", half_life=2, admit=2, sketch_depth=2, sketch_width=64, control_flow=control_flow
    )
    f = jax.jit(functools.partial(resolve, spec), donate_argnums=0)  # (the map written in place, as training does)
    text = f.lower(init_map(spec), *as_arrays([1] * 4096), 0).compile().as_text()
    bodies, body, passes = set(re.findall(r"while\(.*?body=(%[\w.\-]+)", text)), None, []
    for line in text.splitlines():
        body = (re.match(r"^(%[\w.\-]+) ", line) or [None, body])[1]
        if (
            body in bodies
            and re.search(r"= \w+\[65528\]\{0\} (broadcast|copy|fusion)\(", line)
            and "scatter" not in line
        ):
            passes.append(line.strip())
        if re.search(r"= \w+\[65528\]\{0\} copy\(%(m_|copy)", line):  # the map's own arrays
            passes.append(line.strip())
    assert len(bodies) >= 2 and not passes, passes


def test_an_unknown_control_flow_is_refused():
    with pytest.raises(ValueError, match="control_flow='fast': one of auto, branches, prefixes, one_path"):
        MapSpec(64, 8, 4, control_flow="fast").check()


@pytest.mark.parametrize("policy,admit", [("lru", 0), ("lfu", 0), ("lfu", 2)])
def test_new_ids_contesting_slots_settle_in_rounds_as_the_model_settles_them(policy, admit, claims):
    """60 to 70 new ids a batch of 256 places contest 62 slots of two probes each: some lose a
    slot and ask again in the next round, some get none (with admission some wait, so fewer
    ask). The rounds end when no id lost a contest: every step equals the Python model."""
    spec = MapSpec(64, 2, 2, policy, half_life=2 if policy == "lfu" else 0, admit=admit, sketch_width=8)
    rng = np.random.default_rng(64)
    model, m = DictMap(spec), init_map(spec)
    fresh_ids = iter(rng.choice(2**62, size=2000, replace=False) + (1 << 40))
    for step, new in enumerate([64, 65, 60, 70, 64, 66]):
        old = list(model.row_of)[: 80 - new]  # ids holding rows: found
        ids = [int(next(fresh_ids)) for _ in range(new)] + old
        batch = [int(k) for k in rng.choice(ids, 256 - len(ids))] + ids  # every id at least once
        rng.shuffle(batch)
        m, stats = step_like_the_model(spec, model, m, batch, step, resolver(spec, claims))
        assert stats["admitted"] + stats["held_back"] + stats["unplaced"] == new, step  # new, or pending


def test_a_full_shard_evicts_by_its_policy_and_admission_waits_for_k_sightings():
    spec = MapSpec(rows=4, vshards=1, probes=3, policy="lru").check()  # 3 rows past the shared one
    m, run = init_map(spec), resolver(spec)
    rows = {}
    for step, key in enumerate([10, 11, 12]):
        out = run(m, *as_arrays([key]), step)
        m, rows[key] = out.map, int(out.rows[0])
    assert sorted(rows.values()) == [1, 2, 3] and int(out.stats["evicted"]) == 0
    m = run(m, *as_arrays([11, 12]), 3).map  # 10 is now the least recently seen
    out = run(m, *as_arrays([13]), 4)
    assert int(out.rows[0]) == rows[10] and int(out.stats["evicted"]) == 1 and bool(out.fresh[rows[10]])
    assert 10 not in contents(out.map)

    spec = MapSpec(rows=8, vshards=1, probes=4, admit=3, sketch_width=64).check()
    m, run = init_map(spec), resolver(spec)
    for step, seen in enumerate([[7], [7], [7, 7]]):
        out = run(m, *as_arrays(seen), step)
        m = out.map
        admitted = int(out.stats["admitted"])
        assert (admitted == 1) == (step == 2), step  # the third and fourth sightings reach 3
    assert 7 in contents(m)
    out = run(init_map(spec), *as_arrays([9]), 0)
    assert int(out.rows[0]) == 0 and int(out.stats["held_back"]) == 1  # the shared row meanwhile


@pytest.mark.slow
@settings(max_examples=examples(15), deadline=None)
@given(spec=specs, pool=pools, data=st.data())
def test_owners_of_whole_shards_reach_what_one_map_reaches(spec, pool, data):
    """Each owner holds some whole shards and sees the batch's ids of its shards: the rows,
    fresh rows and maps put together equal the one map's, on any number of owners."""
    spec.check()
    batches = data.draw(st.lists(st.lists(st.sampled_from(pool), min_size=8, max_size=8), min_size=2, max_size=5))
    whole = init_map(spec)
    for owners in [o for o in (2, 4) if spec.vshards % o == 0]:
        per = spec.vshards // owners
        parts = [init_map(spec, per) for _ in range(owners)]
        one = whole
        for step, batch in enumerate(batches):
            hi, lo, valid = as_arrays(batch)
            ref = resolver(spec)(one, hi, lo, valid, step)
            one = ref.map
            shard = np.asarray(shard_of(spec, hi, lo))
            rows, fresh = np.full(len(batch), -1), []
            for o in range(owners):
                mine = valid & jnp.asarray(shard // per == o)
                out = resolver(spec)(parts[o], hi, lo, mine, step, o * per)
                parts[o] = out.map
                local = np.asarray(out.rows)
                rows = np.where(local >= 0, local + o * per * spec.slots, rows)
                fresh.append(np.asarray(out.fresh))
            assert rows.tolist() == np.asarray(ref.rows).tolist()
            assert np.concatenate(fresh).tolist() == np.asarray(ref.fresh).tolist()
            for field in ("key_hi", "key_lo", "used", "last_seen", "count"):
                joined = np.concatenate([np.asarray(getattr(p, field)) for p in parts])
                assert joined.tolist() == np.asarray(getattr(one, field)).tolist(), field


def test_bad_specs_are_refused_naming_the_setting():
    with pytest.raises(ValueError, match="probes=4"):
        MapSpec(rows=8, vshards=2, probes=4).check()
    with pytest.raises(ValueError, match="policy='mru'"):
        MapSpec(rows=8, vshards=1, probes=4, policy="mru").check()


def test_reading_the_map_changes_nothing_and_sends_unknown_ids_to_the_shared_row():
    spec = SPECS[4]
    model, m = DictMap(spec), init_map(spec)
    for step, batch in enumerate([[1, 2, 3, 2, 5, None], [2, 3, 3, 9, 9, 1], [1, 2, 3, 4, 5, 6]]):
        model.resolve(batch, step)
        m = resolver(spec)(m, *as_arrays(batch), step).map
    read = jax.jit(functools.partial(resolve, spec, learn=False))
    batch = [1, 2, 3, 4, 77, None]
    out = read(m, *as_arrays(batch), 9)
    want = [model.row_of.get(k, model.probes(k)[0] * spec.slots) if k is not None else -1 for k in batch]
    assert np.asarray(out.rows).tolist() == want
    assert not np.asarray(out.fresh).any() and int(out.stats["admitted"]) == 0
    for a, b in zip(out.map, m, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_ids_sharing_a_32_bit_hash_stay_distinct():
    """Two ids whose hashes collide (found by a birthday search) keep rows of their own: the
    batch takes the exact path of the distinct ids (by hash and low word)."""
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 2**63, 300_000, dtype=np.int64).astype(np.uint64)
    hi, lo = split_ids(ids)
    h = id_hash(hi, lo, np)
    hs, first = np.unique(h, return_index=True)
    dup = np.setdiff1d(np.arange(len(h)), first)[0]
    a, b = ids[first[np.searchsorted(hs, h[dup])]], ids[dup]
    assert a != b and id_hash(*split_ids(np.array([a])), np) == id_hash(*split_ids(np.array([b])), np)
    spec = MapSpec(rows=16, vshards=1, probes=4).check()
    batch = np.array([a, b, a, 5], np.uint64)
    model = DictMap(spec)
    want_rows, _, want_stats = model.resolve([int(x) for x in batch], 0)
    bhi, blo = split_ids(batch)
    out = resolve(spec, init_map(spec), jnp.asarray(bhi), jnp.asarray(blo), jnp.ones(4, bool), 0)
    rows = np.asarray(out.rows)
    assert rows[0] == rows[2] != rows[1] and len(set(rows.tolist())) == 3
    np.testing.assert_array_equal(rows, want_rows)
    assert {k: int(v) for k, v in out.stats.items()} == want_stats


@functools.cache
def _distinct(form: str):
    from dlrm_jax.embedding.dynamic.distinct import distinct_ids

    return jax.jit(functools.partial(distinct_ids, form=form, tables=3))  # (the tables below: 0-2)


@functools.cache
def _id_pool() -> np.ndarray:
    """Eight ids, the first two a pair whose 32-bit hashes collide (a birthday search), the last
    the first's low word under another high word."""
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 2**63, 300_000, dtype=np.int64).astype(np.uint64)
    h = id_hash(*split_ids(ids), np)
    hs, first = np.unique(h, return_index=True)
    dup = np.setdiff1d(np.arange(len(h)), first)[0]
    a = ids[first[np.searchsorted(hs, h[dup])]]
    return np.array([a, ids[dup], 0, 1, 2**40 + 3, 2**63 - 1, 77, a ^ (1 << 40)], np.uint64)


@settings(max_examples=examples(40), deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2), st.integers(0, 7), st.booleans()), min_size=1, max_size=64),
    st.booleans(),
    st.sampled_from(["branches", "one_path"]),
)
@example([(0, 0, True), (0, 7, True), (1, 0, True), (0, 0, True)], False, "one_path")  # one low word, two ids
@example([(0, 0, True), (0, 1, True), (0, 0, False), (0, 1, True)], True, "one_path")  # the colliding pair
def test_distinct_ids_number_each_table_and_id_once(entries, with_counts, form):
    """``distinct.distinct_ids`` against a Python grouping, both ways it finds them
    (``branches``: a hash table, rounds until every id settles, CPUs', numbered in the order
    each first occurs; ``one_path``: stable radix sorts, GPUs', numbered in (table, id) order):
    each valid (table, id) pair numbered once, with its occurrences (or summed counts); padding
    of any table and id numbered N. A pair of ids whose 32-bit hashes collide (found by a
    birthday search) is always in the pool, so they meet; padding shares its words with real
    ids."""
    pool = _id_pool()
    entries = entries + [(i % 3, i % 8, False) for i in range(64 - len(entries))]  # one shape, padded
    table = np.array([t for t, _, _ in entries], np.int32)
    raw = pool[[k for _, k, _ in entries]]
    valid = np.array([v for _, _, v in entries])
    counts = np.arange(1, len(entries) + 1, dtype=np.int32) if with_counts else None
    hi, lo = split_ids(raw)
    out = _distinct(form)(
        jnp.asarray(hi), jnp.asarray(lo), jnp.asarray(valid), jnp.asarray(table), None if counts is None else counts
    )
    index, uhi, ulo, utab, occurrences, real = map(np.asarray, out)
    n, order, totals = len(entries), {}, {}
    for i, (t, k, v) in enumerate(entries):
        if v:
            order.setdefault((t, int(pool[k])), len(order))
            totals[(t, int(pool[k]))] = totals.get((t, int(pool[k])), 0) + (1 if counts is None else int(counts[i]))
    if form == "one_path":
        order = {pair: j for j, pair in enumerate(sorted(order))}
    want = [order[(t, int(pool[k]))] if v else n for t, k, v in entries]
    np.testing.assert_array_equal(index, want)
    np.testing.assert_array_equal(real, np.arange(n) < len(order))
    for (t, k), j in order.items():
        got = (int(utab[j]), (int(uhi[j]) << 32) | int(ulo[j]))
        assert got == (t, k) and occurrences[j] == totals[(t, k)]


def test_distinct_ids_set_each_distinct_slot_from_one_occurrence_alone():
    """The distinct ids' words, tables and occurrences are scattered from one occurrence each
    (the first; on GPUs, ``one_path``, the first and last of its run in sorted order), with
    unique indices promised (XLA's GPU code then stores without atomics: every occurrence of a
    hot id writing its slot made thousands of stores to one address, one after another); on
    GPUs they come from sorts, with no scatter that adds or takes a least and no loop."""
    from dlrm_jax.embedding.dynamic.distinct import distinct_ids

    n = 64
    args = (jnp.zeros(n, jnp.uint32), jnp.zeros(n, jnp.uint32), jnp.ones(n, bool), jnp.zeros(n, jnp.int32))
    for form, combining in (("branches", {"scatter-min", "scatter-add"}), ("one_path", set())):
        jaxpr = jax.make_jaxpr(functools.partial(distinct_ids, form=form))(*args)
        top = [e for e in jaxpr.eqns if e.primitive.name == "scatter"]
        assert len(top) == (4 if combining else 5) and all(e.params["unique_indices"] for e in top)
        names = {e.primitive.name for e in _all_eqns(jaxpr.jaxpr)}
        assert {"scatter-min", "scatter-add"} & names == combining and ("while" in names) == bool(combining)
        index, *_, occurrences, _ = jax.jit(functools.partial(distinct_ids, form=form))(*args)  # one id 64 times
        assert np.asarray(index).tolist() == [0] * n and int(occurrences[0]) == n


def _all_eqns(jaxpr):
    """Every equation of ``jaxpr``, those of its loops' and branches' bodies too."""
    for e in jaxpr.eqns:
        yield e
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            yield from _all_eqns(sub)


HALF_LIVES = {
    "decay": [MapSpec(12, 2, 3, "lfu", half_life=2), MapSpec(8, 1, 4, "lfu", half_life=5), MapSpec(6, 2, 2, "lru")],
    # admission's sketches aging at each table's own half life (each counter shifted by its table's)
    "sketches": [
        MapSpec(12, 2, 3, "lfu", half_life=2, admit=2, sketch_depth=2, sketch_width=4),
        MapSpec(8, 1, 4, "lru", half_life=5, admit=3, sketch_depth=1, sketch_width=8),
        MapSpec(6, 2, 2, "lru"),
    ],
}


@pytest.mark.parametrize("kind", list(HALF_LIVES))
def test_tables_of_different_half_lives_resolved_as_one_each_reach_their_own_map(kind):
    """Two tables with half lives 2 and 5 and an lru one in one fused resolution (each probe's
    decay divided by its own table's half life; with admission, each table's sketch halved at
    its own), step after step with evictions and gaps between steps: each table's rows, fresh
    rows and map as its own Python model's."""
    from dlrm_jax.embedding.dynamic.resolve import Maps, resolve_fused
    from dlrm_jax.embedding.dynamic.sharded import fuse_maps, split_maps

    specs = HALF_LIVES[kind]
    layout = Maps(tuple(specs), tuple(s.vshards for s in specs))
    run = jax.jit(
        lambda m, table, hi, lo, valid, step: resolve_fused(
            layout, m, table, hi, lo, valid, step, jnp.zeros(3, jnp.int32)
        )
    )
    models = [DictMap(s) for s in specs]
    m = fuse_maps(specs, 1, [init_map(s) for s in specs])
    rng = np.random.default_rng(11)
    pool = rng.integers(0, 2**63, 40, dtype=np.int64).astype(np.uint64)
    for step in [0, 1, 2, 5, 6, 13, 14, 30, 31, 32]:
        batches = [[int(k) for k in rng.choice(pool, 10)] for _ in specs]
        flat = np.array([k for b in batches for k in b], np.uint64)
        table = np.repeat(np.arange(3, dtype=np.int32), 10)
        hi, lo = split_ids(flat)
        out = run(m, jnp.asarray(table), jnp.asarray(hi), jnp.asarray(lo), jnp.ones(30, bool), step)
        m = out.map
        for t, (model, mine) in enumerate(zip(models, split_maps(specs, 1, m), strict=True)):
            want_rows, want_fresh, _ = model.resolve(batches[t], step)
            assert np.asarray(out.rows)[table == t].tolist() == want_rows, (t, step)
            fresh = np.asarray(out.fresh_rows)[np.asarray(out.fresh_table) == t]
            assert set(fresh[fresh >= 0].tolist()) == want_fresh, (t, step)
            assert contents(mine) == model.row_of, (t, step)


def test_a_resolution_in_chunks_equals_one_at_once(claims):
    """The placement's per-probe work and the sketch's counters in passes of a few ids (as the
    largest prefixes run on CPUs: ``chunk``) give every output of one pass (the GPUs' form),
    bit for bit, and the Python model's rows: lfu with admission, and lru, with evictions and
    repeated ids."""
    from dlrm_jax.embedding.dynamic.resolve import Maps, resolve_fused
    from dlrm_jax.embedding.dynamic.sharded import resolution_chunk

    # passes on CPUs (their scratch under the mmap cutoff), all at once on GPUs (fewer kernels)
    assert resolution_chunk("cpu", 13_824) == 6_912 and resolution_chunk("cpu", 1) == 1
    assert resolution_chunk("gpu", 13_824) == resolution_chunk("cuda", 1_703_936) == 0

    specs = [MapSpec(16, 2, 4, "lfu", half_life=3, admit=2, sketch_depth=2, sketch_width=4), MapSpec(6, 2, 2, "lru")]
    layout = Maps(tuple(specs), tuple(s.vshards for s in specs))

    def run(chunk):  # 40 ids: 5 passes of 8 (touched counters kept: write=True)
        first = jnp.zeros(2, jnp.int32)
        return jax.jit(lambda m, t, hi, lo, v, s: resolve_fused(layout, m, t, hi, lo, v, s, first, chunk=chunk))

    whole, chunked = run(0), run(8)
    from dlrm_jax.embedding.dynamic.sharded import fuse_maps, split_maps

    models = [DictMap(s) for s in specs]
    m = fuse_maps(specs, 1, [init_map(s) for s in specs])
    rng = np.random.default_rng(5)
    pool = rng.integers(0, 2**63, 30, dtype=np.int64).astype(np.uint64)
    for step in range(8):
        batches = [[int(k) for k in rng.choice(pool, 20)] for _ in specs]
        table = np.repeat(np.arange(2, dtype=np.int32), 20)
        hi, lo = split_ids(np.array([k for b in batches for k in b], np.uint64))
        args = (jnp.asarray(table), jnp.asarray(hi), jnp.asarray(lo), jnp.ones(40, bool), step)
        want, got = whole(m, *args), chunked(m, *args)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(step))
        m = got.map
        for t, (model, mine) in enumerate(zip(models, split_maps(specs, 1, m), strict=True)):
            assert np.asarray(got.rows)[table == t].tolist() == model.resolve(batches[t], step)[0], (t, step)
            assert contents(mine) == model.row_of, (t, step)


@settings(max_examples=examples(60), deadline=None)
@given(data=st.data())
def test_every_probed_slot_has_one_claim_place_of_its_own(data):
    """The claim places of maps far larger than their batch (``claims.probe_windows``): two
    probes share a place exactly when they probe the same slot, and every place lies below ids
    x probes. Random tables of few slots (windows that overlap, and wrap past a shard's last
    slot onto its first), several shards each, tables probing differently far, repeated homes."""
    from dlrm_jax.embedding.dynamic.claims import probe_windows, window_place

    tables = data.draw(st.lists(st.tuples(st.integers(2, 12), st.integers(1, 3)), min_size=1, max_size=3))
    probes_of = [data.draw(st.integers(1, slots - 1)) for slots, _ in tables]
    most = max(probes_of)
    ids = data.draw(st.lists(st.tuples(st.integers(0, len(tables) - 1), st.integers(0, 99), st.integers(0, 99)), min_size=24, max_size=24))  # fmt: skip
    row_start = np.cumsum([0] + [s * n for s, n in tables])
    shard_start = np.cumsum([0] + [n for _, n in tables])
    t = np.array([i[0] for i in ids])
    slots = np.array([tables[j][0] for j in t])
    local = np.array([i[1] % tables[j][1] for i, j in zip(ids, t, strict=True)])
    home = np.array([i[2] for i in ids]) % (slots - 1)
    shard_base = row_start[t] + local * slots
    windows = probe_windows(
        *(jnp.asarray(x, jnp.int32) for x in (shard_base, home, shard_start[t] + local)),
        int(shard_start[-1]),
        most,
        int(row_start[-1]),
    )
    place_of = {}
    for p in range(most):
        wrap = home + p - (slots - 1)
        places = np.asarray(window_place(p, jnp.asarray(wrap, jnp.int32), *windows))
        for i in np.flatnonzero(p < np.array([probes_of[j] for j in t])):
            slot = shard_base[i] + 1 + (wrap[i] if wrap[i] >= 0 else home[i] + p)
            assert 0 <= places[i] < len(ids) * most
            place_of.setdefault(int(slot), set()).add(int(places[i]))
    assert all(len(at) == 1 for at in place_of.values()), place_of  # one place a slot
    assert len({next(iter(at)) for at in place_of.values()}) == len(place_of)  # a place a slot


def test_a_map_far_larger_than_its_batch_fills_nothing_of_its_size():
    """A step's work follows its batch: where the map's rows outnumber the batch's probes many
    times (``claims.compact_claims``), no array of the map's rows is filled anywhere in the
    compiled resolution (the slots claimed are marked at the probes' places): 1,024 ids of 4
    probes through a map of 524,280 rows. The map's own arrays are written where they lie."""
    from dlrm_jax.embedding.dynamic.resolve import Maps, resolve_fused

    spec = MapSpec(8 * 65535, 8, 4, "lfu", half_life=2, admit=2, sketch_depth=2, sketch_width=64)
    maps, first, table = Maps((spec,), (8,)), jnp.zeros(1, jnp.int32), jnp.zeros(1024, jnp.int32)
    fused = jax.jit(lambda m, *a: resolve_fused(maps, m, table, *a, first), donate_argnums=0)  # (as training runs it)
    m = init_map(spec)
    text = fused.lower(m._replace(sketch=m.sketch.reshape(-1)), *as_arrays([1] * 1024), 0).compile().as_text()
    fills = [line.strip() for line in text.splitlines() if re.search(r"= \w+\[524280\]\{0\} broadcast\(", line)]
    assert not fills, fills
    rng = np.random.default_rng(3)
    model, m = DictMap(spec), init_map(spec)
    pool = rng.choice(2**62, size=900, replace=False) + (1 << 40)
    for step in range(3):
        batch = [None if rng.random() < 0.05 else int(k) for k in rng.choice(pool, size=1024)]
        m, stats = step_like_the_model(spec, model, m, batch, step, resolver(spec, "large"))
    assert stats["admitted"] > 0
