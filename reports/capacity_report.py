"""The report of a capacity search: DIR/index.html and DIR/report.md, opening with the
answer ("priority sustains 16.3 req/s at 90% SLO attainment, sjf 15.4, ..."), then the
brackets, the SLO attainment curves with each capacity marked, what the run length means
for the answer, and the comparison report of every policy at every capacity found.

    files = write_capacity_report(Path("runs/cap"))   # DIR as `servelab capacity` left it

Reads DIR/capacity.json (`sweeps/capacity.py`), DIR/sweep.json and the runs, so it can be
rebuilt at any time. Runs that failed are named near the top; the rest is drawn from the
runs that succeeded (at least one probe must have). Cost: each probe's summary.json, the
held probes' requests.csv (run length), then the comparison report's cost.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from servelab.reports import plots
from servelab.reports.comparison import RUNS_DIR, describe_labels, load_comparison, show_value
from servelab.reports.document import Bullets, Heading, Image, ReportFiles, Table, Text, write_document
from servelab.reports.plots_load import CapacityCurve, attainment_curves
from servelab.reports.report import build_document
from servelab.reports.runio import read_json, read_requests
from servelab.reports.slo import slo_tiers, tenants_tightest_first

CAPACITY_FILE, CAPACITY_FORMAT = "capacity.json", "servelab.capacity/1"


def write_capacity_report(out_dir: Path) -> ReportFiles:
    out_dir = Path(out_dir)
    data = read_json(out_dir / CAPACITY_FILE)
    if not isinstance(data, dict) or data.get("format") != CAPACITY_FORMAT:
        raise ValueError(f"{out_dir / CAPACITY_FILE}: not a servelab capacity file ({CAPACITY_FORMAT})")
    return write_document(out_dir, build_capacity_document(data, out_dir))


def build_capacity_document(data: Mapping[str, Any], out_dir: Path) -> list:
    try:
        comparison = load_comparison(out_dir)
    except ValueError as exc:   # no run at the capacities is stored (they failed)
        comparison, unstored = None, str(exc)
    first, first_requests = _first_run(comparison, data["groups"], out_dir)
    target, tolerance = data["attainment_target"], data["tolerance"]
    criterion = data.get("criterion") or f"{target:.0%} SLO attainment"
    groups = data["groups"]
    colours = plots.policy_colours(g["labels"].get("policy", "") for g in groups)
    doc: list = [Heading(1, f"Capacity at {criterion}: {first['trace']}"),
                 Text(_answer(groups, criterion, tolerance, first, len(first_requests))),
                 _bracket_table(groups), *_failed_probes(groups)]
    tenants = tenants_tightest_first(slo_tiers(first, first_requests))
    for labels, members in _variants(groups).items():
        suffix = f" ({describe_labels(dict(labels))})" if labels else ""
        slug = "_".join(f"{a}-{show_value(v)}" for a, v in labels).replace("/", "-")
        doc.append(Image(f"attainment{'_' + slug if slug else ''}", "SLO attainment vs request rate" + suffix,
                         "The share of requests within their SLOs at every rate the search probed, per "
                         "policy" + ("" if target is None else f"; the dashed line is the {target:.0%} target")
                         + ". A star and a dotted line mark "
                         "each policy's capacity (the last rate that held); the right panel splits the "
                         "attainment by tenant, which shows whose requests a policy gives up first.",
                         attainment_curves({g["labels"].get("policy", "?"): _curve(g, out_dir) for g in members},
                                           target, colours, "SLO attainment vs request rate" + suffix,
                                           tenants=tenants)))
    doc += [Heading(2, "How it was found"), Text(_method(criterion, tolerance, data["start_rates"]))]
    run_length = _run_length(groups, out_dir, data)
    if run_length:   # nothing to say where no capacity held
        doc += [Heading(2, "How the answer depends on run length"), *run_length]
    notes = [f"{_who(g)}: {n}" for g in groups for n in g["notes"]]
    if notes:
        doc += [Heading(2, "Notes"), Bullets(notes)]
    found = any(g["capacity"] is not None for g in groups)
    # with none found the search's runs compare the policies at its lowest start rate
    title = "The policies at each capacity found" if found else \
        "The policies at the lowest start rate (no capacity was found)"
    if comparison is None:
        doc += [Heading(2, title),
                Text(f"No run at the capacities succeeded ({unstored}); rerun the same command to retry them.")]
    else:
        doc += build_document(comparison, title=title, level=2, run_targets=data.get("criterion"))
    return doc


def _first_run(comparison, groups, out_dir: Path) -> tuple[Mapping[str, Any], Any]:
    """(config, request records) of the comparison's first point, else of the first probe
    that succeeded: what the title and the tenants' SLO tiers are read from."""
    if comparison is not None:
        return comparison.points[0].config, comparison.points[0].requests
    run = next(out_dir / RUNS_DIR / p["run"] for g in groups for p in g["probes"] if p["attainment"] is not None)
    return read_json(run / "config.json")["config"], read_requests(run)


