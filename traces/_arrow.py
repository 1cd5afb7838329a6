"""The bulk path for clean trace files: pyarrow's CSV and JSON readers.

Real trace files are clean, and per-row Python parsing costs 10-30 µs a row. Here pyarrow
reads the file in C++, every cell of the columns used is checked against the syntax the
row parser (`_rows`) accepts without trimming or rounding — plain decimals, digit lengths,
integer priorities — by regular expressions Arrow runs, and lengths, times and SLOs are
checked as whole columns. If anything is off — a line Arrow cannot split, a cell outside
that syntax, a zero length, an unsorted time, an impossible date, invalid UTF-8, a quote
or a lone carriage return anywhere, prefix hashes in a servelab file — the bulk path
returns None and the loader parses row by row, which finds the exact line and problem.
So the two paths agree on every file the bulk path accepts (property tests check it).

Both readers return the raw columns the row parser would: (times, prompts, outputs,
extra fields per row or None) in file order, as Python lists. Cost: about a second per
million rows, most of it turning columns into Python objects for the records.
"""
from __future__ import annotations

import functools
import re
from typing import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.json as pajson

from servelab.traces._rows import MAX_LENGTH, BadRow, parse_azure_ns
from servelab.traces.formats import TraceFormat

_DECIMAL = r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,4})?"
_SYNTAX = {  # the whole cell, per kind of column
    "length": r"[0-9]{1,10}", "decimal": _DECIMAL, "optional decimal": f"(?:{_DECIMAL})?",
    "azure time": r"[0-9]{4}-[0-9]{2}-[0-9]{2}[ T][0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]{1,9})?",
    "priority": r"(?:-?[0-9]{1,12})?", "text": ".*", "empty": "",
}
_SERVELAB_KINDS = {"arrival_s": "decimal", "prompt_tokens": "length", "output_tokens": "length",
                   "tenant": "text", "priority": "priority", "slo_ttft_ms": "optional decimal",
                   "slo_tpot_ms": "optional decimal",
                   "prefix_block_size": "empty", "prefix_hashes": "empty"}  # hashes: row by row
_NOT_AN_OBJECT = re.compile(rb"^[ \t]*[^{\s]", re.MULTILINE)
"""A non-blank line that does not open a JSON object. Such a file goes to the row parser
(which names the line): pyarrow 26.0.1's JSON reader crashes the process (SIGSEGV) on a
file whose first value is `null`, found by tests/test_traces_corruption.py."""


def _returns_memory(read):
    """Hand the memory Arrow freed back to the system when `read` is done: Arrow's allocator
    keeps freed blocks for reuse, about 80 MB after a million-row trace, which a simulation
    that follows would otherwise hold for nothing."""
    @functools.wraps(read)
    def wrapper(*args):
        try:
            return read(*args)
        finally:
            pa.default_memory_pool().release_unused()
    return wrapper


@_returns_memory
def csv_columns(data: bytes, names: list[str], roles: dict[str, str], fmt: TraceFormat):
    """The columns of a clean CSV trace of format `fmt` whose header (line 1) is `names`,
    or None.

    `roles` maps 'time', 'prompt', 'output' to column names (no 'time' for a length-only
    table). Datetimes (Azure's) come back as integer ns since 0001-01-01, other times as
    floats in the format's unit; a servelab file also gives its extra fields per row."""
    if b'"' in data or data.count(b"\r") != data.count(b"\r\n"):
        return None   # quoting and lone CRs are split differently by Arrow and the csv module
    kinds = {roles["prompt"]: "length", roles["output"]: "length"}
    if "time" in roles:
        kinds[roles["time"]] = "azure time" if fmt.time_unit == "datetime" else "decimal"
    if fmt.name == "servelab":
        kinds.update({n: _SERVELAB_KINDS[n.lower()] for n in names if n.lower() in _SERVELAB_KINDS})
    cells = _read_csv(data, names, kinds)
    if cells is None:
        return None
    prompts, outputs = _lengths(cells[roles["prompt"]]), _lengths(cells[roles["output"]])
    if prompts is None or outputs is None:
        return None
    if "time" not in roles:
        return None, prompts, outputs, None
    times = _azure_times(cells[roles["time"]]) if fmt.time_unit == "datetime" \
        else _seconds(cells[roles["time"]])
    if times is None or (fmt.name == "servelab" and len(times) and not times[0] >= 0):
        return None
    extras = None
    if fmt.name == "servelab":
        extras = _servelab_extras({n.lower(): c for n, c in cells.items()}, len(prompts))
        if extras is None:
            return None
    return times, prompts, outputs, extras


