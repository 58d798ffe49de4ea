"""``dlrm-jax preprocess tabular``: CSV or JSON-lines files described by a schema
(:mod:`dlrm_jax.data.preprocessing.tabular_schema`) -> the binary layout of :mod:`dlrm_jax.data.sources.binary`.

Files are streamed a chunk of records at a time (:mod:`dlrm_jax.data.preprocessing.tabular_records`); side
files named by the schema's ``joins`` are read whole first and left-joined to every record on
one key. A categorical field's text is counted and hashed by
:func:`~dlrm_jax.data.preprocessing.tabular_columns.category_values`; dense
fields become ``log1p(max(x, 0))`` (or stay as they are), missing ones 0; the label is a 0/1
column or a comparison with a threshold. Records that cannot be used are reported as
``path:line: what is wrong``, or skipped and counted, as for Criteo.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dlrm_jax.data import shards
from dlrm_jax.data.preprocessing.prep_driver import Options, default_workers, write_dataset
from dlrm_jax.data.preprocessing.preprocess import (
    BadLine,
    Chunk,
    DataFormatError,
    PreprocessReport,
    SkipLog,
    Task,
    check_arguments,
    check_input_files,
    open_input,
)
from dlrm_jax.data.preprocessing.tabular_columns import (
    Part,
    Problems,
    convert,
    labels_of,
    show,
    stack,
    times_of,
)
from dlrm_jax.data.preprocessing.tabular_records import Records, leading_fields, read_records, records_from
from dlrm_jax.data.preprocessing.tabular_schema import Join, SchemaError, TabularSchema, load_schema
from dlrm_jax.files import as_paths


def _report(path: str, rec: Records, problems: Problems, log: SkipLog) -> np.ndarray:
    """Record a chunk's bad records in line order; int64 [k]: the rows of ``rec.rows`` kept."""
    bad = rec.bad + [(rec.linenos[i], kind, msg) for i, (kind, msg) in problems.items()]
    for j, (line, kind, msg) in enumerate(sorted(bad)):
        log.record(path, line, BadLine(j, kind, msg))
    return np.setdiff1d(np.arange(len(rec.rows)), np.fromiter(problems, np.int64, len(problems)))


class _Side(NamedTuple):
    index: dict[str, int]  # key text -> row of ``part``; its last row stands for "no match"
    part: Part


def _load_side(schema: TabularSchema, join: Join, path: str, log: SkipLog, chunk_lines: int) -> _Side:
    """A side file's features, whole, keyed by its join column (the first valid row of a key
    wins; later ones are bad lines)."""
    wanted, index, parts, first_line = schema.wanted(join.name), {}, [], {}
    for rec in read_records(path, join.layout, wanted, chunk_lines):
        cols, problems = rec.columns(wanted), {}
        part = convert(schema, join.name, cols, problems)
        for i, key in enumerate(cols[join.key]):
            if key is None or key in schema.na_values:
                problems.setdefault(i, ("join key", f"join key column {join.key} is empty"))
            elif key in first_line:
                problems.setdefault(i, ("join key", f"join key {show(key)} repeats line {first_line[key]}"))
            elif i not in problems:
                first_line[key] = rec.linenos[i]
        keep = _report(path, rec, problems, log)
        base = len(index)
        index.update((cols[join.key][i], base + k) for k, i in enumerate(keep.tolist()))
        parts.append(part.take(keep))
    d, c = (sum(f.column.join == join.name for f in fs) for fs in (schema.dense, schema.categorical))
    parts.append(Part(np.zeros((1, d), np.float32), np.zeros((1, c), np.uint64), np.ones((1, c), bool)))
    return _Side(index, Part(*(np.concatenate(a) for a in zip(*parts, strict=True))))


# ---------------------------------------------------------------- preprocessing


class TabularParser:
    """Picklable: turns one input file (a task: CSV quoting may hide line ends, so files are
    not cut) into :class:`~dlrm_jax.data.preprocessing.preprocess.Chunk` s, joined with the side files."""

    error = DataFormatError

    def __init__(self, schema: TabularSchema, sides: dict, chunk_lines: int):
        self.schema, self.sides, self.chunk_lines = schema, sides, chunk_lines
        self.num_dense, self.num_features = len(schema.dense), len(schema.categorical)
        self.split_by = str(schema.split_by) if schema.split_by else None  # the driver splits by its times
        self._misses = dict.fromkeys(sides, 0)

    def tasks(self, paths: list[str]) -> list[Task]:
        return [Task(p, 0, -1) for p in paths]

    def parse(self, task: Task, log: SkipLog) -> Iterator[Chunk]:
        for rec in read_records(task.path, self.schema.layout, self.schema.wanted(), self.chunk_lines):
            yield _chunk(self.schema, self.sides, task.path, rec, log, self._misses)

    def take_extra(self) -> dict:
        """The rows no side-file row matched since the last call, per join."""
        misses, self._misses = self._misses, dict.fromkeys(self.sides, 0)
        return {"join_misses": misses}


