"""Time `load_trace` on real files: best of N wall-clock and CPU times, and rows per second.

    python -m servelab.traces.benchmark PATH [PATH ...] [--repeat 7] [--rate 5]

The budget it checks against: the simulator replays azure-conv-2023 end to end in 1.5 s,
loading included, so loading that file must take well under 0.3 s. CPU time is reported
beside wall time because shared machines inflate the latter.
"""
from __future__ import annotations

import argparse
import time

from servelab.traces.loaders import load_trace


def time_load(path: str, repeat: int, rate: float | None = None) -> tuple[int, float, float]:
    """(rows, best wall seconds, best CPU seconds) over `repeat` loads."""
    best_wall = best_cpu = float("inf")
    rows = 0
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        rows = len(load_trace(path, rate=rate))
        best_wall = min(best_wall, time.perf_counter() - w0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    return rows, best_wall, best_cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", metavar="PATH")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--rate", type=float, help="for length-only tables")
    args = parser.parse_args(argv)
    for path in args.paths:
        rows, wall, cpu = time_load(path, args.repeat, args.rate)
        print(f"{path}: {rows} rows  best wall {wall * 1e3:.1f} ms  best CPU {cpu * 1e3:.1f} ms  "
              f"({rows / wall / 1e3:.0f}k rows/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
