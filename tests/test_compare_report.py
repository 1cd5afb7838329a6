"""The comparison report: every figure type from a small sweep (series counted on the figure
objects), valid PNGs, a self-contained index.html, report.md's table equal to the runs'
summaries, and the analysis behind the prose (breaking points, where breaks are marked,
winners by a margin, the rate shown over time, fairness, memory)."""
from __future__ import annotations

import base64
import json
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_hex

from servelab.cli import main
from servelab.records import RequestRecord, StepRecord
from servelab.reports import plots
from servelab.reports.comparison import leaders, load_comparison, tenant_service, windowed_jain
from servelab.reports.document import Image, Table, Text
from servelab.reports.findings import analyse
from servelab.reports.report import build_document
from servelab.reports.runio import read_steps
from servelab.reports.slo import find_break, slo_attainment, slo_tiers, tier_p99

POLICIES = ("fcfs", "priority", "sjf", "fair")
RATES = (3.0, 40.0)
MANAGERS = ("paged", "contiguous-max")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
COLOURS = {"fcfs": "#1f77b4", "priority": "#ff7f0e", "sjf": "#2ca02c", "fair": "#d62728"}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("compare") / "sweep"
    status = main(["compare", "--trace", "default", "--num-requests", "40", "--model", "llama-2-7b",
                   "--kv-blocks", "1000", "--rates", ",".join(f"{r:g}" for r in RATES),
                   "--block-managers", ",".join(MANAGERS), "--slo-ttft-ms", "2000",
                   "--engine", "servelab", "--workers", "2", "--out", str(out)])
    assert status == 0
    return out


@pytest.fixture(scope="module")
def document(sweep):
    comparison = load_comparison(sweep)
    return comparison, build_document(comparison)


def _images(document) -> dict[str, Image]:
    return {b.name: b for b in document[1] if isinstance(b, Image)}


def _summaries(comparison, manager: str) -> dict[tuple[str, float], dict]:
    return {(p.policy, p.rate): p.summary for p in comparison.points if p.labels["block_manager"] == manager}


def _gids(ax, prefix: str) -> list[str]:
    return sorted(line.get_gid() for line in ax.get_lines() if (line.get_gid() or "").startswith(prefix))


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _group(comparison, manager: str):
    return analyse([p for p in comparison.points if p.labels["block_manager"] == manager])


def _preempted(comparison, manager: str) -> bool:
    return any(p.summary["num_preemptions"] for p in comparison.points if p.labels["block_manager"] == manager)


def test_files_are_written_and_figures_are_real_pngs(sweep, document):
    comparison, blocks = document
    names = set(_images(document))
    kinds = ("latency_cdf", "vs_rate", "timeline", "fairness")
    expected = {f"{kind}_block_manager-{m}" for kind in kinds for m in MANAGERS} | {"memory"}
    expected |= {f"preemptions_block_manager-{m}" for m in MANAGERS if _preempted(comparison, m)}
    assert names == expected
    assert {p.stem for p in (sweep / "figures").glob("*.png")} == names
    for path in (sweep / "figures").glob("*.png"):
        data = path.read_bytes()
        width, height = _png_size(data)
        assert width >= 800 and height >= 400, path.name
        assert len(data) > 15_000, f"{path.name}: {len(data)} bytes is too little to hold a plot"


def test_a_figure_with_nothing_to_show_is_left_out_with_one_line(document):
    """This sweep preempts with paging and never with contiguous-max: one group draws the
    preemptions figure, the other says in one line why it has none."""
    comparison, blocks = document
    assert [_preempted(comparison, m) for m in MANAGERS] == [True, False]
    notes = [b.text for b in blocks if isinstance(b, Text) and b.text.startswith("Preemptions: none")]
    assert notes == ["Preemptions: none at any rate, so no figure."]