def preprocess_tabular(
    schema: str | Path | TabularSchema,
    inputs: list[str],
    output: str,
    *,
    joins: dict[str, str] | None = None,
    val_inputs: list[str] = (),
    max_ind_range: int = 0,
    min_count: int = 1,
    vocab_from: str = "train",
    val_fraction: float = 0.1,
    shuffle_seed: int | None = 0,
    shard_mb: float = 1024.0,
    workers: int = 0,
    skip_bad_lines: bool = False,
    chunk_lines: int = 100_000,
    raw_values: bool = False,
    window_seconds: float = 0.0,
    progress: bool = True,
    overwrite: bool = False,
) -> PreprocessReport:
    """Tabular files described by ``schema`` (a YAML file, a shipped schema's name such as
    ``"movielens_1m"``, or a :class:`~dlrm_jax.data.preprocessing.tabular_schema.TabularSchema`) -> the
    sharded layout of :mod:`dlrm_jax.data.shards` at ``output``.

    ``joins`` maps each of the schema's join names to its side file (read whole, left-joined).
    Ids, splits, shuffling and shards as for Criteo (:func:`~dlrm_jax.data.preprocessing.criteo_preprocess.
    preprocess_criteo`): frequency-ordered vocabularies or ``category_values(text) %
    max_ind_range`` numbered by hashed value, counted on the train rows (``vocab_from``) or
    all; the val split is ``val_inputs``, the latest ``val_fraction`` of rows by the schema's
    ``split_by`` column, or the last ``val_fraction`` of valid rows. Each input file is one task of the ``workers`` processes.
    Bad records raise ``DataFormatError("path:line: ...")`` or, with ``skip_bad_lines``, are
    counted. meta.json also names the features and counts the rows no side-file row matched
    (``join_misses``). ``raw_values``: each shard keeps every feature's 64-bit value too
    (``category_values``'s hash, 0 where missing), which dynamic tables map. With
    ``shuffle_seed=None`` meta.json records the train rows' windows for progressive validation
    (``train.progressive_window: data``): each input file, or with ``window_seconds`` each span of
    that many seconds of the ``split_by`` column (the rows must come in its order). Train on the output with ``data.source=binary``. An ``output`` that
    holds a dataset already is replaced only with ``overwrite``.
    """
    inputs, val_inputs = as_paths(inputs), as_paths(val_inputs)
    check_arguments("preprocess_tabular", inputs, max_ind_range, min_count, val_fraction, chunk_lines, vocab_from)
    schema = schema if isinstance(schema, TabularSchema) else load_schema(schema)
    joins, names = dict(joins or {}), [j.name for j in schema.joins]
    if sorted(joins) != sorted(names):
        raise SchemaError(
            f"{schema.path}: joins: the schema joins {names or 'no side file'}; give "
            f"exactly those files (--join NAME=PATH), got {sorted(joins) or 'none'}"
        )
    check_input_files(inputs, val_inputs)  # before reading side files
    shards.check_output_target(output, overwrite)
    log = SkipLog(skip_bad_lines)
    sides = {j.name: _load_side(schema, j, str(joins[j.name]), log, chunk_lines) for j in schema.joins}
    opts = Options(
        max_ind_range=max_ind_range,
        min_count=min_count,
        vocab_from=vocab_from,
        val_fraction=val_fraction,
        shuffle_seed=shuffle_seed,
        shard_mb=shard_mb,
        workers=workers or default_workers(),
        skip_bad_lines=skip_bad_lines,
        raw_values=raw_values,
        window_seconds=window_seconds,
        progress=progress,
    )

    def meta(extra: dict, root: Path) -> dict:
        # The schema and its join files go into the dataset: serving exports them as the rules
        # of raw records, and the files preprocessing read may be edited, moved or deleted later.
        side = shards.SIDE_FILES
        copied = {
            "schema": f"{side}/schema.yaml",
            "joins": {k: f"{side}/joins/{k}/{Path(v).name}" for k, v in joins.items()},
        }
        for source, to in [(schema.path, copied["schema"]), *((joins[k], v) for k, v in copied["joins"].items())]:
            (root / to).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, root / to)
        named = header_columns(schema, [*inputs, *val_inputs])
        return {
            **({"header_columns": named} if named else {}),
            "schema": str(Path(schema.path).resolve()),
            "dense_features": [f.name for f in schema.dense],
            "categorical_features": [f.name for f in schema.categorical],
            "joins": {k: str(Path(v).resolve()) for k, v in joins.items()},
            "join_misses": {k: extra.get("join_misses", {}).get(k, 0) for k in names},
            "side_files": copied,  # (in the dataset's folder: what it was made from, as it was read)
        }

    parser = TabularParser(schema, sides, chunk_lines)
    report = write_dataset(parser, inputs, output, opts, val_inputs, meta, overwrite)
    if log.by_reason:  # side files' skipped lines are counted with the main files'
        report = _with_side_skips(report, log)
    misses = json.loads((Path(output) / "meta.json").read_text()).get("join_misses", {})
    rows = report.train_rows + report.val_rows
    # (said: a join whose keys never matched, a case or a BOM apart, made its features all id 0 unsaid)
    notes = [
        f"warning: join {k}: {n:,} of {rows:,} rows found no row of {joins[k]} with their key (their "
        f"features from it are missing, id 0){'; none matched: are the keys written alike?' if n == rows else ''}"
        for k, n in misses.items()
        if n
    ]
    return dataclasses.replace(report, notes=(*report.notes, *notes)) if notes else report


