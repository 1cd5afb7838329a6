"""Timelines of the SimPy engine: exact step times, idling, arrival order and tie-breaks,
fast-forward rows, rejections, the simulated executor and the routers."""
from __future__ import annotations

import math

import pytest

from servelab.config import CacheConfig, SchedulerConfig
from servelab.outputs import BatchShape, ScheduledSeq, ScheduledWork, SchedulerOutput
from servelab.simulator.speed import build_scheduler
from servelab.request import Request
from servelab.simulator.cost_model import CostModel
from servelab.simulator.engine import Cluster
from servelab.simulator.executor import SimulatedExecutor
from servelab.simulator.router import (LeastOutstandingRouter, PrefixAffinityRouter,
                                       RoundRobinRouter, make_router)

COST = CostModel("llama-2-7b", "a100-80gb")


def cluster(requests, sched=None, cache=None, policy="fcfs", replicas=1, router="round-robin",
            fast_forward=True) -> Cluster:
    sched = sched or SchedulerConfig(max_model_len=4096)
    cache = cache or CacheConfig(num_gpu_blocks=1024)
    schedulers = [build_scheduler(sched, cache, policy) for _ in range(replicas)]
    return Cluster(schedulers, COST, make_router(router, replicas), requests, fast_forward=fast_forward)


def prefill(tokens: int, context: int = 0) -> float:
    return COST.step_time(BatchShape(1, tokens, context, tokens * context, tokens * tokens))


def decode(context_sum: int, seqs: int = 1) -> float:
    return COST.step_time(BatchShape(num_decode_seqs=seqs, decode_context_sum=context_sum))


@pytest.mark.parametrize("fast_forward", [True, False])
def test_one_request_timeline(fast_forward):
    c = cluster([Request(0, 1.5, 100, 5)], fast_forward=fast_forward)
    c.run()
    rec, = c.request_records()
    d0 = prefill(100)
    decodes = [decode(101 + j) for j in range(4)]   # contexts 100..103, +1 for the new token
    assert rec.status == "finished" and rec.output_tokens == 5
    assert rec.scheduled_s == 1.5
    assert rec.first_token_s == 1.5 + d0
    assert math.isclose(rec.finish_s, 1.5 + d0 + sum(decodes), rel_tol=1e-12)
    steps = [(s.start_s, s.num_prefill_tokens, s.num_decode_tokens, s.num_steps) for s in c.step_records()]
    if fast_forward:   # three decodes in closed form; the last one (which finishes) is a step
        assert [row[1:] for row in steps] == [(100, 0, 1), (0, 1, 3), (0, 1, 1)]
        run = c.step_records()[1]
        assert run.decode_context_sum == 101
        assert math.isclose(run.duration_s, sum(decodes[:3]), rel_tol=1e-12)
    else:
        assert [row[1:] for row in steps] == [(100, 0, 1)] + [(0, 1, 1)] * 4


def test_idle_engine_sleeps_until_the_next_arrival():
    reqs = [Request(0, 0.0, 50, 20), Request(1, 100.0, 50, 20)]
    c = cluster(reqs)
    sched = c.replicas[0].scheduler
    calls = []
    schedule = sched.schedule
    sched.schedule = lambda now: calls.append(now) or schedule(now)
    c.run()
    first, second = c.request_records()
    assert second.scheduled_s == 100.0       # woken exactly at the arrival
    assert not [s for s in c.step_records() if first.finish_s <= s.start_s < 100.0]
    steps = c.step_records()
    # one schedule() per step, plus one per wake-up and one on going idle: no polling
    assert len(calls) <= len(steps) + 2 * len(reqs)


def test_equal_arrival_times_are_released_in_trace_order():
    # ids out of order on purpose: trace order, not id order, decides who is queued first
    reqs = [Request(5, 1.0, 10, 3), Request(3, 1.0, 10, 3), Request(4, 1.0, 10, 3)]
    c = cluster(reqs, sched=SchedulerConfig(max_model_len=4096, waiting_queue_limit=1))
    c.run()
    status = {r.request_id: (r.status, r.reject_reason) for r in c.request_records()}
    assert status[5] == ("finished", "")
    assert status[3][0] == status[4][0] == "rejected"
    assert "waiting queue full" in status[3][1]


