"""The admission stage before the policy (policies/admission_control.py): per-tenant queue
limits and token buckets, shedding by tier on the predicted wait, the reasons recorded,
shed requests counted as SLO misses, and its config and flags."""
from __future__ import annotations

import json

import pytest

from servelab.cli import main
from servelab.config import AdmissionConfig, SchedulerConfig
from servelab.reports.health import rejection_reasons
from servelab.reports.metrics import summarize
from servelab.reports.slo import slo_attainment

from sched_harness import make_requests, simulate

ONE_AT_A_TIME = dict(max_num_seqs=1, max_num_batched_tokens=64, chunked_prefill=None)


def _rejected(run) -> dict[int, str]:
    return {r.request_id: r.reject_reason for r in run.records if r.status == "rejected"}


def test_tenant_queue_limit_counts_each_tenant_apart():
    """Tenant a sends four requests at once, b one; at most two of a's wait to start."""
    reqs = make_requests([(0.0, 8, 4, {"tenant": "a"})] * 4 + [(0.0, 8, 4, {"tenant": "b"})])
    run = simulate(reqs, SchedulerConfig(**ONE_AT_A_TIME,
                                         admission=AdmissionConfig(tenant_queue_limit=2)))
    assert _rejected(run) == {2: "tenant queue full (2 requests of a waiting)",
                              3: "tenant queue full (2 requests of a waiting)"}


def test_token_bucket_admits_a_tenant_at_its_rate_after_a_burst():
    """1 req/s with bursts of 2: two at t=0 pass, the third (0 tokens) and the one at 0.5 s
    (half a token) are refused, the one at 1.5 s (1.5 tokens) passes; tenant b has its
    own bucket."""
    reqs = make_requests([(0.0, 8, 2), (0.0, 8, 2), (0.0, 8, 2), (0.0, 8, 2, {"tenant": "b"}),
                          (0.5, 8, 2), (1.5, 8, 2)])
    run = simulate(reqs, SchedulerConfig(admission=AdmissionConfig(tenant_rate=1.0, tenant_burst=2)))
    assert _rejected(run) == {2: "tenant default over its rate (1 req/s, burst 2)",
                              4: "tenant default over its rate (1 req/s, burst 2)"}


def _tiers():
    """One request at a time, 10 ms a step: request 0 (priority 0) runs 1 s; then, every
    100 ms, a priority-1 request with a 250 ms TTFT SLO and a priority-0 one."""
    spec = [(0.0, 8, 100)]
    for i in range(1, 6):
        spec += [(0.1 * i, 8, 2, {"priority": 1, "slo_ttft_ms": 250.0}),
                 (0.1 * i, 8, 2, {"priority": 0, "slo_ttft_ms": 250.0})]
    return make_requests(spec)


def test_shedding_by_tier_sheds_the_lower_tier_once_its_predicted_wait_passes_its_slo():
    """Nothing of tier 1 has started, so its predicted wait is how long its oldest
    waiting request has waited: 0.1 s at 0.2 s, ... 0.3 s at 0.4 s > 250 ms, so the
    tier-1 arrivals at 0.4 and 0.5 s are shed. Tier 0 is never shed."""
    run = simulate(_tiers(), SchedulerConfig(**ONE_AT_A_TIME, admission=AdmissionConfig(
        shed_from_priority=1)), policy="priority")
    assert _rejected(run) == {
        7: "shed: predicted wait 300 ms exceeds the TTFT SLO 250 ms (priority 1)",
        9: "shed: predicted wait 400 ms exceeds the TTFT SLO 250 ms (priority 1)"}
    everyone = simulate(_tiers(), SchedulerConfig(**ONE_AT_A_TIME, admission=AdmissionConfig(
        shed_from_priority=0)), policy="priority")
    assert {rid % 2 for rid in _rejected(everyone)} == {0, 1}   # both tiers shed


