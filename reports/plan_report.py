"""The report of a deployment plan: DIR/index.html and DIR/report.md, opening with the
answer ("5 x h100-sxm (TP1), fcfs, round-robin: p99 TTFT 1.59 s at 10.3 req/s, $23.80/h"),
then every layout ranked (GPUs, cost, what it reached, the req/s per GPU it was offered,
$ per million output tokens; a run that had not settled also says what it served), the
frontier of cost against the tightest target, what was pruned or could not run, and the
comparison report of the finalists.

    report = write_plan_report(Path("runs/plan"))   # DIR as `servelab plan` left it
    report.answer                                    # the opening sentence

Reads DIR/plan.json (`sweeps/plan.py`), DIR/sweep.json (the finalists) and the runs, so it
can be rebuilt at any time.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servelab.labels import count_words, is_disaggregated
from servelab.reports import plots
from servelab.reports.comparison import RUNS_DIR, load_comparison, offered_rate
from servelab.reports.document import Bullets, Heading, Image, ReportFiles, Table, Text, write_document
from servelab.reports.report import build_document
from servelab.reports.runio import read_json, read_requests
from servelab.reports.slo import SloTargets, slo_attainment

PLAN_FILE, PLAN_FORMAT = "plan.json", "servelab.plan/1"
HOUR_S = 3600.0


@dataclass(frozen=True)
class PlanReport:
    files: ReportFiles
    answer: str


def write_plan_report(out_dir: Path) -> PlanReport:
    out_dir = Path(out_dir)
    data = read_json(out_dir / PLAN_FILE)
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        raise ValueError(f"{out_dir / PLAN_FILE}: not a servelab plan file ({PLAN_FORMAT})")
    if data["best"] is None:
        raise ValueError(f"{out_dir / PLAN_FILE}: no layout met the targets, so there is no plan to report")
    rows = _ranked(data, out_dir)
    answer = _answer(data, rows)
    return PlanReport(write_document(out_dir, _document(data, rows, answer, out_dir)), answer)


@dataclass(frozen=True)
class _Row:
    """A layout at its fewest replicas that met the targets."""

    layout: Mapping[str, Any]
    summary: Mapping[str, Any]
    config: Mapping[str, Any]
    offered: float
    """The traffic the run was offered, req/s (`offered_rate`)."""

    @property
    def name(self) -> str:
        return layout_name(self.layout["labels"], self.layout["replicas"])

    @property
    def gpus(self) -> int:
        return self.layout["replicas"] * self.layout["gpus_per_replica"]


def layout_name(labels: Mapping[str, Any], replicas: int) -> str:
    """"5 x h100-sxm (TP1), fcfs, round-robin": count and GPU first, then the other knobs;
    a disaggregated layout reads "3 x [1P+3D] h100-sxm (TP1), ...": 3 units of one prefill
    and three decode replicas; a mixture-of-experts deployment of data-parallel ranks
    "2 x h100-sxm (TP1, DP2, EP2), ...": two deployments of two single-GPU ranks."""
    named = [labels[k] for k in ("policy", "router") if k in labels]
    rest = [*named, *(f"{k}={v}" for k, v in labels.items()
                      if k not in ("gpu", "tp", "pools", "ranks", "policy", "router"))]
    pools = f"[{labels['pools']}] " if is_disaggregated(labels) else ""
    ranks = f", {labels['ranks']}" if "ranks" in labels else ""
    return ", ".join([f"{replicas} x {pools}{labels['gpu']} (TP{labels['tp']}{ranks})", *rest])


def _ranked(data: Mapping[str, Any], out_dir: Path) -> list[_Row]:
    found = [g for g in data["layouts"] if g["status"] == "found"]
    found.sort(key=lambda g: (round(g["cost"], 9), g["replicas"] * g["gpus_per_replica"],
                              _met(g)["tightness"]))
    rows = []
    for g in found:
        run = out_dir / RUNS_DIR / _met(g)["run"]
        rows.append(_Row(g, read_json(run / "summary.json"), read_json(run / "config.json")["config"],
                         offered_rate(read_requests(run))))
    return rows


def _met(layout: Mapping[str, Any]) -> Mapping[str, Any]:
    return next(t for t in layout["trials"] if t["replicas"] == layout["replicas"])


def _cost(data: Mapping[str, Any], value: float) -> str:
    if data["objective"] == "cost":
        return f"${value:,.2f}/h"
    return f"{value:g} GPU{'' if value == 1 else 's'}"


def _reached(targets: SloTargets, summary: Mapping[str, Any]) -> str:
    """What a run reached on each target, e.g. "p99 TTFT 1.59 s"."""
    parts = []
    for t in targets.percentiles:
        value = t.value(summary)
        parts.append(f"p{t.percentile} {t.metric.upper()} {_ms(value)}")
    if targets.attainment is not None:
        parts.append(f"{slo_attainment(summary):.1%} within SLO")
    return ", ".join(parts)


def _ms(value: float) -> str:
    if value == float("inf"):
        return "unbounded"
    return f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.0f} ms"


def _dollars_per_m_tokens(data: Mapping[str, Any], row: _Row, price_per_gpu: float | None) -> str:
    """The layout's dollars an hour over the output tokens an hour of the traffic it was
    sized for: the offered rate times the mean output of the requests it served (the
    run's own output throughput also counts the drain after the last arrival, which a
    short trace makes a large share). Its cost is the plan's own where the plan priced it
    (every pool at its own GPU's price: a disaggregated layout's decode pool may run
    other GPUs), else its GPU's price times its GPUs."""
    done = row.summary["completed"]
    tokens_per_s = row.offered * row.summary["total_output_tokens"] / done if done else 0.0
    per_hour = row.layout["cost"] if data["objective"] == "cost" else \
        None if price_per_gpu is None else price_per_gpu * row.gpus
    if per_hour is None or not tokens_per_s:
        return "n/a"
    return f"${per_hour / (tokens_per_s * HOUR_S) * 1e6:,.2f}"


