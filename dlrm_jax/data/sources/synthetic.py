"""Criteo-shaped synthetic data with power-law id popularity and a learnable hidden model.

One counter-based definition, evaluated twice. Every random number is a 32-bit word ``mix32``
of (seed, stream, step, global row index, field), so a row depends on its index in the global
batch only (never on how the batch is split between processes or devices), and a resumed run
sees the data an uninterrupted one saw. Words become values by integer arithmetic, exactly
rounded float32 multiplies and tables built once on the host. The code is written once against
an array namespace ``xp``: numpy evaluates it on the host, ``jax.numpy`` inside ``jax.jit`` on
the devices (uint32 wraps in both; no x64), and the two give the same batches bit for bit.

* Dense counts: floor(exp(N(mu_k, 1.4))) by inverse transform, 10% missing, 5% of column 1
  negative (-1..-3); the dense features are log1p(count) from a float32 table. Ids: the bounded
  power law P(rank) ~ rank**-zipf_exponent, ``permuted`` over the table by a multiplicative
  bijection or ``frequency_ordered`` (id = rank). Multi-hot bags: lengths uniform in [0, bag],
  PAD_ID past the length.
* Quantile tables: K = 1024 equal-probability bins, the last split again into K (tails resolved
  to probability 2**-20), values uniform over a bin's integers: the distributions above,
  quantised to that resolution.
* Labels: Bernoulli(sigmoid(logit)), the hidden logit an integer in units of 2**-16: a per-id
  score for every table (the centred sum of the bytes of a hash of the id, near-normal, so a
  10M-row table costs no memory), a linear term over the dense features, pairwise products of
  4-wide hidden id vectors for a few feature pairs, a bias calibrated to ``positive_rate``.
  Frequent ids are learnable, rare ones mostly noise.

Threads: the host path (``raw``, ``batch``, :class:`SyntheticSource`'s ``train_batch``) is
numpy on whichever thread calls it, ``CHUNK`` rows at a time. The device path
(:meth:`SyntheticGenerator.device_batches`) dispatches jitted programs without collectives
(five a batch on CPUs, one on GPUs): call it from the thread that dispatches the train step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from dlrm_jax.data.batch import PAD_ID, Batch, process_slice
from dlrm_jax.data.sources.synthetic_draws import (  # noqa: F401 - zipf_ids re-exported
    _BINS,
    _BYTES_STD,
    _FIX,
    _byte_sum,
    _count_bins,
    _draw_fields,
    _fields,
    _fold,
    _noise_bins,
    _permutation,
    _permute,
    _words,
    _zipf_bins,
    zipf_ids,
)
from dlrm_jax.hashing import mix32

CHUNK = 8192  # rows the host evaluates at once (bounds temporaries; no part of the data)
# Threads for the ids alone (planning, hot-row statistics): numpy's arithmetic lets go of the
# GIL, so chunks run side by side (the planner's 4 calibration batches of DLRM-DCNv2: 2.7 s ->
# 1.2 s on 2 cores). Whole batches stay on their caller's thread: the input pipeline already
# runs several readers.
_ID_THREADS = min(8, os.cpu_count() or 1)


def _by_chunks(fn, lo: int, hi: int, threads: int = 1) -> list:
    """``fn(rows_n)`` for each CHUNK of rows ``lo:hi`` (uint32), in order, on up to
    ``threads`` threads."""
    chunks = [np.arange(start, min(start + CHUNK, hi), dtype=np.uint32) for start in range(lo, hi, CHUNK)]
    if len(chunks) < 2 or threads < 2:
        return [fn(rows_n) for rows_n in chunks]
    with ThreadPoolExecutor(min(threads, len(chunks))) as pool:
        return list(pool.map(fn, chunks))


TRAIN_STREAM, EVAL_STREAM, CALIBRATION_STREAM = 0, 1, 2
_LATENT = 4  # width of the hidden id vectors (the four bytes of a word)
_ID, _COUNT, _MISSING, _BAG, _NEG, _LABEL, _SCORE, _VECTOR = range(1, 9)  # kinds of fields


class RawSamples(NamedTuple):
    """Samples before normalisation, as they would appear in a Criteo TSV line.

    counts:  int64 [n, num_dense]  raw integer features; missing ones are held in ``missing``
    missing: bool  [n, num_dense]
    ids:     int32 [n, S]          table-local ids, PAD_ID for empty bag slots
    labels:  int8  [n]
    """

    counts: np.ndarray
    missing: np.ndarray
    ids: np.ndarray
    labels: np.ndarray


# ---------------------------------------------------------------- the generator


class _Tables(NamedTuple):
    """What the definition reads besides static shapes: numpy on the host, replicated
    jax.Arrays on the devices. S slots (bag positions), F features, D dense columns, K bins."""

    id_bins: np.ndarray  # int32 [2, F * (2K - 1)]  rank quantile tables
    id_base: np.ndarray  # int32 [S]  offset of each slot's table
    id_mult: np.ndarray  # uint32 [S]  id = (rank * mult + shift) % rows
    id_shift: np.ndarray  # uint32 [S]
    id_rows: np.ndarray  # uint32 [S]
    id_inv: np.ndarray  # float32 [S]  1 / rows
    id_key: np.ndarray  # uint32 [S]  hash key of the hidden model's per-id words
    count_bins: np.ndarray  # int32 [2, D * (2K - 1)]
    count_base: np.ndarray  # int32 [D]
    log1p: np.ndarray  # float32 [C]  log1p(c), rounded from float64, for every count c drawn
    noise_bins: np.ndarray  # int32 [2, 2K - 1]  the labels' logistic noise
    dense_w: np.ndarray  # int32 [D]  logit per dense feature, in 2**-16 per 2**-8
    feature_w: np.ndarray  # int32 [F]  logit per unit of a per-id score
    bias: np.ndarray  # int32 []


class SyntheticGenerator:
    """Draws raw Criteo-shaped samples and their labels; see the module docstring."""

    def __init__(
        self,
        *,
        seed: int,
        num_dense: int,
        table_rows: tuple[int, ...],
        bag_sizes: tuple[int, ...],
        zipf_exponent: float,
        positive_rate: float,
        id_layout: str = "permuted",
    ):
        self.seed, self.num_dense = seed, num_dense
        self.table_rows, self.bag_sizes = tuple(table_rows), tuple(bag_sizes)
        self.zipf_exponent, self.permuted = zipf_exponent, id_layout == "permuted"
        self.slot_feature = np.repeat(np.arange(len(table_rows)), self.bag_sizes)  # [S]
        starts = np.cumsum((0, *bag_sizes))
        self.spans = [(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:], strict=True)]
        params = np.random.default_rng([seed, 7_777])
        self._count_mu = params.uniform(0.0, 4.0, num_dense)
        dense_w = params.normal(0.0, 0.35, num_dense)
        feature_w = params.uniform(0.3, 1.0, len(table_rows))
        nf = len(table_rows)
        self._pairs = [tuple(int(f) for f in params.choice(nf, 2, replace=False)) for _ in range(min(8, nf // 2))]
        self.host = self._tables(dense_w, feature_w)
        bias = round(self._calibrate(positive_rate) * 2**_FIX)
        self.host = self.host._replace(bias=np.int32(bias))

    def _tables(self, dense_w: np.ndarray, feature_w: np.ndarray) -> _Tables:
        rows = self.table_rows
        perm = [_permutation(r, f) if self.permuted else (1, 0) for f, r in enumerate(rows)]
        slot = lambda v, dtype=np.uint32: np.asarray(v, dtype)[self.slot_feature]
        count_bins = [_count_bins(mu) for mu in self._count_mu] or [np.ones((2, 1), np.int32)]
        return _Tables(
            id_bins=np.concatenate([_zipf_bins(r, self.zipf_exponent) for r in rows], axis=1),
            id_base=slot(np.arange(len(rows)) * (2 * _BINS - 1), np.int32),
            id_mult=slot([m for m, _ in perm]),
            id_shift=slot([s for _, s in perm]),
            id_rows=slot(rows),
            id_inv=slot(1 / np.asarray(rows, np.float32), np.float32),
            id_key=slot([_fold(self.seed, _SCORE, f) for f in range(len(rows))]),
            count_bins=np.concatenate(count_bins, axis=1),
            count_base=np.arange(self.num_dense, dtype=np.int32) * (2 * _BINS - 1),
            noise_bins=_noise_bins(),
            log1p=normalise_dense(np.arange(max(lo[-1] + w[-1] for lo, w in count_bins)), False),
            dense_w=np.round(dense_w * 2 ** (_FIX - 8)).astype(np.int32),
            feature_w=np.round(feature_w * 2**_FIX / _BYTES_STD).astype(np.int32),
            bias=np.int32(0),
        )

    # ---------------------------------------------------------------- the definition
    # Arrays are field-major, [fields, n] (``_dn``: D dense columns, ``_sn``: S slots): XLA:CPU
    # vectorises a loop over the rows, and a few fields in the inner loop run 1.5-5x slower.
    def _row_keys(self, xp, stream: int, step, rows_n):
        """uint32 [n]: the key of each global row ``rows_n`` of batch ``step`` of ``stream``."""
        s = xp.asarray(step).astype(xp.uint32)
        k1 = mix32(s ^ _fold(self.seed, stream, 1), xp)
        k2 = mix32(s * xp.uint32(0x9E3779B9) ^ _fold(self.seed, stream, 2), xp)
        return mix32(mix32(rows_n * xp.uint32(0x85EBCA6B) + k1, xp) ^ k2, xp)

    def _features(self, xp, t: _Tables, key_n):
        """(counts_dn int32, missing_dn bool, ids_sn int32) of the rows with keys ``key_n``."""
        d = self.num_dense
        counts_dn = _draw_fields(xp, t.count_bins, t.count_base, key_n, _COUNT, d)
        missing_dn = _words(xp, key_n, _fields(_MISSING, d)) >> 16 < round(0.1 * 2**16)
        if d > 1:  # Criteo's second integer feature can be negative
            w_n = _words(xp, key_n, _fields(_NEG, 1))[0]
            value_n = -1 - (((w_n & xp.uint32(0xFFFF)) * 3) >> 16).astype(xp.int32)
            negative_n = (w_n >> 16) < round(0.05 * 2**16)
            counts_dn = xp.where(negative_n & (np.arange(d) == 1)[:, None], value_n, counts_dn)
        return counts_dn, missing_dn, self._ids(xp, t, key_n)

    def _ids(self, xp, t: _Tables, key_n):
        column = lambda v: v[:, None]  # a per-slot constant against the rows
        rank_sn = _draw_fields(xp, t.id_bins, t.id_base, key_n, _ID, len(self.slot_feature))
        if self.permuted:
            rank_sn = _permute(xp, rank_sn, *map(column, (t.id_mult, t.id_shift, t.id_rows, t.id_inv)))
        bags = np.asarray(self.bag_sizes)
        if bags.max() == 1:
            return rank_sn
        multi = np.flatnonzero(bags > 1)
        length_mn = ((_words(xp, key_n, _fields(_BAG, len(multi))) >> 16) * column(bags[multi] + 1)) >> 16
        row = np.maximum(np.cumsum(bags > 1) - 1, 0)[self.slot_feature]  # [S]
        length_sn = xp.where(column(bags[self.slot_feature] > 1), length_mn.astype(xp.int32)[row], 1)
        valid_sn = length_sn > column(np.concatenate([np.arange(b) for b in bags]))
        return xp.where(valid_sn, rank_sn, PAD_ID)

    @staticmethod
    def _present(xp, counts_dn, missing_dn):
        """int32 [D, n]: the counts the dense features see: missing ones and negatives are 0."""
        return xp.where(missing_dn, 0, xp.maximum(counts_dn, 0))

    @staticmethod
    def _dense(xp, t: _Tables, present_dn):
        """float32 [D, n]: the DLRM dense features, log1p of the present counts, by table:
        equal to :func:`normalise_dense` bit for bit, in numpy and in XLA."""
        return xp.take(t.log1p, present_dn)

    @staticmethod
    def _noise(xp, t: _Tables, key_n):
        """int32 [n]: the labels' logistic noise."""
        return _draw_fields(xp, t.noise_bins, np.zeros(1, np.int32), key_n, _LABEL, 1)[0]

    def _labels(self, xp, t: _Tables, noise_n, dense_dn, ids_sn):
        """(labels_n bool, logit_n int32): Bernoulli(sigmoid(logit)) by logistic noise."""
        logit_n = self._logit(xp, t, dense_dn, ids_sn)
        return logit_n + noise_n > 0, logit_n

    def _logit(self, xp, t: _Tables, dense_dn, ids_sn):
        """int32 [n]: the hidden model's logit in units of 2**-16 (int32 sums: exact in any order)."""
        fixed_dn = xp.floor(dense_dn * xp.float32(256.0)).astype(xp.int32)  # exact
        logit_n = _sum_rows(fixed_dn * t.dense_w[:, None]) + t.bias
        valid_sn = None if max(self.bag_sizes) == 1 else ids_sn != PAD_ID
        word_sn = mix32(ids_sn.astype(xp.uint32) ^ t.id_key[:, None], xp)
        score_fn = _byte_sum(xp, word_sn)
        if valid_sn is not None:
            score_fn = xp.stack([_bag_mean(xp, score_fn[a:b], valid_sn[a:b]) for a, b in self.spans])
        logit_n = logit_n + _sum_rows(score_fn * t.feature_w[:, None])
        vectors = {f: self._vector(xp, word_sn, valid_sn, f) for pair in self._pairs for f in pair}
        dot_n = sum(vectors[f][k] * vectors[g][k] for f, g in self._pairs for k in range(_LATENT))
        return logit_n + ((dot_n * 3) >> 1)  # 0.5 / _BYTES_STD**2 * 2**16 = 1.5 a unit

    def _vector(self, xp, word_sn, valid_sn, f: int) -> list:
        """Feature ``f``'s hidden vector, ``_LATENT`` int32 [n]: centred bytes of a hash of the
        id (uniform, std ``_BYTES_STD``), averaged over the bag."""
        a, b = self.spans[f]
        w_bn = mix32(word_sn[a:b] ^ _fields(_VECTOR, 1)[0], xp)
        parts = [((w_bn >> 8 * k) & xp.uint32(0xFF)).astype(xp.int32) * 2 - 255 for k in range(_LATENT)]
        if b - a == 1:
            return [p[0] for p in parts]
        return [_bag_mean(xp, p, valid_sn[a:b]) for p in parts]

    def _calibrate(self, positive_rate: float) -> float:
        """The bias that gives the requested click-through rate, by bisection on a sample."""
        logits = self._host_rows(CALIBRATION_STREAM, 0, 0, 16 * 1024)[4] / 2.0**_FIX
        lo, hi = -20.0, 20.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            too_many = np.mean(1.0 / (1.0 + np.exp(-(logits + mid)))) > positive_rate
            lo, hi = (lo, mid) if too_many else (mid, hi)
        return 0.5 * (lo + hi)

    # ---------------------------------------------------------------- host and device paths
    def _host_rows(self, stream: int, step: int, lo: int, hi: int) -> tuple:
        """(counts, missing, ids, labels, logit) of rows ``lo:hi`` by numpy, CHUNK at a time."""

        def chunk(rows_n):
            with np.errstate(over="ignore"):
                key_n = self._row_keys(np, stream, step, rows_n)
                counts, missing, ids = self._features(np, self.host, key_n)
                dense = self._dense(np, self.host, self._present(np, counts, missing))
                labels, logit = self._labels(np, self.host, self._noise(np, self.host, key_n), dense, ids)
                return counts.T, missing.T, ids.T, labels, logit

        return tuple(np.concatenate(p) for p in zip(*_by_chunks(chunk, lo, hi), strict=True))

    def ids(self, stream: int, step: int, lo: int, hi: int) -> np.ndarray:
        """int32 [hi - lo, S]: the ids of rows ``lo:hi``, as :meth:`raw` gives them, without the
        dense features and labels (a third of the work on multi-hot data)."""

        def chunk(rows_n):
            with np.errstate(over="ignore"):  # (per thread: numpy's error state is)
                return self._ids(np, self.host, self._row_keys(np, stream, step, rows_n)).T

        return np.concatenate(_by_chunks(chunk, lo, hi, _ID_THREADS))

    def raw(self, stream: int, step: int, lo: int, hi: int) -> RawSamples:
        """Rows ``lo:hi`` of global batch ``step`` of ``stream``, unnormalised (host numpy)."""
        counts, missing, ids, labels, _ = self._host_rows(stream, step, lo, hi)
        return RawSamples(counts.astype(np.int64), missing, ids, labels.astype(np.int8))

    def logits(self, stream: int, step: int, lo: int, hi: int) -> np.ndarray:
        """The hidden model's logits of those rows: the labels' true log-odds, so their AUC
        is the best any model can reach on these samples."""
        return self._host_rows(stream, step, lo, hi)[4] / 2.0**_FIX

    def batch(self, stream: int, step: int, lo: int, hi: int) -> Batch:
        counts, missing, ids, labels = self.raw(stream, step, lo, hi)
        return Batch(normalise_dense(counts, missing), ids, labels.astype(np.float32))

    def device_batches(self, stream: int, global_batch: int, sharding) -> Callable[[int], Batch]:
        """``make(step)``: global batch ``step`` of ``stream`` generated on the devices, a Batch
        of jax.Arrays with the batch ``sharding`` (a NamedSharding splitting dim 0, e.g.
        ``StepFunctions.batch_sharding``): dense f32 [B, num_dense], ids i32 [B, S], labels f32
        [B]. Each device computes its own rows; with several processes, each process's devices
        hold its rows, as ``StepFunctions.device_batch(batch(...))`` places them. Bitwise equal
        to :meth:`batch`. ``step`` is traced: one compilation serves every step."""
        return _DeviceBatches(self, stream, global_batch, sharding)


