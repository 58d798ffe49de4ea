"""A tabular file's columns converted (:mod:`dlrm_jax.data.preprocessing.tabular`): categorical
texts hashed to 64-bit values (:func:`category_values`), dense fields to float32, labels to 0/1
and ``split_by`` times to seconds; each unusable record noted in ``problems`` by its row."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from dlrm_jax.data.preprocessing.tabular_schema import OPS, TabularSchema
from dlrm_jax.data.sources.synthetic import normalise_dense
from dlrm_jax.hashing import mix64

_SEED = np.uint64(0x9E3779B97F4A7C15)
_F32_MAX = float(np.finfo(np.float32).max)


def category_values(texts: Sequence[str]) -> np.ndarray:
    """uint64 [n]: the value each categorical text is counted (vocabularies) or hashed
    (``% max_ind_range``) by. With b the text's UTF-8 bytes, zero-padded to 8-byte words
    w_1..w_k (little-endian) and m = splitmix64: h = m(len(b) ^ 0x9E3779B97F4A7C15), then
    h = m(h ^ w_i) for each word.

    ``vocab/feature_{f}.npy`` of a tabular dataset lists these values, so the id of a text is
    its row + 1 there. Vectorised: one numpy step per 8 bytes of the longest text.
    """
    return _hash_texts(texts)[0]


def _hash_texts(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """uint64 [n] :func:`category_values` and int64 [n] UTF-8 lengths of ``texts``."""
    buf = np.frombuffer("\x00".join(texts).encode("utf-8", "surrogatepass"), np.uint8)
    ends = np.flatnonzero(buf == 0)
    if len(ends) == max(len(texts) - 1, 0):  # NUL-separated: one encode for all texts
        starts = np.concatenate([[0], ends + 1]) if len(texts) else ends
        lengths = np.append(ends, len(buf))[: len(texts)] - starts
    else:  # some text holds a NUL character
        data = [t.encode("utf-8", "surrogatepass") for t in texts]
        lengths = np.fromiter(map(len, data), np.int64, len(data))
        buf, starts = np.frombuffer(b"".join(data), np.uint8), np.cumsum(lengths) - lengths
    buf = np.concatenate([buf, np.zeros(8, np.uint8)])  # a word read past the end stays inside
    h = mix64(lengths.astype(np.uint64) ^ _SEED)
    order = np.argsort(-lengths, kind="stable")  # longest first: a prefix is still "running"
    ranked, byte = -lengths[order], np.arange(8)
    for k in range(0, int(lengths.max(initial=0)), 8):
        rows = order[: np.searchsorted(ranked, -k)]  # the texts longer than k bytes
        word = buf[starts[rows, None] + k + byte]  # uint8 [m, 8]
        word[byte >= (lengths[rows] - k)[:, None]] = 0  # bytes past a text's end
        h[rows] = mix64(h[rows] ^ word.view("<u8")[:, 0])
    return h, lengths


def show(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:40] + "...")


# ---------------------------------------------------------------- converting columns

Problems = dict[int, tuple[str, str]]  # row of a chunk -> (kind, message) of its first problem


def _numbers(texts: Sequence[str | None], na: frozenset[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64 [n] values (0 where missing), bool [n] missing, and int64 [k] the rows whose
    text is not a finite number."""
    a = np.array(["" if t is None else t for t in texts] if None in texts else texts, dtype=str)
    missing = np.isin(a, list(na))
    a[missing] = "0"
    try:
        x = a.astype(np.float64)
    except ValueError:
        x = np.array([_float(t) for t in a.tolist()], dtype=np.float64)
    # Python's float() takes 1_000 and other scripts' digits (a label '0_1' or '١' read as 1):
    # numbers are ASCII without underscores here, as the CSV readers of the other tools have them
    odd = np.char.find(a, "_") >= 0
    try:
        a.astype(np.bytes_)
    except UnicodeEncodeError:
        odd |= np.array([not t.isascii() for t in a.tolist()])
    x[odd] = np.nan
    return x, missing, np.flatnonzero(~np.isfinite(x))


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("nan")


def _categories(texts: Sequence[str | None], na: frozenset[str], substr) -> tuple[np.ndarray, np.ndarray]:
    """uint64 [n] values (0 where missing) and bool [n] missing of one categorical column."""
    texts = ["" if t is None else t for t in texts] if None in texts else texts
    values, lengths = _hash_texts(texts)
    empty = lengths == 0
    for marker in na - {""}:  # same value, then the same text
        rows = np.flatnonzero(values == category_values([marker])[0])
        empty[[i for i in rows.tolist() if texts[i] == marker]] = True
    if substr:
        values, lengths = _hash_texts([t[substr[0] : substr[1]] for t in texts])
        empty |= lengths == 0
    return np.where(empty, np.uint64(0), values), empty


