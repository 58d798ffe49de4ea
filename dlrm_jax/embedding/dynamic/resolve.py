"""One batch of raw ids through id maps (``idmap``): every dynamic table at once, in one pass.

Several tables' maps are held as one (:class:`Maps`: their arrays end to end, each table's
shards on this device in a block of its own) and a batch's ids of all of them, each tagged
with its table, go through one dedup, one probe, one sketch update and one placement loop.
What a batch does to one table depends only on that table's block and its own ids, so the
result is the one each table's map reaches alone; a step with 26 dynamic tables runs about
60 operations instead of 26 x 60 (most of a small step's time on CPU was their dispatch).

Per table and shard (``idmap``'s layout), one batch:
1. the batch's distinct ids, each with its occurrences; ids found in their probes keep their row;
2. admission (``admit`` > 1): a count-min sketch per shard counts each absent id's
   occurrences; an id is admitted once its estimate reaches ``admit`` (counts are kept after
   admission, so an evicted id that returns is admitted at once). With ``half_life``, every
   counter halves at each step that is a multiple of it (the sketch forgets, as TinyLFU's does);
3. placement in ``probes`` rounds: each admitted absent id asks for the best slot among its
   probes not taken this batch (a free slot first, in probe order; else the policy's victim),
   and where several ask for one slot the first id in (hash, low word) order gets it;
   the others ask again next round. Under ``lfu`` an id takes a held slot only when its own
   count (its sketch estimate, or without admission its occurrences in the batch) exceeds the
   victim's decayed count, so rare new ids do not push out frequent old ones (TinyLFU's
   rule). An id that gets no slot uses its shard's shared row;
4. the rows given to new ids are *fresh*: their values and optimizer state must be reset
   before the batch looks them up (the caller does it, from :attr:`Fused.fresh_rows`).

Policies, on integers only (so a plain Python model reaches the same bits):
``lru``: the victim is the slot seen least recently; ``lfu``: the slot with the smallest
count, each count halving every ``half_life`` steps since its id was last seen (0: never),
ties to the least recently seen. Further ties go to the earlier probe. A new id's count starts
at its count above.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dlrm_jax.chunks import by_chunks, by_platform
from dlrm_jax.embedding.dynamic.claims import compact_claims, probe_windows, window_place
from dlrm_jax.embedding.dynamic.distinct import distinct_ids
from dlrm_jax.embedding.dynamic.idmap import (
    _HOME_SEED,
    STATS,
    IdMap,
    Maps,
    MapSpec,
    Resolved,
    id_hash,
)
from dlrm_jax.embedding.dynamic.map_writes import MapWrites, write_map
from dlrm_jax.embedding.dynamic.sketch import count_absent
from dlrm_jax.few_segments import few_segment_sum
from dlrm_jax.hashing import mix32

_FREE = np.iinfo(np.int32).min  # a free slot's key: below any seen slot's
_TAKEN = np.iinfo(np.int32).max  # a slot already given out this batch
_LAST = np.uint32(0xFFFFFFFF)


class Fused(NamedTuple):
    """One batch through :class:`Maps`: ``rows`` int32 [N], each id's row among its table's rows
    here (-1: padding, or an id of another device's shards); ``map``: the maps after the batch;
    ``fresh_rows`` int32 [min(N, the map's rows)], rows given to a new id this batch (its
    table's row here), first, then -1, with that entry's ``fresh_table`` and id
    (``fresh_hi``/``fresh_lo``); ``stats``: int32 [tables, len(STATS)]. What the batch wrote
    (a map held on the host keeps it to undo: ``host_maps``): ``touched`` int32 [N], the map
    rows it set (the map's row count: none), ``sketch_touched`` int32 [N * depth], the sketch
    counters it added to (the sketch's size: none; with ``write=False``, none at all unless
    asked for), aging apart. ``writes``: with ``write=False``, what the batch sets in the map
    (``map`` then holds only the new sketch)."""

    rows: jax.Array
    map: IdMap
    fresh_rows: jax.Array
    fresh_table: jax.Array
    fresh_hi: jax.Array
    fresh_lo: jax.Array
    stats: jax.Array
    touched: jax.Array
    sketch_touched: jax.Array
    writes: MapWrites | None = None


def resolve_fused(
    maps: Maps,
    m: IdMap,
    table,
    hi,
    lo,
    valid,
    step,
    first_shards,
    learn: bool = True,
    counts=None,
    write=True,
    chunk: int = 0,
    age=True,
    prefixes: bool = True,
    counters: bool | None = None,
) -> Fused:
    """The batch of ids ``hi``/``lo`` (uint32 [N]; ``valid``: bool [N], False for padding) of the
    tables ``table`` (int32 [N], indices into ``maps.specs``) through the maps ``m`` (held as
    ``maps`` says) at train step ``step``. ``first_shards`` (int32 [tables], may be traced):
    each table's first shard held here; ids of other shards are left alone (row -1).
    ``learn=False`` (evaluation, serving): the maps are read, not changed: an id without a row
    uses its shard's shared row. ``counts`` (int32 [N]): each entry stands for that many
    lookups of its id (ids counted where they were looked up), else one. ``write=False``: the
    map's rows are left to the caller (``Fused.writes``, :func:`write_map`: outside any switch
    it runs in). ``chunk``: at most this many distinct ids' per-probe arrays at once (the
    placement's per-probe work and the sketch's counters in passes where more are resolved,
    the candidates recomputed each round there), so a rare large batch needs no more scratch
    than the common ones; 0: all at once. ``age`` (may be traced): whether the sketches age
    where this step ends a half life (a batch resolved in passes, ``table_passes``, ages them in
    its first only). ``prefixes=False``: the work past the dedup is compiled for all N ids
    only, not also for shorter prefixes (:func:`distinct_sizes`: each is a copy of it in the
    program, about a second of compile on CPU), for paths a step rarely takes. ``counters``:
    whether ``Fused.sketch_touched`` lists the counters added to (default: as ``write``; the
    host maps' journal wants them with ``write=False``). Traceable."""
    n = hi.shape[0]
    index, uhi, ulo, utab, occurrences, real = distinct_ids(
        hi, lo, valid, table, counts, maps.control_flow, len(maps.specs)
    )
    # The distinct ids come first: the rest of the work runs on the least of a few prefix sizes
    # that holds them (a batch repeats most ids: 7,500 distinct of 26,624 in stream's batch).
    sizes = distinct_sizes(n) if prefixes else [n]
    count = jnp.max(jnp.where(valid, index + 1, 0))
    branches = [
        lambda k=k: _settled(
            maps,
            m,
            k,
            n,
            uhi[:k],
            ulo[:k],
            utab[:k],
            occurrences[:k],
            real[:k],
            step,
            first_shards,
            learn,
            write if counters is None else counters,
            chunk,
            age,
        )
        for k in sizes
    ]
    distinct_row, at, seen_at, seen_count, sketch, fresh, stats, sketch_touched = (
        branches[0]()
        if len(sizes) == 1
        else by_platform(  # (one_path: all N ids, what every branch gives)
            lambda: lax.switch(jnp.searchsorted(jnp.asarray(sizes), count, method="compare_all"), branches),
            branches[-1],
            maps.control_flow,
            sizes=True,
        )
    )
    # The map is written here, not in the branches (a switch's results are buffers of their
    # own: a map written in a branch was copied whole, every step).
    writes = MapWrites(at, seen_at, seen_count, uhi, ulo, count)
    new_map = m._replace(sketch=sketch)
    if learn and write:
        new_map = write_map(new_map, writes, step, maps.control_flow)
    rows = jnp.where(index < n, distinct_row[jnp.clip(index, 0, n - 1)], -1)
    return Fused(
        rows,
        new_map,
        fresh[:, 0],
        fresh[:, 1],
        fresh[:, 2].view(jnp.uint32),
        fresh[:, 3].view(jnp.uint32),
        stats,
        seen_at,
        sketch_touched,
        None if write else writes,
    )


def distinct_sizes(n: int) -> list[int]:
    """The prefix sizes a resolution of ``n`` ids is compiled for: a sixteenth, a quarter, a
    third, a half, all (stream's batches of 1,024 hold 28% distinct ids; of 8,192, 15%; on 8
    devices at 8,192 each owner resolves 3,750-4,250 distinct ids in 13,824 places: a third
    holds them, where the least before was a half)."""
    return sorted({k for k in (n // 16, n // 4, n // 3, n // 2) if k >= 256} | {n})


def _settled(
    maps: Maps,
    m: IdMap,
    k: int,
    n: int,
    uhi,
    ulo,
    utab,
    occurrences,
    real,
    step,
    first_shards,
    learn,
    touched,
    chunk,
    ages,
):
    """:func:`resolve_fused` past the dedup, on the first ``k`` distinct ids (every one of
    them): each one's row ([n], -1 past k); the map rows given to each ([n], the map's row
    count past k or where none), the rows each was seen at (the same) and their counts; the
    sketch after the batch; the fresh rows' entries ([min(n, the map's rows), 4], first), the
    counts, and the sketch counters added to ([n * depth]; [0] without ``touched`` or a sketch)."""
    specs, rows_n = maps.specs, m.used.shape[0]
    # Each distinct id's table's settings (each a gather from a [tables] constant, fused where used:
    # one [U, 10] array of them was the largest of a resolution of a whole gathered batch)
    per_table = lambda values: jnp.asarray(np.asarray(values, np.int32))[utab]
    slots, vshards = per_table([s.slots for s in specs]), per_table([s.vshards for s in specs])
    shards, base = per_table(maps.shards), per_table(maps.row_starts)
    lfu = per_table([s.policy == "lfu" for s in specs]) > 0
    half_life = per_table([s.half_life if s.policy == "lfu" else 0 for s in specs])
    counts = per_table([s.counts for s in specs]) > 0
    probes_of, admit = per_table([s.probes for s in specs]), per_table([s.admit for s in specs])
    first = jnp.asarray(first_shards, jnp.int32)[utab]

    h = id_hash(uhi, ulo)
    local = (h % vshards.astype(jnp.uint32)).astype(jnp.int32) - first
    real = real & (local >= 0) & (local < shards)
    local = jnp.clip(local, 0, shards - 1)
    home = (mix32(h ^ jnp.uint32(_HOME_SEED), jnp) % (slots - 1).astype(jnp.uint32)).astype(jnp.int32)
    probes = max(s.probes for s in specs)
    shard_base = base + local * slots
    # The slots claimed this batch are marked in arrays of claim places: the map's rows, or
    # where those outnumber the batch's probes many times, the places of the slots the ids
    # probe (``claims``), so a step's work follows its batch, not the map's size.
    if compact_claims(rows_n, k, probes):
        shard = per_table(maps.shard_starts) + local  # (numbered on this device)
        windows = probe_windows(shard_base, home, shard, sum(maps.shards), probes, rows_n)
    else:
        windows = ()
    places_n = k * probes if windows else rows_n
    lives = {s.half_life for s in specs if s.policy == "lfu" and s.half_life}
    # One half life (a run's tables share it) divides as a constant: a multiply and a shift,
    # where XLA:CPU divides by a varying divisor one element at a time (4x the time).
    divisor = np.int32(lives.pop()) if len(lives) == 1 else None

    def probed(p, shard_base, home, slots, probes_of, half_life, *windows):
        """[U] each: each id's ``p``-th probed row, its claim place, whether its table probes
        that far, and the slot's flag, recency and decayed count. Per probe, not [U, P]: the
        callers fold over the probes, with no [U, P] array and no reduction over one (compiled
        for one H200 at criteo_kaggle's batch, those arrays and their reductions were a sixth
        of the resolution's memory traffic: 3.46 -> 2.81 GB a step, 88 -> 75 kernels)."""
        in_probes = p < probes_of  # tables probe differently far
        wrap = (home + p) - (slots - 1)  # past the shard's last slot: back to slot 1
        probe = shard_base + 1 + jnp.where(wrap >= 0, wrap, wrap + (slots - 1))  # (no division)
        place = window_place(p, wrap, *windows) if windows else probe
        used, last_seen = m.used[probe], m.last_seen[probe]
        age = jnp.maximum(step - last_seen, 0)  # (a held slot's id was seen at or before the step)
        halvings = lax.div(age, jnp.maximum(half_life, 1) if divisor is None else divisor)
        decayed = m.count[probe] >> jnp.where(half_life > 0, jnp.minimum(halvings, 31), 0)
        return probe, place, in_probes, used, last_seen, decayed

    probing = (shard_base, home, slots, probes_of, half_life, *windows)  # what ``probed`` takes of each id

    def lookup(uhi, ulo, *where_):
        """Whether each id is in its probes, its row, claim place and decayed count there."""
        matched = row = place = count = None
        for p in range(probes):  # the first matching probe
            probe, at, in_probes, used, _, decayed = probed(p, *where_)
            match = in_probes & used & (m.key_hi[probe] == uhi) & (m.key_lo[probe] == ulo)
            if matched is None:
                matched, row, place, count = match, probe, at, decayed
            else:
                first = match & ~matched
                row, place = jnp.where(first, probe, row), jnp.where(first, at, place)
                matched, count = matched | match, jnp.where(first, decayed, count)
        return matched, row, place, count

    chunk = chunk if 0 < chunk < k else k
    in_passes = functools.partial(by_chunks, chunk)
    matched, found_row, found_place, found_count = in_passes(lookup, uhi, ulo, *probing)
    found = real & matched

    sketch, admitted, estimate = m.sketch, real if learn else found, occurrences
    sketch_touched = jnp.zeros(0, jnp.int32)
    if learn and any(s.counts for s in specs):
        sketch, estimate, sketch_touched = count_absent(
            maps, sketch, utab, h, local, real & ~found & counts, occurrences, step, chunk, ages
        )
        estimate = jnp.where(counts, estimate, occurrences)
        admitted = real & (found | ~counts | (estimate >= admit))
        sketch_touched = sketch_touched if touched else jnp.zeros(0, jnp.int32)

    # Placement: free slots first, then the policy's victims; the first id in (hash, low word)
    # order wins a contested slot (slots are a table's own, so contests are within a table).
    def candidates(estimate, lfu, *where_):
        """Per probe ([U] each): the probed row, its claim place, its rank for the id (two
        keys), whether it is closed."""
        out = []
        for p in range(probes):
            probe, at, in_probes, used, last_seen, decayed = probed(p, *where_)
            primary = jnp.where(used, jnp.where(lfu, decayed, last_seen), _FREE)
            # lfu: a held slot is open to an id only when the id's count exceeds the slot's
            closed = ~in_probes | (lfu & used & (estimate <= decayed))
            secondary = jnp.where(lfu, jnp.where(used, last_seen, _FREE), 0)
            out.append((probe, at, closed, primary, secondary))
        return out

    def choose(taken, per_probe):
        """Each id's best open probe, if any, its claim place and whether its slot is held: the
        least (rank, second rank) over the probes, the earlier probe on a tie, folded a probe at
        a time."""
        best1 = best2 = target = place = None
        for probe, at, closed, primary, secondary in per_probe:
            k1 = jnp.where(taken[at] | closed, _TAKEN, primary)
            if best1 is None:
                best1, best2, target, place = k1, secondary, probe, at
            else:
                better = (k1 < best1) | ((k1 == best1) & (secondary < best2))
                best1, best2 = jnp.where(better, k1, best1), jnp.where(better, secondary, best2)
                target, place = jnp.where(better, probe, target), jnp.where(better, at, place)
        return best1 < _TAKEN, target, place, best1 != _FREE

    asking = (estimate, lfu, *probing)
    if chunk == k:  # the candidates once, for every round
        fixed = candidates(*asking)
        ask = lambda taken: choose(taken, fixed)
    else:  # a chunk's candidates again each round: the ids' arrays never whole
        ask = lambda taken: in_passes(lambda *a: choose(taken, candidates(*a)), *asking)
    taken = jnp.zeros(places_n, bool).at[jnp.where(found, found_place, places_n)].set(True, mode="drop")
    pending = admitted & ~found
    placed, evicts = jnp.full(k, -1, jnp.int32), pending & False

    def round_(carry):
        r, _, taken, placed, evicts, pending, least = carry
        open_, target, place, held = ask(taken)
        asked = pending & open_
        # Each slot's least claim, by hash and then by low word, in a buffer that lives through
        # the rounds (no pass over its places a round): a slot claimed in a round is taken in
        # it (its least claimant wins), so no later round claims it again and what a round
        # leaves there is never read; the ties on a hash are set back before their low words.
        at = jnp.where(asked, place, places_n)
        least = least.at[at].min(h, mode="drop")
        asks = asked & (least[place] == h)
        at = jnp.where(asks, place, places_n)
        least = least.at[at].set(_LAST, mode="drop").at[at].min(ulo, mode="drop")
        wins = asks & (least[place] == ulo)
        placed, evicts = jnp.where(wins, target, placed), jnp.where(wins, held, evicts)
        taken = taken.at[jnp.where(wins, place, places_n)].set(True, mode="drop")
        return r + 1, jnp.any(asked & ~wins), taken, placed, evicts, pending & ~wins, least

    # At most ``probes`` rounds, and another only while an id lost a contested slot: an id that
    # did not ask had no open probe, and the slots only fill, so it still has none (no round
    # runs where no id is pending; most batches settle in one).
    # (the rows derived from the batch: inside shard_map they vary by device like it)
    if learn:  # (reading, no id asks for a slot)
        least = jnp.where(taken, _LAST, _LAST)  # (from ``taken``: inside shard_map it varies by device like it)
        carry = (0, jnp.any(pending), taken, jnp.where(pending, placed, placed), evicts, pending, least)
        more = lambda c: (c[0] < probes) & c[1]

        def switches(c, left):  # the loop's rounds, each in a switch inside the one before
            return c if left == 0 else lax.cond(more(c), lambda c: switches(round_(c), left - 1), lambda c: c, c)

        # On GPUs the rounds are switches, not a loop: XLA's runtime reads a loop's predicate on
        # the host each round (a copy and a wait, the device idle), where it records a switch of
        # kernels into the step's CUDA graph and decides it on the device (``bench.hlo_kernels``).
        # The first round runs before them, whether or not an id is pending (then it changes
        # nothing): a training batch nearly always has new ids.
        _, _, taken, placed, evicts, pending, _ = by_platform(
            lambda: lax.while_loop(more, round_, carry), lambda: switches(round_(carry), probes - 1), maps.control_flow
        )
    won = placed >= 0
    at = jnp.where(won, placed, rows_n)
    # (each winner's slot held before the batch, as its choice saw it: the map read again here
    # after the rounds was copied whole by XLA, twice, to be written in place after)
    evicted = won & evicts

    seen_at = jnp.where(found, found_row, at)
    kept = jnp.where(found, found_count, 0)
    seen_count = jnp.where(found, kept + occurrences, estimate)
    fused_row = jnp.where(found, found_row, jnp.where(won, placed, shard_base))
    distinct_row = jnp.where(real, fused_row - base, -1)  # the table's own numbering
    per_id = [
        jnp.where(real, occurrences, 0),  # lookups
        jnp.where(found, occurrences, 0),  # found
        won,  # admitted
        evicted,  # evicted
        real & ~admitted,  # held back
        pending,  # unplaced
    ]
    # one sum of the six (XLA fuses the stack into the scatter: no [U, 6] array; summed one by
    # one they were 12 of a resolution's kernels on GPUs, 3 now)
    stats = few_segment_sum(jnp.stack([x.astype(jnp.int32) for x in per_id], 1), utab, len(specs))
    to = jnp.where(won, jnp.cumsum(won, dtype=jnp.int32) - 1, n)  # the fresh rows first, in one scatter
    entries = jnp.stack([placed - base, utab, uhi.view(jnp.int32), ulo.view(jnp.int32)], 1)
    fresh = jnp.full((min(n, rows_n), 4), -1, jnp.int32).at[to].set(entries, mode="drop")  # (a row is given once)
    pad = lambda x, fill, size: jnp.concatenate([x, jnp.full(size - x.shape[0], fill, x.dtype)])
    depth = sketch_touched.shape[0] // k
    return (
        pad(distinct_row, -1, n),
        pad(at, rows_n, n),
        pad(seen_at, rows_n, n),
        pad(seen_count, 0, n),
        sketch,
        fresh,
        stats,
        pad(sketch_touched, m.sketch.shape[0], n * depth),
    )


def resolve(spec: MapSpec, m: IdMap, hi, lo, valid, step, first_shard=0, learn: bool = True) -> Resolved:
    """One table's batch of ids ``hi``/``lo`` (uint32 [N]; ``valid``: bool [N], False for
    padding) through its map ``m`` of the shards ``first_shard`` onward at train step ``step``:
    :func:`resolve_fused` of one table. Ids of other shards are left alone (row -1).
    ``learn=False``: the map is read, not changed. Traceable; ``first_shard`` may be traced."""
    maps = Maps((spec,), (m.used.shape[0] // spec.slots,))
    out = resolve_fused(
        maps,
        m._replace(sketch=m.sketch.reshape(-1)),  # one table's map is a fused map of one table
        jnp.zeros(hi.shape[0], jnp.int32),
        hi,
        lo,
        valid,
        step,
        jnp.reshape(first_shard, 1),
        learn,
    )
    rows_n = m.used.shape[0]
    fresh = jnp.zeros(rows_n, bool).at[jnp.where(out.fresh_rows >= 0, out.fresh_rows, rows_n)].set(True, mode="drop")
    new_map = out.map._replace(sketch=out.map.sketch.reshape(m.sketch.shape))
    return Resolved(out.rows, new_map, fresh, dict(zip(STATS, out.stats[0], strict=True)))
