"""Disaggregated prefill/decode in the simulator: link pricing, imports, link queueing,
back-pressure, the decode timeline against a lone engine (a property), refusals, and the
run directory."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.cli import main
from servelab.config import CacheConfig, SchedulerConfig
from servelab.engine import VirtualClock, engine_loop, run_to_end
from servelab.memory import make_block_manager
from servelab.policies import make_policy
from servelab.simulator.speed import BatchingScheduler, build_scheduler
from servelab.records import RequestRecord
from servelab.outputs import StepResult
from servelab.request import Request
from servelab.simulator.cost_model import CostModel
from servelab.simulator.disaggregated_cluster import DisaggregatedCluster
from servelab.simulator.kv_handoff import HeldKV, decode_part, land, prefill_part
from servelab.simulator.disaggregated_run import held
from servelab.simulator.disaggregation import DisaggregationConfig, PoolConfig
from servelab.simulator.executor import SimulatedExecutor
from servelab.simulator.links import get_link
from servelab.simulator.router import make_router
from servelab.simulator.run import SimulationConfig, build_simulation, load_config, run_simulation

COST = CostModel("llama-3.1-8b", "h100-sxm")
KV_PER_TOKEN = COST.block_bytes // COST.block_size
SCHED = SchedulerConfig(max_model_len=8192)


def cluster(requests, *, prefill_blocks=4096, decode_blocks=4096, link="ib-400g",
            transfer="after-prefill", prefill=1, decode=1, policy="fcfs",
            keep_token_times=False, async_scheduling=False) -> DisaggregatedCluster:
    """Pools of llama-3.1-8b on H100s at tp 1 with the given KV blocks per replica."""
    prefill_schedulers = [
        BatchingScheduler(SCHED, HeldKV(make_block_manager(CacheConfig(num_gpu_blocks=prefill_blocks), 8192)),
                  make_policy(policy)) for _ in range(prefill)]
    decode_schedulers = [build_scheduler(SCHED, CacheConfig(num_gpu_blocks=decode_blocks), policy,
                                         keep_token_times=keep_token_times) for _ in range(decode)]
    return DisaggregatedCluster(prefill_schedulers, COST, decode_schedulers, COST,
                                make_router("round-robin", prefill), requests, link=get_link(link),
                                kv_transfer=transfer, kv_bytes_per_token=KV_PER_TOKEN,
                                num_layers=COST.model.num_layers, lanes=1,
                                keep_token_times=keep_token_times, async_scheduling=async_scheduling)


def run(c: DisaggregatedCluster):
    c.run()
    for replica in c.prefill + c.decode:
        replica.scheduler.bm.check_invariants()
        assert replica.scheduler.bm.num_used_blocks == 0   # every hold released, every request done
    return {r.request_id: r for r in c.request_records()}, {h.request_id: h for h in c.handoff_table()}


# --------------------------------------------------------------------------- pricing
def test_link_pricing_follows_the_datasheet_figures():
    mib256 = 256 * 2**20   # 2k tokens of Llama-3.1-8B (128 KiB per token)
    assert KV_PER_TOKEN == 128 * 1024
    assert get_link("ib-400g").seconds(mib256, 1) == pytest.approx(10e-6 + mib256 / 50e9)   # ~5.4 ms
    assert get_link("nvlink").seconds(mib256, 1) == pytest.approx(5e-6 + mib256 / 450e9)    # ~0.6 ms
    assert get_link("pcie-gen5").seconds(mib256, 2) == pytest.approx(10e-6 + mib256 / (2 * 63e9))
    assert get_link("ideal").seconds(mib256, 1) == 0.0
    ib = get_link("ib-400g")
    wire = mib256 / 50e9
    # layer by layer: the last layer's share is left when the prefill outlasts the wire...
    assert ib.layerwise_seconds(mib256, 1, 32, overlap_s=1.0) == pytest.approx(10e-6 + wire / 32)
    # ...and what the link could not carry meanwhile when it does not
    assert ib.layerwise_seconds(mib256, 1, 32, overlap_s=wire / 2) == pytest.approx(10e-6 + wire / 2)


def test_a_handoff_is_priced_on_the_link_and_nothing_is_recomputed():
    link = get_link("ib-400g")
    c = cluster([Request(0, 0.5, 2000, 4)], link="ib-400g")
    records, handoffs = run(c)
    rec, h = records[0], handoffs[0]
    assert h.kv_bytes == 2000 * KV_PER_TOKEN
    assert h.held_blocks == 125   # 2000 tokens of 16-token blocks
    assert h.landed_s == h.transfer_start_s == h.prefill_end_s   # room and a free link at once
    assert h.transfer_end_s - h.transfer_start_s == pytest.approx(link.seconds(2000 * KV_PER_TOKEN, 1))
    # the record: TTFT from the prefill replica, the last token from the decode replica
    assert rec.status == "finished" and rec.output_tokens == 4 and rec.arrival_s == 0.5
    assert rec.first_token_s == h.prefill_end_s and rec.scheduled_s == h.scheduled_s == 0.5
    decode_steps = [(s.start_s, s.num_prefill_tokens, s.duration_s) for s in c.decode[0].steps.table()]
    assert decode_steps[0][0] == h.transfer_end_s                  # the decode replica starts on arrival
    assert [s[1] for s in decode_steps] == [1, 0, 0]               # the first token's KV, then decodes
    assert rec.finish_s == pytest.approx(decode_steps[-1][0] + decode_steps[-1][2])


def test_layerwise_leaves_only_the_last_layers_share_after_a_long_prefill():
    _, h_after = run(cluster([Request(0, 0.0, 4000, 2)], transfer="after-prefill"))
    _, h_layer = run(cluster([Request(0, 0.0, 4000, 2)], transfer="layerwise"))
    a, b = h_after[0], h_layer[0]
    link, nbytes = get_link("ib-400g"), 4000 * KV_PER_TOKEN
    assert a.prefill_end_s == b.prefill_end_s
    assert b.transfer_end_s - b.transfer_start_s == pytest.approx(
        link.layerwise_seconds(nbytes, 1, 32, b.prefill_end_s - b.scheduled_s))
    assert b.transfer_end_s - b.transfer_start_s < (a.transfer_end_s - a.transfer_start_s) / 2


# --------------------------------------------------------------------------- the link
def test_transfers_from_one_prefill_replica_queue_on_its_link():
    reqs = [Request(0, 0.0, 500, 3), Request(1, 0.0, 500, 3)]   # prefilled in one step
    _, h = run(cluster(reqs))
    assert h[0].prefill_end_s == h[1].prefill_end_s == h[0].landed_s == h[1].landed_s
    assert h[0].transfer_start_s == h[0].prefill_end_s
    assert h[1].transfer_start_s == h[0].transfer_end_s                 # FIFO behind the first
    assert h[1].transfer_end_s - h[1].transfer_start_s == pytest.approx(
        get_link("ib-400g").seconds(500 * KV_PER_TOKEN, 1))
    # two prefill replicas have a link each: nothing queues
    _, h = run(cluster(reqs, prefill=2))
    assert h[0].transfer_start_s == h[0].prefill_end_s and h[1].transfer_start_s == h[1].prefill_end_s


def test_imports_delivered_at_one_instant_start_in_one_step():
    # three prompts prefilled in one step, sent one after another over a free link
    reqs = [Request(0, 0.0, 500, 3), Request(1, 0.0, 500, 3), Request(2, 0.0, 300, 3)]
    c = cluster(reqs, link="ideal")
    _, h = run(c)
    (t,) = {x.transfer_end_s for x in h.values()}
    steps = [(s.start_s, s.num_prefill_tokens, s.num_decode_tokens) for s in c.decode[0].steps.table()]
    assert steps[:2] == [(t, 3, 0), (steps[1][0], 0, 3)]


# --------------------------------------------------------------------------- back-pressure
def test_a_full_decode_pool_keeps_the_kv_on_the_prefill_replica():
    # 100 decode blocks hold one 1000-token prompt (63 blocks) and its growth, not two
    reqs = [Request(0, 0.0, 1000, 50), Request(1, 0.0, 1000, 50)]
    records, h = run(cluster(reqs, decode_blocks=100))
    assert h[0].landed_s == h[0].prefill_end_s
    assert h[1].prefill_end_s < h[1].landed_s == records[0].finish_s   # lands when the first leaves
    assert h[1].released_s == h[1].transfer_end_s > records[0].finish_s
    # meanwhile its blocks stay allocated on the prefill replica
    c = cluster(reqs, decode_blocks=100)
    c.env.run(until=(h[1].prefill_end_s + h[1].landed_s) / 2)
    assert c.prefill[0].held.num_held_blocks == h[1].held_blocks == 63
    assert c.prefill[0].scheduler.bm.num_used_blocks == 63
    waiting = held(np.array([h[0].prefill_end_s, h[1].prefill_end_s]),
                   np.array([h[0].landed_s, h[1].landed_s]), np.array([63, 63]))
    assert waiting == (63, pytest.approx(63 * (h[1].landed_s - h[1].prefill_end_s)))


def test_held_blocks_make_a_prefill_replica_wait_not_reject():
    # 70 prefill blocks hold one 1000-token prompt: the second waits for the first's release
    reqs = [Request(0, 0.0, 1000, 50), Request(1, 0.0, 1000, 50)]
    records, h = run(cluster(reqs, prefill_blocks=70, decode_blocks=100))
    assert records[1].status == "finished"
    assert records[1].scheduled_s == h[0].released_s   # admitted when the first's KV left


# --------------------------------------------------------------------------- imports
def test_an_import_is_admitted_without_memory_or_prefill():
    sched = build_scheduler(SCHED, CacheConfig(num_gpu_blocks=200), "fcfs")
    first = prefill_part(Request(7, 0.0, 1000, 10))
    first.scheduled_s, first.first_token_s = 0.0, 0.1
    part = decode_part(Request(7, 0.0, 1000, 10), RequestRecord.from_request(first))
    land(sched.bm, part)
    used = sched.bm.num_used_blocks
    assert used == 63   # 1001 slots: the prompt and the first token
    sched.add_request(part, 0.2)
    out = sched.schedule(0.2)
    (work,) = list(out.scheduled)
    assert (work.num_tokens, work.num_samples) == (1, 1)    # the first token's KV, sampling the second
    assert sched.bm.num_used_blocks == used


def _imported(rid: int, prompt: int, output: int) -> Request:
    first = prefill_part(Request(rid, 0.0, prompt, output))
    first.scheduled_s, first.first_token_s = 0.0, 0.1
    return decode_part(Request(rid, 0.0, prompt, output), RequestRecord.from_request(first))


def test_blocks_waiting_imports_hold_are_waited_for_not_taken_as_a_full_cache():
    """A lone decode that cannot grow while a waiting import holds the rest of the cache
    has not outgrown the cache: it is preempted, not rejected; the import starts while
    the preempted request waits for its memory, and both finish."""
    sched = build_scheduler(SCHED, CacheConfig(num_gpu_blocks=4, block_size=4), "fcfs")
    a, b = _imported(1, 7, 6), _imported(2, 7, 6)   # 8 slots (2 blocks) each; 12 tokens fit in 16
    for part in (a, b):
        land(sched.bm, part)
    sched.add_request(a, 0.2)
    out = sched.schedule(0.2)            # a alone: 8 tokens in its 2 blocks
    sched.update(out, StepResult(0.01))
    sched.add_request(b, 0.21)           # b lands behind it, holding the other 2 blocks
    now, records = 0.21, []
    for _ in range(40):
        if not sched.has_unfinished():
            break
        out = sched.schedule(now)
        now += 0.01
        records += sched.update(out, StepResult(0.01))
    assert sorted((r.request_id, r.status) for r in records) == [(1, "finished"), (2, "finished")]
    assert a.num_preemptions == 1 and b.num_preemptions == 0


# --------------------------------------------------------------------------- the property
class ImportFeed:
    """A lone decode engine whose requests arrive, prompts imported, at given times: the
    engine-loop driver of the reference (a VirtualClock; no SimPy)."""

    def __init__(self, scheduler, arrivals):
        self.scheduler, self.clock = scheduler, VirtualClock()
        self.pending = sorted(arrivals, key=lambda a: (a[0], a[1].request_id))
        self.next, self.records = 0, []

    def step_time(self):
        now = self.clock.now()
        while self.next < len(self.pending) and self.pending[self.next][0] <= now:
            req = self.pending[self.next][1]
            land(self.scheduler.bm, req)
            self.scheduler.add_request(req, now)
            self.next += 1
        return now

    def ran(self, step):
        self.clock.advance(step.result.duration_s)

    def finished(self, step):
        self.records += step.records

    def ran_nothing(self, step):
        self.records += step.records

    def idle(self):
        if self.next >= len(self.pending):
            return None
        self.clock.wait_until(self.pending[self.next][0])
        return ()


requests_st = st.lists(st.tuples(st.sampled_from([0.0, 0.001]) | st.floats(0.0, 0.2),
                                 st.integers(1, 1500), st.integers(2, 40)),
                       min_size=1, max_size=12)


@settings(max_examples=25, deadline=None)
@given(requests_st, st.integers(1, 2), st.integers(1, 2), st.sampled_from(["fcfs", "priority", "sjf"]))
def test_decode_timeline_equals_a_lone_engine_fed_imported_prompts(rows, prefill, decode, policy):
    """With a free link and unlimited decode memory, every request's token times on its
    decode replica are those of a lone engine (same scheduler, block manager and cost
    model, no SimPy) that receives it, its prompt's KV imported, when its prefill ends."""
    t, originals = 0.0, []
    for i, (gap, prompt, output) in enumerate(rows):
        t += gap
        originals.append(Request(i, t, prompt, output, priority=i % 2))
    c = cluster([r.fresh_copy() for r in originals], link="ideal", prefill=prefill, decode=decode,
                decode_blocks=5000, policy=policy, keep_token_times=True)
    published, decoded = [], c.decoded   # records as published (a run's tables drop token times)
    c.decoded = lambda recs: (published.extend(recs), decoded(recs))
    _, handoffs = run(c)
    records = {r.request_id: r for r in published}
    firsts = {rec.request_id: rec for replica in c.prefill for rec in replica.records.table()}
    for d in range(decode):
        sched = build_scheduler(SCHED, CacheConfig(num_gpu_blocks=5000), policy, keep_token_times=True)
        feed = ImportFeed(sched, [(h.transfer_end_s, decode_part(originals[i], firsts[i], keep_token_times=True))
                                  for i, h in handoffs.items() if h.decode_replica == d])
        run_to_end(engine_loop(sched, SimulatedExecutor(COST), feed))
        for ref in feed.records:
            got = records[ref.request_id]
            assert handoffs[ref.request_id].transfer_end_s == got.first_token_s   # a free link
            assert (got.token_times, got.finish_s, got.num_preemptions) == \
                (ref.token_times, ref.finish_s, ref.num_preemptions)
        assert len(feed.records) == sum(h.decode_replica == d for h in handoffs.values())