def test_every_figure_has_one_series_per_policy_in_its_fixed_colour(document):
    comparison, _ = document
    images = _images(document)
    policy_lines = [f"policy:{p}" for p in sorted(POLICIES)]
    for manager in MANAGERS:
        summaries = _summaries(comparison, manager)
        group = _group(comparison, manager)
        cdf = images[f"latency_cdf_block_manager-{manager}"].figure
        assert len(cdf.axes) == len(RATES) * 3
        for ax in cdf.axes:
            assert _gids(ax, "policy:") == policy_lines

        vs_rate = images[f"vs_rate_block_manager-{manager}"].figure
        ttft, tpot, attainment, goodput = vs_rate.axes[:4]
        tenants = ("batch", "interactive")   # the default workload's tenants carry their own SLOs
        for ax, metric in ((ttft, "ttft"), (tpot, "tpot")):
            assert _gids(ax, "tier:") == sorted(f"tier:{p}:{metric}:{t}" for p in POLICIES for t in tenants)
            assert _gids(ax, "slo:") == [f"slo:{metric}:{t}" for t in tenants]   # every SLO drawn
        assert _gids(attainment, "policy:") == policy_lines
        assert _gids(goodput, "throughput:") == [f"throughput:{p}" for p in sorted(POLICIES)]
        line = next(l for l in goodput.get_lines() if l.get_gid() == "goodput:sjf")
        assert list(line.get_ydata()) == [summaries["sjf", r]["request_goodput"] for r in RATES]
        line = next(l for l in attainment.get_lines() if l.get_gid() == "policy:sjf")
        assert list(line.get_ydata()) == pytest.approx([100 * slo_attainment(summaries["sjf", r]) for r in RATES])

        timeline = images[f"timeline_block_manager-{manager}"].figure
        assert len(timeline.axes) == 2
        assert f"at {group.divergent_rate:g} req/s" in timeline.texts[0].get_text()
        for ax in timeline.axes:
            assert _gids(ax, "policy:") == policy_lines

        if _preempted(comparison, manager):
            bars = images[f"preemptions_block_manager-{manager}"].figure.axes[0].containers
            assert [c.get_label() for c in bars] == list(POLICIES)
            for container, policy in zip(bars, POLICIES):
                assert [r.get_height() for r in container] == [summaries[policy, r]["num_preemptions"]
                                                               for r in RATES]

        fairness = images[f"fairness_block_manager-{manager}"].figure
        *top, jain = fairness.axes
        assert [ax.get_title() for ax in top] == list(POLICIES)
        for ax, policy in zip(top, POLICIES):
            assert _gids(ax, "tenant:") == [f"tenant:{policy}:batch", f"tenant:{policy}:interactive"]
        assert _gids(jain, "policy:") == policy_lines
        assert _gids(jain, "windowed:") == [f"windowed:{p}" for p in sorted(POLICIES)]
        line = next(l for l in jain.get_lines() if l.get_gid() == "policy:fair")
        assert list(line.get_ydata()) == [summaries["fair", r]["jain_fairness_index"] for r in RATES]

    memory = images["memory"].figure
    assert len(memory.axes) == 3
    for ax in memory.axes:
        assert [c.get_label() for c in ax.containers] == list(POLICIES)
        assert all(len(c) == len(MANAGERS) for c in ax.containers)
    top_rate = max(RATES)   # memory is shown where it is under the most pressure
    for container, policy in zip(memory.axes[2].containers, POLICIES):
        expected = [max(s.num_running for s in _steps(comparison, policy, top_rate, m)) for m in MANAGERS]
        assert [r.get_height() for r in container] == expected

    for image in images.values():   # one colour per policy, the same in every figure
        for ax in image.figure.axes:
            for artist in [*ax.get_lines(), *(r for c in ax.containers for r in c)]:
                gid = artist.get_gid() or ""
                policy = gid.split(":")[1] if gid.count(":") >= 1 else None
                if policy in POLICIES:
                    colour = artist.get_color() if hasattr(artist, "get_color") else artist.get_facecolor()
                    assert to_hex(colour) == COLOURS[policy], (image.name, gid)


