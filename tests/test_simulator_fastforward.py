"""Fast-forward equals step-by-step simulation: random traces × random configurations.

Both runs use the same scheduler, cost model and SimPy processes; one advances runs of
plain decode steps in closed form, the other simulates every step. Every per-request
record must agree: integers exactly, times to 1e-9 relative.
"""
from __future__ import annotations

import math

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from servelab.config import CacheConfig, SchedulerConfig
from servelab.simulator.speed import build_scheduler
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
    cache = CacheConfig(block_size=block_size, num_gpu_blocks=draw(st.integers(4, 400)) * 16 // block_size,
                        num_cpu_blocks=draw(st.sampled_from([0, 16, 256])),
                        watermark=draw(st.sampled_from([0.0, 0.01, 0.1])),
                        enable_prefix_caching=draw(st.booleans()), block_manager=manager)
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
    runs = sum(s.num_steps > 1 for s in fast_steps)
    event("fast-forwarded" if runs else "no run to fast-forward")
