"""summarize(): every value checked against hand arithmetic, plus edge cases and bad input."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.records import RequestRecord, StepRecord
from servelab.reports import SUMMARY_KEYS, TENANT_KEYS, summarize

# Times are multiples of 1/4 s so that most of the arithmetic below is exact in binary.
REQUESTS = [
    # a: ttft 500, e2el 1500, tpot (1500-500)/4 = 250; no token_times -> 4 ITL gaps of 250;
    # queueing 0.
    RequestRecord(0, 0.0, 10, 5, "finished", scheduled_s=0.0, first_token_s=0.5, finish_s=1.5,
                  num_preemptions=1, tenant="a"),
    # a, n=2: ttft 500, e2el 1750, tpot 1250/3 = 416.67; token_times -> gaps 250, 750, 250;
    # queueing 250; its own TTFT SLO 400 (< 500) makes it miss goodput.
    RequestRecord(1, 0.25, 20, 4, "finished", scheduled_s=0.5, first_token_s=0.75, finish_s=2.0,
                  num_preemptions=2, tenant="a", n=2, slo_ttft_ms=400.0,
                  token_times=[0.75, 1.0, 1.75, 2.0]),
    # b, one output token: ttft 750, e2el 750, no TPOT and no ITL; queueing 500; its own TTFT
    # SLO 800 (looser than the global 600) lets it meet goodput.
    RequestRecord(2, 0.5, 30, 1, "finished", scheduled_s=1.0, first_token_s=1.25, finish_s=1.25,
                  tenant="b", slo_ttft_ms=800.0),
    # b, rejected: counts only in `rejected` and per_tenant["b"]["rejected"].
    RequestRecord(3, 1.0, 5000, 0, "rejected", finish_s=1.0, tenant="b",
                  reject_reason="prompt longer than the KV cache"),
]
STEPS = [
    StepRecord(0.0, 0.5, 10, 0, 1, 1, 2, 0, kv_blocks_used=2, kv_blocks_total=10),
    # A fast-forwarded run of 4 identical decode steps lasting 1.0 s in all.
    StepRecord(0.5, 1.0, 0, 3, 0, 3, 0, 0, kv_blocks_used=6, kv_blocks_total=10, num_steps=4),
    StepRecord(1.5, 0.5, 0, 2, 0, 2, 0, 0, kv_blocks_used=4, kv_blocks_total=10),
]


def test_summary_matches_hand_computed_values():
    s = summarize(REQUESTS, STEPS, slo_ttft_ms=600.0, slo_tpot_ms=300.0)
    expected = {
        "duration": 2.0,                       # first arrival 0.0 -> last finish 2.0
        "completed": 3,
        "rejected": 1,
        "total_input_tokens": 60,              # 10 + 20 + 30
        "total_output_tokens": 14,             # 5 + 4*2 (n=2) + 1
        "request_throughput": 1.5,             # 3 / 2
        "request_goodput": 1.0,                # requests 0 and 2 meet their SLOs: 2 / 2
        "output_throughput": 7.0,              # 14 / 2
        "total_token_throughput": 37.0,        # 74 / 2
        # TTFT [500, 500, 750]; linear percentile at h = (3-1)q: p90 h=1.8, p99 h=1.98
        "mean_ttft_ms": 1750 / 3,
        "median_ttft_ms": 500.0,
        "std_ttft_ms": 250 * math.sqrt(2) / 3,  # sqrt((2*(250/3)^2 + (500/3)^2) / 3)
        "p90_ttft_ms": 700.0,                  # 500 + 0.8*250
        "p99_ttft_ms": 745.0,                  # 500 + 0.98*250
        # TPOT [250, 1250/3]; the one-token request has none
        "mean_tpot_ms": 1000 / 3,
        "median_tpot_ms": 1000 / 3,
        "std_tpot_ms": 250 / 3,                # half the spread 500/3
        "p90_tpot_ms": 400.0,                  # 250 + 0.9*(500/3)
        "p99_tpot_ms": 415.0,                  # 250 + 0.99*(500/3)
        # ITL multiset: 250 x4 (request 0, approximated) + 250, 750, 250 (request 1)
        # = 250 x6, 750 x1
        "mean_itl_ms": 2250 / 7,
        "median_itl_ms": 250.0,                # h = 6*0.5 = 3
        "std_itl_ms": math.sqrt(1_500_000) / 7,  # sqrt((6*(500/7)^2 + (3000/7)^2) / 7)
        "p90_itl_ms": 450.0,                   # h = 5.4: 250 + 0.4*500
        "p99_itl_ms": 720.0,                   # h = 5.94: 250 + 0.94*500
        # E2EL [1500, 1750, 750]
        "mean_e2el_ms": 4000 / 3,
        "median_e2el_ms": 1500.0,
        "std_e2el_ms": math.sqrt(1_625_000) / 3,  # sqrt(((500/3)^2 + (1250/3)^2 + (1750/3)^2) / 3)
        "p90_e2el_ms": 1700.0,                 # 1500 + 0.8*250
        "p99_e2el_ms": 1745.0,                 # 1500 + 0.98*250
        "num_preemptions": 3,                  # 1 + 2
        "mean_queueing_delay_ms": 250.0,       # [0, 250, 500]
        "p99_queueing_delay_ms": 495.0,        # 250 + 0.98*250
        "mean_kv_cache_usage": 0.45,           # (0.2*0.5 + 0.6*1.0 + 0.4*0.5) / 2.0
        "max_kv_cache_usage": 0.6,
        "mean_batch_size": 2.5,                # (1*1 + 3*4 + 2*1) / 6 steps
        "jain_fairness_index": 1936 / 2080,    # service a=28, b=16: 44^2 / (2*(28^2 + 16^2))
        "per_tenant": {
            # a: service (30 + 2*13) / 2 = 28
            # within_slo: request 0 meets every SLO, request 1 misses its own TTFT SLO
            "a": {"completed": 2, "rejected": 0, "within_slo": 1, "total_input_tokens": 30,
                  "total_output_tokens": 13, "mean_ttft_ms": 500.0, "service_tokens_per_s": 28.0},
            # b: service (30 + 2*1) / 2 = 16
            "b": {"completed": 1, "rejected": 1, "within_slo": 1, "total_input_tokens": 30,
                  "total_output_tokens": 1, "mean_ttft_ms": 750.0, "service_tokens_per_s": 16.0},
        },
    }
    assert list(s) == list(SUMMARY_KEYS) == list(expected)
    for key, value in expected.items():
        if key == "per_tenant":
            assert list(s[key]) == ["a", "b"]
            for tenant, row in value.items():
                assert list(s[key][tenant]) == list(TENANT_KEYS)
                assert s[key][tenant] == pytest.approx(row, rel=1e-12), tenant
        else:
            assert s[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
            assert type(s[key]) is type(value), key


def test_goodput_end_to_end_slo_and_no_slo():
    # e2el <= 1000 holds only for request 2 (750); request 1 also misses its own TTFT SLO.
    assert summarize(REQUESTS, STEPS, slo_e2el_ms=1000.0)["request_goodput"] == 0.5
    # A value equal to its SLO meets it (request 0's e2el is exactly 1500).
    assert summarize(REQUESTS, STEPS, slo_e2el_ms=1500.0)["request_goodput"] == 1.0
    # No global SLO: only request 1's own TTFT SLO can fail -> 2 good of 3.
    assert summarize(REQUESTS, STEPS)["request_goodput"] == 1.0
    no_slo = [RequestRecord(**{**_as_dict(r), "slo_ttft_ms": None}) for r in REQUESTS]
    s = summarize(no_slo, STEPS)
    assert s["request_goodput"] == s["request_throughput"] == 1.5


def test_given_duration_and_tenant_weights():
    s = summarize(REQUESTS, STEPS, duration_s=4.0, tenant_weights={"a": 2.0})
    assert s["duration"] == 4.0
    assert s["request_throughput"] == 0.75
    assert s["output_throughput"] == 3.5
    assert s["per_tenant"]["a"]["service_tokens_per_s"] == 14.0
    # Normalised service a = 14/2 = 7, b = 8: 15^2 / (2*(49 + 64))
    assert s["jain_fairness_index"] == pytest.approx(225 / 226, rel=1e-12)


def test_equal_normalised_service_scores_one_and_zero_durations_fall_back():
    requests = [
        RequestRecord(0, 0.0, 10, 2, "finished", 0.0, 0.5, 1.0, tenant="x"),
        RequestRecord(1, 0.0, 20, 2, "finished", 0.0, 0.5, 1.0, tenant="y"),
    ]
    steps = [StepRecord(0.0, 0.0, 0, 1, 0, 1, 0, 0, 1, 4),
             StepRecord(0.0, 0.0, 0, 1, 0, 1, 0, 0, 3, 4, num_steps=3)]
    s = summarize(requests, steps, tenant_weights={"x": 14.0, "y": 24.0})
    assert s["jain_fairness_index"] == pytest.approx(1.0, rel=1e-12)
    assert s["mean_kv_cache_usage"] == pytest.approx((0.25 + 3 * 0.75) / 4)  # weighted by num_steps


def _assert_plain_json(summary: dict) -> None:
    text = json.dumps(summary, allow_nan=False)
    assert json.loads(text) == summary
    assert list(summary) == list(SUMMARY_KEYS)

    def walk(value):
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif value is not None:   # None: a statistic over an empty set
            assert type(value) in (int, float), type(value)
            assert math.isfinite(value)
    walk(summary)


#: Keys that count or divide by the run's duration: 0 when nothing finished. Every other
#: key is a statistic of the finished requests (or of the steps) and is None then.
COUNTS_AND_RATES = {"duration", "completed", "rejected", "total_input_tokens", "total_output_tokens",
                    "request_throughput", "request_goodput", "output_throughput",
                    "total_token_throughput", "num_preemptions"}


@pytest.mark.parametrize("requests", [[], [r for r in REQUESTS if r.status == "rejected"]])
def test_nothing_finished_gives_zero_counts_and_null_statistics(requests):
    s = summarize(requests, [])
    _assert_plain_json(s)
    for key in SUMMARY_KEYS:
        if key == "rejected":
            assert s[key] == len(requests)
        elif key == "per_tenant":
            assert s[key] == ({} if not requests else {"b": {
                "completed": 0, "rejected": 1, "within_slo": 0, "total_input_tokens": 0,
                "total_output_tokens": 0, "mean_ttft_ms": None, "service_tokens_per_s": 0.0}})
        elif key in COUNTS_AND_RATES:
            assert s[key] == 0, key
        else:
            assert s[key] is None, key


def test_a_statistic_with_no_values_is_null_while_the_others_are_set():
    """Only one-token outputs: no TPOT and no ITL exist, yet TTFT does."""
    requests = [RequestRecord(i, 0.0, 5, 1, "finished", 0.0, 0.1 * (i + 1), 0.1 * (i + 1)) for i in range(3)]
    s = summarize(requests, [])
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert all(s[f"{stat}_{m}_ms"] is None for m in ("tpot", "itl")
               for stat in ("mean", "median", "std", "p90", "p99"))


def test_full_summary_is_plain_json():
    _assert_plain_json(summarize(REQUESTS, STEPS, slo_ttft_ms=600.0))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 1000), st.integers(1, 1000)),
                min_size=1, max_size=12))
def test_itl_weighting_equals_the_expanded_gaps(rows):
    """The weighted ITL statistics equal numpy's on the explicit list of repeated gaps."""
    requests = [RequestRecord(i, 0.0, 1, k, "finished", 0.0, first / 1000, (first + span) / 1000)
                for i, (k, first, span) in enumerate(rows)]
    gaps = np.concatenate([np.full(k - 1, span / (k - 1)) for k, _, span in rows if k > 1]
                          + [np.zeros(0)])
    s = summarize(requests, [])
    if not len(gaps):
        assert s["mean_itl_ms"] is None and s["p99_itl_ms"] is None
        return
    want = {"mean": gaps.mean(), "median": np.median(gaps), "std": gaps.std(),
            "p90": np.percentile(gaps, 90), "p99": np.percentile(gaps, 99)}
    for stat, value in want.items():
        assert s[f"{stat}_itl_ms"] == pytest.approx(value, rel=1e-9, abs=1e-9), stat


