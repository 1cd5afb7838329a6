"""DistServe's simulator result against servelab's (run by scripts/distserve.sh): the
results section of docs/distserve.md and docs/distserve/attainment.png.

DistServe's README (LLMServe/DistServe, simdistserve/README.md) reports "Best per GPU rate:
1.56" for OPT-13B serving ShareGPT on one node of 4 x A100-80GB SXM under TTFT 200 ms and
TPOT 100 ms at P90, with one prefill instance of TP2 and one decode instance of TP1 (3 GPUs).
Here the same model, GPU, SLOs and placement run in servelab's simulator on the ShareGPT
lengths of /work/shared/traces, cut as DistServe cuts its ShareGPT (prompt + output < 2048
tokens), beside a co-located vLLM-like baseline on the same 3 GPUs and a decode-heavier
placement of 3 GPUs:

1. a grid of per-GPU rates, each layout: SLO attainment, p90 TTFT and p90 TPOT (the figure);
2. `servelab capacity` per layout, under DistServe's criterion (p90 TTFT <= 200 ms and
   p90 TPOT <= 100 ms, each over all requests, as its simulate_dist.py checks them) with
   DistServe's 300 requests and with 1,000, and under 90 % of requests within both SLOs;
3. the layouts at DistServe's per-GPU rate, and a sensitivity run with outputs scaled to
   the mean of DistServe's own ShareGPT sample.

Runs and the derived traces are kept under runs/distserve/ (rerunning reuses them); about
four minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parents[1]
TRACE = Path(os.environ.get("SERVELAB_SHARED", str(ROOT.parent / "shared"))) \
    / "traces" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
MODEL, GPU, LINK = "opt-13b", "a100-80gb", "nvlink3"
SLO_TTFT_MS, SLO_TPOT_MS = 200, 100
DISTSERVE_PER_GPU = 1.56
"""simdistserve/README.md: "Best per GPU rate: 1.56", config pp_cross=1, tp_prefill=2,
pp_prefill=1, tp_decode=1, pp_decode=1 (--N 300 --esp 0.25 --max-per-gpu-rate 5)."""
DISTSERVE_BRACKET = (1.5625, 1.71875)
"""What 1.56 means: benchmarks/search_binary.py bisects [0, 5] until the bracket is under
0.25 (2.5 broke, 1.25 held, 1.875 broke, 1.5625 held, 1.71875 broke), so the capacity lies
in this bracket."""
MAX_TOTAL_TOKENS = 2048
"""DistServe's ShareGPT cut (evaluation/2-benchmark-serving/0-prepare-dataset.py: rows with
prompt_len + output_len >= 2048 are dropped), which OPT's 2,048-token context needs."""
DISTSERVE_OUTPUT_MEAN = 181
"""Mean output tokens of DistServe's own ShareGPT requests (the request logs of its OPT-13B
runs in simdistserve/benchmarks/alignment/data-ground-truth/opt-13b-sharegpt/, commit
20a1633: 176 to 186 over the distserve-300-3, distserve-c21d12-1600-16 and vllm-400-4
logs; prompts 759 to 780)."""
DISTSERVE_STEP_MS = {
    1: {"prefill": (18.10254647486372, 0.1019122572698738, 7.122264314252114e-06),
        "decoding_smallbs": (19.934702624895458, 0.0006269356524350583, 0.03850697740828398),
        "decoding_largebs": (7.1661889468253595, 0.0005798000403396046, 0.15831096191764046)},
    2: {"prefill": (14.742973695171262, 0.06857720739764, 2.4495727400243586e-06)},
}
"""DistServe's step times for OPT-13B on an A100-80GB, in ms, by TP
(simdistserve/estimators/profile_data/profiler-a100-80g.distserve.json, read by
estimators/time_estimator.py): a prefill of prompts l_i costs a + b·Σl_i + c·Σl_i²; a
decode step of B requests a + b·Σ(context + 1) + c·B (the small-batch line below 95
requests, the large-batch one from it)."""
DISTSERVE_DECODE_THRESHOLD = 95
DISTSERVE_STEP_OVERHEAD_MS = (2.0, 1e-4)
"""base/worker.py `add_ray_overhead`: 2 ms plus 1e-4 ms per context token of the batch,
added to every step."""
GPUS = 3
LAYOUTS = {
    "DistServe: 1P TP2 + 1D TP1": ["--prefill-replicas", "1", "--decode-replicas", "1",
                                   "--prefill-tp", "2", "--decode-tp", "1", "--kv-link", LINK],
    "co-located: 3 x TP1": ["--replicas", "3", "--router", "least-outstanding"],
    "1P TP1 + 2D TP1": ["--prefill-replicas", "1", "--decode-replicas", "2", "--kv-link", LINK],
}
PER_GPU_RATES = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5)
DISTSERVE_CRITERION = ["--p90-ttft-ms", str(SLO_TTFT_MS), "--p90-tpot-ms", str(SLO_TPOT_MS)]
JOINT_CRITERION = ["--attainment", "0.9"]
BEGIN, END = "<!-- results:begin (scripts/distserve.sh) -->", "<!-- results:end -->"


