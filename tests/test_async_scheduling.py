"""vLLM's asynchronous scheduling in the simulator (`simulator/async_scheduling.py`): a
request that arrives while a step runs is first scheduled a step later than a
synchronous engine would; one that meets an engine with nothing in flight is scheduled
at once; the fast-forward keeps results those of stepping one by one."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_data_parallel import ROWS, _trace   # traces of (gap, prompt, output) rows

from servelab.config import CacheConfig, SchedulerConfig
from servelab.outputs import BatchShape
from servelab.request import Request
from servelab.simulator.async_scheduling import AsyncScheduling
from servelab.simulator.cost_model import CostModel
from servelab.simulator.engine import Cluster
from servelab.simulator.router import make_router
from servelab.simulator.speed import build_scheduler

COST = CostModel("llama-2-7b", "a100-80gb")
TINY_EP2 = CostModel("tiny-moe", "h100-sxm", ep=2)


def cluster(requests, *, lag: bool, fast_forward: bool = True, replicas: int = 1,
            cost: CostModel = COST, lock_step: int = 1, router: str = "round-robin") -> Cluster:
    sched = SchedulerConfig(max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=512,
                            chunked_prefill=512)
    cache = CacheConfig(num_gpu_blocks=1024)
    return Cluster([build_scheduler(sched, cache, "fcfs") for _ in range(replicas)], cost,
                   make_router(router, replicas), requests, fast_forward=fast_forward,
                   lock_step_ranks=lock_step, async_scheduling=lag)


def prefill(tokens: int) -> float:
    return COST.step_time(BatchShape(1, tokens, 0, 0, tokens * tokens))


def starts(c: Cluster) -> list[float]:
    return [s.start_s for s in c.step_records()]


@pytest.mark.parametrize("fast_forward", [True, False])
def test_an_arrival_during_a_step_is_scheduled_a_step_later_than_without(fast_forward):
    d0 = prefill(64)
    reqs = lambda: [Request(0, 0.0, 64, 50), Request(1, d0 / 2, 32, 5)]   # noqa: E731
    sync = cluster(reqs(), lag=False, fast_forward=fast_forward)
    sync.run()
    lagged = cluster(reqs(), lag=True, fast_forward=fast_forward)
    lagged.run()
    s0, s1 = sync.request_records()
    a0, a1 = lagged.request_records()
    assert s0.scheduled_s == a0.scheduled_s == 0.0           # an idle engine: at once
    assert s1.scheduled_s == d0                              # the next step
    second = starts(lagged)[2]                               # the step after the next
    assert starts(lagged)[1] == d0 and a1.scheduled_s == second > d0
    assert lagged.step_records()[1].num_prefill_tokens == 0  # step 2: request 0's decode only


def test_a_request_queued_when_nothing_is_in_flight_is_scheduled_at_once():
    """Request 0 finishes in its prefill step, so the engine forms no batch behind it:
    request 1, queued at that step's end, runs in the next step."""
    d0 = prefill(64)
    c = cluster([Request(0, 0.0, 64, 1), Request(1, d0 / 2, 32, 5)], lag=True)
    c.run()
    first, second = c.request_records()
    assert first.finish_s == d0
    assert second.scheduled_s == d0


def test_a_lock_step_rank_with_nothing_in_flight_schedules_its_arrival_at_once():
    """Round-robin: requests 0 and 2 go to rank 0, 1 and 3 to rank 1. Rank 1's request
    finishes in the first step, so request 3, which arrived during it, runs in the next;
    rank 0 still runs request 0, so request 2 waits a step more."""
    reqs = [Request(0, 0.0, 64, 50), Request(1, 0.0, 64, 1), Request(2, 1e-4, 8, 5),
            Request(3, 1e-4, 8, 5)]
    c = cluster(reqs, lag=True, replicas=2, cost=TINY_EP2, lock_step=2, fast_forward=False)
    c.run()
    r = {rec.request_id: rec for rec in c.request_records()}
    boundary = r[1].finish_s
    assert r[0].scheduled_s == r[1].scheduled_s == 0.0
    assert r[3].scheduled_s == boundary
    assert r[2].scheduled_s > boundary


def test_the_keeper_hands_back_requests_at_the_right_boundary():
    lag = AsyncScheduling()
    a, b, c = (Request(i, 0.0, 8, 2) for i in range(3))
    assert not lag.hold(a)                    # nothing in flight: schedule now
    lag.step_started()
    assert lag.hold(a) and lag.hold(b)
    assert lag.step_ended() == [] and lag.queued == [a, b]
    lag.step_started()
    assert lag.hold(c)
    assert lag.step_ended() == [a, b] and lag.queued == [c]
    assert lag.nothing_in_flight() == [c] and not lag.keeps_any


def _same_records(fast: Cluster, slow: Cluster) -> None:
    for a, b in zip(fast.request_records(), slow.request_records(), strict=True):
        assert (a.request_id, a.status, a.output_tokens, a.num_preemptions) == \
            (b.request_id, b.status, b.output_tokens, b.num_preemptions)
        for name in ("scheduled_s", "first_token_s", "finish_s"):
            assert getattr(a, name) == pytest.approx(getattr(b, name), rel=1e-9, abs=1e-12)


@settings(max_examples=30, deadline=None)
@given(rows=ROWS, replicas=st.sampled_from([1, 2]))
def test_property_fast_forward_equals_stepping_one_by_one(rows, replicas):
    runs = []
    for ff in (True, False):
        c = cluster(_trace(rows), lag=True, fast_forward=ff, replicas=replicas,
                    router="least-outstanding")
        c.run()
        runs.append(c)
    _same_records(*runs)


@settings(max_examples=20, deadline=None)
@given(rows=ROWS)
def test_property_lock_step_group_fast_forward_equals_stepping_one_by_one(rows):
    runs = []
    for ff in (True, False):
        c = cluster(_trace(rows), lag=True, fast_forward=ff, replicas=2, cost=TINY_EP2, lock_step=2)
        c.run()
        runs.append(c)
    _same_records(*runs)
    assert runs[0].groups[0].dummy_steps == runs[1].groups[0].dummy_steps


@settings(max_examples=40, deadline=None)
@given(rows=ROWS)
def test_property_an_arrival_during_a_step_skips_the_next_unless_nothing_else_runs_in_it(rows):
    """Stepping one by one: a request that arrives while a step runs is queued at that
    step's end e, and may start at e only if the engine then had nothing else to run
    (no other request in progress at e): otherwise the batch at e was formed before it
    was queued. It is never scheduled before e."""
    c = cluster(_trace(rows), lag=True, fast_forward=False)
    c.run()
    spans = [(s.start_s, s.start_s + s.duration_s) for s in c.step_records()]
    records = list(c.request_records())
    lagged = 0
    for rec in records:
        assert rec.status == "finished"
        under_way = [e for b, e in spans if b < rec.arrival_s < e]
        if not under_way:
            continue
        e = under_way[0]
        assert rec.scheduled_s >= e
        if rec.scheduled_s == e:
            assert not [r for r in records if r.scheduled_s < e < r.finish_s]
        else:
            lagged += 1
    if len(rows) > 1 and all(gap == 0.002 for gap, _, _ in rows[1:]) and \
            all(p >= 200 and out >= 2 for _, p, out in rows):
        # prefills of >= 200 tokens outlast 2 ms gaps, and a request with a second token
        # to make is still running when the step that took its prefill ends (one with a
        # single output token finishes there, and the next may start at once)
        assert lagged
