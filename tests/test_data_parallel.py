"""The data-parallel ranks of a mixture-of-experts deployment step in lock-step
(`simulator/data_parallel.py`): every rank's step starts and ends together, a step lasts
as long as the slowest rank's price, the MoE layers are priced over the tokens all ranks
carry, an idle rank runs dummy steps while a peer works, the group's fast-forward equals
stepping one by one, and dense or dp == 1 clusters keep their independent replicas."""
from __future__ import annotations

import collections
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import SHARED
from servelab.config import CacheConfig, SchedulerConfig
from servelab.outputs import BatchShape
from servelab.simulator.speed import build_scheduler
from servelab.request import Request
from servelab.simulator.cost_model import CostModel
from servelab.simulator.engine import Cluster
from servelab.simulator.executor import SimulatedExecutor
from servelab.simulator.router import make_router

QWEN_EP2 = CostModel("qwen3-30b-a3b", "h100-sxm", ep=2)
TINY_EP2 = CostModel("tiny-moe", "h100-sxm", ep=2)


class RecordingExecutor(SimulatedExecutor):
    """The simulated executor, keeping each step's (start time, shape, own price)."""

    def __init__(self, cost_model: CostModel) -> None:
        super().__init__(cost_model)
        self.priced: dict[float, tuple[BatchShape, float]] = {}

    def execute(self, output):
        result = super().execute(output)
        self.priced[output.now] = (result.shape, result.duration_s)
        return result


def group_cluster(requests, cost=TINY_EP2, *, fast_forward=False, router="round-robin",
                  max_num_seqs=8, blocks=2048):
    sched = SchedulerConfig(max_model_len=4096, max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=512, chunked_prefill=512)
    cache = CacheConfig(num_gpu_blocks=blocks)
    executors = [RecordingExecutor(cost) for _ in range(2)]
    cluster = Cluster([build_scheduler(sched, cache, "fcfs") for _ in range(2)], cost,
                      make_router(router, 2), requests, fast_forward=fast_forward,
                      executors=executors, lock_step_ranks=2)
    return cluster, executors


def moe_part(cost: CostModel, shape: BatchShape) -> float:
    """The MoE layers and EP exchange of a step as `breakdown` prices them."""
    parts = cost.breakdown(shape)
    return sum(parts[k].time_s for k in ("moe_experts", "ep_dispatch", "ep_combine") if k in parts)


def tokens(shape: BatchShape) -> int:
    return shape.num_prefill_tokens + shape.num_decode_seqs


# --------------------------------------------------------------------------- pricing


def test_the_moe_layers_are_priced_over_the_tokens_every_rank_carries():
    """A rank's lock-step price is its own step with the MoE layers (and the EP exchange)
    over the group's tokens, not dp × its own."""
    mine = BatchShape(num_decode_seqs=8, decode_context_sum=8 * 500)
    peer = BatchShape(num_decode_seqs=56, decode_context_sum=56 * 500)   # together: 64 tokens
    even = BatchShape(num_decode_seqs=32, decode_context_sum=32 * 500)   # dp × 32 = 64 tokens
    price = QWEN_EP2.step_time(mine) + QWEN_EP2.lockstep_correction(8, 64)
    assert price == pytest.approx(QWEN_EP2.step_time(mine) - moe_part(QWEN_EP2, mine)
                                  + moe_part(QWEN_EP2, even), rel=1e-9)
    # more tokens in the group cost this rank more, and balanced ranks need no correction
    assert QWEN_EP2.lockstep_correction(8, 64) > 0 > QWEN_EP2.lockstep_correction(8, 9)
    assert QWEN_EP2.lockstep_correction(32, 64) == 0.0
    assert QWEN_EP2.step_time(peer) + QWEN_EP2.lockstep_correction(56, 64) > price


