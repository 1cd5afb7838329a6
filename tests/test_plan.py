"""Deployment planning: the replica search on synthetic layouts (a fake runner), SLO
targets as percentiles, `compare --replicas` lists, and `servelab plan` end to end on a
small workload, whose answer fresh `servelab simulate` runs must confirm (the chosen layout
meets the target, one replica fewer misses it)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from servelab.cli import main
from servelab.reports.slo import PercentileTarget, SloTargets
from servelab.simulator.run import SimulationConfig
from servelab.sweeps.plan import Layout, search_plan
from servelab.sweeps.sweep import PointOutcome

BASE = SimulationConfig(trace="default", num_requests=50)
P99_TTFT_1S = SloTargets(None, (PercentileTarget("ttft", 99, 1000.0),))


class FakeRunner:
    """Stands in for a SweepRunner: a run's p99 TTFT is `latency(gpu, replicas)` ms."""

    def __init__(self, latency, workers: int = 1) -> None:
        self.latency, self.workers, self.batches = latency, workers, []

    def run(self, points, progress=None):
        self.batches.append([(p.config.gpu, p.config.replicas) for p in points])
        out = []
        for p in points:
            ms = self.latency(p.config.gpu, p.config.replicas)
            summary = {"completed": 100, "rejected": 0, "duration": 1.0, "request_goodput": 100.0,
                       "p99_ttft_ms": ms}
            out.append(PointOutcome(p, Path("unused") / p.name, "ran", summary))
        return out


def _layout(gpu: str, price: float, most: int = 64) -> Layout:
    return Layout((("gpu", gpu), ("tp", 1)), 1, price, lambda n, g=gpu: replace(BASE, gpu=g, replicas=n), most)


def _needs(counts: dict[str, int]):
    """p99 TTFT 900 ms from counts[gpu] replicas up, 1500 ms below."""
    return lambda gpu, n: 900.0 if n >= counts[gpu] else 1500.0


def test_the_cheapest_layout_wins_and_each_answer_is_bracketed_by_runs():
    needs = {"a100-80gb": 11, "h100-sxm": 5, "h200": 3}
    prices = {"a100-80gb": 2.45, "h100-sxm": 4.76, "h200": 6.35}
    plan = search_plan([_layout(g, p) for g, p in prices.items()], FakeRunner(_needs(needs)), targets=P99_TTFT_1S)
    best = plan.best
    assert dict(best.labels)["gpu"] == "h200" and best.replicas == 3   # $19.05 beats $23.80 and $26.95
    assert best.cost == pytest.approx(3 * 6.35)
    assert best.below.replicas == 2 and not best.below.held
    for r in plan.results:
        gpu = dict(r.labels)["gpu"]
        if r.status == "found":
            assert r.replicas == needs[gpu] and r.below is not None and not r.below.held
        else:   # stopped once it could not beat the best
            assert r.status == "pruned" and r.lower_bound > best.cost
    assert [r.status for r in plan.results] == ["pruned", "pruned", "found"]


def test_a_layout_that_ties_the_best_is_still_resolved():
    plan = search_plan([_layout("h100-sxm", 2.0), _layout("h200", 4.0)],
                       FakeRunner(_needs({"h100-sxm": 6, "h200": 3})), targets=P99_TTFT_1S)
    assert [r.status for r in plan.results] == ["found", "found"]
    assert [r.cost for r in plan.ranked] == [12.0, 12.0]


def test_a_layout_that_never_meets_the_target_is_unmet_at_its_most_replicas():
    plan = search_plan([_layout("h100-sxm", 1.0, most=6)], FakeRunner(_needs({"h100-sxm": 100})),
                       targets=P99_TTFT_1S)
    (r,) = plan.results
    assert r.status == "unmet" and plan.best is None
    assert [t.replicas for t in r.trials] == [1, 2, 4, 6]