def test_a_break_is_marked_only_where_a_value_crossed_its_line(document):
    """Every X sits above the SLO line of its own tier (or below the attainment target),
    at the policy's breaking rate; every policy that breaks is marked somewhere."""
    comparison, _ = document
    images = _images(document)
    for manager in MANAGERS:
        group = _group(comparison, manager)
        ttft, tpot, attainment, goodput = images[f"vs_rate_block_manager-{manager}"].figure.axes[:4]
        slos = {t.tenant: t.slo_ms for t in group.tiers if t.metric == "ttft"}
        marked = set()
        for ax, metric in ((ttft, "ttft"), (tpot, "tpot")):
            slo = {t.tenant: t.slo_ms for t in group.tiers if t.metric == metric}
            for line in ax.get_lines():
                gid = line.get_gid() or ""
                if gid.startswith("breakmark:"):
                    _, policy, _, tenant = gid.split(":")
                    assert line.get_xdata()[0] == group.breaks[policy].rate
                    assert line.get_ydata()[0] > slo[tenant], (manager, gid)
                    marked.add(policy)
        assert slos   # the default workload's tenants carry TTFT SLOs
        for line in attainment.get_lines():
            gid = line.get_gid() or ""
            if gid.startswith("breakmark:"):
                assert line.get_ydata()[0] < 90.0
                marked.add(gid.split(":")[1])
        assert _gids(goodput, "breakmark:") == []   # goodput has no SLO line to cross
        assert marked == {p for p, b in group.breaks.items() if b is not None}


def _steps(comparison, policy, rate, manager) -> list[StepRecord]:
    point = next(p for p in comparison.points
                 if (p.policy, p.rate, p.labels["block_manager"]) == (policy, rate, manager))
    return read_steps(comparison.out_dir / "runs" / point.name / "steps.csv")


def test_report_md_table_equals_the_run_summaries(sweep):
    text = (sweep / "report.md").read_text()
    lines = [l for l in text.splitlines() if l.startswith("| Policy | Rate (req/s) | Block manager |")]
    assert len(lines) == 1
    rows = text.split(lines[0])[1].strip().splitlines()[1:1 + len(POLICIES) * len(RATES) * len(MANAGERS)]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    keys = {"Throughput (req/s)": "request_throughput", "Output (tok/s)": "output_throughput",
            "Mean TTFT (ms)": "mean_ttft_ms", "P99 TTFT (ms)": "p99_ttft_ms", "Mean TPOT (ms)": "mean_tpot_ms",
            "P99 TPOT (ms)": "p99_tpot_ms", "P99 E2E (ms)": "p99_e2el_ms", "Goodput (req/s)": "request_goodput",
            "Preemptions": "num_preemptions", "Rejected": "rejected", "Jain index": "jain_fairness_index"}
    summaries = {}
    for run in (sweep / "runs").iterdir():
        config = json.loads((run / "config.json").read_text())["config"]
        summaries[config["policy"], config["rate"], config["block_manager"]] = \
            json.loads((run / "summary.json").read_text())
    seen = set()
    for row in rows:
        cells = dict(zip(header, (c.strip() for c in row.strip("|").split("|"))))
        point = (cells["Policy"], float(cells["Rate (req/s)"]), cells["Block manager"])
        summary = summaries[point]
        seen.add(point)
        for name, key in keys.items():
            cell = cells[name]
            decimals = len(cell.split(".")[1]) if "." in cell else 0
            assert abs(float(cell) - summary[key]) <= 0.5 * 10 ** -decimals + 1e-9, (point, name)
        assert float(cells["SLO met (%)"]) == pytest.approx(100 * slo_attainment(summary), abs=0.05)
    assert seen == set(summaries) and len(seen) == 16


def test_index_html_is_self_contained(sweep):
    page = (sweep / "index.html").read_text()
    assert "<style>" in page and "<script" not in page and "<link" not in page
    assert not re.search(r"""(src|href)=["']?(https?:|//|figures/)""", page)
    uris = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(uris) == len(list((sweep / "figures").glob("*.png")))
    pngs = {p.read_bytes() for p in (sweep / "figures").glob("*.png")}
    assert {base64.b64decode(u) for u in uris} == pngs
    assert "breaks at" in page and "Best policy per metric" in page


