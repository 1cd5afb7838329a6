"""The `lpm` policy: longest cached prefix first, with a starvation guard."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelab.config import CacheConfig, SchedulerConfig
from servelab.policies import LongestPrefixMatchPolicy, make_policy

from sched_harness import FakeExecutor, make_requests, simulate
from test_scheduler_policies import _newly_admitted_checker
from test_scheduler_properties import workloads

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SHARED = tuple(range(500, 532))


class _Lpm(LongestPrefixMatchPolicy):
    """lpm that keeps the scheduler's probe where a test can ask it too."""

    def attach_prefix_probe(self, cached_tokens) -> None:
        super().attach_prefix_probe(cached_tokens)
        self.probe = cached_tokens


def _prompt(shared: int, own: int, tag: int) -> dict:
    """Token ids: `shared` tokens of the common prefix, then `own` of the request's own."""
    return {"prompt_token_ids": SHARED[:shared] + tuple(range(tag * 1000, tag * 1000 + own))}


def _timeline(max_wait_s):
    """One seat. Request 0 computes the shared prefix (32 tokens) and finishes; request 1
    runs long; while it runs, request 2 (nothing cached) arrives before request 3 (the
    shared prefix cached). When the seat frees, which goes first?"""
    rows = [(0.0, 33, 1, _prompt(32, 1, 1)), (0.1, 4, 40, _prompt(0, 4, 2)),
            (0.2, 36, 2, _prompt(0, 36, 3)), (0.3, 36, 2, _prompt(32, 4, 4))]
    sched = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, chunked_prefill=None,
                            max_model_len=128)
    cache = CacheConfig(block_size=4, num_gpu_blocks=64, watermark=0, enable_prefix_caching=True)
    run = simulate(make_requests(rows), sched, cache, "lpm", {"max_wait_s": max_wait_s},
                   executor=FakeExecutor(step_s=0.1))
    return run.admitted, {r.request_id: r for r in run.records}


def test_the_longest_cached_prefix_goes_first():
    admitted, rec = _timeline(max_wait_s=None)
    assert admitted == [0, 1, 3, 2]
    assert rec[3].cached_tokens == 32 and rec[2].cached_tokens == 0


def test_the_guard_admits_an_overdue_request_first():
    # request 2 has waited 4 s (> 1 s) when the seat frees: it goes first, as under FCFS
    admitted, rec = _timeline(max_wait_s=1.0)
    assert admitted == [0, 1, 2, 3]
    assert rec[2].scheduled_s == pytest.approx(rec[1].finish_s)   # as soon as the seat frees


def test_without_prefix_caching_lpm_is_fcfs():
    rows = [(0.0, 33, 1, _prompt(32, 1, 1)), (0.1, 4, 40, _prompt(0, 4, 2)),
            (0.2, 36, 2, _prompt(0, 36, 3)), (0.3, 36, 2, _prompt(32, 4, 4))]
    sched = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=128)
    run = simulate(make_requests(rows), sched, CacheConfig(block_size=4, num_gpu_blocks=64),
                   "lpm")
    assert run.admitted == [0, 1, 2, 3]


def test_a_long_queue_falls_back_to_arrival_order():
    rows = [(0.0, 33, 1, _prompt(32, 1, 1)), (0.1, 4, 40, _prompt(0, 4, 2)),
            (0.2, 36, 2, _prompt(0, 36, 3)), (0.3, 36, 2, _prompt(32, 4, 4))]
    sched = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=128)
    cache = CacheConfig(block_size=4, num_gpu_blocks=64, enable_prefix_caching=True)
    run = simulate(make_requests(rows), sched, cache, "lpm", {"max_queue": 1})
    assert run.admitted == [0, 1, 2, 3]


@SETTINGS
@given(workloads(), st.sampled_from([None, 0.02, 0.1]))
def test_lpm_admits_the_longest_cached_prefix_and_the_guard_bounds_waits(w, max_wait):
    """Whenever a request is admitted for the first time, no request still waiting would
    have had more tokens served by the cache (what is cached then only shrinks for it),
    unless the admitted one was overdue; and nobody goes before an overdue request but
    an older overdue one."""
    reqs, sched, cache, _, _ = w
    cache = replace(cache, enable_prefix_caching=True)
    policy = _Lpm(max_wait_s=max_wait, max_queue=1000)
    seen: set[int] = set()

    def check(scheduler, out, admitted, waiting):
        for a in admitted:
            if a.request_id in seen:
                continue   # readmitted after a recompute: cached_tokens is the first admission's
            seen.add(a.request_id)
            a_overdue = max_wait is not None and out.now - a.arrival_s >= max_wait
            for wr in waiting:
                if max_wait is not None and out.now - wr.arrival_s >= max_wait:
                    assert a_overdue and a.arrival_s <= wr.arrival_s
                elif not a_overdue:
                    assert a.cached_tokens >= policy.probe(wr), \
                        f"admitted {a.request_id} ({a.cached_tokens} cached) before " \
                        f"{wr.request_id} ({policy.probe(wr)} cached)"

    simulate(reqs, sched, cache, policy, on_schedule=_newly_admitted_checker(check))


def test_lpm_options_and_flags():
    assert make_policy("lpm").describe() == {"name": "lpm", "max_wait_s": 30.0, "max_queue": 128}
    assert make_policy("lpm", max_wait_s=None, max_queue=4).max_queue == 4
    with pytest.raises(ValueError, match="max_queue"):
        make_policy("lpm", max_queue=0)
    with pytest.raises(ValueError, match="max_wait_s"):
        make_policy("lpm", max_wait_s=-1.0)
    assert {f.flag for f in LongestPrefixMatchPolicy.flags} == {"lpm-max-wait-s", "lpm-max-queue"}
