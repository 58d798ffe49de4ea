"""Records of one tabular file, a chunk at a time: lines decoded (gzipped files decompressed as
a stream), split as CSV (quotes, records over several lines), by a multi-character delimiter
or as JSON objects, and the schema's columns picked out, each record with its first line
number. Records that cannot be split are returned as (line, kind, message), not raised; a
header line without the schema's columns (or, when the schema lists ``columns``, one that
differs from them) raises DataFormatError naming the file. With ``header: auto`` a file's
first line is its header when most of its fields are names of the schema's columns, and data
otherwise.
"""

from __future__ import annotations

import collections
import csv
import itertools
import json
import operator
from collections.abc import Iterator
from typing import NamedTuple

from dlrm_jax.data.preprocessing.preprocess import DataFormatError, open_input
from dlrm_jax.data.preprocessing.tabular_schema import AUTO, Layout


class _Bad(Exception):
    """A record that cannot be used: (kind counted in reports, message)."""


class Records(NamedTuple):
    """One chunk of a file: the wanted columns' texts of the usable records (None: missing)."""

    linenos: list[int]  # first line of each record in ``rows``
    rows: list[tuple]
    bad: list[tuple[int, str, str]]  # (line, kind, message) of records that could not be split
    count: int  # records read, usable or not (a header line is not counted)

    def columns(self, wanted: list[str | int]) -> dict[str | int, tuple]:
        """Column -> texts of every usable record."""
        cols = zip(*self.rows, strict=True) if self.rows else [()] * len(wanted)
        return dict(zip(wanted, cols, strict=True))


def _decoded(f, encoding: str, undecodable: set[int]) -> Iterator[str]:
    """The lines of binary file ``f`` as text; the numbers of lines that cannot be decoded go
    into ``undecodable`` (their text has replacement characters)."""
    lineno = 0
    while lines := list(itertools.islice(f, 4096)):
        if (
            lineno == 0
            and encoding.replace("_", "-").lower() in ("utf-8", "utf8")
            and lines[0].startswith(b"\xef\xbb\xbf")
        ):
            lines[0] = lines[0][3:]  # a BOM: not the first field's (a header's was stripped, a first value's was kept)
        try:
            yield from [line.decode(encoding) for line in lines]
        except UnicodeDecodeError:
            for i, line in enumerate(lines, lineno + 1):
                try:
                    yield line.decode(encoding)
                except UnicodeDecodeError:
                    undecodable.add(i)
                    yield line.decode(encoding, "replace")
        lineno += len(lines)


def _split(lines: Iterator[str], layout: Layout, fits) -> Iterator[tuple[int, int, object]]:
    """(first line, last line, fields list | JSON object | _Bad) per record; ``fits(fields)``:
    whether a CSV record over several lines has the columns' shape."""
    if layout.format == "json_lines":
        for lineno, line in enumerate(lines, 1):
            try:
                text = line.rstrip("\r\n")  # so that an error's column is on this line
                value = json.loads(text) if text.strip() else _Bad("empty line", "empty line")
            except ValueError as e:
                value = _Bad("json", f"not valid JSON: {getattr(e, 'msg', e)} (column {getattr(e, 'colno', '?')})")
            yield lineno, lineno, value if isinstance(value, dict | _Bad) else _Bad("json", "not a JSON object")
    elif len(layout.delimiter) > 1:
        for lineno, line in enumerate(lines, 1):
            text = line.rstrip("\r\n")
            yield lineno, lineno, text.split(layout.delimiter) if text else []
    else:
        yield from _csv_records(lines, layout, fits)


class _Runaway(Exception):
    """A quoted field still open after :data:`MAX_RECORD_LINES` lines."""


MAX_RECORD_LINES = 64  # a quoted field may hold newlines, within reason


def _csv_records(lines: Iterator[str], layout: Layout, fits) -> Iterator[tuple[int, int, object]]:
    """CSV records, each over one line or several (a quoted field holding newlines). A record
    that cannot be split (an unclosed quote, text after a closing one), whose quotes stay open
    over :data:`MAX_RECORD_LINES` lines, or that spans several lines without ``fits`` the
    columns is its first line alone: that line is bad and reading resumes on the next, so one
    stray quote costs one line, never the rest of the file."""
    source, again = iter(lines), collections.deque()
    span: list[str] = []  # lines of the record being read

    def feed() -> Iterator[str]:
        while again or (line := next(source, None)) is not None:
            line = again.popleft() if again else line
            if len(span) == MAX_RECORD_LINES:
                again.appendleft(line)
                raise _Runaway
            span.append(line)
            yield line

    quoting = csv.QUOTE_MINIMAL if layout.quoting else csv.QUOTE_NONE
    done = 0  # lines of the records read so far
    while True:
        reader = csv.reader(feed(), delimiter=layout.delimiter, quoting=quoting, strict=True)
        while True:
            span.clear()
            try:
                row = next(reader)
                if len(span) == 1 or fits(row):
                    yield done + 1, done + len(span), row
                    done += len(span)
                    continue
                why = "a quoted field runs over {} lines and the record does not fit the columns"
            except StopIteration:
                return
            except _Runaway:
                why = "a quoted field is still open after {} lines"
            except csv.Error as e:
                why = f"not valid CSV: {e}" + (" (a quote opened on this line is not closed)" if len(span) > 1 else "")
            yield done + 1, done + 1, _Bad("csv", why.format(len(span)))
            again.extendleft(reversed(span[1:]))
            done += 1
            break  # a fresh reader from the next line


def _json_text(name: str, value) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    raise _Bad("nested value", f"{name!r} holds a JSON {type(value).__name__}, expected a string or number")


