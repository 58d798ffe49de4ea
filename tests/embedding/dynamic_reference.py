"""A plain Python model of the dynamic tables' id map (dlrm_jax/embedding/dynamic/idmap.py):
a dict from id to row and per-row lists, one id at a time; the rules written out once more,
without arrays, to hold the traced map against."""

import numpy as np

from dlrm_jax.embedding.dynamic.idmap import _HOME_SEED, _SKETCH_SEEDS, MapSpec, id_hash
from dlrm_jax.hashing import mix32

BIG = 2**31 - 1


def h32(x: int) -> int:
    return int(mix32(np.array([x], np.uint32))[0])


class DictMap:
    def __init__(self, spec: MapSpec):
        self.spec = spec
        self.row_of: dict[int, int] = {}  # id -> row
        self.id_at: dict[int, int] = {}  # row -> id
        self.last_seen = [0] * spec.rows
        self.count = [0] * spec.rows
        self.sketch = {}  # (shard, d, col) -> count

    def _hash(self, key: int) -> int:
        hi, lo = np.array([key >> 32], np.uint32), np.array([key & 0xFFFFFFFF], np.uint32)
        return int(id_hash(hi, lo, np)[0])

    def order(self, key: int) -> tuple[int, int]:
        """Who wins a contested slot: the smaller (hash, low word)."""
        return self._hash(key), key & 0xFFFFFFFF

    def probes(self, key: int) -> tuple[int, list[int]]:
        s = self.spec
        h = self._hash(key)
        shard = h % s.vshards
        home = h32(h ^ _HOME_SEED) % (s.slots - 1)
        return shard, [shard * s.slots + 1 + (home + p) % (s.slots - 1) for p in range(s.probes)]

    def decayed(self, row: int, step: int) -> int:
        s = self.spec
        if s.policy != "lfu" or not s.half_life:
            return self.count[row]
        return self.count[row] >> min((step - self.last_seen[row]) // s.half_life, 31)

    def open_to(self, row: int, estimate: int, decayed: dict) -> bool:
        """Whether a new id of count ``estimate`` may take ``row``: a free row, or under lfu a
        held row whose decayed count is below it."""
        return row not in self.id_at or self.spec.policy != "lfu" or estimate > decayed[row]

    def resolve(self, ids: list[int | None], step: int) -> tuple[list[int], set[int], dict]:
        """Rows of ``ids`` (None: padding -> -1), the fresh rows, and the counts."""
        s = self.spec
        occurrences: dict[int, int] = {}
        for key in ids:
            if key is not None:
                occurrences[key] = occurrences.get(key, 0) + 1
        distinct = sorted(occurrences, key=self.order)
        found = {k for k in distinct if k in self.row_of}
        absent = [k for k in distinct if k not in found]
        cells = {
            k: [
                (self.probes(k)[0], d, h32(self._hash(k) ^ seed) % s.sketch_width)
                for d, seed in enumerate(_SKETCH_SEEDS[: s.sketch_depth])
            ]
            for k in absent
        }
        if s.counts and s.half_life and step > 0 and step % s.half_life == 0:
            self.sketch = {cell: v >> 1 for cell, v in self.sketch.items()}
        if s.counts:  # the whole batch counted first, then each id's estimate read
            for k in absent:
                for cell in cells[k]:
                    self.sketch[cell] = self.sketch.get(cell, 0) + occurrences[k]
        estimate = {k: min(self.sketch[c] for c in cells[k]) if s.counts else occurrences[k] for k in absent}
        admitted = set(found) | {k for k in absent if not s.counts or estimate[k] >= s.admit}
        taken = {self.row_of[k] for k in found}
        decayed = {r: self.decayed(r, step) for r in self.id_at}

        def key_of(row: int):
            if row not in self.id_at:
                return (-(2**31), -(2**31) if s.policy == "lfu" else 0)
            if s.policy == "lru":
                return (self.last_seen[row], 0)
            return (decayed[row], self.last_seen[row])

        pending = [k for k in distinct if k in admitted and k not in found]
        placed: dict[int, int] = {}
        for _ in range(s.probes):
            asks: dict[int, int] = {}  # row -> smallest id asking for it
            for k in pending:
                free = [r for r in self.probes(k)[1] if r not in taken and self.open_to(r, estimate[k], decayed)]
                if not free:
                    continue
                target = min(free, key=lambda r: (key_of(r), self.probes(k)[1].index(r)))
                asks[target] = min(asks.get(target, k), k, key=self.order)
            for row, k in asks.items():
                placed[k] = row
                taken.add(row)
            pending = [k for k in pending if k not in placed]
        stats = {"lookups": sum(occurrences.values()), "found": sum(occurrences[k] for k in found)}
        stats.update(admitted=len(placed), evicted=sum(r in self.id_at for r in placed.values()))
        stats.update(held_back=sum(k not in admitted for k in distinct), unplaced=len(pending))
        for k in found:
            r = self.row_of[k]
            self.count[r] = decayed[r] + occurrences[k]
            self.last_seen[r] = step
        for k, r in placed.items():
            if r in self.id_at:
                del self.row_of[self.id_at[r]]
            self.id_at[r], self.row_of[k] = k, r
            self.count[r], self.last_seen[r] = estimate[k], step

        def row(k):
            if k is None:
                return -1
            if k in self.row_of:
                return self.row_of[k]
            return self.probes(k)[0] * s.slots  # its shard's shared row

        return [row(k) for k in ids], set(placed.values()), stats
