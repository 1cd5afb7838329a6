"""`servelab plan`: how many GPUs, of which kind, in which layout, to serve a traffic
within its SLOs, at the least cost.

    servelab plan --trace azure-code-2023 --rate-scale 4 --p99-ttft-ms 2000 \\
        --gpus h100-sxm,h200,a100-80gb --out DIR

A layout is every value of every swept knob but the replica count: GPU kind (--gpus;
default every catalog GPU with a price), tensor parallelism (--tps; default 1, 2, 4 and 8,
those the model fits), policy (--policies; default --policy), router (--routers), and
any other `compare` list, and, with --prefill-replicas/--decode-replicas, disaggregated
pool shapes beside the co-located layouts (one layout per P:D pair: its searched count n
runs n x P prefill and n x D decode replicas). For each layout the search finds the fewest
replicas (pool units) that meet
the targets at the traffic given (--rate or --rate-scale, default the trace's own), and
ranks the layouts by cost an hour (--objective cost, prices from the GPU catalog or
--gpu-price) or by GPUs (--objective gpus); see `sweeps/plan.py` for the search.

DIR receives every run under runs/ (the store `compare` uses: rerunning reuses them),
plan.json, sweep.json (the finalists) and index.html / report.md opening with the answer.
When no layout meets the targets within --max-gpus, one line says which target and the
best reached, and no report is written. Importing this module is cheap.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from servelab.cli import CLIError
from servelab.labels import COLOCATED
from servelab.options import positive_float, positive_int
from servelab.progress import PointProgress
from servelab.sweeps.capacity_cli import add_target_arguments, check_slos, slo_targets
from servelab.sweeps.cli import (add_grid_arguments, check_sweep_out, drop_other_reports,
                                 grid_axes, note_another_search, plural, point_config, single_flag)

DEFAULT_TPS = (1, 2, 4, 8)
"""Tensor-parallel degrees tried when neither --tp nor --tps is given: one NVLink domain
of 8 GPUs, the widest a single vLLM engine spans without pipeline parallelism."""
DEFAULT_MAX_GPUS = 64
"""The most GPUs a layout may use unless --max-gpus says otherwise: eight 8-GPU nodes."""
FINALISTS = 4
"""Layouts compared in full at the end of the report (the cheapest found)."""
OBJECTIVES = ("cost", "gpus")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", conflict_handler="resolve",   # add_grid_arguments redefines --replicas
        help="find the cheapest deployment (GPU kind, TP, replicas, policy) that meets the SLOs",
        description="For every layout (GPU kind x tensor parallelism x policy x router x any other "
                    "`compare` list), find the fewest replicas that meet the SLO targets at the given "
                    "traffic, and rank the layouts by cost an hour (or GPUs). Writes DIR/plan.json, "
                    "DIR/index.html and DIR/report.md; every run is stored under DIR/runs and reused "
                    "on a rerun. Every `servelab simulate` flag applies to every run.")
    add_grid_arguments(p, rates_help=": one rate only (plan sizes a deployment for one traffic)",
                       sweep_defaults={"policy": " (default: --policy's one)",
                                       "gpu": " (default: every catalog GPU with a price)",
                                       "tp": " (default: " + ",".join(map(str, DEFAULT_TPS)) + ")"})
    for flag, searched in (("--gpu", "every catalog GPU with a price"),
                           ("--tp", ",".join(map(str, DEFAULT_TPS)))):
        action = single_flag(p, flag)          # one value instead of plan's search
        action.help = f"{action.help.split(' (default')[0]} (default: plan searches {searched})"
    c = add_target_arguments(p, "plan")
    c.add_argument("--objective", choices=OBJECTIVES, default="cost",
                   help="what to minimise: cost an hour (default) or GPUs")
    c.add_argument("--gpu-price", type=_prices, default={}, metavar="GPU=USD,...",
                   help="$ per GPU-hour, replacing the catalog's (e.g. h100-sxm=2.5,h200=3.4)")
    c.add_argument("--max-gpus", type=positive_int, default=DEFAULT_MAX_GPUS, metavar="N",
                   help="the most GPUs a layout may use (default %(default)s)")
    p.set_defaults(func=functools.partial(_cmd_plan, parser=p), command_name="plan", gpu=None, tp=None)


def _prices(text: str) -> dict[str, float]:
    """GPU=USD,GPU=USD: --gpu-price."""
    prices = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"expected GPU=USD items such as h100-sxm=2.5, got {item!r}")
        prices[name.strip()] = positive_float(value.strip())
    return prices


def _layout_axes(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
    """args with every layout knob as a list (a single flag becomes a one-value list, so
    every layout names its GPU, TP, policy and router), and the GPU and TP lists plan
    searches by default (see the module docstring)."""
    from servelab.simulator.gpus import get_gpu, gpu_names

    args = argparse.Namespace(**vars(args))
    if args.sweep_gpu is None:
        if args.gpu is not None:
            args.sweep_gpu, args.gpu = (args.gpu,), None
        else:
            priced = tuple(n for n in gpu_names() if get_gpu(n).price_per_hour_usd is not None)
            args.sweep_gpu = priced
    if args.sweep_policy is None:   # compare's default is four policies; plan's is --policy
        args.sweep_policy, args.policy = (args.policy,), parser.get_default("policy")
    if args.sweep_router is None:   # named in every layout, as the answer names it
        args.sweep_router, args.router = (args.router or _default_router(args),), parser.get_default("router")
    if args.sweep_tp is None:
        args.sweep_tp, args.tp = ((args.tp,) if args.tp is not None else DEFAULT_TPS), None
    return args   # args.gpu / args.tp stay as given: grid_axes refuses --gpu with --gpus


def _planned_gpus(args: argparse.Namespace, swept: Sequence[str]) -> list[str]:
    """The swept GPUs and the pools' own (--prefill-gpu, --decode-gpu): every GPU a layout
    may be priced at."""
    pools = [getattr(args, f"{pool}_gpu", None) for pool in ("prefill", "decode")]
    return list(dict.fromkeys([*swept, *(g for g in pools if g)]))


def _price_of(gpu: str, args: argparse.Namespace) -> float:
    from servelab.simulator.gpus import get_gpu

    if args.objective == "gpus":
        return 1.0
    spec = get_gpu(gpu)
    price = args.gpu_price.get(gpu, spec.price_per_hour_usd)
    if price is None:
        raise CLIError(f"no price for GPU {gpu}: give --gpu-price {gpu}=USD, or --objective gpus")
    return price


def _layouts(args, parser):
    """(layouts, skipped): one `Layout` per combination of the swept values but the rate,
    and the combinations that cannot run at all (the model does not fit), with why."""
    from servelab.simulator.run import build_simulation
    from servelab.sweeps.plan import Layout

    axes = dict(grid_axes(args, parser))
    planned = _planned_gpus(args, axes["gpu"])
    unknown = sorted(set(args.gpu_price) - set(planned))
    if unknown:
        raise CLIError(f"--gpu-price names {', '.join(unknown)}, not among the GPUs planned "
                       f"({', '.join(planned)})")
    rates = axes.pop("rate")
    if len(rates) > 1:
        raise CLIError("plan sizes a deployment for one traffic: give --rate or --rate-scale, not --rates")
    if "replicas" in axes or args.replicas != (1,):
        raise CLIError("plan searches the replica count itself: drop --replicas (bound it with --max-gpus)")
    for axis in POOL_AXES:
        axes.pop(axis, None)
    layouts, skipped, checked, refused = [], [], {}, []
    shapes = _pool_shapes(args)
    for combo in itertools.product(*axes.values()):
        for shape in shapes:
            values = dict(zip(axes, combo))
            unit = _unit(args, values, shape)
            if len(shapes) > 1:   # the pools' shape names every layout, after the GPU and TP
                at = list(values).index("tp") + 1
                values = dict([*list(values.items())[:at], ("pools", unit.name), *list(values.items())[at:]])
            build = functools.partial(_config_at, args, parser, {**values, "rate": rates[0]}, shape)
            try:
                config = build(1)
            except CLIError as exc:   # e.g. a fixed --ep that this TP does not divide
                refused.append(str(exc))
                skipped.append((values, str(exc)))
                continue
            ranks = config.replicas if shape is None else 1
            if ranks > 1:   # --ep/--dp: a replica is a deployment of that many engines
                unit = _Unit(unit.name, unit.gpus * ranks, unit.cost * ranks,
                             f"{unit.describe} x {ranks} data-parallel ranks")
                build = functools.partial(_config_at, args, parser, {**values, "rate": rates[0]},
                                          shape, ranks=ranks)
                at = list(values).index("tp") + 1   # named after the TP: "(TP1, DP2, EP2)"
                values = dict([*list(values.items())[:at], ("ranks", f"DP{ranks}, EP{config.ep}"),
                               *list(values.items())[at:]])
            most = args.max_gpus // unit.gpus
            if most < 1:
                skipped.append((values, f"{unit.describe} needs more than --max-gpus {args.max_gpus}"))
                continue
            machine = (config.model, config.gpu, config.tp, config.pp, config.weight_dtype, config.kv_dtype, config.engine,
                       config.block_size, config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs,
                       config.disaggregation)
            if machine not in checked:
                try:
                    build_simulation(config)
                    checked[machine] = None
                except ValueError as exc:
                    checked[machine] = str(exc)
            if checked[machine] is not None:
                skipped.append((values, checked[machine]))
                continue
            layouts.append(Layout(tuple(values.items()), unit.gpus, unit.cost, build, most))
    if not layouts and len(refused) == len(skipped) and len(set(refused)) == 1:
        raise CLIError(refused[0])   # the flags themselves, not a layout: one line
    return layouts, skipped, rates[0]


POOL_AXES = ("prefill_replicas", "decode_replicas")
POOL_FLAGS = ("prefill_tp", "decode_tp", "prefill_gpu", "decode_gpu", "prefill_kv_blocks",
              "decode_kv_blocks", "kv_link", "kv_transfer")
"""`simulate` flags that only a disaggregated run takes: unset for the co-located layouts."""


def _pool_shapes(args) -> list[tuple[int, int] | None]:
    """None (co-located) and, when --prefill-replicas and --decode-replicas are given,
    every (P, D) pair of their lists: the unit a disaggregated layout scales."""
    prefill, decode = args.prefill_replicas, args.decode_replicas
    if prefill == (None,) and decode == (None,):
        return [None]
    if None in prefill or None in decode:
        raise CLIError("plan's disaggregated layouts need both --prefill-replicas and --decode-replicas")
    return [None, *itertools.product(prefill, decode)]


@dataclass(frozen=True)
class _Unit:
    """What the searched count multiplies: one replica, or one P:D set of pool replicas."""

    name: str
    gpus: int
    cost: float
    describe: str


def _unit(args, values: dict, shape: tuple[int, int] | None) -> _Unit:
    gpu, tp = values["gpu"], values["tp"]
    if shape is None:   # a replica of pipeline stages has tp GPUs per stage
        pp = values.get("pp", args.pp[0])
        return _Unit(COLOCATED, tp * pp, tp * pp * _price_of(gpu, args),
                     f"TP{tp}" + (f" PP{pp}" if pp > 1 else ""))
    parts, gpus, cost = [], 0, 0.0
    for pool, count in zip(("prefill", "decode"), shape):
        pool_gpu = getattr(args, f"{pool}_gpu") or gpu
        pool_tp = getattr(args, f"{pool}_tp") or tp
        gpus += count * pool_tp
        cost += count * pool_tp * _price_of(pool_gpu, args)
        own = [f"TP{pool_tp}"] if pool_tp != tp else []
        own += [pool_gpu] if pool_gpu != gpu else []
        parts.append(f"{count}{pool[0].upper()}" + (f"({' '.join(own)})" if own else ""))
    name = "+".join(parts)
    return _Unit(name, gpus, cost, f"a {name} pool unit ({gpus} GPUs)")


def _config_at(args, parser, values: dict, shape: tuple[int, int] | None, count: int,
               ranks: int = 1):
    """The run of a layout at `count` replicas (each a deployment of `ranks` data-parallel
    engines under --ep/--dp), or `count` pool units of `shape`."""
    values = {k: v for k, v in values.items() if k != "pools"}
    if shape is None:
        return point_config(args, parser, {**values, **dict.fromkeys((*POOL_AXES, *POOL_FLAGS)),
                                           "replicas": count * ranks})
    return point_config(args, parser, {**values, "prefill_replicas": count * shape[0],
                                       "decode_replicas": count * shape[1]})


def _cmd_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from servelab.reports.plan_report import write_plan_report
    from servelab.sweeps.plan import PLAN_FILE, search_plan, write_plan_file
    from servelab.sweeps.runner import SweepRunner, default_workers
    from servelab.sweeps.sweep import SweepError, SweepPoint, write_sweep_file

    check_sweep_out(Path(args.out), "plan", args.force)   # before any work
    args = _layout_axes(args, parser)
    targets = slo_targets(args)
    check_slos(args, parser, targets, {"gpu": args.sweep_gpu[0], "tp": args.sweep_tp[0]})
    layouts, skipped, rate = _layouts(args, parser)
    for values, why in skipped:
        print(f"plan: skipped {_who(values)}: {why}", file=sys.stderr)
    if not layouts:
        raise CLIError("no layout can run: " + "; ".join(f"{_who(v)}: {why}" for v, why in skipped))
    out = Path(args.out)
    if args.force:
        drop_other_reports(out, "plan")
    note_another_search(
        out, "plan", PLAN_FILE, "plan",
        (str(targets), args.objective, rate, args.rate_scale, args.max_gpus, args.num_requests,
         [dict(layout.labels) for layout in layouts]),
        lambda d: (d["criterion"], d["objective"], d["rate"], d["rate_scale"], d["max_gpus"],
                   d["num_requests"], [layout["labels"] for layout in d["layouts"]]))
    workers = args.workers or default_workers()
    traffic = f"{rate:g} req/s" if rate is not None else f"the trace's rate x {args.rate_scale or 1:g}"
    print(f"plan: {plural(len(layouts), 'layout')} at {traffic} to {targets}, up to {args.max_gpus} GPUs, "
          f"{plural(workers, 'worker')}, into {out}", file=sys.stderr)
    progress = PointProgress(command="plan", detail=lambda o: _verdict(o, targets))
    try:
        with SweepRunner(out, workers=workers, ray=args.ray, ray_address=args.ray_address,
                         output_format=args.output_format) as runner:
            plan = search_plan(layouts, runner, targets=targets, progress=progress,
                               on_round=lambda k, n: setattr(progress, "prefix", f"round {k} "))
            unsettled = {i: _unsettled(r, runner.runs_dir) for i, r in enumerate(plan.results)}
            finalists = [r for r in plan.ranked[:FINALISTS]]
            points = [SweepPoint(layouts[plan.results.index(r)].build(r.replicas),
                                 (*r.labels.items(), ("replicas", r.replicas))) for r in finalists]
            if points:
                write_sweep_file(out, points)
            write_plan_file(out, plan, unsettled=unsettled, settings={
                "objective": args.objective, "rate": rate, "rate_scale": args.rate_scale,
                "max_gpus": args.max_gpus, "num_requests": args.num_requests,
                "prices": {g: _price_of(g, args) for g in _planned_gpus(
                    args, list(dict.fromkeys(dict(r.labels)["gpu"] for r in plan.results)))}
                if args.objective == "cost" else {},
                "skipped": [{"labels": v, "why": why} for v, why in skipped]})
    except SweepError as exc:
        raise CLIError(str(exc)) from None
    except OSError as exc:
        raise CLIError(f"cannot write the plan directory {out}: {exc}") from None
    failed = [r for r in plan.results if r.status == "failed"]
    for r in failed:
        errors = "; ".join(f"{t.replicas} replicas: {t.error}" for t in r.trials if t.error)
        print(f"plan: {_who(r.labels)}: a run failed ({errors})", file=sys.stderr)
    if plan.best is None:
        raise CLIError(_no_answer(plan, args.max_gpus) + f" (runs kept in {out.resolve()})")
    report = write_plan_report(out)
    print(report.answer)
    print(f"report: {report.files.html.resolve()}\n        {report.files.markdown.resolve()}")
    return 1 if failed else 0


def _who(values) -> str:
    return ", ".join(f"{k}={v}" for k, v in dict(values).items())


def _verdict(outcome, targets) -> str:
    if outcome.summary is None:
        return ""
    misses = targets.misses(outcome.summary)
    return " (met)" if not misses else f" (missed: {'; '.join(misses)})"


def _unsettled(result, runs_dir: Path) -> str | None:
    """Why the run at a layout's answer had not settled (its queue still growing), or None."""
    from servelab.reports.health import overload
    from servelab.reports.runio import read_requests

    if result.met is None:
        return None
    run = runs_dir / result.met.name
    sign = overload(read_requests(run))
    return None if sign is None else sign.evidence()


def _no_answer(plan, max_gpus: int) -> str:
    """No layout met the targets: which target, and the best any layout reached."""
    from servelab.reports.plan_report import layout_name

    tried = [t for r in plan.results for t in r.trials if t.tightness is not None]
    if not tried:
        return "no layout could be run"
    closest = min(tried, key=lambda t: t.tightness)
    owner = next(r for r in plan.results if closest in r.trials)
    return (f"no layout meets {plan.targets} within {max_gpus} GPUs; the closest was "
            f"{layout_name(owner.labels, closest.replicas)}: {'; '.join(closest.misses)}")


def _default_router(args: argparse.Namespace) -> str:
    """The router every layout names when --router is not given: least-outstanding when
    --dp or --ep spread a deployment over data-parallel ranks (as `simulate` picks it for
    them, `simulator.cli.config_from_args`), round-robin otherwise."""
    spread = max(getattr(args, "dp", None) or 1, getattr(args, "ep", None) or 1)
    return "least-outstanding" if spread > 1 else "round-robin"
