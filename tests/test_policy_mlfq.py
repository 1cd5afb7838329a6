"""FastServe's skip-join MLFQ (policies/mlfq.py): levels, demotion, starvation promotion,
preemption of demoted requests, the fast-forward's bound, and the paper's claim."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelab.config import CacheConfig, SchedulerConfig
from servelab.policies import make_policy, mlfq
from servelab.request import Request

from sched_harness import make_requests, simulate
from test_scheduler_policies import _newly_admitted_checker
from test_scheduler_properties import workloads


def _with_output(req: Request, drawn: int) -> Request:
    req.seqs[0].num_output_tokens = drawn
    return req


def test_skip_join_and_demotion_follow_the_quanta():
    """Quanta 32, 64, 128, ... output tokens; a prompt token costs 1/16 of one. A
    100-token prompt (6.25) joins level 0, a 1000-token one (62.5) skips to level 1; each
    is demoted once it drew its level's quantum."""
    p = make_policy("mlfq")
    assert p.quanta == [32, 64, 128, 256, 512, 1024]
    short, long_ = Request(0, 0.0, 100, 10_000), Request(1, 0.0, 1000, 10_000)
    assert [p.level(_with_output(short, n)) for n in (0, 31, 32, 95, 96)] == [0, 0, 1, 1, 2]
    assert [p.level(_with_output(long_, n)) for n in (0, 63, 64, 191, 192)] == [1, 1, 2, 2, 3]
    assert p.level(_with_output(short, 10**6)) == 5   # the last level has no end


def _reference_level(p, req: Request) -> int:
    """The level walked level by level: join where the prefill's price fits a quantum,
    then drop one level per quantum drawn (counted from promotion, if promoted)."""
    if req.request_id in p._promoted:
        level, left = 0, req.num_output_tokens - p._promoted[req.request_id]
    else:
        price = req.prompt_len / p.prefill_ratio
        level = next((i for i, q in enumerate(p.quanta) if q >= price), p.num_levels - 1)
        left = req.num_output_tokens
    while level < p.num_levels - 1 and left >= p.quanta[level]:
        left -= p.quanta[level]
        level += 1
    return level


_OPTIONS = st.fixed_dictionaries({
    "quantum_tokens": st.sampled_from([1, 3, 32]), "quantum_ratio": st.sampled_from([1.0, 1.5, 2.0]),
    "num_levels": st.sampled_from([1, 2, 6]), "prefill_tokens_per_output_token": st.sampled_from([1.0, 16.0])})
_RUNNING = st.lists(st.tuples(st.integers(1, 3000), st.integers(0, 400), st.booleans()),
                    min_size=1, max_size=4)


@settings(max_examples=100, deadline=None)
@given(_OPTIONS, _RUNNING, st.integers(1, 3000))
def test_levels_and_the_preemption_bound_match_a_walk_token_by_token(options, running, head_prompt):
    """`level` equals the level walked quantum by quantum (promoted requests counted from
    promotion), and `tokens_until_preemptible` is exactly the fewest tokens one running
    request must draw before the waiting head may preempt it (found by drawing them)."""
    p = make_policy("mlfq", **options, max_wait_s=None)
    head = Request(99, 0.0, head_prompt, 10_000)
    p.add(head, 0.0)
    reqs = []
    for i, (prompt, drawn, promoted) in enumerate(running):
        req = _with_output(Request(i, 0.0, prompt, 10_000), drawn)
        if promoted:
            p._promoted[i] = drawn // 2
        reqs.append(req)
        assert p.level(req) == _reference_level(p, req)
        assert p.may_preempt_for(head, req) == (_reference_level(p, req) > p.level(head))

    def first_preemptible(req: Request) -> int | None:
        start, first = req.seqs[0].num_output_tokens, None
        for t in range(sum(p.quanta) + 1):   # by then it is at the last level
            req.seqs[0].num_output_tokens = start + t
            assert p.level(req) == _reference_level(p, req)
            if first is None and p.may_preempt_for(head, req):
                first = t
        req.seqs[0].num_output_tokens = start
        return first   # None: never (it would have to sink below the last level)

    bound = p.tokens_until_preemptible([head], reqs)
    found = [t for t in map(first_preemptible, reqs) if t is not None]
    assert bound == (min(found) if found else mlfq.NEVER)


def test_overdue_request_is_admitted_first_and_promoted_to_the_top():
    """A request that waited max_wait_s jumps every level and, once admitted, restarts at
    level 0 (its demotions counted from there)."""
    p = make_policy("mlfq", max_wait_s=1.0)
    old = _with_output(Request(0, 0.0, 8, 10_000), 500)   # preempted after 500 tokens: level 4
    p.requeue(old, 0.0)
    fresh = Request(1, 0.5, 8, 10)
    p.add(fresh, 0.5)
    assert p.peek(0.9) is fresh and p.level(old) == 4
    assert p.peek(1.0) is old
    p.remove(old)
    assert p.level(old) == 0
    assert p.level(_with_output(old, 532)) == 1


def _long_then_short(preemptive: bool, fast_forward: bool = False):
    """A (short prompt, 120 tokens) fills most of a 10-block cache; B (64-token prompt:
    level 1 at one prompt token per output token) arrives when it no longer fits. A is at
    level 1 then; it sinks to level 2 after 96 tokens, and from then on B may preempt it."""
    reqs = make_requests([(0.0, 16, 120), (0.855, 64, 4)])
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, chunked_prefill=None,
                            max_model_len=512)
    cache = CacheConfig(block_size=16, num_gpu_blocks=10, watermark=0.0)
    return simulate(reqs, sched, cache, "mlfq",
                    {"preemptive": preemptive, "prefill_tokens_per_output_token": 1.0,
                     "max_wait_s": None}, fast_forward=fast_forward)


