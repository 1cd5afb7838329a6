"""Fast-forward equals step-by-step simulation: random traces × random configurations.

Both runs use the same scheduler, cost model and SimPy processes; one advances runs of
plain decode steps in closed form, the other simulates every step. Every per-request
record must agree: integers exactly, times to 1e-9 relative.
"""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from servelab.config import CacheConfig, SchedulerConfig
from servelab.outputs import BatchShape
from servelab.simulator.speed import build_scheduler
from servelab.simulator.speed.decode_batch import OffloadRun
from servelab.request import Request
from servelab.simulator.cost_model import CostModel
from servelab.simulator.engine import Cluster
from servelab.simulator.router import make_router, router_names

from _policy_options import admission_configs, policies

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TIME_FIELDS = ("arrival_s", "scheduled_s", "first_token_s", "finish_s")
# Gaps with no simple relation to the cost model's step times: an arrival that coincides
# with a step end to ~1e-15 s could fall on either side of it (see simulator/engine.py).
GAPS = (0.0, 0.0, 0.00731, 0.0193, 0.0617, 0.143, 0.577)
COST_MODELS = {}


def cost_model(model: str, gpu: str, block_size: int) -> CostModel:
    key = (model, gpu, block_size)
    if key not in COST_MODELS:
        COST_MODELS[key] = CostModel(model, gpu, block_size=block_size)
    return COST_MODELS[key]


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 4, 16]))
    policy, options = draw(policies())
    chunk = draw(st.sampled_from([None, 8, 64, 512]))
    sched = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 12)), max_num_batched_tokens=draw(st.sampled_from([16, 64, 256, 2048])),
        chunked_prefill=chunk, step_composition=draw(st.sampled_from(["decode_first", "prefill_first"])),
        preemption=draw(st.sampled_from(["recompute", "swap"])),
        max_model_len=draw(st.sampled_from([128, 512, 4096])),
        waiting_queue_limit=draw(st.sampled_from([None, None, 4])),
        batching=draw(st.sampled_from(["continuous", "continuous", "static"])),
        admission=draw(admission_configs()))
    manager = draw(st.sampled_from(["paged", "paged", "paged", "contiguous-max", "contiguous-pow2",
                                    "contiguous-oracle"]))
    prefix_caching = draw(st.booleans())
    # a CPU tier (paged only): decode runs that outlast the free list copy to it
    host = draw(st.sampled_from([0, 0, 2, 8, 64])) if prefix_caching and manager == "paged" else 0
    cache = CacheConfig(block_size=block_size, num_gpu_blocks=draw(st.integers(4, 400)) * 16 // block_size,
                        num_cpu_blocks=draw(st.sampled_from([0, 16, 256])),
                        watermark=draw(st.sampled_from([0.0, 0.01, 0.1])),
                        enable_prefix_caching=prefix_caching, block_manager=manager,
                        num_host_blocks=host)
    replicas = draw(st.sampled_from([1, 1, 1, 2, 3]))
    router = draw(st.sampled_from(router_names()))
    model = draw(st.sampled_from([("llama-2-7b", "a100-80gb"), ("tiny-llama", "h100-sxm")]))
    shared = tuple(range(100, 400))
    t = 0.0
    reqs = []
    for i in range(draw(st.integers(1, 14))):
        t += draw(st.sampled_from(GAPS))
        prompt = draw(st.integers(1, 300))
        output = draw(st.integers(1, 400))
        ids = None
        if draw(st.booleans()):
            common = min(prompt, draw(st.integers(0, 300)))
            ids = shared[:common] + tuple(range(1000 * (i + 1), 1000 * (i + 1) + prompt - common))
        reqs.append(dict(request_id=i, arrival_s=t, prompt_len=prompt, output_len=output,
                         max_tokens=output + draw(st.sampled_from([0, 0, 100])),
                         n=draw(st.sampled_from([1, 1, 1, 2, 3])), priority=draw(st.integers(0, 3)),
                         tenant=draw(st.sampled_from("abc")), prompt_token_ids=ids,
                         slo_ttft_ms=draw(st.sampled_from([None, 50.0, 1000.0])),
                         slo_tpot_ms=draw(st.sampled_from([None, 20.0]))))
    return reqs, sched, cache, policy, options, replicas, router, model


