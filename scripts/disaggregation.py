"""Co-located against disaggregated serving at one GPU count (run by scripts/disaggregation.sh):
docs/disaggregation/latency.png and the results section of docs/disaggregation.md.

Llama-3.1-8B on 4 x H100 (`servelab simulate`'s defaults: vLLM 0.24's scheduler, FCFS; least-outstanding routing)
serving the arXiv-summarization lengths (prompts ~2.6k tokens, outputs ~290: prefill-heavy)
with Poisson arrivals at each rate:

- co-located: 4 replicas of tp 1;
- disaggregated: 1P+3D, 2P+2D, 3P+1D replicas of tp 1, KV over 400 Gb/s InfiniBand;

p90 TTFT and p99 TPOT against the rate, goodput per GPU under TTFT 300 ms / TPOT 20 ms,
then, at one rate, the KV link (ideal to PCIe Gen4) and a decode-heavy trace (BWB lengths:
prompts ~1.1k tokens, outputs ~1.6k), where splitting the GPUs stops paying. Runs are kept under
runs/disaggregation/ (rerunning reuses them); a few minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parents[1]
TRACES = os.environ.get("SERVELAB_SHARED", str(ROOT.parent / "shared")) + "/traces"
GPUS = 4
LAYOUTS = {"co-located 4x": None, "1P+3D": (1, 3), "2P+2D": (2, 2), "3P+1D": (3, 1)}
RATES = (8, 12, 16, 20, 24, 28, 32, 36)
SLO_TTFT_MS, SLO_TPOT_MS = 300.0, 20.0
LINK_RATE, LINKS = 20, ("ideal", "nvlink", "ib-400g", "roce-200g", "pcie-gen4")
DECODE_HEAVY, DECODE_HEAVY_RATE = "bwb-lengths", 16
BEGIN, END = "<!-- results:begin (scripts/disaggregation.sh) -->", "<!-- results:end -->"


def config(layout, rate: float, num_requests: int, trace: str = "arxiv-lengths", link: str = "ib-400g"):
    """The config `servelab simulate` builds from these flags."""
    from servelab.cli import build_parser
    from servelab.simulator.cli import config_from_args

    pools = LAYOUTS[layout]
    flags = ["simulate", "--trace", trace, "--trace-dir", TRACES, "--no-download", "--rate", str(rate),
             "--num-requests", str(num_requests), "--model", "llama-3.1-8b", "--gpu", "h100-sxm",
             "--router", "least-outstanding", "--slo-ttft-ms", str(SLO_TTFT_MS),
             "--slo-tpot-ms", str(SLO_TPOT_MS), "--out", "unused"]
    flags += ["--replicas", str(GPUS)] if pools is None else [
        "--prefill-replicas", str(pools[0]), "--decode-replicas", str(pools[1]), "--kv-link", link]
    return config_from_args(build_parser().parse_args(flags))


def run(job) -> tuple:
    """(key, summary, disaggregation report) of one point, from runs/ if done before."""
    key, cfg, out = job
    from servelab.simulator.run import run_simulation

    if not (out / "summary.json").exists() or json.loads((out / "config.json").read_text())["config"] != cfg.to_dict():
        run_simulation(cfg, out)
    report = out / "disaggregation.json"
    return key, json.loads((out / "summary.json").read_text()), \
        json.loads(report.read_text()) if report.exists() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=1500)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "disaggregation.md")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "disaggregation")
    args = parser.parse_args(argv)
    runs = args.runs
    jobs = []
    for layout in LAYOUTS:
        for rate in RATES:
            jobs.append(((layout, rate), config(layout, rate, args.num_requests), runs / f"{_slug(layout)}_r{rate}"))
    for link in LINKS:
        jobs.append((("link", link), config("2P+2D", LINK_RATE, args.num_requests, link=link),
                     runs / f"link-{link}_r{LINK_RATE}"))
    for layout in LAYOUTS:
        jobs.append((("decode-heavy", layout),
                     config(layout, DECODE_HEAVY_RATE, args.num_requests, trace=DECODE_HEAVY),
                     runs / f"{DECODE_HEAVY}_{_slug(layout)}_r{DECODE_HEAVY_RATE}"))
    with ProcessPoolExecutor(args.workers) as pool:
        results = {key: (summary, report) for key, summary, report in pool.map(run, jobs)}
    figures = args.doc.parent / "disaggregation"
    figures.mkdir(parents=True, exist_ok=True)
    _figure(results).savefig(figures / "latency.png", dpi=100, metadata={"Software": None})
    text = args.doc.read_text()
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    args.doc.write_text(head + BEGIN + "\n" + _results(results, args.num_requests) + END + tail)
    print(f"wrote {args.doc} and {figures / 'latency.png'}", file=sys.stderr)
    return 0


def _slug(layout: str) -> str:
    return layout.replace(" ", "-").replace("+", "")


def _figure(results) -> Figure:
    fig = Figure(figsize=(10, 4))
    for ax, key, title in zip(fig.subplots(1, 2), ("p90_ttft_ms", "p99_tpot_ms"), ("p90 TTFT", "p99 TPOT")):
        for layout in LAYOUTS:
            ys = [results[(layout, r)][0][key] for r in RATES]
            ax.plot(RATES, ys, marker="o", label=layout, linestyle="--" if LAYOUTS[layout] is None else "-")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_yscale("log")
        ax.set_title(f"{title}, 4 x H100, Llama-3.1-8B, arXiv lengths")
        ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def _ms(value) -> str:
    return "n/a" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _results(results, num_requests: int) -> str:
    lines = [f"Each point: {num_requests:,} requests, Poisson arrivals, seed 0. "
             f"Goodput: requests meeting TTFT {SLO_TTFT_MS:.0f} ms and TPOT {SLO_TPOT_MS:.0f} ms, "
             "per second, per GPU (4 GPUs in every layout).", "",
             "![p90 TTFT and p99 TPOT against the rate](disaggregation/latency.png)", "",
             "| rate (req/s) | " + " | ".join(f"{l} p90 TTFT / p99 TPOT (ms) / goodput per GPU" for l in LAYOUTS) + " |",
             "|---:|" + "---:|" * len(LAYOUTS)]
    for rate in RATES:
        cells = []
        for layout in LAYOUTS:
            s = results[(layout, rate)][0]
            cells.append(f"{_ms(s['p90_ttft_ms'])} / {_ms(s['p99_tpot_ms'])} / {s['request_goodput'] / GPUS:.2f}")
        lines.append(f"| {rate} | " + " | ".join(cells) + " |")
    lines += ["", f"**The KV link** (2P+2D at {LINK_RATE} req/s; a transfer runs over one link per GPU "
              "pair, tp 1 here):", "",
              "| link | mean transfer (ms) | p99 transfer (ms) | p90 TTFT (ms) | p99 TPOT (ms) | mean TPOT (ms) |",
              "|---|---:|---:|---:|---:|---:|"]
    for link in LINKS:
        s, r = results[("link", link)]
        t = r["handoff_ms"]["transfer"]
        lines.append(f"| {link} | {t['mean']:.2f} | {t['p99']:.2f} | {_ms(s['p90_ttft_ms'])} | "
                     f"{_ms(s['p99_tpot_ms'])} | {s['mean_tpot_ms']:.2f} |")
    lines += ["", f"**Decode-heavy traffic** (BWB lengths, prompts ~1.1k tokens and outputs ~1.6k, at "
              f"{DECODE_HEAVY_RATE} req/s):", "",
              "| layout | p90 TTFT (ms) | p99 TPOT (ms) | goodput per GPU | prefill busy | decode busy |",
              "|---|---:|---:|---:|---:|---:|"]
    for layout in LAYOUTS:
        s, r = results[("decode-heavy", layout)]
        busy = ("", "") if r is None else tuple(f"{r['utilisation'][p]['gpu_busy_fraction']:.0%}"
                                                for p in ("prefill", "decode"))
        lines.append(f"| {layout} | {_ms(s['p90_ttft_ms'])} | {_ms(s['p99_tpot_ms'])} | "
                     f"{s['request_goodput'] / GPUS:.2f} | {busy[0]} | {busy[1]} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