def _answer(data: Mapping[str, Any], rows: Sequence[_Row]) -> str:
    targets = SloTargets.from_dict(data["targets"])
    best = rows[0]
    head = (f"{best.name}: {_reached(targets, best.summary)} at {best.offered:.2f} req/s, "
            f"{_cost(data, best.layout['cost'])}")
    if data["objective"] == "cost":
        head += f" ({best.gpus} GPU{'s' if best.gpus != 1 else ''})"
    below = next((t for t in best.layout["trials"] if t["replicas"] == best.layout["replicas"] - 1), None)
    tail, notes = [], list(best.layout["edge_notes"])
    if below is not None:
        fewer = f"{count_words(best.layout['labels'], below['replicas'])} missed"
        hair = [n for n in notes if n.startswith(fewer + " by a hair")]
        tail.append(f"{fewer}{' by a hair' if hair else ''}: {'; '.join(below['misses'])}")
        notes = [n for n in notes if n not in hair]
    tail += [f"note: {n}" for n in notes]
    if best.layout["unsettled"]:
        tail.append(f"note: the run had not settled ({best.layout['unsettled']}): a longer run may need more")
    return head + "." + "".join(f" {t[0].upper()}{t[1:]}." for t in tail)


def _document(data: Mapping[str, Any], rows: Sequence[_Row], answer: str, out_dir: Path) -> list:
    targets = SloTargets.from_dict(data["targets"])
    first = rows[0].config
    traffic = (f"{data['rate']:g} req/s" if data["rate"] is not None
               else f"the trace's rate x {data['rate_scale'] or 1:g}")
    doc: list = [Heading(1, f"Deployment plan: {first['model']} serving {first['trace']} at {traffic}, "
                            f"{data['criterion']}"),
                 Text(answer),
                 Heading(2, "Every layout at its fewest replicas that met the targets"),
                 _table(data, rows, targets),
                 Image("plan_frontier", "Cost against the tightest target",
                       "One point per layout at its fewest replicas that met the targets: its cost (x) and how "
                       "close it came to its tightest target (y, value / limit; 1 is the limit). The hollow "
                       "marker beside each is the same layout with one replica fewer, which missed. The "
                       "cheapest layout is starred.", _frontier(data, rows))]
    doc += _other_layouts(data)
    doc += [Heading(2, "How it was found"), Text(_method(data))]
    notes = [f"{layout_name(g['labels'], g['replicas'] or 0)}: {n}" for g in data["layouts"] for n in g["notes"]]
    if notes:
        doc += [Heading(2, "Notes"), Bullets(notes)]
    try:
        comparison = load_comparison(out_dir)
    except ValueError:
        comparison = None
    if comparison is not None:
        doc += build_document(comparison, title="The finalists compared", level=2,
                              run_targets=data["criterion"])
    return doc


def _table(data: Mapping[str, Any], rows: Sequence[_Row], targets: SloTargets) -> Table:
    body = []
    for row in rows:
        gpu = row.layout["labels"]["gpu"]
        price = data["prices"].get(gpu)
        body.append([row.name, str(row.gpus), _cost(data, row.layout["cost"]), _reached(targets, row.summary),
                     f"{row.offered / row.gpus:.2f}",
                     _dollars_per_m_tokens(data, row, price),
                     "; ".join(_edge(row)) or "-"])
    return Table(["Layout", "GPUs", "Cost", "Reached", "req/s per GPU", "$ per M output tokens", "Edge"], body)


def _edge(row: _Row) -> list[str]:
    """The row's edge notes; a run that had not settled also says what it served, since its
    offered rate (the req/s per GPU column) overstates it."""
    notes = list(row.layout["edge_notes"])
    if row.layout["unsettled"]:
        served = row.summary["request_throughput"] / row.gpus
        notes.append(f"not settled: served {served:.2f} req/s per GPU of the {row.offered / row.gpus:.2f} offered")
    return notes


