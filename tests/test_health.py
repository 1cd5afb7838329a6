"""Signs that a run's numbers mislead: rejection reasons grouped, and overload read from the
queue (a backlog that never empties, not a late burst) and from a long drain."""
from __future__ import annotations

from servelab.records import RequestRecord, StepRecord
from servelab.reports.health import MIN_QUEUE_FLOOR, format_reasons, overload, rejection_reasons


def _requests(n: int = 40, span: float = 100.0, drain: float = 1.0) -> list[RequestRecord]:
    out = []
    for i in range(n):
        t = span * i / (n - 1)
        out.append(RequestRecord(i, t, 10, 5, "finished", t, t + 0.1, t + 0.5 + (drain if i == n - 1 else 0.0)))
    return out


def _steps(waiting) -> list[StepRecord]:
    """One 1-second step per second, waiting[i] requests waiting during step i."""
    return [StepRecord(float(i), 1.0, 0, 1, 0, 1, int(w), 0, 1, 10) for i, w in enumerate(waiting)]


def test_a_queue_that_never_empties_late_is_overload_a_late_burst_is_not():
    backlog = [0] * 50 + [i for i in range(10, 60)]          # grows and never empties again
    burst = [0] * 90 + [40] * 10                              # a burst over the last tenth only
    bursty = [0 if i % 7 == 0 else 30 for i in range(100)]    # busy, but it empties now and then
    sign = overload(_requests(), _steps(backlog))
    assert sign is not None and sign.queue_floor == 35 and not sign.drained   # at 75 s, a quarter from the end
    assert "never emptied over the last quarter" in sign.describe()
    assert overload(_requests(), _steps(burst)) is None
    assert overload(_requests(), _steps(bursty)) is None
    assert overload(_requests(), _steps([MIN_QUEUE_FLOOR - 1] * 100)) is None


def test_a_long_backlog_that_drains_before_the_end_is_still_overload():
    """What users feel: a queue of hundreds for most of the arrivals, gone just before the
    last one (the queue-floor and drain signals both miss it)."""
    held = [0] * 10 + [300] * 70 + [0] * 20                   # 70 s of the 100 s of arrivals
    sign = overload(_requests(), _steps(held))
    assert sign is not None and sign.queue_floor is None and not sign.drained
    assert sign.backlog_s == 70.0 and sign.peak_waiting == 300
    assert "waited without a break for 70 s of the 100 s of arrivals (up to 300 at once)" in sign.evidence()
    short = [0] * 10 + [300] * 40 + [0] * 50                  # 40 s: a burst, not overload
    assert overload(_requests(), _steps(short)) is None
    broken = [0 if i % 30 == 0 else 300 for i in range(100)]  # empties every 30 s
    assert overload(_requests(), _steps(broken)) is None


def test_a_run_far_longer_than_its_arrivals_drained_a_backlog():
    sign = overload(_requests(drain=80.0), _steps([0] * 100))
    assert sign is not None and sign.drained and sign.queue_floor is None
    assert "took 180 simulated s for 100 s of arrivals" in sign.evidence()
    assert overload(_requests(drain=20.0), _steps([0] * 100)) is None


def test_rejection_reasons_group_alike_reasons_and_count_them():
    rejected = [RequestRecord(i, 0.0, 100 + i, 5, "rejected", finish_s=0.0,
                              reject_reason=f"prompt of {100 + i} tokens + 1 exceeds max_model_len 64")
                for i in range(3)]
    rejected.append(RequestRecord(9, 0.0, 5, 5, "rejected", finish_s=0.0, reject_reason="waiting queue full"))
    reasons = rejection_reasons([*rejected, *_requests(3)])
    assert reasons == [("prompt of 100 tokens + 1 exceeds max_model_len 64", 3), ("waiting queue full", 1)]
    assert format_reasons(reasons) == ("3 x prompt of 100 tokens + 1 exceeds max_model_len 64 (and alike); "
                                       "1 x waiting queue full")
