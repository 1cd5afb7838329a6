"""Records held as columns: what a long run keeps instead of millions of record objects.

    table = RecordTable.from_records(RequestRecord, records)   # checked, column by column
    table.column("arrival_s")                                  # a numpy array
    table[0], list(table)                                      # records, built on demand

    log = RecordLog(StepRecord)     # an engine appends a record per step
    log.append(step)
    steps = log.table()

A `RequestRecord` or `StepRecord` object costs 300-400 bytes; as columns a step row costs
about 60 and a request row about 80, and metrics, checks and writers take whole columns
instead of walking objects. A column is a numpy array: float64 for float fields (NaN stands
for None in a `float | None` field; a stored float is always finite; an `int | None` field
is float64 too, NaN for None, its values integers below 2**53), object (Python str)
for str fields, and for int fields the narrowest signed integer type that holds the values
(most counts fit 16 bits) — handed out as int64, so arithmetic on a column cannot
overflow. Fields that are not flat (`RequestRecord.token_times`) are not held: a record
built from a table has their default.

A table is a read-only Sequence of records, so code written for a list of records works
unchanged: indexing builds one record (about a microsecond), iterating builds them a block
of rows at a time. Code that wants speed asks for columns.
"""
from __future__ import annotations

import functools
import math
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import fields
from operator import attrgetter

import numpy as np

from servelab.records import RequestRecord

KINDS = {"int": np.int64, "float": np.float64, "float | None": np.float64,
         "int | None": np.float64, "str": object}
"""Field annotation -> column dtype."""
_ITER_ROWS = 4096
"""Rows turned into records at a time when iterating: bounds the lists alive at once."""


@functools.cache
def stored_fields(record_type: type) -> dict[str, str]:
    """Field name -> annotation of the fields a table of `record_type` holds: every field up
    to the first one that is not flat (the rest must have defaults)."""
    out = {}
    for f in fields(record_type):
        if f.type not in KINDS:
            break
        out[f.name] = f.type
    return out


def describe_record(records: Sequence, i: int) -> str:
    """How an error names record i: a request by its id, a step by its position."""
    record = records[i]
    if isinstance(record, RequestRecord):
        return f"request {record.request_id}"
    return f"step record {i}"