class _Columns:
    """Picks the wanted columns out of one file's records."""

    def __init__(self, path: str, layout: Layout, wanted: list[str | int], header: list[str] | None):
        self.wanted, self.sep = wanted, repr(layout.delimiter)
        names = _names(header) if header is not None else list(layout.columns)
        self.width = len(names) if layout.format == "csv" and names else None
        if layout.format == "json_lines":
            return
        for w in wanted:
            if isinstance(w, str) and names.count(w) != 1:
                found = "appears twice in" if w in names else "is not in"
                raise DataFormatError(
                    f"{path}:1: column {w!r} (named in the schema) {found} the header: {', '.join(names)}"
                )
        positions = [w if isinstance(w, int) else names.index(w) for w in wanted]
        self.needed = max(positions) + 1
        if self.width is not None and self.needed > self.width:
            raise DataFormatError(
                f"{path}:1: the schema wants column {self.needed - 1} (0-based), the header names {self.width}"
            )
        self.get = operator.itemgetter(*positions) if len(positions) > 1 else lambda r: (r[positions[0]],)

    def fits(self, fields: list[str]) -> bool:
        """Whether a CSV record has as many fields as the columns need."""
        return len(fields) == self.width if self.width is not None else len(fields) >= self.needed

    def pick(self, record) -> tuple:
        """The wanted texts of a record, or raise :class:`_Bad`."""
        if isinstance(record, _Bad):
            raise record
        if isinstance(record, dict):
            for name in self.wanted:
                if name not in record:
                    raise _Bad("missing column", f"no {name!r} in the JSON object")
            return tuple(_json_text(name, record[name]) for name in self.wanted)
        n = len(record)
        if n != self.width and (self.width is not None or n < self.needed):
            if not n:
                raise _Bad("empty line", "empty line")
            want = self.width or f"at least {self.needed}"
            raise _Bad("field count", f"expected {want} fields separated by {self.sep}, found {n}")
        return self.get(record)


def leading_fields(leading: list[bytes], layout: Layout) -> list[list[str]]:
    """The fields of each record of a file's ``leading`` lines as reading splits them (a quoted
    field may hold the delimiter), its malformed ones left out."""
    text = (line.decode(layout.encoding, "replace") for line in leading)
    records = _split(text, layout, lambda row: True)
    return [[x.strip().strip('"') for x in row] for _, _, row in records if isinstance(row, list)]


def _names(header: list[str]) -> list[str]:
    """A header line's names, without surrounding spaces or a byte-order mark."""
    return [h.strip().lstrip("\ufeff") for h in header]


def _looks_like_header(first, columns: tuple[str, ...]) -> bool:
    """``header: auto``: whether a file's first record is a header (most of its fields are
    names of the schema's columns)."""
    if first is None or not isinstance(first[2], list) or not first[2]:
        return False
    names = _names(first[2])
    return 2 * sum(n in columns for n in names) > len(names)


def _check_header(path: str, names: list[str], columns: tuple[str, ...]) -> None:
    """A header line must equal the schema's ``columns`` when it lists them."""
    if not columns or tuple(names) == columns:
        return
    missing, extra = [c for c in columns if c not in names], [n for n in names if n not in columns]
    what = [f"missing {', '.join(missing)}"] if missing else []
    what += [f"unexpected {', '.join(extra)}"] if extra else []
    if not what:  # the same names, in another order or repeated
        k = next((i for i, (a, b) in enumerate(zip(names, columns, strict=False)) if a != b), None)
        what = [
            f"column {k} is {names[k]}, expected {columns[k]}"
            if k is not None
            else f"{len(names)} names, expected {len(columns)}"
        ]
    raise DataFormatError(
        f"{path}:1: the header does not match the schema's columns ({'; '.join(what)}); expected: {', '.join(columns)}"
    )


def read_records(path: str, layout: Layout, wanted: list[str | int], chunk_lines: int, bar=None) -> Iterator[Records]:
    """The records of one file, ``chunk_lines`` at a time; ``bar`` (tqdm) advances by bytes read."""
    with open_input(path) as (raw, f):
        yield from records_from(f, raw, path, layout, wanted, chunk_lines, bar)


def records_from(
    f, raw, path: str, layout: Layout, wanted: list[str | int], chunk_lines: int, bar=None
) -> Iterator[Records]:
    """:func:`read_records` of an open binary stream ``f`` (``raw``: the file under it, for
    ``bar``); ``path`` names it in errors."""
    undecodable: set[int] = set()
    columns = None  # known once the header is read
    fits = lambda fields: columns is None or columns.fits(fields)
    items = _split(_decoded(f, layout.encoding, undecodable), layout, fits)
    header = None
    if layout.format == "csv" and layout.header:
        first = next(items, None)
        if layout.header == AUTO and not _looks_like_header(first, layout.columns):
            items = itertools.chain([first] if first else [], items)  # line 1 is data
        elif first is None or not isinstance(first[2], list) or not first[2] or 1 in undecodable:
            raise DataFormatError(f"{path}:1: expected a header line naming the columns (the schema says header: true)")
        else:
            header = first[2]
            _check_header(path, _names(header), layout.columns)
    columns, read = _Columns(path, layout, wanted, header), 0
    while batch := list(itertools.islice(items, chunk_lines)):
        out = Records([], [], [], len(batch))
        for first, last, record in batch:
            try:
                if undecodable and not undecodable.isdisjoint(range(first, last + 1)):
                    raise _Bad("encoding", f"not valid {layout.encoding} text")
                out.rows.append(columns.pick(record))
                out.linenos.append(first)
            except _Bad as e:
                out.bad.append((first, *e.args))
        if bar is not None:
            bar.update(raw.tell() - read)
            read = raw.tell()
        yield out
