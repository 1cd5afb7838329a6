"""Signs that a run's numbers do not mean what they seem to: rejections and their reasons,
and overload (arrivals outpacing service, so every latency depends on how long the run is).

    reasons = rejection_reasons(requests)          # [("prompt of N tokens ... KV cache", 2000)]
    warning = overload(requests, steps)            # None, or an `Overload` that says why

A stable system's queue settles at a level that depends on the load; an overloaded one
grows for as long as requests arrive, and its latencies are then set by the run's length,
not by the policy. Both signals below are read from the records alone:

- the waiting queue still grows in the last half of the arrivals (a least-squares slope
  over QUEUE_WINDOWS windows of that half, time-weighted by step duration);
- the run lasts far longer than its arrivals (simulated span / arrival span above
  DRAIN_RATIO): a backlog was drained after the last arrival.

Cost: one pass over the step records (numpy), O(steps + requests).
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from servelab.records import RequestRecord, StepRecord

QUEUE_WINDOWS = 4
"""Windows over the last half of the arrival span in which the mean queue is taken."""
MIN_QUEUE_GROWTH = 5.0
GROWTH_SHARE = 0.25
"""The queue counts as growing when the trend over that half gains more than
MIN_QUEUE_GROWTH requests and more than GROWTH_SHARE of the half's mean queue: a handful
of waiting requests, or a wobble around a high but steady level, is not a trend."""
DRAIN_RATIO = 1.5
"""A run longer than this many times its arrival span drained a backlog."""

_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def rejection_reasons(requests: Sequence[RequestRecord]) -> list[tuple[str, int]]:
    """Rejected requests grouped by reason, most first: (the first reason of the group, how
    many). Reasons that differ only in their numbers ("prompt of 812 tokens ..." and
    "prompt of 95 tokens ...") are one group."""
    counts: Counter = Counter()
    example: dict[str, str] = {}
    for r in requests:
        if r.status == "rejected":
            reason = r.reject_reason or "no reason recorded"
            kind = _NUMBER.sub("N", reason)
            example.setdefault(kind, reason)
            counts[kind] += 1
    return sorted(((example[k], n) for k, n in counts.items()), key=lambda item: (-item[1], item[0]))


def format_reasons(reasons: Sequence[tuple[str, int]]) -> str:
    """'1,995 x prompt of 812 tokens + 1 can never fit ... (and alike); 5 x waiting queue full'."""
    return "; ".join(f"{n:,} x {why}" + (" (and alike)" if n > 1 and _NUMBER.search(why) else "")
                     for why, n in reasons)


@dataclass(frozen=True)
class Overload:
    """Why a run looks overloaded, in words and numbers."""

    queue_start: float
    """Mean waiting requests in the first window of the last half of the arrivals."""
    queue_end: float
    """... and in its last window."""
    queue_growing: bool
    run_s: float
    """First arrival to last finish (or rejection)."""
    arrival_span_s: float
    drained: bool
    """The run lasted more than DRAIN_RATIO x the arrival span."""

    def evidence(self) -> str:
        """What was seen, in words ("the waiting queue grew from 3 to 40 requests ...")."""
        parts = []
        if self.queue_growing:
            parts.append(f"the waiting queue grew from {self.queue_start:,.0f} to {self.queue_end:,.0f} "
                         "requests over the second half of the arrivals")
        if self.drained:
            parts.append(f"the run took {self.run_s:,.0f} simulated s for {self.arrival_span_s:,.0f} s of "
                         "arrivals")
        return " and ".join(parts)

    def describe(self) -> str:
        return (f"overloaded: {self.evidence()}. Arrivals outpace service, so latencies grow "
                "with the run's length: a longer trace gives worse numbers.")


def overload(requests: Sequence[RequestRecord], steps: Sequence[StepRecord]) -> Overload | None:
    """An `Overload` when the records show arrivals outpacing service (see the module
    docstring), else None. Needs at least two distinct arrival times."""
    if not requests or not steps:
        return None
    arrivals = np.fromiter((r.arrival_s for r in requests), float, len(requests))
    first, last = float(arrivals.min()), float(arrivals.max())
    if last <= first:
        return None
    end = max(r.finish_s for r in requests if r.finish_s is not None)
    start = np.fromiter((s.start_s for s in steps), float, len(steps))
    duration = np.fromiter((s.duration_s for s in steps), float, len(steps))
    waiting = np.fromiter((s.num_waiting for s in steps), float, len(steps))
    edges = np.linspace((first + last) / 2, last, QUEUE_WINDOWS + 1)
    means = window_means(start, duration, waiting, edges)
    growing = False
    if np.isfinite(means).sum() >= 2:
        centres = ((edges[:-1] + edges[1:]) / 2)[np.isfinite(means)]
        slope = np.polyfit(centres, means[np.isfinite(means)], 1)[0]
        gain = slope * (last - first) / 2
        growing = bool(gain > max(MIN_QUEUE_GROWTH, GROWTH_SHARE * np.nanmean(means)))
    drained = (end - first) > DRAIN_RATIO * (last - first)
    if not (growing or drained):
        return None
    finite = means[np.isfinite(means)]
    return Overload(float(finite[0]) if len(finite) else 0.0, float(finite[-1]) if len(finite) else 0.0,
                    growing, end - first, last - first, drained)


def window_means(start: np.ndarray, duration: np.ndarray, values: np.ndarray,
                 edges: np.ndarray) -> np.ndarray:
    """Mean of `values` over the steps that start in each window [edges[i], edges[i+1]),
    weighted by step duration (NaN for a window with no step of positive duration)."""
    index = np.searchsorted(edges, start, side="right") - 1
    inside = (index >= 0) & (index < len(edges) - 1)
    weight = np.bincount(index[inside], weights=duration[inside], minlength=len(edges) - 1)
    total = np.bincount(index[inside], weights=(duration * values)[inside], minlength=len(edges) - 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(weight > 0, total / weight, np.nan)
