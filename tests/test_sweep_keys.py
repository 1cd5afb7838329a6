"""A sweep point's key: same config -> same key, in any process; any field change -> another key."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from servelab.config import AdmissionConfig, SpeculativeConfig, SchedulerConfig
from servelab.simulator.disaggregation import DisaggregationConfig, PoolConfig
from servelab.simulator.run import SimulationConfig
from servelab.sweeps.sweep import SweepPoint, config_key

BASE = SimulationConfig(trace="default", model="llama-2-7b", rate=10.0, num_requests=40, policy="sjf")

#: One other valid value for every SimulationConfig field.
CHANGED = {
    "trace": "other.csv", "trace_dir": "/data/traces", "trace_format": "azure", "on_bad_row": "drop",
    "rate": 11.0, "arrival_cv": 2.0, "rate_scale": 1.5, "num_requests": 41, "seed": 1,
    "download": False, "model": "llama-3.1-8b", "gpu": "a100-80gb", "tp": 2, "pp": 2, "weight_dtype": "fp8",
    "kv_dtype": "fp8", "calibration": "cal.json", "engine": "vllm-0.24",
    "gpu_memory_utilization": 0.8,
    "scheduler": SchedulerConfig(max_num_seqs=64), "policy": "fcfs",
    "policy_options": {"max_wait_s": 5.0}, "block_size": 32, "kv_blocks": 300, "cpu_kv_blocks": 10,
    "block_manager": "contiguous-max", "prefix_caching": True, "watermark": 0.02, "replicas": 2,
    "router": "least-outstanding", "slo_ttft_ms": 500.0, "slo_tpot_ms": 50.0, "fast_forward": False,
    "kv_offload_gb": 4.0, "ep": 2, "expert_load": "power-law:1.2", "async_scheduling": True,
    "disaggregation": DisaggregationConfig(PoolConfig(replicas=2), PoolConfig(replicas=1)),
}
#: Fields whose change needs another one changed too (a CPU tier needs prefix caching;
#: expert parallelism over 2 GPUs at tp 1 makes 2 data-parallel ranks, 2 replicas).
ALONG = {"kv_offload_gb": {"prefix_caching": True}, "ep": {"replicas": 2}}
#: One other valid value for every SchedulerConfig field.
CHANGED_SCHEDULER = {
    "max_num_seqs": 7, "max_num_batched_tokens": 4096, "chunked_prefill": None,
    "step_composition": "prefill_first", "preemption": "swap", "max_model_len": 2048,
    "waiting_queue_limit": 3, "batching": "static",
    "admission": AdmissionConfig(shed_from_priority=1),
    "speculative": SpeculativeConfig("ngram"),
}


def test_every_field_is_covered_by_a_change():
    assert set(CHANGED) == {f.name for f in dataclasses.fields(SimulationConfig)}
    assert set(CHANGED_SCHEDULER) == {f.name for f in dataclasses.fields(SchedulerConfig)}


def test_any_field_change_gives_another_key():
    base = config_key(BASE)
    keys = {base}
    for name, value in CHANGED.items():
        changed = dataclasses.replace(BASE, **{name: value, **ALONG.get(name, {})})
        assert changed != BASE
        assert config_key(changed) != base, name
        keys.add(config_key(changed))
    for name, value in CHANGED_SCHEDULER.items():
        changed = dataclasses.replace(BASE, scheduler=dataclasses.replace(BASE.scheduler, **{name: value}))
        assert config_key(changed) != base, name
        keys.add(config_key(changed))
    assert len(keys) == 1 + len(CHANGED) + len(CHANGED_SCHEDULER)  # all distinct


def test_equal_configs_share_a_key():
    twin = SimulationConfig(trace="default", model="llama-2-7b", rate=10.0, num_requests=40, policy="sjf")
    assert config_key(twin) == config_key(BASE)
    assert config_key(SimulationConfig.from_dict(json.loads(json.dumps(BASE.to_dict())))) == config_key(BASE)
    # equal values of another numeric type are the same config
    assert config_key(dataclasses.replace(BASE, rate=10)) == config_key(BASE)
    assert config_key(dataclasses.replace(BASE, watermark=0)) == \
        config_key(dataclasses.replace(BASE, watermark=0.0))
    # the order policy options were given in does not matter
    a = dataclasses.replace(BASE, policy="fair", policy_options={"weights": {"x": 1.0, "y": 2.0}})
    b = dataclasses.replace(BASE, policy="fair", policy_options={"weights": {"y": 2.0, "x": 1.0}})
    assert config_key(a) == config_key(b)


def test_key_is_the_same_in_another_process():
    code = ("from servelab.simulator.run import SimulationConfig; "
            "from servelab.sweeps.sweep import config_key; "
            "print(config_key(SimulationConfig(trace='default', model='llama-2-7b', rate=10.0, "
            "num_requests=40, policy='sjf')))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    key = config_key(BASE)
    assert out.stdout.strip() == key
    assert len(key) == 64 and int(key, 16) >= 0


def test_point_name_is_readable_and_carries_the_key():
    point = SweepPoint(dataclasses.replace(BASE, model="/models/My Model/config.json"),
                       (("model", "/models/My Model/config.json"), ("policy", "sjf"), ("rate", 10.0),
                        ("chunked_prefill", None)))
    assert point.name == f"config.json_sjf_r10_chunkoff_{point.key[:12]}"
    assert point.describe() == "model=/models/My Model/config.json policy=sjf rate=10 chunked_prefill=off"


def test_a_point_at_the_traces_own_rate_says_so():
    """No --rates (the trace's arrivals, or --rate-scale's): 'as traced', not 'off'; the
    directory name keeps its old spelling so that stored sweeps still resume."""
    point = SweepPoint(BASE, (("policy", "fcfs"), ("rate", None), ("chunked_prefill", None)))
    assert point.describe() == "policy=fcfs rate=as traced chunked_prefill=off"
    assert point.name.startswith("fcfs_roff_chunkoff_")
