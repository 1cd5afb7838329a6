"""Capacity search: the bracketing and bisection on a synthetic attainment curve (a fake
runner), and `servelab capacity` end to end on a small workload, whose answer a fresh
`servelab simulate` at the reported rates must confirm."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from servelab.cli import main
from servelab.reports.slo import slo_attainment
from servelab.simulator.run import SimulationConfig
from servelab.sweeps.capacity import MAX_BRACKET_STEPS, Search, search_capacity
from servelab.sweeps.sweep import PointOutcome

BASE = SimulationConfig(trace="default", num_requests=50)


class FakeRunner:
    """Stands in for a SweepRunner: the attainment at a rate is `curve(policy, rate)`; the
    points for which `fails(policy, rate)` is true fail."""

    def __init__(self, curve, workers: int = 1, fails=lambda policy, rate: False) -> None:
        self.curve, self.workers, self.fails, self.batches = curve, workers, fails, []

    def run(self, points, progress=None):
        self.batches.append([(p.config.policy, p.config.rate) for p in points])
        out = []
        for p in points:
            if self.fails(p.config.policy, p.config.rate):
                out.append(PointOutcome(p, Path("unused") / p.name, "failed", error="RunCheckError: a bug"))
                continue
            attained = self.curve(p.config.policy, p.config.rate)
            summary = {"completed": 1000, "rejected": 0, "duration": 1.0, "request_goodput": 1000 * attained}
            out.append(PointOutcome(p, Path("unused") / p.name, "ran", summary))
        return out


def _searches(*policies: str) -> list[Search]:
    from dataclasses import replace
    return [Search((("policy", p),), lambda rate, p=p: replace(BASE, policy=p, rate=rate)) for p in policies]


def _cliff(at: dict[str, float]):
    """Attainment 1.0 up to at[policy] req/s, 0.5 above."""
    return lambda policy, rate: 1.0 if rate <= at[policy] else 0.5


def test_the_bracket_straddles_the_cliff_within_the_tolerance():
    cliffs = {"fcfs": 11.3, "sjf": 27.0, "fair": 4.1}
    runner = FakeRunner(_cliff(cliffs))
    found = search_capacity(_searches(*cliffs), runner, start_rates=[10.0], target=0.9, tolerance=0.02)
    for c, (policy, cliff) in zip(found, cliffs.items()):
        assert c.status == "found", policy
        assert c.held.rate <= cliff < c.broke.rate
        assert c.width <= 0.02 * (1 + 1e-9)
        assert c.held.held and not c.broke.held and c.held.attainment == 1.0
    assert runner.batches[0] == [("fcfs", 10.0), ("sjf", 10.0), ("fair", 10.0)]   # a shared start


def test_one_group_fills_the_workers_with_probes_per_round():
    one = FakeRunner(_cliff({"fcfs": 13.7}), workers=1)
    three = FakeRunner(_cliff({"fcfs": 13.7}), workers=3)
    a = search_capacity(_searches("fcfs"), one, start_rates=[10.0], tolerance=0.01)[0]
    b = search_capacity(_searches("fcfs"), three, start_rates=[10.0], tolerance=0.01)[0]
    assert a.status == b.status == "found"
    assert max(map(len, three.batches[2:])) == 3
    assert len(three.batches) < len(one.batches)


def test_a_group_that_always_holds_or_always_breaks_says_so():
    runner = FakeRunner(lambda policy, rate: 1.0 if policy == "fcfs" else 0.0)
    holds, breaks = search_capacity(_searches("fcfs", "sjf"), runner, start_rates=[10.0])
    assert holds.status == "holds" and holds.broke is None and holds.rate > 10.0
    assert breaks.status == "breaks" and breaks.held is None and breaks.rate is None
    assert len(holds.probes) == len(breaks.probes) == 1 + MAX_BRACKET_STEPS


def test_a_rate_above_the_first_break_that_held_is_a_note_and_the_bracket_stays_below():
    """Attainment dips at 12-13 req/s and recovers at 15: the capacity stays below 12."""
    curve = lambda policy, rate: 0.5 if 12.0 <= rate < 13.0 or rate > 20.0 else 1.0  # noqa: E731
    c = search_capacity(_searches("fcfs"), FakeRunner(curve), start_rates=[10.0, 12.5, 15.0])[0]
    assert 12.0 <= c.broke.rate <= 12.5 and c.held.rate < 12.0 and c.status == "found"
    assert any("not monotone" in n and "15 req/s" in n for n in c.notes)


def test_a_failed_probe_stops_its_group_only_and_neither_holds_nor_breaks():
    """sjf's first bisection probe (between 10 req/s, held, and 11, broke) fails: its
    capacity is unknown, its bracket is what the other probes found; fcfs goes on."""
    runner = FakeRunner(_cliff({"fcfs": 10.5, "sjf": 10.5}),
                        fails=lambda policy, rate: policy == "sjf" and 10.0 < rate < 11.0)
    fcfs, sjf = search_capacity(_searches("fcfs", "sjf"), runner, start_rates=[10.0])
    assert fcfs.status == "found" and fcfs.held.rate <= 10.5 < fcfs.broke.rate
    assert sjf.status == "failed" and sjf.rate is None and sjf.to_dict()["capacity"] is None
    assert [p.error for p in sjf.failed] == ["RunCheckError: a bug"] and 10.0 < sjf.failed[0].rate < 11.0
    assert (sjf.held.rate, sjf.broke.rate) == (10.0, 11.0) and len(sjf.probes) == 3


@pytest.mark.parametrize("kwargs, message", [
    ({"target": 0.0}, "attainment target"), ({"tolerance": 1.5}, "tolerance"),
    ({"start_rates": [-5.0]}, "start rates must be > 0"),
])
def test_bad_settings_are_refused(kwargs, message):
    args = {"start_rates": [10.0], **kwargs}
    with pytest.raises(ValueError, match=message):
        search_capacity(_searches("fcfs"), FakeRunner(_cliff({"fcfs": 1.0})), **args)


# --------------------------------------------------------------------------- end to end
FLAGS = ["--trace", "default", "--num-requests", "300", "--policies", "fcfs,priority",
         "--slo-ttft-ms", "10000", "--slo-tpot-ms", "200"]


@pytest.fixture(scope="module")
def capacity_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("capacity") / "cap"
    assert main(["capacity", *FLAGS, "--workers", "2", "--out", str(out)]) == 0
    return out


def _simulate_attainment(tmp: Path, policy: str, rate: float) -> float:
    run = tmp / f"{policy}-{rate:g}"
    assert main(["simulate", *[f for f in FLAGS if f not in ("--policies", "fcfs,priority")],
                 "--policy", policy, "--rate", repr(rate), "--out", str(run)]) == 0
    return slo_attainment(json.loads((run / "summary.json").read_text()))


def test_a_fresh_run_at_the_capacity_holds_and_at_the_first_broken_rate_does_not(capacity_dir, tmp_path):
    data = json.loads((capacity_dir / "capacity.json").read_text())
    assert [g["labels"]["policy"] for g in data["groups"]] == ["fcfs", "priority"]
    for group in data["groups"]:
        assert group["status"] == "found", group
        held, broke = group["held"]["rate"], group["broke"]["rate"]
        assert broke / held - 1 <= data["tolerance"] * (1 + 1e-9)
        assert group["bracket_width"] == pytest.approx(broke / held - 1)
        policy = group["labels"]["policy"]
        assert _simulate_attainment(tmp_path, policy, held) >= data["attainment_target"]
        assert _simulate_attainment(tmp_path, policy, broke) < data["attainment_target"]


def test_the_report_opens_with_the_answer_and_draws_the_attainment_curves(capacity_dir):
    data = json.loads((capacity_dir / "capacity.json").read_text())
    text = (capacity_dir / "report.md").read_text()
    first = text.split("\n\n")[1]
    ranked = sorted(data["groups"], key=lambda g: -g["capacity"])
    assert first.startswith(f"{ranked[0]['labels']['policy']} sustains {ranked[0]['capacity']:g} req/s "
                            f"at 90% SLO attainment, {ranked[1]['labels']['policy']} {ranked[1]['capacity']:g} req/s")
    assert (capacity_dir / "figures" / "attainment.png").stat().st_size > 15_000
    assert "How the answer depends on run length" in text
    sweep = json.loads((capacity_dir / "sweep.json").read_text())   # every policy at every capacity
    assert sorted(sweep["axes"]["rate"]) == sorted({g["capacity"] for g in data["groups"]})
    assert len(sweep["points"]) == 2 * len(sweep["axes"]["rate"])


def test_the_report_counts_the_requests_replayed_not_those_asked_for(capacity_dir, tmp_path):
    """--num-requests above the trace's length replays the whole trace: the report says
    how many ran, and that a larger --num-requests cannot lengthen the run."""
    import shutil

    from servelab.reports.capacity_report import write_capacity_report

    out = tmp_path / "cap"
    shutil.copytree(capacity_dir, out)
    data = json.loads((out / "capacity.json").read_text())
    (out / "capacity.json").write_text(json.dumps({**data, "num_requests": 5000}))
    text = write_capacity_report(out).markdown.read_text()
    assert "(llama-3.1-8b on h100-sxm, 300 requests per run;" in text
    assert "a longer run (a longer trace: this one holds 300 requests, fewer than --num-requests " \
           "5,000) gives" in text
    assert "a larger --num-requests" in (capacity_dir / "report.md").read_text()


def test_rerunning_the_search_reuses_every_probe(capacity_dir, capsys):
    assert main(["capacity", *FLAGS, "--workers", "2", "--out", str(capacity_dir)]) == 0
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("capacity: round")]
    assert lines and all("done before, skipped" in l for l in lines)


def test_a_capacity_needs_an_slo(tmp_path, capsys):
    from servelab.traces import Trace, TraceRecord, write_csv
    trace = tmp_path / "plain.csv"   # its requests carry no SLO of their own
    write_csv(Trace(tuple(TraceRecord(0.1 * i, 50, 20) for i in range(20))), trace)
    assert main(["capacity", "--trace", str(trace), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a capacity needs an SLO" in err
    assert not (tmp_path / "x").exists()


def test_tolerance_and_attainment_are_checked(capsys):
    for flag, value in (("--tolerance", "0"), ("--attainment", "1.5")):
        with pytest.raises(SystemExit):
            main(["capacity", flag, value, "--out", "unused"])
        assert f"argument {flag}" in capsys.readouterr().err


def test_a_capacity_whose_run_had_not_settled_is_flagged(tmp_path):
    from servelab.sweeps.capacity import Capacity, Probe, steady_state_warning

    runs = tmp_path / "runs"
    for rate in (3.0, 40.0):
        assert main(["simulate", "--trace", "default", "--num-requests", "300", "--rate", f"{rate:g}",
                     "--engine", "servelab", "--out", str(runs / f"r{rate:g}")]) == 0

    def warning(rate: float):
        held = Probe(rate, f"r{rate:g}", 0.95, True)
        return steady_state_warning(Capacity({"policy": "fcfs"}, 0.9, 0.02, (held,), held, None), runs)

    assert warning(3.0) is None
    flagged = warning(40.0)
    assert flagged.startswith("at 40 req/s only ") and "second half of the run" in flagged
    assert "the waiting queue never emptied over the last quarter of the arrivals" in flagged


def test_runs_that_fail_are_named_and_the_report_comes_from_those_that_succeeded(capacity_dir, tmp_path,
                                                                               monkeypatch, capsys):
    """Every probe above the start rate fails (so every group's search fails): capacity.json and
    the report are still written, from the start probes, naming the failed runs; exit status 1."""
    import shutil

    from servelab.sweeps import runner as runner_module

    out = tmp_path / "cap"
    shutil.copytree(capacity_dir / "runs", out / "runs")   # the probes stored: nothing to simulate
    start = json.loads((capacity_dir / "capacity.json").read_text())["start_rates"][0]
    error = "RunCheckError: request 4: times must satisfy arrival_s <= scheduled_s"

    class FailingAboveTheStart(runner_module.SweepRunner):
        def run(self, points, progress=None):
            below = [p for p in points if p.config.rate <= start]
            ran = dict(zip([p.key for p in below], super().run(below, progress) if below else []))
            return [ran.get(p.key) or PointOutcome(p, self.runs_dir / p.name, "failed", error=error)
                    for p in points]
    monkeypatch.setattr(runner_module, "SweepRunner", FailingAboveTheStart)
    assert main(["capacity", *FLAGS, "--workers", "1", "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    data = json.loads((out / "capacity.json").read_text())
    for group in data["groups"]:
        assert group["status"] == "failed" and group["capacity"] is None
        failed = [p for p in group["probes"] if p["error"]]
        assert len(failed) == 1 and failed[0]["rate"] > start and failed[0]["error"] == error
        ran = [p for p in group["probes"] if not p["error"]]
        assert [p["rate"] for p in ran] == [start]
        assert (group["held"] or group["broke"])["rate"] == start
        policy = group["labels"]["policy"]
        assert f"{policy}: capacity unknown, a run failed at {failed[0]['rate']:g} req/s: {error}" in printed
    text = (out / "report.md").read_text()
    assert "## Runs that failed" in text and text.count(error) == 2
    assert "an unknown rate (a run failed" in text.split("\n\n")[1]
    assert (out / "index.html").exists()


def test_the_opening_sentence_names_the_swept_groups_not_the_first_one():
    """Groups over models (or GPUs): the parenthesis does not name the first group's model
    as everyone's, and an unsettled capacity names its group, not its policy twice; a
    group that found no capacity is not called settled."""
    from servelab.reports.capacity_report import _answer, _bracket_table

    def group(model, policy, rate, unsettled):
        return {"labels": {"model": model, "policy": policy}, "status": "found", "capacity": rate,
                "held": {"rate": rate, "attainment": 0.95}, "broke": {"rate": rate * 1.02,
                                                                    "attainment": 0.8},
                "bracket_width": 0.02, "probes": [1, 2],
                "steady_state_warning": "not steady" if unsettled else None}

    groups = [group("qwen2.5-7b", "fcfs", 20.0, True), group("llama-3.1-8b", "fcfs", 18.0, True)]
    text = _answer(groups, "90% SLO attainment", 0.02,
                   {"model": "qwen2.5-7b", "gpu": "h100-sxm"}, 300)
    assert "(on h100-sxm, 300 requests per run;" in text and "qwen2.5-7b on h100-sxm" not in text
    assert "The run at the capacity of model=qwen2.5-7b, fcfs and of model=llama-3.1-8b, fcfs " \
           "had not settled" in text
    none = {**group("llama-3.1-8b", "fcfs", 0.0, False), "status": "breaks", "capacity": None,
            "held": None}
    assert _bracket_table([none]).rows[0][-1] == "n/a"


def test_a_search_that_finds_no_capacity_says_where_it_compared(tmp_path):
    """Nothing holds (50 KV blocks): no settled-queue claim, no empty run-length section,
    and the comparison is titled at the lowest start rate, not at "each capacity found"."""
    from servelab.cli import main

    out = tmp_path / "cap"
    assert main(["capacity", "--trace", "default", "--policies", "fcfs", "--num-requests", "100",
                 "--kv-blocks", "50", "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "## The policies at the lowest start rate (no capacity was found)" in text
    assert "How the answer depends on run length" not in text
    assert "at each capacity found" not in text
    row = next(x for x in text.splitlines() if x.startswith("| fcfs | n/a"))
    assert row.endswith("| n/a |")


def test_a_capacity_search_over_another_says_its_report_is_replaced(tmp_path, capsys):
    """As compare says of another grid: the same search again says nothing, another one
    (here another policy) says that the earlier report is replaced."""
    from servelab.cli import main

    out = tmp_path / "cap"
    base = ["capacity", "--trace", "default", "--num-requests", "100", "--kv-blocks", "50", "--out", str(out)]
    assert main([*base, "--policies", "fcfs"]) == 0
    assert main([*base, "--policies", "fcfs"]) == 0
    assert "held another" not in capsys.readouterr().err
    assert main([*base, "--policies", "sjf"]) == 0
    assert (f"capacity: note: {out} held another capacity search; its report is replaced by this "
            "one's") in capsys.readouterr().err


def test_a_capacity_whose_run_held_few_of_the_requests_asked_says_so(tmp_path, capsys):
    """Llama-3.1-70B in FP8 on one H100 rejects long requests; the search walks down to a
    rate at which the default workload's 600 s hold 19 of 300 requests, and its capacity
    from those few read as an answer (docs/parallelism.md reports none)."""
    from servelab.cli import main

    assert main(["capacity", "--trace", "default", "--policies", "fcfs", "--rates", "2",
                 "--tolerance", "0.05", "--p99-ttft-ms", "3000", "--p99-tpot-ms", "150",
                 "--num-requests", "300", "--model", "llama-3.1-70b", "--gpu", "h100-sxm",
                 "--weight-dtype", "fp8", "--out", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "  few requests: its run held 19 of the 300 requests asked (the trace ends first at" in out
    # the embedded comparison judges runs by the requests' SLOs, and says the search did not
    report = (tmp_path / "c" / "report.md").read_text()
    assert ("the search above judged its runs by p99 TTFT <= 3000 ms and p99 TPOT <= 150 ms, so a "
            "run may hold here and not there") in " ".join(report.split())
