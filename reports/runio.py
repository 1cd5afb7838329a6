"""Reading and writing a run directory's files: requests.csv, steps.csv and JSON documents.

Files are written atomically (a temporary file in the same directory, fsync, then
os.replace), so a crashed run never leaves half a file behind a valid name. Output is
byte-for-byte deterministic: floats are written as repr(float), which round-trips exactly;
None is an empty cell; lines end in "\\n".

requests.csv has REQUEST_COLUMNS, followed by REQUEST_EXTRA_COLUMNS when any record has a
per-request SLO or n != 1. ttft_ms, tpot_ms and e2el_ms are derived from the timestamps for
people and spreadsheets; on reading they must agree with the timestamps. ``token_times`` are
not stored: a record read back has none, so its ITL is the per-request approximation
described in `servelab.reports.metrics`.

Readers check the header and every cell, and raise ValueError naming the file, the line and
the column of the first bad cell. Blank lines are skipped.

Cost: rows are converted a chunk at a time, column by column, so that the per-cell work runs
in C (map over str/repr/float); a cell-by-cell path runs only to name a bad value. A few
seconds per million rows.
"""
from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from operator import attrgetter
from pathlib import Path
from typing import IO, Any

from servelab.records import RequestRecord, StepRecord
from servelab.reports.columns import REQUEST_STATUSES

PathLike = str | os.PathLike[str]

REQUEST_COLUMNS: tuple[str, ...] = (
    "request_id", "arrival_s", "prompt_tokens", "output_tokens", "scheduled_s",
    "first_token_s", "finish_s", "ttft_ms", "tpot_ms", "e2el_ms", "num_preemptions",
    "tenant", "priority", "status", "reject_reason",
)
REQUEST_EXTRA_COLUMNS: tuple[str, ...] = ("slo_ttft_ms", "slo_tpot_ms", "n")
REQUEST_DERIVED_COLUMNS: tuple[str, ...] = ("ttft_ms", "tpot_ms", "e2el_ms")
STEP_COLUMNS: tuple[str, ...] = tuple(StepRecord.field_names())

_CHUNK_ROWS = 65_536
"""Rows converted at once: bounds memory while keeping the per-cell loops in C."""
_INT = re.compile(r"[+-]?[0-9]+")
_QUOTED_CHARS = (",", '"', "\n", "\r")
"""A text cell holding one of these goes through the csv module (quoted as it decides)."""


@dataclass(frozen=True, slots=True)
class _Codec:
    """How one column's values become cells and back.

    ``format_one``/``parse_one`` convert a single value and raise ValueError(why) for a bad
    one; ``format_all``/``parse_all`` convert a whole column in C loops and return None when
    some value needs the one-at-a-time verdict.
    """
    format_one: Callable[[Any], str]
    parse_one: Callable[[str], Any]
    format_all: Callable[[list], list[str] | None]
    parse_all: Callable[[list[str]], list | None]
    text: bool = False
    """Free text, which may hold a carriage return (see `_write_csv`)."""


def _format_int(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"must be an integer, got {v!r}")
    return str(v)


def _parse_int(cell: str) -> int:
    if not _INT.fullmatch(cell):
        raise ValueError(f"expected an integer, got {cell!r}")
    return int(cell)


def _format_float(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"must be a finite number, got {v!r}")
    return repr(float(v))


def _parse_float(cell: str) -> float:
    try:
        value = float(cell)
    except ValueError:
        raise ValueError(f"expected a number, got {cell!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {cell!r}")
    return value


def _format_optional_float(v: Any) -> str:
    return "" if v is None else _format_float(v)


def _parse_optional_float(cell: str) -> float | None:
    return None if cell == "" else _parse_float(cell)


def _format_str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"must be a string, got {v!r}")
    return v


def _parse_status(cell: str) -> str:
    if cell not in REQUEST_STATUSES:
        raise ValueError(f"expected one of {', '.join(REQUEST_STATUSES)}, got {cell!r}")
    return cell