def header_columns(schema: TabularSchema, inputs: Sequence[str]) -> list[str] | None:
    """The main files' columns as their header lines name them, where the schema lists none and
    every file's header names the same ones in the same order (else None): what serving reads
    records sent without a header by."""
    layout = schema.layout
    if layout.format != "csv" or layout.columns or layout.header is not True:
        return None
    found = set()
    for path in inputs:
        with open_input(path) as (_, f):
            fields = leading_fields([f.readline()], layout)
        found.add(tuple(name.lstrip("\ufeff") for name in fields[0]) if fields else ())
    return list(found.pop()) if len(found) == 1 and () not in found else None


def _with_side_skips(report: PreprocessReport, log: SkipLog) -> PreprocessReport:
    by_reason = Counter(report.skipped_by_reason) + log.by_reason
    return dataclasses.replace(
        report,
        skipped=by_reason.total(),
        skipped_by_reason=dict(by_reason),
        skipped_examples=tuple(log.examples + list(report.skipped_examples))[:10],
    )


def _chunk(
    schema: TabularSchema, sides: dict[str, _Side], path: str, rec: Records, log: SkipLog, misses: dict[str, int] | None
) -> Chunk:
    """One chunk of the main file: columns converted, bad records reported, side files joined."""
    cols, problems = rec.columns(schema.wanted()), {}
    labels = labels_of(schema, cols[schema.label.column.key], problems)
    times = times_of(schema, cols[schema.split_by.key], problems) if schema.split_by else None
    main = convert(schema, "", cols, problems)
    keep = _report(path, rec, problems, log)
    dense, values, empty = _joined(schema, sides, cols, main, keep, misses)
    return Chunk(rec.count, values, empty, labels[keep], dense, None if times is None else times[keep])


def _joined(
    schema: TabularSchema,
    sides: dict[str, _Side],
    cols: dict,
    main: Part,
    keep: np.ndarray,
    misses: dict[str, int] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dense, values, empty) of the kept records: the main file's features and the side files' rows."""
    parts = {"": main.take(keep)}
    for j in schema.joins:
        side, miss = sides[j.name], len(sides[j.name].index)
        on = cols[j.column.key]
        rows = np.fromiter((side.index.get(on[i], miss) for i in keep.tolist()), np.int64, len(keep))
        parts[j.name] = side.part.take(rows)
        if misses is not None:
            misses[j.name] += int((rows == miss).sum())
    dense = _assemble(parts, schema.dense, "dense", len(keep), np.float32)
    values = _assemble(parts, schema.categorical, "values", len(keep), np.uint64)
    empty = _assemble(parts, schema.categorical, "empty", len(keep), bool)
    return dense, values, empty


# ---------------------------------------------------------------- scoring (dlrm_jax.serving)


def load_sides(schema: TabularSchema, joins: dict[str, str], log: SkipLog, chunk_lines: int = 65536) -> dict:
    """Every side file of the schema's joins, read whole (``joins``: name -> path)."""
    return {j.name: _load_side(schema, j, str(joins[j.name]), log, chunk_lines) for j in schema.joins}


