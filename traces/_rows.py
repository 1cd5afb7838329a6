"""Row-level machinery shared by the loaders: reading lines, parsing cells, bad-row policy.

Parsing is strict on purpose: a cell is a length only if it is plain ASCII digits (or an
integral decimal such as `12.0`), a time only if it looks like a decimal number. Python's
own `int()`/`float()` would also take `1_000`, Unicode digits, `nan` or `inf`, which in a
trace file are corruption, not data.
"""
from __future__ import annotations

import csv
import datetime as _dt
import math
import re
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Callable

from servelab.traces.record import RowIssue, TraceError, TraceFormatError

ON_BAD_ROW = ("error", "drop")
MAX_LENGTH = 2**31 - 1
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,4})?", re.ASCII)
AZURE_TIME = re.compile(r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?", re.ASCII)
NS = 10**9
_NON_FINITE = frozenset({"nan", "+nan", "-nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"})


class BadRow(Exception):
    """Raised by a row parser; the loader turns it into an error or a counted drop."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def read_lines(data: bytes) -> list[str | None]:
    """The file's lines (index 0 = line 1) without line terminators; None marks a line that
    is not valid UTF-8. A leading BOM is ignored; CRLF and LF both work."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        if data.startswith(b"\xef\xbb\xbf"):
            data = data[3:]
        out: list[str | None] = []
        for raw in data.split(b"\n"):
            try:
                out.append(raw.decode("utf-8").removesuffix("\r"))
            except UnicodeDecodeError:
                out.append(None)
        return out
    if "\r\n" in text:
        text = text.replace("\r\n", "\n")
    return text.split("\n")


def split_cells(line: str) -> list[str]:
    """Comma-separated cells; lines with quotes go through the csv module (one line only)."""
    if '"' not in line:
        return line.split(",")
    try:
        return next(csv.reader([line]))
    except (csv.Error, StopIteration) as exc:
        raise BadRow("malformed quoting", f"cannot split the line into cells ({exc})") from None


def parse_number(cell: str, column: str) -> float:
    """A finite decimal number (a time or an SLO)."""
    s = cell.strip()
    if _NUMBER.fullmatch(s):
        v = float(s)
        if v != math.inf and v != -math.inf:
            return v
    if s.lower() in _NON_FINITE or _NUMBER.fullmatch(s):
        raise BadRow("non-finite value", f"{column} is {cell!r}, not a finite number")
    raise BadRow("non-numeric value", f"{column} is {cell!r}, not a number")


def parse_int(cell: str, column: str) -> int:
    """An integer cell (digits, or an integral decimal like `12.0`)."""
    s = cell.strip()
    if s.isdigit() and s.isascii() and len(s) <= 12:
        return int(s)
    v = parse_number(s, column)
    if v != int(v):
        raise BadRow("non-integer value", f"{column} is {cell!r}, not an integer")
    return int(v)


def parse_length(cell: str, column: str) -> int:
    """A token count: an integer in [1, 2**31 - 1]."""
    s = cell.strip()
    if s.isdigit() and s.isascii() and len(s) <= 10:
        v = int(s)
    else:
        v = parse_int(s, column)
    if v < 1:
        raise BadRow("non-positive length", f"{column} is {cell.strip()!r}; token counts must be >= 1")
    if v > MAX_LENGTH:
        raise BadRow("implausible length", f"{column} is {cell.strip()!r}, above {MAX_LENGTH}")
    return v


def parse_azure_ns(cell: str, column: str, days: dict) -> int:
    """'2023-11-16 18:17:03.9799600' -> integer nanoseconds since 0001-01-01 (exact)."""
    m = AZURE_TIME.fullmatch(cell.strip())
    if m is None:
        raise BadRow("invalid timestamp", f"{column} is {cell[:40]!r}; expected YYYY-MM-DD HH:MM:SS[.fffffff]")
    y, mo, d, hh, mm, ss, frac = m.groups()
    day = days.get((y, mo, d))
    if day is None:
        try:
            day = days[(y, mo, d)] = _dt.date(int(y), int(mo), int(d)).toordinal()
        except ValueError:
            raise BadRow("invalid timestamp", f"{column} is {cell.strip()!r}, not a calendar date") from None
    h, mi, s = int(hh), int(mm), int(ss)
    if h > 23 or mi > 59 or s > 59:
        raise BadRow("invalid timestamp", f"{column} is {cell.strip()!r}, not a time of day")
    ns = int(frac.ljust(9, "0")) if frac else 0
    return ((day * 86400 + h * 3600 + mi * 60 + s) * NS) + ns


@dataclass
class RowSink:
    """Applies the bad-row policy: raise at the first bad row, or drop and count it by reason."""

    path: str
    on_bad_row: str
    issues: dict[str, list] = field(default_factory=dict)  # reason -> [count, example]

    def __post_init__(self) -> None:
        if self.on_bad_row not in ON_BAD_ROW:
            raise TraceError(f"on_bad_row must be one of {ON_BAD_ROW}, got {self.on_bad_row!r}")

    def bad(self, line: int, reason: str, detail: str) -> None:
        if self.on_bad_row == "error":
            raise TraceFormatError(self.path, line, f"{reason}: {detail}")
        self.count(line, reason, detail)

    def count(self, line: int, reason: str, detail: str) -> None:
        """Record a dropped row whatever the policy (e.g. a failed request in BurstGPT)."""
        entry = self.issues.get(reason)
        if entry is None:
            self.issues[reason] = [1, f"line {line}: {detail}"]
        else:
            entry[0] += 1

    def report(self) -> tuple[RowIssue, ...]:
        return tuple(RowIssue(reason, n, example) for reason, (n, example) in self.issues.items())


def enforce_order(rows: list[tuple], sink: RowSink, show: Callable[[object], str]) -> list[tuple]:
    """Keep rows whose time (element 1; element 0 is the line number) never decreases.

    In error mode the first decrease raises. In drop mode the longest non-decreasing
    subsequence is kept (O(n log n)), so one corrupted far-future timestamp costs one row,
    not every row after it.
    """
    if all(rows[i][1] <= rows[i + 1][1] for i in range(len(rows) - 1)):
        return rows
    if sink.on_bad_row == "error":
        for prev, row in zip(rows, rows[1:]):
            if row[1] < prev[1]:
                sink.bad(row[0], "out-of-order timestamp",
                         f"time {show(row[1])} comes before {show(prev[1])} on line {prev[0]}")
    # Patience sorting over the rows in reverse, on negated times: among equally long runs
    # this keeps the earliest rows, so the row reported is the one that breaks the order.
    tails: list = []          # tails[k]: best (negated) end of a kept run of length k + 1
    tail_index: list[int] = []
    back = [-1] * len(rows)
    for i in range(len(rows) - 1, -1, -1):
        key = -rows[i][1]
        k = bisect_right(tails, key)
        if k == len(tails):
            tails.append(key)
            tail_index.append(i)
        else:
            tails[k] = key
            tail_index[k] = i
        back[i] = tail_index[k - 1] if k else -1
    keep = [False] * len(rows)
    i = tail_index[-1]
    while i >= 0:
        keep[i] = True
        i = back[i]
    kept = []
    for row, ok in zip(rows, keep):
        if ok:
            kept.append(row)
        else:
            sink.bad(row[0], "out-of-order timestamp",
                     f"time {show(row[1])} breaks the arrival order of the rows around it")
    return kept
