"""A run directory's files: requests and steps (CSV, or Parquet for large runs), and JSON.

    write_records(out_dir, requests, steps, "csv")     # requests.csv, steps.csv
    requests = read_requests(out_dir)                  # a RecordTable, from either format
    steps = read_steps(out_dir / "steps.parquet")

Tables are written by pyarrow from the records' columns (`RecordTable`): nothing is
formatted one value at a time in Python. Each file is written atomically
(`servelab.atomic`), and the same records give the same bytes.

requests has REQUEST_COLUMNS, followed by REQUEST_EXTRA_COLUMNS when any record has a
per-request SLO or n != 1, then REQUEST_PREFIX_COLUMNS when the run kept a prefix cache
(its records say how many prompt tokens it served). ttft_ms, tpot_ms and e2el_ms are
derived from the timestamps for people and spreadsheets; on reading they must agree with
the timestamps. ``token_times`` are not stored: a record read back has none, so its ITL is
the per-request approximation described in `servelab.reports.metrics`. steps has one
column per StepRecord field, except that STEP_TIER_COLUMNS appear only when some step moved
prefix blocks to or from the CPU tier.

CSV: a float is written as the shortest text that reads back to the same double (Arrow's
formatting: ``1`` for 1.0, ``0.00001`` for 1e-05), so every value round-trips exactly; None
is an empty cell; lines end in "\\n". Text cells are quoted only when some text cell of the
file needs it (a comma, quote or line break; then every text cell is). Parquet keeps the
same columns with their types (None as null).

Readers check the columns, every value (integers, finite floats, statuses, derived
columns) and raise ValueError naming the file, and for a CSV file the line and column of
the first bad cell: pyarrow reads the file, and only when it or a check fails is the file
walked row by row with the csv module to name the line. Blank lines are skipped.

Cost: about a second per million request rows and less per million step rows, either way;
Parquet files are about half the size of CSV and read several times faster.
"""
from __future__ import annotations

import csv
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from servelab.atomic import atomic_path, write_atomic
from servelab.options import OUTPUT_FORMATS
from servelab.record_table import KINDS, RecordTable, stored_fields
from servelab.records import RequestRecord, StepRecord
from servelab.reports.columns import REQUEST_STATUSES

PathLike = str | os.PathLike[str]

REQUEST_COLUMNS: tuple[str, ...] = (
    "request_id", "arrival_s", "prompt_tokens", "output_tokens", "scheduled_s",
    "first_token_s", "finish_s", "ttft_ms", "tpot_ms", "e2el_ms", "num_preemptions",
    "tenant", "priority", "status", "reject_reason",
)
REQUEST_EXTRA_COLUMNS: tuple[str, ...] = ("slo_ttft_ms", "slo_tpot_ms", "n")
REQUEST_PREFIX_COLUMNS: tuple[str, ...] = ("cached_tokens", "cpu_cached_tokens")
REQUEST_DERIVED_COLUMNS: tuple[str, ...] = ("ttft_ms", "tpot_ms", "e2el_ms")
STEP_TIER_COLUMNS: tuple[str, ...] = ("num_offload_blocks", "num_load_blocks")
STEP_COLUMNS: tuple[str, ...] = tuple(n for n in stored_fields(StepRecord) if n not in STEP_TIER_COLUMNS)
SUFFIXES = {"csv": ".csv", "parquet": ".parquet"}

_KIND = {**stored_fields(RequestRecord), **stored_fields(StepRecord),
         **dict.fromkeys(REQUEST_DERIVED_COLUMNS, "float | None"), "status": "status"}
"""Column -> kind: a field annotation, or 'status'."""
_ARROW = {"int": pa.int64(), "int | None": pa.int64(), "float": pa.float64(), "float | None": pa.float64(),
          "str": pa.string(), "status": pa.string()}
_BATCH_ROWS = 1 << 18
"""Rows converted and written at once: bounds the memory a write needs beyond the table."""


# --- writing ----------------------------------------------------------------------------

OPTIONAL_RUN_FILES = ("disaggregation.json", "handoffs.csv", "handoffs.parquet",
                      "speculation.json", "outputs.jsonl")
"""Files a run directory holds only for some runs (disaggregated, speculative, with the
outputs saved): `clear_optional_files` removes an earlier run's before a new one is written."""


RUN_FILES = ("config.json", "summary.json", *(f"{name}{suffix}" for name in ("requests", "steps")
                                              for suffix in SUFFIXES.values()),
             *OPTIONAL_RUN_FILES)
"""Every file a run directory may hold: what a new run written there replaces."""


