"""Pure transformations of a `Trace`: rate scaling, cuts, length clipping, tenant/priority rules, merging.

Each returns a new `Trace` and appends a provenance note; clipping also adds counted
`RowIssue`s, so `trace stats` shows how much a run's input differs from the source.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Sequence

from servelab._validate import check_bounded
from servelab.traces.record import RowIssue, Trace, TraceError, TraceRecord, merge_issues


def _positive(name: str, value) -> float:
    """`value` if it is a finite number > 0 (the range checked and worded by
    `servelab._validate`, as the command line's `number` parser does), else a TraceError."""
    check_bounded(name, value, 0, lo_open=True, error=TraceError)
    return value


def _count(name: str, value) -> int:
    """`value` if it is an int >= 0, else a TraceError."""
    check_bounded(name, value, 0, integer=True, error=TraceError)
    return value


def scale_rate(trace: Trace, factor: float) -> Trace:
    """Replay at `factor`× speed: every arrival time divided by `factor` (2 = twice the rate)."""
    _positive("factor", factor)
    return trace.with_records((replace(r, arrival_s=r.arrival_s / factor) for r in trace.records),
                              note=f"replayed at {factor:g}x speed")


def with_rate(trace: Trace, req_per_s: float) -> Trace:
    """Rescale time so that the mean rate, rows / (last - first arrival), is `req_per_s`."""
    _positive("req_per_s", req_per_s)
    rate = trace.mean_rate
    if rate is None:
        raise TraceError(f"cannot rescale {trace.source} to {req_per_s:g} req/s: it needs at least "
                         "two requests at different times")
    factor = req_per_s / rate
    out = scale_rate(trace, factor)
    return replace(out, notes=out.notes[:-1] + (f"rescaled to {req_per_s:g} req/s (x{factor:.4g} from {rate:.4g})",))


def time_window(trace: Trace, start_s: float, end_s: float | None = None) -> Trace:
    """Requests arriving in [start_s, end_s), re-based so that start_s becomes 0."""
    check_bounded("start_s", start_s, 0, error=TraceError)
    if end_s is not None and not end_s > start_s:
        raise TraceError(f"end_s must be > start_s ({start_s}), got {end_s!r}")
    end = math.inf if end_s is None else end_s
    kept = (replace(r, arrival_s=r.arrival_s - start_s) for r in trace.records if start_s <= r.arrival_s < end)
    return trace.with_records(kept, note=f"window [{start_s:g}, {end:g}) s, re-based to 0")


def first_n(trace: Trace, n: int) -> Trace:
    """The first `n` requests."""
    _count("n", n)
    if n >= len(trace.records):
        return trace.with_records(trace.records, note=f"all {len(trace.records)} requests "
                                                      f"(fewer than the {n} asked for)")
    return trace.with_records(trace.records[:n], note=f"first {n} requests")


def clip_lengths(trace: Trace, max_model_len: int | None = None, *, max_prompt_tokens: int | None = None,
                 max_output_tokens: int | None = None) -> Trace:
    """Clip lengths so each request fits, counting every clipped request by reason.

    With `max_model_len` L, a prompt is cut to L - 1 tokens (room for one output token) and
    the output to L - prompt. Prefix hashes are cut to the blocks the shorter prompt covers.
    """
    limits = {"max_model_len": max_model_len, "max_prompt_tokens": max_prompt_tokens,
              "max_output_tokens": max_output_tokens}
    for name, v in limits.items():
        if v is not None:
            check_bounded(name, v, 2 if name == "max_model_len" else 1, integer=True, error=TraceError)
    issues: dict[str, list] = {}

    def note(reason: str, i: int, before: int, after: int, what: str) -> None:
        entry = issues.setdefault(reason, [0, f"request {i}: {what} {before} -> {after} tokens"])
        entry[0] += 1

    out = []
    for i, r in enumerate(trace.records):
        p, o = r.prompt_tokens, r.output_tokens
        caps = [(max_prompt_tokens, f"prompt clipped to {max_prompt_tokens} tokens"),
                (max_model_len - 1 if max_model_len else None, f"prompt clipped to fit max_model_len {max_model_len}")]
        for cap, reason in caps:
            if cap is not None and p > cap:
                note(reason, i, p, cap, "prompt")
                p = cap
        caps = [(max_output_tokens, f"output clipped to {max_output_tokens} tokens"),
                (max_model_len - p if max_model_len else None, f"output clipped to fit max_model_len {max_model_len}")]
        for cap, reason in caps:
            if cap is not None and o > cap:
                note(reason, i, o, cap, "output")
                o = cap
        if (p, o) == (r.prompt_tokens, r.output_tokens):
            out.append(r)
            continue
        hashes = r.prefix_hashes
        if hashes is not None and p != r.prompt_tokens:
            hashes = hashes[:-(-p // r.prefix_block_size)]
        out.append(replace(r, prompt_tokens=p, output_tokens=o, prefix_hashes=hashes))
    shown = ", ".join(f"{k}={v}" for k, v in limits.items() if v is not None)
    changed = sum(a is not b for a, b in zip(out, trace.records))
    clipped = tuple(RowIssue(reason, n, example) for reason, (n, example) in issues.items())
    return trace.with_records(out, note=f"lengths clipped ({shown}): {changed} requests", clipped=clipped,
                              clipped_requests=changed)


# ----------------------------------------------------------------------------- tenants and priorities
@dataclass(frozen=True)
class Assignment:
    """What a rule sets on a request; None keeps the request's current value."""

    tenant: str | None = None
    priority: int | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None

    def __post_init__(self) -> None:
        if self.tenant is not None and (not isinstance(self.tenant, str) or not self.tenant
                                        or not self.tenant.isprintable()):
            raise TraceError(f"Assignment.tenant must be a non-empty printable string, got {self.tenant!r}")
        if self.priority is not None:
            check_bounded("Assignment.priority", self.priority, integer=True, error=TraceError)
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            if getattr(self, name) is not None:
                _positive(f"Assignment.{name}", getattr(self, name))

    def apply(self, r: TraceRecord) -> TraceRecord:
        changes = {k: v for k, v in (("tenant", self.tenant), ("priority", self.priority),
                                     ("slo_ttft_ms", self.slo_ttft_ms), ("slo_tpot_ms", self.slo_tpot_ms))
                   if v is not None}
        return replace(r, **changes) if changes else r

    def __str__(self) -> str:
        return ",".join(f"{k}={v}" for k, v in vars(self).items() if v is not None) or "unchanged"


def assign_by_length(trace: Trace, threshold: int, *, short: Assignment, long: Assignment,
                     by: str = "prompt") -> Trace:
    """`long` for requests whose prompt (or output, by='output') has >= threshold tokens, else `short`."""
    if by not in ("prompt", "output"):
        raise TraceError(f"by must be 'prompt' or 'output', got {by!r}")
    _positive("threshold", threshold)
    attr = "prompt_tokens" if by == "prompt" else "output_tokens"
    recs = (long.apply(r) if getattr(r, attr) >= threshold else short.apply(r) for r in trace.records)
    return trace.with_records(recs, note=f"assigned by {by} length: < {threshold} -> {short}; >= {threshold} -> {long}")


def assign_round_robin(trace: Trace, assignments: Sequence[Assignment]) -> Trace:
    """Request i gets assignments[i % len(assignments)]."""
    if not assignments:
        raise TraceError("assign_round_robin needs at least one assignment")
    k = len(assignments)
    recs = (assignments[i % k].apply(r) for i, r in enumerate(trace.records))
    return trace.with_records(recs, note=f"assigned round-robin over {'; '.join(map(str, assignments))}")


def assign_random(trace: Trace, assignments: Sequence[Assignment], weights: Sequence[float] | None = None,
                  seed: int = 0) -> Trace:
    """Each request independently gets one assignment, drawn with `weights` from a seeded stream."""
    if not assignments:
        raise TraceError("assign_random needs at least one assignment")
    if weights is not None:
        if len(weights) != len(assignments) or any(not w >= 0 for w in weights) or not sum(weights) > 0:
            raise TraceError("weights must be one non-negative number per assignment, not all zero")
    rng = random.Random(seed)
    picks = rng.choices(range(len(assignments)), weights=weights, k=len(trace.records))
    recs = (assignments[j].apply(r) for j, r in zip(picks, trace.records))
    return trace.with_records(recs, note=f"assigned at random (seed={seed}, weights={list(weights or [])}) over "
                                         f"{'; '.join(map(str, assignments))}")


def merge(*traces: Trace, source: str | None = None) -> Trace:
    """One trace of all requests in arrival order (ties: earlier argument first). Use the
    assignment rules first to tell the sources apart, e.g. as tenants."""
    if not traces:
        raise TraceError("merge needs at least one trace")
    records = sorted((r for t in traces for r in t.records), key=lambda r: r.arrival_s)
    rows = [t.source_rows for t in traces]
    return Trace(tuple(records), source=source or " + ".join(t.source for t in traces), format="merged",
                 source_rows=None if None in rows else sum(rows),
                 dropped=merge_issues(*(t.dropped for t in traces)),
                 clipped=merge_issues(*(t.clipped for t in traces)),
                 notes=tuple(f"[{t.source}] {n}" for t in traces for n in t.notes) + (f"merged {len(traces)} traces",))