def test_a_count_that_misses_above_one_that_met_is_reported():
    # meets at 2, misses at 3-5 (seeded bursts), meets from 6 up: one round of four
    # doublings tries 1, 2, 4 and 8
    latency = lambda gpu, n: 900.0 if n == 2 or n >= 6 else 1500.0
    plan = search_plan([_layout("h100-sxm", 1.0)], FakeRunner(latency, workers=4), targets=P99_TTFT_1S)
    (r,) = plan.results
    assert r.status == "found" and r.replicas == 2
    assert [(t.replicas, t.held) for t in r.trials] == [(1, False), (2, True), (4, False), (8, True)]
    assert r.notes and "not monotone: 4 replicas missed although 2 met" in r.notes[0]


def test_percentile_targets_count_rejected_requests_as_slowest():
    target = PercentileTarget("ttft", 99, 1000.0)
    ok = {"completed": 99, "rejected": 1, "p99_ttft_ms": 800.0, "duration": 1.0, "request_goodput": 99.0}
    assert target.value(ok) == 800.0
    assert target.value({**ok, "completed": 98, "rejected": 2}) == float("inf")
    targets = SloTargets(0.9, (target,))
    assert targets.held(ok) and targets.tightness(ok) == pytest.approx(0.8)
    slow = {**ok, "p99_ttft_ms": 1300.0}
    assert targets.misses(slow) == ["p99 TTFT 1,300 ms > 1000 ms"]
    assert targets.tightness(slow) == pytest.approx(1.3)
    with pytest.raises(ValueError, match="percentiles a run records"):
        PercentileTarget("ttft", 95, 1000.0)
    with pytest.raises(ValueError, match="attainment target or a percentile"):
        SloTargets(None)


def test_a_miss_never_reads_as_the_limit_itself():
    targets = SloTargets(None, (PercentileTarget("tpot", 99, 150.0),))
    assert targets.misses({"p99_tpot_ms": 150.04, "completed": 1, "rejected": 0}) == \
        ["p99 TPOT 150.04 ms > 150 ms"]
    assert targets.misses({"p99_tpot_ms": 157.2, "completed": 1, "rejected": 0}) == \
        ["p99 TPOT 157 ms > 150 ms"]


# --------------------------------------------------------------------------- the commands
SMALL = ["--trace", "default", "--num-requests", "300", "--rate", "60"]


def _p99_ttft(tmp_path: Path, name: str, *flags: str) -> float:
    out = tmp_path / name
    assert main(["simulate", *SMALL, *flags, "--out", str(out)]) == 0
    return json.loads((out / "summary.json").read_text())["p99_ttft_ms"]


@pytest.fixture(scope="module")
def small_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "p"
    code = main(["plan", *SMALL, "--p99-ttft-ms", "300", "--gpus", "h100-sxm,h200", "--tps", "1,2",
                 "--max-gpus", "8", "--workers", "2", "--out", str(out)])
    return code, out


def test_plan_answers_and_fresh_simulations_confirm_it(small_plan, tmp_path, capsys):
    code, out = small_plan
    assert code == 0
    data = json.loads((out / "plan.json").read_text())
    best = data["layouts"][data["best"]]
    labels, replicas = best["labels"], best["replicas"]
    assert replicas > 1   # a case where one replica fewer exists
    flags = ["--gpu", labels["gpu"], "--tp", str(labels["tp"]), "--policy", labels["policy"]]
    assert _p99_ttft(tmp_path, "met", *flags, "--replicas", str(replicas)) <= 300
    assert _p99_ttft(tmp_path, "fewer", *flags, "--replicas", str(replicas - 1)) > 300
    for g in data["layouts"]:   # nothing found cheaper than the answer
        assert g["cost"] is None or g["cost"] >= best["cost"] - 1e-9
        assert g["status"] in ("found", "pruned")
    report = (out / "report.md").read_text()
    first = report.splitlines()[2]
    assert first.startswith(f"{replicas} x {labels['gpu']} (TP{labels['tp']}), fcfs, round-robin: p99 TTFT")
    assert "$" in first and (out / "figures" / "plan_frontier.png").stat().st_size > 10_000
    assert "The finalists compared" in report


