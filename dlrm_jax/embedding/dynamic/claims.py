"""Where a resolution (``resolve``) marks the slots claimed in a batch: at the map's rows, or at
one place per slot its ids probe.

The placement's rounds keep, per slot, whether it is taken this batch and its least claim. Kept
at the map's rows, those are two arrays of the map's size filled every step: a step's scratch
and work then grow with the map (criteo_kaggle's tables uncapped, all dynamic, one CPU device
at 8,192: 247 MB of scratch, 102 MB at the places). Kept at the probes' places they follow
the batch: the ids sorted by shard and home,
every distinct slot that some id probes gets one place below ids x probes (the probe windows
below), and every id that probes the slot finds the same place, so contests for a slot meet
as they did at its row.
"""

from __future__ import annotations

import jax.numpy as jnp

from dlrm_jax.sorting import sort_with_order

# Claims are marked at the probes' own places (:func:`probe_windows`) where the map's rows are
# more than this many times the batch's probes (k ids x probes places): there the fill of two
# arrays of the map's rows a step (5 bytes a row; on one CPU device about 0.4 ns a row where
# the scratch is reused, as in training, 1.5 where it is mapped afresh) outweighs the sort of
# the ids by their probes (about 0.7 ms for 8,900 ids of 8 probes on CPU).
COMPACT_CLAIMS = 16


def compact_claims(rows: int, k: int, probes: int) -> bool:
    """Whether a resolution of ``k`` distinct ids through maps of ``rows`` rows marks its claims
    at its probes' places (:func:`probe_windows`) rather than at the map's rows."""
    return rows > COMPACT_CLAIMS * k * probes


def probe_windows(shard_base, home, shard, shards: int, probes: int, rows: int):
    """Each id's claim places, as :func:`window_place` reads them: every distinct slot the ids
    probe gets one place below U x ``probes``, the same for every id that probes it, with no
    array of the map's ``rows``. The ids sorted by shard and home, each one's window of
    ``probes`` slots from its home starts ``probes`` places after the one before where they do
    not overlap (another shard, or a gap), else as many places after as its home lies; a
    window running past the shard's last slot wraps to its first slots, and those have the
    places of the shard's first window where that covers them (the first window is the one
    with the least home: only it can), else places of their own past their window's.
    ``shard``: each id's shard, numbered below ``shards``. Returns (each id's first place, its
    shard's first home and that window's first place)."""
    u = shard_base.shape[0]
    _, order = sort_with_order(shard_base + home, rows)
    sorted_shard, sorted_home = shard[order], home[order]
    same = sorted_shard[1:] == sorted_shard[:-1]
    apart = jnp.where(same, jnp.minimum(sorted_home[1:] - sorted_home[:-1], probes), probes)
    first = jnp.cumsum(jnp.concatenate([jnp.zeros(1, jnp.int32), apart]), dtype=jnp.int32)
    # each shard's first window, set by that window's id alone (one write a shard)
    starts = jnp.concatenate([jnp.ones(1, bool), ~same])
    at = jnp.where(starts, sorted_shard, shards)
    shard_first = jnp.zeros((shards, 2), jnp.int32).at[at].set(jnp.stack([sorted_home, first], 1), mode="drop")
    of_shard = shard_first[shard]
    return jnp.zeros(u, jnp.int32).at[order].set(first, unique_indices=True), of_shard[:, 0], of_shard[:, 1]


def window_place(p, wrap, first, first_home, first_of_shard):
    """The claim place of an id's ``p``-th probe (``wrap`` >= 0: the slot it wrapped to past its
    shard's last, :func:`probe_windows`' layout)."""
    covered = (wrap >= 0) & (wrap >= first_home)  # a wrapped slot that the shard's first window holds
    return jnp.where(covered, first_of_shard + wrap - first_home, first + p)
