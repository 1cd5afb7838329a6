"""Golden timelines: for each policy, a tiny hand-written trace whose per-step schedule is
written out. Every step takes 1 s (FakeExecutor(step_s=1.0)); each row is
(step start, [(request id, tokens computed)], [(preempted id, mode)]), the work in the
order SchedulerOutput.scheduled lists it: batched decodes first, then the rest."""
from __future__ import annotations

from servelab.config import CacheConfig, SchedulerConfig

from sched_harness import FakeExecutor, make_requests, simulate


def timeline(run):
    return [(o.now, [(e.request_id, e.num_tokens) for e in o.scheduled],
             [(rid, mode.value) for rid, mode in o.preempted]) for o in run.outputs]


def finish_times(run):
    return {r.request_id: (r.first_token_s, r.finish_s) for r in run.records}


def test_fcfs_chunked_prefill_decode_first():
    # budget 8, chunks of 4, 5 blocks of 4 tokens. Request 2 (8-token prompt, 2 blocks)
    # arrives at t=1 when only 1 block is free; it is admitted once request 1 finishes.
    reqs = make_requests([(0, 6, 3), (0, 4, 2), (1, 8, 2)])
    run = simulate(reqs, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, chunked_prefill=4,
                                         max_model_len=64),
                   CacheConfig(block_size=4, num_gpu_blocks=5, watermark=0), "fcfs",
                   executor=FakeExecutor(step_s=1.0))
    assert timeline(run) == [
        (0, [(0, 4), (1, 4)], []),           # both prompts start; request 1's completes
        (1, [(1, 1), (0, 2)], []),           # decode first (1, batched), then 0's last chunk
        (2, [(0, 1), (2, 4)], []),           # 1 finished at t=2; 2 admitted, chunk of 4
        (3, [(0, 1), (2, 4)], []),
        (4, [(2, 1)], []),
    ]
    assert finish_times(run) == {0: (2.0, 4.0), 1: (1.0, 2.0), 2: (4.0, 5.0)}


def test_priority_lower_value_first():
    # Two slots. The priority-1 request runs before the priority-2 one that arrived with
    # it; the priority-0 arrival at t=1 waits for a free slot (preemption is for memory).
    reqs = make_requests([(0, 4, 3, {"priority": 2}), (0, 4, 3, {"priority": 1}),
                          (1, 4, 2, {"priority": 0})])
    run = simulate(reqs, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, chunked_prefill=None,
                                         max_model_len=64),
                   CacheConfig(block_size=4, num_gpu_blocks=8, watermark=0), "priority",
                   {"preemptive": True}, executor=FakeExecutor(step_s=1.0))
    assert timeline(run) == [
        (0, [(1, 4), (0, 4)], []),
        (1, [(1, 1), (0, 1)], []),
        (2, [(1, 1), (0, 1)], []),
        (3, [(2, 4)], []),
        (4, [(2, 1)], []),
    ]


def test_preemptive_priority_evicts_lower_priority_for_memory():
    # Memory for one request only: the priority-0 arrival preempts the running
    # priority-5 request (recompute), which then restarts from its prompt + outputs.
    reqs = make_requests([(0, 8, 4, {"priority": 5}), (1.5, 8, 2, {"priority": 0})])
    run = simulate(reqs, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, chunked_prefill=None,
                                         max_model_len=64),
                   CacheConfig(block_size=4, num_gpu_blocks=3, watermark=0), "priority",
                   {"preemptive": True}, executor=FakeExecutor(step_s=1.0))
    assert timeline(run) == [
        (0, [(0, 8)], []),
        (1, [(0, 1)], []),
        (2, [(1, 8)], [(0, "recompute")]),
        (3, [(1, 1)], []),
        (4, [(0, 10)], []),                  # recompute: 8 prompt + 2 generated tokens
        (5, [(0, 1)], []),
    ]
    assert [r.num_preemptions for r in sorted(run.records, key=lambda r: r.request_id)] == [1, 0]


def test_sjf_shortest_predicted_output_first():
    reqs = make_requests([(0, 4, 6), (0, 4, 2), (0, 4, 4)])
    run = simulate(reqs, SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, chunked_prefill=None,
                                         max_model_len=64),
                   CacheConfig(block_size=4, num_gpu_blocks=8, watermark=0), "sjf",
                   {"max_wait_s": None}, executor=FakeExecutor(step_s=1.0))
    assert run.admitted == [1, 2, 0]
    assert timeline(run)[:3] == [(0, [(1, 4)], []), (1, [(1, 1)], []), (2, [(2, 4)], [])]
    assert finish_times(run) == {1: (1.0, 2.0), 2: (3.0, 6.0), 0: (7.0, 12.0)}


