"""The map rows a batch sets (:class:`MapWrites`, one entry per distinct id) and their writing
where the map lies (:func:`write_map`): apart from the resolution that decides them
(``resolve``), so that a caller running it inside a switch writes the map outside it."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dlrm_jax.choices import ControlFlow
from dlrm_jax.chunks import in_chunks_on_cpu
from dlrm_jax.embedding.dynamic.idmap import IdMap

WRITE_CHUNK = 4096  # distinct ids whose map rows one pass of the write loop sets


class MapWrites(NamedTuple):
    """The map rows a batch sets, an entry per distinct id (:func:`write_map`): ``at`` int32
    [N], the row given to each new id (the map's row count: none); ``seen_at`` and
    ``seen_count``, the row each id was seen at and its count there (likewise); ``hi``/``lo``,
    the ids' words; ``count``, int32, the entries that hold an id (the rest are padding)."""

    at: jax.Array
    seen_at: jax.Array
    seen_count: jax.Array
    hi: jax.Array
    lo: jax.Array
    count: jax.Array

    def fitted(self, n: int, rows: int) -> MapWrites:
        """The same writes in ``n`` entries (``rows``: the map's row count, the padding's row).
        More entries than ``n`` are compacted, those that write a row first: each writes rows
        no other does, so at most ``rows`` of them do (``n`` >= ``rows``)."""
        have = self.at.shape[0]
        if have > n:
            if n < rows:
                raise ValueError(f"{have} map writes cannot fit in {n} entries of a map of {rows} rows")
            keep = (self.at < rows) | (self.seen_at < rows)
            to = jnp.where(keep, jnp.cumsum(keep, dtype=jnp.int32) - 1, n)
            put = lambda x, fill: jnp.full(n, fill, x.dtype).at[to].set(x, mode="drop")
            count = jnp.sum(keep, dtype=jnp.int32)
            return MapWrites(put(self.at, rows), put(self.seen_at, rows), *(put(x, 0) for x in self[2:5]), count)
        grow = lambda x, fill: jnp.concatenate([x, jnp.full(n - have, fill, x.dtype)])
        return MapWrites(grow(self.at, rows), grow(self.seen_at, rows), *(grow(x, 0) for x in self[2:5]), self.count)


def write_map(m: IdMap, w: MapWrites, step, form: str = ControlFlow.AUTO) -> IdMap:
    """``m`` with the writes ``w`` of the batch at ``step`` made where the map lies, a chunk of
    entries at a time (``chunks.in_chunks``: a write inside a switch's branch copied the map
    whole, every step), or at once on GPUs (``chunks.in_chunks_on_cpu``, ``form`` as its;
    padding writes nothing)."""

    def write(m, at, seen_at, seen_count, hi, lo):
        return m._replace(
            key_hi=m.key_hi.at[at].set(hi, mode="drop"),
            key_lo=m.key_lo.at[at].set(lo, mode="drop"),
            used=m.used.at[at].set(True, mode="drop"),
            last_seen=m.last_seen.at[seen_at].set(jnp.asarray(step, jnp.int32), mode="drop"),
            count=m.count.at[seen_at].set(seen_count, mode="drop"),
        )

    return in_chunks_on_cpu(w[:5], w.count, WRITE_CHUNK, m, write, form)  # (each entry sets: written twice, the same)
