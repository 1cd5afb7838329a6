"""Least slack first (policies/lsf.py): the waiting order prices each request's prefill,
and the victim is the running request with the most TPOT slack."""
from __future__ import annotations

from servelab.config import CacheConfig, SchedulerConfig
from servelab.policies import make_policy
from servelab.request import Request

from sched_harness import make_requests, simulate


def test_between_equal_deadlines_the_longer_prompt_goes_first():
    """Both are due 1 s after arrival; the 5,000-token prompt needs 0.5 s of prefill at
    10,000 tokens/s, so its slack is the smaller one. A request without an SLO is due
    after the default 10 s."""
    p = make_policy("lsf")
    short = Request(0, 0.0, 10, 5, slo_ttft_ms=1000.0)
    long_ = Request(1, 0.2, 5000, 5, slo_ttft_ms=1000.0)
    loose = Request(2, 0.0, 10, 5)
    for r in (short, long_, loose):
        p.add(r, 0.2)
    assert [r.request_id for r in p.waiting(0.2)] == [1, 0, 2]
    assert make_policy("edf").waiting_key(short) < make_policy("edf").waiting_key(long_)


def test_a_running_request_whose_next_token_is_due_soonest_is_preempted_last():
    """Next-token deadlines: first_token_s + k · TPOT SLO after k tokens. A (2 tokens at a
    10 ms TPOT, first token at 1 s) is due at 1.02 s; B (the default 200 ms) at 1.4 s:
    B has the slack and is the victim."""
    p = make_policy("lsf")
    a = Request(0, 0.0, 10, 50, slo_tpot_ms=10.0)
    b = Request(1, 0.0, 10, 50)
    for r in (a, b):
        r.first_token_s = 1.0
        s = r.seqs[0]
        s.num_output_tokens, s.num_tokens, s.num_computed_tokens, s.prefill_len = 2, 12, 11, 10
    assert p.next_deadline(a) == 1.0 + 2 * 0.01 and p.next_deadline(b) == 1.0 + 2 * 0.2
    assert max((a, b), key=lambda r: p.victim_key(r, 0)) is b


def test_memory_pressure_preempts_the_request_with_tpot_slack():
    """Two requests decode in a cache that cannot hold both to the end; the one with the
    tight TPOT SLO (admitted first, so FCFS would keep it) is kept by lsf too, and the one
    with slack is preempted — while edf, by TTFT deadline, preempts the tight one."""
    reqs = make_requests([(0.0, 16, 40, {"slo_tpot_ms": 5.0, "slo_ttft_ms": 10_000.0}),
                          (0.0, 16, 40, {"slo_tpot_ms": 500.0, "slo_ttft_ms": 100.0})])
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, chunked_prefill=None)
    cache = CacheConfig(block_size=8, num_gpu_blocks=12, watermark=0.0)
    victims = {}
    for policy in ("lsf", "edf"):
        run = simulate([r.fresh_copy() for r in reqs], sched, cache, policy)
        victims[policy] = [r.request_id for r in run.records if r.num_preemptions]
    assert victims == {"lsf": [1], "edf": [0]}