def labels_of(schema: TabularSchema, texts: Sequence[str | None], problems: Problems) -> np.ndarray:
    """float32 [n] 0/1 labels; unusable rows go into ``problems``."""
    label = schema.label
    x, missing, bad = _numbers(texts, schema.na_values)
    y = OPS[label.op](x, label.threshold) if label.op else x == 1
    ok = np.ones(len(x), bool) if label.op else (x == 0) | (x == 1)
    want = f"a number (label = value {label.op} {label.threshold:g})" if label.op else "0 or 1"
    for i in np.union1d(bad, np.flatnonzero(missing | ~ok)).tolist():
        problems.setdefault(i, ("label", f"label column {label.column} is {show(texts[i] or '')}, expected {want}"))
    return y.astype(np.float32)


def times_of(schema: TabularSchema, texts: Sequence[str | None], problems: Problems) -> np.ndarray:
    """float64 [n] times of the split_by column: numbers, or ISO dates / date-times (seconds
    since 1970); unusable rows go into ``problems``."""
    x, missing, bad = _numbers(texts, schema.na_values)
    bad = bad[~missing[bad]]
    if len(bad):  # not numbers: dates?
        x[bad] = _iso_seconds([texts[i] for i in bad.tolist()])
    for i in np.flatnonzero(missing | ~np.isfinite(x)).tolist():
        problems.setdefault(
            i,
            (
                "split_by",
                f"split_by column {schema.split_by} is {show(texts[i] or '')}, "
                f"expected a number or a date (YYYY-MM-DD[ HH:MM:SS])",
            ),
        )
    return x


def _iso_seconds(texts: list[str]) -> np.ndarray:
    """float64 [n] seconds since 1970 of ISO dates / date-times (NaN: not one)."""
    with warnings.catch_warnings():  # numpy warns about time zone suffixes (and reads them as UTC)
        warnings.simplefilter("ignore")
        try:
            t = np.array([v.strip() for v in texts], dtype="datetime64[s]")
        except ValueError:  # some text is not a date: one at a time
            t = np.array([_iso_one(v) for v in texts], dtype="datetime64[s]")
    # (numpy reads 'now' and 'today' as this moment: a row so stamped went to the held-out split)
    words = np.isin(np.char.lower(np.char.strip(np.array(texts, dtype=str))), ["now", "today"])
    return np.where(np.isnat(t) | words, np.nan, t.astype(np.int64).astype(np.float64))


def _iso_one(text: str) -> np.datetime64:
    try:
        return np.datetime64(text.strip(), "s")
    except ValueError:
        return np.datetime64("NaT", "s")


class Part(NamedTuple):
    """The features one file holds, converted, in schema order (Dj dense, Cj categorical)."""

    dense: np.ndarray  # float32 [n, Dj] transformed
    values: np.ndarray  # uint64 [n, Cj]
    empty: np.ndarray  # bool [n, Cj]

    def take(self, rows: np.ndarray) -> Part:
        return Part(*(a[rows] for a in self))


def convert(schema: TabularSchema, join: str, cols: dict, problems: Problems) -> Part:
    """The features of file ``join`` ("" = main) from its columns' texts."""
    n, na = len(next(iter(cols.values()))), schema.na_values
    dense, values, empty = [], [], []
    for f in (f for f in schema.dense if f.column.join == join):
        x, missing, bad = _numbers(cols[f.column.key], na)
        if f.transform == "none":
            bad = np.union1d(bad, np.flatnonzero(np.abs(x) > _F32_MAX))
        for i in bad.tolist():
            text = cols[f.column.key][i]
            problems.setdefault(
                i, ("dense field", f"dense column {f.column} is {show(text)}, expected a finite number")
            )
        x[bad] = 0
        dense.append(normalise_dense(x, missing) if f.transform == "log1p" else x.astype(np.float32))
    for f in (f for f in schema.categorical if f.column.join == join):
        v, e = _categories(cols[f.column.key], na, f.substr)
        values.append(v)
        empty.append(e)
    return Part(stack(dense, n, np.float32), stack(values, n, np.uint64), stack(empty, n, bool))


def stack(columns: list[np.ndarray], n: int, dtype) -> np.ndarray:
    return np.stack(columns, 1).astype(dtype) if columns else np.zeros((n, 0), dtype)