def test_a_rerun_runs_nothing_new(small_plan, capsys):
    _, out = small_plan
    runs = sorted(p.name for p in (out / "runs").iterdir())
    assert main(["plan", *SMALL, "--p99-ttft-ms", "300", "--gpus", "h100-sxm,h200", "--tps", "1,2",
                 "--max-gpus", "8", "--workers", "2", "--out", str(out)]) == 0
    assert sorted(p.name for p in (out / "runs").iterdir()) == runs


def test_plan_puts_disaggregated_pool_shapes_beside_co_located_layouts(tmp_path, capsys):
    """--prefill-replicas/--decode-replicas lists make one layout per P:D shape, whose count
    is of pool units (n units: n x P prefill and n x D decode replicas, each costing its
    GPUs), searched beside the co-located layout of the same GPU and TP."""
    out = tmp_path / "p"
    assert main(["plan", "--trace", "default", "--num-requests", "200", "--rate", "40", "--gpu", "h100-sxm",
                 "--tp", "1", "--prefill-replicas", "1", "--decode-replicas", "1,2", "--decode-tp", "2",
                 "--p99-ttft-ms", "500", "--p99-tpot-ms", "40", "--objective", "gpus", "--workers", "1",
                 "--out", str(out)]) == 0
    data = json.loads((out / "plan.json").read_text())
    layouts = {g["labels"]["pools"]: g for g in data["layouts"]}
    assert set(layouts) == {"co-located", "1P+1D(TP2)", "1P+2D(TP2)"}
    assert [layouts[k]["gpus_per_replica"] for k in ("co-located", "1P+1D(TP2)", "1P+2D(TP2)")] == [1, 3, 5]
    for shape, (p, d) in (("1P+1D(TP2)", (1, 1)), ("1P+2D(TP2)", (1, 2))):
        for t in layouts[shape]["trials"]:   # each run holds its count of units, pool by pool
            config = json.loads((out / "runs" / t["run"] / "config.json").read_text())["config"]
            pools = config["disaggregation"]
            assert (pools["prefill"]["replicas"], pools["decode"]["replicas"]) == (t["replicas"] * p, t["replicas"] * d)
            assert pools["decode"]["tp"] == 2 and pools["prefill"].get("tp") is None
    for t in layouts["co-located"]["trials"]:
        config = json.loads((out / "runs" / t["run"] / "config.json").read_text())["config"]
        assert "disaggregation" not in config and config["replicas"] == t["replicas"]
    report = (out / "report.md").read_text()
    assert "[1P+1D(TP2)] h100-sxm (TP1)" in report


@pytest.mark.parametrize("flags, message", [
    (["--p99-ttft-ms", "1", "--gpus", "h100-sxm", "--tps", "1", "--max-gpus", "2"],
     "error: no layout meets p99 TTFT <= 1 ms within 2 GPUs; the closest was 2 x h100-sxm (TP1), fcfs, "
     "round-robin: p99 TTFT"),
    (["--p99-ttft-ms", "300", "--gpus", "h100-sxm", "--rates", "10,20"], "one traffic"),
    (["--p99-ttft-ms", "300", "--gpus", "h100-sxm", "--replicas", "3"], "searches the replica count"),
    (["--p99-ttft-ms", "300", "--gpus", "h100-sxm", "--gpu-price", "b200=3"], "--gpu-price names b200"),
    (["--p99-ttft-ms", "300", "--gpus", "h100-sxm", "--gpu-price", "h100-sxm"], "expected GPU=USD"),
    (["--p99-ttft-ms", "300", "--gpus", "h100-sxm", "--rate", "0"], "--rate"),
    (["--gpus", "h100-sxm"], "a plan needs an SLO"),
])
def test_bad_plans_are_one_line_errors(tmp_path, capsys, flags, message):
    argv = ["plan", "--trace", str(_plain_trace(tmp_path)), "--num-requests", "40", *flags,
            "--out", str(tmp_path / "p")]
    try:
        code = main(argv)
    except SystemExit as exc:   # argparse refuses a malformed value itself
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    last = err.splitlines()[-1]   # progress lines come first when the runs were made
    assert message in last and (err.count("\n") == 1 or "round 1" in err), err
    assert not (tmp_path / "p" / "report.md").exists()