def test_a_dummy_step_is_one_token_through_the_layers_with_the_groups_moe():
    cost = QWEN_EP2
    one = BatchShape(num_decode_seqs=1, decode_context_sum=1)
    b = cost.breakdown(one)
    # no LM head, sampler or attention: the token rows of a one-token step, MoE over 33 tokens
    per_token = sum(op.time_s for name, op in b.items()
                    if name not in ("lm_head", "sampler", "attn_decode", "step_overhead",
                                    "moe_experts", "ep_dispatch", "ep_combine"))
    moe_33 = cost.lockstep_correction(0, 33)
    assert cost.dummy_step_time(33) == pytest.approx(cost.step_overhead_s + per_token + moe_33,
                                                     rel=1e-9)
    assert cost.dummy_step_time(33) < cost.step_time(one) + cost.lockstep_correction(1, 33)


@pytest.mark.parametrize("args, message", [
    ((3, 2), "rank_tokens must be an integer in [0, group_tokens=2]"),
    ((-1, 2), "rank_tokens must be an integer in [0, group_tokens=2]"),
])
def test_bad_token_counts_are_refused(args, message):
    with pytest.raises(ValueError) as exc:
        QWEN_EP2.lockstep_correction(*args)
    assert message in str(exc.value)


def test_lock_step_pricing_needs_data_parallel_ranks():
    for cost in (CostModel("llama-3.1-8b", "h100-sxm"), CostModel("qwen3-30b-a3b", "h100-sxm"),
                 CostModel("qwen3-30b-a3b", "h100-sxm", tp=2, ep=2)):
        assert cost.data_parallel_ranks == 1
        with pytest.raises(ValueError, match="lock-step pricing is for the data-parallel ranks"):
            cost.lockstep_correction(1, 2)


# --------------------------------------------------------------------------- timelines


def test_an_idle_rank_runs_dummy_steps_while_its_peer_works_and_the_steps_are_the_slowest_ranks():
    """One request: rank 0 works alone; rank 1 runs a dummy step every step, and the
    group's step lasts max(rank 0's price with MoE over 1 + 1 tokens, the dummy's)."""
    c, (busy, idle) = group_cluster([Request(0, 0.25, 300, 6)])
    c.run()
    steps = list(c.replicas[0].steps.table())
    assert len(steps) == 6 and not len(c.replicas[1].steps.table())
    assert c.groups[0].dummy_steps == [0, 6]
    assert not idle.priced
    now = 0.25
    for step in steps:
        shape, own = busy.priced[step.start_s]
        n = tokens(shape)
        expected = max(own + TINY_EP2.lockstep_correction(n, n + 1),
                       TINY_EP2.dummy_step_time(n + 1))
        assert step.start_s == now and step.duration_s == expected
        now += step.duration_s
    rec, = c.request_records()
    assert rec.finish_s == now


def test_ranks_step_together_and_each_step_lasts_as_long_as_the_slowest_rank():
    """A long prompt on rank 0 and short ones on rank 1: while both work their steps start
    at the same instants and share one duration, the largest of their lock-step prices
    (the other rank's plain decode waits for the long prefill)."""
    reqs = [Request(0, 0.0, 1500, 4), Request(1, 0.0, 20, 12), Request(2, 0.01, 1200, 3),
            Request(3, 0.01, 30, 10)]
    c, execs = group_cluster(reqs)
    c.run()
    by_start = collections.defaultdict(dict)
    for r, replica in enumerate(c.replicas):
        for step in replica.steps.table():
            by_start[step.start_s][r] = step.duration_s
    starts = sorted(by_start)
    both = [t for t in starts if len(by_start[t]) == 2]
    assert len(both) >= 5
    for t, nxt in zip(starts, starts[1:]):
        d = set(by_start[t].values())
        assert len(d) == 1                           # one duration for every rank
        assert nxt == pytest.approx(t + d.pop(), abs=1e-12)   # the next step starts at its end
    waited = 0
    for t in both:
        (s0, p0), (s1, p1) = execs[0].priced[t], execs[1].priced[t]
        total = tokens(s0) + tokens(s1)
        prices = [p0 + TINY_EP2.lockstep_correction(tokens(s0), total),
                  p1 + TINY_EP2.lockstep_correction(tokens(s1), total)]
        assert by_start[t][0] == max(prices)
        waited += prices[1] < prices[0]
    assert waited   # rank 1's cheap steps waited for rank 0's prefill at least once


