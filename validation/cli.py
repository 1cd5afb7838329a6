"""`servelab validate`: the cost model against real runs, per step and end to end.

    servelab validate --run runs/real-fcfs --out runs/val                 # default model's error
    servelab validate --run runs/real-fcfs --fit --out runs/val           # calibrate, held-out error
    servelab validate --run runs/real-fcfs --run runs/real-sjf --fit --simulate --out runs/val
    servelab validate --real-requests ../shared/real-runs/llmservingsim-vllm-0.19/*/* \
        --out docs/real-runs.md                                          # whole vLLM runs

With --run, OUT gets validation.json (every figure), calibration.json (with --fit: a
profile that `servelab simulate --calibration` and `compare --calibration` load), three
plots, and with --simulate a replay run directory per real run. A CPU run's peaks are
probed on this machine (`--probe`, on by default for CPU runs): validate on the machine
that ran them.

--real-requests takes recorded runs of vLLM itself (per-request timestamps, no step
records: `validation/real_runs.py`) and replays each through the simulator with the
engine's own config; OUT is then a Markdown report with its figures in a folder beside
it. It lives here, not in a command of its own, because it answers the same question —
how far the simulator is from real runs — and shares --out and --calibration; the
options that read step records (--fit and the rest) are refused with it.

Importing this module is cheap; the handler imports numpy, torch and the simulator.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from servelab.cli import CLIError
from servelab.options import non_negative_int, number, positive_float


_fraction = number(float, low=0, high=1, low_open=True, high_open=True)
"""--train-fraction: the share of steps the fit trains on, in (0, 1)."""

_STEP_RECORD_OPTIONS = {"fit": False, "train_fraction": 0.5, "split_seed": 0,
                        "loss": "l1", "simulate": False, "probe": None,
                        "max_mape": 15.0, "max_total_error": 10.0, "strict": False}
"""Options that read a servelab run's step records, with their defaults: given another
value with --real-requests, they are refused."""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "validate", help="per-step and end-to-end error of the cost model against real runs",
        description="Predict every step of real runs (servelab run) with the cost model and "
                    "report the error; --fit calibrates the model on a training split and "
                    "reports held-out error; --simulate replays the runs' requests through the "
                    "simulator and compares request-level metrics and policy rankings.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", action="append", metavar="DIR",
                        help="a real run directory (servelab run); repeat for several runs of "
                             "one setup (e.g. the same trace under different policies)")
    source.add_argument("--real-requests", nargs="+", metavar="RUN_DIR",
                        help="recorded vLLM runs (vllm_requests.jsonl + vllm_meta.json each): "
                             "replay their requests with the engine's config and compare "
                             "TTFT, TPOT and E2E per request; --out names the report (FILE.md)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="where to write the results (with --real-requests: FILE.md)")
    p.add_argument("--gpu", metavar="G",
                   help="catalog GPU to price with (default: mapped from the run's device)")
    p.add_argument("--calibration", metavar="FILE",
                   help="profile to evaluate, or to start --fit from (default: the device's "
                        "packaged profile, fitted to measured kernel times)")
    p.add_argument("--fit", action="store_true",
                   help="fit per-class scales and step overhead on a training split; report held-out "
                        "error and write OUT/calibration.json")
    p.add_argument("--train-fraction", type=_fraction, metavar="F",
                   default=_STEP_RECORD_OPTIONS["train_fraction"],
                   help="share of steps to fit on (default %(default)s)")
    p.add_argument("--split-seed", type=non_negative_int, metavar="N",
                   default=_STEP_RECORD_OPTIONS["split_seed"],
                   help="seed of the train/held-out permutation (default %(default)s)")
    p.add_argument("--loss", choices=("l1", "l2"), default=_STEP_RECORD_OPTIONS["loss"],
                   help="what --fit minimises over relative step errors: l1 = mean absolute "
                        "(the MAPE reported; robust to steps slowed by a busy host), l2 = mean "
                        "square (default %(default)s)")
    p.add_argument("--simulate", action="store_true",
                   help="replay each run's requests in the simulator with the calibration and "
                        "compare TTFT/TPOT/E2E percentiles, throughput and policy rankings")
    p.add_argument("--probe", action=argparse.BooleanOptionalAction,
                   default=_STEP_RECORD_OPTIONS["probe"],
                   help="measure this CPU's matmul rate and copy bandwidth as the cpu entry's "
                        "peaks (default: on for CPU runs)")
    p.add_argument("--force", action="store_true",
                   help="write into an --out that holds something else (another command's "
                        "files, another report)")
    p.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True,
                   help="write the error plots (default: on)")
    p.add_argument("--max-mape", type=positive_float, metavar="PCT",
                   default=_STEP_RECORD_OPTIONS["max_mape"],
                   help="warn above this step MAPE (held-out with --fit) (default %(default)s)")
    p.add_argument("--max-total-error", type=positive_float, metavar="PCT",
                   default=_STEP_RECORD_OPTIONS["max_total_error"],
                   help="warn when summed step time, or a replay's throughput, is off by more "
                        "(default %(default)s)")
    p.add_argument("--strict", action="store_true",
                   help="exit with status 1 when any warning is raised")
    p.set_defaults(func=_cmd_validate)


def _cmd_real_requests(args: argparse.Namespace) -> int:
    import shlex
    import sys

    from servelab.validation.real_runs_report import write_report

    given = [f"--{name.replace('_', '-')}" for name, default in _STEP_RECORD_OPTIONS.items()
             if getattr(args, name) != default]
    if given:
        raise CLIError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to --run "
                       "(servelab run directories), not to --real-requests")
    calibration = ["--calibration", shlex.quote(args.calibration)] if args.calibration else []
    gpu = ["--gpu", shlex.quote(args.gpu)] if args.gpu else []
    command = " ".join(["servelab validate --real-requests",
                        *map(shlex.quote, args.real_requests), *calibration, *gpu,
                        "--out", shlex.quote(args.out)])
    try:
        write_report(args.real_requests, args.out, command, calibration=args.calibration,
                     plots=args.plots, progress=lambda line: print(line, file=sys.stderr),
                     gpu=args.gpu, force=args.force)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    print(f"-> {args.out}")
    return 0


VALIDATE_MARKER = "validation.json"
"""What every `validate --run` report directory holds."""


def check_validate_out(out: Path, runs: list[Path], force: bool) -> None:
    """ValueError (one line) when `out` is one of the runs validated, or holds files but no
    earlier report (`VALIDATE_MARKER`) and `force` is off: the report would mix with them."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if any(out.resolve() == run.resolve() for run in runs):
        raise ValueError(f"--out {out} is a run being validated: give the report its own "
                         f"directory")
    if force or not out.is_dir():
        return
    names = sorted(entry.name for entry in out.iterdir())
    if names and VALIDATE_MARKER not in names:
        what = "a `servelab simulate` or `servelab run` directory" if "config.json" in names \
            else f"files that are not a validate report's ({', '.join(names[:3])}" \
                 f"{', ...' if len(names) > 3 else ''})"
        raise ValueError(f"--out {out} holds {what}: use another --out, or --force to write "
                         f"the report into it")