class RecordTable(Sequence):
    """Records of one flat dataclass, column by column (see the module docstring)."""

    __slots__ = ("record_type", "_columns", "_len")

    def __init__(self, record_type: type, columns: Mapping[str, np.ndarray]) -> None:
        """Wrap ready columns (one per stored field, in field order, equally long, of the
        field's dtype); use `from_records` for anything that needs checking."""
        names = list(stored_fields(record_type))
        if list(columns) != names:
            raise ValueError(f"a {record_type.__name__} table needs the columns {names}, "
                             f"got {list(columns)}")
        lengths = {len(c) for c in columns.values()}
        if len(lengths) > 1:
            raise ValueError(f"columns of unequal lengths {sorted(lengths)}")
        for name, annotation in stored_fields(record_type).items():
            dtype = columns[name].dtype
            if columns[name].ndim != 1 or not (dtype == KINDS[annotation] or (
                    annotation == "int" and dtype.kind == "i")):
                raise ValueError(f"column {name} must be a 1-d {np.dtype(KINDS[annotation])} array, "
                                 f"got {dtype}")
        self.record_type = record_type
        self._columns = dict(columns)
        self._len = lengths.pop() if lengths else 0

    # --- building -----------------------------------------------------------------------
    @classmethod
    def from_records(cls, record_type: type, records: Sequence) -> "RecordTable":
        """Columns of `records` (objects with the stored fields as attributes). Raises
        ValueError naming the first bad record and field: an int field that is not an
        integer (a bool is not) or does not fit 64 bits, a float field that is not a finite
        number (None only where the field allows it), a str field that is not a string."""
        if isinstance(records, RecordTable):
            return records
        columns = {}
        for name, annotation in stored_fields(record_type).items():
            values = list(map(attrgetter(name), records))
            column = _convert(values, annotation)
            if column is None:
                i = next(i for i, v in enumerate(values) if _problem(v, annotation))
                raise ValueError(f"{describe_record(records, i)}: {name} "
                                 f"{_problem(values[i], annotation)}, got {values[i]!r}")
            columns[name] = column
        return cls(record_type, columns)

    @classmethod
    def from_columns(cls, record_type: type, columns: Mapping[str, np.ndarray]) -> "RecordTable":
        """A table of ready, checked columns of the fields' kinds (a reader's): int columns
        are stored narrowed (see the module docstring)."""
        return cls(record_type, {name: _narrow(c) if c.dtype.kind == "i" else c
                                 for name, c in columns.items()})

    @classmethod
    def concat(cls, record_type: type, tables: Iterable["RecordTable"]) -> "RecordTable":
        """One table of the rows of `tables`, in order."""
        return _join(record_type, [t._columns.copy() for t in tables])

    def take(self, index: np.ndarray) -> "RecordTable":
        """The rows at `index` (an integer array), in that order."""
        return RecordTable(self.record_type, {n: c[index] for n, c in self._columns.items()})

    def sorted_by(self, name: str) -> "RecordTable":
        """The rows ordered by one column; equal values keep their order (a stable sort,
        as `list.sort` is)."""
        key = self._columns[name]
        if len(key) < 2 or bool((key[1:] >= key[:-1]).all()):
            return self
        return self.take(np.argsort(key, kind="stable"))

    # --- reading ------------------------------------------------------------------------
    def column(self, name: str, rows: slice = slice(None)) -> np.ndarray:
        """One column (or the `rows` of it), read-only: float64 (NaN for None in a
        `float | None` or `int | None` column), int64 or object (str)."""
        column = self._columns[name][rows]
        column = column.astype(np.int64) if column.dtype.kind == "i" and column.dtype != np.int64 \
            else column.view()
        column.flags.writeable = False
        return column

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(self._columns)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.take(np.arange(self._len)[i])
        i = operator.index(i)
        if not -self._len <= i < self._len:
            raise IndexError(f"record {i} of a table of {self._len}")
        i %= self._len
        return next(self._records(i, i + 1))

    def __iter__(self) -> Iterator:
        for start in range(0, self._len, _ITER_ROWS):
            yield from self._records(start, min(start + _ITER_ROWS, self._len))

    def _records(self, start: int, stop: int) -> Iterator:
        lists = []
        for name, annotation in stored_fields(self.record_type).items():
            values = self._columns[name][start:stop].tolist()
            if annotation == "int | None":
                values = [None if v != v else int(v) for v in values]
            elif annotation == "float | None" and any(v != v for v in values):
                values = [None if v != v else v for v in values]
            lists.append(values)
        return map(self.record_type, *lists)

    def __repr__(self) -> str:
        return f"RecordTable({self.record_type.__name__}, {self._len} rows)"


def _join(record_type: type, parts: list[dict[str, np.ndarray]]) -> RecordTable:
    """A table of the rows of column dicts `parts`, which it empties as it goes: a part's
    column is released as soon as it is joined, so the peak is the result plus one column."""
    if len(parts) == 1:
        return RecordTable(record_type, parts[0])
    columns = {}
    for name, annotation in stored_fields(record_type).items():
        columns[name] = np.concatenate([p.pop(name) for p in parts]) if parts else \
            np.empty(0, KINDS[annotation])
    return RecordTable(record_type, columns)


def _convert(values: list, annotation: str) -> np.ndarray | None:
    """The column of `values`, or None when some value does not belong in it. Exact types
    are checked first (C loops); anything else goes through `_problem` one by one."""
    types = set(map(type, values))
    if annotation == "str":
        ok = types <= {str} or not any(_problem(v, annotation) for v in values)
        return np.array(values, dtype=object) if ok else None
    allowed = {"int": {int}, "float | None": {float, int, type(None)},
               "int | None": {int, type(None)}}.get(annotation, {float, int})
    if not types <= allowed:
        if any(_problem(v, annotation) for v in values):
            return None
        values = [v.item() if isinstance(v, np.generic) else v for v in values]
    if annotation == "int":
        try:
            return _narrow(np.array(values, dtype=np.int64))
        except OverflowError:
            return None
    if annotation == "int | None" and any(v is not None and abs(v) >= _EXACT for v in values):
        return None
    missing = values.count(None) if type(None) in types else 0
    try:
        column = np.array([math.nan if v is None else v for v in values] if missing else values,
                          dtype=np.float64)
    except OverflowError:   # an int beyond the float range
        return None
    finite = np.isfinite(column)
    # NaN spells None: a NaN among the values themselves is not a number we can store
    return column if int(finite.sum()) == len(column) - missing else None


