"""summary.json names the engine preset and the calibration profile that priced the run,
as config.json's `derived` names them, and adds nothing else: the rest of it is still
exactly `summarize` over the run's own requests and steps."""
from __future__ import annotations

import json

import pytest

from servelab.reports.metrics import summarize
from servelab.reports.runio import read_requests, read_steps
from servelab.simulator.disaggregation import DisaggregationConfig, PoolConfig
from servelab.simulator.run import SimulationConfig, run_simulation
from servelab.traces import Trace, TraceRecord, write_csv

NAMES = ("engine", "profile", "profile_engine_version")


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    records = [TraceRecord(0.05 * i, 40 + (37 * i) % 300, 20 + (53 * i) % 200) for i in range(30)]
    path = tmp_path_factory.mktemp("trace") / "small.csv"
    write_csv(Trace(tuple(records)), path)
    return path


def _read(run) -> tuple[dict, dict]:
    return (json.loads((run / "summary.json").read_text()),
            json.loads((run / "config.json").read_text()))


@pytest.mark.parametrize("changes, engine, version", [
    (dict(engine="vllm-0.24"), "vllm-0.24", "0.24.0"),
    (dict(engine="vllm-0.14"), "vllm-0.14", "0.14.0"),
    (dict(), "servelab", "0.14.0"),                      # no preset: the GPU's catalog profile
    (dict(engine="vllm-0.24", calibration="none"), "vllm-0.24", None),   # the bare roofline
    (dict(engine="vllm-0.24", model="llama-2-7b", tp=2, pp=2), "vllm-0.24", "0.24.0"),
])
def test_summary_names_the_engine_and_profile_as_config_json_does(trace_file, tmp_path, changes,
                                                                   engine, version):
    config = SimulationConfig(trace=str(trace_file), gpu="h100-sxm", slo_ttft_ms=500.0, **changes)
    result = run_simulation(config, tmp_path / "run")
    summary, doc = _read(tmp_path / "run")
    cost = doc["derived"]["cost_model"]
    assert list(summary)[:3] == list(NAMES)   # at the head of the file
    assert (summary["engine"], summary["profile"], summary["profile_engine_version"]) == \
        (cost["engine"], cost["calibration"], cost["calibration_engine_version"])
    assert (summary["engine"], summary["profile_engine_version"]) == (engine, version)
    assert summary["profile"] == ("none" if config.calibration == "none" else
                                  "h100-sxm.vllm-0.24" if version == "0.24.0" else "h100-sxm")
    # nothing else changed: the rest is the summary of the run's own records
    rest = {k: v for k, v in summary.items() if k not in NAMES}
    run = tmp_path / "run"
    requests, steps = read_requests(run / "requests.csv"), read_steps(run / "steps.csv")
    assert rest == json.loads(json.dumps(summarize(requests, steps, slo_ttft_ms=500.0)))
    # the in-memory summary (what a sweep keeps for a fresh point) is the file's
    assert json.loads(json.dumps(result.summary)) == summary


def test_a_disaggregated_summary_names_each_pools_profile(trace_file, tmp_path):
    config = SimulationConfig(trace=str(trace_file), engine="vllm-0.24", gpu="h100-sxm",
                              disaggregation=DisaggregationConfig(PoolConfig(), PoolConfig(gpu="a100-80gb")))
    run_simulation(config, tmp_path / "run")
    summary, doc = _read(tmp_path / "run")
    pools = doc["derived"]["disaggregation"]
    assert summary["engine"] == doc["derived"]["engine"] == "vllm-0.24"
    assert summary["profile"] == {name: pools[name]["cost_model"]["calibration"]
                                  for name in ("prefill", "decode")}
    assert summary["profile"]["prefill"] != summary["profile"]["decode"]
    assert "profile_engine_version" not in summary   # config.json names none per pool