def _cmd_validate(args: argparse.Namespace) -> int:
    if args.real_requests:
        return _cmd_real_requests(args)
    from servelab.validation.validate import (ValidateOptions, catalog_gpu, load_real_run,
                                             validate)

    if not args.fit:
        given = [f"--{name.replace('_', '-')}" for name in ("train_fraction", "split_seed", "loss")
                 if getattr(args, name) != _STEP_RECORD_OPTIONS[name]]
        if given:
            raise CLIError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to "
                           "--fit, which was not given")
    folders = [Path(path).resolve() for path in args.run]
    twice = next((f for f in folders if folders.count(f) > 1), None)
    if twice is not None:
        raise CLIError(f"--run {twice} is given twice: its steps would sit on both sides of "
                       f"the held-out split")
    try:
        runs = [load_real_run(path) for path in args.run]
        gpu = args.gpu or catalog_gpu(runs[0].device, runs[0].device_name)
        check_validate_out(Path(args.out), [Path(path) for path in args.run], args.force)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    overrides: dict[str, float] = {}
    probe = args.probe if args.probe is not None else gpu == "cpu"
    if probe:
        if gpu != "cpu":
            raise CLIError(f"--probe measures this CPU; the runs are priced on {gpu}")
        from servelab.validation.probe import probe_cpu

        measured = probe_cpu(dtype=runs[0].derived["dtype"])
        overrides = measured.gpu_overrides()
        print(f"cpu probe: {measured.matmul_flops_per_s / 1e9:.1f} GFLOP/s {measured.dtype} "
              f"matmul, {measured.copy_bytes_per_s / 1e9:.1f} GB/s copy "
              f"({measured.library}, {measured.threads} threads)")
    try:
        options = ValidateOptions(gpu=gpu, gpu_overrides=overrides, calibration=args.calibration,
                                  fit=args.fit, train_fraction=args.train_fraction,
                                  split_seed=args.split_seed, loss=args.loss,
                                  simulate=args.simulate, plots=args.plots,
                                  max_mape_pct=args.max_mape,
                                  max_total_error_pct=args.max_total_error)
        report = validate(runs, options, args.out)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    print(format_report(report, args.out))
    return 1 if args.strict and report["verdict"]["warnings"] else 0


