"""The simulator behaves like the systems it models: reservation wastes memory, load and
scarce memory cost latency and preemptions, replicas absorb load."""
from __future__ import annotations

import pytest

from servelab.config import SchedulerConfig
from servelab.reports.runio import read_steps
from servelab.simulator.run import SimulationConfig, run_simulation
from servelab.traces import TenantSpec, Uniform, WorkloadSpec, generate, write_csv


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    """~300 requests in 10 s: more than one Llama-2-7B on an A100 serves at once."""
    spec = WorkloadSpec((TenantSpec("t", rate=30.0, prompt=Uniform(100, 800), output=Uniform(50, 400)),),
                        duration_s=10.0)
    path = tmp_path_factory.mktemp("physics") / "trace.csv"
    write_csv(generate(spec, seed=1), path)
    return path


def run(trace_file, out_dir=None, **changes):
    base = dict(trace=str(trace_file), model="llama-2-7b", gpu="a100-80gb",
                scheduler=SchedulerConfig(max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=4096))
    return run_simulation(SimulationConfig(**{**base, **changes}), out_dir)


def running_stats(steps) -> tuple[int, float]:
    total = sum(s.num_steps for s in steps)
    return max(s.num_running for s in steps), sum(s.num_running * s.num_steps for s in steps) / total


def test_contiguous_max_reservation_holds_far_fewer_requests_than_paging(trace_file, tmp_path):
    run(trace_file, tmp_path / "paged", kv_blocks=2000)
    run(trace_file, tmp_path / "max", kv_blocks=2000, block_manager="contiguous-max")
    paged_max, paged_mean = running_stats(read_steps(tmp_path / "paged" / "steps.csv"))
    max_max, max_mean = running_stats(read_steps(tmp_path / "max" / "steps.csv"))
    assert max_max <= 2000 // (4096 // 16)          # one max_model_len reservation each
    assert paged_max >= 4 * max_max
    assert paged_mean >= 3 * max_mean


def test_doubling_the_load_raises_latency(trace_file):
    base = run(trace_file, rate_scale=0.5).summary
    double = run(trace_file, rate_scale=1.0).summary
    assert double["mean_ttft_ms"] > 1.5 * base["mean_ttft_ms"]
    assert double["mean_e2el_ms"] > base["mean_e2el_ms"]


def test_a_larger_kv_cache_preempts_less(trace_file):
    small = run(trace_file, kv_blocks=400).summary
    large = run(trace_file, kv_blocks=1600).summary
    assert small["num_preemptions"] > 0
    assert large["num_preemptions"] < small["num_preemptions"]
    assert large["mean_e2el_ms"] < small["mean_e2el_ms"]


def test_more_replicas_cut_ttft_under_load(trace_file):
    one = run(trace_file).summary
    two = run(trace_file, replicas=2, router="least-outstanding").summary
    assert two["completed"] == one["completed"]
    assert two["mean_ttft_ms"] < 0.5 * one["mean_ttft_ms"]