# --------------------------------------------------------------------------- asynchronous scheduling
def test_under_asynchronous_scheduling_an_arrival_at_a_busy_prefill_replica_waits_a_step():
    """Request 1 arrives while request 0's prefill runs: a synchronous replica prefills it
    next; one that schedules a step ahead had formed that step already (request 0 still
    prefills: its prompt takes two chunks)."""
    reqs = lambda: [Request(0, 0.0, 3000, 5), Request(1, 0.001, 100, 5)]   # noqa: E731
    sync, _ = run(cluster(reqs()))
    c = cluster(reqs(), async_scheduling=True)
    lagged, _ = run(c)
    starts = [s.start_s for s in c.prefill[0].steps.table()]
    assert sync[1].scheduled_s == starts[1] < lagged[1].scheduled_s == starts[2]


def test_under_asynchronous_scheduling_an_arrival_kept_back_waits_for_held_blocks_not_rejected():
    """Request 1 arrives during request 0's only prefill step; at its end nothing else runs,
    so request 1 may start at once, but request 0's KV, held until its transfer ends,
    leaves no room: the replica waits for the release (as without the lag), it does not
    reject request 1 as too big for an empty cache."""
    reqs = [Request(0, 0.0, 500, 5), Request(1, 0.001, 500, 5)]
    records, h = run(cluster(reqs, prefill_blocks=40, async_scheduling=True))
    assert records[1].status == "finished"
    assert records[1].scheduled_s == h[0].released_s


