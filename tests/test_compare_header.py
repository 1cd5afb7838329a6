"""The comparison report's header ("Every point: ...") names the pipeline depth and the
expert / data parallelism of the runs where they are not 1, swept or not; a swept pp is
an axis (named in the sweep sentence and a table column), not a fixed setting."""
from __future__ import annotations

import pytest

from servelab.cli import main

BASE = ["compare", "--trace", "default", "--num-requests", "12", "--policies", "fcfs",
        "--workers", "1"]


def _report(tmp_path, *argv) -> str:
    out = tmp_path / "cmp"
    assert main([*BASE, *map(str, argv), "--out", str(out)]) == 0
    return (out / "report.md").read_text()


def _every_point(report: str) -> str:
    (line,) = [line for line in report.splitlines() if line.startswith("Every point: ")]
    return line


def test_a_fixed_pipeline_depth_is_in_the_header(tmp_path):
    line = _every_point(_report(tmp_path, "--model", "llama-2-7b", "--tp", 2, "--pp", 2))
    assert "; tensor parallelism 2; pipeline parallelism 2 (4 GPUs per replica); 1 replica(s);" in line
    assert "expert parallelism" not in line


def test_expert_and_data_parallelism_are_in_the_header(tmp_path):
    line = _every_point(_report(tmp_path, "--model", "qwen3-30b-a3b", "--dp", 2))
    assert ("; tensor parallelism 1; expert parallelism 2, data parallelism 2 (each replica one "
            "data-parallel attention rank); 2 replica(s);") in line
    assert "pipeline parallelism" not in line


@pytest.mark.parametrize("argv", [(), ("--model", "qwen3-30b-a3b")])
def test_parallelism_of_1_is_not_mentioned(tmp_path, argv):
    line = _every_point(_report(tmp_path, *argv))
    assert "tensor parallelism 1; 1 replica(s)" in line
    assert "pipeline parallelism" not in line and "expert parallelism" not in line


def test_a_swept_pipeline_depth_is_an_axis_not_a_setting(tmp_path):
    report = _report(tmp_path, "--model", "llama-2-7b", "--pp", "1,2")
    assert "sweeping pp (1, 2)" in report
    assert "pipeline parallelism" not in _every_point(report)
    assert "KV blocks per replica" not in _every_point(report)   # it differs with pp
    header = next(line for line in report.splitlines() if "| Throughput (req/s) |" in line)
    assert header.startswith("| Policy | Rate (req/s) | PP | Throughput (req/s) |")


def test_settings_a_swept_gpu_or_engine_sets_are_not_claimed_for_every_point(tmp_path):
    """The A100's config.json holds vLLM to 256 sequences and 2,048 tokens where the H100
    takes the engine's 1,024 and 8,192; servelab's own engine chunks prefills at 512 tokens
    and keeps no prefix cache."""
    line = _every_point(_report(tmp_path, "--gpus", "h100-sxm,a100-80gb"))
    assert "batching of at most" not in line and "KV blocks per replica" not in line
    assert line.endswith("Differing with the points' engines, GPUs or models (each run's "
                         "config.json has them): KV blocks, batch limits, chunked prefill.")
    line = _every_point(_report(tmp_path / "e", "--engines", "vllm-0.24,servelab"))
    assert "prefix caching" not in line.split(". Differing")[0]
    assert "chunked prefill" in line.split(". Differing")[1]
