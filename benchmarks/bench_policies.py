"""What the SLO-era policies cost in simulator speed: each policy's `servelab simulate` wall
time against the same run with fcfs (not a test).

Setup: scripts/policy_capacity.py's case — the embedded default workload, llama-3.1-8b
on one H100 SXM, the default engine (vLLM 0.24's scheduler defaults, prefix caching on),
--slo-ttft-ms 10000 --slo-tpot-ms 200, --requests requests (default 4,000), seed 0 — at
one rate below every policy's capacity (20 req/s) and one past it (30 req/s). Target
(issue #40): every policy within 1.5x of fcfs's wall time on the same run.

Each run is the real command line in a fresh process, start-up included, as a user runs
it; the package's bytecode is compiled first. The variants of one repeat run one after
another, and the repeats interleave, so a shared machine's drift falls on all of them
alike; the fastest of --repeat runs is reported, in wall seconds and in CPU seconds (user
+ system, from the kernel's accounting of the child: steadier than wall time on a busy
machine), each with its ratio to fcfs.

    .venv/bin/python benchmarks/bench_policies.py [--requests 4000] [--rates 20,30]
        [--repeat 3] [--only fcfs,mlfq]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_RATIO = 1.5
COMMON = ["simulate", "--trace", "default", "--model", "llama-3.1-8b", "--gpu", "h100-sxm",
          "--slo-ttft-ms", "10000", "--slo-tpot-ms", "200"]
VARIANTS = {
    "fcfs": ["--policy", "fcfs"],
    "priority": ["--policy", "priority"],
    "priority-preemptive": ["--policy", "priority", "--preemptive-priority"],
    "edf": ["--policy", "edf"],
    "lsf": ["--policy", "lsf"],
    "mlfq-no-preemption": ["--policy", "mlfq", "--mlfq-no-preemption"],
    "mlfq": ["--policy", "mlfq"],   # preemptive, its default
    "edf+shed": ["--policy", "edf", "--shed-from-priority", "1"],
}
"""fcfs first: the others are measured against it."""


def compile_bytecode() -> None:
    """Compile the package's modules once (what a first import does by default)."""
    dirs = [str(REPO / d) for d in ("servelab", "policies", "memory", "simulator", "traces", "reports")]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *dirs], check=True,
                   stdout=subprocess.DEVNULL)


def run_measured(command: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of `command` in a child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status):
        raise subprocess.CalledProcessError(os.waitstatus_to_exitcode(status), command)
    return wall, usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--rates", default="20,30", help="request rates, req/s (default: below and "
                    "past every policy's capacity)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per variant (fastest reported)")
    ap.add_argument("--only", help="comma-separated variants (fcfs is always run): "
                    + ", ".join(VARIANTS))
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    names = list(VARIANTS)
    if args.only:
        wanted = set(args.only.split(",")) | {"fcfs"}
        unknown = wanted - set(VARIANTS)
        if unknown:
            ap.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
        names = [n for n in VARIANTS if n in wanted]
    rates = [float(r) for r in args.rates.split(",")]

    compile_bytecode()
    best: dict[tuple[str, float], tuple[float, float]] = {}
    preemptions: dict[tuple[str, float], int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeat):
            for rate in rates:
                for name in names:
                    out = Path(tmp) / f"{name}_r{rate:g}"
                    command = [sys.executable, "-m", "servelab", *COMMON, *VARIANTS[name],
                               "--rate", str(rate), "--num-requests", str(args.requests),
                               "--out", str(out), "--force"]
                    wall, cpu = run_measured(command)
                    key = (name, rate)
                    old = best.get(key, (float("inf"), float("inf")))
                    best[key] = (min(old[0], wall), min(old[1], cpu))
                    summary = json.loads((out / "summary.json").read_text())
                    preemptions[key] = summary["num_preemptions"]

    print(f"servelab simulate, default engine, {args.requests:,} requests, fastest of "
          f"{args.repeat}; target: within {TARGET_RATIO:g}x of fcfs")
    print(f"{'variant':<20} {'rate':>5} {'wall s':>7} {'x fcfs':>7} {'CPU s':>7} {'x fcfs':>7} "
          f"{'preemptions':>11}")
    for rate in rates:
        base_wall, base_cpu = best[("fcfs", rate)]
        for name in names:
            wall, cpu = best[(name, rate)]
            verdict = "" if wall / base_wall <= TARGET_RATIO else "  MISSES the target"
            print(f"{name:<20} {rate:>5g} {wall:>7.2f} {wall / base_wall:>6.2f}x {cpu:>7.2f} "
                  f"{cpu / base_cpu:>6.2f}x {preemptions[(name, rate)]:>11}{verdict}")


if __name__ == "__main__":
    main()
