"""Progress bars of long runs: `servelab simulate` and `servelab run` show requests done,
the time left and the run's own clock, on a terminal only."""
from __future__ import annotations

import io
import types

from servelab.backends.clocks import Progress
from servelab.progress import RequestProgress


def test_the_bar_shows_requests_the_run_clock_and_an_eta():
    stream = io.StringIO()
    bar = RequestProgress(10, command="simulate", clock="simulated", stream=stream, enabled=True,
                          min_interval_s=0)
    bar.update(3, 12.5)
    bar.close()
    text = stream.getvalue()
    assert "simulate:" in text and "3/10 requests" in text and "simulated 12.5 s" in text
    assert "<" in text   # elapsed<remaining: the ETA


def test_off_a_terminal_nothing_is_drawn():
    quiet = io.StringIO()
    bar = RequestProgress(10, command="simulate", clock="simulated", stream=quiet)
    bar.update(3, 1.0)
    bar.close()
    assert quiet.getvalue() == ""


def test_off_a_terminal_a_run_may_ask_for_plain_lines():
    """`servelab run` into a log: a plain line every plain_every_s (here every update), and
    one when it ends, so a long run is never silent."""
    log = io.StringIO()
    bar = RequestProgress(10, command="run", clock="virtual clock", stream=log, plain_every_s=0)
    bar.update(3, 1.5, "2 running")
    bar.update(10, 4.0)
    bar.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("run: 3/10 requests, virtual clock 1.5 s, 2 running  (elapsed ")
    assert lines[2].startswith("run: 10/10 requests, virtual clock 4.0 s, finished")


def test_plain_lines_are_spaced_in_wall_time():
    log = io.StringIO()
    bar = RequestProgress(10, command="run", clock="virtual clock", stream=log, plain_every_s=3600)
    for done in range(10):
        bar.update(done, float(done))
    assert log.getvalue() == ""
    bar.close()
    assert log.getvalue().count("\n") == 1


def test_the_engine_loop_writes_plain_lines_off_a_terminal_unless_told_not_to(capsys, monkeypatch):
    sched = types.SimpleNamespace(num_running=1, num_waiting=0, num_swapped=0)
    monkeypatch.setattr(Progress, "PLAIN_EVERY_S", 0.0)
    for enabled, expected_lines in ((None, 2), (False, 0)):
        progress = Progress(4, enabled=enabled, clock="virtual")
        progress.update(2, 1.0, 5, sched, force=True)
        progress.close()
        assert capsys.readouterr().err.count("run: ") == expected_lines


def test_the_real_engine_loop_shows_its_clock_and_the_scheduler_state(capsys):
    sched = types.SimpleNamespace(num_running=4, num_waiting=7, num_swapped=0)
    progress = Progress(20, enabled=True, clock="wall")
    progress.update(5, 3.25, 40, sched, force=True)
    progress.close()
    err = capsys.readouterr().err
    assert "run:" in err and "5/20 requests" in err and "wall clock 3.2 s" in err
    assert "4 running, 7 waiting, 0 swapped, 40 steps" in err


def _outcome(status: str, error: str | None = None):
    point = types.SimpleNamespace(describe=lambda: "policy=fcfs rate=12")
    return types.SimpleNamespace(status=status, error=error, point=point, summary={})


def test_a_sweep_writes_one_line_per_point_off_a_terminal():
    from servelab.progress import PointProgress

    stream = io.StringIO()
    progress = PointProgress(command="compare", stream=stream, detail=lambda o: " (90.0% within SLO)")
    progress.prefix = "round 1 "
    progress(_outcome("ran"), 1, 10)
    progress(_outcome("failed", "ValueError: bad"), 2, 10)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("compare: round 1 [ 1/10] policy=fcfs rate=12  done (90.0% within SLO)  (elapsed ")
    assert lines[1].startswith("compare: round 1 [ 2/10] policy=fcfs rate=12  FAILED: ValueError: bad  (elapsed ")
    assert "\r" not in stream.getvalue()   # no bar off a terminal


def test_on_a_terminal_the_lines_sit_above_a_bar_of_the_batch():
    from servelab.progress import PointProgress

    stream = io.StringIO()
    progress = PointProgress(command="capacity", stream=stream, enabled=True)
    progress(_outcome("done before"), 1, 2)
    progress(_outcome("ran"), 2, 2)
    text = stream.getvalue()
    assert "capacity: [1/2] policy=fcfs rate=12  done before, skipped" in text
    assert "1/2" in text and "point" in text   # tqdm's bar: points settled of the batch
    assert progress._bar is None               # closed with its batch
