"""The trace file formats `load_trace` reads: one registry, by name.

A format says which columns of a file's header hold a request's arrival time, prompt tokens
and output tokens, and in which unit its times are written. The built-in ones, each as
published (`../shared/traces/README.md` describes the files):

| format     | columns (header, any case)                             | time                     |
|------------|--------------------------------------------------------|--------------------------|
| azure      | TIMESTAMP, ContextTokens, GeneratedTokens              | datetime, 7 fractional digits |
| splitwise  | arrived_at, num_prefill_tokens, num_decode_tokens      | seconds                  |
| mooncake   | a JSON object per line (timestamp, input_length, ...)  | milliseconds             |
| lengths    | num_prefill_tokens, num_decode_tokens (no time column) | drawn: rate, cv, seed    |
| burstgpt   | Timestamp, Model, Request tokens, Response tokens      | seconds                  |
| servelab   | arrival_s, prompt_tokens, output_tokens [, ...]        | seconds, kept verbatim   |

A file's format is detected from its first line (`detect`): the format whose columns the
header holds, the one with the most columns when several do (a length table's two columns
are also in a Splitwise header), ties to the first registered; two formats of the very
same columns (say one in ms, one in s) make a header ambiguous, an error. `--trace-format`,
`load_trace(format=...)` and detection read this registry, so a new CSV format is one
`register_trace_format(TraceFormat(...))` where it is defined (docs/extending.md): the
loader reads its time, prompt and output columns as it reads Splitwise's. What a built-in
format carries beyond those three (Azure's datetimes, BurstGPT's model column and failed
requests, servelab's tenants, priorities and SLOs, Mooncake's prefix hash ids) its own
reader in `loaders.py` reads. Standard library only: the command line imports it to list
the names.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from servelab.registry import Registry

ROLES = ("time", "prompt", "output", "model")
"""What a column may hold: arrival time, prompt tokens, output tokens, the model served."""
TIME_UNITS = {"s": 1, "ms": 1_000, "us": 1_000_000, "datetime": 1_000_000_000}
"""Raw time units per second: a datetime (YYYY-MM-DD HH:MM:SS[.fraction], Azure's) is read
as integer nanoseconds, so that relative times are exact to its 100 ns resolution."""


@dataclass(frozen=True)
class TraceFormat:
    """One trace file format (see the module docstring)."""

    name: str
    columns: Mapping[str, str]
    """Role (`ROLES`) -> the column holding it, as the header names it in lower case (for a
    JSON-lines format, the key). 'prompt' and 'output' are required; without 'time' the
    file is a length-only table, whose arrivals are drawn at a given rate."""
    time_unit: str = "s"
    """Unit of the time column (`TIME_UNITS`)."""
    keeps_times: bool = False
    """Times are kept as written (servelab's own format); otherwise they are re-based so
    that the first kept request arrives at 0 s."""
    json_lines: bool = False
    """One JSON object per line (Mooncake's layout) instead of a CSV with a header."""
    description: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "columns", MappingProxyType(dict(self.columns)))   # read-only
        if not isinstance(self.name, str) or not self.name or self.name == "auto":
            raise ValueError(f"a trace format name must be a non-empty string other than "
                             f"'auto', got {self.name!r}")
        unknown = sorted(set(self.columns) - set(ROLES))
        if unknown:
            raise ValueError(f"trace format {self.name!r}: unknown column role(s) "
                             f"{', '.join(unknown)}; roles are {', '.join(ROLES)}")
        missing = [role for role in ("prompt", "output") if role not in self.columns]
        if missing:
            raise ValueError(f"trace format {self.name!r} needs a column for {' and '.join(missing)}")
        if any(not isinstance(c, str) or not c or c != c.strip().lower() for c in self.columns.values()):
            raise ValueError(f"trace format {self.name!r}: columns are non-empty lower-case "
                             f"names without surrounding spaces, got {dict(self.columns)}")
        if len(set(self.columns.values())) < len(self.columns):
            raise ValueError(f"trace format {self.name!r}: each role needs its own column, got "
                             f"{dict(self.columns)}")
        if self.time_unit not in TIME_UNITS:
            raise ValueError(f"trace format {self.name!r}: time_unit must be one of "
                             f"{', '.join(TIME_UNITS)}, got {self.time_unit!r}")
        if self.json_lines and (not self.has_times or self.time_unit == "datetime"):
            raise ValueError(f"trace format {self.name!r}: a JSON-lines format needs a time "
                             "key holding numbers (time_unit s, ms or us)")

    @property
    def has_times(self) -> bool:
        """False for a length-only table (arrivals are drawn)."""
        return "time" in self.columns

    @property
    def units_per_s(self) -> int:
        return TIME_UNITS[self.time_unit]


TRACE_FORMATS: Registry[TraceFormat] = Registry("trace format")


def register_trace_format(fmt: TraceFormat) -> TraceFormat:
    """Add a format under its name; a name taken by another format is an error."""
    return TRACE_FORMATS.add(fmt.name, fmt)


def trace_format_names() -> list[str]:
    """In the order they were registered."""
    return TRACE_FORMATS.names()


def get_trace_format(name: str) -> TraceFormat:
    """The registered format `name`; an unknown name is a ValueError listing the known."""
    return TRACE_FORMATS.get(name)


def detect(header: str) -> TraceFormat | None:
    """The format of a file whose first non-blank line is `header`, or None: a JSON
    object is the JSON-lines format's; a CSV header is the format whose columns it
    holds, the most specific one if several do, ties to the first registered."""
    head = header.strip()
    if head.startswith("{"):
        return next((f for _, f in TRACE_FORMATS.items() if f.json_lines), None)
    names = {c.strip().lower() for c in head.split(",")}
    best = None
    for _, fmt in TRACE_FORMATS.items():
        if not fmt.json_lines and set(fmt.columns.values()) <= names \
                and (best is None or len(fmt.columns) > len(best.columns)):
            best = fmt
    if best is not None:
        same = [f.name for _, f in TRACE_FORMATS.items()
                if f is not best and not f.json_lines and set(f.columns.values()) == set(best.columns.values())]
        if same:   # e.g. one in ms, one in s: which is meant, the header cannot say
            raise ValueError(f"the header's columns are those of trace formats {best.name!r} and "
                             f"{', '.join(map(repr, same))}, which read them differently: "
                             f"name one with --trace-format")
    return best


register_trace_format(TraceFormat(
    "azure", {"time": "timestamp", "prompt": "contexttokens", "output": "generatedtokens"},
    time_unit="datetime", description="Azure LLM inference traces (2023, 2024)"))
register_trace_format(TraceFormat(
    "splitwise", {"time": "arrived_at", "prompt": "num_prefill_tokens", "output": "num_decode_tokens"},
    description="Vidur's copy of the Azure traces, in relative seconds"))
register_trace_format(TraceFormat(
    "mooncake", {"time": "timestamp", "prompt": "input_length", "output": "output_length"},
    time_unit="ms", json_lines=True, description="Mooncake (FAST'25), with prefix hash_ids"))
register_trace_format(TraceFormat(
    "lengths", {"prompt": "num_prefill_tokens", "output": "num_decode_tokens"},
    description="prompt and output lengths without arrivals (Vidur, Etalon)"))
register_trace_format(TraceFormat(
    "burstgpt", {"time": "timestamp", "model": "model", "prompt": "request tokens",
                 "output": "response tokens"},
    description="BurstGPT, failed requests logged with 0 response tokens"))
register_trace_format(TraceFormat(
    "servelab", {"time": "arrival_s", "prompt": "prompt_tokens", "output": "output_tokens"},
    keeps_times=True, description="servelab's own (`canonical.py`): tenants, priorities, SLOs, "
                                  "prefix hashes"))