def scoring_chunks(
    schema: TabularSchema,
    sides: dict,
    f,
    raw,
    path: str,
    leading: Sequence[bytes],
    log: SkipLog,
    chunk_lines: int,
    bar=None,
    labeled: bool | None = None,
    header_columns: Sequence[str] = (),
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Records of an open file to score, the label neither read nor checked: per chunk, (the
    line of every record in file order, the positions of the usable ones among them, and their
    dense, values, empty). A file whose header (or field count) shows no label column is read
    without it; ``leading``: the file's first lines, which tell (``labeled``: whether records
    without a header carry the label; None: as they tell). ``header_columns``: the columns the
    training files' headers named (:func:`header_columns`), which records without a header
    are read by where the schema lists none."""
    # (the leading lines' fields, as reading splits them, once: a quoted field holding the delimiter is one)
    records = leading_fields(list(leading), schema.layout) if schema.layout.format == "csv" else []
    layout, wanted = _without_label(schema, _headless_by(schema, path, records, header_columns), records, labeled)
    for rec in records_from(f, raw, path, layout, wanted, chunk_lines, bar):
        cols, problems = rec.columns(wanted), {}
        main = convert(schema, "", cols, problems)
        keep = _report(path, rec, problems, log)
        dense, values, empty = _joined(schema, sides, cols, main, keep, None)
        lines = np.array(rec.linenos + [line for line, _, _ in rec.bad], np.int64)
        order = np.argsort(lines, kind="stable")
        at = np.empty(len(lines), np.int64)
        at[order] = np.arange(len(lines))
        yield lines[order], at[keep], dense, values, empty


def _headless_by(schema: TabularSchema, path: str, records: list[list[str]], header_columns: Sequence[str]):
    """The layout records of a file to score are read by: the schema's, or where it names its
    columns only in a header line and the file's first line is none, the training files'
    (``header_columns``); a DataFormatError where those were not recorded."""
    layout = schema.layout
    if layout.format != "csv" or layout.columns or not layout.header:
        return layout
    fields = [x.lstrip("\ufeff") for x in records[0]] if records else []
    names = set(header_columns) or {w for w in schema.wanted() if isinstance(w, str)}
    if not fields or 2 * sum(x in names for x in fields) > len(fields):  # a header line: read by it
        return layout
    if not header_columns:
        raise DataFormatError(
            f"{path}:1: records without a header line, and the schema names its columns only in one (no "
            f"columns: list) while the model's dataset did not record them; send the header line first, or "
            f"preprocess and export again with this version (it records the training files' columns)"
        )
    return dataclasses.replace(layout, header=False, columns=tuple(header_columns))


def _without_label(schema: TabularSchema, layout, records: list[list[str]], labeled: bool | None = None) -> tuple:
    """(layout, wanted columns) to read records to score: the label is not wanted, and records
    without the label column (a header without its name; else ``labeled`` False, or by default
    most of the leading lines of either width one field fewer: one malformed first line does not
    decide) are read as such; a line of the other width is then a bad line. A schema's header is
    read where the first line is one: records alone are scored too (a server's requests; they
    were refused, the header expected in every call)."""
    label = schema.label.column.key
    wanted = [w for w in schema.wanted() if w != label or any(f.column.key == label for f in schema.features)]
    if layout.format != "csv" or not layout.columns:
        return layout, wanted
    fields = records[0] if records else []
    named = bool(fields) and 2 * sum(x in layout.columns for x in fields) > len(fields)
    if layout.header and not named:
        layout = dataclasses.replace(layout, header=False)
    if not isinstance(label, str) or label not in layout.columns:
        return layout, wanted
    if layout.header:
        absent = label not in fields
    elif labeled is not None:
        absent = not labeled
    else:
        widths = [len(r) for r in records]
        absent = widths.count(len(layout.columns) - 1) > widths.count(len(layout.columns))
    if absent:
        layout = dataclasses.replace(layout, columns=tuple(c for c in layout.columns if c != label))
    return layout, wanted


def _assemble(parts: dict[str, Part], features, field: str, n: int, dtype) -> np.ndarray:
    """[n, len(features)]: each feature's column from the part of the file that holds it."""
    taken: dict[str, int] = {}
    columns = []
    for f in features:
        k = taken[f.column.join] = taken.get(f.column.join, -1) + 1
        columns.append(getattr(parts[f.column.join], field)[:, k])
    return stack(columns, n, dtype)
