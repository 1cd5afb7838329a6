"""Signs that a run's numbers mislead: rejection reasons grouped, and overload read from the
queue the request records imply (a backlog that never empties, not a late burst) and from
a backlog drained after the last arrival."""
from __future__ import annotations

import pytest

from servelab.records import RequestRecord
from servelab.reports.health import (MIN_QUEUE_FLOOR, format_reasons, overload, queue_at,
                                     rejection_reasons, waiting_queue)


def _requests(waits=lambda t: 0.0, n: int = 401, span: float = 100.0,
              drain: float = 1.0) -> list[RequestRecord]:
    """n requests a quarter second apart over `span` s, request i waiting waits(arrival)
    seconds before it is first scheduled; the last finishes `drain` s after it arrives."""
    out = []
    for i in range(n):
        t = span * i / (n - 1)
        s = t + waits(t)
        out.append(RequestRecord(i, t, 10, 5, "finished", s, s + 0.1,
                                 max(s + 0.5, t + drain) if i == n - 1 else s + 0.5))
    return out


def test_a_queue_that_never_empties_late_is_overload_a_late_burst_is_not():
    backlog = lambda t: 0.0 if t < 50 else 0.2 * (t - 50)     # waits grow: the queue does too
    burst = lambda t: 5.0 if 90 <= t < 92 else 0.0            # two seconds' arrivals held up
    bursty = lambda t: 0.0 if int(t) % 7 == 0 else 7 - t % 7  # busy, but it empties now and then
    sign = overload(_requests(backlog))
    assert sign is not None and sign.queue_floor is not None and not sign.drained
    assert sign.queue_floor >= 10                              # 25 s in: 5 s waits
    assert "never emptied over the last quarter" in sign.describe()
    assert overload(_requests(burst)) is None
    assert overload(_requests(bursty)) is None
    few = lambda t: 0.25 * (MIN_QUEUE_FLOOR - 1) - 0.01       # always MIN_QUEUE_FLOOR - 1 waiting
    assert overload(_requests(few)) is None


def test_a_long_backlog_that_drains_before_the_end_is_still_overload():
    """What users feel: a queue of dozens for most of the arrivals, gone just before the
    last one (the queue-floor and drain signals both miss it)."""
    held = lambda t: 10.0 if 10 <= t < 70 else 0.0            # 60 s of arrivals wait 10 s each
    sign = overload(_requests(held))
    assert sign is not None and sign.queue_floor is None and not sign.drained
    assert sign.backlog_s == 67.75 and sign.peak_waiting == 40  # 11.0 s (5 waiting) to 78.75 s (4)
    assert "waited without a break for 68 s of the 100 s of arrivals (up to 40 at once)" in sign.evidence()
    short = lambda t: 10.0 if 10 <= t < 50 else 0.0           # 40 s: a burst, not overload
    assert overload(_requests(short)) is None
    broken = lambda t: 10.0 if t % 30 < 15 else 0.0           # empties every 30 s
    assert overload(_requests(broken)) is None


def test_a_run_far_longer_than_its_arrivals_drained_a_backlog_an_empty_queue_did_not():
    late = lambda t: 0.0 if t < 95 else 80.0                   # the last 5 s wait 80 s each
    sign = overload(_requests(late))
    assert sign is not None and sign.drained and sign.queue_floor is None
    assert ("21 requests were still waiting at the last of 100 s of arrivals, and 79 s passed before "
            "fewer than 5 waited (the run lasted 180 s)") in sign.evidence()
    # the same length, but nothing waits: the last request's own decode is long (a slow
    # model, a short run), which is no backlog
    assert overload(_requests(drain=80.0)) is None
    short = overload(_requests(lambda t: 0.0 if t < 3 else 80.0, span=4.0, n=17))
    assert short.evidence() == ("5 requests were still waiting at the last of 4.0 s of arrivals, and "
                                "79 s passed before fewer than 5 waited (the run lasted 84 s)")
    # a burst in the last step, taken in by the next steps while the last requests decode
    # for 10 s: the run lasts 3x its arrivals, but no backlog was drained
    step = _requests(lambda t: 1.0 if t >= 4.0 else 0.0, span=5.0, n=41, drain=10.0)
    times, waiting = waiting_queue(step)
    assert queue_at(times, waiting, 5.0) == 8 and max(r.finish_s for r in step) == 15.0
    assert overload(step) is None


def test_the_queue_counts_every_replica_and_rejections_leave_it():
    """Requests of two replicas (or of a prefill and a decode pool): the queue is the
    cluster's, read from each request's arrival and first scheduling."""
    backlog = lambda t: 0.0 if t < 50 else 0.2 * (t - 50)
    two = [RequestRecord(r.request_id, r.arrival_s, 10, 5, "finished", r.scheduled_s,
                         r.first_token_s, r.finish_s) for r in _requests(backlog)]
    assert overload(two[::2] + two[1::2]) is not None          # any order
    rejected = [RequestRecord(i, 0.25 * i, 10, 0, "rejected", finish_s=0.25 * i)
                for i in range(401)]
    assert overload(rejected) is None                           # rejected at once: never waited


def test_rejection_reasons_group_alike_reasons_and_count_them():
    rejected = [RequestRecord(i, 0.0, 100 + i, 5, "rejected", finish_s=0.0,
                              reject_reason=f"prompt of {100 + i} tokens + 1 exceeds max_model_len 64")
                for i in range(3)]
    rejected.append(RequestRecord(9, 0.0, 5, 5, "rejected", finish_s=0.0, reject_reason="waiting queue full"))
    reasons = rejection_reasons([*rejected, *_requests(n=3)])
    assert reasons == [("prompt of 100 tokens + 1 exceeds max_model_len 64", 3), ("waiting queue full", 1)]
    assert format_reasons(reasons) == ("3 x prompt of 100 tokens + 1 exceeds max_model_len 64 (and alike); "
                                       "1 x waiting queue full")


@pytest.mark.parametrize("seconds, text", [(0.043, "0.043"), (0.25, "0.25"), (3.14, "3.1"), (68.2, "68"),
                                           (1234.0, "1,234"), (5e-5, "< 0.001")])
def test_seconds_in_a_sentence_keep_two_digits_below_a_second(seconds, text):
    from servelab.reports.health import _secs

    assert _secs(seconds) == text
