"""MLPerf DLRM-DCNv2's one-hot -> multi-hot rule, re-implemented with vectorised NumPy.

The reference is ``recommendation_v2/torchrec_dlrm/multi_hot.py`` (class ``Multihot``, method
``__make_multi_hot_indices_tables``) in github.com/mlcommons/training, applied to every Criteo
1TB day by ``recommendation_v2/torchrec_dlrm/scripts/materialize_synthetic_multihot_dataset.py``.

The rule is a fixed lookup table per feature, not a hash: feature ``f`` with cardinality ``C``
and bag size ``m`` owns a table of ``C`` rows and ``m`` columns whose row ``i`` is the bag of
one-hot id ``i``. Column 0 is ``i`` itself; columns 1..m-1 are random draws made once, row-major,
from ONE legacy MT19937 stream seeded with 0 before feature 0 and continued feature after feature
(so a feature's table also depends on the cardinalities and bag sizes of the features before it):

* ``uniform`` (what MLPerf uses): ``randint(0, C)`` for each of the ``C * (m - 1)`` cells;
* ``pareto``: ``pareto(a=0.25)`` draws truncated to int32, then taken modulo ``C`` (draws above
  2**31 overflow in that cast to INT32_MIN on x86, exactly as in the reference).

A feature with ``m == 1`` (or ``C == 1``, for uniform) consumes no draws. The script first
reduces each raw id modulo ``C`` (``expand(..., wrap=True)``), then writes one int32 array of
shape ``[rows, m]`` per feature (fixed-length bags) into ``day_{d}_sparse_multi_hot.npz``.
``expand`` returns those arrays side by side: feature ``f``'s bag in columns
``[start_f, start_f + m_f)``. The same id of the same feature always gets the same bag, so the
output does not depend on how rows are split between workers.

Memory: the tables hold exactly the reference's random cells, as int32 (column 0 is not stored):
``4 * sum(C_f * (m_f - 1))`` bytes, see ``table_bytes``. With the MLPerf cardinalities that is
about 23 GB, dominated by the 40M-row features (bag 100 alone: 15.8 GB) and cannot be made
smaller without changing the dataset. Build it once (about 2 minutes of MT19937 draws, at
~55M cells/s), ``save`` it, and have every worker ``load`` it memory-mapped: one copy in the
page cache.

Plain NumPy, no JAX: meant for the host-side preprocessing workers (processes), one rule each.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np

MLPERF_DCNV2_BAG_SIZES: tuple[int, ...] = (
    3,
    2,
    1,
    2,
    6,
    1,
    1,
    1,
    1,
    7,
    3,
    8,
    1,
    6,
    9,
    5,
    1,
    1,
    1,
    12,
    100,
    27,
    10,
    3,
    1,
    1,
)
DISTRIBUTIONS = ("uniform", "pareto")
SEED = 0  # np.random.seed(0) in the reference, once for all tables
PARETO_SHAPE = 0.25
_CHUNK_CELLS = 1 << 22  # float64 pareto draws made at a time (32 MiB)
_BLOCK_ROWS = 4096  # rows expanded at a time
_META = "rule.json"


def rule_name(distribution: str = "uniform") -> dict:
    """What names a rule whose tables are drawn again rather than kept: its distribution and
    seed, as a dataset's meta.json (``multi_hot``) and a serving artifact record it."""
    return {"distribution": distribution, "seed": SEED}


def check_seed(seed, where: str) -> None:
    """Tables drawn with another seed than this module's are another rule: refused, naming ``where``."""
    if seed != SEED:
        raise ValueError(f"{where}: multi-hot tables drawn with seed {seed}, not {SEED}")


def _check(cardinalities: Sequence[int], bag_sizes: Sequence[int], distribution: str):
    cards, bags = [int(c) for c in cardinalities], [int(m) for m in bag_sizes]
    if len(cards) != len(bags):
        raise ValueError(f"{len(cards)} cardinalities but {len(bags)} bag sizes")
    if not cards:
        raise ValueError("no features: cardinalities is empty")
    if min(cards) < 1 or max(cards) > 2**31 - 1:
        raise ValueError(f"cardinalities must lie in [1, 2**31 - 1], got {cards}")
    if min(bags) < 1:
        raise ValueError(f"bag sizes must be >= 1, got {bags}")
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    return cards, bags


def table_bytes(cardinalities: Sequence[int], bag_sizes: Sequence[int]) -> int:
    """Bytes the int32 lookup tables of these features take."""
    return 4 * sum(int(c) * (int(m) - 1) for c, m in zip(cardinalities, bag_sizes, strict=True))