def simulate(reqs, sched, cache, policy, options, replicas, router, model, fast_forward):
    cm = cost_model(*model, cache.block_size)
    schedulers = [build_scheduler(sched, cache, policy, options) for _ in range(replicas)]
    cluster = Cluster(schedulers, cm, make_router(router, replicas), [Request(**r) for r in reqs],
                      fast_forward=fast_forward)
    cluster.run()
    for replica in cluster.replicas:
        replica.scheduler.bm.check_invariants()
    return cluster.request_records(), cluster.step_records()


def assert_same_records(fast, slow):
    assert [r.request_id for r in fast] == [r.request_id for r in slow]
    for a, b in zip(fast, slow):
        for name in type(a).__slots__:
            x, y = getattr(a, name), getattr(b, name)
            if name in TIME_FIELDS and x is not None and y is not None:
                assert math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12), (a.request_id, name, x, y)
            else:
                assert x == y, (a.request_id, name, x, y)


@SETTINGS
@given(scenarios())
def test_fast_forward_equals_step_by_step(scenario):
    fast_records, fast_steps = simulate(*scenario, fast_forward=True)
    slow_records, slow_steps = simulate(*scenario, fast_forward=False)
    assert_same_records(fast_records, slow_records)
    assert all(s.num_steps == 1 for s in slow_steps)
    assert sum(s.num_steps for s in fast_steps) == len(slow_steps)
    assert sum(s.num_decode_tokens * s.num_steps for s in fast_steps) == \
        sum(s.num_decode_tokens for s in slow_steps)
    assert math.isclose(sum(s.duration_s for s in fast_steps), sum(s.duration_s for s in slow_steps),
                        rel_tol=1e-9)
    for name in ("num_offload_blocks", "num_load_blocks"):
        assert sum(getattr(s, name) for s in fast_steps) == sum(getattr(s, name) for s in slow_steps)
    runs = sum(s.num_steps > 1 for s in fast_steps)
    event("fast-forwarded" if runs else "no run to fast-forward")
    if any(s.num_steps > 1 and s.num_offload_blocks for s in fast_steps):
        event("a run copied to the CPU tier")


@st.composite
def cpu_tier_scenarios(draw):
    """Short requests leave their prompts cached and unreferenced, then long decodes
    outgrow the free list: their runs evict those blocks, with a copy each to the CPU
    tier, which a fast-forward run must price step by step as the steps would."""
    block_size = draw(st.sampled_from([1, 4, 16]))
    reqs = []
    for i in range(draw(st.integers(1, 8))):
        prompt = draw(st.integers(1, 200))
        reqs.append(dict(request_id=i, arrival_s=0.0193 * draw(st.booleans()) if i else 0.0,
                         prompt_len=prompt, output_len=draw(st.integers(1, 4)),
                         prompt_token_ids=tuple(range(1000 * (i + 1), 1000 * (i + 1) + prompt))))
    for i in range(len(reqs), len(reqs) + draw(st.integers(1, 6))):
        reqs.append(dict(request_id=i, arrival_s=draw(st.sampled_from([0.5, 0.5, 0.577, 2.0])),
                         prompt_len=draw(st.integers(1, 100)), output_len=draw(st.integers(50, 600))))
    reqs.sort(key=lambda r: r["arrival_s"])   # (stable: ids break ties in order)
    for i, r in enumerate(reqs):
        r["request_id"] = i
    sched = SchedulerConfig(max_num_seqs=draw(st.integers(1, 8)), max_num_batched_tokens=2048,
                            max_model_len=4096)
    cache = CacheConfig(block_size=block_size, num_gpu_blocks=draw(st.integers(40, 200)) * 16 // block_size,
                        enable_prefix_caching=True, num_host_blocks=draw(st.sampled_from([1, 4, 32, 512])))
    policy = draw(st.sampled_from(["fcfs", "sjf"]))
    return reqs, sched, cache, policy, {}, 1, "round-robin", ("tiny-llama", "h100-sxm")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cpu_tier_scenarios())
def test_fast_forward_with_a_cpu_tier_equals_step_by_step(scenario):
    fast_records, fast_steps = simulate(*scenario, fast_forward=True)
    slow_records, slow_steps = simulate(*scenario, fast_forward=False)
    assert_same_records(fast_records, slow_records)
    assert sum(s.num_steps for s in fast_steps) == len(slow_steps)
    assert sum(s.num_offload_blocks for s in fast_steps) == sum(s.num_offload_blocks for s in slow_steps)
    assert math.isclose(sum(s.duration_s for s in fast_steps), sum(s.duration_s for s in slow_steps),
                        rel_tol=1e-9)
    copying = [s for s in fast_steps if s.num_steps > 1 and s.num_offload_blocks]
    event("a run copied to the CPU tier" if copying else "no run copied")


