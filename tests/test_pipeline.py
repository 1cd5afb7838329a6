"""Pipeline parallelism in the simulator (`simulator/pipeline.py`): vLLM's layer split, stage
prices that add up to the whole step, a lone step's timeline through the stages, virtual
engines filling the pipeline under load without two batches on one stage at once, KV and
weights per stage, the GPUs a plan counts, and the layouts refused in one line."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest

from servelab.cli import main
from servelab.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from servelab.models import load_model_spec
from servelab.outputs import BatchShape
from servelab.simulator.speed import build_scheduler
from servelab.request import Request
from servelab.simulator.cost_model import CostModel
from servelab.simulator.disaggregation import DisaggregationConfig, PoolConfig
from servelab.simulator.engine import Cluster
from servelab.simulator.footprint import Footprint, stage_footprint
from servelab.simulator.gpus import GIB, get_gpu
from servelab.simulator.pipeline import (INTER_NODE_LINK, PipelinedCluster, PipelineLayout,
                                         stage_layer_ranges)
from servelab.simulator.router import make_router
from servelab.simulator.run import SimulationConfig, build_simulation, run_simulation
from servelab.traces import Trace, TraceRecord, write_csv

MODEL = load_model_spec("llama-2-7b")
SCHED = SchedulerConfig(max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=2048)


def pipelined(requests, pp=2, cost=None, kv_blocks=4096, replicas=1, router="round-robin"):
    cost = cost or CostModel(MODEL, "a100-80gb")
    layout = PipelineLayout(MODEL, cost, pp)
    cache = CacheConfig(num_gpu_blocks=kv_blocks // pp)
    schedulers = [build_scheduler(SCHED, cache, "fcfs") for _ in range(replicas * pp)]
    return PipelinedCluster(schedulers, layout, make_router(router, replicas), requests)


# --------------------------------------------------------------------------- the layer split
@pytest.mark.parametrize("layers, pp, counts", [
    (32, 1, [32]), (32, 4, [8, 8, 8, 8]),
    (61, 2, [31, 30]),          # DeepSeek-V3: the remainder goes before the last stage
    (80, 3, [27, 27, 26]),
    (10, 4, [2, 3, 3, 2]),      # remainder 2: the two stages before the last
    (11, 4, [3, 3, 3, 2]),      # remainder 3 reaches the first stage
    (5, 5, [1, 1, 1, 1, 1]),
])
def test_layers_are_split_as_vllm_get_pp_indices_splits_them(layers, pp, counts):
    ranges = stage_layer_ranges(layers, pp)
    assert [end - start for start, end in ranges] == counts
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_a_stage_without_layers_is_refused():
    with pytest.raises(ValueError, match="pp=3 exceeds the model's 2 layers"):
        stage_layer_ranges(2, 3)
    with pytest.raises(ValueError, match="pp=33 exceeds llama-2-7b's 32 layers"):
        PipelineLayout(MODEL, CostModel(MODEL, "a100-80gb"), 33)


# --------------------------------------------------------------------------- stage prices
SHAPES = (BatchShape(num_decode_seqs=16, decode_context_sum=16 * 900),
          BatchShape(num_prefill_seqs=2, num_prefill_tokens=1024, prefill_q_context_sum=0,
                     prefill_q_sq_sum=2 * 512 ** 2, prefill_max_keys=512),
          BatchShape(1, 300, 200, 300 * 200, 300 * 300, num_decode_seqs=5, decode_context_sum=4000))


@pytest.mark.parametrize("name, gpu, tp, pp, weight_dtype", [
    ("llama-2-7b", "a100-80gb", 1, 2, "bf16"), ("llama-3.1-70b", "h100-sxm", 2, 4, "bf16"),
    ("qwen3-30b-a3b", "h100-sxm", 1, 3, "bf16"), ("deepseek-v3", "h100-sxm", 8, 2, "fp8")])
def test_stage_prices_add_up_to_the_whole_step(name, gpu, tp, pp, weight_dtype):
    model = load_model_spec(name)
    cost = CostModel(model, gpu, tp=tp, weight_dtype=weight_dtype)
    layout = PipelineLayout(model, cost, pp)
    for shape in SHAPES:
        stages = layout.stage_times(shape)
        assert math.isclose(sum(stages), cost.step_time(shape), rel_tol=1e-9)
        assert all(t > 0 for t in stages)
    first, last = layout.stages[0].breakdown(SHAPES[0]), layout.stages[-1].breakdown(SHAPES[0])
    assert first["step_overhead"].time_s == cost.step_overhead_s > 0
    assert last["step_overhead"].time_s == 0
    assert "embedding" in first and "embedding" not in last
    assert {"lm_head", "sampler", "final_norm"} <= set(last) and not {"lm_head", "sampler"} & set(first)
    if tp > 1:
        assert last["logits_gather"].time_s > 0 and first["logits_gather"].time_s == 0


def test_a_tp_stage_boundary_within_a_node_rides_nvlink_and_between_nodes_the_network():
    model = load_model_spec("deepseek-v3")
    layout = PipelineLayout(model, CostModel(model, "h100-sxm", tp=8, weight_dtype="fp8"), 2)
    link, = layout.links
    assert (link.link.name, link.lanes, link.crosses_nodes) == (INTER_NODE_LINK, 8, True)
    tokens = 2048
    nbytes = tokens * model.hidden_size * 2 * 2            # hidden states + residual, BF16
    wire = link.link.latency_us * 1e-6 + nbytes / (link.link.bandwidth_gbps * 1e9 * 8)
    assert layout.transfer_time(0, tokens) > wire           # plus the receiving all-gather
    local = PipelineLayout(MODEL, CostModel(MODEL, "a100-80gb", tp=2), 4)
    assert [lk.crosses_nodes for lk in local.links] == [False, False, False]
    assert local.links[0].link.bandwidth_gbps == get_gpu("a100-80gb").nvlink_gbps


# --------------------------------------------------------------------------- timelines
def test_a_lone_step_takes_its_stage_times_plus_the_transfers():
    c = pipelined([Request(0, 2.0, 100, 3)], pp=3)
    c.run()
    rec, = c.request_records()
    layout = c.layout
    prefill = BatchShape(1, 100, 0, 0, 100 * 100)

    def step(shape, tokens):
        return sum(layout.stage_times(shape)) + sum(layout.transfer_time(b, tokens) for b in range(2))

    decodes = [step(BatchShape(num_decode_seqs=1, decode_context_sum=101 + j), 1) for j in range(2)]
    assert math.isclose(rec.first_token_s, 2.0 + step(prefill, 100), rel_tol=1e-12)
    assert math.isclose(rec.finish_s, rec.first_token_s + sum(decodes), rel_tol=1e-12)
    steps = c.step_records()
    assert [s.num_steps for s in steps] == [1, 1, 1]           # no fast-forward
    timeline = c.replicas[0].timeline
    assert list(timeline.starts[1])[0] == timeline.ends[0][0] + layout.transfer_time(0, 100)


def test_under_load_the_virtual_engines_fill_the_pipeline():
    """64 requests at once, 8 per batch: two virtual engines on two balanced stages (no
    step overhead on the first) serve nearly twice what one unpipelined engine does, and no
    stage ever runs two batches at once."""
    cost = CostModel(MODEL, "a100-80gb", step_overhead_s=0.0)
    requests = [Request(i, 0.0, 64, 200) for i in range(64)]
    pipe = pipelined([r.fresh_copy() for r in requests], cost=cost)
    pipe.run()
    plain = Cluster([build_scheduler(SCHED, CacheConfig(num_gpu_blocks=4096), "fcfs")], cost,
                    make_router("round-robin", 1), [r.fresh_copy() for r in requests], fast_forward=False)
    plain.run()
    end = {name: max(r.finish_s for r in c.request_records()) for name, c in (("pipe", pipe), ("plain", plain))}
    speedup = end["plain"] / end["pipe"]
    assert 1.85 < speedup <= 2.0
    assert [len(e.records) for e in pipe.replicas[0].engines] == [32, 32]   # fewest unfinished
    timeline = pipe.replicas[0].timeline
    for starts, ends in zip(timeline.starts, timeline.ends):
        assert all(s < e for s, e in zip(starts, ends))
        assert all(e <= s for e, s in zip(ends, starts[1:]))          # never two at once
    busy = pipe.stats()["stage_busy_fraction"]
    assert max(busy) > 0.97


def test_a_replica_is_routed_as_a_whole_and_its_engines_take_turns():
    requests = [Request(i, 0.1 * i, 50, 30) for i in range(12)]
    c = pipelined(requests, replicas=2, router="least-outstanding")
    c.run()
    assert c.num_done == 12
    per_engine = [len(e.records) for r in c.replicas for e in r.engines]
    assert sum(per_engine) == 12 and min(per_engine) > 0


# --------------------------------------------------------------------------- memory
@pytest.mark.parametrize("name, tp, tied", [("llama-3.1-70b", 2, False), ("llama-3.1-8b", 1, True),
                                            ("deepseek-v3", 8, False), ("qwen3-30b-a3b", 2, False)])
def test_stage_weights_and_kv_add_up_to_the_model(name, tp, tied):
    model = dataclasses.replace(load_model_spec(name), tie_word_embeddings=True) if tied else load_model_spec(name)
    whole = Footprint.of(model, tp)
    assert stage_footprint(model, 0, model.num_layers, 0, 1, tp) == whole
    ranges = stage_layer_ranges(model.num_layers, 3)
    stages = [stage_footprint(model, a, b, s, 3, tp) for s, (a, b) in enumerate(ranges)]
    table = whole.vocab * whole.hidden * 2
    # a tied table is held twice: the first stage embeds, the last stage's LM head reads its copy
    assert sum(f.weight_bytes for f in stages) == whole.weight_bytes + (table if tied else 0)
    assert sum(f.kv_bytes_per_token for f in stages) == whole.kv_bytes_per_token
    assert [f.vocab for f in stages] == [0, 0, whole.vocab]        # logits on the last stage only
    if model.moe is None or not model.moe.dense_layers:   # (DeepSeek's first stage: 3 dense layers)
        middle = stages[1].weight_bytes
        assert stages[0].weight_bytes > middle and stages[2].weight_bytes > middle   # the tables


def test_a_model_too_big_for_one_gpu_fits_in_two_stages_and_kv_is_the_smallest_stages():
    model = load_model_spec("llama-3.1-70b")
    config = dict(model="llama-3.1-70b", gpu="h100-sxm", num_requests=5)
    with pytest.raises(ValueError, match="weights need .* GiB per GPU"):
        build_simulation(SimulationConfig(**config))
    sim = build_simulation(SimulationConfig(**config, pp=2))
    per_stage = sim.stage_kv_blocks
    assert len(per_stage) == 2 and sim.kv_blocks == min(per_stage)
    # each stage: (memory × utilization − its weights − its activation peak) // its block
    gpu = sim.cost_model.gpu
    for f, blocks in zip(sim.pipeline.footprints(), per_stage):
        free = gpu.memory_bytes * 0.9 - f.weight_bytes
        assert 0 < blocks < free // (16 * f.kv_bytes_per_token)
        assert f.weight_bytes / GIB == pytest.approx(Footprint.of(model).weight_bytes / GIB / 2, rel=0.01)
    engines = list(sim.cluster.engines)
    assert len(engines) == 2
    assert {e.scheduler.bm.num_gpu_blocks for e in engines} == {sim.kv_blocks // 2}
    # the first stage has no logits to hold at its peak: more room for KV than the last
    assert per_stage[0] > per_stage[1]


def test_deepseek_v3_needs_two_h100_nodes_in_fp8():
    config = dict(model="deepseek-v3", gpu="h100-sxm", tp=8, weight_dtype="fp8", num_requests=5)
    with pytest.raises(ValueError, match="weights need"):
        build_simulation(SimulationConfig(**config))
    sim = build_simulation(SimulationConfig(**config, pp=2))
    assert sim.pipeline.gpus == 16 and sim.kv_blocks > 0


# --------------------------------------------------------------------------- config and runs
@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    records = [TraceRecord(0.05 * i, 40 + (37 * i) % 300, 20 + (53 * i) % 200) for i in range(40)]
    path = tmp_path_factory.mktemp("trace") / "small.csv"
    write_csv(Trace(tuple(records)), path)
    return path


def test_pp_1_is_the_config_and_run_there_were_before(trace_file, tmp_path):
    base = dict(trace=str(trace_file), model="llama-2-7b", gpu="a100-80gb")
    config = SimulationConfig(**base, pp=1)
    assert "pp" not in config.to_dict() and config == SimulationConfig(**base)
    assert SimulationConfig.from_dict(config.to_dict()).pp == 1
    result = run_simulation(config, tmp_path / "run")
    assert "pipeline" not in result.derived
    assert "pp" not in json.loads((tmp_path / "run" / "config.json").read_text())["config"]
    assert isinstance(build_simulation(config).cluster, Cluster)


def test_a_pipelined_run_records_its_layout_and_reruns_exactly(trace_file, tmp_path):
    config = SimulationConfig(trace=str(trace_file), model="llama-2-7b", gpu="a100-80gb", pp=2, tp=2)
    assert SimulationConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    first = run_simulation(config, tmp_path / "a")
    run_simulation(config, tmp_path / "b")
    for name in ("config.json", "summary.json", "requests.csv", "steps.csv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    pipeline = first.derived["pipeline"]
    assert first.summary["completed"] == 40
    assert pipeline["gpus_per_replica"] == 4 and pipeline["virtual_engines"] == 2
    assert [s["layers"] for s in pipeline["stages"]] == [[0, 16], [16, 32]]
    assert pipeline["kv_blocks_per_virtual_engine"] == first.derived["kv_blocks_per_replica"] // 2
    assert all(0 < f < 1 for f in pipeline["stage_busy_fraction"])


@pytest.mark.parametrize("changes, message", [
    (dict(scheduler=SchedulerConfig(speculative=SpeculativeConfig(method="ngram"))), "speculative decoding"),
    (dict(disaggregation=DisaggregationConfig(PoolConfig(), PoolConfig())), "disaggregated"),
    (dict(model="qwen3-30b-a3b", ep=2, replicas=2), "data-parallel expert parallelism"),
    (dict(pp=0), "pp must be >= 1"),
])
def test_layouts_pipelines_do_not_run_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        SimulationConfig(**{"pp": 2, **changes})


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--model", "tiny-llama", "--pp", "3"], "pp=3 exceeds tiny-llama's 2 layers"),
    (["simulate", "--pp", "2", "--speculative", "ngram"],
     "--pp 2 with speculative decoding is not modelled: pipeline stages run plain decoding"),
    (["simulate", "--pp", "2", "--prefill-replicas", "1", "--decode-replicas", "1"],
     "--pp 2 with disaggregated prefill/decode pools is not modelled: pipeline stages run in "
     "co-located replicas"),
    (["run", "--model", "tiny-llama", "--pp", "2"], "pipeline parallelism is simulation-only"),
])
def test_the_commands_refuse_in_one_line(argv, message, tmp_path, capsys):
    assert main([*argv, "--num-requests", "3", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_compare_sweeps_pp_and_plan_counts_tp_times_pp_gpus():
    from servelab.cli import build_parser
    from servelab.sweeps.cli import build_points
    from servelab.sweeps.plan_cli import _unit

    argv = ["compare", "--model", "llama-2-7b", "--gpu", "a100-80gb", "--pp", "1,2", "--policies", "fcfs",
            "--out", "unused"]
    parser = build_parser()
    args = parser.parse_args(argv)
    axes, points = build_points(args, args.func.keywords["parser"])
    assert axes["pp"] == (1, 2) and [p.config.pp for p in points] == [1, 2]
    unit = _unit(argparse.Namespace(objective="gpus", pp=(2,)), {"gpu": "h100-sxm", "tp": 8}, None)
    assert (unit.gpus, unit.describe) == (16, "TP8 PP2")
