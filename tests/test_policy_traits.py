"""A policy with nothing to act on orders as FCFS does: priority with one priority, fair
share with one tenant, lpm without shared cached prefixes give runs identical to fcfs's,
and `nothing_to_act_on` says so in words (servelab/traits.py, Policy.acts_on)."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, assume, given, settings

from servelab.policies import nothing_to_act_on, policy_names
from servelab.policies.base import POLICIES
from servelab.traits import TRAITS, WorkloadTraits
from servelab.request import Request

from sched_harness import simulate
from test_scheduler_properties import workloads


def _timeline(run) -> list[tuple]:
    return sorted((r.request_id, r.status, r.scheduled_s, r.first_token_s, r.finish_s,
                   r.num_preemptions) for r in run.records)


def _plain(reqs: list[Request]) -> list[Request]:
    """The same requests with one tenant, one priority and no prompt ids to share."""
    return [Request(r.request_id, r.arrival_s, r.prompt_len, r.output_len, n=r.n)
            for r in reqs]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_a_policy_with_nothing_to_act_on_runs_exactly_as_fcfs(w):
    """Without preemption (whose victim rules differ: priority's is the latest arrival,
    FCFS's the latest admitted) the runs are identical."""
    reqs, sched, cache, policy, options = w
    cache = replace(cache, enable_prefix_caching=False, num_host_blocks=0)
    fcfs = simulate(_plain(reqs), sched, cache, "fcfs")
    assume(not any(r.num_preemptions for r in fcfs.records))
    traits = WorkloadTraits.of(fcfs.records)
    for name in ("priority", "fair", "lpm", "edf"):
        assert nothing_to_act_on(name, traits) is not None
        opts = options if name == policy else None
        assert _timeline(simulate(_plain(reqs), sched, cache, name, opts)) == _timeline(fcfs), name


def test_reasons_name_what_the_workload_lacks():
    lone = WorkloadTraits(frozenset({"chat"}), frozenset({0}), shared_prefixes=False)
    assert nothing_to_act_on("priority", lone) == "every request has priority 0"
    assert nothing_to_act_on("fair", lone) == "one tenant (chat)"
    assert "prefix caching off" in nothing_to_act_on("lpm", lone)
    assert nothing_to_act_on("fcfs", lone) is None and nothing_to_act_on("sjf", lone) is None
    rich = WorkloadTraits(frozenset({"chat", "batch"}), frozenset({0, 1}), shared_prefixes=True,
                          ttft_slos=frozenset({50.0, None}))
    assert all(nothing_to_act_on(p, rich) is None for p in policy_names())


def test_traits_are_read_from_records():
    from servelab.records import RequestRecord

    records = [RequestRecord(0, 0.0, 10, 5, "finished", tenant="a", priority=1, cached_tokens=0),
               RequestRecord(1, 0.0, 10, 5, "finished", tenant="b", priority=1, cached_tokens=16)]
    traits = WorkloadTraits.of(records)
    assert traits == WorkloadTraits(frozenset({"a", "b"}), frozenset({1}), True, frozenset({None}))
    assert traits.missing() == ["every request has priority 1", "no request has a TTFT SLO of its own"]


@pytest.mark.parametrize("policy", policy_names())
def test_every_policy_declares_known_traits(policy):
    assert set(POLICIES.get(policy).acts_on) <= set(TRAITS)


def test_traits_of_no_requests_say_so():
    empty = WorkloadTraits.of([])
    assert nothing_to_act_on("fair", empty) == "no requests"
    assert nothing_to_act_on("priority", empty) == "no requests"


@pytest.mark.parametrize("policy", policy_names())
def test_the_property_suites_draw_every_policy_with_its_options(policy):
    """A policy with flags has options the property suites draw (tests/_policy_options.py),
    so its guards are exercised; every registered policy is drawn."""
    from _policy_options import OPTIONS

    assert not POLICIES.get(policy).flags or policy in OPTIONS