def test_matches_a_plain_per_record_computation():
    """The vectorised summary agrees with a loop over the records' own properties."""
    rng = np.random.default_rng(7)
    requests = []
    for i in range(300):
        arrival = float(rng.uniform(0, 50))
        tenant = f"t{rng.integers(3)}"
        if rng.random() < 0.1:
            requests.append(RequestRecord(i, arrival, 100, 0, "rejected", finish_s=arrival,
                                          tenant=tenant))
            continue
        k = int(rng.integers(1, 30))
        scheduled = arrival + float(rng.exponential(0.3))
        first = scheduled + float(rng.exponential(0.1))
        times = list(np.cumsum(np.r_[first, rng.exponential(0.02, k - 1)]))
        requests.append(RequestRecord(
            i, arrival, int(rng.integers(1, 2000)), k, "finished", scheduled, first, times[-1],
            num_preemptions=int(rng.integers(3)), tenant=tenant, n=int(rng.integers(1, 3)),
            slo_ttft_ms=300.0 if rng.random() < 0.3 else None,
            token_times=times if rng.random() < 0.5 else None))
    s = summarize(requests, [], slo_ttft_ms=500.0, slo_tpot_ms=25.0, slo_e2el_ms=2000.0)

    done = [r for r in requests if r.status == "finished"]
    duration = max(r.finish_s for r in done) - min(r.arrival_s for r in requests)
    itl = []
    for r in done:
        if r.token_times is not None:
            itl += [(b - a) * 1e3 for a, b in zip(r.token_times, r.token_times[1:])]
        else:
            itl += [r.tpot_ms] * (r.output_tokens - 1) if r.output_tokens > 1 else []
    def meets(r) -> bool:
        return ((r.ttft_ms <= (r.slo_ttft_ms if r.slo_ttft_ms is not None else 500.0))
                and (r.tpot_ms or 0.0) <= 25.0 and r.e2el_ms <= 2000.0)

    good = sum(map(meets, done))
    series = {"ttft": [r.ttft_ms for r in done], "e2el": [r.e2el_ms for r in done],
              "tpot": [r.tpot_ms for r in done if r.tpot_ms is not None], "itl": itl}
    want = {
        "duration": duration, "completed": len(done), "rejected": len(requests) - len(done),
        "request_goodput": good / duration,
        "output_throughput": sum(r.output_tokens * r.n for r in done) / duration,
        "num_preemptions": sum(r.num_preemptions for r in requests),
        "mean_queueing_delay_ms": np.mean([(r.scheduled_s - r.arrival_s) * 1e3 for r in done]),
    }
    for metric, values in series.items():
        want |= {f"mean_{metric}_ms": np.mean(values), f"median_{metric}_ms": np.median(values),
                 f"std_{metric}_ms": np.std(values), f"p90_{metric}_ms": np.percentile(values, 90),
                 f"p99_{metric}_ms": np.percentile(values, 99)}
    for key, value in want.items():
        assert s[key] == pytest.approx(value, rel=1e-9), key
    for tenant, row in s["per_tenant"].items():
        mine = [r for r in done if r.tenant == tenant]
        service = sum(r.prompt_tokens + 2 * r.output_tokens * r.n for r in mine) / duration
        assert row["service_tokens_per_s"] == pytest.approx(service, rel=1e-12)
        assert row["mean_ttft_ms"] == pytest.approx(np.mean([r.ttft_ms for r in mine]), rel=1e-12)
        assert row["within_slo"] == sum(map(meets, mine))