@settings(max_examples=25, deadline=None)
@given(requests_st, st.integers(1, 2), st.integers(1, 2), st.sampled_from([150, 5000]),
       st.sampled_from([130, 4096]))
def test_property_asynchronous_pools_serve_every_request_and_release_every_block(
        rows, prefill, decode, decode_blocks, prefill_blocks):
    """Kept-back arrivals and imports, back-pressure from a small decode pool onto a small
    prefill pool (held blocks): every request finishes, none is rejected while held blocks
    were to be released, no block stays held (`run` checks), and none is scheduled before
    it arrived."""
    t, reqs = 0.0, []
    for i, (gap, prompt, output) in enumerate(rows):
        t += gap
        reqs.append(Request(i, t, min(prompt, 1000), output))
    records, _ = run(cluster(reqs, prefill=prefill, decode=decode, decode_blocks=decode_blocks,
                             prefill_blocks=prefill_blocks, async_scheduling=True))
    assert len(records) == len(reqs)
    for rec in records.values():
        assert rec.status == "finished" and rec.scheduled_s >= rec.arrival_s


# --------------------------------------------------------------------------- refusals
BASE = dict(trace="default", num_requests=20, rate=10.0)


@pytest.mark.parametrize("pool, message", [
    (PoolConfig(model="llama-2-7b"), "the prefill pool has model llama-3.1-8b and the decode pool llama-2-7b"),
    (PoolConfig(kv_dtype="fp8"), "the prefill pool has kv_dtype bf16 and the decode pool fp8: KV blocks move"),
    (PoolConfig(block_size=32), "the prefill pool has block_size 16 and the decode pool 32"),
])
def test_pools_that_cannot_share_kv_are_refused(pool, message):
    with pytest.raises(ValueError, match=message):
        SimulationConfig(**BASE, disaggregation=DisaggregationConfig(decode=pool))


