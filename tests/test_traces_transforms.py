"""Trace transformations: rate scaling, cuts, clipping (counted), tenant/priority rules, merging."""
from __future__ import annotations

import pytest

from servelab.traces.loaders import load_trace
from servelab.traces.record import RowIssue, Trace, TraceError, TraceRecord
from servelab.traces.transforms import (Assignment, assign_by_length, assign_random, assign_round_robin,
                                        clip_lengths, first_n, merge, scale_rate, time_window, with_rate)


def _trace(times=(0.0, 1.0, 2.0, 4.0), prompts=(10, 20, 30, 40), **kw):
    return Trace(tuple(TraceRecord(t, p, 5) for t, p in zip(times, prompts)), source="t", **kw)


def test_scale_rate_and_with_rate():
    t = _trace()
    fast = scale_rate(t, 2.0)
    assert [r.arrival_s for r in fast] == [0.0, 0.5, 1.0, 2.0]
    assert fast.notes[-1] == "replayed at 2x speed"
    assert [r.prompt_tokens for r in fast] == [10, 20, 30, 40]
    assert with_rate(t, 10.0).mean_rate == pytest.approx(10.0)
    assert "rescaled to 10 req/s" in with_rate(t, 10.0).notes[-1]
    with pytest.raises(TraceError, match="at least two requests at different times"):
        with_rate(_trace(times=(3.0, 3.0), prompts=(1, 1)), 2.0)
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(TraceError):
            scale_rate(t, bad)


def test_with_rate_on_a_real_trace(traces_dir):
    trace = load_trace(traces_dir / "splitwise_code.csv")
    for rate in (1.0, 12.5):
        assert with_rate(trace, rate).mean_rate == pytest.approx(rate, rel=1e-12)


def test_time_window_and_first_n():
    t = _trace(times=(0.0, 1.0, 2.0, 4.0, 6.0), prompts=(1, 2, 3, 4, 5))
    w = time_window(t, 1.0, 4.0)
    assert [(r.arrival_s, r.prompt_tokens) for r in w] == [(0.0, 2), (1.0, 3)]
    assert [r.prompt_tokens for r in time_window(t, 2.0)] == [3, 4, 5]
    assert [r.prompt_tokens for r in first_n(t, 2)] == [1, 2] and len(first_n(t, 0)) == 0
    with pytest.raises(TraceError):
        time_window(t, 3.0, 3.0)
    with pytest.raises(TraceError):
        first_n(t, -1)


def test_clip_lengths_counts_and_reports_every_clipped_request():
    recs = (TraceRecord(0.0, 14050, 39, tuple(range(28)), 512), TraceRecord(1.0, 100, 9000),
            TraceRecord(2.0, 100, 50), TraceRecord(3.0, 8191, 5))
    t = Trace(recs, source="x", clipped=(RowIssue("older", 1, "line 2"),))
    c = clip_lengths(t, 8192)
    assert [(r.prompt_tokens, r.output_tokens) for r in c] == [(8191, 1), (100, 8092), (100, 50), (8191, 1)]
    assert c.records[0].prefix_hashes == tuple(range(16))
    assert c.records[2] is recs[2]
    assert [(i.reason, i.count, i.example) for i in c.clipped] == [
        ("older", 1, "line 2"),
        ("prompt clipped to fit max_model_len 8192", 1, "request 0: prompt 14050 -> 8191 tokens"),
        ("output clipped to fit max_model_len 8192", 3, "request 0: output 39 -> 1 tokens")]
    # request 0 is clipped twice (prompt and output) but counted once: 1 older + 3
    assert c.num_clipped == 4 and c.notes[-1] == "lengths clipped (max_model_len=8192): 3 requests"
    caps = clip_lengths(t, max_prompt_tokens=1000, max_output_tokens=64)
    assert [(r.prompt_tokens, r.output_tokens) for r in caps] == [(1000, 39), (100, 64), (100, 50), (1000, 5)]
    with pytest.raises(TraceError):
        clip_lengths(t, 1)


def test_assignment_rules():
    t = _trace(prompts=(10, 2000, 30, 5000))
    short, long = Assignment(tenant="chat", priority=0, slo_ttft_ms=300.0), Assignment(tenant="batch", priority=2)
    by_len = assign_by_length(t, 1000, short=short, long=long)
    assert [(r.tenant, r.priority, r.slo_ttft_ms) for r in by_len] == [
        ("chat", 0, 300.0), ("batch", 2, None), ("chat", 0, 300.0), ("batch", 2, None)]
    assert "< 1000 -> tenant=chat,priority=0,slo_ttft_ms=300.0" in by_len.notes[-1]
    rr = assign_round_robin(t, [Assignment(tenant="a"), Assignment(tenant="b", priority=1), Assignment()])
    assert [(r.tenant, r.priority) for r in rr] == [("a", 0), ("b", 1), ("default", 0), ("a", 0)]
    big = _trace(times=tuple(float(i) for i in range(4000)), prompts=(5,) * 4000)
    rnd = assign_random(big, [Assignment(tenant="x"), Assignment(tenant="y")], weights=[3, 1], seed=9)
    share = sum(r.tenant == "x" for r in rnd) / len(rnd)
    assert share == pytest.approx(0.75, abs=0.03)
    again = assign_random(big, [Assignment(tenant="x"), Assignment(tenant="y")], weights=[3, 1], seed=9)
    assert again.records == rnd.records
    for bad in (lambda: Assignment(tenant=""), lambda: Assignment(priority=1.5), lambda: assign_round_robin(t, []),
                lambda: assign_random(t, [Assignment()], weights=[0]), lambda: assign_by_length(t, 5, short=short,
                                                                                               long=long, by="x")):
        with pytest.raises(TraceError):
            bad()


def test_merge_orders_by_time_and_combines_metadata():
    a = Trace((TraceRecord(0.0, 1, 1, tenant="a"), TraceRecord(2.0, 1, 1, tenant="a")), source="A", source_rows=3,
              dropped=(RowIssue("missing column", 1, "line 4"),))
    b = Trace((TraceRecord(1.0, 2, 2, tenant="b"), TraceRecord(2.0, 2, 2, tenant="b")), source="B", source_rows=2)
    m = merge(a, b)
    assert [(r.arrival_s, r.tenant) for r in m] == [(0.0, "a"), (1.0, "b"), (2.0, "a"), (2.0, "b")]
    assert m.source == "A + B" and m.source_rows == 5 and m.num_dropped == 1
    assert len(m) + m.num_dropped == m.source_rows
