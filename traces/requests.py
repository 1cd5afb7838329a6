"""A trace's requests held as columns, each `Request` made when it is asked for.

A `Request` with its `Sequence` costs about 570 bytes: a million made up front hold 0.6 GB
for a whole simulation. `TraceRequests` keeps what a client sent in numpy columns (about
50 bytes a request) and makes request i on demand, so a simulation that makes each request
as it arrives, and lets it go once its record is out, holds only the requests in flight.

    requests = trace.requests(seed=0)   # a Sequence of Requests, in arrival order
    requests[i]                         # request i, a fresh object (no serving state)
    requests.arrival_s                  # the arrival column

Request i is the trace's record i with request_id = i and a sampling seed derived from
(seed, i), exactly what `Trace.to_requests` returns (which is `list(trace.requests(seed))`).
Iterating makes the requests a block of rows at a time; indexing makes one (a few µs).
"""
from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Iterator

import numpy as np

from servelab.request import Request

if TYPE_CHECKING:
    from servelab.traces.record import Trace

_ITER_ROWS = 4096
"""Rows turned into Python values at a time when iterating."""


class TraceRequests(Sequence):
    """The requests of a trace as columns (see the module docstring). The trace's records
    are not kept."""

    __slots__ = ("arrival_s", "seed", "_prompt", "_output", "_tenant", "_tenants", "_priority",
                 "_slo_ttft", "_slo_tpot", "_prefix_hashes", "_prefix_block_size")

    def __init__(self, trace: Trace, seed: int = 0) -> None:
        records = trace.records
        self.seed = seed
        self.arrival_s = _column([r.arrival_s for r in records], np.float64)
        """Arrival times (float64, sorted: a trace is in arrival order)."""
        self._prompt = _column([r.prompt_tokens for r in records], np.int64)
        self._output = _column([r.output_tokens for r in records], np.int64)
        self._priority = _column([r.priority for r in records], np.int64)
        names: dict[str, int] = {}
        self._tenant = np.array([names.setdefault(r.tenant, len(names)) for r in records], np.int32)
        self._tenants = list(names)
        self._slo_ttft = _column([math.nan if r.slo_ttft_ms is None else r.slo_ttft_ms
                                  for r in records], np.float64)
        self._slo_tpot = _column([math.nan if r.slo_tpot_ms is None else r.slo_tpot_ms
                                  for r in records], np.float64)
        # prefix hashes are rare and ragged: a list when some record has them
        hashes = [r.prefix_hashes for r in records]
        present = any(h is not None for h in hashes)
        self._prefix_hashes = hashes if present else None
        self._prefix_block_size = [r.prefix_block_size for r in records] if present else None

    def __len__(self) -> int:
        return len(self.arrival_s)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        i = operator.index(i)
        if not -n <= i < n:
            raise IndexError(f"request {i} of {n}")
        return next(self._requests(i % n, i % n + 1))

    def __iter__(self) -> Iterator[Request]:
        n = len(self)
        for start in range(0, n, _ITER_ROWS):
            yield from self._requests(start, min(start + _ITER_ROWS, n))

    def _requests(self, start: int, stop: int) -> Iterator[Request]:
        from servelab.traces.record import _request_seed

        rows = slice(start, stop)
        tenants, seed = self._tenants, self.seed
        hashes = self._prefix_hashes[rows] if self._prefix_hashes is not None else [None] * (stop - start)
        sizes = self._prefix_block_size[rows] if self._prefix_block_size is not None else hashes
        for i, arrival, prompt, output, priority, tenant, ttft, tpot, h, bs in zip(
                range(start, stop), self.arrival_s[rows].tolist(), self._prompt[rows].tolist(),
                self._output[rows].tolist(), self._priority[rows].tolist(),
                self._tenant[rows].tolist(), self._slo_ttft[rows].tolist(),
                self._slo_tpot[rows].tolist(), hashes, sizes):
            yield Request(i, arrival, prompt, output, priority=priority, tenant=tenants[tenant],
                          slo_ttft_ms=None if ttft != ttft else ttft,
                          slo_tpot_ms=None if tpot != tpot else tpot, prefix_hashes=h,
                          prefix_block_size=bs, seed=_request_seed(seed, i))


def _column(values: list, dtype) -> np.ndarray:
    """`values` as a numpy column of `dtype`, or of Python objects when an int does not fit
    64 bits (a trace record's ints are unbounded)."""
    try:
        return np.array(values, dtype=dtype)
    except OverflowError:
        return np.array(values, dtype=object)