@_returns_memory
def json_columns(data: bytes, num_rows: int, keys: Mapping[str, str]):
    """(raw times, prompts, outputs, prefix hash tuples) of a clean JSON-lines file of
    `num_rows` non-blank lines whose `keys` map 'time', 'prompt' and 'output' to its keys
    (Mooncake's: timestamp, input_length, output_length) and whose every line has
    `hash_ids`, or None. Integer times only (Mooncake's milliseconds); anything else goes
    row by row."""
    if data.count(b"\r") != data.count(b"\r\n") or _NOT_AN_OBJECT.search(data):
        return None
    time_key, prompt_key, output_key = keys["time"], keys["prompt"], keys["output"]
    schema = pa.schema([(time_key, pa.int64()), (prompt_key, pa.int64()), (output_key, pa.int64()),
                        ("hash_ids", pa.list_(pa.int64()))])
    try:
        table = pajson.read_json(pa.py_buffer(data), parse_options=pajson.ParseOptions(
            explicit_schema=schema, unexpected_field_behavior="ignore"))
    except pa.ArrowInvalid:
        return None
    if table.num_rows != num_rows or any(c.null_count for c in table.columns):
        return None   # two objects on a line, or a field missing
    prompts, outputs = _in_range(table[prompt_key]), _in_range(table[output_key])
    times = table[time_key].to_numpy()
    hashes = table["hash_ids"]
    if prompts is None or outputs is None or not _sorted(times) or (
            num_rows and (pc.min(pc.list_value_length(hashes)).as_py() < 1
                          or pc.list_flatten(hashes).null_count
                          or pc.min(pc.list_flatten(hashes)).as_py() < 0)):
        return None   # (int64 parsing already keeps hashes <= MAX_HASH; a null hash is bad)
    return times.tolist(), prompts, outputs, list(map(tuple, hashes.to_pylist()))


# --- reading and checking columns -------------------------------------------------------

def _read_csv(data: bytes, names: list[str], kinds: dict[str, str]) -> dict | None:
    """{column: string column} for the columns in `kinds`, each cell in its kind's syntax."""
    try:
        table = pacsv.read_csv(pa.py_buffer(data), pacsv.ReadOptions(skip_rows=1, column_names=names),
                               convert_options=pacsv.ConvertOptions(
                                   include_columns=list(kinds), strings_can_be_null=False,
                                   column_types=dict.fromkeys(kinds, pa.string())))
    except pa.ArrowInvalid:
        return None
    cells = {}
    for name, kind in kinds.items():
        column = table[name]
        if kind != "text" and not pc.all(
                pc.match_substring_regex(column, f"^{_SYNTAX[kind]}$")).as_py():
            return None   # (an empty file, where all() is null, goes row by row too)
        cells[name] = column
    return cells


def _lengths(column: pa.ChunkedArray) -> list[int] | None:
    try:
        return _in_range(column.cast(pa.int64()))
    except pa.ArrowInvalid:
        return None


def _in_range(column: pa.ChunkedArray) -> list[int] | None:
    """A token-count column as ints, if all are in [1, MAX_LENGTH]."""
    values = column.to_numpy()
    if len(values) and (values.min() < 1 or values.max() > MAX_LENGTH):
        return None
    return values.tolist()


def _seconds(column: pa.ChunkedArray) -> list[float] | None:
    try:
        values = column.cast(pa.float64()).to_numpy()
    except pa.ArrowInvalid:   # beyond the float range
        return None
    if len(values) and not (np.isfinite(values).all() and _sorted(values)):
        return None
    return values.tolist()


def _azure_times(column: pa.ChunkedArray) -> list[int] | None:
    """Integer ns since 0001-01-01: each distinct whole second is parsed once by the row
    parser's own function (an hour-long trace has at most 3,600), the fraction per row."""
    seconds = pc.utf8_slice_codeunits(column, 0, 19).combine_chunks().dictionary_encode()
    days: dict = {}
    try:
        bases = [parse_azure_ns(stamp, "", days) for stamp in seconds.dictionary.to_pylist()]
    except BadRow:
        return None
    origin = min(bases, default=0)
    offsets = np.array([b - origin for b in bases], dtype=np.int64)
    fraction = pc.utf8_rpad(pc.utf8_slice_codeunits(column, 20, 29), 9, "0").cast(pa.int64())
    ns = offsets[seconds.indices.to_numpy()] + fraction.to_numpy()
    if not _sorted(ns):
        return None
    return [origin + t for t in ns.tolist()]


def _servelab_extras(cells: dict, n: int) -> list[tuple] | None:
    """(prefix hashes, block size, tenant, priority, slo_ttft_ms, slo_tpot_ms) per row."""
    tenants = ["default"] * n
    if "tenant" in cells:
        encoded = cells["tenant"].combine_chunks().dictionary_encode()
        words = [w or "default" for w in encoded.dictionary.to_pylist()]
        if not all(map(str.isprintable, words)):
            return None
        tenants = [words[i] for i in encoded.indices.to_numpy().tolist()]
    priorities = [0] * n
    if "priority" in cells:   # an empty cell is 0
        column = cells["priority"]
        priorities = pc.if_else(pc.equal(column, ""), "0", column).cast(pa.int64()).to_numpy().tolist()
    slos = []
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        values = [None] * n
        if name in cells:   # an empty cell is None
            column = cells[name]
            present_or_null = pc.if_else(pc.equal(column, ""), pa.scalar(None, pa.string()), column)
            array = present_or_null.cast(pa.float64()).to_numpy(zero_copy_only=False)   # NaN for None
            present = array[~np.isnan(array)]
            if len(present) and not (present.min() > 0 and np.isfinite(present.max())):
                return None
            values = array.tolist()
            if len(present) < n:
                values = [None if v != v else v for v in values]
        slos.append(values)
    return [(None, None, t, p, a, b) for t, p, a, b in zip(tenants, priorities, *slos)]


def _sorted(values: np.ndarray) -> bool:
    return bool((values[1:] >= values[:-1]).all())

