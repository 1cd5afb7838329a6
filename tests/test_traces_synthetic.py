"""Arrival processes, length distributions, multi-tenant generation, shared prefixes, and
the default workload (its JSON must still match a refit of the real azure-conv file)."""
from __future__ import annotations

import json
from dataclasses import replace
from importlib import resources

import numpy as np
import pytest

from servelab.traces.distributions import (ArrivalProcess, Empirical, Fixed, LogNormal, Quantiles, Uniform,
                                           length_dist_from_dict)
from servelab.traces.fit_default_workload import fit
from servelab.traces.loaders import load_trace
from servelab.traces.record import Trace, TraceError, TraceRecord
from servelab.traces.stats import prefix_hit_ratio, trace_stats
from servelab.traces.synthetic import (SharedPrefix, TenantSpec, WorkloadSpec, default_workload, generate,
                                       load_default_spec, spec_from_dict, spec_to_dict)


def _rng(seed=0):
    return np.random.default_rng(seed)


@pytest.mark.parametrize("rate, cv", [(5.0, 1.0), (20.0, 0.5), (2.0, 3.0)])
def test_gamma_arrivals_have_the_asked_rate_and_cv(rate, cv):
    t = ArrivalProcess(rate, cv).times(_rng(1), n=40000)
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)
    assert np.all(np.diff(t) >= 0) and t[0] > 0


def test_arrivals_are_seeded_scale_with_rate_and_cover_a_duration():
    a = ArrivalProcess(4.0, 2.0)
    assert np.array_equal(a.times(_rng(7), n=50), a.times(_rng(7), n=50))
    assert not np.array_equal(a.times(_rng(7), n=50), a.times(_rng(8), n=50))
    assert np.allclose(ArrivalProcess(8.0, 2.0).times(_rng(7), n=50), a.times(_rng(7), n=50) / 2)
    t = a.times(_rng(3), duration_s=500.0)
    assert t.max() < 500.0 and len(t) == pytest.approx(2000, rel=0.15)
    assert np.allclose(ArrivalProcess(2.0, 0.0).times(_rng(0), n=3), [0.5, 1.0, 1.5])
    for bad in (dict(rate=0.0), dict(rate=float("inf")), dict(rate=1.0, cv=-1.0)):
        with pytest.raises(TraceError):
            ArrivalProcess(**{"cv": 1.0, **bad})
    with pytest.raises(TraceError, match="exactly one of n and duration_s"):
        a.times(_rng(), n=3, duration_s=2.0)


def test_length_distributions():
    rng = _rng(5)
    assert np.all(Fixed(7).sample(10, rng) == 7)
    u = Uniform(3, 5).sample(3000, rng)
    assert set(u.tolist()) == {3, 4, 5}
    ln = LogNormal.from_mean_cv(500.0, 0.8, high=4000).sample(50000, rng)
    assert ln.mean() == pytest.approx(500, rel=0.03) and ln.max() <= 4000 and ln.min() >= 1
    emp = Empirical((10, 20, 20, 30)).sample(20000, rng)
    assert set(emp.tolist()) == {10, 20, 30} and (emp == 20).mean() == pytest.approx(0.5, abs=0.02)
    q = Quantiles((0.0, 0.5, 1.0), (10.0, 20.0, 100.0)).sample(40000, rng)
    assert np.median(q) == pytest.approx(20, abs=1) and q.min() >= 10 and q.max() <= 100
    assert (q <= 20).mean() == pytest.approx(0.5, abs=0.02)
    for d in (Fixed(3), Uniform(1, 9), LogNormal(2.0, 0.5, 1, 99), Empirical((1, 2)), q_ := Quantiles.fit([1, 5, 9], (0.0, 0.5, 1.0))):
        assert length_dist_from_dict(d.to_dict()) == d
    assert q_.values == (1.0, 5.0, 9.0)
    for bad in (lambda: Fixed(0), lambda: Uniform(5, 3), lambda: Empirical(()), lambda: LogNormal(1.0, -1.0),
                lambda: Quantiles((0.0, 1.0), (5.0, 3.0)), lambda: length_dist_from_dict({"kind": "zipf"})):
        with pytest.raises(TraceError):
            bad()


def test_empirical_from_a_loaded_trace(traces_dir):
    trace = load_trace(traces_dir / "splitwise_code.csv")
    emp = Empirical.from_trace(trace, "output").sample(20000, _rng(2))
    assert emp.mean() == pytest.approx(27.9, rel=0.1)
    with pytest.raises(TraceError):
        Empirical.from_trace(trace, "total")


def _two_tenants(rate_b=3.0, prefix=None):
    return WorkloadSpec((
        TenantSpec("chat", 6.0, Uniform(10, 200), Fixed(20), priority=0, slo_ttft_ms=500.0, prefix=prefix),
        TenantSpec("batch", rate_b, Fixed(3000), Uniform(1, 50), cv=2.0, priority=1),
    ), duration_s=300.0)


def test_multi_tenant_generation_rates_priorities_and_order():
    trace = generate(_two_tenants(), seed=11)
    assert isinstance(trace, Trace) and trace.format == "synthetic"
    by = {name: [r for r in trace.records if r.tenant == name] for name in ("chat", "batch")}
    assert len(by["chat"]) / 300 == pytest.approx(6.0, rel=0.1)
    assert len(by["batch"]) / 300 == pytest.approx(3.0, rel=0.25)
    assert {(r.priority, r.slo_ttft_ms) for r in by["chat"]} == {(0, 500.0)}
    assert {(r.priority, r.prompt_tokens) for r in by["batch"]} == {(1, 3000)}
    assert all(r.arrival_s < 300 for r in trace.records)
    assert generate(_two_tenants(), seed=11).records == trace.records
    assert generate(_two_tenants(), seed=12).records != trace.records


