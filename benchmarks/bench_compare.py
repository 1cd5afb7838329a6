"""Sweep throughput (simulated requests per second of wall time) and report cost (s per figure).

Setup: the embedded default workload on Llama-3.1-8B / H100, four policies x two rates
(--requests requests each), run once per worker count into a fresh directory, then the
report of the last sweep is built (figures drawn, PNGs rendered) and timed.

    python benchmarks/bench_compare.py [--requests 1000] [--workers 1,2]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from servelab.config import SchedulerConfig
from servelab.reports import plots
from servelab.reports.report import Image, build_document, load_comparison
from servelab.simulator.run import SimulationConfig
from servelab.sweeps.runner import run_sweep
from servelab.sweeps.sweep import expand_grid, override_builder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--workers", default="1,2")
    args = ap.parse_args()
    base = SimulationConfig(trace="default", num_requests=args.requests,
                            scheduler=SchedulerConfig(max_model_len=131072))
    points = expand_grid({"policy": ["fcfs", "priority", "sjf", "fair"], "rate": [12.0, 16.0]},
                         override_builder(base))
    with tempfile.TemporaryDirectory() as tmp:
        for workers in (int(w) for w in args.workers.split(",")):
            out = Path(tmp) / f"w{workers}"
            start = time.perf_counter()
            outcome = run_sweep(points, out, workers=workers)
            wall = time.perf_counter() - start
            simulated = sum(o.summary["completed"] + o.summary["rejected"] for o in outcome.outcomes)
            print(f"{workers} worker(s): {len(points)} points, {simulated:,} requests in {wall:.1f} s "
                  f"= {simulated / wall:,.0f} simulated requests/s ({wall / len(points):.2f} s per point)")
        start = time.perf_counter()
        blocks = build_document(load_comparison(out))
        built = time.perf_counter() - start
        images = [b for b in blocks if isinstance(b, Image)]
        start = time.perf_counter()
        for image in images:
            plots.png_bytes(image.figure)
        rendered = time.perf_counter() - start
        print(f"report: loading + analysis + {len(images)} figures built in {built:.2f} s; "
              f"PNG rendering {rendered:.2f} s ({rendered / len(images):.2f} s per figure)")


if __name__ == "__main__":
    main()