def test_a_gpu_without_a_price_needs_one_or_the_gpu_objective(tmp_path, capsys):
    spec = json.loads(Path(__file__).parents[1].joinpath("simulator/data/gpus/h100-sxm.json").read_text())
    spec.update(name="my-gpu", price_per_hour_usd=None, aliases=[], device_names=[])
    path = tmp_path / "my-gpu.json"
    path.write_text(json.dumps(spec))
    argv = ["plan", "--trace", str(_plain_trace(tmp_path)), "--num-requests", "40", "--p99-ttft-ms", "5000",
            "--gpus", str(path), "--tps", "1", "--out", str(tmp_path / "p")]
    assert main(argv) == 2
    assert "no price for GPU" in capsys.readouterr().err
    assert main([*argv, "--objective", "gpus"]) == 0
    assert "1 x " in capsys.readouterr().out


def _plain_trace(tmp_path: Path) -> Path:
    from servelab.traces import Trace, TraceRecord, write_csv
    trace = tmp_path / "plain.csv"   # its requests carry no SLO of their own
    write_csv(Trace(tuple(TraceRecord(0.05 * i, 200, 50) for i in range(40))), trace)
    return trace


def test_compare_sweeps_a_list_of_replica_counts(tmp_path, capsys):
    out = tmp_path / "c"
    assert main(["compare", *SMALL, "--policies", "fcfs", "--replicas", "1,3", "--out", str(out)]) == 0
    sweep = json.loads((out / "sweep.json").read_text())
    assert sweep["axes"]["replicas"] == [1, 3]
    replicas = [json.loads((out / "runs" / p["name"] / "config.json").read_text())["config"]["replicas"]
                for p in sweep["points"]]
    assert replicas == [1, 3]


def test_capacity_holds_a_percentile_target(tmp_path, capsys):
    out = tmp_path / "cap"
    assert main(["capacity", *SMALL[:4], "--rate", "30", "--policies", "fcfs", "--p99-ttft-ms", "400",
                 "--tolerance", "0.1", "--out", str(out)]) == 0
    data = json.loads((out / "capacity.json").read_text())
    assert data["criterion"] == "p99 TTFT <= 400 ms" and data["attainment_target"] is None
    (group,) = data["groups"]
    held = json.loads((out / "runs" / group["held"]["run"] / "summary.json").read_text())
    broke = json.loads((out / "runs" / group["broke"]["run"] / "summary.json").read_text())
    assert held["p99_ttft_ms"] <= 400 < broke["p99_ttft_ms"]
    assert "Capacity at p99 TTFT <= 400 ms" in (out / "report.md").read_text()


def test_dollars_per_million_tokens_price_each_pool_at_its_own_gpu():
    """A disaggregated layout of one H100 prefill replica and two TP2 L40S decode replicas:
    its cost an hour is the plan's ($10.36, each pool at its GPU's price), not five H100s.
    Its tokens an hour are the offered traffic's (30 req/s x 90 output tokens a request),
    not the run's throughput, whose drain after the last arrival a short trace inflates."""
    from servelab.reports.plan_report import _Row, _dollars_per_m_tokens

    summary = {"output_throughput": 1500.0, "completed": 400, "total_output_tokens": 36_000}
    row = _Row({"cost": 10.36, "replicas": 1, "gpus_per_replica": 5}, summary, {}, 30.0)
    cost_plan = {"objective": "cost"}
    assert _dollars_per_m_tokens(cost_plan, row, 4.76) == f"${10.36 / (2700 * 3600) * 1e6:,.2f}"
    assert _dollars_per_m_tokens({"objective": "gpus"}, row, 4.76) == \
        f"${4.76 * 5 / (2700 * 3600) * 1e6:,.2f}"
    assert _dollars_per_m_tokens({"objective": "gpus"}, row, None) == "n/a"
    nothing = _Row(row.layout, {**summary, "completed": 0}, {}, 30.0)
    assert _dollars_per_m_tokens(cost_plan, nothing, 4.76) == "n/a"