def test_prose_names_where_each_policy_breaks_and_who_missed(document):
    comparison, blocks = document
    text = "\n".join(item for b in blocks for item in getattr(b, "items", [getattr(b, "text", "")]))
    for manager in MANAGERS:
        summaries = _summaries(comparison, manager)
        for policy in POLICIES:
            # every request carries its own TTFT SLO, so the global --slo-ttft-ms 2000 applies
            # to nobody and cannot break through the overall p99
            b = find_break([(r, summaries[policy, r]) for r in RATES], slo_ttft_ms=None, slo_tpot_ms=None)
            expected = (f"{policy} breaks at {b.rate:g} req/s: {b.reason} (misses: " if b
                        else f"{policy} holds at every rate run")
            assert expected in text
    winners = [b for b in blocks if isinstance(b, Table) and b.headers[0] == "Metric"]
    assert len(winners) == len(MANAGERS) and all(len(t.rows[0]) == 1 + len(RATES) for t in winners)


def test_winners_are_only_policies_that_hold_and_lead_by_the_margin(document):
    comparison, blocks = document
    tables = [b for b in blocks if isinstance(b, Table) and b.headers[0] == "Metric"]
    for manager, table in zip(MANAGERS, tables):
        group = _group(comparison, manager)
        for column, rate in enumerate(group.rates, start=1):
            holding = {p.policy for p in group.points if p.rate == rate and group.holds(p)}
            for row in table.rows:
                cell = row[column]
                named = set(re.findall(r"[a-z]+", cell.split(" (")[0])) & set(POLICIES)
                assert named <= holding, (manager, rate, row[0], cell)
                if not holding:
                    assert cell == "all break"


def test_leaders_need_a_margin():
    assert leaders({"a": 100.0, "b": 99.5, "c": 120.0}, min, 0.05) == (["a", "b"], True)
    assert leaders({"a": 100.0, "b": 103.0}, min, 0.05) == (["a", "b"], False)    # within 5%: no winner
    assert leaders({"a": 100.0, "b": 110.0}, max, 0.05) == (["b"], True)
    assert leaders({"a": None, "b": 3.0}, max, 0.05) == (["b"], False)           # alone: nothing to beat
    assert leaders({"a": 0, "b": 0}, min, 0.05) == (["a", "b"], False)


def test_the_time_series_show_the_rate_where_attainment_differs_most(document):
    comparison, _ = document
    for manager in MANAGERS:
        group = _group(comparison, manager)
        spread = {r: np.ptp([group.attainment[p.name] for p in group.points if p.rate == r]) for r in RATES}
        assert spread[group.divergent_rate] == max(spread.values())


def test_slo_tiers_are_the_tenants_own_and_the_global_one_for_the_rest():
    own = [RequestRecord(0, 0.0, 5, 5, "finished", 0.0, 0.1, 0.5, tenant="chat", slo_ttft_ms=500.0),
           RequestRecord(1, 0.0, 5, 5, "finished", 0.0, 2.0, 2.5, tenant="batch")]
    tiers = slo_tiers({"slo_ttft_ms": 3000.0, "slo_tpot_ms": None}, own)
    assert [(t.metric, t.tenant, t.slo_ms) for t in tiers] == [("ttft", "batch", 3000.0), ("ttft", "chat", 500.0)]
    assert tier_p99(own, tiers[0]) == pytest.approx(2000.0)
    everyone = slo_tiers({"slo_ttft_ms": None, "slo_tpot_ms": 50.0}, own[1:])
    assert [(t.metric, t.tenant) for t in everyone] == [("tpot", None)]
    assert slo_tiers({"slo_ttft_ms": None, "slo_tpot_ms": None}, own[1:]) == []


def test_a_global_slo_that_no_request_takes_is_said_to_be_unused():
    """--slo-ttft-ms 500 over a trace whose every request has its own TTFT SLO changed
    nothing, and the report's SLO paragraph did not say so."""
    from servelab.reports.slo import unused_global_slos

    own = [RequestRecord(0, 0.0, 5, 5, "finished", 0.0, 0.1, 0.5, tenant="chat", slo_ttft_ms=1000.0,
                         slo_tpot_ms=100.0),
           RequestRecord(1, 0.0, 5, 5, "finished", 0.0, 2.0, 2.5, tenant="batch", slo_ttft_ms=1e4)]
    given = {"slo_ttft_ms": 500.0, "slo_tpot_ms": 50.0}
    assert unused_global_slos(given, own) == ["--slo-ttft-ms 500"]   # batch takes the TPOT one
    assert unused_global_slos({"slo_ttft_ms": None, "slo_tpot_ms": None}, own) == []


