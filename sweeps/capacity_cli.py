"""`servelab capacity`: how much traffic each policy serves within its SLOs.

    servelab capacity --trace default --policies fcfs,priority,sjf,fair --num-requests 4000 --out DIR

For each policy (and each value of any other swept knob: --gpus, --chunk-sizes, ...), the
highest request rate at which at least --attainment of the requests meet their SLOs,
bracketed and bisected to --tolerance on the same seeded workload (`sweeps/capacity.py`).
It takes every `servelab compare` flag; --rates (or --rate) gives the rates to start from
(default: the trace's own mean rate). Then every policy is run at every capacity found, so
the report can show what each policy does at the others' limits.

DIR receives the probes and those runs under runs/ (the store `compare` uses: rerunning
skips what is done), capacity.json (the brackets, per group), sweep.json (the grid at the
capacities), and index.html / report.md opening with the answer. A run that fails (a probe,
or a run at the capacities) is named, on the terminal and in the report, and the exit
status is then 1; everything is still written from the runs that succeeded (a group whose
probe failed shows the bracket its other probes found, its capacity unknown), and
rerunning retries only what failed. Importing this module is cheap.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

from servelab.cli import CLIError
from servelab.options import fraction, number, positive_float
from servelab.progress import PointProgress
from servelab.sweeps.cli import (add_grid_arguments, check_sweep_out, drop_other_reports,
                                 grid_axes, note_another_search, plural, point_config)

_tolerance = number(float, low=0, high=1, low_open=True, high_open=True)
"""A relative width in (0, 1): --tolerance."""


def register(subparsers) -> None:
    from servelab.sweeps.capacity import DEFAULT_TOLERANCE

    p = subparsers.add_parser(
        "capacity", conflict_handler="resolve",   # add_grid_arguments redefines --replicas
        help="find the highest request rate each policy serves within its SLOs",
        description="For each policy (and any other swept knob), find the highest request rate at "
                    "which at least --attainment of the requests meet their SLOs, by bracketing "
                    "and bisection on the same seeded workload; then run every policy at every "
                    "capacity found, and write DIR/capacity.json, DIR/index.html and DIR/report.md. "
                    "Every `servelab compare` flag applies.")
    add_grid_arguments(p, rates_help=": rates to start the search from (default: the trace's own rate)")
    c = add_target_arguments(p, "capacity")
    c.add_argument("--tolerance", type=_tolerance, default=DEFAULT_TOLERANCE, metavar="F",
                   help="stop when the bracket (first broken rate / last held - 1) is at most F "
                        "(default %(default)s)")
    p.set_defaults(func=functools.partial(_cmd_capacity, parser=p), command_name="capacity")


def add_target_arguments(p: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """--attainment and the percentile targets (`reports.slo.SloTargets`): what a run must
    meet to hold, for `capacity` and `plan`. Returns the group, for the command's own flags."""
    from servelab.reports.slo import PERCENTILES, SLO_METRICS
    from servelab.sweeps.capacity import DEFAULT_ATTAINMENT

    c = p.add_argument_group(title)
    c.add_argument("--attainment", type=fraction, default=None, metavar="F",
                   help=f"share of requests that must meet their SLOs (default {DEFAULT_ATTAINMENT}; "
                        "not applied when a percentile target is given without it)")
    for percentile in PERCENTILES:
        for metric, name in SLO_METRICS:
            c.add_argument(f"--p{percentile}-{metric}-ms", type=positive_float, default=None, metavar="MS",
                           help=f"the run's p{percentile} {name} must be at most MS")
    c.add_argument("--percentile", type=int, choices=tuple(PERCENTILES), default=None,
                   help="read --slo-ttft-ms / --slo-tpot-ms as bounds on this percentile of the run "
                        "instead of per-request SLOs counted by --attainment")
    return c


