"""Repeat the procedure of tests/test_validate_cpu_replay.py and print the spread of its
figures (not a test): the bounds of that test are set from this script's output.

Each round serves the test's burst trace with the real CPU backend under fcfs, sjf and
priority, fits the cost model on the fcfs run (`validate --fit`) and replays the three
runs with that profile (`validate --calibration ... --simulate`), exactly as the test does.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/validate_cpu_rounds.py --rounds 30 [--jsonl F]

One line per round, then for each metric the median / p90 / max of the replay's |error|,
raw and with each run's own step-time error taken out (the test's `on_model_clock`), how
often the real and the simulated rankings on median TTFT and median E2E were sjf < fcfs <
priority, and the spread of the held-out step MAPE and of the mean Kendall tau-b. About
5 s a round on a quiet 2-core machine.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import test_validate_cpu_replay as t  # noqa: E402
from servelab.validation.replay import METRICS  # noqa: E402


def one_round(root: Path) -> dict:
    dirs = t.serve(root)
    with contextlib.redirect_stdout(io.StringIO()):
        fit, report = t.fit_and_replay(root, dirs)
    sim = report["simulate"]
    row = {"load": os.getloadavg()[0],
           "held_out_mape": fit["held_out"]["overall"]["mape_pct"],
           "uncalibrated_mape": fit["default_held_out"]["overall"]["mape_pct"],
           "mean_tau": sim["ranking"]["mean_kendall_tau_b"],
           "tau": {m: r["kendall_tau_b"] for m, r in sim["ranking"]["metrics"].items()},
           "runs": {}}
    for policy, run in sim["runs"].items():
        row["runs"][policy] = {
            "total_time_error_pct": report["per_run"][run["run"]]["total_time_error_pct"],
            "raw": {m: run["metrics"][m]["error_pct"] for m in METRICS},
            "schedule": {m: (run["metrics"][m]["sim"] / t.on_model_clock(report, policy, m) - 1)
                         * 100 for m in METRICS},
            "real": {m: run["metrics"][m]["real"] for m in METRICS},
            "model_clock": {m: t.on_model_clock(report, policy, m) for m in METRICS},
            "sim": {m: run["metrics"][m]["sim"] for m in METRICS}}
    return row


def spread(values) -> str:
    a = np.abs(np.asarray(values, float))
    return f"{np.median(a):6.1f} {np.percentile(a, 90):6.1f} {a.max():6.1f}"


def ordered(row: dict, side: str, metric: str) -> bool:
    values = {p: r[side][metric] for p, r in row["runs"].items()}
    return sorted(values, key=values.get) == t.EXPECTED_ORDER


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--jsonl", help="append each round's figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="validate-rounds-") as tmp:
        for i in range(args.rounds):
            row = one_round(Path(tmp) / str(i))
            rows.append(row)
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps(row) + "\n")
            runs = " ".join(f"{p} {r['total_time_error_pct']:+4.0f}%" for p, r in row["runs"].items())
            print(f"round {i:2d} load {row['load']:.1f}: held-out MAPE {row['held_out_mape']:5.1f}%, "
                  f"per-run step-time error {runs}, mean tau-b {row['mean_tau']:+.2f}", flush=True)
    n = len(rows)
    print(f"\n{n} rounds; |error| of the replay, median / p90 / max (%)")
    print(f"{'metric':20s} {'raw':>20s}   {'own step error out':>20s}")
    for m in METRICS:
        raw = [r["raw"][m] for row in rows for r in row["runs"].values()]
        sched = [r["schedule"][m] for row in rows for r in row["runs"].values()]
        print(f"{m:20s} {spread(raw):>20s}   {spread(sched):>20s}")
    steps = [r["total_time_error_pct"] for row in rows for r in row["runs"].values()]
    print(f"per-run step-time error |%|: {spread(steps)}")
    for m in t.SEPARATED:
        print(f"{m}: sjf < fcfs < priority in the simulator {sum(ordered(r, 'sim', m) for r in rows)}"
              f"/{n}, real {sum(ordered(r, 'real', m) for r in rows)}/{n}, real on the model's "
              f"clock {sum(ordered(r, 'model_clock', m) for r in rows)}/{n}")
    held = [r["held_out_mape"] for r in rows]
    ratio = [r["held_out_mape"] / r["uncalibrated_mape"] for r in rows]
    taus = [r["mean_tau"] for r in rows if r["mean_tau"] is not None]
    print(f"held-out step MAPE {min(held):.1f}-{max(held):.1f}% (median {np.median(held):.1f}%), "
          f"at most {max(ratio):.2f}x the uncalibrated model's")
    print(f"mean Kendall tau-b over the {len(METRICS)} metrics {min(taus):+.2f} to {max(taus):+.2f} "
          f"(median {np.median(taus):+.2f})")


if __name__ == "__main__":
    main()