@pytest.mark.parametrize("fast_forward", [True, False])
def test_an_arrival_at_a_step_end_joins_the_next_step(fast_forward):
    d0 = prefill(64)
    reqs = [Request(0, 0.0, 64, 50), Request(1, d0, 32, 5)]
    c = cluster(reqs, fast_forward=fast_forward)
    c.run()
    first, second = c.request_records()
    assert first.first_token_s == d0
    assert second.scheduled_s == d0          # not one step later
    step = c.step_records()[1]
    assert (step.start_s, step.num_prefill_tokens, step.num_decode_tokens) == (d0, 32, 1)


def test_a_run_takes_the_step_under_way_at_an_arrival_and_publishes_a_reject_with_it():
    """An arrival in the middle of a decode step only joins the next one, so the run
    ends with that step, not before it; a request rejected on arrival then is
    published (what a router sees) when the next step ends, as stepping one by one."""
    d0 = prefill(64)
    at = d0 + 20.5 * decode(65)   # halfway through the 21st decode step
    runs = {}
    for fast_forward in (True, False):
        c = cluster([Request(0, 0.0, 64, 100), Request(1, at, 5000, 4)], fast_forward=fast_forward)
        published = None
        while c.env.peek() < math.inf:
            c.env.step()
            if published is None and c.replicas[0].records:
                published = c.env.now
        runs[fast_forward] = published, [(s.start_s, s.num_steps) for s in c.step_records()]
    (fast_published, fast_rows), (slow_published, slow_rows) = runs[True], runs[False]
    assert fast_rows[1][1] == 21               # 20 whole decode steps + the one under way
    assert math.isclose(fast_rows[2][0], slow_rows[22][0], rel_tol=1e-12)
    assert slow_published == pytest.approx(slow_rows[23][0], rel=1e-12)  # the next step's end
    assert fast_published == pytest.approx(slow_published, rel=1e-12)


def test_a_request_that_can_never_run_is_rejected_at_arrival():
    reqs = [Request(0, 0.5, 5000, 4), Request(1, 0.7, 10, 4)]
    c = cluster(reqs)
    c.run()
    rejected, ok = c.request_records()
    assert rejected.status == "rejected" and "max_model_len" in rejected.reject_reason
    assert rejected.finish_s == 0.5
    assert ok.status == "finished"
    assert c.replicas[0].outstanding == 0


def test_long_decodes_are_fast_forwarded_into_few_rows():
    def reqs():   # fresh objects for each run: a scheduler keeps its state in them
        return [Request(i, 0.01 * i, 200, 1000) for i in range(8)]

    fast, slow = cluster(reqs()), cluster(reqs(), fast_forward=False)
    fast.run()
    slow.run()
    rows = fast.step_records()
    assert sum(s.num_steps for s in rows) == len(slow.step_records()) >= 1000
    assert len(rows) < 40
    for a, b in zip(fast.request_records(), slow.request_records()):
        assert math.isclose(a.finish_s, b.finish_s, rel_tol=1e-9)


def test_simulated_executor_prices_the_step_and_draws_no_tokens():
    out = SchedulerOutput(0.0, ScheduledWork([ScheduledSeq(0, (0, 0), 128, 0, 1, True),
                                              ScheduledSeq(1, (1, 0), 1, 700, 1, False)]),
                          swap_in=[(3, 4)])
    result = SimulatedExecutor(COST).execute(out)
    assert result.sampled is None
    assert result.duration_s == COST.step_time(BatchShape.from_output(out))
    assert result.duration_s > COST.step_time(BatchShape(1, 128, 0, 0, 128 * 128, 1, 701))  # swap costs


def test_compact_decodes_price_as_their_listed_entries():
    """A step's work prices the same whether its plain decodes come as compact rows or
    listed one by one, and reads the same entries."""
    rows = ((0, (0, 0), 10), (1, (1, 0), 33))
    listed = [ScheduledSeq(2, (2, 0), 64, 16, 0, True), ScheduledSeq(3, (3, 1), 1, 40, 1, False)]
    compact = ScheduledWork(listed, rows, 7, (10 + 8) + (33 + 8))
    spelled = ScheduledWork(list(compact))
    assert list(spelled) == [ScheduledSeq(0, (0, 0), 1, 17, 1, False),
                             ScheduledSeq(1, (1, 0), 1, 40, 1, False), *listed]
    assert compact == spelled and len(compact) == 4
    assert BatchShape.from_output(SchedulerOutput(0.0, compact)) == \
        BatchShape.from_output(SchedulerOutput(0.0, spelled))
    assert compact.prefill_continues() and not ScheduledWork(listed[1:], rows, 7).prefill_continues()