def slo_targets(args: argparse.Namespace):
    """The `SloTargets` the flags of `add_target_arguments` ask for."""
    from servelab.reports.slo import PERCENTILES, SLO_METRICS, PercentileTarget, SloTargets
    from servelab.sweeps.capacity import DEFAULT_ATTAINMENT

    targets = [PercentileTarget(metric, percentile, limit)
               for percentile in PERCENTILES for metric, _ in SLO_METRICS
               if (limit := getattr(args, f"p{percentile}_{metric}_ms")) is not None]
    if args.percentile is not None:
        given = [(metric, getattr(args, f"slo_{metric}_ms")) for metric, _ in SLO_METRICS]
        if all(limit is None for _, limit in given):
            raise CLIError("--percentile reads --slo-ttft-ms / --slo-tpot-ms as percentile bounds: give one")
        for metric, limit in given:
            if limit is None:
                continue
            if any(t.metric == metric and t.percentile == args.percentile for t in targets):
                raise CLIError(f"--p{args.percentile}-{metric}-ms and --percentile {args.percentile} with "
                               f"--slo-{metric}-ms bound the same percentile: give one")
            targets.append(PercentileTarget(metric, args.percentile, limit))
    attainment = args.attainment if args.attainment is not None or targets else DEFAULT_ATTAINMENT
    return SloTargets(attainment, tuple(targets))


def _start_rates(args, parser, axes) -> list[float]:
    """--rates / --rate, else the trace's own mean rate (over the requests replayed)."""
    from servelab.simulator.cli import user_errors
    from servelab.simulator.run import load_workload

    given = [r for r in axes["rate"] if r is not None]
    if given:
        return given
    with user_errors():
        trace = load_workload(point_config(args, parser, {}))
    if not trace.mean_rate:
        raise CLIError("the trace has no arrival rate to start from: give --rate or --rates")
    return [float(f"{trace.mean_rate:.3g}")]


def check_slos(args, parser, targets, values: dict | None = None) -> None:
    """A search needs an SLO to miss: a percentile target, a global SLO, or the requests' own
    (read from the workload `point_config(args, parser, values)` builds)."""
    from servelab.simulator.cli import user_errors
    from servelab.simulator.run import load_workload

    if targets.percentiles or args.slo_ttft_ms is not None or args.slo_tpot_ms is not None:
        return
    with user_errors():
        trace = load_workload(point_config(args, parser, values or {}))
    if not any(r.slo_ttft_ms is not None or r.slo_tpot_ms is not None for r in trace.records):
        raise CLIError(f"a {args.command_name} needs an SLO to hold: give --slo-ttft-ms and/or "
                       "--slo-tpot-ms, or a percentile target such as --p99-ttft-ms (the trace's requests "
                       "carry no SLO of their own)")