def test_token_times_gaps_are_used_per_request():
    # Two requests with token_times back to back: the gap between them must not count.
    requests = [
        RequestRecord(0, 0.0, 1, 3, "finished", 0.0, 0.0, 0.5, token_times=[0.0, 0.25, 0.5]),
        RequestRecord(1, 0.0, 1, 2, "finished", 0.0, 4.0, 5.0, token_times=[4.0, 5.0]),
        RequestRecord(2, 0.0, 1, 1, "finished", 0.0, 6.0, 6.0, token_times=[6.0]),
    ]
    s = summarize(requests, [])
    assert s["mean_itl_ms"] == pytest.approx((250 + 250 + 1000) / 3)
    assert s["median_itl_ms"] == 250.0


def _as_dict(r: RequestRecord) -> dict:
    return {name: getattr(r, name) for name in RequestRecord.field_names()}


def _with(record: RequestRecord, **changes) -> RequestRecord:
    return RequestRecord(**{**_as_dict(record), **changes})


@pytest.mark.parametrize("changes, message", [
    ({"status": "running"}, "request 0: status must be one of"),
    ({"first_token_s": None}, "request 0: a finished request needs finite"),
    ({"first_token_s": 2.0}, "request 0: times must satisfy"),
    ({"output_tokens": 0}, "request 0: a finished request must have output_tokens >= 1"),
    ({"n": 0}, "request 0: n must be >= 1"),
    ({"arrival_s": math.nan}, "request 0: arrival_s must be a finite number"),
    ({"prompt_tokens": 1.5}, "request 0: prompt_tokens must be an integer"),
    ({"scheduled_s": "soon"}, "request 0: scheduled_s must be a number or None"),
    ({"slo_tpot_ms": -1.0}, "request 0: slo_tpot_ms must be >= 0"),
    ({"tenant": None}, "request 0: tenant must be a string"),
    ({"token_times": [0.5, 1.5, 1.0, 1.2, 1.5]}, "request 0: token_times must be a list of finite"),
    ({"token_times": [0.5, None, 1.0, 1.2]}, "request 0: token_times must be a list of finite"),
    ({"token_times": 3.0}, "request 0: token_times must be a list of finite"),
])
def test_bad_request_records_are_named(changes, message):
    with pytest.raises(ValueError, match=message):
        summarize([_with(REQUESTS[0], **changes)] + REQUESTS[1:], STEPS)


@pytest.mark.parametrize("step, message", [
    (StepRecord(0.0, -1.0, 0, 1, 0, 1, 0, 0, 1, 4), "step record 1: duration_s"),
    (StepRecord(0.0, 1.0, 0, 1, 0, 1, 0, 0, 1, 0), "step record 1: kv_blocks_total must be >= 1"),
    (StepRecord(0.0, 1.0, 0, 1, 0, 1, 0, 0, 5, 4), "step record 1: kv_blocks_used"),
    (StepRecord(0.0, 1.0, 0, 1, 0, 1, 0, 0, 1, 4, num_steps=0), "step record 1: num_steps"),
])
def test_bad_step_records_are_named(step, message):
    with pytest.raises(ValueError, match=message):
        summarize(REQUESTS, [STEPS[0], step])


@pytest.mark.parametrize("kwargs, message", [
    ({"slo_ttft_ms": -1.0}, "slo_ttft_ms"),
    ({"slo_e2el_ms": math.nan}, "slo_e2el_ms"),
    ({"duration_s": 0.0}, "duration_s"),
    ({"tenant_weights": {"a": 0.0}}, "tenant_weights\\['a'\\]"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        summarize(REQUESTS, STEPS, **kwargs)