def clear_optional_files(out_dir: PathLike) -> None:
    """Remove what an earlier run wrote into `out_dir` beside the tables that this one may
    not write (`OPTIONAL_RUN_FILES`): a run replaced with --force leaves none of them."""
    for name in OPTIONAL_RUN_FILES:
        (Path(out_dir) / name).unlink(missing_ok=True)


def write_records(out_dir: PathLike, requests: Sequence[RequestRecord],
                  steps: Sequence[StepRecord], output_format: str = "csv") -> None:
    """Write out_dir/requests.<format> and out_dir/steps.<format> (removing the other
    format's files, so a directory never holds two versions of a table)."""
    if output_format not in OUTPUT_FORMATS:
        raise ValueError(f"output format must be one of {', '.join(OUTPUT_FORMATS)}, "
                         f"got {output_format!r}")
    out = Path(out_dir)
    for name, records, write in (("requests", requests, write_requests),
                                 ("steps", steps, write_steps)):
        write(out / f"{name}{SUFFIXES[output_format]}", records)
        for other, suffix in SUFFIXES.items():
            if other != output_format:
                (out / f"{name}{suffix}").unlink(missing_ok=True)


def write_requests(path: PathLike, records: Sequence[RequestRecord]) -> None:
    """Write request records as CSV or Parquet (by the file's suffix); the extra columns
    appear only when some record needs them. Raises ValueError naming the first record
    whose value cannot be stored, before the file is touched."""
    table = RecordTable.from_records(RequestRecord, records)
    derived = _derived(table)
    extended = not (np.isnan(table.column("slo_ttft_ms")).all()
                    and np.isnan(table.column("slo_tpot_ms")).all() and (table.column("n") == 1).all())
    prefix = not np.isnan(table.column("cached_tokens")).all()
    _write(path, REQUEST_COLUMNS + (REQUEST_EXTRA_COLUMNS if extended else ())
           + (REQUEST_PREFIX_COLUMNS if prefix else ()), table, derived)


def write_steps(path: PathLike, records: Sequence[StepRecord]) -> None:
    """Write step records as CSV or Parquet (by the file's suffix), one column per field;
    the CPU-tier columns only when some step moved prefix blocks to or from it."""
    table = RecordTable.from_records(StepRecord, records)
    tier = any(table.column(name).any() for name in STEP_TIER_COLUMNS)
    _write(path, STEP_COLUMNS + (STEP_TIER_COLUMNS if tier else ()), table, {})


def _derived(table: RecordTable) -> dict[str, np.ndarray]:
    """ttft_ms, tpot_ms, e2el_ms as `RequestRecord` computes them (NaN for None); raises
    ValueError naming the first record whose value is not finite (huge times overflow)."""
    arrival, first = table.column("arrival_s"), table.column("first_token_s")
    finish, out = table.column("finish_s"), table.column("output_tokens")
    done = (table.column("status") == "finished") & ~np.isnan(finish)
    with np.errstate(over="ignore", invalid="ignore"):
        derived = {
            "ttft_ms": (first - arrival) * 1e3,
            "tpot_ms": np.where(done & (out >= 2) & ~np.isnan(first),
                                (finish - first) * 1e3 / np.maximum(out - 1, 1), math.nan),
            "e2el_ms": np.where(done, (finish - arrival) * 1e3, math.nan),
        }
    for name, values in derived.items():
        bad = np.isinf(values)
        if bad.any():
            i = int(bad.argmax())
            raise ValueError(f"request {table[i].request_id}: {name} must be a finite number, "
                             f"got {values[i]!r}")
    return derived


def _write(path: PathLike, names: Sequence[str], table: RecordTable,
           derived: dict[str, np.ndarray]) -> None:
    """Write the columns `names` (the table's, or `derived`'s) a batch of rows at a time, so
    that only a batch is ever converted to Arrow's types at once."""
    schema = pa.schema([(name, _ARROW[_KIND[name]]) for name in names])
    fmt = _format(path)
    quote = fmt == "csv" and any(c in word for name in names if schema.field(name).type == pa.string()
                                 for word in set(table.column(name)) for c in ',"\r\n')
    with atomic_path(path) as tmp:
        writer = pq.ParquetWriter(tmp, schema) if fmt == "parquet" else pacsv.CSVWriter(
            tmp, schema, write_options=pacsv.WriteOptions(
                quoting_style="needed" if quote else "none", quoting_header="none"))
        with writer:
            for start in range(0, len(table), _BATCH_ROWS):
                rows = slice(start, start + _BATCH_ROWS)
                writer.write_batch(pa.record_batch(
                    [_arrow(derived[name][rows] if name in derived else table.column(name, rows), name)
                     for name in names], schema=schema))