def test_a_trace_replays_from_columns_and_served_requests_are_let_go():
    from servelab.traces.record import Trace, TraceRecord
    trace = Trace([TraceRecord(0.01 * i, 40 + i % 7, 3 + i % 5) for i in range(300)])
    for replicas in (1, 2):
        made, listed = cluster(trace.requests(), replicas=replicas), \
            cluster(trace.to_requests(), replicas=replicas)
        made.run()
        listed.run()
        assert list(made.request_records()) == list(listed.request_records())
        assert list(made.step_records()) == list(listed.step_records())
        assert all(not r.scheduler.requests for r in made.replicas)  # nothing kept once done


def test_requests_must_come_in_arrival_order():
    with pytest.raises(ValueError, match="arrival order"):
        cluster([Request(0, 2.0, 10, 3), Request(1, 1.0, 10, 3)])


# --- routers ---------------------------------------------------------------------------

def test_round_robin_assigns_up_front():
    reqs = [Request(i, 0.0, 10, 3) for i in range(7)]
    assert RoundRobinRouter(3).assign_upfront(reqs) == [0, 1, 2, 0, 1, 2, 0]


def test_least_outstanding_takes_the_emptiest_lowest_index():
    r = LeastOutstandingRouter(4)
    assert r.route(Request(0, 0.0, 10, 3), [3, 1, 1, 2]) == 1
    assert r.assign_upfront([]) is None


def test_prefix_affinity_sticks_to_a_prefix_and_balances_beyond_the_limit():
    r = PrefixAffinityRouter(3, affinity_tokens=4, max_imbalance=2)
    a = Request(0, 0.0, 8, 3, prompt_token_ids=(1, 2, 3, 4, 5, 6, 7, 8))
    a2 = Request(1, 0.0, 6, 3, prompt_token_ids=(1, 2, 3, 4, 9, 9))
    other = Request(2, 0.0, 6, 3, prompt_token_ids=(7, 7, 7, 7, 7, 7))
    plain = Request(3, 0.0, 6, 3)
    assert r.route(a, [2, 0, 1]) == 1                 # new prefix: least loaded
    assert r.route(a2, [2, 3, 1]) == 1                # same leading tokens: same replica
    assert r.route(other, [2, 3, 1]) == 2
    assert r.route(plain, [0, 3, 1]) == 0             # no prefix information
    assert r.route(a, [0, 3, 1]) == 0                 # 3 - 0 > 2: moves to the least loaded
    assert r.route(a2, [1, 0, 0]) == 0                # ... and stays there
    hashed = Request(4, 0.0, 40, 3, prefix_hashes=(11, 12, 13), prefix_block_size=16)
    assert r.route(hashed, [5, 5, 0]) == 2


def test_unknown_router_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown router 'random'.*round-robin"):
        make_router("random", 2)


def test_least_outstanding_spreads_a_burst_over_replicas():
    reqs = [Request(i, 0.0, 500, 200) for i in range(6)]
    c = cluster(reqs, replicas=3, router="least-outstanding")
    c.run()
    assert [len(r.records) for r in c.replicas] == [2, 2, 2]
    assert all(r.outstanding == 0 for r in c.replicas)
    starts = [s.start_s for s in c.step_records()]
    assert starts == sorted(starts)


def test_step_record_field_order_is_what_the_positional_builders_assume():
    """`StepRecord.from_shape` (engine_step's and the fast-forward's builder) passes the
    fields positionally: a reordered field would silently swap columns, so the order is
    pinned here."""
    from servelab.records import StepRecord
    assert StepRecord.field_names() == [
        "start_s", "duration_s", "num_prefill_tokens", "num_decode_tokens", "num_prefill_seqs",
        "num_running", "num_waiting", "num_swapped", "kv_blocks_used", "kv_blocks_total",
        "num_preempted", "num_steps", "prefill_context_sum", "prefill_q_context_sum",
        "prefill_q_sq_sum", "decode_context_sum", "num_swap_blocks", "num_copy_blocks",
        "num_offload_blocks", "num_load_blocks"]