def test_a_row_that_had_not_settled_says_what_it_served():
    """Its req/s per GPU is the offered rate, which an overloaded run did not serve: the
    Edge column gives the served rate beside it (plan_report._edge)."""
    from servelab.reports.plan_report import _edge, _Row

    layout = {"replicas": 3, "gpus_per_replica": 2, "edge_notes": ["3 replicas met with little margin"],
              "unsettled": "the waiting queue never emptied"}
    row = _Row(layout, {"request_throughput": 43.2}, {}, offered=600.0)
    assert _edge(row) == ["3 replicas met with little margin",
                          "not settled: served 7.20 req/s per GPU of the 100.00 offered"]
    settled = _Row({**layout, "unsettled": None}, {"request_throughput": 99.0}, {}, offered=100.0)
    assert _edge(settled) == ["3 replicas met with little margin"]


def test_a_plan_without_per_request_slos_names_its_targets_in_the_comparison(tmp_path, capsys):
    """The finalists' comparison does not say "No SLO was given" (nor report an SLO
    attainment) when the plan was sized to whole-run percentiles."""
    out = tmp_path / "p"
    assert main(["plan", "--trace", str(_plain_trace(tmp_path)), "--num-requests", "40", "--gpus", "h100-sxm",
                 "--tps", "1", "--p99-ttft-ms", "2000", "--max-gpus", "2", "--workers", "1",
                 "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "The targets (p99 TTFT <= 2000 ms) are percentiles over each whole run" in report
    assert "No SLO was given" not in report and "lowest SLO attainment" not in report


def test_a_gpu_count_objective_reads_in_the_singular_for_one():
    from servelab.reports.plan_report import _cost

    gpus, cost = {"objective": "gpus"}, {"objective": "cost"}
    assert (_cost(gpus, 1), _cost(gpus, 3), _cost(cost, 4.76)) == ("1 GPU", "3 GPUs", "$4.76/h")


def test_a_plan_over_data_parallel_ranks_names_the_least_outstanding_router():
    """As `simulate` routes --dp / --ep ranks when --router is not given."""
    from argparse import Namespace
    from servelab.sweeps.plan_cli import _default_router

    assert _default_router(Namespace(dp=2, ep=None)) == "least-outstanding"
    assert _default_router(Namespace(dp=None, ep=4)) == "least-outstanding"
    assert _default_router(Namespace(dp=None, ep=None)) == "round-robin"


def test_plan_help_states_what_plan_searches_by_default(capsys):
    """Not compare's defaults (four policies) nor argparse's None: what plan does."""
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--policies P,P,... values of --policy to sweep (default: --policy's one)" in text
    assert "--gpus G,G,... values of --gpu to sweep (default: every catalog GPU with a price)" in text
    assert "--tps N,N,... values of --tp to sweep (default: 1,2,4,8)" in text
    assert "(default: plan searches every catalog GPU with a price)" in text
    assert "tensor-parallel GPUs per replica (default: plan searches 1,2,4,8)" in text
    assert "(default None)" not in text and "fcfs,priority,sjf,fair" not in text


def test_a_layout_with_data_parallel_ranks_counts_and_prices_every_rank(tmp_path, capsys):
    """Under --ep 2 a replica is a deployment of two engines on two GPUs: the plan runs
    count x 2 replicas and counts and prices both GPUs (it priced one)."""
    out = tmp_path / "plan"
    assert main(["plan", "--trace", "default", "--model", "qwen3-30b-a3b", "--ep", "2",
                 "--rate", "30", "--num-requests", "100", "--p99-ttft-ms", "2000",
                 "--gpus", "h100-sxm", "--tps", "1,4", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    answer = captured.out
    plan = json.loads((out / "plan.json").read_text())
    price = plan["prices"]["h100-sxm"]
    assert "h100-sxm (TP1, DP2, EP2)" in answer
    assert "(2 GPUs)" in answer and f"${2 * price:.2f}/h" in answer
    # a TP the fixed --ep does not divide is skipped, as a layout that does not fit is,
    # and the others are searched
    assert "skipped gpu=h100-sxm, tp=4" in captured.err and "--ep 2 must be a multiple" in captured.err
    assert [s["labels"]["tp"] for s in plan["skipped"]] == [4]
    runs = {p.parent.name: json.loads(p.read_text())["config"]
            for p in (out / "runs").glob("*/config.json")}
    counts = {name: int(name.split("_x")[1].split("_")[0]) for name in runs}
    assert runs and all(c["replicas"] == 2 * counts[n] and c["ep"] == 2 for n, c in runs.items())


def test_a_pools_own_gpu_is_priced_listed_and_overridable(tmp_path, capsys):
    """--prefill-gpu's GPU is one the plan prices: --gpu-price may name it, and the report
    lists its price (it was charged at the catalog's, unlisted, and --gpu-price refused it)."""
    out = tmp_path / "plan"
    assert main(["plan", "--trace", "default", "--rate", "20", "--num-requests", "100",
                 "--p99-ttft-ms", "3000", "--gpus", "h100-sxm", "--tps", "1",
                 "--prefill-replicas", "1", "--decode-replicas", "1", "--prefill-gpu", "l40s",
                 "--gpu-price", "h100-sxm=4,l40s=0.5", "--out", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["prices"] == {"h100-sxm": 4.0, "l40s": 0.5}
    assert "h100-sxm $4, l40s $0.5" in (out / "report.md").read_text()
    pooled = [r for r in plan["layouts"] if r["labels"]["pools"] == "1P(l40s)+1D"]
    assert pooled and all(r["cost_per_replica"] == pytest.approx(4.5) for r in pooled)


def test_pools_on_the_layouts_own_gpu_share_its_engine_and_kernels_in_the_report(tmp_path):
    """A plan over co-located and 1P+1D layouts of one GPU: every point runs the same
    engine and kernels, and the report says so (it listed the engine as differing, the
    pools' records lacking the kernels' engine version)."""
    out = tmp_path / "plan"
    assert main(["plan", "--trace", "default", "--rate", "40", "--num-requests", "100",
                 "--p99-ttft-ms", "2000", "--p99-tpot-ms", "50", "--gpus", "h100-sxm",
                 "--tps", "1", "--prefill-replicas", "1", "--decode-replicas", "1",
                 "--out", str(out)]) == 0
    line = next(x for x in (out / "report.md").read_text().splitlines()
                if x.startswith("Every point:"))
    assert line.startswith("Every point: engine vllm-0.24 (kernels: h100-sxm.vllm-0.24, "
                           "measured inside vLLM 0.24.0);")
    assert "engine or its kernels" not in line


def test_a_plan_over_another_says_its_report_is_replaced(tmp_path, capsys):
    """As compare says of another grid: the same plan again says nothing, another one
    (here another latency target) says that the earlier report is replaced."""
    out = tmp_path / "plan"
    base = ["plan", "--trace", "default", "--rate", "20", "--num-requests", "100", "--gpus", "h100-sxm",
            "--tps", "1", "--out", str(out)]
    assert main([*base, "--p99-ttft-ms", "3000"]) == 0
    assert main([*base, "--p99-ttft-ms", "3000"]) == 0
    assert "held another" not in capsys.readouterr().err
    assert main([*base, "--p99-ttft-ms", "2000"]) == 0
    assert f"plan: note: {out} held another plan; its report is replaced by this one's" in capsys.readouterr().err
