"""Load trace files into a `Trace`, detecting the format from the header.

The formats (their columns, time units, detection) are the registry's in `formats.py`;
any CSV format registered there is read by the generic row reader and the bulk path, and
the built-in formats that carry more than arrival, prompt and output have their own
readers here (BurstGPT's failed requests, servelab's optional columns, Mooncake's prefix
hash ids in JSON lines).

Foreign formats are re-based so the first kept request arrives at 0 s. Azure datetimes are
parsed to integer nanoseconds (Python's datetime keeps only microseconds), so relative
times are exact to the file's 100 ns resolution. Clean files (every format but BurstGPT)
are read by pyarrow's CSV and JSON readers (`_arrow`); anything else is parsed row by row
to find the exact line and problem. The conversation trace (19,366 rows) loads in about
0.1 s (`python -m servelab.traces.benchmark`).
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
from typing import Callable

from servelab.traces._arrow import csv_columns as arrow_csv
from servelab.traces._arrow import json_columns as arrow_json
from servelab.traces._rows import (NS, BadRow, RowSink, enforce_order, parse_azure_ns, parse_int,
                                   parse_length, parse_number, read_lines, split_cells)
from servelab.traces.formats import TRACE_FORMATS, TraceFormat, detect, trace_format_names
from servelab.traces.record import MAX_HASH, NeedsRateError, Trace, TraceError, TraceFormatError, TraceRecord

FAILED_REASON = "failed request (0 response tokens)"
MOONCAKE_BLOCK_SIZE = 512
"""Tokens per `hash_ids` block in the Mooncake traces (FAST'25 release README)."""

UNREAD_COLUMNS = "columns not read"
"""How a trace's note names header columns its format does not read (a misspelt
`priorty` would otherwise go unnoticed: every request at priority 0)."""
_SERVELAB_OPTIONAL = ("tenant", "priority", "slo_ttft_ms", "slo_tpot_ms", "prefix_block_size", "prefix_hashes")

Row = tuple  # (line, time, prompt, output, hashes, block_size, tenant, priority, slo_ttft, slo_tpot)


def detect_format(path: str | os.PathLike, first_line: str | None = None) -> str:
    """The format name for a file, from its first non-blank line (read if not given)."""
    if first_line is None:
        with open(path, "rb") as f:
            first_line = _first_nonblank(read_lines(f.read(65536)))[1] or ""
    try:
        fmt = detect(first_line)
    except ValueError as exc:   # two formats of the very same columns
        raise TraceFormatError(str(path), 1, str(exc)) from None
    if fmt is None:
        raise TraceFormatError(str(path), 1, f"cannot tell the trace format from the first line "
                               f"{first_line.strip()[:120]!r}; expected one of the headers of "
                               f"{', '.join(trace_format_names())} (or name it with --trace-format)")
    return fmt.name


def load_trace(path: str | os.PathLike, format: str = "auto", *, on_bad_row: str = "error",
               rate: float | None = None, cv: float = 1.0, seed: int = 0,
               keep_failed: bool = False, max_model_len: int | None = None,
               num_requests: int | None = None) -> Trace:
    """Read a trace file into arrival-ordered `TraceRecord`s.

    on_bad_row: 'error' raises `TraceFormatError` (file, line, problem) at the first bad row;
        'drop' skips bad rows and reports each kind in `Trace.dropped`.
    rate: target mean request rate (req/s). Required for length-only tables, whose arrivals
        are drawn from a Gamma renewal process with coefficient of variation `cv` (1 =
        Poisson) and `seed`; for timed traces the replay is rescaled to it (`with_rate`).
    keep_failed: BurstGPT only; keep failed requests (0 response tokens) as 1-token outputs,
        counted in `Trace.clipped`, instead of dropping them (counted in `Trace.dropped`).
    max_model_len: clip prompt+output to this many tokens (`clip_lengths`), counted.
    num_requests: keep only the first this many requests, before a timed trace is rescaled
        to `rate`: the requests replayed arrive at that mean rate, not the whole file.
    """
    path_s = str(path)
    if format != "auto" and format not in TRACE_FORMATS:
        raise TraceError(f"unknown trace format {format!r}; expected auto or one of "
                         f"{', '.join(trace_format_names())}")
    sink, clips = RowSink(path_s, on_bad_row), RowSink(path_s, "drop")
    with open(path, "rb") as f:
        data = f.read()
    lines = read_lines(data)
    header_no, header = _first_nonblank(lines)
    if header_no is None:
        raise TraceFormatError(path_s, None, "the file holds no rows (empty or blank)")
    if header is None:
        raise TraceFormatError(path_s, header_no, "the first line is not valid UTF-8 text")
    fmt = detect_format(path_s, header) if format == "auto" else format
    spec = TRACE_FORMATS.get(fmt)
    if not spec.has_times and rate is None:
        raise NeedsRateError(f"{path_s} is a length-only table (no timestamps): give a request rate "
                             "for the synthetic arrival process (--rate, or --rates in a sweep; "
                             "rate= from Python)")
    if spec.has_times and cv != 1.0:
        raise TraceError(f"cv applies only to length-only tables (drawn arrivals); {path_s} is {fmt}")
    if keep_failed and fmt != "burstgpt":
        raise TraceError("keep_failed applies only to BurstGPT traces")

    times, prompts, outputs, extras, data_rows = _parse(path_s, data, lines, header_no, header, spec, sink,
                                                        clips, keep_failed)
    del data, lines
    notes = [f"format {fmt}"]
    if fmt == "servelab":
        known = (*spec.columns.values(), *_SERVELAB_OPTIONAL)
        unread = [name for name in (c.strip().lower() for c in split_cells(header))
                  if name not in known]
        if unread:
            notes.append(f"{UNREAD_COLUMNS}: {', '.join(unread)} (a servelab trace's columns: "
                         f"{', '.join(known)})")
    if not spec.has_times:
        import numpy as np

        from servelab.traces.distributions import ArrivalProcess
        process = ArrivalProcess(rate, cv)
        times = process.times(np.random.default_rng(seed), n=len(prompts)).tolist()
        notes.append(f"arrivals drawn: {process.describe()} seed={seed}")
    elif not spec.keeps_times and times:
        if spec.time_unit == "datetime":
            notes.append(f"time origin {_format_ns(times[0])} (the first kept row)")
        t0, div = times[0], spec.units_per_s
        times = [(t - t0) / div for t in times]
    if extras is None:
        records = [TraceRecord(t, p, o) for t, p, o in zip(times, prompts, outputs)]
    else:
        records = [TraceRecord(t, p, o, *x) for t, p, o, x in zip(times, prompts, outputs, extras)]
    trace = Trace(tuple(records), source=path_s, format=fmt, source_rows=data_rows,
                  dropped=sink.report(), clipped=clips.report(), notes=tuple(notes))
    if num_requests is not None:
        from servelab.traces.transforms import first_n
        trace = first_n(trace, num_requests)
    if rate is not None and spec.has_times:
        from servelab.traces.transforms import with_rate
        trace = with_rate(trace, rate)
    if max_model_len is not None:
        from servelab.traces.transforms import clip_lengths
        trace = clip_lengths(trace, max_model_len)
    return trace


# ----------------------------------------------------------------------------- reading rows
def _parse(path: str, data: bytes, lines: list[str | None], header_no: int, header: str,
           spec: TraceFormat, sink: RowSink, clips: RowSink, keep_failed: bool):
    """(raw times, prompts, outputs, extra fields per row or None, data rows) in file order,
    bad rows already raised or dropped, times checked for order."""
    columns = _bulk_columns(data, lines, header_no, header, spec)
    if columns is not None:
        times, prompts, outputs, extras = columns
        return times, prompts, outputs, extras, len(prompts)
    if spec.json_lines:
        rows, data_rows = _read_rows(lines, header_no - 1, sink, _json_row_parser(spec))
    else:
        parse = _csv_row_parser(path, spec, header_no, header)
        rows, data_rows = _read_rows(lines, header_no, sink, parse, ncols=len(split_cells(header)))
    if spec.name == "burstgpt":
        rows = _handle_failed(rows, keep_failed, sink, clips)
    if spec.has_times:
        rows = enforce_order(rows, sink, _time_shown(spec))
    return [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows], [r[4:] for r in rows], data_rows


def _first_nonblank(lines: list[str | None]) -> tuple[int | None, str | None]:
    for i, line in enumerate(lines):
        if line is None or line.strip():
            return i + 1, line
    return None, None


def _clean_header(header: str) -> list[str] | None:
    """The header's column names if the bulk paths can use them (no quotes, no name
    twice), else None."""
    if '"' in header:
        return None
    names = [c.strip() for c in header.split(",")]
    return names if len({name.lower() for name in names}) == len(names) else None


def _bulk_columns(data: bytes, lines: list[str | None], header_no: int, header: str,
                  spec: TraceFormat):
    """(times, prompts, outputs, extra fields per row or None) of a clean file, read by
    pyarrow (`_arrow`), or None to parse it row by row. BurstGPT always goes row by row."""
    if None in lines:   # invalid UTF-8: the row parser names the line
        return None
    if spec.json_lines:
        columns = arrow_json(data, sum(1 for line in lines if line and not line.isspace()),
                             spec.columns)
        if columns is None:
            return None
        times, prompts, outputs, hashes = columns
        return times, prompts, outputs, [(h, MOONCAKE_BLOCK_SIZE, "default", 0, None, None)
                                         for h in hashes]
    names = _clean_header(header)
    if spec.name == "burstgpt" or names is None or header_no != 1:
        return None
    by_lower = {name.lower(): name for name in names}
    if not set(spec.columns.values()) <= by_lower.keys():
        return None   # the row parser names what is missing
    roles = {role: by_lower[column] for role, column in spec.columns.items()}
    return arrow_csv(data, names, roles, spec)


def _read_rows(lines, start: int, sink: RowSink, parse: Callable, ncols: int | None = None):
    """Parse lines[start:] (0-based index; line number = index + 1). Blank lines are not rows.
    Returns (parsed rows, number of data rows seen)."""
    rows: list[Row] = []
    data_rows = 0
    for i in range(start, len(lines)):
        line = lines[i]
        if line is None:
            data_rows += 1
            sink.bad(i + 1, "invalid UTF-8", "the line is not valid UTF-8 text")
            continue
        if not line or line.isspace():
            continue
        data_rows += 1
        try:
            if ncols is None:
                rows.append((i + 1, *parse(line)))
                continue
            cells = split_cells(line)
            if len(cells) != ncols:
                reason = "missing column" if len(cells) < ncols else "extra column"
                raise BadRow(reason, f"expected {ncols} comma-separated cells, found {len(cells)}")
            rows.append((i + 1, *parse(cells)))
        except BadRow as exc:
            sink.bad(i + 1, exc.reason, exc.detail)
    return rows, data_rows


def _csv_row_parser(path: str, spec: TraceFormat, header_no: int, header: str) -> Callable:
    """A function cells -> row tuple for this header, with column positions bound once."""
    try:
        names = [c.strip() for c in split_cells(header)]
    except BadRow as exc:
        raise TraceFormatError(path, header_no, f"malformed header: {exc.detail}") from None
    index: dict[str, int] = {}
    for i, name in enumerate(names):
        if name.lower() in index:
            raise TraceFormatError(path, header_no, f"column {name!r} appears twice in the header")
        index[name.lower()] = i
    need = spec.columns
    missing = [c for c in need.values() if c not in index]
    if missing:
        raise TraceFormatError(path, header_no, f"the {spec.name} format needs column(s) "
                               f"{', '.join(missing)}; the header has {', '.join(names)}")
    col = {role: index[name] for role, name in need.items()}
    label = {role: names[i] for role, i in col.items()}
    ip, io, lp, lo = col["prompt"], col["output"], label["prompt"], label["output"]

    if spec.name == "burstgpt":
        return _burstgpt_parser(col, label)
    if spec.name == "servelab":
        return _servelab_parser(col, label, index)
    if not spec.has_times:
        return lambda c: (None, parse_length(c[ip], lp), parse_length(c[io], lo),
                          None, None, "default", 0, None, None)
    it, lt = col["time"], label["time"]
    if spec.time_unit == "datetime":
        days: dict = {}
        return lambda c: (parse_azure_ns(c[it], lt, days), parse_length(c[ip], lp), parse_length(c[io], lo),
                          None, None, "default", 0, None, None)
    return lambda c: (parse_number(c[it], lt), parse_length(c[ip], lp), parse_length(c[io], lo),
                      None, None, "default", 0, None, None)


def _burstgpt_parser(col, label) -> Callable:
    it, im, ip, io = col["time"], col["model"], col["prompt"], col["output"]

    def parse(c: list[str]) -> tuple:
        t = parse_number(c[it], label["time"])
        model = c[im].strip()
        if not model or not model.isprintable():
            raise BadRow("invalid model", f"{label['model']} is {c[im]!r}; expected a model name")
        prompt = parse_length(c[ip], label["prompt"])
        out = parse_int(c[io], label["output"])
        if out < 0:
            raise BadRow("non-positive length", f"{label['output']} is {c[io].strip()!r}")
        if out > 2**31 - 1:
            out = parse_length(c[io], label["output"])  # raises 'implausible length'
        return t, prompt, out, None, None, model, 0, None, None  # out == 0: failed, see below
    return parse


def _handle_failed(rows: list[Row], keep_failed: bool, sink: RowSink, clips: RowSink) -> list[Row]:
    """BurstGPT logs failed requests with 0 response tokens: drop them (counted whatever
    on_bad_row says, as they are data, not corruption) or keep them as 1-token outputs."""
    kept = []
    for row in rows:
        if row[3] != 0:
            kept.append(row)
        elif keep_failed:
            clips.count(row[0], "failed request kept with 1 output token", "Response tokens is 0; kept with 1")
            kept.append(row[:3] + (1,) + row[4:])
        else:
            sink.count(row[0], FAILED_REASON, "Response tokens is 0 (the request failed); dropped")
    return kept


def _servelab_parser(col, label, index: dict[str, int]) -> Callable:
    it, ip, io = col["time"], col["prompt"], col["output"]
    opt = {name: index.get(name) for name in _SERVELAB_OPTIONAL}

    def cell(c: list[str], name: str) -> str:
        i = opt[name]
        return "" if i is None else c[i]

    def parse(c: list[str]) -> tuple:
        t = parse_number(c[it], label["time"])
        if t < 0:
            raise BadRow("negative arrival", f"arrival_s is {c[it].strip()!r}; arrivals are >= 0 s")
        tenant = cell(c, "tenant") or "default"
        if not tenant.isprintable():
            raise BadRow("invalid tenant", f"tenant {tenant!r} holds non-printable characters")
        priority = parse_int(cell(c, "priority"), "priority") if cell(c, "priority").strip() else 0
        slos = []
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            raw = cell(c, name).strip()
            v = parse_number(raw, name) if raw else None
            if v is not None and v <= 0:
                raise BadRow("invalid SLO", f"{name} is {raw!r}; SLOs are > 0 ms")
            slos.append(v)
        hashes, bs = _prefix(cell(c, "prefix_hashes"), cell(c, "prefix_block_size"))
        return (t, parse_length(c[ip], label["prompt"]), parse_length(c[io], label["output"]),
                hashes, bs, tenant, priority, slos[0], slos[1])
    return parse


def _prefix(hashes_cell: str, bs_cell: str) -> tuple[tuple[int, ...] | None, int | None]:
    words, bs_raw = hashes_cell.split(), bs_cell.strip()
    if not words and not bs_raw:
        return None, None
    if not words or not bs_raw:
        raise BadRow("invalid prefix hashes", "prefix_hashes and prefix_block_size must be given together")
    if not all(w.isdigit() and w.isascii() and len(w) <= 19 for w in words):
        raise BadRow("invalid prefix hashes", f"prefix_hashes {hashes_cell[:60]!r} is not space-separated "
                     "non-negative integers")
    hashes = tuple(int(w) for w in words)
    if max(hashes) > MAX_HASH:
        raise BadRow("invalid prefix hashes", f"prefix_hashes holds a value above {MAX_HASH}")
    return hashes, parse_length(bs_raw, "prefix_block_size")


def _json_row_parser(spec: TraceFormat) -> Callable:
    """A function line -> row tuple for a JSON-lines format: its keys for time, prompt and
    output, and Mooncake's `hash_ids` (512-token blocks) where a line has them."""
    time_key, prompt_key, output_key = (spec.columns[r] for r in ("time", "prompt", "output"))
    unit = {"ms": "milliseconds", "s": "seconds", "us": "microseconds"}.get(spec.time_unit, spec.time_unit)

    def parse(line: str) -> tuple:
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise BadRow("invalid JSON", f"not a JSON object ({str(exc)[:80]})") from None
        if type(obj) is not dict:
            raise BadRow("invalid JSON", f"expected a JSON object, found {type(obj).__name__}")
        t = obj.get(time_key)
        if type(t) not in (int, float) or not math.isfinite(t):
            raise BadRow("invalid field", f"{time_key} is {t!r}; expected a number of {unit}")
        prompt, out = _json_length(obj, prompt_key), _json_length(obj, output_key)
        hashes = obj.get("hash_ids")
        if hashes is not None:
            if (type(hashes) is not list or not hashes
                    or any(type(h) is not int or not 0 <= h <= MAX_HASH for h in hashes)):
                raise BadRow("invalid prefix hashes", "hash_ids must be a non-empty list of integers >= 0")
            hashes = tuple(hashes)
        bs = MOONCAKE_BLOCK_SIZE if hashes is not None else None
        return t, prompt, out, hashes, bs, "default", 0, None, None
    return parse


def _json_length(obj: dict, key: str) -> int:
    v = obj.get(key)
    if type(v) is float and math.isfinite(v) and v == int(v):
        v = int(v)
    if type(v) is not int:
        raise BadRow("invalid field", f"{key} is {v!r}; expected an integer token count")
    if v < 1:
        raise BadRow("non-positive length", f"{key} is {v}; token counts must be >= 1")
    if v > 2**31 - 1:
        raise BadRow("implausible length", f"{key} is {v}")
    return v


# ----------------------------------------------------------------------------- times
def _format_ns(ns: int) -> str:
    day, rest = divmod(ns, 86400 * NS)
    sec, frac = divmod(rest, NS)
    date = _dt.date.fromordinal(day)
    digits = f"{frac:09d}"
    return f"{date} {sec // 3600:02d}:{sec // 60 % 60:02d}:{sec % 60:02d}.{digits[:7] if frac % 100 == 0 else digits}"


def _time_shown(spec: TraceFormat) -> Callable:
    """How an error message shows a raw time of the format: a datetime as written, a
    number with its unit ("1.5 s", "1500 ms")."""
    if spec.time_unit == "datetime":
        return _format_ns
    unit = spec.time_unit
    return lambda t: f"{t} {unit}"
