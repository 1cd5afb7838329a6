"""A sweep killed with SIGKILL halfway resumes: the rerun skips the stored points, runs the
rest, and leaves exactly one complete, uncorrupted run directory per point."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from servelab.reports.metrics import summarize
from servelab.reports.runio import read_requests, read_steps
from servelab.sweeps.sweep import DONE_MARKER, RUNS_DIR

POLICIES, RATES = ("fcfs", "sjf"), ("10", "20", "30")
N_POINTS = len(POLICIES) * len(RATES)


def _compare(out: Path) -> list[str]:
    return [sys.executable, "-m", "servelab", "compare", "--trace", "default", "--num-requests", "150",
            "--model", "llama-2-7b", "--kv-blocks", "300", "--policies", ",".join(POLICIES),
            "--rates", ",".join(RATES), "--slo-ttft-ms", "2000", "--workers", "2", "--out", str(out)]


def _stored(out: Path) -> set[str]:
    return {p.parent.name for p in (out / RUNS_DIR).glob(f"*/{DONE_MARKER}")}


def test_sigkill_halfway_then_rerun_completes_without_corrupt_or_duplicate_points(tmp_path):
    out = tmp_path / "sweep"
    # its own session, so that killing the group kills the driver and its pool workers at once
    proc = subprocess.Popen(_compare(out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while len(_stored(out)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL, "the sweep finished before it could be killed"
    before = _stored(out)
    assert 2 <= len(before) < N_POINTS
    inodes = {name: os.stat(out / RUNS_DIR / name / "summary.json").st_ino for name in before}

    rerun = subprocess.run(_compare(out), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    lines = [line for line in rerun.stderr.splitlines() if line.startswith("compare: [")]
    assert len(lines) == N_POINTS
    assert sum("done before, skipped" in line for line in lines) == len(before)
    assert sum(line.split("  ")[1] == "done" for line in lines) == N_POINTS - len(before)
    assert "report: " in rerun.stdout

    sweep = json.loads((out / "sweep.json").read_text())
    names = [p["name"] for p in sweep["points"]]
    # exactly one directory per point: no temporary leftovers, no duplicates
    assert sorted(p.name for p in (out / RUNS_DIR).iterdir()) == sorted(names)
    for entry in sweep["points"]:
        run = out / RUNS_DIR / entry["name"]
        assert json.loads((run / DONE_MARKER).read_text())["key"] == entry["key"]
        config = json.loads((run / "config.json").read_text())["config"]
        assert (config["policy"], f"{config['rate']:g}") == (entry["labels"]["policy"],
                                                             f"{entry['labels']['rate']:g}")
        requests, steps = read_requests(run / "requests.csv"), read_steps(run / "steps.csv")
        assert len(requests) == 150
        stored = json.loads((run / "summary.json").read_text())
        cost = json.loads((run / "config.json").read_text())["derived"]["cost_model"]
        assert stored == {"engine": cost["engine"], "profile": cost["calibration"],
                          "profile_engine_version": cost["calibration_engine_version"],
                          **json.loads(json.dumps(summarize(
                              requests, steps, slo_ttft_ms=2000.0, tenant_weights=None)))}
    # points stored before the kill were skipped, not rewritten
    assert inodes == {name: os.stat(out / RUNS_DIR / name / "summary.json").st_ino for name in before}
    assert (out / "index.html").stat().st_size > 0 and (out / "report.md").stat().st_size > 0
