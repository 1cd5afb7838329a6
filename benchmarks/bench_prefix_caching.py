"""What prefix caching costs the simulator (not a test).

Issue #16's case: the Mooncake conversation trace (12,031 requests, mean prompt 12k
tokens, 512-token prefix hashes, heavy reuse), Llama-3.1-8B on one H100, FCFS, an
8,192-token step budget: an overloaded replica whose waiting head is looked up in the
prefix cache step after step. The same run is timed with and without `--prefix-caching`;
target: the prefix-caching run costs at most 1.5x the other (it was 13.6x).

The two runs alternate (without, with, without, ...) so that a shared machine's drifting
speed hits both alike, each in a fresh process, the command line as a user types it. The
fastest of --repeat runs of each is reported (and the median), wall and CPU seconds (user
+ system of the child, which drift less on a shared machine), with the ratios of the
fastest; the prefix cache's hit rate (summary.json) shows the runs did the work.

    .venv/bin/python benchmarks/bench_prefix_caching.py [--repeat N] [--num-requests N]
        [--trace PATH] [--kv-offload-gb GB] [--keep DIR] [--instructions]

--kv-offload-gb also gives the prefix-caching run a CPU tier of that many GiB.
--instructions counts the instructions of one run of each instead of timing them
(benchmarks/count_instructions.sh: valgrind, about 50x slower, repeatable to ~0.01%),
for comparisons that a shared machine's drifting speed cannot blur.
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
SHARED = Path(os.environ.get("SERVELAB_SHARED", REPO.parent / "shared"))
TARGET_RATIO = 1.5
SERVELAB = [sys.executable, "-m", "servelab"]


def case_args(trace: Path, num_requests: int | None) -> list[str]:
    # --engine servelab: prefix caching off unless asked for, as the case was first measured
    args = ["simulate", "--trace", str(trace), "--model", "llama-3.1-8b", "--gpu", "h100-sxm",
            "--engine", "servelab", "--policy", "fcfs", "--max-num-batched-tokens", "8192"]
    return args + (["--num-requests", str(num_requests)] if num_requests else [])


def timed(command: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system) of one run of `command` in a child
    process. CPU time drifts less than wall time on a machine shared with other work."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status):
        raise subprocess.CalledProcessError(os.waitstatus_to_exitcode(status), command)
    return wall, usage.ru_utime + usage.ru_stime


def instructions(command: list[str]) -> int:
    """Millions of instructions one run of `command` executes (count_instructions.sh)."""
    out = subprocess.run(["bash", str(REPO / "benchmarks" / "count_instructions.sh"), *command],
                         check=True, capture_output=True, text=True).stdout
    return int(out.split()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=SHARED / "traces" / "mooncake_conversation_trace.jsonl")
    ap.add_argument("--num-requests", type=int, help="replay only the first N requests")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each (fastest and median reported)")
    ap.add_argument("--kv-offload-gb", type=float, default=0.0,
                    help="a CPU tier of this many GiB for the prefix-caching run")
    ap.add_argument("--keep", type=Path, help="keep the run directories here")
    ap.add_argument("--instructions", action="store_true",
                    help="count instructions of one run of each (valgrind) instead of timing")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")

    base = case_args(args.trace, args.num_requests)
    cached = ["--prefix-caching"] + (["--kv-offload-gb", str(args.kv_offload_gb)]
                                     if args.kv_offload_gb else [])
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        commands = {"without": [*SERVELAB, *base, "--out", str(work / "without")],
                    "with": [*SERVELAB, *base, *cached, "--out", str(work / "with")]}
        if args.instructions:
            counts = {name: instructions(command) for name, command in commands.items()}
            summary = json.loads((work / "with" / "summary.json").read_text())
            for name, command in commands.items():
                print(f"{name:>7} prefix caching: {counts[name]:,} M instructions")
                print(f"    servelab {' '.join(command[3:-2])}")
            print(f"ratio: {counts['with'] / counts['without']:.2f}x instructions; "
                  f"{summary['completed']} requests finished, prefix-cache hit rate "
                  f"{summary['prefix_cache_hit_rate']:.1%}")
            return
        walls: dict[str, list[float]] = {"without": [], "with": []}
        cpus: dict[str, list[float]] = {"without": [], "with": []}
        for _ in range(args.repeat):
            for name, command in commands.items():
                wall, cpu = timed(command)
                walls[name].append(wall)
                cpus[name].append(cpu)
        summary = json.loads((work / "with" / "summary.json").read_text())
    for name in walls:
        walls[name].sort()
        cpus[name].sort()
    for name, command in commands.items():
        w, c = walls[name], cpus[name]
        print(f"{name:>7} prefix caching: {w[0]:.2f} s wall, fastest of {len(w)} (median "
              f"{w[len(w) // 2]:.2f} s); {c[0]:.2f} s CPU (median {c[len(c) // 2]:.2f} s)")
        print(f"    servelab {' '.join(command[3:-2])}")
    ratio = walls["with"][0] / walls["without"][0]
    cpu_ratio = cpus["with"][0] / cpus["without"][0]
    verdict = "meets" if ratio <= TARGET_RATIO else "MISSES"
    print(f"ratio: {ratio:.2f}x wall, {cpu_ratio:.2f}x CPU ({verdict} the {TARGET_RATIO:g}x target); "
          f"{summary['completed']} requests finished, prefix-cache hit rate "
          f"{summary['prefix_cache_hit_rate']:.1%}")


if __name__ == "__main__":
    main()
