"""The prefix-caching section of the comparison report: hit rate per point and over each
run, and the findings on lpm and prefix-affinity routing."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from servelab.cli import main
from servelab.reports.comparison import load_comparison
from servelab.reports.prefix_report import TIME_WINDOWS, hit_rate_windows, prefix_section
from servelab.reports.document import Bullets, Table

COMMON = ["--trace", "default", "--num-requests", "160", "--model", "llama-2-7b", "--kv-blocks", "400",
          "--rates", "6", "--workers", "2"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("compare") / "prefix"
    assert main(["compare", *COMMON, "--prefix-caching", "--policies", "fcfs,lpm", "--replicas", "2",
                 "--routers", "round-robin,prefix-affinity", "--out", str(out)]) == 0
    return out


def test_the_section_lists_every_points_hit_rate_and_its_course(sweep):
    c = load_comparison(sweep)
    tables = [b for b in prefix_section(c) if isinstance(b, Table)]
    per_point, over_time = tables
    assert per_point.headers == ["Policy", "Rate (req/s)", "Router", "Hit rate (%)"]
    rates = {(p.policy, p.labels["router"]): p.summary["prefix_cache_hit_rate"] for p in c.points}
    assert len(rates) == 4 and all(r > 0 for r in rates.values())
    for policy, _, router, cell in per_point.rows:
        assert float(cell) == pytest.approx(100 * rates[policy, router], abs=0.05)
    assert over_time.headers[-TIME_WINDOWS:] == [f"{i}/{TIME_WINDOWS}" for i in range(1, TIME_WINDOWS + 1)]
    assert len(over_time.rows) == 4
    assert "## Prefix caching" in (sweep / "report.md").read_text()


def test_windows_add_up_to_the_runs_hit_rate(sweep):
    for p in load_comparison(sweep).points:
        done = [r for r in p.requests if r.status == "finished"]
        arrival = np.array([r.arrival_s for r in done])
        edges = np.linspace(arrival.min(), arrival.max(), TIME_WINDOWS + 1)
        prompt = np.histogram(arrival, bins=edges, weights=[r.prompt_tokens for r in done])[0]
        rates = hit_rate_windows(p)
        total = sum(rate * tokens for rate, tokens in zip(rates, prompt) if rate is not None)
        assert total / prompt.sum() == pytest.approx(p.summary["prefix_cache_hit_rate"], rel=1e-9)


def test_findings_compare_lpm_and_prefix_affinity_with_the_others(sweep):
    c = load_comparison(sweep)
    bullets = next(b for b in prefix_section(c) if isinstance(b, Bullets)).items
    rate = {(p.policy, p.labels["router"]): 100 * p.summary["prefix_cache_hit_rate"] for p in c.points}
    lpm = [b for b in bullets if b.startswith("lpm at")]
    routing = [b for b in bullets if b.startswith("prefix-affinity routing")]
    assert len(lpm) == 2 and len(routing) == 2
    assert f"hit rate {rate['lpm', 'round-robin']:.1f}%" in lpm[0] and "(round-robin)" in lpm[0]
    assert f"the best other policy's (fcfs) {rate['fcfs', 'round-robin']:.1f}%" in lpm[0]
    fcfs = next(b for b in routing if "(fcfs)" in b)
    assert f"hit rate {rate['fcfs', 'prefix-affinity']:.1f}%" in fcfs
    assert f"round-robin's {rate['fcfs', 'round-robin']:.1f}%" in fcfs


def test_no_section_without_a_prefix_cache(tmp_path):
    out = tmp_path / "plain"
    assert main(["compare", "--trace", "default", "--num-requests", "30", "--kv-blocks", "400",
                 "--no-prefix-caching",
                 "--policies", "fcfs", "--workers", "1", "--out", str(out)]) == 0
    assert prefix_section(load_comparison(out)) == []
    assert "Prefix caching" not in (out / "report.md").read_text()


def test_the_summary_table_gives_the_hit_rate_in_percent_as_the_section_does(sweep):
    from servelab.reports.report import summary_table

    c = load_comparison(sweep)
    table = next(b for b in summary_table(c) if isinstance(b, Table))
    column = table.headers.index("Prefix hit rate (%)")
    assert table.headers[-1] == "SLO met (%)"
    for row, p in zip(table.rows, c.points):
        assert float(row[column]) == pytest.approx(100 * p.summary["prefix_cache_hit_rate"], abs=0.05)
