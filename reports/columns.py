"""The columns of per-request and per-step records as numpy arrays, checked: what
`reports.metrics` computes on. A bad value raises ValueError naming the record and the
field ("request 12: times must satisfy arrival_s <= ...").

Cost: a `RecordTable` (what a simulation returns and the run-file readers give) hands its
columns over as they are; a list of records costs one pass per column through
`map(attrgetter)` into numpy (about 0.1 s per million records each). The checks are
vectorised.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from operator import attrgetter

import numpy as np

from servelab.record_table import RecordTable, describe_record, stored_fields
from servelab.records import RequestRecord

REQUEST_STATUSES = ("finished", "rejected")


class RequestArrays:
    """Columns of the request records as numpy arrays (None -> NaN), checked for consistency.

    Building them is the only per-record Python work in `summarize()`: one pass per column
    (about 0.1 s per million records each), then the checks are vectorised.
    """

    def __init__(self, requests: Sequence[RequestRecord]) -> None:
        self.requests = requests
        statuses = column(requests, "status")
        unknown = set(statuses).difference(REQUEST_STATUSES)
        if unknown:
            bad = np.array([s in unknown for s in statuses])
            got = statuses[int(bad.argmax())]
            self._fail(bad, f"status must be one of {REQUEST_STATUSES}, got {got!r}")
        self.finished = finished_mask(statuses)
        self.tenants = column(requests, "tenant")
        if not all(isinstance(t, str) for t in set(self.tenants)):
            bad = np.array([not isinstance(t, str) for t in self.tenants])
            self._fail(bad, "tenant must be a string")
        self.arrival = floats(requests, "arrival_s")
        self.scheduled = floats(requests, "scheduled_s")
        self.first_token = floats(requests, "first_token_s")
        self.finish = floats(requests, "finish_s")
        self.slo_ttft = floats(requests, "slo_ttft_ms")
        self.slo_tpot = floats(requests, "slo_tpot_ms")
        self.prompt_tokens = ints(requests, "prompt_tokens")
        self.output_tokens = ints(requests, "output_tokens")
        self.num_preemptions = ints(requests, "num_preemptions")
        self.n = ints(requests, "n")
        self._check()

    def _check(self) -> None:
        fin = self.finished
        with np.errstate(invalid="ignore"):  # NaN compares False; NaN is checked first
            checks = (
                (~np.isfinite(self.arrival), "arrival_s must be a finite number"),
                (self.prompt_tokens < 0, "prompt_tokens must be >= 0"),
                (self.output_tokens < 0, "output_tokens must be >= 0"),
                (self.num_preemptions < 0, "num_preemptions must be >= 0"),
                (self.n < 1, "n must be >= 1"),
                (self.slo_ttft < 0, "slo_ttft_ms must be >= 0"),
                (self.slo_tpot < 0, "slo_tpot_ms must be >= 0"),
                (fin & (self.output_tokens < 1),
                 "a finished request must have output_tokens >= 1"),
                (fin & ~(np.isfinite(self.scheduled) & np.isfinite(self.first_token)
                         & np.isfinite(self.finish)),
                 "a finished request needs finite scheduled_s, first_token_s and finish_s"),
                (fin & ~((self.arrival <= self.scheduled) & (self.scheduled <= self.first_token)
                         & (self.first_token <= self.finish)),
                 "times must satisfy arrival_s <= scheduled_s <= first_token_s <= finish_s"),
            )
        for bad, what in checks:
            if bad.any():
                self._fail(bad, what)

    def _fail(self, bad: np.ndarray, what: str) -> None:
        raise ValueError(f"{describe_record(self.requests, int(np.argmax(bad)))}: {what}")


def is_number(x: object) -> bool:
    return is_real(x) and not math.isnan(x)


def column(records: Sequence, name: str) -> list:
    """One field of every record, as a list (None where a table holds no such field)."""
    if isinstance(records, RecordTable):
        if name not in records.columns:
            return [None] * len(records)
        values = records.column(name).tolist()
        if stored_fields(records.record_type)[name] == "int | None":   # held as float64
            return [None if v != v else int(v) for v in values]
        return [None if v != v else v for v in values] if any(v != v for v in values) else values
    return list(map(attrgetter(name), records))


def finished_mask(records_or_statuses: Sequence) -> np.ndarray:
    """True where a request finished: of records, or of their `status` column."""
    statuses = records_or_statuses
    if len(statuses) and not isinstance(statuses[0], str):
        statuses = column(records_or_statuses, "status")
    return np.fromiter(map("finished".__eq__, statuses), dtype=bool, count=len(statuses))


def floats(records: Sequence, name: str) -> np.ndarray:
    """One float column; None becomes NaN."""
    if isinstance(records, RecordTable):
        return records.column(name)   # read-only, no copy
    try:  # fast path: no None, no intermediate list
        return np.fromiter(map(attrgetter(name), records), dtype=float, count=len(records))
    except (TypeError, ValueError):
        pass
    values = column(records, name)
    if values.count(None) == len(values):
        return np.full(len(values), math.nan)
    try:
        return np.array(values, dtype=float)
    except (TypeError, ValueError):
        i = next((i for i, v in enumerate(values) if v is not None and not is_real(v)), 0)
        raise ValueError(f"{describe_record(records, i)}: {name} must be a number or None, "
                         f"got {values[i]!r}") from None


def ints(records: Sequence, name: str) -> np.ndarray:
    """One integer column (counts, exact below 2**53); a non-integral value is an error."""
    if isinstance(records, RecordTable):
        return records.column(name)
    try:
        values = np.fromiter(map(attrgetter(name), records), dtype=float, count=len(records))
    except (TypeError, ValueError):
        values = np.full(len(records), math.nan)
    integral = np.isfinite(values) & (values == np.floor(values))
    if not integral.all():
        cells = column(records, name)
        i = next((i for i, v in enumerate(cells) if isinstance(v, bool) or not isinstance(v, int)),
                 int(np.argmin(integral)))
        raise ValueError(f"{describe_record(records, i)}: {name} must be an integer, got {cells[i]!r}")
    return values.astype(np.int64)


def is_real(x: object) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)