# Platforms whose devices make a batch in five programs (:class:`_DeviceBatches`); elsewhere one.
FIVE_PROGRAMS_ON = ("cpu",)


class _DeviceBatches:
    """The device path on CPUs: five jitted programs, the rows' keys, the features (and the
    labels' noise), the labels and dense features, then each field-major output in the batch's
    row-major layout. In one program XLA:CPU would recompute keys, hashes and gathers in every
    loop that reads them, and a transpose fused with the arithmetic that feeds it, or with a
    second transpose, runs 3x slower than on its own (5.8 against 8.7 ms a batch of 65,536 for
    three programs row-major, 1 CPU device). On GPUs the same functions make one program: each
    launch is work on the thread that dispatches the train step, five of them a step."""

    def __init__(self, gen: SyntheticGenerator, stream: int, global_batch: int, sharding):
        import jax  # here, not at the top: the host path and its users need no jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        self.jax, self.xp = jax, jax.numpy
        self.gen, self.stream, mesh = gen, stream, sharding.mesh
        axes = sharding.spec[0] if isinstance(sharding.spec[0], tuple) else (sharding.spec[0],)
        self.axes, self.per = axes, global_batch // math.prod(mesh.shape[a] for a in axes)
        if self.per * math.prod(mesh.shape[a] for a in axes) != global_batch:
            raise ValueError(f"batch {global_batch} does not split evenly over {axes} of {mesh}")
        everywhere = NamedSharding(mesh, P())  # make_array_*: also with several processes
        self.tables = jax.tree.map(
            lambda x: jax.make_array_from_callback(np.shape(x), everywhere, lambda i: np.asarray(x)[i]), gen.host
        )
        rows, fields = P(axes), P(None, axes)  # [n] and field-major [m, n], split by rows
        on_devices = lambda fn, ins, outs: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), *ins), out_specs=outs))
        self.keys = on_devices(self._keys, [P()], rows)
        self.features = on_devices(self._features, [rows], (fields, fields, rows))
        self.finish = on_devices(self._finish, [rows, fields, fields], (fields, rows))
        # one transpose a program: XLA:CPU runs a lone transpose 3-4x faster than two together
        self.row_major = on_devices(lambda t, x: x.T, [fields], rows)
        self.whole = None
        if mesh.devices.flat[0].platform not in FIVE_PROGRAMS_ON:
            self.whole = on_devices(self._whole, [P()], (rows, rows, rows))

    def __call__(self, step) -> Batch:
        t = self.tables
        if self.whole is not None:
            return Batch(*self.whole(t, step))
        key_n = self.keys(t, step)
        present_dn, ids_sn, noise_n = self.features(t, key_n)
        dense_dn, labels_n = self.finish(t, noise_n, present_dn, ids_sn)
        return Batch(self.row_major(t, dense_dn), self.row_major(t, ids_sn), labels_n)

    def _whole(self, t: _Tables, step):  # the five programs' work in one
        present_dn, ids_sn, noise_n = self._features(t, self._keys(t, step))
        dense_dn, labels_n = self._finish(t, noise_n, present_dn, ids_sn)
        return dense_dn.T, ids_sn.T, labels_n

    def _keys(self, t: _Tables, step):  # of this device's rows
        xp, first = self.xp, self.jax.lax.axis_index(self.axes).astype(self.xp.uint32) * self.per
        rows_n = first + xp.arange(self.per, dtype=xp.uint32)
        return self.gen._row_keys(xp, self.stream, step, rows_n)

    def _features(self, t: _Tables, key_n):  # -> (present_dn, ids_sn, noise_n)
        xp, gen = self.xp, self.gen
        counts_dn, missing_dn, ids_sn = gen._features(xp, t, key_n)
        # the noise here: fused with the logit's loop, its gathers slow that loop 5x
        return gen._present(xp, counts_dn, missing_dn), ids_sn, gen._noise(xp, t, key_n)

    def _finish(self, t: _Tables, noise_n, present_dn, ids_sn):  # -> (dense_dn, labels_n)
        xp, gen = self.xp, self.gen
        dense_dn = gen._dense(xp, t, present_dn)
        labels_n, _ = gen._labels(xp, t, noise_n, dense_dn, ids_sn)
        return dense_dn, labels_n.astype(xp.float32)