def test_a_group_sleeps_without_events_while_no_rank_has_work():
    reqs = [Request(0, 0.0, 100, 3), Request(1, 500.0, 100, 3)]
    c, _ = group_cluster(reqs)
    c.run()
    first, second = c.request_records()
    assert first.finish_s < 1.0 and second.scheduled_s == 500.0
    # three steps on rank 0 for the first request, three on rank 1 for the second, each
    # with the other rank's dummy: none in the 499 s between
    assert [len(r.steps.table()) for r in c.replicas] == [3, 3]
    assert c.groups[0].dummy_steps == [3, 3]


def _trace(draw_rows) -> list[Request]:
    t, reqs = 0.0, []
    for i, (gap, prompt, out) in enumerate(draw_rows):
        t += gap
        reqs.append(Request(i, t, prompt, out))
    return reqs


ROWS = st.lists(st.tuples(st.sampled_from([0.0, 0.002, 0.01, 0.05, 0.3]),
                          st.integers(1, 900), st.integers(1, 40)), min_size=1, max_size=14)


@settings(max_examples=25, deadline=None)
@given(rows=ROWS, router=st.sampled_from(["round-robin", "least-outstanding"]))
def test_property_lock_step_timeline(rows, router):
    """Any trace: no two group steps overlap, ranks that step at an instant share its
    duration, that duration is the largest lock-step price (idle ranks: the dummy step),
    and an idle rank's dummy steps are the steps it sat out."""
    c, execs = group_cluster(_trace(rows), router=router, max_num_seqs=4)
    c.run()
    by_start = collections.defaultdict(dict)
    for r, replica in enumerate(c.replicas):
        for step in replica.steps.table():
            assert step.num_steps == 1
            by_start[step.start_s][r] = step.duration_s
    end = -math.inf
    sat_out = [0, 0]
    for t in sorted(by_start):
        durations = set(by_start[t].values())
        assert len(durations) == 1 and t >= end - 1e-12
        priced = {r: execs[r].priced[t] for r in by_start[t]}
        total = sum(tokens(s) for s, _ in priced.values()) + 2 - len(priced)
        prices = [p + TINY_EP2.lockstep_correction(tokens(s), total) for s, p in priced.values()]
        if len(priced) == 1:
            prices.append(TINY_EP2.dummy_step_time(total))
            sat_out[1 - next(iter(priced))] += 1
        d = durations.pop()
        assert d == max(prices)
        end = t + d
    assert c.groups[0].dummy_steps == sat_out
    assert len(c.request_records()) == len(rows)


@settings(max_examples=25, deadline=None)
@given(rows=ROWS, router=st.sampled_from(["round-robin", "least-outstanding"]))
def test_property_the_groups_fast_forward_equals_stepping_one_by_one(rows, router):
    runs = {}
    for ff in (True, False):
        c, _ = group_cluster(_trace(rows), router=router, fast_forward=ff, max_num_seqs=4)
        c.run()
        runs[ff] = c
    fast, slow = runs[True], runs[False]
    for a, b in zip(fast.request_records(), slow.request_records()):
        assert (a.request_id, a.status, a.output_tokens, a.num_preemptions) == \
            (b.request_id, b.status, b.output_tokens, b.num_preemptions)
        for name in ("scheduled_s", "first_token_s", "finish_s"):
            assert getattr(a, name) == pytest.approx(getattr(b, name), rel=1e-9, abs=1e-12)
    assert fast.groups[0].dummy_steps == slow.groups[0].dummy_steps
    for f, s in zip(fast.replicas, slow.replicas):
        fs, ss = f.steps.table(), s.steps.table()
        assert sum(r.num_steps for r in fs) == len(ss)


def test_the_groups_fast_forward_skips_steps_in_a_long_decode():
    reqs = [Request(0, 0.0, 200, 300), Request(1, 0.0, 150, 250)]
    fast, _ = group_cluster(reqs, fast_forward=True)
    fast.run()
    rows = [r for rep in fast.replicas for r in rep.steps.table()]
    assert max(r.num_steps for r in rows) > 100 and len(rows) < 20