def test_tenant_streams_are_independent_of_other_tenants():
    a = generate(_two_tenants(rate_b=3.0), seed=4)
    b = generate(_two_tenants(rate_b=9.0), seed=4)
    chat = lambda t: [r for r in t.records if r.tenant == "chat"]  # noqa: E731
    assert chat(a) == chat(b)


def test_shared_prefix_groups_produce_shared_leading_hashes():
    prefix = SharedPrefix(blocks=4, fraction=0.6, groups=3, block_size=16)
    spec = WorkloadSpec((TenantSpec("chat", 10.0, Uniform(100, 400), Fixed(5), prefix=prefix),
                         TenantSpec("plain", 2.0, Fixed(64), Fixed(5))), duration_s=200.0)
    trace = generate(spec, seed=3)
    chat = [r for r in trace.records if r.tenant == "chat"]
    assert all(r.prefix_block_size == 16 and len(r.prefix_hashes) == -(-r.prompt_tokens // 16) for r in chat)
    assert all(r.prefix_hashes is None for r in trace.records if r.tenant == "plain")
    heads = [r.prefix_hashes[:4] for r in chat]
    systems = {h for h in heads if heads.count(h) > 1}
    assert len(systems) == 3 and all(h == tuple(range(h[0], h[0] + 4)) for h in systems)
    sharing = sum(h in systems for h in heads) / len(heads)
    assert sharing == pytest.approx(0.6, abs=0.05)
    tails = [h for r in chat for h in r.prefix_hashes[4:]]
    assert len(tails) == len(set(tails)) and not set(tails) & {h for s in systems for h in s}
    expected = sum(64 for r, h in zip(chat, heads) if h in systems) / sum(r.prompt_tokens for r in chat)
    assert prefix_hit_ratio(trace) == pytest.approx(expected, abs=0.01)
    with pytest.raises(TraceError):
        SharedPrefix(blocks=0, fraction=0.5)


def test_workload_spec_validation_and_rate_scaling_and_dict_round_trip():
    spec = _two_tenants(prefix=SharedPrefix(2, 0.5))
    assert spec.with_total_rate(18.0).total_rate == pytest.approx(18.0)
    assert spec_from_dict(json.loads(json.dumps(spec_to_dict(spec)))) == spec
    with pytest.raises(TraceError, match="unique"):
        WorkloadSpec(spec.tenants + spec.tenants[:1], 10.0)
    with pytest.raises(TraceError):
        WorkloadSpec(spec.tenants, 0.0)
    with pytest.raises(TraceError):
        replace(spec.tenants[0], rate=-1.0)


def test_default_workload_json_matches_a_refit_of_azure_conv(traces_dir):
    stored = json.loads(resources.files("servelab.traces").joinpath("data/default_workload.json").read_text())
    assert json.loads(json.dumps(fit(traces_dir / "AzureLLMInferenceTrace_conv.csv"))) == stored
    assert stored["fit"]["rate"] == pytest.approx(5.53, abs=0.005)
    scale = stored["choices"]["rate_scale"]
    for tenant in stored["workload"]["tenants"]:
        assert tenant["rate"] == pytest.approx(stored["fit"]["classes"][tenant["name"]]["rate"] * scale)


def test_default_workload_resembles_azure_conv_and_has_prioritised_tenants(traces_dir):
    trace = default_workload(seed=0, duration_s=1200.0)
    real = trace_stats(load_trace(traces_dir / "AzureLLMInferenceTrace_conv.csv"))
    st = trace_stats(trace)
    assert st.mean_rate == pytest.approx(real.mean_rate * 2.75, rel=0.05)
    assert st.interarrival_cv == pytest.approx(real.interarrival_cv, rel=0.1)
    for mine, theirs in ((st.prompt, real.prompt), (st.output, real.output)):
        assert mine.mean == pytest.approx(theirs.mean, rel=0.05)
        assert mine.p50 == pytest.approx(theirs.p50, rel=0.06)
        assert mine.p90 == pytest.approx(theirs.p90, rel=0.06)
    tenants = {name: prios for name, _, prios in st.tenants}
    assert tenants == {"interactive": (0,), "batch": (1,)}
    batch = [r.prompt_tokens for r in trace.records if r.tenant == "batch"]
    inter = [r.prompt_tokens for r in trace.records if r.tenant == "interactive"]
    assert min(batch) > max(inter)  # the batch tenant holds the long prompts
    assert all(r.slo_ttft_ms is not None for r in trace.records)
    assert default_workload(seed=0).records == default_workload(seed=0).records
    fast = default_workload(seed=0, rate=20.0)
    assert fast.mean_rate == pytest.approx(20.0, rel=0.05)
    assert load_default_spec().duration_s == 600.0


def test_generated_records_are_valid_trace_records():
    trace = default_workload(seed=2)
    assert all(isinstance(r, TraceRecord) for r in trace.records)
    reqs = trace.to_requests()
    assert len(reqs) == len(trace)
    assert {(r.tenant, r.prefix_block_size) for r in reqs} == {("interactive", 16), ("batch", None)}
