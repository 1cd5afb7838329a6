"""`servelab calibrate`: fit the kernel models to measured GPU kernel times.

    servelab calibrate --from-measurements ../shared/gpu-measurements --gpu h100-sxm \\
        --engine-version 0.14.0 \\
        --drop-bad-rows --out h100-sxm.json

Reads every recognised table for the GPU under the folders given (aiconfigurator Parquet,
Vidur CSV; see `measurements.py`), fits each kernel family on a seeded part of its points
and prints the held-out error per family and size band. The profile written records its
sources, the split and the figures; `servelab simulate --calibration FILE` and
`servelab cost --calibration FILE` use it.

Importing this module is cheap; the handler imports numpy, scipy and pyarrow.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from servelab.cli import CLIError
from servelab.options import non_negative_int, number, positive_int


_holdout = number(float, low=0, high=1, high_open=True)
"""--holdout: the share of rows held out of the fit, in [0, 1)."""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate", help="fit the cost model's kernel parameters to measured kernel times",
        description="Fit every kernel family (GEMM, prefill and decode attention, all-reduce, "
                    "element-wise) to measured latencies of one GPU and write a calibration "
                    "profile. Error is reported on points held out from the fit.")
    p.add_argument("--from-measurements", action="append", required=True, metavar="DIR",
                   help="folder searched for measurement tables (aiconfigurator *_perf.parquet, "
                        "Vidur *.mlp.csv and *.all_reduce.csv); repeatable")
    p.add_argument("--gpu", required=True, metavar="G", help="catalog GPU the tables measure")
    p.add_argument("--engine-version", metavar="V",
                   help="fit only the aiconfigurator tables measured inside this engine version "
                        "(e.g. 0.14.0, what the packaged profiles use); needed when the folders "
                        "hold tables of several versions for the GPU, which are never pooled")
    p.add_argument("--out", required=True, metavar="FILE", help="profile to write (JSON)")
    p.add_argument("--drop-bad-rows", action="store_true",
                   help="drop unusable rows and merge repeated measurements into their median, "
                        "with counts (default: stop at the first, naming file and row)")
    p.add_argument("--holdout", type=_holdout, default=0.3, metavar="F",
                   help="share of each table's points held out from the fit (default %(default)s)")
    p.add_argument("--seed", type=non_negative_int, default=0, metavar="N",
                   help="seed of the held-out split (default %(default)s)")
    p.add_argument("--fallback", metavar="PROFILE",
                   help="profile (file or packaged name) to take kernel families without "
                        "measurements from, e.g. an element-wise fit of a same-era GPU")
    p.add_argument("--max-points", type=positive_int, metavar="N",
                   help="fit each family on a seeded sample of at most N training points (a "
                        "quick look; held-out error still uses every held-out point)")
    p.add_argument("--data-version", default="", metavar="TEXT",
                   help="what the measurements are, for the profile's provenance (e.g. the "
                        "projects' commits: 'aiconfigurator 095f58a51, vidur 7d47513')")
    p.add_argument("--json", action="store_true", help="print the fit report as JSON")
    p.set_defaults(func=_cmd_calibrate)

    f = subparsers.add_parser(
        "fidelity", help="report the cost model's error on held-out measured kernel times",
        description="Judge each packaged calibration profile (and the bare roofline) on the "
                    "measurements its fit held out, inside the engine version it was fitted "
                    "to, per kernel family and size band, plus "
                    "checks on data no fit saw; write Markdown and plots.")
    f.add_argument("--measurements", action="append", required=True, metavar="DIR",
                   help="folder of measurement tables (as for calibrate); repeatable")
    f.add_argument("--out", required=True, metavar="FILE.md",
                   help="report to write (the packaged one is docs/fidelity.md); plots go to "
                        "a folder named after it")
    f.add_argument("--gpu", action="append", metavar="G",
                   help="only this GPU's packaged profiles (repeatable; default: all)")
    f.add_argument("--engine-version", action="append", metavar="V",
                   help="only the packaged profiles fitted inside this engine version, e.g. "
                        "0.24.0 (repeatable; default: all)")
    f.set_defaults(func=_cmd_fidelity)


def _cmd_fidelity(args: argparse.Namespace) -> int:
    from servelab.validation.fidelity import write_report

    try:
        command = " ".join(["servelab fidelity", *(f"--measurements {m}" for m in args.measurements),
                            *(f"--gpu {g}" for g in args.gpu or ()),
                            *(f"--engine-version {v}" for v in args.engine_version or ()),
                            f"--out {args.out}"])
        path = write_report(args.measurements, args.out, args.gpu,
                            progress=lambda line: print(line, file=sys.stderr), command=command,
                            engine_versions=args.engine_version)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    print(f"wrote {path}")
    return 0


def _check_out_is_not_an_input(out: Path, args: argparse.Namespace) -> None:
    """Refuse an --out that would replace what the fit reads: the GPU file, or a table in
    a measurement folder (the profile is JSON, whatever the name says)."""
    from servelab.validation.measurements import TABLE_SUFFIXES

    where = out.resolve()
    if str(args.gpu).endswith(".json") and where == Path(args.gpu).resolve():
        raise CLIError(f"--out {out} is the GPU file --gpu reads: write the profile beside it "
                       f"(e.g. {out.with_suffix('.profile.json')})")
    if out.suffix.lower() in TABLE_SUFFIXES and any(
            where.is_relative_to(Path(folder).resolve()) for folder in args.from_measurements):
        raise CLIError(f"--out {out} would be a table among the measurements --from-measurements "
                       "reads: write the profile (JSON) elsewhere")


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from servelab.simulator.calibration import load_profile
    from servelab.simulator.gpus import get_gpu
    from servelab.validation.kernel_fit import calibrate
    from servelab.validation.measurements import load_measurements

    out = Path(args.out)
    if out.is_dir():
        raise CLIError(f"--out {out} is a folder: name the profile file to write (e.g. {out / 'my-gpu.json'})")
    _check_out_is_not_an_input(out, args)
    try:   # before the fit, which takes minutes: a folder that cannot be made fails now
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CLIError(f"cannot make the folder of --out {out}: {exc.strerror or exc}") from None
    try:
        gpu = get_gpu(args.gpu)
        fallback = load_profile(args.fallback) if args.fallback else None
        ms = load_measurements(args.from_measurements, gpu, drop_bad_rows=args.drop_bad_rows,
                               engine_version=args.engine_version)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if ms.dropped:
        print("dropped: " + ", ".join(f"{n} {why}" for why, n in sorted(ms.dropped.items())),
              file=sys.stderr)
    if ms.unread:
        print(f"not read (no kernel family reads them): {', '.join(ms.unread)}", file=sys.stderr)
    try:
        result = calibrate(ms, seed=args.seed, holdout=args.holdout, fallback=fallback,
                           data_version=args.data_version, max_points=args.max_points,
                           progress=lambda line: print(line, file=sys.stderr), gpu=gpu)
    except ValueError as exc:   # e.g. a family left too few points to fit: nothing written
        raise CLIError(str(exc)) from None
    try:
        path = result.profile.save(out)
    except OSError as exc:
        raise CLIError(f"cannot write the profile to {out}: {exc.strerror or exc}") from None
    if args.json:
        print(json.dumps({name: {"params": fit.params.to_dict(), "stats": fit.stats,
                                 "stats_without_glitches": fit.clean_stats,
                                 "glitch_rows": fit.glitch_rows}
                          for name, fit in result.families.items()}, indent=2))
    else:
        print(f"{gpu.name}: fitted on {1 - args.holdout:.0%} of each table, error on the "
              f"held-out {args.holdout:.0%}")
        for name, fit in result.families.items():
            print(f"  {name:<13} {fit.rows + fit.heldout_rows:>6} points  held-out "
                  f"{_fmt(fit.stats['heldout'])}")
            if fit.glitch_rows:
                print(f"  {'':<13} {fit.glitch_rows:>6} glitches (slower than a larger problem; "
                      f"not fitted)  held-out without them {_fmt(fit.clean_stats['heldout'])}")
            for label, stats in fit.stats.items():
                if label not in ("train", "heldout"):
                    print(f"      {label:<28} {_fmt(stats)}")
        for key, value in result.profile.source.items():
            if key.startswith("kernels.") and not value.startswith(("aiconfigurator", "Vidur")):
                print(f"  {key[len('kernels.'):]:<13} {value}")
    print(f"wrote {path}")
    return 0


def _fmt(stats: dict) -> str:
    if not stats.get("n"):
        return "no points"
    return (f"MAPE {stats['mape_pct']:5.1f}%  median {stats['median_pct']:+5.1f}%  "
            f"worst {stats['worst_pct']:+6.1f}%  (n={stats['n']})")