def _sum_rows(x_mn):
    """int32 [n]: the sum of the m rows, written out: XLA:CPU runs a fused reduce over the
    leading axis one element at a time, the adds of whole rows vectorised (int32 wraps: the
    same sum in any order)."""
    total = x_mn[0]
    for row in x_mn[1:]:
        total = total + row
    return total


def _bag_mean(xp, v_bn, valid_bn):
    """int32 [n]: the floor mean of ``v_bn`` over each row's valid slots (0 for an empty bag)."""
    count_n = xp.maximum(_sum_rows(valid_bn.astype(xp.int32)), 1)
    return _sum_rows(xp.where(valid_bn, v_bn, 0)) // count_n


def normalise_dense(counts: np.ndarray, missing: np.ndarray) -> np.ndarray:
    """DLRM's dense transform: missing -> 0, negatives clipped to 0, then log1p; float32."""
    return np.log1p(np.where(missing, 0, np.maximum(counts, 0))).astype(np.float32)


class SyntheticSource:
    """The :class:`~dlrm_jax.data.batch.DataSource` for ``data.source=synthetic``.

    ``train_batch`` evaluates on the host (numpy, ~1M samples/s on 2 cores);
    :meth:`device_batches` makes the same batches on the devices, far faster.
    """

    def __init__(self, cfg, process_index: int = 0, process_count: int = 1):
        self.generator = SyntheticGenerator(
            seed=cfg.train.seed,
            num_dense=cfg.data.num_dense,
            table_rows=cfg.table_rows,
            bag_sizes=cfg.bag_sizes,
            zipf_exponent=cfg.data.zipf_exponent,
            positive_rate=cfg.data.positive_rate,
            id_layout=cfg.data.id_layout,
        )
        self.global_batch = cfg.train.batch_size
        self._rows = process_slice(cfg.train.batch_size, process_index, process_count)
        self._eval_batches = cfg.train.eval_batches or 16

    def skip_report(self) -> str:
        return ""  # generated data has no malformed lines

    def train_batch(self, step: int) -> Batch:
        return self.generator.batch(TRAIN_STREAM, step, self._rows.start, self._rows.stop)

    def train_ids(self, step: int) -> np.ndarray:
        return self.generator.ids(TRAIN_STREAM, step, self._rows.start, self._rows.stop)

    def device_batches(self, sharding) -> Callable[[int], Batch]:
        """``make(step)``: global training batch ``step`` made on the devices of the batch
        ``sharding``, equal to ``StepFunctions.device_batch(train_batch(step))`` (see
        :meth:`SyntheticGenerator.device_batches`). Build it once, call it every step."""
        return self.generator.device_batches(TRAIN_STREAM, self.global_batch, sharding)

    def eval_batches(self) -> Iterator[Batch]:
        for i in range(self._eval_batches):
            yield self.generator.batch(EVAL_STREAM, i, self._rows.start, self._rows.stop)

    def eval_logits(self) -> np.ndarray:
        """The hidden model's logits for :meth:`eval_batches`' samples, in their order."""
        rows = self._rows
        return np.concatenate(
            [self.generator.logits(EVAL_STREAM, i, rows.start, rows.stop) for i in range(self._eval_batches)]
        )