def _failed_probes(groups) -> list:
    failed = [f"{_who(g)} at {p['rate']:g} req/s: {p['error']}" for g in groups for p in g["probes"] if p["error"]]
    if not failed:
        return []
    return [Heading(2, "Runs that failed"),
            Text("These probes could not run, so the capacity of their group is unknown: its search stopped "
                 "there, and the table above shows the bracket its other probes found. Rerunning the same "
                 "command reuses every run that succeeded and retries these."),
            Bullets(failed)]


def _who(group: Mapping[str, Any]) -> str:
    return ", ".join(str(v) if a == "policy" else f"{a}={show_value(v)}" for a, v in group["labels"].items())


def _variants(groups: Sequence[Mapping[str, Any]]) -> dict[tuple, list]:
    out: dict[tuple, list] = {}
    for g in groups:
        key = tuple((a, v) for a, v in g["labels"].items() if a != "policy")
        out.setdefault(key, []).append(g)
    return out


def _answer(groups, criterion: str, tolerance: float, config: Mapping[str, Any],
            num_requests: int) -> str:
    """The opening sentence(s): every group's capacity, highest first; `num_requests` is
    what a run replayed (a --num-requests above the trace's length replays the trace)."""
    sentences = []
    for labels, members in _variants(groups).items():
        ranked = sorted(members, key=lambda g: -(g["capacity"] or 0.0))
        names = [g["labels"].get("policy", "?") for g in ranked]
        where = f"With {describe_labels(dict(labels))}, " if labels else ""
        head = f"{where}{names[0]} sustains {_amount(ranked[0])} at {criterion}"
        rest = [f"{name} {_amount(g)}" for name, g in zip(names[1:], ranked[1:])]
        sentences.append(head + "".join(f", {r}" for r in rest) + ".")
    runs = f"{num_requests:,} requests per run"
    unsteady = [_who(g) for g in groups if g.get("steady_state_warning")]
    caveat = (f" The run at the capacity of {' and of '.join(unsteady)} had not settled: treat "
              f"{'that figure' if len(unsteady) == 1 else 'those figures'} as an upper bound (see run length "
              "below).") if unsteady else ""
    swept = {a for g in groups for a in g["labels"] if a != "policy"}
    setup = " ".join(x for x in (None if "model" in swept else config["model"],
                                 None if "gpu" in swept else f"on {config['gpu']}") if x)
    return (" ".join(sentences) + f" ({setup + ', ' if setup else ''}{runs}; each capacity is the "
            f"highest rate that held, with the first rate that broke at most {tolerance:.0%} above it.)"
            + caveat)


def _amount(group: Mapping[str, Any]) -> str:
    status = group["status"]
    if status == "holds":
        return f"more than {group['held']['rate']:g} req/s (it held at every rate tried)"
    if status == "breaks":
        return f"less than {group['broke']['rate']:g} req/s (it broke at every rate tried)"
    if status == "failed":
        held = group["held"]
        return "an unknown rate (a run failed" + (f"; {held['rate']:g} req/s held)" if held else ")")
    return f"{group['capacity']:g} req/s"


def _bracket_table(groups) -> Table:
    rows = []
    for g in groups:
        held, broke = g["held"], g["broke"]
        capacity = "n/a" if held is None else f"{held['rate']:g}"
        if g["status"] == "failed":
            capacity = "unknown: a run failed" + ("" if held is None else f" ({capacity} held)")
        rows.append([_who(g), capacity,
                     "n/a" if held is None else f"{100 * held['attainment']:.1f}",
                     "n/a" if broke is None else f"{broke['rate']:g}",
                     "n/a" if broke is None else f"{100 * broke['attainment']:.1f}",
                     "n/a" if g["bracket_width"] is None else f"{100 * g['bracket_width']:.1f}%",
                     str(len(g["probes"])),
                     "n/a" if held is None else
                     "yes" if g.get("steady_state_warning") is None else "no (see below)"])
    return Table(["Policy", "Capacity (req/s)", "SLO met at capacity (%)", "First broken (req/s)",
                  "SLO met where broken (%)", "Bracket", "Runs", "Queue settled at capacity"], rows)