def _cmd_capacity(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from servelab.reports.capacity_report import write_capacity_report
    from servelab.reports.slo import slo_attainment
    from servelab.sweeps.capacity import (CAPACITY_FILE, Search, search_capacity, steady_state_warning,
                                          write_capacity_file)
    from servelab.sweeps.runner import SweepRunner, default_workers
    from servelab.sweeps.sweep import SweepError, SweepPoint, write_sweep_file

    check_sweep_out(Path(args.out), "capacity", args.force)   # before any work

    axes = dict(grid_axes(args, parser))
    targets = slo_targets(args)
    check_slos(args, parser, targets)
    start = _start_rates(args, parser, axes)
    others = {axis: values for axis, values in axes.items() if axis != "rate"}
    searches = []
    for combo in itertools.product(*others.values()):
        values = dict(zip(others, combo))
        searches.append(Search(tuple(values.items()), functools.partial(_config_at, args, parser, values)))
    from servelab.sweeps.cli import check_points
    # bad flags, layouts and CPU tiers fail here, once, as one-line errors
    check_points([SweepPoint(s.build(start[0]), s.labels) for s in searches])
    out = Path(args.out)
    if args.force:
        drop_other_reports(out, "capacity")
    note_another_search(
        out, "capacity", CAPACITY_FILE, "capacity search",
        (str(targets), list(start), args.num_requests, [dict(s.labels) for s in searches]),
        lambda d: (d["criterion"], d["start_rates"], d["num_requests"], [g["labels"] for g in d["groups"]]))
    workers = args.workers or default_workers()
    print(f"capacity: {plural(len(searches), 'search', 'es')} from {', '.join(f'{r:g}' for r in start)} "
          f"req/s to {targets}, within {args.tolerance:.0%}, "
          f"{plural(workers, 'worker')}, into {out}", file=sys.stderr)
    progress = PointProgress(command="capacity",
                             detail=lambda o: f" ({slo_attainment(o.summary):.1%} within SLO)")
    try:
        with SweepRunner(out, workers=workers, ray=args.ray, ray_address=args.ray_address,
                         output_format=args.output_format) as runner:
            found = search_capacity(searches, runner, start_rates=start, target=targets.attainment,
                                    percentiles=targets.percentiles, tolerance=args.tolerance, progress=progress,
                                    on_round=lambda k, n: setattr(progress, "prefix", f"round {k} "))
            rates = sorted({c.rate for c in found if c.rate is not None}) or [min(start)]
            grid = {**others, "rate": tuple(rates)}
            points = [SweepPoint(s.build(rate), (*s.labels, ("rate", rate))) for s in searches for rate in rates]
            progress.prefix = "at the capacities "
            failed_runs = [o for o in runner.run(points, progress) if o.status == "failed"]
            write_sweep_file(out, points, grid)
            warnings = {i: steady_state_warning(c, runner.runs_dir) for i, c in enumerate(found)}
            thin = {i: _thin_run(c, runner.runs_dir, args.num_requests) for i, c in enumerate(found)}
            write_capacity_file(out, found, warnings, start_rates=start,
                                num_requests=args.num_requests, percentiles=targets.percentiles)
    except SweepError as exc:
        raise CLIError(str(exc)) from None
    except OSError as exc:
        raise CLIError(f"cannot write the sweep directory {out}: {exc}") from None
    for i, c in enumerate(found):
        print(_describe(c))
        for note in c.notes:
            print(f"  note: {note}")
        if warnings[i]:
            print(f"  not steady: {warnings[i]}: an upper bound (a larger --num-requests tells)")
        if thin[i]:
            print(f"  few requests: {thin[i]}")
    for o in failed_runs:
        print(f"at the capacities: {o.point.describe()}: failed: {o.error}")
    if any(p.attainment is not None for c in found for p in c.probes):
        report = write_capacity_report(out)
        print(f"report: {report.html.resolve()}\n        {report.markdown.resolve()}")
    else:
        print(f"no report: every probe failed (capacity.json in {out.resolve()} lists them)")
    return 1 if failed_runs or any(c.status == "failed" for c in found) else 0


def _thin_run(capacity, runs_dir: Path, asked: int | None) -> str | None:
    """Say so when the run at a capacity held fewer than half the requests asked for: at a
    low rate a timed trace ends first (the default workload's 600 s hold 19 requests at
    0.036 req/s), and a capacity from a handful of requests is a rough one."""
    from servelab.reports.runio import read_json

    if capacity.held is None or not asked:
        return None
    summary = read_json(runs_dir / capacity.held.name / "summary.json")
    held = summary["completed"] + summary["rejected"]
    if held >= asked / 2:
        return None
    return (f"its run held {held} of the {asked:,} requests asked (the trace ends first at "
            f"{capacity.held.rate:.4g} req/s): a rough figure; a longer trace (or --rate on a "
            "length-only one) tells")


def _config_at(args, parser, values: dict, rate: float):
    return point_config(args, parser, {**values, "rate": rate})


def _describe(c) -> str:
    who = ", ".join(f"{v}" if a == "policy" else f"{a}={v}" for a, v in c.labels.items())
    if c.status == "failed":
        failed = "; ".join(f"at {p.rate:g} req/s: {p.error}" for p in c.failed)
        found = [f"{p.rate:g} req/s {'held' if p is c.held else 'broke'} ({p.attainment:.1%} within SLO)"
                 for p in (c.held, c.broke) if p is not None]
        return (f"{who}: capacity unknown, a run failed {failed}"
                + (f"; of the runs that succeeded, {', '.join(found)}" if found else ""))
    if c.status == "holds":
        return (f"{who}: held at every rate tried, up to {c.held.rate:g} req/s "
                f"({c.held.attainment:.1%} within SLO): the capacity is higher")
    if c.status == "breaks":
        return (f"{who}: broke at every rate tried, down to {c.broke.rate:g} req/s "
                f"({'; '.join(c.broke.misses)})")
    return (f"{who}: {c.held.rate:g} req/s ({c.held.attainment:.1%} within SLO; {c.broke.rate:g} req/s "
            f"broke: {'; '.join(c.broke.misses)}; bracket {c.width:.1%})"
            + ("" if c.status == "found" else " - not narrowed to the tolerance"))