def test_a_point_without_its_marker_is_listed_as_missing(sweep, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(sweep, copy)
    victim = next((copy / "runs").iterdir())
    (victim / "done.json").unlink()
    comparison = load_comparison(copy)
    assert len(comparison.points) == 15 and len(comparison.missing) == 1


# --------------------------------------------------------------------------- the analysis
def _summary(goodput: float, completed: int, rejected: int = 0, duration: float = 10.0,
             p99_ttft: float = 100.0, p99_tpot: float = 10.0) -> dict:
    return {"request_goodput": goodput, "completed": completed, "rejected": rejected, "duration": duration,
            "p99_ttft_ms": p99_ttft, "p99_tpot_ms": p99_tpot}


def test_breaking_point_is_the_first_rate_missing_attainment_or_a_p99_slo():
    ok, low = _summary(1.0, 10), _summary(0.8, 10)
    assert slo_attainment(low) == 0.8 and slo_attainment(_summary(0.8, 8, rejected=2)) == 0.8
    assert find_break([(2.0, ok), (1.0, ok)], slo_ttft_ms=None, slo_tpot_ms=None) is None
    b = find_break([(3.0, low), (1.0, ok), (2.0, low)], slo_ttft_ms=None, slo_tpot_ms=None)
    assert (b.rate, b.reason) == (2.0, "80% of requests met their SLOs")
    slow = _summary(1.0, 10, p99_tpot=60.0)
    b = find_break([(1.0, ok), (2.0, slow)], slo_ttft_ms=None, slo_tpot_ms=50.0)
    assert (b.rate, b.reason) == (2.0, "p99 TPOT 60 ms > SLO 50 ms")
    assert find_break([(1.0, slow)], slo_ttft_ms=None, slo_tpot_ms=None) is None   # no global SLO
    nothing = {**_summary(0.0, 0, rejected=10, duration=0.0), "p99_ttft_ms": None, "p99_tpot_ms": None}
    b = find_break([(1.0, nothing)], slo_ttft_ms=100.0, slo_tpot_ms=50.0)
    assert b.reason == "0% of requests met their SLOs; no request finished"   # null p99s are no crash


def _request(rid, tenant, arrival, first, finish, prompt=10, output=11):
    return RequestRecord(rid, arrival, prompt, output, "finished", arrival, first, finish, tenant=tenant)


def test_tenant_service_conserves_tokens_and_windowed_jain_sees_when():
    even = [_request(0, "a", 0.0, 0.0, 10.0), _request(1, "b", 0.0, 0.0, 10.0)]
    edges, service = tenant_service(even, windows=10)
    width = edges[1] - edges[0]
    for tenant in ("a", "b"):   # 1 x 10 prompt + 2 x 11 output tokens, all of it somewhere
        assert service[tenant].sum() * width == pytest.approx(10 + 2 * 11)
    assert windowed_jain(even, windows=10) == pytest.approx(1.0)
    # b waits from the start but is served only after a: unfair in every window
    serial = [_request(0, "a", 0.0, 0.0, 5.0), _request(1, "b", 0.0, 5.0, 10.0)]
    assert windowed_jain(serial, windows=10) == pytest.approx(0.5, abs=0.05)
    # a weight of 2 for a makes a 2:1 split perfectly fair
    heavy = [_request(0, "a", 0.0, 0.0, 10.0, output=21), _request(1, "b", 0.0, 0.0, 10.0, prompt=4, output=11)]
    assert windowed_jain(heavy, {"a": 2.0}, windows=1) == pytest.approx(1.0)


def test_time_means_hold_each_steps_value_over_its_duration():
    start = np.array([0.0, 1.0, 3.0])
    duration = np.array([1.0, 2.0, 1.0])
    values = np.array([10.0, 20.0, 40.0])
    means = plots._time_mean(start, duration, values, np.array([0.0, 2.0, 4.0, 6.0]))
    assert means[:2] == pytest.approx([15.0, 30.0]) and np.isnan(means[2])


def test_policy_colours_are_fixed_and_extras_deterministic():
    assert plots.policy_colours(["sjf", "fair", "priority", "fcfs"]) == COLOURS
    a = plots.policy_colours(["zeta", "fair", "alpha"])
    assert a == plots.policy_colours(["alpha", "zeta", "fair"]) and a["fair"] == "#d62728"
    assert len(set(a.values())) == 3


def test_a_tenant_keeps_its_line_style_across_figures():
    """The tightest-SLO tenant is solid in every figure (the rate sweep and the capacity
    curves already ordered tenants so; the fairness figure sorted them by name)."""
    assert plots.tenant_styles(["zeta"], {"alpha", "zeta"}) == {"zeta": "-", "alpha": "--"}
    assert plots.tenant_styles([], {"b", "a"}) == {"a": "-", "b": "--"}
    curve = (np.array([1.0, 2.0]), np.array([5.0, 6.0]))
    fig = plots.fairness({"fcfs": {"alpha": curve, "zeta": curve}}, {"fcfs": [(1.0, 0.9, 0.8)]},
                         {"fcfs": "#1f77b4"}, "t", tenants_first=["zeta"])
    lines = {line.get_gid(): line.get_linestyle() for ax in fig.axes for line in ax.get_lines()
             if (line.get_gid() or "").startswith("tenant:")}
    assert lines == {"tenant:fcfs:zeta": "-", "tenant:fcfs:alpha": "--"}


def test_a_narrow_latency_range_is_drawn_linear_from_zero():
    """One rate, two policies 0.02 ms apart: no log axis reading 51.99 and 52.01 ms."""
    from servelab.reports.plots_load import RatePoint, rate_sweep

    def point(p99):
        summary = {"p99_ttft_ms": p99, "p99_tpot_ms": 10.0, "request_goodput": 1.0,
                   "request_throughput": 1.0}
        return RatePoint(5.0, summary, 1.0, {})

    fig = rate_sweep({"fcfs": [point(52.0)], "sjf": [point(52.01)]}, [], COLOURS, "t",
                     breaks={}, target=0.9)
    ttft = fig.axes[0]
    assert ttft.get_yscale() == "linear" and ttft.get_ylim()[0] == 0


def test_the_report_names_the_engine_and_the_kernels_that_priced_it(sweep, tmp_path):
    assert "Every point: engine servelab (kernels: h100-sxm, measured inside vLLM 0.14.0); model" in (sweep / "report.md").read_text()
    out = tmp_path / "vllm"
    assert main(["compare", "--trace", "default", "--num-requests", "10", "--policies", "fcfs",
                 "--workers", "1", "--out", str(out)]) == 0
    assert ("engine vllm-0.24 (kernels: h100-sxm.vllm-0.24, measured inside vLLM 0.24.0)"
            in (out / "report.md").read_text())


def test_the_policy_that_holds_longest_is_qualified_where_it_held_overloaded(document):
    """"Most load within SLO: priority (never breaks ...)" at rates where its queue never
    emptied read as capacity; the verdict now says where it held only while overloaded."""
    from dataclasses import replace

    from servelab.reports.findings import _verdict

    comparison, _ = document
    group = _group(comparison, MANAGERS[0])
    assert all(b is not None for b in group.breaks.values())   # every policy breaks here
    best = sorted(group.breaks)[0]   # made the one policy that holds at every rate run
    calm = replace(group, overloaded=dict.fromkeys(group.overloaded),
                   breaks={**group.breaks, best: None})
    verdict = _verdict(calm)
    assert verdict.startswith(f"Most load within SLO: {best} (never breaks at the rates run")
    assert "while overloaded" not in verdict
    top = group.series[best][-1]
    marked = replace(calm, overloaded={**calm.overloaded, top.name: object()})
    assert _verdict(marked).endswith(f"It holds while overloaded at {top.rate:g} req/s, where "
                                     "latencies grow with the run's length: a longer run may "
                                     "break it sooner.")