def _draw_tables(cards: list[int], bags: list[int], distribution: str) -> list[np.ndarray]:
    rs = np.random.RandomState(SEED)  # same stream as the reference's global np.random.seed(0)
    tables = []
    for card, m in zip(cards, bags, strict=True):
        if m == 1:
            table = np.empty((card, 0), np.int32)  # draws nothing, as in the reference
        elif distribution == "uniform":
            # Drawing straight to int32 gives the values and stream of the default int64 draw.
            table = rs.randint(0, card, size=(card, m - 1), dtype=np.int32)
        else:
            table = np.empty((card, m - 1), np.int32)
            step = max(1, _CHUNK_CELLS // (m - 1))
            for lo in range(0, card, step):
                draws = rs.pareto(PARETO_SHAPE, size=(min(step, card - lo), m - 1))
                with np.errstate(invalid="ignore"):  # the reference's overflowing cast
                    table[lo : lo + step] = draws.astype(np.int32) % np.int32(card)
        tables.append(table)
    return tables


class MultiHotRule:
    """The one-hot -> multi-hot tables of a set of features, and ``expand`` to apply them."""

    def __init__(
        self,
        cardinalities: Sequence[int],
        bag_sizes: Sequence[int],
        distribution: str = "uniform",
        *,
        tables: Sequence[np.ndarray] | None = None,
    ):
        self.cardinalities, self.bag_sizes = _check(cardinalities, bag_sizes, distribution)
        self.distribution = distribution
        self.starts = tuple(int(s) for s in np.cumsum([0, *self.bag_sizes[:-1]]))
        self.width = sum(self.bag_sizes)
        if tables is None:
            tables = _draw_tables(self.cardinalities, self.bag_sizes, distribution)
        for f, (t, c, m) in enumerate(zip(tables, self.cardinalities, self.bag_sizes, strict=True)):
            if t.shape != (c, m - 1) or t.dtype != np.int32:
                raise ValueError(f"table {f} is {t.dtype} {t.shape}, expected int32 {(c, m - 1)}")
        self.tables = list(tables)

    @property
    def nbytes(self) -> int:
        return table_bytes(self.cardinalities, self.bag_sizes)

    def expand(self, ids_nf: np.ndarray, *, wrap: bool = False, out: np.ndarray | None = None) -> np.ndarray:
        """int32 [n, F] table-local one-hot ids -> int32 [n, sum(bag_sizes)] bags.

        wrap: reduce ids modulo the cardinality first, as the materialise script does;
        otherwise an id outside [0, cardinality) is an error. out: an int32 [n, width] array to
        fill (reusing one saves the page faults of a fresh output, a large part of the cost).
        """
        ids = np.asarray(ids_nf)
        num_features = len(self.cardinalities)
        if ids.ndim != 2 or ids.shape[1] != num_features:
            raise ValueError(f"ids must have shape [n, {num_features}], got {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"ids must be integers, got {ids.dtype}")
        n = ids.shape[0]
        if out is None:
            out = np.empty((n, self.width), np.int32)
        elif out.shape != (n, self.width) or out.dtype != np.int32:
            raise ValueError(f"out is {out.dtype} {out.shape}, expected int32 {(n, self.width)}")
        if n == 0:
            return out
        cards = np.asarray(self.cardinalities, np.int64)[:, None]
        scratch = np.empty(_BLOCK_ROWS * (max(self.bag_sizes) - 1), np.int32)
        features = list(zip(self.tables, self.bag_sizes, self.starts, strict=True))
        # Blocks of rows, small enough that the block's ids and each feature's gathered rows are
        # still in cache when copied into their (strided) columns of the output.
        for lo in range(0, n, _BLOCK_ROWS):
            block = out[lo : lo + _BLOCK_ROWS]
            rows = block.shape[0]
            cols = ids[lo : lo + rows].T  # [F, rows]
            if wrap:
                cols = cols % cards
            else:
                low, high = cols.min(axis=1), cols.max(axis=1)
                for f in np.flatnonzero((low < 0) | (high >= cards[:, 0])):
                    bad = low[f] if low[f] < 0 else high[f]
                    raise ValueError(f"feature {f}: id {bad} outside [0, {self.cardinalities[f]})")
            cols = np.ascontiguousarray(cols, np.int32)
            for f, (table, m, s) in enumerate(features):
                col = cols[f]
                block[:, s] = col
                if m > 1:
                    bags = scratch[: rows * (m - 1)].reshape(rows, m - 1)
                    np.take(table, col, axis=0, out=bags, mode="clip")  # ids checked above
                    block[:, s + 1 : s + m] = bags
        return out

    def save(self, directory: str | os.PathLike) -> None:
        """Write the tables as .npy files (one per feature with bag > 1) and a rule.json."""
        os.makedirs(directory, exist_ok=True)
        meta = dict(
            cardinalities=self.cardinalities, bag_sizes=self.bag_sizes, distribution=self.distribution, seed=SEED
        )
        for f, table in enumerate(self.tables):
            if table.size:
                np.save(os.path.join(directory, f"table_{f}.npy"), table)
        with open(os.path.join(directory, _META), "w") as fh:
            json.dump(meta, fh)

    @classmethod
    def load(cls, directory: str | os.PathLike, *, mmap: bool = True) -> MultiHotRule:
        """The rule ``save`` wrote; memory-mapped (read-only) unless mmap is False."""
        with open(os.path.join(directory, _META)) as fh:
            meta = json.load(fh)
        check_seed(meta.get("seed"), str(directory))
        tables = []
        for f, (c, m) in enumerate(zip(meta["cardinalities"], meta["bag_sizes"], strict=True)):
            path = os.path.join(directory, f"table_{f}.npy")
            empty = np.empty((c, m - 1), np.int32)
            tables.append(np.load(path, mmap_mode="r" if mmap else None) if m > 1 else empty)
        return cls(meta["cardinalities"], meta["bag_sizes"], meta["distribution"], tables=tables)
