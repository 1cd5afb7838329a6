"""`servelab compare`: run a grid of simulations and write a comparison report.

    servelab compare --trace T --policies fcfs,priority,sjf,fair --rates 12,15.2,16.6 --out DIR

Every `servelab simulate` flag is accepted and applies to every point. The list flags
sweep: --policies, --rates (mean request rate, req/s: the trace's arrivals are rescaled to
it), --block-sizes, --chunk-sizes (tokens, budget or off), --preemptions, --block-managers,
--gpus, --models, --tps, --engines, --routers; and --replicas, --pp, --speculative and
--num-speculative-tokens take a list too (--replicas 3,4,5; --speculative off,draft:llama-3.1-8b),
and so do a disaggregated run's --prefill-replicas and --decode-replicas (--prefill-replicas 1,2).
Each point's config is built from the flags exactly as `servelab simulate` builds it (its run directory's config.json reruns it), and a policy flag such as
--sjf-predictor applies to that policy's points only.

DIR receives runs/<point>/ (the simulate layout, see `sweeps/sweep.py`), sweep.json,
index.html (self-contained) and report.md with figures/. Rerunning the command skips the
points already done, so an interrupted sweep resumes. Importing this module is cheap.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any, Callable

from servelab.cli import CLIError
from servelab.labels import show_value
from servelab.options import chunk_tokens, positive_float, positive_int
from servelab.progress import PointProgress
from servelab.simulator.cli import policy_flag_owners

DEFAULT_POLICIES = ("fcfs", "priority", "sjf", "fair")


def _one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}, got {text!r}")
        return text
    return parse


_CHOICES = None
"""SWEEP_FLAGS' item parser for a flag of names: one of the `choices` its single flag
offers (the block managers, preemption modes, routers and engines `simulate` registers),
read from that flag when the list flag is added, so the two accept the same names and
sweeps/ needs no registry of memory/ or policies/ (DESIGN.md's import table)."""


def _name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a name, got an empty item")
    return text.strip()


#: (list flag, the sweep axis = the simulate flag's dest, the simulate flag, item parser or
#: _CHOICES, metavar)
SWEEP_FLAGS: tuple[tuple[str, str, str, Callable[[str], Any] | None, str], ...] = (
    ("--policies", "policy", "--policy", _name, "P,P,..."),
    ("--rates", "rate", "--rate", positive_float, "REQ_PER_S,..."),
    ("--models", "model", "--model", _name, "M,M,..."),
    ("--gpus", "gpu", "--gpu", _name, "G,G,..."),
    ("--tps", "tp", "--tp", positive_int, "N,N,..."),
    ("--block-managers", "block_manager", "--block-manager", _CHOICES, "BM,BM,..."),
    ("--block-sizes", "block_size", "--block-size", positive_int, "TOKENS,..."),
    ("--chunk-sizes", "chunked_prefill", "--chunked-prefill", chunk_tokens, "TOKENS|budget|off,..."),
    ("--preemptions", "preemption", "--preemption", _CHOICES, "MODE,MODE,..."),
    ("--routers", "router", "--router", _CHOICES, "R,R,..."),
    ("--engines", "engine", "--engine", _CHOICES, "E,E,..."),
)
#: `simulate` flags that take a comma-separated list here (more than one value sweeps
#: them): (flag, the sweep axis = the flag's dest, item parser, metavar).
LIST_FLAGS: tuple[tuple[str, str, Callable[[str], Any], str], ...] = (
    ("--replicas", "replicas", positive_int, "N[,N,...]"),
    ("--pp", "pp", positive_int, "N[,N,...]"),
    ("--speculative", "speculative", _name, "off|ngram|eagle|mtp|draft:M,..."),
    ("--num-speculative-tokens", "num_speculative_tokens", positive_int, "K[,K,...]"),
    ("--prefill-replicas", "prefill_replicas", positive_int, "N[,N,...]"),
    ("--decode-replicas", "decode_replicas", positive_int, "M[,M,...]"),
)
#: Grid axis order: hardware and memory variants outermost, then policy, then rate.
AXIS_ORDER = ("engine", "model", "gpu", "tp", "pp", "replicas", "prefill_replicas", "decode_replicas",
              "block_manager", "block_size",
              "chunked_prefill", "preemption", "speculative", "num_speculative_tokens", "router",
              "policy", "rate")


def _list_of(parse: Callable[[str], Any]) -> Callable[[str], tuple]:
    def parse_list(text: str) -> tuple:
        items = [item.strip() for item in text.split(",")]
        if not text.strip() or any(not item for item in items):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        values = tuple(parse(item) for item in items)
        for i, value in enumerate(values):
            if value in values[:i]:
                raise argparse.ArgumentTypeError(f"{items[i]!r} is listed twice in {text!r}")
        return values
    return parse_list


class _ParserSlot:
    """Stands in for argparse's subparsers object so that `simulate`'s register() adds its
    flags to the compare parser: compare accepts every simulate flag, spelled, defaulted
    and validated the same way, with no second list of flags to keep in step."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        return self.parser


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compare", conflict_handler="resolve",   # add_grid_arguments redefines --replicas
        help="run a grid of simulations (policies x loads x ...) and report on it",
        description="Simulate every combination of the listed policies, request rates and "
                    "other knobs, store one run directory per point under DIR/runs (rerunning "
                    "skips finished points), and write DIR/index.html and DIR/report.md. Every "
                    "`servelab simulate` flag applies to all points.")
    add_grid_arguments(p, rates_help=": mean request rates in req/s, the trace's arrivals rescaled to each")
    p.set_defaults(func=functools.partial(_cmd_compare, parser=p))


def add_grid_arguments(p: argparse.ArgumentParser, *, rates_help: str,
                       sweep_defaults: dict[str, str] | None = None) -> None:
    """Every `servelab simulate` flag, the sweep lists and the execution flags: what
    `compare` takes, and `capacity` and `plan` with it. `p` must be made with
    conflict_handler="resolve": the flags of LIST_FLAGS replace simulate's.
    `sweep_defaults`: per axis, the help's note on what the command sweeps when its list
    flag is not given (compare's: four policies)."""
    from servelab.simulator import cli as simulate_cli

    simulate_cli.register(_ParserSlot(p))   # adds --out DIR and every simulate flag
    g = p.add_argument_group("sweep (comma-separated lists; each replaces its single flag)")
    for flag, axis, parse, metavar in LIST_FLAGS:
        g.add_argument(flag, dest=axis, type=_list_of(parse), default=(p.get_default(axis),), metavar=metavar,
                       help=f"{flag} as `simulate` takes it, or a list of values to sweep"
                            + ("" if p.get_default(axis) is None else f" (default {p.get_default(axis)})"))
    notes = {"policy": " (default: " + ",".join(DEFAULT_POLICIES) + ")", "rate": rates_help,
             "chunked_prefill": " (token counts, budget or off)", **(sweep_defaults or {})}
    for flag, axis, single, parse, metavar in SWEEP_FLAGS:
        if parse is _CHOICES:
            parse = _one_of(tuple(single_flag(p, single).choices))
        g.add_argument(flag, dest=f"sweep_{axis}", type=_list_of(parse), default=None, metavar=metavar,
                       help=f"values of {single} to sweep{notes.get(axis, '')}")
    x = p.add_argument_group("execution")
    x.add_argument("--workers", type=positive_int, default=None, metavar="N",
                   help="simulations run in parallel (default: the CPUs available)")
    ray = x.add_mutually_exclusive_group()
    ray.add_argument("--ray", action="store_true",
                     help="run the points on a local Ray instance (pip install 'servelab[ray]')")
    ray.add_argument("--ray-address", metavar="ADDR",
                     help="run the points on the Ray cluster at ADDR ('auto': this machine's)")


def single_flag(p: argparse.ArgumentParser, flag: str) -> argparse.Action:
    """The `simulate` flag `flag` of parser `p`."""
    return next(a for a in p._actions if flag in a.option_strings)


# --------------------------------------------------------------------------- the grid
def grid_axes(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, tuple]:
    """The swept axes in AXIS_ORDER: policy and rate always, others when a list was given."""
    axes: dict[str, tuple] = {}
    for flag, axis, single, _, _ in SWEEP_FLAGS:
        values = getattr(args, f"sweep_{axis}")
        single_given = getattr(args, axis) != parser.get_default(axis)
        if values is not None and single_given:
            raise CLIError(f"give {single} or {flag}, not both")
        if values is None and axis == "policy":
            values = (args.policy,) if single_given else DEFAULT_POLICIES
        elif values is None and axis == "rate":
            values = (args.rate,)
        if values is not None:
            axes[axis] = values
    for _, axis, _, _ in LIST_FLAGS:
        if len(getattr(args, axis)) > 1:
            axes[axis] = getattr(args, axis)
    for dest, policy in policy_flag_owners().items():
        if getattr(args, dest) != parser.get_default(dest) and policy not in axes["policy"]:
            flag = "--" + dest.replace("_", "-")
            raise CLIError(f"{flag} configures --policy {policy}, which is not among the "
                           f"policies compared ({','.join(axes['policy'])})")
    from servelab.simulator.gpus import get_gpu
    for gpu in axes.get("gpu", (args.gpu,)):
        try:
            get_gpu(gpu)
        except ValueError as exc:
            raise CLIError(str(exc)) from None
    return {axis: axes[axis] for axis in AXIS_ORDER if axis in axes}


def point_config(args: argparse.Namespace, parser: argparse.ArgumentParser, values: dict[str, Any]):
    """The config `servelab simulate` would build from these flags with `values` set."""
    from servelab.simulator.cli import config_from_args

    ns = argparse.Namespace(**vars(args))
    for _, axis, _, _ in LIST_FLAGS:
        setattr(ns, axis, getattr(args, axis)[0])   # one value, or the axis sets it below
    for axis, value in values.items():
        setattr(ns, axis, value)
    for dest, policy in policy_flag_owners().items():
        if policy != ns.policy:
            setattr(ns, dest, parser.get_default(dest))
    return config_from_args(ns)


def build_points(args: argparse.Namespace, parser: argparse.ArgumentParser):
    from servelab.sweeps.sweep import expand_grid

    axes = grid_axes(args, parser)
    try:
        return axes, expand_grid(axes, lambda values: point_config(args, parser, values))
    except ValueError as exc:  # two grid points that are one simulation
        raise CLIError(str(exc)) from None


# --------------------------------------------------------------------------- the command
def plural(n: int, noun: str, suffix: str = "s") -> str:
    return f"{n} {noun}{suffix if n != 1 else ''}"


def check_points(points) -> None:
    """A layout the model cannot take (`--tps 1,3` on a model of 32 heads, `--pp 40` on
    one of 32 layers) or a CPU tier
    larger than its machine allows fails its points alike: say so once, before the sweep
    starts (each distinct machine and tier checked once)."""
    from servelab.simulator.run import check_host_tier, check_layout

    seen = set()
    for point in points:
        c = point.config
        machine = (c.model, c.gpu, c.tp, c.ep, c.pp, c.weight_dtype, c.kv_dtype, c.calibration,
                   c.block_size, c.kv_offload_gb, c.cpu_kv_blocks)
        if machine not in seen:
            seen.add(machine)
            try:
                check_layout(c)
                check_host_tier(c)
            except ValueError as exc:
                where = " ".join(f"{axis}={show_value(v, axis)}" for axis, v in point.labels
                                 if axis not in ("policy", "rate"))
                said = not where or str(exc).startswith(where)   # "tp=3 must divide ..."
                raise CLIError(str(exc) if said else f"{where}: {exc}") from None


def check_sweep_out(out: Path, command: str, force: bool) -> None:
    """`outdir.check_sweep_dir` as a one-line error, before any work."""
    from servelab.outdir import check_sweep_dir

    try:
        check_sweep_dir(out, command, force=force)
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def drop_other_reports(out: Path, command: str) -> None:
    """Forced over another command's report (`--force`), that report's own file goes when
    the sweep starts, so the folder holds one report (sweep.json: every command rewrites it)."""
    from servelab.outdir import SWEEP_REPORTS

    for name, marker in SWEEP_REPORTS:
        if name not in (command, "compare") and out.is_dir():
            (out / marker).unlink(missing_ok=True)


def note_another_search(out: Path, command: str, file: str, what: str, mine: Any,
                        key: Callable[[dict], Any]) -> None:
    """Say so when `out` holds a search of this command's kind (its `file`) that is not
    this one (`key` of that file differs from `mine`, compared as JSON): its report is
    replaced, as compare says of another grid. A rerun of the same search says nothing."""
    from servelab.reports.runio import read_json

    try:
        earlier = key(read_json(out / file))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return
    if json.loads(json.dumps(mine)) != json.loads(json.dumps(earlier)):
        print(f"{command}: note: {out} held another {what}; its report is replaced by this one's "
              "(stored runs of points that recur are reused, the others stay on disk)",
              file=sys.stderr)


def _earlier_grid(out: Path) -> set[str] | None:
    """The point keys of the comparison already in `out` (its sweep.json), if any."""
    from servelab.reports.runio import read_json
    from servelab.sweeps.sweep import SWEEP_FILE

    try:
        return {entry["key"] for entry in read_json(out / SWEEP_FILE)["points"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _cmd_compare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from servelab.reports.report import write_report
    from servelab.sweeps.runner import default_workers, run_sweep
    from servelab.sweeps.sweep import SweepError

    check_sweep_out(Path(args.out), "compare", args.force)   # before any work
    axes, points = build_points(args, parser)
    check_points(points)
    if all(point.config.rate is None for point in points):
        from servelab.simulator.cli import user_errors
        from servelab.simulator.run import load_workload

        with user_errors():                 # a length-only trace needs --rates: say so once
            load_workload(points[0].config)
    out = Path(args.out)
    if args.force:
        drop_other_reports(out, "compare")
    workers = args.workers or default_workers()
    where = ("the Ray cluster at " + args.ray_address) if args.ray_address else \
        "a local Ray instance" if args.ray else plural(min(workers, len(points)), "worker process", "es")
    shape = " x ".join(f"{len(values)} {axis}" for axis, values in axes.items())
    print(f"compare: {plural(len(points), 'point')} ({shape}) on {where}, into {out}", file=sys.stderr)
    earlier = _earlier_grid(out)
    if earlier is not None and earlier != {p.key for p in points}:
        reused = len(earlier & {p.key for p in points})
        print(f"compare: note: {out} held a comparison of another grid ({plural(len(earlier), 'point')}); "
              f"its report is replaced by this one's ({reused} of its stored points are reused, the "
              "others stay on disk)", file=sys.stderr)
    try:
        outcome = run_sweep(points, out, workers=workers, ray=args.ray, ray_address=args.ray_address,
                            axes=axes, progress=PointProgress(command="compare"),
                            output_format=args.output_format)
    except SweepError as exc:
        raise CLIError(str(exc)) from None
    except OSError as exc:
        raise CLIError(f"cannot write the sweep directory {out}: {exc}") from None
    errors = {failed.error for failed in outcome.failed}
    if len(outcome.failed) == len(points) and len(errors) == 1:
        raise CLIError(f"every point failed, no report written: {errors.pop()}")
    if outcome.failed:
        print(f"compare: {len(outcome.failed)} of {len(points)} points failed:", file=sys.stderr)
        for failed in outcome.failed:
            print(f"  {failed.point.describe()}: {failed.error}", file=sys.stderr)
        if len(outcome.failed) == len(points):
            raise CLIError("every point failed: no report written")
    report = write_report(out)
    print(f"report: {report.html.resolve()}\n        {report.markdown.resolve()}")
    return 1 if outcome.failed else 0