def _curve(group: Mapping[str, Any], out_dir: Path) -> CapacityCurve:
    """A group's probes, with each tenant's attainment from the probe's summary.json."""
    per_tenant: dict[str, list[tuple[float, float]]] = {}
    probes = []
    for p in group["probes"]:
        if p["attainment"] is None:
            continue
        probes.append((p["rate"], p["attainment"]))
        summary = read_json(out_dir / RUNS_DIR / p["run"] / "summary.json")
        for tenant, row in summary["per_tenant"].items():
            total = row["completed"] + row["rejected"]
            per_tenant.setdefault(tenant, []).append((p["rate"], row["within_slo"] / total if total else 0.0))
    return CapacityCurve(probes, per_tenant, group["capacity"],
                         None if group["broke"] is None else group["broke"]["rate"])


def _method(criterion: str, tolerance: float, start: Sequence[float]) -> str:
    return (f"Every policy ran the same seeded workload, rescaled to each rate probed, starting from "
            f"{', '.join(f'{r:g}' for r in start)} req/s. While every rate held, the next was higher by a "
            "factor 1.1 (squared at each further step), while every rate broke, lower by it; then the "
            "bracket between the last rate that held and the first that broke was bisected (in log "
            f"space) until it was within {tolerance:.0%}. A rate holds when it meets {criterion} (attainment: "
            "the share of all requests that finish within their SLOs, a request's own SLO first; rejected "
            "requests count as misses, and as slower than every finished request in a percentile). Each "
            "probe is an ordinary run directory under runs/: rerunning the command reuses them.")


def _longer(data: Mapping[str, Any], counts: list[int]) -> str:
    """How to get a longer run: a larger --num-requests, unless the trace ran out first."""
    asked = data.get("num_requests")
    if asked and max(counts) < asked:
        return (f"a longer trace: this one holds {max(counts):,} requests, fewer than "
                f"--num-requests {asked:,}")
    return "a larger --num-requests"


def _run_length(groups, out_dir: Path, data: Mapping[str, Any]) -> list:
    spans = []
    for g in groups:
        if g["held"] is not None:
            arrivals = read_requests(out_dir / RUNS_DIR / g["held"]["run"]).column("arrival_s")
            spans.append((len(arrivals), float(arrivals.max() - arrivals.min())))
    doc = []
    if spans:
        counts = sorted({n for n, _ in spans})
        low, high = min(s for _, s in spans), max(s for _, s in spans)
        digits = 0 if f"{low:,.0f}" != f"{high:,.0f}" else 1
        span = f"{low:,.{digits}f} to {high:,.{digits}f}" if f"{low:,.{digits}f}" != f"{high:,.{digits}f}" \
            else f"{low:,.{digits}f}"
        doc.append(Text(
            f"Each run replays {', '.join(f'{n:,}' for n in counts)} requests: {span} s of "
            "arrivals at the capacities found. A run answers whether the SLOs hold for that long: an overload "
            "so slight that its queue needs longer to push latencies past the SLOs goes unseen, so a capacity "
            f"from a short run is an upper bound, and a longer run ({_longer(data, counts)}) gives an equal "
            "or lower one. A policy that meets the target by giving up one tenant drops the most as runs grow, "
            "because the requests it gives up wait longer and longer. The answer is also that of one sample "
            "of arrivals (--seed): near a capacity, bursts decide which requests miss, so another seed can "
            "move it; rerun with --seed N to see by how much."))
    unsteady = [f"{_who(g)}: {g['steady_state_warning']}." for g in groups if g.get("steady_state_warning")]
    if unsteady:
        doc += [Text("Where the queue had not settled at the capacity: a longer run at that rate would "
                     "likely miss the target, so treat these capacities as upper bounds."),
                Bullets(unsteady)]
    elif spans:
        doc.append(Text("At every capacity the waiting queue had settled by the end of the run (it did not grow "
                        "over the second half of the arrivals), so a longer run should give about the same answer."))
    return doc
