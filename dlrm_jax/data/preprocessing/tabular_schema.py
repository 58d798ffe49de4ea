"""The schema of ``dlrm-jax preprocess tabular``: which columns of a CSV / JSON-lines file (and
of small side files joined to it) are the label, the dense and the categorical features.

A schema is a YAML file (shipped ones: ``configs/schemas/``)::

    format: csv                 # csv | json_lines
    delimiter: "::"             # csv: one character (quotes handled) or several (no quoting)
    header: false               # csv: true (the first line names the columns) | false | auto
    columns: [user, item, rating, ts]   # names by position (json_lines: optional); with a
                                # header, it must equal them; header: auto reads files with
                                # and without one (a first line that looks like one is one)
    quoting: true               # csv, one-character delimiter: "a,b" is one field
    encoding: utf-8
    na_values: ["NULL"]         # texts that mean "missing", besides the empty field
    label: {column: rating, op: ">=", threshold: 4}  # or {column: click}: values 0 / 1
    dense: [price, {column: age, transform: none}]   # log1p(max(x, 0)) (default) | none
    categorical: [user, {column: hour, substr: [6, 8], name: hour_of_day}]
    joins:          # side files, read whole; left join of the main file's column on their key
      users: {column: user, key: user_id, columns: [user_id, gender]}  # + any layout key above
    split_by: ts    # hold out the latest rows by this column's time (a number, or an ISO date
                    # such as 2012-01-03 or "2012-01-03 12:34:56"), not the file's last lines

A column is a name, a 0-based position, or ``JOIN.NAME`` for a column of a side file. Errors
raise :class:`SchemaError` naming the schema file and the key.
"""

from __future__ import annotations

import codecs
import operator
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from dlrm_jax.config import CONFIG_DIR, ConfigError

SCHEMA_DIR = CONFIG_DIR / "schemas"
FORMATS = ("csv", "json_lines")
OPS = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
}  # label = OPS[op](value, threshold)
DENSE_TRANSFORMS = ("log1p", "none")
AUTO = "auto"  # header: auto
_LAYOUT_KEYS = ("format", "delimiter", "header", "columns", "quoting", "encoding")
_TOP_KEYS = (*_LAYOUT_KEYS, "na_values", "label", "dense", "categorical", "joins", "split_by")


class SchemaError(ConfigError):
    """A schema that cannot be used; the message names the schema file and the key."""


@dataclass(frozen=True)
class Layout:
    """How one file is split into columns."""

    format: str = "csv"
    delimiter: str = ","
    header: bool | str = True  # True, False, or AUTO: a first line that looks like a header is one
    columns: tuple[str, ...] = ()  # names by position; a header line must equal them
    quoting: bool = True
    encoding: str = "utf-8"


@dataclass(frozen=True)
class Column:
    """A column of the main file (``join`` empty) or of side file ``join``: a name or a
    0-based position."""

    join: str
    key: str | int

    def __str__(self) -> str:
        return f"{self.join}.{self.key}" if self.join else str(self.key)


@dataclass(frozen=True)
class Feature:
    name: str
    column: Column
    transform: str = "text"  # dense: log1p | none; categorical: text
    substr: tuple[int, int] | None = None  # categorical: characters [start, stop) of the text


@dataclass(frozen=True)
class Label:
    column: Column
    op: str = ""  # "" = the column already holds 0 / 1
    threshold: float = 0.0


@dataclass(frozen=True)
class Join:
    name: str
    column: Column  # of the main file
    key: str | int  # of the side file
    layout: Layout