def _errors(e: dict) -> str:
    return (f"MAPE {e['mape_pct']:.1f}%, median APE {e['median_ape_pct']:.1f}%, "
            f"p90 {e['p90_ape_pct']:.1f}%, bias {e['bias_pct']:+.1f}% ({e['steps']} steps)")


def format_report(report: dict, out: str) -> str:
    """The lines the command prints: the figures people read first, then where the rest is."""
    from servelab.validation.fit import MIN_SCALE

    s = report["setup"]
    lines = [f"{report['steps']} steps of {len(report['runs'])} run(s): {s['model']} on "
             f"{s['gpu']} ({s['dtype']}, tp {s['tp']})"]
    if "fit" in report:
        f = report["fit"]
        start = "starting" if s["calibration"] else "default"
        lines += [f"fit on {f['train_steps']} steps",
                  f"  held-out:  {_errors(report['held_out']['overall'])}",
                  f"  train:     {_errors(report['train']['overall'])}",
                  f"  {start + ' model,':<10} held-out: "
                  f"{_errors(report[f'{start}_held_out']['overall'])}"]
        for kind, e in report["held_out"]["by_step_type"].items():
            lines.append(f"  held-out {kind:<8} {_errors(e)}")
        for name, why in f["unidentified"].items():
            lines.append(f"  not identified, kept at its start: {name} ({why})")
        if f["at_bound"]:
            lines.append(f"  at its bound (no overhead, or a scale of {MIN_SCALE}): "
                         f"{', '.join(f['at_bound'])}")
        if "profile_path" in f:
            lines.append(f"calibration profile -> {f['profile_path']}")
    else:
        key = "starting" if s["calibration"] else "default"
        lines.append(f"{key} model: {_errors(report[key]['overall'])}")
        for kind, e in report[key]["by_step_type"].items():
            lines.append(f"  {kind:<8} {_errors(e)}")
    if len(report["per_run"]) > 1:
        for path, e in report["per_run"].items():
            lines.append(f"  run {path}: MAPE {e['mape_pct']:.1f}%, bias {e['bias_pct']:+.1f}% "
                         f"({e['steps']} steps)")
    sim = report.get("simulate")
    if sim:
        for label, r in sim["runs"].items():
            m = r["metrics"]
            parts = [f"{k.removesuffix('_ms')} {m[k]['real']:.1f}/{m[k]['sim']:.1f}"
                     for k in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_e2el_ms")]
            lines.append(f"replay {label} (real/sim ms): {', '.join(parts)}; output tok/s "
                         f"{m['output_throughput']['real']:.1f}/{m['output_throughput']['sim']:.1f}")
            lines += [f"  note: {n}" for n in r["notes"]]
        if "ranking" in sim:
            tau = sim["ranking"]["mean_kendall_tau_b"]
            lines.append("policy ranking agreement, mean Kendall tau-b over metrics: "
                         + ("undefined" if tau is None else f"{tau:+.2f}"))
    v = report["verdict"]
    judged = "held-out" if v["steps_judged"] == "held_out" else "all"
    summary = (f"summary: {judged} step MAPE {v['step_mape_pct']:.1f}%, total step time "
               f"{v['total_time_error_pct']:+.1f}%")
    if "replay_throughput_error_pct" in v:
        summary += ", replay output throughput " + ", ".join(
            f"{label} {err:+.1f}%" for label, err in v["replay_throughput_error_pct"].items())
    lines.append(summary)
    lines += [f"WARNING: {w}" for w in v["warnings"]]
    lines.append(f"-> {out}/validation.json")
    return "\n".join(lines)