def test_the_predicted_wait_is_the_last_start_of_the_tier_once_one_started():
    """After a tier-1 request started having waited 0.6 s (request 0 ran 60 steps of
    10 ms), the next tier-1 arrival is predicted to wait as long, and is shed against a
    500 ms SLO though no other tier-1 request waits."""
    reqs = make_requests([(0.0, 8, 60), (0.0, 8, 2, {"priority": 1, "slo_ttft_ms": 5000.0}),
                          (0.7, 8, 2, {"priority": 1, "slo_ttft_ms": 500.0})])
    run = simulate(reqs, SchedulerConfig(**ONE_AT_A_TIME, admission=AdmissionConfig(
        shed_from_priority=1)), policy="priority")
    assert list(_rejected(run)) == [2]
    assert _rejected(run)[2] == ("shed: predicted wait 600 ms exceeds the TTFT SLO 500 ms "
                                 "(priority 1)")


def test_shed_requests_count_as_missing_their_slo():
    """Goodput's attainment divides by every request, the shed ones included, and the
    health report names the reason."""
    run = simulate(_tiers(), SchedulerConfig(**ONE_AT_A_TIME, admission=AdmissionConfig(
        shed_from_priority=1)), policy="priority")
    summary = summarize(run.records, [], slo_ttft_ms=10_000.0)
    met = sum(1 for r in run.records if r.status == "finished"
              and (r.first_token_s - r.arrival_s) * 1e3 <= (r.slo_ttft_ms or 10_000.0))
    assert summary["rejected"] == 2
    assert slo_attainment(summary) == pytest.approx(met / len(run.records))
    assert rejection_reasons(run.records)[0][1] == 2


def test_admission_config_is_validated_and_round_trips():
    with pytest.raises(ValueError, match="AdmissionConfig.tenant_burst"):
        AdmissionConfig(tenant_burst=0.5)
    with pytest.raises(ValueError, match="AdmissionConfig.tenant_rate"):
        AdmissionConfig(tenant_rate=0.0)
    with pytest.raises(ValueError, match="SchedulerConfig.admission"):
        SchedulerConfig(admission={"shed_tier": 1})
    plain = SchedulerConfig()
    assert "admission" not in plain.to_dict()   # configs without a rule read as before
    shed = SchedulerConfig(admission=AdmissionConfig(shed_from_priority=1, tenant_rate=3.0))
    assert SchedulerConfig(**json.loads(json.dumps(shed.to_dict()))) == shed


def test_flags_reach_the_run_config(tmp_path):
    out = tmp_path / "run"
    assert main(["simulate", "--trace", "default", "--num-requests", "50", "--policy", "edf",
                 "--shed-from-priority", "1", "--tenant-queue-limit", "40", "--out", str(out)]) == 0
    admission = json.loads((out / "config.json").read_text())["config"]["scheduler"]["admission"]
    assert admission["shed_from_priority"] == 1 and admission["tenant_queue_limit"] == 40
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", "default", "--tenant-burst", "0.5", "--out", str(out)])


def test_the_real_backend_runs_the_stage_too(tmp_path):
    """`servelab run` builds its scheduler from the same flags: tenant a's second request,
    20 ms after its first, finds its bucket (1 req/s, burst 1) empty."""
    from servelab.reports.runio import read_json, read_requests

    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens,tenant,priority\n"
                     "0.0,12,4,a,0\n0.01,7,4,b,1\n0.02,20,4,a,0\n")
    out = tmp_path / "run"
    assert main(["run", "--device", "cpu", "--model", "tiny-llama", "--trace", str(trace),
                 "--block-size", "4", "--kv-blocks", "24", "--tenant-rate", "1",
                 "--tenant-burst", "1", "--out", str(out)]) == 0
    records = {r.request_id: r for r in read_requests(out / "requests.csv")}
    assert (records[0].status, records[1].status) == ("finished", "finished")
    assert records[2].reject_reason == "tenant a over its rate (1 req/s, burst 1)"
    assert read_json(out / "config.json")["config"]["scheduler"]["admission"]["tenant_rate"] == 1.0