def _arrow(values: np.ndarray, name: str) -> pa.Array:
    if values.dtype == object:
        return pa.array(values, type=pa.string())
    # NaN is None in an optional column, and is null in the file
    if _KIND[name] == "int | None":
        return pa.array(values, from_pandas=True).cast(pa.int64())
    return pa.array(values, from_pandas=_KIND[name] == "float | None")


def _format(path: PathLike) -> str:
    for fmt, suffix in SUFFIXES.items():
        if str(path).endswith(suffix):
            return fmt
    raise ValueError(f"{path}: a run table is a {' or '.join(SUFFIXES.values())} file")


# --- reading ----------------------------------------------------------------------------

def read_requests(path: PathLike) -> RecordTable:
    """Request records from a requests.csv / requests.parquet file, or from a run
    directory holding one; the derived columns must agree with the timestamps."""
    path = table_file(path, "requests")
    headers = [REQUEST_COLUMNS + extra + prefix for extra in ((), REQUEST_EXTRA_COLUMNS)
               for prefix in ((), REQUEST_PREFIX_COLUMNS)]
    columns = _read(path, headers)
    header = tuple(columns)
    n = len(columns["request_id"])
    columns.setdefault("slo_ttft_ms", np.full(n, math.nan))
    columns.setdefault("slo_tpot_ms", np.full(n, math.nan))
    columns.setdefault("n", np.ones(n, dtype=np.int64))
    for name in REQUEST_PREFIX_COLUMNS:
        columns.setdefault(name, np.full(n, math.nan))
    table = RecordTable.from_columns(RequestRecord,
                                     {name: columns[name] for name in stored_fields(RequestRecord)})
    for name, computed in _derived(table).items():
        stored = columns[name]
        same = (np.isnan(stored) == np.isnan(computed)) & (
            np.isnan(stored) | np.isclose(stored, computed, rtol=1e-9, atol=1e-9))
        if not same.all():
            _name_bad_row(path, header, f"column {name!r} disagrees with the timestamps")
    return table


def read_steps(path: PathLike) -> RecordTable:
    """Step records from a steps.csv / steps.parquet file, or from a run directory."""
    path = table_file(path, "steps")
    columns = _read(path, (STEP_COLUMNS, STEP_COLUMNS + STEP_TIER_COLUMNS))
    n = len(next(iter(columns.values())))
    for name in STEP_TIER_COLUMNS:
        columns.setdefault(name, np.zeros(n, dtype=np.int64))
    return RecordTable.from_columns(StepRecord, {name: columns[name] for name in stored_fields(StepRecord)})


def table_file(path: PathLike, name: str) -> Path:
    """`path` itself if it is a file; in a run directory, its `name` table in whichever
    format it was written."""
    path = Path(path)
    if not path.is_dir():
        return path
    found = [path / f"{name}{suffix}" for suffix in SUFFIXES.values()
             if (path / f"{name}{suffix}").exists()]
    if len(found) != 1:
        raise ValueError(f"{path}: expected one of {name}.csv or {name}.parquet, found "
                         f"{', '.join(p.name for p in found) or 'neither'}")
    return found[0]


def _read(path: Path, headers: Sequence[Sequence[str]]) -> dict[str, np.ndarray]:
    """{column: values} of a checked run table (NaN for None in optional float columns)."""
    if _format(path) == "parquet":
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as exc:
            raise ValueError(f"{path}: not a readable Parquet file ({exc})") from None
        header = tuple(table.column_names)
        _check_header(path, header, headers)
        try:
            table = table.cast(pa.schema([(n, _ARROW[_KIND[n]]) for n in header]))
        except (pa.ArrowException, ValueError) as exc:
            raise ValueError(f"{path}: column types do not match ({exc})") from None
    else:
        header = _csv_header(path)
        _check_header(path, header, headers)
        try:
            table = pacsv.read_csv(path, pacsv.ReadOptions(skip_rows=1, column_names=header),
                                   pacsv.ParseOptions(newlines_in_values=True),
                                   pacsv.ConvertOptions(
                                       column_types={n: _ARROW[_KIND[n]] for n in header},
                                       null_values=[""], strings_can_be_null=False))
        except pa.ArrowInvalid as exc:
            _name_bad_row(path, header, str(exc))
    columns = {}
    for name in header:
        values, kind = table.column(name), _KIND[name]
        if not _column_ok(values, kind):
            _name_bad_row(path, header, f"column {name!r} holds a value out of place")
        columns[name] = _to_numpy(values, kind)
    return columns


