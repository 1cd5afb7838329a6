"""The canonical request record every trace source is turned into, and the `Trace` holding them.

A `TraceRecord` is what a client sent, nothing about how it was served: when it arrived
(seconds from the trace start), how long its prompt and output are, optional prefix block
hashes (for prefix-caching studies), who sent it and with what priority and SLOs. A `Trace`
is an arrival-ordered tuple of records plus provenance: where it came from, how many source
rows were dropped or clipped and why. Nothing is ever dropped or changed silently: every
loader and transform that does so adds a `RowIssue`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Iterator

from servelab.request import Request

if TYPE_CHECKING:
    from servelab.traces.requests import TraceRequests


MAX_HASH = 2**63 - 1
"""Prefix hash ids are non-negative signed 64-bit integers."""


class TraceError(ValueError):
    """A trace could not be read or built as asked (bad argument, missing dataset, ...)."""


class NeedsRateError(TraceError):
    """A length-only table (no timestamps) was loaded without a request rate to draw its
    arrivals from; `servelab trace stats` catches it to show the lengths anyway."""


class TraceFormatError(TraceError):
    """A trace file is malformed; names the file, the line (1-based, header = line 1) and the problem."""

    def __init__(self, path: str, line: int | None, problem: str) -> None:
        self.path = str(path)
        self.line = line
        self.problem = problem
        where = f"{self.path}, line {line}" if line is not None else self.path
        super().__init__(f"{where}: {problem}")


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a trace. Lengths are token counts >= 1; arrival_s is >= 0."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_hashes: tuple[int, ...] | None = None
    """Hash ids of the prompt's consecutive `prefix_block_size`-token blocks; equal ids at
    the same position mean equal content (e.g. Mooncake's `hash_ids` over 512-token blocks)."""
    prefix_block_size: int | None = None
    tenant: str = "default"
    priority: int = 0
    """Lower value is served first (vLLM's convention)."""
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None

    def __post_init__(self) -> None:
        # Inline type checks: this runs once per row of every loaded trace.
        a, p, o = self.arrival_s, self.prompt_tokens, self.output_tokens
        if not (type(a) is float or type(a) is int) or not 0 <= a < math.inf:
            raise ValueError(f"arrival_s must be a finite number >= 0, got {a!r}")
        if type(p) is not int or p < 1:
            raise ValueError(f"prompt_tokens must be an int >= 1, got {p!r}")
        if type(o) is not int or o < 1:
            raise ValueError(f"output_tokens must be an int >= 1, got {o!r}")
        if self.prefix_hashes is not None or self.prefix_block_size is not None:
            self._check_prefix()
        if type(self.tenant) is not str or not self.tenant or not self.tenant.isprintable():
            raise ValueError(f"tenant must be a non-empty printable string, got {self.tenant!r}")
        if type(self.priority) is not int:
            raise ValueError(f"priority must be an int, got {self.priority!r}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            v = getattr(self, name)
            if v is not None and (type(v) not in (int, float) or not 0 < v < math.inf):
                raise ValueError(f"{name} must be a finite number > 0 or None, got {v!r}")

    def _check_prefix(self) -> None:
        hashes, bs = self.prefix_hashes, self.prefix_block_size
        if type(bs) is not int or bs < 1:
            raise ValueError(f"prefix_block_size must be an int >= 1 when prefix_hashes is given, got {bs!r}")
        if type(hashes) is not tuple or not hashes:
            raise ValueError(f"prefix_hashes must be a non-empty tuple of ints when "
                             f"prefix_block_size is given, got {hashes!r}")
        if set(map(type, hashes)) != {int} or min(hashes) < 0 or max(hashes) > MAX_HASH:  # C-speed checks
            raise ValueError(f"prefix_hashes must hold ints in [0, 2**63), got {hashes!r}")


@dataclass(frozen=True, slots=True)
class RowIssue:
    """A kind of problem found in a trace's rows: what, how often, and the first occurrence."""

    reason: str
    """Short category, e.g. 'non-numeric value' or 'prompt clipped to max_model_len 8192'."""
    count: int
    example: str
    """The first occurrence in full, e.g. "line 17: ContextTokens is 'abc', not an integer"."""


def merge_issues(*groups: tuple[RowIssue, ...]) -> tuple[RowIssue, ...]:
    """Combine issue lists, summing counts per reason and keeping the first example."""
    merged: dict[str, RowIssue] = {}
    for group in groups:
        for issue in group:
            seen = merged.get(issue.reason)
            merged[issue.reason] = issue if seen is None else replace(seen, count=seen.count + issue.count)
    return tuple(merged.values())


def _request_seed(seed: int, index: int) -> int:
    """A per-request sampling seed: splitmix64 of (seed, index), kept below 2**62 so that
    `seed + sample_index` still fits a signed 64-bit generator seed."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 2


@dataclass(frozen=True)
class Trace:
    """Arrival-ordered records plus where they came from and what was dropped or clipped.

    `source_rows` is the number of data rows in the source file (None when generated):
    as loaded, `len(records) + num_dropped == source_rows`; cuts such as `first_n` keep
    `source_rows` and say what they removed in `notes`.
    """

    records: tuple[TraceRecord, ...]
    source: str = "<memory>"
    format: str = "servelab"
    source_rows: int | None = None
    dropped: tuple[RowIssue, ...] = ()
    clipped: tuple[RowIssue, ...] = ()
    """Why requests were clipped, one count per reason: a request clipped twice (prompt and
    output) counts under each."""
    clipped_requests: int = 0
    """Requests clipped for any reason (each once)."""
    notes: tuple[str, ...] = field(default=())
    """Provenance, one line each: time origin, arrival process and seed, transforms applied."""

    def __post_init__(self) -> None:
        if not isinstance(self.records, tuple):
            object.__setattr__(self, "records", tuple(self.records))
        if self.clipped and not self.clipped_requests:      # one request per issue counted
            object.__setattr__(self, "clipped_requests", sum(i.count for i in self.clipped))
        recs = self.records
        for i in range(1, len(recs)):
            if recs[i].arrival_s < recs[i - 1].arrival_s:
                raise ValueError(f"trace records must be in arrival order: record {i} arrives at "
                                 f"{recs[i].arrival_s} s, before record {i - 1} at {recs[i - 1].arrival_s} s")

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[TraceRecord]:
        return iter(self.records)

    @property
    def num_dropped(self) -> int:
        return sum(i.count for i in self.dropped)

    @property
    def num_clipped(self) -> int:
        """Requests clipped, each once whatever the reasons."""
        return self.clipped_requests

    @property
    def span_s(self) -> float:
        """Last arrival minus first arrival (0 for fewer than two records)."""
        return self.records[-1].arrival_s - self.records[0].arrival_s if len(self.records) > 1 else 0.0

    @property
    def mean_rate(self) -> float | None:
        """Requests per second as rows / (last - first arrival); None when the span is 0."""
        span = self.span_s
        return len(self.records) / span if span > 0 else None

    def with_records(self, records, *, note: str | None = None, clipped: tuple[RowIssue, ...] = (),
                     clipped_requests: int = 0) -> "Trace":
        """A copy holding `records`, with a provenance note and extra clipping issues (of
        `clipped_requests` more requests) appended."""
        return replace(self, records=tuple(records),
                       clipped=merge_issues(self.clipped, clipped) if clipped else self.clipped,
                       clipped_requests=self.clipped_requests + clipped_requests,
                       notes=self.notes + ((note,) if note else ()))

    def requests(self, seed: int = 0) -> "TraceRequests":
        """The requests of this trace as columns, each `Request` made when asked for
        (`traces/requests.py`): request_id = index, and a sampling seed derived from
        (seed, index), so a replay is reproducible and requests do not share random streams."""
        from servelab.traces.requests import TraceRequests
        return TraceRequests(self, seed)

    def to_requests(self, seed: int = 0) -> list[Request]:
        """Fresh `Request`s, all made now: `list(self.requests(seed))`."""
        return list(self.requests(seed))