def write_traces(runs: Path) -> dict[str, tuple[Path, dict]]:
    """The ShareGPT lengths cut at MAX_TOTAL_TOKENS, and the same with every output scaled to
    DistServe's sample mean (the sensitivity run): {name: (path, stats)}."""
    with TRACE.open(newline="") as f:
        rows = [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in csv.DictReader(f)]
    kept = [(p, o) for p, o in rows if p + o < MAX_TOTAL_TOKENS]
    scale = DISTSERVE_OUTPUT_MEAN / statistics.fmean(o for _, o in kept)
    variants = {"sharegpt": kept, "short-outputs": [(p, max(1, round(o * scale))) for p, o in kept]}
    out = {}
    for name, pairs in variants.items():
        path = runs / f"{name}-lt{MAX_TOTAL_TOKENS}.csv"
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["num_prefill_tokens", "num_decode_tokens", "num_total_tokens", "pd_ratio"])
            w.writerows((p, o, p + o, p / o) for p, o in pairs)
        out[name] = path, {"rows": len(pairs), "of": len(rows),
                           "prompt_mean": statistics.fmean(p for p, _ in pairs),
                           "prompt_p50": statistics.median(p for p, _ in pairs),
                           "output_mean": statistics.fmean(o for _, o in pairs),
                           "output_p50": statistics.median(o for _, o in pairs)}
    return out


def flags(layout: str, trace: Path, num_requests: int) -> list[str]:
    """The flags every command here shares for one layout."""
    return ["--trace", str(trace), "--num-requests", str(num_requests), "--model", MODEL,
            "--gpu", GPU, "--slo-ttft-ms", str(SLO_TTFT_MS), "--slo-tpot-ms", str(SLO_TPOT_MS),
            *LAYOUTS[layout]]


def run_point(job) -> tuple:
    """(key, summary, disaggregation report or None) of one `servelab simulate` point, from
    runs/ when it was run with the same config before."""
    key, argv, out = job
    from servelab.cli import build_parser
    from servelab.simulator.cli import config_from_args
    from servelab.simulator.run import run_simulation

    cfg = config_from_args(build_parser().parse_args(["simulate", *argv, "--out", str(out)]))
    stored = out / "config.json"
    if not (out / "summary.json").exists() or json.loads(stored.read_text())["config"] != cfg.to_dict():
        run_simulation(cfg, out)
    report = out / "disaggregation.json"
    return key, json.loads((out / "summary.json").read_text()), \
        json.loads(report.read_text()) if report.exists() else None