_SMALL_INTS: list[str] = []
"""str(i) for 0 <= i < _SMALL_INTS_END, built on first use: indexing it costs 40% of
str(i), and almost every step-row count is small."""
_SMALL_INTS_END = 1 << 15


def _format_all_ints(values: list) -> list[str] | None:
    if not set(map(type, values)) <= {int}:
        return None
    if values and min(values) >= 0 and max(values) < _SMALL_INTS_END:
        if not _SMALL_INTS:
            _SMALL_INTS.extend(map(str, range(_SMALL_INTS_END)))
        return list(map(_SMALL_INTS.__getitem__, values))
    return list(map(str, values))


def _parse_all_ints(cells: list[str]) -> list | None:
    return list(map(int, cells)) if all(map(_INT.fullmatch, cells)) else None


def _format_all_floats(values: list) -> list[str] | None:
    types = set(map(type, values))
    if types <= {float, int} and all(map(math.isfinite, values)):
        # an int (a clock that starts at 0) is written as the float it stands for
        return list(map(repr, values if int not in types else map(float, values)))
    return None


def _parse_all_floats(cells: list[str]) -> list | None:
    try:
        values = list(map(float, cells))
    except ValueError:
        return None
    return values if all(map(math.isfinite, values)) else None


def _format_all_optional_floats(values: list) -> list[str] | None:
    types = set(map(type, values))
    if not types <= {float, int, type(None)}:
        return None
    if type(None) not in types:
        return _format_all_floats(values)
    present = [v for v in values if v is not None]
    if not all(map(math.isfinite, present)):
        return None
    cells = iter(map(repr, present if int not in types else map(float, present)))
    return ["" if v is None else next(cells) for v in values]


def _parse_all_optional_floats(cells: list[str]) -> list | None:
    try:
        values = [None if c == "" else float(c) for c in cells]
    except ValueError:
        return None
    return values if all(map(math.isfinite, [v for v in values if v is not None])) else None


def _format_all_strs(values: list) -> list[str] | None:
    return values if set(map(type, values)) <= {str} else None


_INT_CODEC = _Codec(_format_int, _parse_int, _format_all_ints, _parse_all_ints)
_FLOAT_CODEC = _Codec(_format_float, _parse_float, _format_all_floats, _parse_all_floats)
_OPTIONAL_FLOAT_CODEC = _Codec(_format_optional_float, _parse_optional_float,
                               _format_all_optional_floats, _parse_all_optional_floats)
_TEXT_CODEC = _Codec(_format_str, str, _format_all_strs, list, text=True)
_STATUS_CODEC = _Codec(_format_str, _parse_status, _format_all_strs,
                       lambda cells: cells if set(cells) <= set(REQUEST_STATUSES) else None)

_REQUEST_CODECS: dict[str, _Codec] = {
    "request_id": _INT_CODEC, "arrival_s": _FLOAT_CODEC, "prompt_tokens": _INT_CODEC,
    "output_tokens": _INT_CODEC, "scheduled_s": _OPTIONAL_FLOAT_CODEC,
    "first_token_s": _OPTIONAL_FLOAT_CODEC, "finish_s": _OPTIONAL_FLOAT_CODEC,
    "ttft_ms": _OPTIONAL_FLOAT_CODEC, "tpot_ms": _OPTIONAL_FLOAT_CODEC,
    "e2el_ms": _OPTIONAL_FLOAT_CODEC, "num_preemptions": _INT_CODEC, "tenant": _TEXT_CODEC,
    "priority": _INT_CODEC, "status": _STATUS_CODEC, "reject_reason": _TEXT_CODEC,
    "slo_ttft_ms": _OPTIONAL_FLOAT_CODEC, "slo_tpot_ms": _OPTIONAL_FLOAT_CODEC, "n": _INT_CODEC,
}

_CODEC_BY_ANNOTATION: dict[str, _Codec] = {
    "int": _INT_CODEC, "float": _FLOAT_CODEC, "float | None": _OPTIONAL_FLOAT_CODEC,
    "str": _TEXT_CODEC,
}