def test_unknown_links_and_too_small_decode_pools_are_refused():
    with pytest.raises(ValueError, match="unknown KV link 'carrier-pigeon'; the catalog has .*ib-400g"):
        DisaggregationConfig(kv_link="carrier-pigeon")
    with pytest.raises(ValueError, match="decode pool: a KV cache of 2 blocks per replica .* cannot hold any request"):
        build_simulation(SimulationConfig(**BASE, disaggregation=DisaggregationConfig(
            decode=PoolConfig(kv_blocks=2))))
    with pytest.raises(ValueError, match="--prefill-replicas and --decode-replicas instead"):
        SimulationConfig(**BASE, replicas=2, disaggregation=DisaggregationConfig())


@pytest.mark.parametrize("flags, message", [
    (["--decode-kv-blocks", "2"], "error: decode pool: a KV cache of 2 blocks per replica"),
    (["--kv-link", "smoke-signal"], "error: unknown KV link 'smoke-signal'"),
])
def test_command_line_refusals_are_one_line(tmp_path, capsys, flags, message):
    code = main(["simulate", "--trace", "default", "--num-requests", "20", "--prefill-replicas", "1",
                 "--decode-replicas", "1", *flags, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert main(["simulate", "--trace", "default", "--prefill-replicas", "1",
                 "--out", str(tmp_path / "run2")]) == 2
    assert "needs both --prefill-replicas and --decode-replicas" in capsys.readouterr().err


# --------------------------------------------------------------------------- run directory
def test_run_directory_reruns_and_co_located_configs_read_as_before(tmp_path):
    config = SimulationConfig(**BASE, disaggregation=DisaggregationConfig(
        prefill=PoolConfig(replicas=2), decode=PoolConfig(replicas=1, tp=2), kv_link="nvlink"))
    assert "disaggregation" not in SimulationConfig(**BASE).to_dict()
    assert SimulationConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    result = run_simulation(config, tmp_path / "run")
    files = {p.name for p in (tmp_path / "run").iterdir()}
    assert {"disaggregation.json", "handoffs.csv", "requests.csv", "summary.json"} <= files
    report = json.loads((tmp_path / "run" / "disaggregation.json").read_text())
    assert report["layout"]["gpus"] == 4 and report["layout"]["transfer_lanes"] == 1
    assert report["requests"]["handed_off"] == len(result.disaggregation.handoffs) == 20
    assert report["per_gpu"]["request_throughput"] == pytest.approx(
        result.summary["request_throughput"] / 4)
    derived = json.loads((tmp_path / "run" / "config.json").read_text())["derived"]["disaggregation"]
    assert derived["decode"]["tp"] == 2 and derived["kv_bytes_per_token"] == KV_PER_TOKEN
    again = run_simulation(load_config(tmp_path / "run" / "config.json"), tmp_path / "again")
    for name in ("requests.csv", "handoffs.csv", "disaggregation.json"):
        assert (tmp_path / "run" / name).read_bytes() == (tmp_path / "again" / name).read_bytes()
    for rec, h in zip(result.requests, result.disaggregation.handoffs):
        assert rec.first_token_s == h.prefill_end_s and rec.finish_s > h.transfer_end_s
    colocated = run_simulation(SimulationConfig(**BASE), tmp_path / "co")
    assert colocated.disaggregation is None and not (tmp_path / "co" / "disaggregation.json").exists()


def test_compare_sweeps_pool_sizes():
    from servelab.cli import build_parser
    from servelab.sweeps.cli import build_points

    args = build_parser().parse_args(["compare", "--trace", "default", "--num-requests", "20", "--out",
                                      "unused", "--policies", "fcfs", "--prefill-replicas", "1,2",
                                      "--decode-replicas", "1", "--kv-link", "nvlink"])
    axes, points = build_points(args, args.func.keywords["parser"])
    assert axes["prefill_replicas"] == (1, 2) and "decode_replicas" not in axes
    assert [(p.config.disaggregation.prefill.replicas, p.config.disaggregation.decode.replicas,
             p.config.disaggregation.kv_link) for p in points] == [(1, 1, "nvlink"), (2, 1, "nvlink")]
    assert points[1].name.startswith("p2_")