def test_a_decode_run_copies_to_the_cpu_tier_as_its_steps_would():
    """Six cached prompts, then four long decodes on a small GPU: the decode runs take the
    cached blocks once the free list is spent, each copied to the 64-block CPU tier; a run
    stops where the tier would have to give up one of its own copies."""
    reqs = [dict(request_id=i, arrival_s=0.0, prompt_len=120, output_len=2,
                 prompt_token_ids=tuple(range(1000 * (i + 1), 1000 * (i + 1) + 120))) for i in range(6)]
    reqs += [dict(request_id=i, arrival_s=0.5, prompt_len=20, output_len=300) for i in range(6, 10)]
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=4096)
    cache = CacheConfig(block_size=4, num_gpu_blocks=260, enable_prefix_caching=True, num_host_blocks=64)
    scenario = (reqs, sched, cache, "fcfs", {}, 1, "round-robin", ("tiny-llama", "h100-sxm"))
    fast_records, fast_steps = simulate(*scenario, fast_forward=True)
    slow_records, slow_steps = simulate(*scenario, fast_forward=False)
    assert_same_records(fast_records, slow_records)
    copying = [s for s in fast_steps if s.num_steps > 1 and s.num_offload_blocks]
    assert copying and max(s.num_offload_blocks for s in copying) == 64
    assert sum(s.num_offload_blocks for s in fast_steps) == sum(s.num_offload_blocks for s in slow_steps) > 64
    # each copying step pays the host link's latency once, and every block its time
    cm = cost_model("tiny-llama", "h100-sxm", 4)
    run = copying[0]
    plain = cm.decode_run_duration(BatchShape(num_decode_seqs=run.num_decode_tokens,
                                              decode_context_sum=run.decode_context_sum),
                                   run.num_steps)[0]
    latency_s, block_s = cm.host_copy
    copies = run.duration_s - plain - run.num_offload_blocks * block_s
    assert copies / latency_s == pytest.approx(round(copies / latency_s), abs=1e-6)
    assert 1 <= round(copies / latency_s) <= run.num_offload_blocks


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=16), st.integers(0, 60), st.integers(0, 80))
def test_offload_run_counts_each_steps_copies(counts, free, num_steps):
    """OffloadRun against the steps one by one: step j takes counts[j % cycle] blocks,
    the free list serves the first `free` of the run, the rest are copied."""
    if free >= sum(counts) * 100:
        return
    taken, first = 0, None
    copied = copying = 0
    for j in range(num_steps):
        before, taken = taken, taken + counts[j % len(counts)]
        o = max(0, taken - free) - max(0, before - free)
        copied += o
        copying += o > 0
    for j in range(10 * len(counts) + free + 1):   # the first step the free list cannot serve
        if sum(counts[i % len(counts)] for i in range(j + 1)) > free:
            first = j
            break
    if first is None:
        return
    run = OffloadRun(counts, free, first)
    assert run.blocks(num_steps) == copied
    assert run.copying_steps(num_steps) == copying
    assert run.seconds(num_steps, 1e-5, 1e-7) == pytest.approx(copying * 1e-5 + copied * 1e-7)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 64), st.integers(0, 100_000), st.integers(1, 400), st.floats(0.001, 2.0),
       st.floats(0.0, 1e-3))
def test_decode_run_until_with_extra_seconds_matches_summed_steps(num_seqs, context, max_steps, budget,
                                                                   per_step):
    """decode_run_until with `extra` (copies priced per step) takes the steps that start
    before the budget, exactly as summing each step's price with its extra would."""
    cm = cost_model("tiny-llama", "h100-sxm", 16)
    shape = BatchShape(num_decode_seqs=num_seqs, decode_context_sum=context)
    extra = lambda k: per_step * k * (k + 1) / 2   # noqa: E731 (grows: a later step copies more)
    k, total = cm.decode_run_until(shape, max_steps, budget, extra)
    t, steps = 0.0, 0
    while steps < max_steps and t < budget:
        t += cm.step_time(BatchShape(num_decode_seqs=num_seqs,
                                     decode_context_sum=context + steps * num_seqs)) + per_step * (steps + 1)
        steps += 1
    assert k == steps
    assert total == pytest.approx(t, rel=1e-9)