def _step_codecs() -> dict[str, _Codec]:
    codecs = {}
    for f in fields(StepRecord):
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if annotation not in _CODEC_BY_ANNOTATION:
            raise TypeError(f"runio cannot store StepRecord.{f.name} of type {annotation!r}")
        codecs[f.name] = _CODEC_BY_ANNOTATION[annotation]
    return codecs


_STEP_CODECS = _step_codecs()


# --- requests.csv ---

def write_requests_csv(path: PathLike, records: Sequence[RequestRecord]) -> None:
    """Write requests.csv; the extra columns appear only when some record needs them."""
    extended = any(r.slo_ttft_ms is not None or r.slo_tpot_ms is not None or r.n != 1
                   for r in records)
    columns = REQUEST_COLUMNS + REQUEST_EXTRA_COLUMNS if extended else REQUEST_COLUMNS
    _write_csv(path, columns, _REQUEST_CODECS, records,
               lambda i, r: f"request {r.request_id}")


def read_requests_csv(path: PathLike) -> list[RequestRecord]:
    """Read requests.csv as written by `write_requests_csv` (either column set)."""
    headers = (REQUEST_COLUMNS, REQUEST_COLUMNS + REQUEST_EXTRA_COLUMNS)
    records: list[RequestRecord] = []
    for lines, columns in _read_csv(path, headers, _REQUEST_CODECS):
        stored = {name: columns.pop(name) for name in REQUEST_DERIVED_COLUMNS}
        chunk = _build(RequestRecord, columns)
        for name, cells in stored.items():
            _check_derived(path, lines, chunk, name, cells)
        records += chunk
    return records


def _check_derived(path: PathLike, lines: list[int], records: list[RequestRecord], name: str,
                   stored: list[float | None]) -> None:
    """A derived column read back must agree with what the record computes from its times."""
    try:
        computed = list(map(attrgetter(name), records))
    except TypeError:
        computed = None
    if computed == stored:  # exact: the writer formatted this very computation
        return
    for line, record, value in zip(lines, records, stored):
        try:
            expected = getattr(record, name)
        except TypeError as e:
            raise ValueError(f"{path}:{line}: column {name!r} cannot be derived from the "
                             f"timestamps: {e}") from None
        if (value is None) != (expected is None) or (value is not None and not math.isclose(
                value, expected, rel_tol=1e-9, abs_tol=1e-9)):
            raise ValueError(f"{path}:{line}: column {name!r} is {value!r} but the "
                             f"timestamps give {expected!r}")


# --- steps.csv ---

def write_steps_csv(path: PathLike, records: Sequence[StepRecord]) -> None:
    """Write steps.csv: one column per StepRecord field, in field order."""
    _write_csv(path, STEP_COLUMNS, _STEP_CODECS, records, lambda i, r: f"step record {i}")


def read_steps_csv(path: PathLike) -> list[StepRecord]:
    records: list[StepRecord] = []
    for _, columns in _read_csv(path, (STEP_COLUMNS,), _STEP_CODECS):
        records += _build(StepRecord, columns)
    return records


# --- JSON ---

def write_json(path: PathLike, obj: Any) -> None:
    """Write obj as JSON (insertion order, indent 2, trailing newline) atomically.

    Raises TypeError for values JSON cannot hold (numpy arrays and integers among them; a
    numpy float64 is a float and passes) and ValueError for NaN or infinity, before the
    target file is touched.
    """
    text = json.dumps(obj, indent=2, allow_nan=False) + "\n"
    with _atomic_open(path) as f:
        f.write(text)


def read_json(path: PathLike) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None


# --- shared machinery ---

