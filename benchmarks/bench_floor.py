"""How close can `servelab simulate` get to its targets? A lower bound (not a test).

The simulator runs the shared scheduler, one engine step at a time, in SimPy. So a
run costs at least

    start-up + load + write + (engine steps that ran one by one) x (the cheapest
    engine step there is)

Everything else a run does (admissions, prefill steps, finishes, fast-forward runs,
computing the summary) only adds to that. This script measures each term:

- the fixed phases of the run itself (case (a), or a slice of case (b)'s trace), timed
  in-process in the order `servelab simulate` runs them; start-up is a fresh
  interpreter importing what `simulate` imports;
- the cheapest engine step: one request decoding alone, fast-forward off, so every
  step is a plain one-sequence decode through the whole stack (SimPy timeout,
  `engine_step`: schedule, simulated executor, update, step record);

and prints the bound beside the target. If the bound is above the target, no
optimisation of the scheduler's logic can meet it: the per-step protocol (what the
simulator shares with the real backend) and writing the outputs already cost more.

    .venv/bin/python benchmarks/bench_floor.py [--case a|b|all] [--b-requests N] [--repeat N]

Case (b) is measured on the first --b-requests requests (default 20,000) of the same
synthetic trace `bench_simulator.py` builds and scaled linearly to 1,000,000 (the load
is steady, so a run's work grows linearly with its requests).
"""
from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_simulator import (SHARED, TARGETS_S, azure_args, compile_bytecode,
                             synthetic_args, synthetic_trace)

B_REQUESTS = 1_000_000
IMPORTS = ("import servelab.cli, servelab.simulator.cli, servelab.simulator.run, "
           "servelab.simulator.engine, servelab.policies, servelab.memory, "
           "servelab.reports.metrics, servelab.reports.runio, servelab.traces.loaders")


def startup_s(repeat: int) -> float:
    """Fastest wall time of a fresh interpreter importing what `simulate` imports."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", IMPORTS], check=True)
        best = min(best, time.perf_counter() - t0)
    return best


def run_phases(cli_args: list[str], out: Path) -> dict:
    """One run of `servelab simulate`, phase by phase, as `_cmd_simulate` runs it."""
    from servelab.cli import build_parser
    from servelab.simulator.cli import config_from_args
    from servelab.simulator.run import build_simulation, write_run_dir

    args = build_parser().parse_args([*cli_args, "--out", str(out)])
    t0 = time.perf_counter()
    sim = build_simulation(config_from_args(args))
    t1 = time.perf_counter()
    result = sim.run()
    t2 = time.perf_counter()
    write_run_dir(result, out, args.output_format)
    t3 = time.perf_counter()
    num_steps = result.steps.column("num_steps")
    return {"build_s": t1 - t0, "run_s": t2 - t1, "write_s": t3 - t2,
            "requests": len(result.requests), "rows": len(num_steps),
            "single_rows": int((num_steps == 1).sum()), "engine_steps": int(num_steps.sum())}


def cheapest_step_s(num_steps: int = 20_000) -> float:
    """Seconds per engine step of one request decoding alone (fast-forward off), through
    the simulator's whole stack: Replica.run, engine_step, the simulated executor."""
    from servelab.config import CacheConfig, SchedulerConfig
    from servelab.models import load_model_spec
    from servelab.simulator.speed import build_scheduler
    from servelab.request import Request
    from servelab.simulator.cost_model import CostModel
    from servelab.simulator.engine import Cluster
    from servelab.simulator.gpus import get_gpu
    from servelab.simulator.router import make_router

    sched = build_scheduler(SchedulerConfig(max_model_len=num_steps + 64),
                            CacheConfig(block_size=16, num_gpu_blocks=num_steps // 16 + 16), "fcfs")
    cost = CostModel(load_model_spec("llama-2-7b"), get_gpu("a100-80gb"), block_size=16)
    req = Request(0, 0.0, 16, num_steps)
    cluster = Cluster([sched], cost, make_router("round-robin", 1), [req], fast_forward=False)
    gc.disable()
    try:
        t0 = time.perf_counter()
        cluster.run()
        elapsed = time.perf_counter() - t0
    finally:
        gc.enable()
    return elapsed / len(cluster.step_records())


def report(name: str, phases: dict, start: float, step: float, scale: float) -> None:
    fixed = start + scale * (phases["build_s"] + phases["write_s"])
    steps = scale * phases["single_rows"] * step
    bound = fixed + steps
    run = scale * phases["run_s"]
    target = TARGETS_S[name]
    verdict = "above" if bound > target else "below"
    print(f"({name}) lower bound {bound:.2f} s, {verdict} the {target:g} s target"
          + (f" (measured on {phases['requests']:,} requests, x{scale:g})" if scale != 1 else ""))
    print(f"    start-up {start:.2f} s + load/build {scale * phases['build_s']:.2f} s "
          f"+ write {scale * phases['write_s']:.2f} s = {fixed:.2f} s fixed")
    print(f"    {scale * phases['single_rows']:,.0f} one-by-one engine steps x {step * 1e6:.1f} µs "
          f"(the cheapest step) = {steps:.2f} s")
    print(f"    the run itself took {run:.2f} s for {scale * phases['engine_steps']:,.0f} engine "
          f"steps in {scale * phases['rows']:,.0f} step rows "
          f"({run / (scale * phases['rows']) * 1e6:.0f} µs per row)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=("a", "b", "all"), default="all")
    ap.add_argument("--b-requests", type=int, default=20_000,
                    help="requests of case (b)'s trace to measure (scaled to 1,000,000)")
    ap.add_argument("--rate", type=float, default=8.0, help="case (b) request rate, req/s")
    ap.add_argument("--azure", type=Path, default=SHARED / "traces" / "AzureLLMInferenceTrace_conv.csv")
    ap.add_argument("--repeat", type=int, default=3, help="measurements per term (fastest kept)")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if not 1 <= args.b_requests <= B_REQUESTS:
        ap.error(f"--b-requests must be in 1..{B_REQUESTS}")

    compile_bytecode()
    start = startup_s(args.repeat)
    step = min(cheapest_step_s() for _ in range(args.repeat))
    print(f"start-up {start:.3f} s; cheapest engine step {step * 1e6:.1f} µs")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cases = []
        if args.case in ("a", "all"):
            cases.append(("a", azure_args(args.azure), 1.0))
        if args.case in ("b", "all"):
            trace = work / "synthetic.csv"
            synthetic_trace(trace, args.b_requests, args.rate)
            cases.append(("b", synthetic_args(trace), B_REQUESTS / args.b_requests))
        for name, cli_args, scale in cases:
            runs = [run_phases(cli_args, work / f"{name}{i}") for i in range(args.repeat)]
            best = {k: min(r[k] for r in runs) if k.endswith("_s") else runs[0][k] for k in runs[0]}
            report(name, best, start, step, scale)


if __name__ == "__main__":
    main()