_EXACT = 2**53
"""An `int | None` column holds integers below this, which float64 keeps exactly."""
_INT_TYPES = tuple(np.dtype(t) for t in (np.int8, np.int16, np.int32))


def _narrow(column: np.ndarray) -> np.ndarray:
    """The int column in the narrowest signed type that holds its values."""
    if len(column):
        low, high = int(column.min()), int(column.max())
        for dtype in _INT_TYPES:
            info = np.iinfo(dtype)
            if info.min <= low and high <= info.max:
                return column.astype(dtype)
    return column


def _problem(value, annotation: str) -> str | None:
    """Why one value cannot be stored in a column of this annotation (None if it can)."""
    if annotation == "str":
        return None if isinstance(value, str) else "must be a string"
    if annotation in ("float | None", "int | None") and value is None:
        return None
    integer = annotation in ("int", "int | None")
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return "must be an integer" if integer else "must be a finite number"
    if integer:
        if not isinstance(value, (int, np.integer)):
            return "must be an integer"
        if annotation == "int | None":
            return None if abs(int(value)) < _EXACT else "must be below 2**53 in magnitude"
        return None if -2**63 <= int(value) < 2**63 else "must fit in 64 bits"
    try:
        return None if math.isfinite(value) else "must be a finite number"
    except OverflowError:   # an int beyond the float range
        return "must be a finite number"


class RecordLog:
    """Records that arrive one at a time (a replica's steps, its finished requests), kept
    as columns: every `chunk_rows` records the buffered objects are checked, converted
    (`RecordTable.from_records`) and copied into growing column arrays, then freed.

    The arrays double when full (amortised O(1) a row; capacity never written is never
    touched, so it costs no memory), and widen when a chunk's integers need more bits.
    `table()` is a view of them, not a copy. `append` is a list append and a length check.
    """

    __slots__ = ("record_type", "chunk_rows", "_buffer", "_columns", "_len")

    def __init__(self, record_type: type, chunk_rows: int = 16_384) -> None:
        self.record_type = record_type
        self.chunk_rows = chunk_rows
        self._buffer: list = []
        self._columns: dict[str, np.ndarray] = {}
        self._len = 0

    def append(self, record) -> None:
        buffer = self._buffer
        buffer.append(record)
        if len(buffer) >= self.chunk_rows:
            self._flush()

    def extend(self, records: Iterable) -> None:
        self._buffer.extend(records)
        if len(self._buffer) >= self.chunk_rows:
            self._flush()

    def _flush(self) -> None:
        if not self._buffer and self._columns:
            return
        chunk = RecordTable.from_records(self.record_type, self._buffer)
        start, stop = self._len, self._len + len(chunk)
        for name, values in chunk._columns.items():
            column = self._columns.get(name)
            if column is None or stop > len(column) or not np.can_cast(values.dtype, column.dtype):
                dtype = values.dtype if column is None else np.result_type(column.dtype, values.dtype)
                grown = np.empty(max(stop, 2 * (0 if column is None else len(column))), dtype)
                if start:
                    grown[:start] = column[:start]
                self._columns[name] = column = grown
            column[start:stop] = values
        self._len = stop
        self._buffer = []

    def __len__(self) -> int:
        return self._len + len(self._buffer)

    def table(self) -> RecordTable:
        """Everything appended so far, as one table: a view of the log's columns (later
        appends do not show in it)."""
        self._flush()
        return RecordTable(self.record_type, {n: c[:self._len] for n, c in self._columns.items()})
