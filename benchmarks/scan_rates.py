"""Scan request rates on the code traces with `servelab simulate` (a check, not a test).

Rescaled arrival times are arbitrary floats, and a run once failed after simulating at some
rates only (a request scheduled one ulp before its arrival). This replays every rate of
the scan on the whole trace, each in a fresh process through the real command line, and
counts the runs that exit 0 and write their records (config.json, summary.json,
requests.csv, steps.csv):

    azure-code-2023 and splitwise-code, one replica at 1.0 ... 2.4 req/s (step 0.05) and
    five replicas at 8 ... 11 req/s (step 0.5); --rate-scale 3 on one and on five replicas.

    .venv/bin/python benchmarks/scan_rates.py [--trace-dir ../shared/traces] [--jobs 2]
        [--num-requests N] [--keep DIR]

Exit status 1 if any run failed; each failure is listed with the last line it printed.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVELAB = Path(sys.executable).with_name("servelab")
TRACES = ("azure-code-2023", "splitwise-code")
SCANS = (   # (label, replicas, extra flags per run)
    *((f"1 replica, {r:g} req/s", 1, ("--rate", f"{r:g}")) for r in (round(1.0 + 0.05 * i, 2) for i in range(29))),
    *((f"5 replicas, {r:g} req/s", 5, ("--rate", f"{r:g}")) for r in (8.0 + 0.5 * i for i in range(7))),
    ("1 replica, --rate-scale 3", 1, ("--rate-scale", "3")),
    ("5 replicas, --rate-scale 3", 5, ("--rate-scale", "3")),
)
RECORDS = ("config.json", "summary.json", "requests.csv", "steps.csv")


def run_one(trace: str, replicas: int, flags: tuple[str, ...], out: Path, args) -> str | None:
    """Run one `servelab simulate`; None if it exited 0 and wrote every file, else why not."""
    command = [str(SERVELAB), "simulate", "--trace", trace, "--trace-dir", str(args.trace_dir),
               "--no-download", "--replicas", str(replicas), *flags, "--out", str(out)]
    if args.num_requests:
        command += ["--num-requests", str(args.num_requests)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    missing = [name for name in RECORDS if not (out / name).is_file()]
    if done.returncode == 0 and not missing:
        return None
    last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
    return f"exit {done.returncode}, missing {missing or 'nothing'}: {last}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace-dir", type=Path, default=REPO.parent / "shared" / "traces")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (default %(default)s)")
    parser.add_argument("--num-requests", type=int, help="replay only the first N requests of each trace")
    parser.add_argument("--keep", type=Path, help="write the run directories here (default: a temporary one)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        cases = [(trace, label, replicas, flags, root / trace / f"{i:02d}")
                 for trace in TRACES for i, (label, replicas, flags) in enumerate(SCANS)]
        start = time.perf_counter()
        with ThreadPoolExecutor(args.jobs) as pool:   # each run is its own process
            results = list(pool.map(lambda c: run_one(c[0], c[2], c[3], c[4], args), cases))
        wall = time.perf_counter() - start
    failures = [(trace, label, why) for (trace, label, *_), why in zip(cases, results) if why]
    for trace in TRACES:
        for what, replicas, flag in (("1 replica, rates", 1, "--rate"), ("5 replicas, rates", 5, "--rate"),
                                     ("--rate-scale 3", None, "--rate-scale")):
            mine = [why for (t, _, r, flags, _), why in zip(cases, results)
                    if t == trace and flags[0] == flag and replicas in (None, r)]
            ok = sum(why is None for why in mine)
            print(f"{trace:16} {what:18} {ok:3d} of {len(mine):3d} exit 0 with their records")
    for trace, label, why in failures:
        print(f"FAILED {trace}, {label}: {why}")
    print(f"{len(cases) - len(failures)} of {len(cases)} runs passed in {wall:.0f} s wall "
          f"({args.jobs} at once, {'whole traces' if not args.num_requests else f'{args.num_requests} requests each'})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