@dataclass(frozen=True)
class TabularSchema:
    path: str
    layout: Layout
    label: Label
    dense: tuple[Feature, ...]
    categorical: tuple[Feature, ...]
    joins: tuple[Join, ...] = ()
    na_values: frozenset[str] = frozenset({""})
    split_by: Column | None = None  # the val split: the latest rows by this main-file column

    def wanted(self, join: str = "") -> list[str | int]:
        """The columns read from the main file (``join`` empty) or from a side file, in a
        fixed order without repeats: label, features, join keys, then the split_by column."""
        if join:
            (j,) = [j for j in self.joins if j.name == join]
            cols = [j.key] + [f.column.key for f in self.features if f.column.join == join]
        else:
            cols = [self.label.column.key] + [f.column.key for f in self.features if not f.column.join]
            cols += [j.column.key for j in self.joins] + ([self.split_by.key] if self.split_by else [])
        return list(dict.fromkeys(cols))

    @property
    def features(self) -> tuple[Feature, ...]:
        return self.dense + self.categorical


def resolve_schema_path(path: str | Path) -> Path:
    """A path as given, or a bare name such as ``movielens_1m`` from ``configs/schemas/``."""
    p = Path(path)
    for candidate in (p, SCHEMA_DIR / p, SCHEMA_DIR / f"{p}.yaml"):
        if candidate.is_file():
            return candidate
    shipped = ", ".join(sorted(s.stem for s in SCHEMA_DIR.glob("*.yaml")))
    raise SchemaError(f"schema {path}: no such file (shipped schemas: {shipped})")


def load_schema(path: str | Path) -> TabularSchema:
    """Read and check a schema file, or a shipped schema by name (``movielens_1m``, ``avazu``,
    ``taobao_ad``, ``yelp_reviews`` from ``configs/schemas/``).

    Keys: ``format`` (csv | json_lines), ``delimiter`` (one character, quotes handled, or
    several such as "::"), ``header`` (true | false | auto: each file may or may not start
    with one), ``columns`` (names by position; a file's header line must equal them),
    ``quoting``, ``encoding``, ``na_values``; ``label`` (a 0/1 column, or ``{column, op,
    threshold}``: label = value op threshold); ``dense`` (columns, or ``{column, name,
    transform: log1p | none}``); ``categorical`` (columns, or ``{column, name, substr: [start,
    stop]}``); ``joins`` (``NAME: {column, key, ...layout keys}``: side files, referred to as
    ``NAME.COLUMN``); ``split_by`` (a column of the main file holding times: the val split is
    the latest ``val_fraction`` of rows by it). Raises :class:`SchemaError` naming the file
    and the key.
    """
    p = resolve_schema_path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise SchemaError(f"{p}: cannot be read as YAML ({e})") from None
    return _Parser(str(p)).schema(raw)