def _write_csv(path: PathLike, columns: Sequence[str], codecs: dict[str, _Codec],
               records: Sequence, describe: Callable[[int, Any], str]) -> None:
    with _atomic_open(path) as f:
        writer = csv.writer(f, lineterminator="\n")
        # csv quotes a cell holding "\n" but not a lone "\r" (not in our line terminator), which
        # a reader would take for a line end: rows with one are written fully quoted.
        quote_all = csv.writer(f, lineterminator="\n", quoting=csv.QUOTE_ALL)
        writer.writerow(columns)
        for start in range(0, len(records), _CHUNK_ROWS):
            chunk = records[start:start + _CHUNK_ROWS]
            cells = []
            for name in columns:
                codec = codecs[name]
                try:
                    values = list(map(attrgetter(name), chunk))
                    formatted = codec.format_all(values)
                except TypeError:  # a derived value of inconsistent fields
                    formatted = None
                if formatted is None:
                    formatted = []
                    for i, record in enumerate(chunk):
                        try:
                            formatted.append(codec.format_one(getattr(record, name)))
                        except (TypeError, ValueError) as e:
                            raise ValueError(f"{describe(start + i, record)}: {name} {e}") from None
                cells.append(formatted)
            texts = ["".join(column) for name, column in zip(columns, cells) if codecs[name].text]
            if not any(c in text for text in texts for c in _QUOTED_CHARS):
                # no cell needs quoting (numbers cannot): skip the csv module's checks
                f.write("\n".join(map(",".join, zip(*cells))) + "\n")  # a chunk has >= 1 row
                continue
            has_cr = any("\r" in text for text in texts)
            if not has_cr:
                writer.writerows(zip(*cells))
                continue
            for row in zip(*cells):
                (quote_all if "\r" in "".join(row) else writer).writerow(row)


def _read_csv(path: PathLike, headers: Sequence[Sequence[str]], codecs: dict[str, _Codec],
              ) -> Iterator[tuple[list[int], dict[str, list]]]:
    """Yield (line numbers, {column: parsed values}) per chunk of rows, for one of the headers."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path}: empty file, expected a header line")
        if tuple(header) not in {tuple(h) for h in headers}:
            expected = " or ".join(",".join(h) for h in headers)
            raise ValueError(f"{path}:1: unexpected columns {','.join(header)}; "
                             f"expected {expected}")
        rows: list[list[str]] = []
        lines: list[int] = []
        for row in reader:
            if not row:
                continue
            if len(row) != len(header):
                raise ValueError(f"{path}:{reader.line_num}: expected {len(header)} cells, "
                                 f"got {len(row)}")
            rows.append(row)
            lines.append(reader.line_num)
            if len(rows) == _CHUNK_ROWS:
                yield lines, _parse_columns(path, header, codecs, rows, lines)
                rows, lines = [], []
        if rows:
            yield lines, _parse_columns(path, header, codecs, rows, lines)


def _parse_columns(path: PathLike, header: list[str], codecs: dict[str, _Codec],
                   rows: list[list[str]], lines: list[int]) -> dict[str, list]:
    columns = {}
    for name, cells in zip(header, map(list, zip(*rows))):
        codec = codecs[name]
        values = codec.parse_all(cells)
        if values is None:
            values = []
            for line, cell in zip(lines, cells):
                try:
                    values.append(codec.parse_one(cell))
                except ValueError as e:
                    raise ValueError(f"{path}:{line}: column {name!r}: {e}") from None
        columns[name] = values
    return columns


def _build(cls: type, columns: dict[str, list]) -> list:
    """Records from columns: positionally (fast) when they hold a prefix of cls's fields."""
    field_names = cls.field_names()
    if set(columns) == set(field_names[:len(columns)]):
        return list(map(cls, *(columns[name] for name in field_names[:len(columns)])))
    return [cls(**dict(zip(columns, row))) for row in zip(*columns.values())]


@contextlib.contextmanager
def _atomic_open(path: PathLike) -> Iterator[IO[str]]:
    """A text file that replaces `path` only when the block completes without error.

    The temporary name is unique per live process and thread, so a leftover from a crashed
    process can only be overwritten, never shared.
    """
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
