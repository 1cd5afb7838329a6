"""A grid on a local Ray instance stores the same bytes as the local process pool; without
Ray installed, asking for it is a clear error."""
from __future__ import annotations

import re
import sys

import pytest

from servelab.config import SchedulerConfig
from servelab.simulator.run import SimulationConfig
from servelab.sweeps.runner import run_sweep
from servelab.sweeps.sweep import RAY_INSTALL_HINT, RUNS_DIR, SweepError, expand_grid, override_builder

BASE = SimulationConfig(trace="default", model="llama-2-7b", kv_blocks=300, num_requests=30,
                        scheduler=SchedulerConfig(max_model_len=4096))


def test_ray_grid_stores_what_the_local_pool_stores(tmp_path):
    points = expand_grid({"policy": ["fcfs", "sjf"], "rate": [10.0, 20.0]}, override_builder(BASE))
    on_ray = run_sweep(points, tmp_path / "ray", workers=2, ray=True)
    assert [o.status for o in on_ray.outcomes] == ["ran"] * 4
    on_pool = run_sweep(points, tmp_path / "pool", workers=2)
    for a, b in zip(on_ray.outcomes, on_pool.outcomes):
        assert a.run_dir.parent == tmp_path / "ray" / RUNS_DIR
        assert a.summary == b.summary
        for name in ("config.json", "summary.json", "requests.csv", "steps.csv", "done.json"):
            assert (a.run_dir / name).read_bytes() == (b.run_dir / name).read_bytes(), name
    # a rerun on Ray finds every point done and starts nothing
    assert [o.status for o in run_sweep(points, tmp_path / "ray", ray=True).outcomes] == ["done before"] * 4


def test_without_ray_installed_the_error_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)   # `import ray` now raises ImportError
    points = expand_grid({"rate": [10.0]}, override_builder(BASE))
    with pytest.raises(SweepError, match=re.escape(f"needs the ray package: {RAY_INSTALL_HINT}")):
        run_sweep(points, tmp_path, ray_address="auto")
    assert RAY_INSTALL_HINT == "pip install 'servelab[ray]'"