def _column_ok(values: pa.ChunkedArray, kind: str) -> bool:
    """No missing value where the column needs one, floats finite, statuses known.
    (Over no rows, pyarrow's any() and all() are null: nothing is wrong.)"""
    if values.null_count and kind not in ("float | None", "int | None"):
        return False
    if kind == "status":
        return pc.all(pc.is_in(values, value_set=pa.array(REQUEST_STATUSES))).as_py() is not False
    if kind in ("float", "float | None"):
        return not (pc.any(pc.is_inf(values)).as_py() or pc.any(pc.is_nan(values)).as_py())
    return True


def _to_numpy(values: pa.ChunkedArray, kind: str) -> np.ndarray:
    if KINDS.get(kind, object) is object:   # text: one str object per distinct value
        encoded = values.combine_chunks().dictionary_encode()
        words = np.array(encoded.dictionary.to_pylist(), dtype=object)
        return words[encoded.indices.to_numpy(zero_copy_only=False)]
    if kind == "int | None":   # nulls become NaN
        return values.cast(pa.float64()).to_numpy()
    return values.to_numpy().astype(KINDS[kind], copy=False)


def _csv_header(path: Path) -> tuple[str, ...]:
    with open(path, newline="", encoding="utf-8") as f:
        header = next(csv.reader(f), None)
    if header is None:
        raise ValueError(f"{path}: empty file, expected a header line")
    return tuple(header)


def _check_header(path: Path, header: tuple[str, ...], headers: Sequence[Sequence[str]]) -> None:
    if header not in {tuple(h) for h in headers}:
        where = "" if _format(path) == "parquet" else ":1"
        raise ValueError(f"{path}{where}: unexpected columns {','.join(header)}; expected "
                         + " or ".join(",".join(h) for h in headers))


_INT = re.compile(r"-?[0-9]+")


def _name_bad_row(path: Path, header: tuple[str, ...], problem: str) -> NoReturn:
    """Raise ValueError naming the line and column of the first bad cell: the file is walked
    with the csv module, each cell checked as the reader checks its column. (Parquet has no
    lines: the problem is named as it was found.)"""
    if _format(path) == "parquet":
        raise ValueError(f"{path}: {problem}")
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        next(reader)
        for row in reader:
            if not row:
                continue
            where = f"{path}:{reader.line_num}"
            if len(row) != len(header):
                raise ValueError(f"{where}: expected {len(header)} cells, got {len(row)}")
            values = {}
            for name, cell in zip(header, row):
                try:
                    values[name] = _parse_cell(cell, _KIND[name])
                except ValueError as exc:
                    raise ValueError(f"{where}: column {name!r}: {exc}") from None
            if "ttft_ms" in values:
                _check_derived_row(where, values)
    raise ValueError(f"{path}: {problem}")


def _parse_cell(cell: str, kind: str) -> Any:
    if kind == "status":
        if cell not in REQUEST_STATUSES:
            raise ValueError(f"expected one of {', '.join(REQUEST_STATUSES)}, got {cell!r}")
        return cell
    if kind == "str":
        return cell
    if kind in ("float | None", "int | None") and cell == "":
        return None
    if kind in ("int", "int | None"):
        if not _INT.fullmatch(cell):
            raise ValueError(f"expected an integer, got {cell!r}")
        return int(cell)
    try:
        value = float(cell)
    except ValueError:
        raise ValueError(f"expected a number, got {cell!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {cell!r}")
    return value


def _check_derived_row(where: str, values: dict[str, Any]) -> None:
    record = RequestRecord(**{k: v for k, v in values.items() if k not in REQUEST_DERIVED_COLUMNS})
    for name in REQUEST_DERIVED_COLUMNS:
        value, expected = values[name], getattr(record, name)
        if (value is None) != (expected is None) or (value is not None and not math.isclose(
                value, expected, rel_tol=1e-9, abs_tol=1e-9)):
            raise ValueError(f"{where}: column {name!r} is {value!r} but the timestamps give "
                             f"{expected!r}")


# --- JSON -------------------------------------------------------------------------------

def write_json(path: PathLike, obj: Any) -> None:
    """Write obj as JSON (insertion order, indent 2, trailing newline) atomically.

    Raises TypeError for values JSON cannot hold (numpy arrays and integers among them; a
    numpy float64 is a float and passes) and ValueError for NaN or infinity, before the
    target file is touched.
    """
    write_atomic(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")


def read_json(path: PathLike) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