# --------------------------------------------------------------------------- unchanged elsewhere


@pytest.mark.parametrize("model, ep", [("llama-3.1-8b", 1), ("qwen3-30b-a3b", 1)])
def test_replicas_without_data_parallel_ranks_stay_independent(model, ep):
    """Dense replicas (and MoE replicas without DP ranks) are not grouped: a 2-replica
    round-robin cluster gives each request exactly what a lone replica serving its share
    of the trace gives it."""
    cost = CostModel(model, "h100-sxm", ep=ep)
    sched = SchedulerConfig(max_model_len=4096, max_num_seqs=8)
    cache = CacheConfig(num_gpu_blocks=2048)
    reqs = [Request(i, 0.03 * i, 100 + 37 * i % 400, 5 + 7 * i % 30) for i in range(12)]
    pair = Cluster([build_scheduler(sched, cache, "fcfs") for _ in range(2)], cost,
                   make_router("round-robin", 2), [r.fresh_copy() for r in reqs])
    pair.run()
    assert pair.groups == []
    together = {r.request_id: r for r in pair.request_records()}
    for k in range(2):
        alone = Cluster([build_scheduler(sched, cache, "fcfs")], cost,
                        make_router("round-robin", 1),
                        [r.fresh_copy() for r in reqs[k::2]])
        alone.run()
        for rec in alone.request_records():
            assert rec == together[rec.request_id]


def test_a_simulation_steps_a_moe_deployments_ranks_together_and_dense_replicas_alone():
    """`run_simulation` groups the ranks of `--dp 2` on a MoE model (config.json says how
    many dummy steps each ran) and leaves a dense model's replicas independent."""
    from servelab.simulator.run import SimulationConfig, run_simulation

    common = dict(trace="default", num_requests=40, rate=8.0, replicas=2, kv_blocks=6000)
    moe = run_simulation(SimulationConfig(model="tiny-moe", ep=2, **common), out_dir=None)
    lock_step = moe.derived["data_parallel"]
    assert lock_step["groups"] == 1 and lock_step["ranks_per_group"] == 2
    assert len(lock_step["dummy_steps_per_rank"]) == 2 and sum(lock_step["dummy_steps_per_rank"]) > 0
    assert moe.summary["completed"] == 40
    dense = run_simulation(SimulationConfig(model="tiny-llama", **common), out_dir=None)
    assert "data_parallel" not in dense.derived


def test_the_real_moe_runs_report_describes_lock_step_and_prices_the_exchange_at_the_gpus_ring():
    """The recorded DP2 + EP run (../shared/real-runs): its replay steps the ranks in
    lock-step, its section says so, and its profile prices the EP exchange at the GPU's
    own measured NCCL ring (no all-to-all tables on it); the what-if row brackets the
    exchange at the link's datasheet figure."""
    from servelab.simulator.kernels.movement import alltoall_from_ring
    from servelab.validation import real_runs_report as report
    from servelab.validation.real_runs import load_recorded_run, replay_run

    folder = SHARED / "real-runs/llmservingsim-vllm-0.19/RTXPRO6000/Qwen3-30B-A3B-Instruct-2507"
    if not folder.is_dir():
        pytest.skip(f"the public real runs are not at {folder} (../shared absent)")
    rp = replay_run(load_recorded_run(folder))
    assert sum(rp.derived["data_parallel"]["dummy_steps_per_rank"]) > 0
    note = report._lock_step_note(rp)
    assert "step in lock-step" in note and "derived from its own NCCL ring" in note
    base = rp.cost_model.profile.kernels
    assert base.alltoall == alltoall_from_ring(base.collective)
    label, peak = report._exchange_variant(rp)
    assert label == "EP exchange at the link's datasheet speed" and label in note
    assert peak.kernels.alltoall.link_eff == 1.0 and peak.kernels.alltoall.latency_s == 0.0
    assert peak.kernels.moe == base.moe and peak.device == rp.cost_model.profile.device