def _other_layouts(data: Mapping[str, Any]) -> list:
    items = []
    for g in data["layouts"]:
        who = layout_name(g["labels"], g["pruned_at"] or 0).split(", ", 1)
        where = who[0].split(" x ", 1)[1] + (f", {who[1]}" if len(who) > 1 else "")
        if g["status"] == "pruned":
            items.append(f"{where}: pruned at {count_words(g['labels'], g['pruned_at'])}, which would cost at least "
                         f"{_cost(data, g['lower_bound'])}, more than the answer")
        elif g["status"] == "unmet":
            last = g["trials"][-1]
            items.append(f"{where}: missed even at {count_words(g['labels'], last['replicas'])} ({'; '.join(last['misses'])})")
        elif g["status"] == "failed":
            errors = "; ".join(f"{count_words(g['labels'], t['replicas'])}: {t['error']}" for t in g["trials"] if t["error"])
            items.append(f"{where}: a run failed ({errors})")
        elif g["status"] == "unresolved":
            items.append(f"{where}: not narrowed to one replica")
    items += [f"{', '.join(f'{k}={v}' for k, v in s['labels'].items())}: not run ({s['why']})"
              for s in data["skipped"]]
    if not items:
        return []
    return [Heading(2, "Layouts without an answer"), Bullets(items)]


def _method(data: Mapping[str, Any]) -> str:
    prices = ", ".join(f"{g} ${p:g}" for g, p in data["prices"].items())
    objective = (f"cost an hour, at these prices per GPU-hour: {prices}" if data["objective"] == "cost"
                 else "GPUs")
    return ("For every layout the replica count was searched at the same traffic: doubling from one "
            "replica until a count met the targets, then bisecting until the count that met sat just above "
            "one that missed (so both sides of each answer are runs in runs/). A layout stopped early once "
            "its next count would cost more than a count known to meet the targets elsewhere (pruned). "
            f"Layouts are ranked by {objective}; at most {data['max_gpus']} GPUs each. A percentile is "
            "read over the finished requests, a rejected request counting as slower than all of them.")


def _frontier(data: Mapping[str, Any], rows: Sequence[_Row]):
    """Cost (x) against what each layout reached (y): the target's own value when there is
    one percentile target, else the tightest target's value / limit. Layouts at the same
    point share one label."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    targets = SloTargets.from_dict(data["targets"])
    single = targets.percentiles[0] if len(targets.percentiles) == 1 and targets.attainment is None else None

    def y_of(trial: Mapping[str, Any]) -> float:   # the limit sits at 1 either way
        return trial["tightness"]

    colours = plots.policy_colours(r.layout["labels"]["gpu"] for r in rows)
    shared: dict[tuple[float, float], list[str]] = {}
    for row in rows:
        point = (round(row.layout["cost"], 6), round(y_of(_met(row.layout)), 6))
        shared.setdefault(point, []).append(row.name)
    with plots._style():
        fig = Figure(figsize=(10, 6))
        ax = fig.subplots()
        for i, row in enumerate(rows):
            g = row.layout
            colour = colours[g["labels"]["gpu"]]
            y = y_of(_met(g))
            ax.plot([g["cost"]], [y], "*" if i == 0 else "o", color=colour, ms=18 if i == 0 else 8,
                    mec="black", mew=0.6, zorder=3, gid=f"layout:{row.name}")
            below = next((t for t in g["trials"] if t["replicas"] == g["replicas"] - 1), None)
            if below is not None and below["tightness"] is not None:
                ax.plot([g["cost"] - g["cost_per_replica"]], [min(y_of(below), 3.0)], "o", mfc="none",
                        color=colour, ms=8, gid=f"below:{row.name}")
        for (x, y), names in shared.items():
            count, rest = names[0].split(", ", 1) if ", " in names[0] else (names[0], "")
            others = [n.split(", ", 1)[1] for n in names[1:] if ", " in n and n.split(", ", 1)[0] == count]
            label = count + (f": {', '.join([rest, *others])}" if rest else "")
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(9, -3), fontsize=8.5)
        ax.axhline(1.0, color="black", ls="--", lw=1.2)
        ax.annotate(f"limit: {targets}", (0.99, 1.0), xycoords=("axes fraction", "data"), ha="right",
                    va="bottom", fontsize=9)
        xs = [r.layout["cost"] for r in rows]
        ax.set_xlim(0, max(xs) * 1.35)
        ax.set_xlabel("$ per hour" if data["objective"] == "cost" else "GPUs")
        ax.set_ylabel(f"p{single.percentile} {single.metric.upper()} / {single.limit_ms:g} ms" if single is not None
                      else "tightest target reached (value / limit)")
        ax.set_ylim(0, max(1.3, min(3.0, max(y_of(_met(r.layout)) for r in rows) * 1.2)))
        handles = [Line2D([], [], color=c, marker="o", ls="", label=gpu) for gpu, c in colours.items()]
        handles.append(Line2D([], [], color="grey", marker="o", mfc="none", ls="", label="one replica fewer"))
        ax.legend(handles=handles, frameon=False, loc="lower right")
        ax.set_title("Cost against the targets, one point per layout at its fewest replicas (star: the answer)")
    return fig
