"""TraceRecord / Trace invariants, Trace.to_requests, and the canonical CSV round trip."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.request import Request
from servelab.traces.canonical import columns_for, to_csv_text, write_csv
from servelab.traces.loaders import load_trace
from servelab.traces.record import RowIssue, Trace, TraceRecord, merge_issues


def test_record_is_frozen_with_slots_and_defaults():
    r = TraceRecord(1.5, 10, 20)
    assert (r.tenant, r.priority, r.prefix_hashes, r.slo_ttft_ms) == ("default", 0, None, None)
    assert not hasattr(r, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.prompt_tokens = 3


@pytest.mark.parametrize("kwargs, words", [
    (dict(arrival_s=-1.0), "arrival_s"),
    (dict(arrival_s=float("nan")), "arrival_s"),
    (dict(arrival_s=float("inf")), "arrival_s"),
    (dict(prompt_tokens=0), "prompt_tokens"),
    (dict(output_tokens=-3), "output_tokens"),
    (dict(prompt_tokens=2.0), "prompt_tokens"),
    (dict(prefix_hashes=(1, 2)), "prefix_block_size"),
    (dict(prefix_block_size=16), "prefix_hashes"),
    (dict(prefix_hashes=(), prefix_block_size=16), "prefix_hashes"),
    (dict(prefix_hashes=(1, -2), prefix_block_size=16), "prefix_hashes"),
    (dict(tenant=""), "tenant"),
    (dict(tenant="a\nb"), "tenant"),
    (dict(priority=1.5), "priority"),
    (dict(slo_ttft_ms=0.0), "slo_ttft_ms"),
    (dict(slo_tpot_ms=float("nan")), "slo_tpot_ms"),
])
def test_record_rejects_bad_fields(kwargs, words):
    base = dict(arrival_s=0.0, prompt_tokens=1, output_tokens=1)
    with pytest.raises(ValueError, match=words):
        TraceRecord(**{**base, **kwargs})


def test_trace_requires_arrival_order_and_reports_counts():
    recs = (TraceRecord(0.0, 1, 1), TraceRecord(2.0, 1, 1), TraceRecord(2.0, 1, 1), TraceRecord(4.0, 1, 1))
    issues = (RowIssue("non-numeric value", 2, "line 3: x"), RowIssue("missing column", 1, "line 9: y"))
    t = Trace(list(recs), source_rows=7, dropped=issues)
    assert isinstance(t.records, tuple) and len(t) == 4 and list(t) == list(recs)
    assert t.num_dropped == 3 and t.span_s == 4.0 and t.mean_rate == 1.0
    assert Trace((TraceRecord(1.0, 1, 1),)).mean_rate is None
    with pytest.raises(ValueError, match="arrival order: record 1"):
        Trace((TraceRecord(3.0, 1, 1), TraceRecord(1.0, 1, 1)))


def test_merge_issues_sums_by_reason_and_keeps_first_example():
    a = (RowIssue("x", 2, "line 3"), RowIssue("y", 1, "line 4"))
    b = (RowIssue("x", 5, "line 9"), RowIssue("z", 1, "line 1"))
    assert merge_issues(a, b) == (RowIssue("x", 7, "line 3"), RowIssue("y", 1, "line 4"), RowIssue("z", 1, "line 1"))


def test_to_requests_maps_fields_ids_and_derives_distinct_deterministic_seeds():
    recs = [TraceRecord(0.5, 100, 7, (3, 4), 64, "alice", 2, 500.0, 50.0), TraceRecord(1.25, 9, 1)]
    trace = Trace(recs + [TraceRecord(2.0, 5, 5)] * 50)
    reqs = trace.to_requests(seed=3)
    assert all(isinstance(r, Request) for r in reqs)
    assert [r.request_id for r in reqs] == list(range(len(trace)))
    r0 = reqs[0]
    assert (r0.arrival_s, r0.prompt_len, r0.output_len, r0.max_tokens) == (0.5, 100, 7, 7)
    assert (r0.tenant, r0.priority, r0.slo_ttft_ms, r0.slo_tpot_ms) == ("alice", 2, 500.0, 50.0)
    assert (r0.prefix_hashes, r0.prefix_block_size) == ((3, 4), 64)
    seeds = [r.seed for r in reqs]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**62 for s in seeds)
    assert seeds == [r.seed for r in trace.to_requests(seed=3)]
    assert seeds != [r.seed for r in trace.to_requests(seed=4)]
    assert reqs[1].tenant == "default" and reqs[1].prefix_hashes is None


def test_trace_requests_make_each_request_on_demand_as_to_requests_does():
    recs = [TraceRecord(0.5, 100, 7, (3, 4), 64, "alice", 2, 500.0, 50),
            TraceRecord(1, 9, 1, priority=2**70)]
    trace = Trace(recs + [TraceRecord(2.0 + i, 5, 5, tenant="bob") for i in range(9000)])
    lazy = trace.requests(seed=3)
    assert len(lazy) == len(trace) and lazy.arrival_s.dtype.kind == "f"
    fields = [f.name for f in dataclasses.fields(Request) if f.name != "seqs"]
    listed = trace.to_requests(seed=3)
    for i in (0, 1, 2, 4096, len(trace) - 1, -1):
        assert [getattr(lazy[i], f) for f in fields] == [getattr(listed[i], f) for f in fields]
    assert [(r.request_id, r.seed, r.tenant) for r in lazy] == \
        [(r.request_id, r.seed, r.tenant) for r in listed]
    assert lazy[0] is not lazy[0]                       # fresh every time: replays
    assert type(lazy[1].arrival_s) is float and lazy[1].priority == 2**70
    assert (lazy[0].slo_tpot_ms, lazy[1].slo_ttft_ms, lazy[1].prefix_hashes) == (50.0, None, None)
    assert [r.request_id for r in lazy[2:8:3]] == [2, 5]
    with pytest.raises(IndexError):
        lazy[len(trace)]


def test_canonical_csv_writes_only_the_column_groups_in_use():
    plain = Trace((TraceRecord(0.0, 5, 6), TraceRecord(0.1, 7, 8)))
    assert columns_for(plain) == ("arrival_s", "prompt_tokens", "output_tokens")
    assert to_csv_text(plain) == "arrival_s,prompt_tokens,output_tokens\n0.0,5,6\n0.1,7,8\n"
    full = Trace((TraceRecord(0.0, 5, 6, (1, 2), 4, "t,x", -1, 250.0, None), TraceRecord(1.0, 3, 2)))
    text = to_csv_text(full)
    assert text.splitlines()[0] == ("arrival_s,prompt_tokens,output_tokens,tenant,priority,"
                                    "slo_ttft_ms,slo_tpot_ms,prefix_block_size,prefix_hashes")
    assert text.splitlines()[1] == '0.0,5,6,"t,x",-1,250.0,,4,1 2'
    assert text.splitlines()[2] == "1.0,3,2,default,0,,,,"


_tenants = st.text(st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp")), min_size=1, max_size=8).filter(
    str.isprintable)


@st.composite
def _records(draw):
    n = draw(st.integers(1, 12))
    times = sorted(draw(st.lists(st.floats(0, 1e7, allow_nan=False), min_size=n, max_size=n)))
    out = []
    for t in times:
        bs = draw(st.one_of(st.none(), st.integers(1, 1024)))
        hashes = None if bs is None else tuple(draw(st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=5)))
        out.append(TraceRecord(t, draw(st.integers(1, 2**31 - 1)), draw(st.integers(1, 10**6)), hashes, bs,
                               draw(st.one_of(st.just("default"), _tenants)), draw(st.integers(-5, 5)),
                               draw(st.one_of(st.none(), st.floats(1e-3, 1e6))),
                               draw(st.one_of(st.none(), st.floats(1e-3, 1e6)))))
    return out


@settings(max_examples=100, deadline=None)
@given(_records())
def test_canonical_csv_round_trips_exactly(tmp_path_factory, records):
    path = tmp_path_factory.mktemp("canon") / "t.csv"
    trace = Trace(tuple(records))
    write_csv(trace, path)
    back = load_trace(path)
    assert back.format == "servelab"
    assert back.records == trace.records
    assert back.source_rows == len(records) and back.num_dropped == 0
