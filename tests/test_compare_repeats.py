"""A comparison on a workload that gives some policies nothing to act on (one tenant, one
priority, no prefix caching) says so, shows their identical runs once, and draws no
fairness figure for a single tenant."""
from __future__ import annotations

from pathlib import Path

import pytest

from servelab.cli import main
from servelab.reports.comparison import load_comparison
from servelab.reports.document import Image, Text
from servelab.reports.repeats import repeated_policies
from servelab.reports.report import build_document


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, traces_dir) -> Path:
    out = tmp_path_factory.mktemp("repeats") / "sweep"
    assert main(["compare", "--trace", "azure-conv-2023", "--trace-dir", str(traces_dir),
                 "--num-requests", "60", "--policies", "fcfs,priority,sjf,fair",
                 "--rates", "4,40", "--max-num-seqs", "4", "--workers", "1",
                 "--out", str(out)]) == 0
    return out


def test_identical_runs_are_found_and_named_with_what_the_workload_lacks(sweep):
    comparison = load_comparison(sweep)
    assert repeated_policies(comparison.points) == {"priority": "fcfs", "fair": "fcfs"}
    doc = build_document(comparison)
    texts = [b.text for b in doc if isinstance(b, Text)]
    note = next(t for t in texts if "made the same schedule as" in t)
    assert note.startswith("priority and fair made the same schedule as fcfs at every rate")
    assert "one tenant (default)" in note and "every request has priority 0" in note
    assert "Fairness across tenants: one tenant (default), so no figure." in texts
    assert not any(isinstance(b, Image) and b.name.startswith("fairness") for b in doc)


def test_findings_and_figures_rank_distinct_runs_only(sweep):
    doc = build_document(load_comparison(sweep))
    findings = " ".join(b.text for b in doc if isinstance(b, Text)
                        and "same schedule as" not in b.text
                        and "simulations of the trace" not in b.text)
    assert "fair" not in findings.replace("fairness", "").replace("Fairness", "")
    latency = next(b for b in doc if isinstance(b, Image) and b.name.startswith("latency_cdf"))
    labels = {line.get_label() for ax in latency.figure.axes for line in ax.get_lines()}
    assert {"fcfs", "sjf"} <= labels and not {"priority", "fair"} & labels


def test_distinct_policies_are_not_grouped():
    from types import SimpleNamespace

    from servelab.records import RequestRecord

    def point(policy, rate, finish):
        return SimpleNamespace(policy=policy, rate=rate, requests=[
            RequestRecord(0, 0.0, 10, 5, "finished", 0.0, 0.1, 1.0),
            RequestRecord(1, 0.0, 10, 5, "finished", 0.0, 0.2, finish)])

    points = [point("fcfs", 1, 2.0), point("sjf", 1, 2.0), point("fcfs", 2, 3.0),
              point("sjf", 2, 2.5), point("fair", 1, 2.0), point("fair", 2, 3.0)]
    assert repeated_policies(points) == {"fair": "fcfs"}
    points[-1] = point("fair", 2, 3.0 * (1 + 1e-12))     # the same times, summed in another order
    assert repeated_policies(points) == {"fair": "fcfs"}
    points[-1] = point("fair", 2, 3.0 * (1 + 1e-6))      # another schedule
    assert repeated_policies(points) == {}