def test_sjf_starvation_guard_admits_overdue_request_first():
    # Without the guard the long request 0 would wait for both short ones; with a 1.5 s
    # maximum wait it is overdue at t=2 and goes before request 2.
    reqs = make_requests([(0, 4, 6), (0, 4, 2), (0, 4, 4)])
    run = simulate(reqs, SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, chunked_prefill=None,
                                         max_model_len=64),
                   CacheConfig(block_size=4, num_gpu_blocks=8, watermark=0), "sjf",
                   {"max_wait_s": 1.5}, executor=FakeExecutor(step_s=1.0))
    assert run.admitted == [1, 0, 2]


def test_fair_share_alternates_tenants_by_virtual_counter():
    # Tenant a sends three requests, b one. After a's first request (4 in + 2·2 out = 8)
    # b's counter (0) is smaller, so b goes next; then a's remaining requests.
    reqs = make_requests([(0, 4, 2, {"tenant": "a"}), (0, 4, 2, {"tenant": "a"}),
                          (0, 4, 2, {"tenant": "a"}), (0, 4, 2, {"tenant": "b"})])
    run = simulate(reqs, SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, chunked_prefill=None,
                                         max_model_len=64),
                   CacheConfig(block_size=4, num_gpu_blocks=8, watermark=0), "fair",
                   executor=FakeExecutor(step_s=1.0))
    assert run.admitted == [0, 3, 1, 2]
    assert run.scheduler.policy.counters == {"a": 24.0, "b": 8.0}


def test_swap_preemption_and_swap_in():
    # 3 blocks: both 4-token prompts fit, but only one can grow into a second block.
    # FCFS preempts the most recently admitted (1) to the CPU pool; it swaps back in once
    # request 0 finishes, keeping its computed KV (no recompute).
    reqs = make_requests([(0, 4, 6), (0, 4, 6)])
    run = simulate(reqs, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, chunked_prefill=None,
                                         preemption="swap", max_model_len=64),
                   CacheConfig(block_size=4, num_gpu_blocks=3, num_cpu_blocks=4, watermark=0), "fcfs",
                   executor=FakeExecutor(step_s=1.0))
    tl = timeline(run)
    assert tl[:3] == [(0, [(0, 4), (1, 4)], []), (1, [(0, 1)], [(1, "swap")]), (2, [(0, 1)], [])]
    assert tl[6] == (6, [(1, 1)], [])
    assert [o.now for o in run.outputs if o.swap_out] == [1]
    assert [o.now for o in run.outputs if o.swap_in] == [6]
    assert finish_times(run) == {0: (1.0, 6.0), 1: (1.0, 11.0)}


def test_static_batching_waits_for_the_whole_batch():
    reqs = make_requests([(0, 4, 1), (0, 4, 3), (1, 4, 1)])
    run = simulate(reqs, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, chunked_prefill=None,
                                         batching="static", max_model_len=64),
                   CacheConfig(block_size=4, num_gpu_blocks=8, watermark=0), "fcfs",
                   executor=FakeExecutor(step_s=1.0))
    assert timeline(run) == [
        (0, [(0, 4), (1, 4)], []),
        (1, [(1, 1)], []),
        (2, [(1, 1)], []),
        (3, [(2, 4)], []),                   # request 2 arrived at t=1 but waits for the batch
    ]


def test_prefill_first_holds_decodes_while_prefills_run():
    reqs = make_requests([(0, 4, 3), (1, 4, 2)])
    run = simulate(reqs, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, chunked_prefill=None,
                                         step_composition="prefill_first", max_model_len=64),
                   CacheConfig(block_size=4, num_gpu_blocks=8, watermark=0), "fcfs",
                   executor=FakeExecutor(step_s=1.0))
    assert timeline(run) == [
        (0, [(0, 4)], []),
        (1, [(1, 4)], []),                   # request 0's decode waits for the prefill
        (2, [(0, 1), (1, 1)], []),
        (3, [(0, 1)], []),
    ]
