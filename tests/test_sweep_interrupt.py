"""Ctrl-C on a sweep, as a terminal sends it (SIGINT to the whole process group): the
command stops within seconds, leaves no worker behind, says in one line what is stored and
how to resume, and a rerun resumes with nothing lost."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

RATES = ",".join(str(r) for r in range(2, 12))   # 10 rates x 4 policies: 40 points


def _compare(out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "servelab", "compare", "--trace", "default", "--num-requests", "150",
         "--policies", "fcfs,priority,sjf,fair", "--rates", RATES, "--workers", "2",
         "--out", str(out)],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_ctrl_c_stops_a_sweep_at_once_and_a_rerun_resumes(tmp_path):
    out = tmp_path / "cmp"
    proc = _compare(out)
    lines = []
    for line in proc.stderr:                      # wait until two points are stored
        lines.append(line)
        if sum("  done" in l for l in lines) >= 2:
            break
    assert proc.poll() is None, "".join(lines)
    os.killpg(proc.pid, signal.SIGINT)
    start = time.monotonic()
    rest = proc.stderr.read()
    proc.wait(timeout=30)
    assert time.monotonic() - start < 15, "the sweep did not stop within seconds"
    assert proc.returncode == 130
    last = rest.strip().splitlines()[-1]
    assert last.startswith("interrupted: ") and "run the same command again to resume" in last
    assert "Traceback" not in rest
    stored = int(last.split()[1])
    assert 2 <= stored < 40
    deadline = time.monotonic() + 10
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _group_alive(proc.pid), "a worker outlived the command"

    again = _compare(out)
    err = again.stderr.read()
    assert again.wait(timeout=600) == 0, err
    assert err.count("done before, skipped") == stored
    assert "[40/40]" in err and (out / "report.md").is_file()


def test_an_interruption_counts_the_points_stored_on_disk(tmp_path, monkeypatch):
    """A pool worker may commit a point whose result the driver has not received when
    Ctrl-C arrives: the message counts what is on disk, as the rerun will skip it."""
    from servelab.simulator.run import SimulationConfig
    from servelab.sweeps import runner as R
    from servelab.sweeps.sweep import RUNS_DIR, SweepPoint, commit_point

    points = [SweepPoint(SimulationConfig(trace="default", num_requests=10, seed=s), (("seed", s),))
              for s in range(3)]

    def interrupted_pool(self, pending, settle):
        commit_point(pending[0], self.runs_dir, lambda d: None)   # stored, never settled
        raise KeyboardInterrupt

    monkeypatch.setattr(R.SweepRunner, "_run_on_pool", interrupted_pool)
    with pytest.raises(R.SweepInterrupted, match=r"interrupted: 1 point\(s\) of this sweep"):
        with R.SweepRunner(tmp_path / "cmp", workers=1) as runner:
            runner.run(points)
    assert sum(1 for d in (tmp_path / "cmp" / RUNS_DIR).iterdir() if not d.name.startswith(".")) == 1
