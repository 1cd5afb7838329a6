"""Grid expansion, atomic point storage, and a sweep that stores, skips and reports failures."""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os

import pytest

from servelab.config import SchedulerConfig
from servelab.reports.runio import read_requests, read_steps
from servelab.simulator.run import SimulationConfig
from servelab.sweeps.runner import run_sweep
from servelab.sweeps.sweep import (DONE_MARKER, LOCK_FILE, RUNS_DIR, SweepError, SweepPoint,
                                      commit_point, expand_grid, is_done, override_builder)

BASE = SimulationConfig(trace="default", model="llama-2-7b", kv_blocks=300, num_requests=20,
                        scheduler=SchedulerConfig(max_model_len=4096))


def test_grid_is_the_product_with_the_last_axis_fastest():
    points = expand_grid({"policy": ["fcfs", "sjf"], "rate": [10.0, 20.0, 30.0]}, override_builder(BASE))
    assert [p.labels for p in points] == [
        (("policy", pol), ("rate", r)) for pol in ("fcfs", "sjf") for r in (10.0, 20.0, 30.0)]
    assert [(p.config.policy, p.config.rate) for p in points] == [
        (pol, r) for pol in ("fcfs", "sjf") for r in (10.0, 20.0, 30.0)]
    assert len({p.key for p in points}) == len({p.name for p in points}) == 6


def test_override_builder_sets_scheduler_fields_and_drops_other_policies_options():
    base = SimulationConfig(trace="default", policy="sjf", policy_options={"max_wait_s": 5.0})
    build = override_builder(base)
    c = build({"policy": "fcfs", "chunked_prefill": None, "preemption": "swap", "block_size": 32})
    assert (c.policy, c.policy_options, c.block_size) == ("fcfs", {}, 32)
    assert (c.scheduler.chunked_prefill, c.scheduler.preemption) == (None, "swap")
    assert build({"policy": "sjf"}).policy_options == {"max_wait_s": 5.0}
    with pytest.raises(ValueError, match="unknown sweep axis 'colour'"):
        build({"colour": "red"})


@pytest.mark.parametrize("axes, message", [
    ({"policy": []}, "has no values"),
    ({"rate": [10.0, 10.0]}, "lists 10 twice"),
    ({"rate": [10.0], "seed": [0, 0.0]}, "lists 0 twice"),
])
def test_bad_grids_are_rejected(axes, message):
    with pytest.raises(ValueError, match=message):
        expand_grid(axes, override_builder(BASE))


def test_two_points_that_are_one_simulation_are_rejected():
    # an axis whose values do not change the config would run every point twice
    with pytest.raises(ValueError, match=r"are the same simulation: label \(a or b\) changes "
                                         r"nothing; sweep it in a comparison of its own$"):
        expand_grid({"rate": [10.0], "label": ["a", "b"]}, lambda values: BASE)


def test_commit_is_atomic_and_the_first_writer_wins(tmp_path):
    point = SweepPoint(BASE, (("policy", "fcfs"),))
    runs = tmp_path / RUNS_DIR

    def writer(text):
        def write(d):
            (d / "data.txt").write_text(text)
        return write

    final = commit_point(point, runs, writer("first"))
    assert is_done(final, point.key) and (final / "data.txt").read_text() == "first"
    assert commit_point(point, runs, writer("second")) == final   # a duplicate writer lands nothing
    assert (final / "data.txt").read_text() == "first"

    other = SweepPoint(dataclasses.replace(BASE, seed=3), (("seed", 3),))

    def broken(d):
        (d / "half.txt").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        commit_point(other, runs, broken)
    assert sorted(p.name for p in runs.iterdir()) == [point.name]   # no half point, no temp dir
    assert not is_done(final, other.key)


def test_a_locked_directory_is_refused(tmp_path):
    points = expand_grid({"rate": [10.0]}, override_builder(BASE))
    tmp_path.mkdir(exist_ok=True)
    with open(tmp_path / LOCK_FILE, "a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SweepError, match="another sweep is writing"):
            run_sweep(points, tmp_path, workers=1)


def test_sweep_stores_each_point_skips_done_ones_and_reports_failures(tmp_path):
    points = expand_grid({"policy": ["fcfs", "sjf"], "rate": [10.0, 20.0]}, override_builder(BASE))
    bad = SweepPoint(SimulationConfig(trace=str(tmp_path / "missing.csv")), (("trace", "missing"),))
    runs = tmp_path / RUNS_DIR
    # leftovers of a killed sweep: a temporary directory and a point without its marker
    (runs / f".{points[0].name}.99999.tmp").mkdir(parents=True)
    (runs / points[1].name).mkdir()
    (runs / points[1].name / "summary.json").write_text("{half")
    seen = []

    outcome = run_sweep([*points, bad], tmp_path, workers=2,
                        progress=lambda o, done, total: seen.append((o.point.key, o.status, done, total)))
    assert [o.status for o in outcome.outcomes] == ["ran"] * 4 + ["failed"]
    assert "missing.csv" in outcome.failed[0].error
    assert sorted(s[2] for s in seen) == [1, 2, 3, 4, 5] and {s[3] for s in seen} == {5}
    assert sorted(p.name for p in runs.iterdir()) == sorted(p.name for p in points)
    for o in outcome.outcomes[:4]:
        assert is_done(o.run_dir, o.point.key)
        stored = json.loads((o.run_dir / "config.json").read_text())
        assert stored["config"] == o.point.config.to_dict()
        assert json.loads((o.run_dir / "summary.json").read_text()) == o.summary
        assert len(read_requests(o.run_dir / "requests.csv")) == 20
        assert read_steps(o.run_dir / "steps.csv")
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert [p["key"] for p in sweep["points"]] == [p.key for p in [*points, bad]]

    stamps = {p.name: os.stat(runs / p.name / DONE_MARKER).st_mtime_ns for p in points}
    again = run_sweep(points, tmp_path, workers=2)
    assert [o.status for o in again.outcomes] == ["done before"] * 4
    assert [o.summary for o in again.outcomes] == [o.summary for o in outcome.outcomes[:4]]
    assert stamps == {p.name: os.stat(runs / p.name / DONE_MARKER).st_mtime_ns for p in points}