class _Parser:
    def __init__(self, path: str):
        self.path = path
        self.layouts: dict[str, Layout] = {}

    def error(self, key: str, message: str) -> SchemaError:
        return SchemaError(f"{self.path}: {key}: {message}" if key else f"{self.path}: {message}")

    def mapping(self, key: str, raw, allowed: tuple[str, ...], required=()) -> dict:
        if not isinstance(raw, dict):
            raise self.error(key, f"expected a mapping, got {raw!r}")
        for k in raw:
            if k not in allowed:
                hint = " (YAML reads a bare on/off/yes/no as true/false)" if isinstance(k, bool) else ""
                raise self.error(f"{key}.{k}" if key else str(k), f"unknown key{hint}; known: {', '.join(allowed)}")
        for k in required:
            if k not in raw:
                raise self.error(f"{key}.{k}" if key else k, "required")
        return raw

    def schema(self, raw) -> TabularSchema:
        raw = self.mapping("", raw, _TOP_KEYS, ("label", "categorical"))
        self.layouts[""] = main = self.layout("", raw, Layout())
        joins = raw.get("joins") or {}
        if not isinstance(joins, dict):
            raise self.error("joins", f"expected a mapping of join names to side-file layouts, got {joins!r}")
        for name, spec in joins.items():  # layouts first: features may name any join's columns
            if not isinstance(name, str) or not name.isidentifier():
                raise self.error(f"joins.{name}", "a join's name must be a word (letters, digits, _)")
            spec = self.mapping(f"joins.{name}", spec, (*_LAYOUT_KEYS, "column", "key"), ("column",))
            inherited = replace(main, columns=(), header=True if main.header == AUTO else main.header)
            self.layouts[name] = self.layout(f"joins.{name}", spec, inherited)
        parsed_joins = tuple(self.join(name, spec) for name, spec in joins.items())
        na = raw.get("na_values", [])
        if not isinstance(na, list) or not all(isinstance(v, str) for v in na):
            hint = "; quote them: YAML reads a bare NULL as null, yes/no as booleans" if isinstance(na, list) else ""
            raise self.error("na_values", f"expected a list of strings, got {na!r}{hint}")
        label = self.label(raw["label"])
        dense = self.features("dense", raw.get("dense") or [], dense=True)
        categorical = self.features("categorical", raw["categorical"], dense=False)
        if not categorical:
            raise self.error("categorical", "at least one categorical column is needed (one embedding table each)")
        names = [f.name for f in dense + categorical]
        for twice in sorted({n for n in names if names.count(n) > 1}):
            raise self.error("dense/categorical", f"feature name {twice!r} is used twice; give one a name:")
        split_by = self.column("split_by", raw["split_by"], joins=False) if raw.get("split_by") is not None else None
        return TabularSchema(self.path, main, label, dense, categorical, parsed_joins, frozenset({"", *na}), split_by)

    def layout(self, key: str, raw: dict, base: Layout) -> Layout:
        where = f"{key}." if key else ""
        fmt = raw.get("format", base.format)
        if fmt not in FORMATS:
            raise self.error(f"{where}format", f"{fmt!r} is not one of {', '.join(FORMATS)}")
        if fmt == "json_lines":
            for k in ("delimiter", "header", "quoting"):
                if k in raw:
                    raise self.error(f"{where}{k}", "not used with format json_lines (one JSON object a line)")
        delimiter, header = raw.get("delimiter", base.delimiter), raw.get("header", base.header)
        quoting = raw.get("quoting", base.quoting if len(delimiter) == 1 else False)
        columns, encoding = raw.get("columns", base.columns), raw.get("encoding", base.encoding)
        if not isinstance(delimiter, str) or not delimiter or delimiter in '\r\n"':
            raise self.error(
                f"{where}delimiter", f"expected a non-empty string, not a quote or newline, got {delimiter!r}"
            )
        if not isinstance(header, bool) and header != AUTO:
            raise self.error(f"{where}header", f"expected true, false or {AUTO}, got {header!r}")
        if not isinstance(quoting, bool):
            raise self.error(f"{where}quoting", f"expected true or false, got {quoting!r}")
        if quoting and len(delimiter) > 1:
            raise self.error(f"{where}quoting", f"quoting needs a one-character delimiter, not {delimiter!r}")
        if not isinstance(columns, list | tuple) or not all(isinstance(c, str) and c for c in columns):
            raise self.error(f"{where}columns", f"expected a list of names, got {columns!r}")
        if fmt == "csv" and header == AUTO and not columns:
            raise self.error(f"{where}header", f"{AUTO} needs columns: (a first line equal to them is the header)")
        if len(set(columns)) < len(columns):
            raise self.error(f"{where}columns", f"a name appears twice in {list(columns)}")
        try:
            codecs.lookup(encoding)
        except (LookupError, TypeError):
            raise self.error(f"{where}encoding", f"unknown text encoding {encoding!r}") from None
        if "a\n".encode(encoding).removeprefix("a".encode(encoding)) != b"\n":  # (a BOM before both)
            raise self.error(  # (lines are split at the byte \n before they are decoded: UTF-16 never parsed)
                f"{where}encoding",
                f"{encoding!r}: its line break is not the byte \\n, which the files are split at; convert them "
                f"to UTF-8 (iconv -f {encoding} -t UTF-8) and give encoding: utf-8",
            )
        return Layout(fmt, delimiter, header, tuple(columns), quoting, encoding)

    def column(self, key: str, raw, joins: bool = True) -> Column:
        """A column reference, checked against its file's declared columns."""
        if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0:
            col = Column("", raw)
        elif isinstance(raw, str) and raw:
            join, dot, name = raw.partition(".")
            col = Column(join, name) if dot and joins and join in self.layouts and join else Column("", raw)
        else:
            raise self.error(key, f"expected a column name or a 0-based position, got {raw!r}")
        return Column(col.join, self.check_key(key, col.join, col.key))

    def check_key(self, key: str, join: str, name: str | int) -> str | int:
        layout, file = self.layouts[join], f"join {join!r}" if join else "the input file"
        if isinstance(name, int):
            if layout.format == "json_lines":
                raise self.error(key, f"{file} is JSON lines: name its columns, not position {name}")
            if layout.columns and name >= len(layout.columns):
                raise self.error(key, f"position {name} is past the {len(layout.columns)} columns of {file}")
        elif layout.columns and name not in layout.columns:
            raise self.error(key, f"unknown column {name!r} of {file}; its columns: {', '.join(layout.columns)}")
        elif layout.format == "csv" and not layout.header and not layout.columns:
            raise self.error(
                key,
                f"column {name!r}: {file} has no header and the schema no columns: list; "
                f"give columns: or a 0-based position",
            )
        return name

    def join(self, name: str, spec: dict) -> Join:
        on = self.column(f"joins.{name}.column", spec["column"], joins=False)
        key = spec.get("key", on.key)
        if isinstance(key, bool) or not isinstance(key, str | int):
            raise self.error(f"joins.{name}.key", f"expected a column name or a 0-based position, got {key!r}")
        return Join(name, on, self.check_key(f"joins.{name}.key", name, key), self.layouts[name])

    def label(self, raw) -> Label:
        if not isinstance(raw, dict):
            return Label(self.column("label", raw, joins=False))
        raw = self.mapping("label", raw, ("column", "op", "threshold"), ("column",))
        col, op = self.column("label.column", raw["column"], joins=False), raw.get("op", "")
        if op and op not in OPS:
            raise self.error("label.op", f"{op!r} is not one of {' '.join(OPS)}")
        threshold = raw.get("threshold")
        if bool(op) != (threshold is not None):
            raise self.error(
                "label", "give both op and threshold (label = value OP threshold), or neither (0 / 1 labels)"
            )
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int | float)):
            raise self.error("label.threshold", f"expected a number, got {threshold!r}")
        return Label(col, op, float(threshold or 0.0))

    def features(self, key: str, raw, dense: bool) -> tuple[Feature, ...]:
        if not isinstance(raw, list):
            raise self.error(key, f"expected a list of columns, got {raw!r}")
        out = []
        for i, item in enumerate(raw):
            where = f"{key}[{i}]"
            if not isinstance(item, dict):
                col = self.column(where, item)
                out.append(Feature(str(col), col, "log1p" if dense else "text"))
                continue
            extra = ("transform",) if dense else ("substr",)
            item = self.mapping(where, item, ("column", "name", *extra), ("column",))
            col = self.column(f"{where}.column", item["column"])
            transform, substr = item.get("transform", "log1p") if dense else "text", item.get("substr")
            if transform not in (*DENSE_TRANSFORMS, "text"):
                raise self.error(f"{where}.transform", f"{transform!r} is not one of {', '.join(DENSE_TRANSFORMS)}")
            if substr is not None and not (
                isinstance(substr, list) and len(substr) == 2 and all(type(v) is int and v >= 0 for v in substr)
            ):
                raise self.error(f"{where}.substr", f"expected [start, stop] character positions, got {substr!r}")
            name = item.get("name", f"{col}[{substr[0]}:{substr[1]}]" if substr else str(col))
            if not isinstance(name, str) or not name:
                raise self.error(f"{where}.name", f"expected a non-empty string, got {name!r}")
            out.append(Feature(name, col, transform, tuple(substr) if substr else None))
        return tuple(out)
