"""Signs that a run's numbers do not mean what they seem to: rejections and their reasons,
and overload (arrivals outpacing service, so every latency depends on how long the run is).

    reasons = rejection_reasons(requests)          # [("prompt of N tokens ... KV cache", 2000)]
    warning = overload(requests)                   # None, or an `Overload` that says why

A stable system's queue comes and goes: even near full load it empties now and then, and
bursts of arrivals fill it for a while. An overloaded one never empties again once the
backlog builds, and its latencies are then set by the run's length, not by the policy.
The queue is read from the request records: a request waits from its arrival until it is
first scheduled (or rejected), so the count covers every replica of a cluster and both
pools of a disaggregated one (a per-step count of one replica's queue would miss a
prefill pool's backlog among its decode replicas' empty queues). Three signals:

- the waiting queue never emptied in the last quarter of the arrivals: its lowest value
  there is at least MIN_QUEUE_FLOOR requests (a burst of arrivals fills the queue for a
  while, which its mean or slope mistakes for growth; only a backlog keeps it from
  emptying for a quarter of the run);
- a backlog held for most of the arrivals: at least MIN_QUEUE_FLOOR requests waited,
  without a break, for LONG_BACKLOG_FRACTION of the arrival span or more, even if it
  drained before the end (what users feel: Llama-2-7B on an A100 under the whole
  azure-conv-2023 trace queues hundreds of requests for most of the hour and empties just
  before the last arrival);
- a backlog drained after the last arrival: MIN_QUEUE_FLOOR or more requests were still
  waiting when the last one arrived, and fewer than that were waiting only DRAIN_FRACTION
  of the arrival span or more later. (The run's length is no sign: a short run of a slow
  model, its queue empty throughout, lasts as long as its last requests take to decode; nor
  is a burst of arrivals in its last step, which the next steps take in.)

Cost: a sort of the requests' arrivals and first schedulings, O(requests log requests).
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from servelab.records import RequestRecord
from servelab.reports.columns import column, floats

MIN_QUEUE_FLOOR = 5
"""Requests that must wait throughout the last quarter of the arrivals for the queue to
count as never emptying (and at the last arrival, for a backlog left then to count):
one or two stragglers are not a backlog."""
DRAIN_FRACTION = 0.5
"""A backlog left at the last arrival that takes this share of the arrival span or more to
fall below MIN_QUEUE_FLOOR was drained after the arrivals ended."""
LONG_BACKLOG_FRACTION = 0.5
"""A backlog of MIN_QUEUE_FLOOR or more that lasts this share of the arrival span without
a break is overload, however it ends."""

_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def rejection_reasons(requests: Sequence[RequestRecord]) -> list[tuple[str, int]]:
    """Rejected requests grouped by reason, most first: (the first reason of the group, how
    many). Reasons that differ only in their numbers ("prompt of 812 tokens ..." and
    "prompt of 95 tokens ...") are one group."""
    counts: Counter = Counter()
    example: dict[str, str] = {}
    for status, reason in zip(column(requests, "status"), column(requests, "reject_reason")):
        if status == "rejected":
            reason = reason or "no reason recorded"
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

    queue_floor: int | None
    """The fewest requests waiting at any time of the last quarter of the arrivals, when
    that shows a backlog that never drains (else None)."""
    run_s: float
    """First arrival to last finish (or rejection)."""
    arrival_span_s: float
    drained: bool
    """A backlog was left at the last arrival and took DRAIN_FRACTION x the arrival span or
    more to fall below MIN_QUEUE_FLOOR (`clear_s`)."""
    backlog_s: float | None = None
    """The longest stretch of the arrivals during which MIN_QUEUE_FLOOR or more requests
    waited without a break, when it lasted LONG_BACKLOG_FRACTION of them (else None)."""
    peak_waiting: int = 0
    waiting_at_last: int = 0
    """Requests waiting right after the last arrival."""
    clear_s: float = 0.0
    """From the last arrival until fewer than MIN_QUEUE_FLOOR requests waited."""

    def evidence(self) -> str:
        """What was seen, in words ("the waiting queue never emptied ...")."""
        parts = []
        if self.queue_floor is not None:
            parts.append(f"the waiting queue never emptied over the last quarter of the arrivals (at least "
                         f"{self.queue_floor:,} requests waited throughout, counted from each request's "
                         "arrival to its first step)")
        if self.backlog_s is not None:
            parts.append(f"{MIN_QUEUE_FLOOR} or more requests waited without a break for "
                         f"{_secs(self.backlog_s)} s of the {_secs(self.arrival_span_s)} s of arrivals "
                         f"(up to {self.peak_waiting:,} at once)")
        if self.drained:
            parts.append(f"{self.waiting_at_last:,} requests were still waiting at the last of "
                         f"{_secs(self.arrival_span_s)} s of arrivals, and {_secs(self.clear_s)} s "
                         f"passed before fewer than {MIN_QUEUE_FLOOR} waited (the run lasted "
                         f"{_secs(self.run_s)} s)")
        return " and ".join(parts)

    def describe(self) -> str:
        return (f"overloaded: {self.evidence()}. Arrivals outpace service, so latencies grow "
                "with the run's length: a longer trace gives worse numbers.")


def overload(requests: Sequence[RequestRecord]) -> Overload | None:
    """An `Overload` when the records show arrivals outpacing service (see the module
    docstring), else None. Needs at least two distinct arrival times."""
    if not requests:
        return None
    arrivals = floats(requests, "arrival_s")
    first, last = float(arrivals.min()), float(arrivals.max())
    if last <= first:
        return None
    finish = floats(requests, "finish_s")
    end = float(finish[~np.isnan(finish)].max())
    times, waiting = waiting_queue(requests)
    inside = (times > first + 0.75 * (last - first)) & (times <= last)
    floor = queue_at(times, waiting, first + 0.75 * (last - first))
    if inside.any():
        floor = min(floor, int(waiting[inside].min()))
    never_empty = floor >= MIN_QUEUE_FLOOR
    backlog = longest_backlog_s(times, waiting, first, last)
    long_backlog = backlog >= LONG_BACKLOG_FRACTION * (last - first)
    at_last = queue_at(times, waiting, last)
    after = (times > last) & (waiting < MIN_QUEUE_FLOOR)
    clear = float(times[after][0]) - last if after.any() else end - last
    drained = at_last >= MIN_QUEUE_FLOOR and clear >= DRAIN_FRACTION * (last - first)
    if not (never_empty or long_backlog or drained):
        return None
    return Overload(queue_floor=floor if never_empty else None, run_s=end - first,
                    arrival_span_s=last - first, drained=drained,
                    backlog_s=backlog if long_backlog else None, peak_waiting=int(waiting.max()),
                    waiting_at_last=at_last, clear_s=clear)


def waiting_queue(requests: Sequence[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """The cluster's waiting queue as a step function: (times, requests waiting from each
    time until the next), one entry per distinct time at which it changed. A request waits
    from its arrival until it is first scheduled, or until it is rejected; one scheduled
    at the moment it arrived never waits."""
    arrivals = floats(requests, "arrival_s")
    leave = floats(requests, "scheduled_s").copy()
    unscheduled = np.isnan(leave)
    leave[unscheduled] = floats(requests, "finish_s")[unscheduled]
    leave = np.where(np.isnan(leave), np.inf, np.maximum(leave, arrivals))
    times = np.concatenate([leave, arrivals])
    deltas = np.concatenate([-np.ones(len(leave)), np.ones(len(arrivals))])
    order = np.lexsort((deltas, times))         # at one time, departures before arrivals
    times, counts = times[order], np.cumsum(deltas[order]).astype(np.int64)
    last_of_time = np.append(times[1:] != times[:-1], True)
    keep = last_of_time & np.isfinite(times)
    return times[keep], counts[keep]


def queue_at(times: np.ndarray, waiting: np.ndarray, t: float) -> int:
    """Requests waiting at time t (after every change at t)."""
    i = int(np.searchsorted(times, t, side="right")) - 1
    return int(waiting[i]) if i >= 0 else 0


def longest_backlog_s(times: np.ndarray, waiting: np.ndarray, first: float, last: float) -> float:
    """The longest stretch of [first, last] during which at least MIN_QUEUE_FLOOR requests
    waited throughout (from the change that made the backlog to the one that ended it)."""
    backlog = (waiting >= MIN_QUEUE_FLOOR).astype(np.int8)
    if not backlog.any():
        return 0.0
    change = np.diff(backlog, prepend=0, append=0)
    begins, ends = np.flatnonzero(change == 1), np.flatnonzero(change == -1)
    end_times = np.append(times, np.inf)[ends]
    spans = np.minimum(end_times, last) - np.maximum(times[begins], first)
    return float(max(spans.max(), 0.0))


def _secs(seconds: float) -> str:
    """Seconds for a sentence: whole above 10 s, one decimal down to 1 s, two significant
    digits down to a millisecond (a 0.043 s burst is not "0.0 s"), "< 0.001" below."""
    if seconds >= 10:
        return f"{seconds:,.0f}"
    if seconds >= 1:
        return f"{seconds:.1f}"
    return f"{seconds:.2g}" if seconds >= 1e-3 else "< 0.001"