def test_a_demoted_request_is_preempted_for_a_higher_level_one():
    """Token-level preemption as this engine allows it: B waits while A is at its own
    level, and preempts A as soon as A is demoted below it; without preemption B waits
    for A to finish."""
    preempting = _long_then_short(preemptive=True)
    a, b = sorted(preempting.records, key=lambda r: r.request_id)
    assert a.num_preemptions == 1 and b.finish_s < a.finish_s
    assert b.scheduled_s == pytest.approx(0.97, abs=0.015)   # A drew its 96th token
    waiting = _long_then_short(preemptive=False)
    a, b = sorted(waiting.records, key=lambda r: r.request_id)
    assert a.num_preemptions == 0 and b.scheduled_s > a.finish_s - 0.02


def test_fast_forward_stops_where_a_demotion_lets_a_waiting_request_preempt():
    """The run of A's decodes after B arrived would pass A's demotion; the fast-forward
    ends there, so the records equal a step-by-step run's (and some steps were skipped)."""
    slow = _long_then_short(preemptive=True)
    fast = _long_then_short(preemptive=True, fast_forward=True)
    assert fast.fast_forwarded > 0
    assert sorted(fast.records, key=lambda r: r.request_id) == \
        sorted(slow.records, key=lambda r: r.request_id)
    assert sum(r.num_preemptions for r in fast.records) == 1


def _heavy_tailed(seed: int, n: int = 150) -> list[Request]:
    """20 req/s, Poisson; output lengths Pareto (shape 1.1, from 8 tokens, at most 600):
    most requests are short, a few are very long."""
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for i in range(n):
        t += rng.expovariate(20.0)
        out = min(600, int(8 * rng.paretovariate(1.1)))
        reqs.append(Request(i, t, rng.randint(16, 64), out))
    return reqs


@pytest.mark.parametrize("seed", [0, 2, 3])
def test_mlfq_cuts_mean_latency_on_a_heavy_tailed_mix(seed):
    """FastServe's premise (Wu et al. 2023: FCFS lets long jobs block the short ones
    behind them; an MLFQ approximates least attained service without knowing output
    lengths, which beats FCFS on mean response time when job sizes are heavy-tailed,
    Righter & Shanthikumar 1989): on a heavy-tailed output mix whose long
    requests fill the KV cache (48 blocks of 16), MLFQ preempts the long requests once
    they are demoted (by swap, keeping their KV as FastServe does) and lets the short
    ones through. Mean latency falls by more than half against FCFS (measured 0.39x,
    0.28x, 0.22x on these seeds), every request served."""
    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, chunked_prefill=256,
                            preemption="swap", max_model_len=1024)
    cache = CacheConfig(block_size=16, num_gpu_blocks=48, num_cpu_blocks=512, watermark=0.0)
    mean = {}
    for policy in ("fcfs", "mlfq"):
        run = simulate(_heavy_tailed(seed), sched, cache, policy, fast_forward=True)
        assert all(r.status == "finished" for r in run.records)
        mean[policy] = sum(r.finish_s - r.arrival_s for r in run.records) / len(run.records)
    assert mean["mlfq"] < 0.5 * mean["fcfs"], mean


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.sampled_from([None, 0.02, 0.1]), st.booleans())
def test_admits_by_level_and_overdue_requests_first(w, max_wait, preemptive):
    """Every admission from the waiting queue takes a request at the highest level that
    waits, unless one waited max_wait_s: then it takes an overdue one (promoted). (This
    found a request preempted twice coming back under its first, stale key:
    `KeyedQueue` now keeps only a request's latest entry.)"""
    reqs, sched, cache, _, _ = w

    def check(scheduler, out, admitted, waiting):
        pol = scheduler.policy
        for a in admitted:
            promoted = a.request_id in pol._promoted
            for wr in waiting:
                if max_wait is not None and out.now - pol._since[wr.request_id] >= max_wait:
                    assert promoted, f"admitted {a.request_id} while {wr.request_id} was overdue"
                elif not promoted:
                    assert pol.level(a) <= pol.level(wr)

    simulate(reqs, sched, cache, "mlfq", {"max_wait_s": max_wait, "preemptive": preemptive,
                                          "quantum_tokens": 2, "prefill_tokens_per_output_token": 4.0},
             on_schedule=_newly_admitted_checker(check))


def test_starvation_guard_bounds_the_wait_of_a_long_prompt():
    """A 2,000-token prompt (the last level) behind a stream of short requests, one
    running at a time: without the guard it waits for the whole stream; with
    max_wait_s=5 it is admitted once the running request ends after it became overdue."""
    rows = [(0.0, 8, 50), (0.1, 2000, 5)] + [(0.2 + 0.5 * i, 8, 50) for i in range(60)]
    sched = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=4096, chunked_prefill=None,
                            max_model_len=4096)
    cache = CacheConfig(block_size=16, num_gpu_blocks=400)
    starved = simulate(make_requests(rows), sched, cache, "mlfq", {"max_wait_s": None})
    guarded = simulate(make_requests(rows), sched, cache, "mlfq", {"max_wait_s": 5.0})
    assert {r.request_id: r.scheduled_s for r in starved.records}[1] > 25.0
    assert {r.request_id: r.scheduled_s for r in guarded.records}[1] <= 0.1 + 5.0 + 0.5