def capacity(name: str, argv: list[str], out: Path, start: float, workers: int) -> dict:
    """One `servelab capacity` search (FCFS, 2 % bracket) into `out`; its group record."""
    from servelab.cli import main as servelab

    out.mkdir(parents=True, exist_ok=True)
    with (out / "capacity.log").open("w") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        status = servelab(["capacity", *argv, "--policies", "fcfs", "--rates", f"{start:.3g}",
                           "--workers", str(workers), "--tolerance", "0.02", "--out", str(out), "--force"])
    if status != 0:
        raise SystemExit(f"servelab capacity {name} failed; see {out / 'capacity.log'}")
    group = json.loads((out / "capacity.json").read_text())["groups"][0]
    rate = group["capacity"]
    print(f"  {name}: {'none held' if rate is None else f'{rate:g} req/s, {rate / GPUS:.2f} per GPU'}",
          file=sys.stderr)
    return group


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=1000,
                        help="requests per run of the grid and of the steadier searches (default 1000)")
    parser.add_argument("--distserve-requests", type=int, default=300,
                        help="requests per run of the searches as DistServe ran them (default 300)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "distserve.md")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "distserve")
    args = parser.parse_args(argv)
    runs, n, n_ds = args.runs, args.num_requests, args.distserve_requests
    runs.mkdir(parents=True, exist_ok=True)
    traces = write_traces(runs)
    sharegpt, short = traces["sharegpt"][0], traces["short-outputs"][0]

    print(f"grid: {len(LAYOUTS)} layouts x {len(PER_GPU_RATES)} rates, {n} requests each", file=sys.stderr)
    jobs = [((layout, r), [*flags(layout, sharegpt, n), "--rate", f"{r * GPUS:g}"],
             runs / "grid" / f"{_slug(layout)}_r{r:g}")
            for layout in LAYOUTS for r in (*PER_GPU_RATES, DISTSERVE_BRACKET[0])]
    with ProcessPoolExecutor(args.workers) as pool:
        grid = {key: (summary, report) for key, summary, report in pool.map(run_point, jobs)}

    print("capacity searches (servelab capacity):", file=sys.stderr)
    found = {}
    for layout in LAYOUTS:
        start = max([r for r in PER_GPU_RATES if _attained(grid[(layout, r)][0])] or [PER_GPU_RATES[0]])
        for label, trace, requests, criterion in (
                ("distserve-300", sharegpt, n_ds, DISTSERVE_CRITERION),
                (f"distserve-{n}", sharegpt, n, DISTSERVE_CRITERION),
                (f"joint-{n}", sharegpt, n, JOINT_CRITERION),
                (f"short-outputs-{n}", short, n, DISTSERVE_CRITERION)):
            if label.startswith("short") and layout.startswith("1P"):
                continue
            found[(layout, label)] = capacity(
                f"{layout}, {label}", [*flags(layout, trace, requests), *criterion],
                runs / "capacity" / f"{_slug(layout)}_{label}", start * GPUS, args.workers)

    figures = args.doc.parent / "distserve"
    figures.mkdir(parents=True, exist_ok=True)
    _figure(grid, n).savefig(figures / "attainment.png", dpi=100, metadata={"Software": None})
    text = args.doc.read_text()
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    args.doc.write_text(head + BEGIN + "\n" + _results(grid, found, traces, n, n_ds) + END + tail)
    print(f"wrote {args.doc} and {figures / 'attainment.png'}", file=sys.stderr)
    return 0


def _slug(layout: str) -> str:
    return layout.split(":")[0].replace(" ", "").replace("+", "-").lower()


def _attained(summary: dict) -> bool:
    """DistServe's criterion held: p90 TTFT and p90 TPOT within their SLOs."""
    from servelab.reports.slo import PercentileTarget, SloTargets

    targets = SloTargets(None, (PercentileTarget("ttft", 90, SLO_TTFT_MS),
                                PercentileTarget("tpot", 90, SLO_TPOT_MS)))
    return targets.held(summary)


def _figure(grid, n: int) -> Figure:
    from servelab.reports.slo import slo_attainment

    fig = Figure(figsize=(13, 3.8))
    panels = (("requests within both SLOs (%)", lambda s: 100 * slo_attainment(s), 90),
              ("p90 TTFT (ms)", lambda s: s["p90_ttft_ms"], SLO_TTFT_MS),
              ("p90 TPOT (ms)", lambda s: s["p90_tpot_ms"], SLO_TPOT_MS))
    for ax, (label, value, line) in zip(fig.subplots(1, 3), panels):
        for layout in LAYOUTS:
            ax.plot(PER_GPU_RATES, [value(grid[(layout, r)][0]) for r in PER_GPU_RATES], marker="o",
                    label=layout, linestyle="--" if layout.startswith("co-located") else "-")
        ax.axhline(line, color="grey", linewidth=1)
        ax.axvspan(*DISTSERVE_BRACKET, color="tab:red", alpha=0.15, label="DistServe's 1.56 (its bracket)")
        ax.set_xlabel("request rate per GPU (req/s, 3 GPUs)")
        ax.set_ylabel(label)
        if label.startswith("p90"):
            ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    fig.axes[0].legend(fontsize=7)
    fig.suptitle(f"OPT-13B on A100-80GB, ShareGPT lengths (prompt + output < {MAX_TOTAL_TOKENS}), "
                 f"{n:,} requests per point; SLOs TTFT {SLO_TTFT_MS} ms, TPOT {SLO_TPOT_MS} ms", fontsize=9)
    fig.tight_layout()
    return fig


def step_prices() -> list[tuple[str, float, float]]:
    """(step, DistServe's ms, servelab's ms) for a few prefill and decode steps of OPT-13B
    on an A100: the two simulators' step prices side by side."""
    from servelab.outputs import BatchShape
    from servelab.simulator.cost_model import CostModel

    zero = dict.fromkeys(BatchShape.__slots__, 0)
    out = []
    base, per_token = DISTSERVE_STEP_OVERHEAD_MS
    for tp in (1, 2):
        cost = CostModel(MODEL, GPU, tp)
        for length in (600, 1200):
            a, b, c = DISTSERVE_STEP_MS[tp]["prefill"]
            theirs = a + b * length + c * length ** 2 + base + per_token * length
            ours = cost.step_time(BatchShape(**{**zero, "num_prefill_seqs": 1, "num_prefill_tokens": length,
                                                "prefill_q_sq_sum": length ** 2, "prefill_max_keys": length}))
            out.append((f"prefill of one {length:,}-token prompt, TP{tp}", theirs, ours * 1e3))
    cost = CostModel(MODEL, GPU, 1)
    for batch, context in ((30, 900), (60, 900), (100, 600)):
        line = "decoding_smallbs" if batch < DISTSERVE_DECODE_THRESHOLD else "decoding_largebs"
        a, b, c = DISTSERVE_STEP_MS[1][line]
        theirs = a + b * batch * (context + 1) + c * batch + base + per_token * batch * context
        ours = cost.step_time(BatchShape(**{**zero, "num_decode_seqs": batch,
                                            "decode_context_sum": batch * context}))
        out.append((f"decode of {batch} requests of {context} tokens, TP1", theirs, ours * 1e3))
    return out


def _per_gpu(group: dict) -> str:
    rate = group["capacity"]
    if rate is None:
        return "none held"
    bound = "" if group.get("steady_state_warning") is None else " (upper bound: not steady)"
    return f"{rate / GPUS:.2f}{bound}"


def _gap(group: dict) -> str:
    rate = group["capacity"]
    return "n/a" if rate is None else f"{(rate / GPUS / DISTSERVE_PER_GPU - 1):+.0%}"


def _ms(value) -> str:
    return "n/a" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _results(grid, found, traces, n: int, n_ds: int) -> str:
    from servelab.reports.slo import slo_attainment

    s, t = traces["sharegpt"][1], traces["short-outputs"][1]
    lines = [f"Trace: the ShareGPT lengths cut at prompt + output < {MAX_TOTAL_TOKENS} tokens: "
             f"{s['rows']:,} of {s['of']:,} rows; prompts {s['prompt_mean']:.0f} tokens on average "
             f"(median {s['prompt_p50']:.0f}), outputs {s['output_mean']:.0f} (median "
             f"{s['output_p50']:.0f}). Poisson arrivals, seed 0, the first N requests of the cut "
             "table; FCFS; servelab's default engine (vLLM V1 defaults: chunked prefill, 2,048 "
             "batched tokens on an A100, asynchronous scheduling in every pool); KV over "
             f"`{LINK}`. Capacities are `servelab capacity`'s "
             "(the highest rate that held, the first that broke within 2 % above it), divided by "
             f"{GPUS} GPUs.", "",
             f"![SLO attainment, p90 TTFT and p90 TPOT against the rate per GPU](distserve/attainment.png)", "",
             f"| layout ({GPUS} GPUs) | DistServe's criterion, {n_ds} requests (req/s/GPU) | gap to 1.56 | "
             f"DistServe's criterion, {n:,} requests | gap to 1.56 | 90 % within both SLOs, {n:,} requests |",
             "|---|---:|---:|---:|---:|---:|"]
    for layout in LAYOUTS:
        a, b, c = (found[(layout, k)] for k in ("distserve-300", f"distserve-{n}", f"joint-{n}"))
        lines.append(f"| {layout} | {_per_gpu(a)} | {_gap(a)} | {_per_gpu(b)} | {_gap(b)} | {_per_gpu(c)} |")
    ours = found[(next(iter(LAYOUTS)), f"distserve-{n}")]["capacity"] or 0.0
    lines += ["", f"The decode GPU of DistServe's placement generates {ours * s['output_mean']:,.0f} "
              f"tokens/s at its capacity here ({ours:g} req/s × {s['output_mean']:.0f} output "
              f"tokens, {n:,} requests); at DistServe's 1.5625 req/s per GPU and its sample's "
              f"{DISTSERVE_OUTPUT_MEAN} output tokens, DistServe's decode GPU generates "
              f"{DISTSERVE_BRACKET[0] * GPUS * DISTSERVE_OUTPUT_MEAN:,.0f}."]
    lines += ["", "**Step prices**, OPT-13B on an A100 (DistServe's fitted step times with its "
              "per-step overhead; servelab's cost model):", "",
              "| step | DistServe (ms) | servelab (ms) | servelab / DistServe |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {theirs:.1f} | {ours:.1f} | {ours / theirs:.2f} |" for name, theirs, ours in step_prices()]
    rate = DISTSERVE_BRACKET[0]
    lines += ["", f"**At DistServe's rate** ({rate} req/s per GPU, {rate * GPUS:g} req/s in all; "
              f"{n:,} requests):", "",
              "| layout | p90 TTFT (ms) | p90 TPOT (ms) | within both SLOs | preemptions | prefill GPUs busy | "
              "decode GPUs busy | waited for a decode replica (mean wait) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for layout in LAYOUTS:
        summary, report = grid[(layout, rate)]
        if report is None:
            busy = waited = "—"
            pools = ("—", "—")
        else:
            pools = tuple(f"{report['utilisation'][p]['gpu_busy_fraction']:.0%}" for p in ("prefill", "decode"))
            wait = report["handoff_ms"]["waiting_for_decode_replica"]["mean"]
            waited = f"{report['back_pressure']['requests_that_waited']:,} ({_ms(wait)} ms)"
        lines.append(f"| {layout} | {_ms(summary['p90_ttft_ms'])} | {_ms(summary['p90_tpot_ms'])} | "
                     f"{slo_attainment(summary):.0%} | {summary['num_preemptions']:,} | {pools[0]} | "
                     f"{pools[1]} | {waited} |")
    lines += ["", f"**Sensitivity: outputs scaled to DistServe's sample** (every output × "
              f"{t['output_mean'] / s['output_mean']:.2f}, mean {t['output_mean']:.0f} tokens, prompts "
              f"unchanged; DistServe's criterion, {n:,} requests):", "",
              "| layout | req/s per GPU | gap to 1.56 |", "|---|---:|---:|"]
    for layout in LAYOUTS:
        if (layout, f"short-outputs-{n}") in found:
            g = found[(layout, f"short-outputs-{n}")]
            lines.append(f"| {layout} | {_per_gpu(g)} | {_gap(g)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
