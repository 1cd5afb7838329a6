"""What a comparison found, in prose: where each policy breaks and why, which runs were
overloaded or rejected requests, and which policy wins each metric when it wins clearly.

    group = analyse(points)           # one variant group's points, analysed once
    blocks = findings(group)          # Bullets, Text and Table blocks for the report

`analyse` also serves the figures (`reports/report_figures.py`): the SLO tiers, the breaks
and the rate where the policies differ most are decided here, once, so prose and figures
cannot disagree.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from servelab.reports.comparison import ReportPoint, leaders, windowed_jain
from servelab.reports.document import Bullets, Table, Text
from servelab.reports.health import Overload, format_reasons, overload, rejection_reasons
from servelab.reports.metrics import slo_outcomes
from servelab.reports.slo import (Break, Tier, broken_tiers, find_break, slo_attainment,
                                  slo_tiers, tier_p99)

WIN_MARGIN = 0.05
"""A policy wins a metric only when it beats every other by more than this (relative)."""
#: Metrics a policy can win: (key, name, better = max or min, unit, decimals); windowed_jain
#: is computed here, the others are summary.json's.
WIN_METRICS: tuple[tuple[str, str, Callable, str, int], ...] = (
    ("request_goodput", "goodput", max, "req/s", 2),
    ("p99_ttft_ms", "p99 TTFT", min, "ms", 0),
    ("mean_ttft_ms", "mean TTFT", min, "ms", 0),
    ("p99_tpot_ms", "p99 TPOT", min, "ms", 1),
    ("p99_e2el_ms", "p99 E2E latency", min, "ms", 0),
    ("windowed_jain", "Jain's index over time windows", max, "", 3),
    ("num_preemptions", "preemptions", min, "", 0),
)


@dataclass(frozen=True)
class Group:
    """One variant group's points and what is derived from them (each computed once)."""

    points: list[ReportPoint]
    series: dict[str, list[ReportPoint]]
    """Policy -> its points by rate."""
    tiers: list[Tier]
    global_slos: tuple[float | None, float | None]
    """The global TTFT / TPOT SLOs that some request falls under (None where every request
    carries its own): only those can break through the overall p99."""
    breaks: dict[str, Break | None]
    attainment: dict[str, float]
    """Point name -> share of requests within their SLOs."""
    tier_p99: dict[str, dict[Tier, float | None]]
    overloaded: dict[str, Overload | None]
    windowed: dict[str, float]
    """Point name -> windowed Jain index."""
    divergent_rate: float
    """The rate at which the policies differ most (see `analyse`)."""

    @property
    def rates(self) -> list[float]:
        return sorted({p.rate for p in self.points})

    def holds(self, point: ReportPoint) -> bool:
        ttft, tpot = self.global_slos
        return find_break([(point.rate, point.summary)], slo_ttft_ms=ttft, slo_tpot_ms=tpot) is None


def analyse(points: Sequence[ReportPoint]) -> Group:
    """Analyse one group. The divergent rate maximises the spread of SLO attainment across
    the policies (then the spread of log p99 TTFT, then the higher rate): where the choice
    of policy matters most, which is what the time series should show."""
    series: dict[str, list[ReportPoint]] = {}
    for p in points:
        series.setdefault(p.policy, []).append(p)
    series = {policy: sorted(pts, key=lambda p: p.rate) for policy, pts in series.items()}
    first = points[0]
    tiers = slo_tiers(first.config, first.requests)
    global_slos = tuple(None if any(t.tenant is not None for t in tiers if t.metric == m)
                        else first.config[f"slo_{m}_ms"] for m in ("ttft", "tpot"))
    breaks = {policy: find_break([(p.rate, p.summary) for p in pts], slo_ttft_ms=global_slos[0],
                                 slo_tpot_ms=global_slos[1]) for policy, pts in series.items()}
    attainment = {p.name: slo_attainment(p.summary) for p in points}

    def spread(rate: float) -> tuple[float, float, float]:
        at = [p for p in points if p.rate == rate]
        att = [attainment[p.name] for p in at]
        ttft = [math.log(p.summary["p99_ttft_ms"]) for p in at if p.summary["p99_ttft_ms"]]
        return (round(max(att) - min(att), 4), (max(ttft) - min(ttft)) if ttft else 0.0, rate)

    rates = sorted({p.rate for p in points})
    return Group(list(points), series, tiers, global_slos, breaks, attainment,
                 {p.name: {t: tier_p99(p.requests, t) for t in tiers} for p in points},
                 {p.name: overload(p.requests) for p in points},
                 {p.name: windowed_jain(p.requests, _weights(p)) for p in points},
                 max(rates, key=spread))


def _weights(point: ReportPoint) -> dict[str, float] | None:
    return point.config["policy_options"].get("weights") if point.policy == "fair" else None


def break_tiers(group: Group, policy: str) -> list[Tier]:
    """The SLO tiers a policy exceeded at its breaking rate (where its figure marks it)."""
    b = group.breaks[policy]
    if b is None:
        return []
    point = next(p for p in group.series[policy] if p.rate == b.rate)
    return broken_tiers(point.requests, group.tiers)


# --------------------------------------------------------------------------- prose
def findings(group: Group) -> list:
    items = []
    top = max(group.rates)
    for policy, pts in group.series.items():
        b = group.breaks[policy]
        if b is None:
            worst = min(group.attainment[p.name] for p in pts)
            items.append(f"{policy} holds at every rate run (up to {top:g} req/s"
                         + (f"; lowest SLO attainment {worst:.0%})." if group.tiers else ")."))
        else:
            point = next(p for p in pts if p.rate == b.rate)
            items.append(f"{policy} breaks at {b.rate:g} req/s: {b.reason}{_misses(point)}.")
    doc: list = [Bullets(items), Text(_verdict(group))]
    doc += _health(group)
    tenants = sorted({t for p in group.points for t in p.summary["per_tenant"]})
    rate = group.divergent_rate
    at = {p.policy: p.summary for p in group.points if p.rate == rate}
    if len(tenants) > 1:
        doc += [Text(f"Mean TTFT per tenant at {rate:g} req/s, where the policies differ most (ms): "
                     "who pays for the load."),
                Table(["Policy", *tenants], [[pol, *(_ms(s["per_tenant"].get(t, {}).get("mean_ttft_ms"))
                                                     for t in tenants)] for pol, s in at.items()])]
    doc += [Text(f"Best policy per metric at each rate: the winner and its value when it leads every "
                 f"other policy by more than {WIN_MARGIN:.0%}. Only the policies that hold their SLOs "
                 "at a rate compete there; 'all break' when none does."), _winner_table(group)]
    return doc


def _misses(point: ReportPoint) -> str:
    """' (misses: 690 interactive TTFT, 25 batch TPOT, 12 rejected)': who missed what."""
    cfg = point.config
    out = slo_outcomes(point.requests, slo_ttft_ms=cfg["slo_ttft_ms"], slo_tpot_ms=cfg["slo_tpot_ms"])
    counts: Counter = Counter()
    for i, r in enumerate(point.requests):
        if not out.finished[i]:
            counts["rejected"] += 1
        for name, missed in (("TTFT", out.ttft_missed), ("TPOT", out.tpot_missed)):
            if missed[i]:
                counts[f"{r.tenant} {name}" if r.tenant != "default" else name] += 1
    if not counts:
        return ""
    return " (misses: " + ", ".join(f"{n:,} {what}" for what, n in counts.most_common(4)) + ")"


def _verdict(group: Group) -> str:
    breaks, rates = group.breaks, group.rates
    if all(b is None for b in breaks.values()):
        return "Every policy meets the SLOs at every rate run: raise the rates to find where they differ."
    if all(b is not None and b.rate == rates[0] for b in breaks.values()):
        return (f"Every policy breaks already at the lowest rate run ({rates[0]:g} req/s): lower the rates "
                "(or relax the SLOs) to find where they hold.")
    last = max(math.inf if b is None else b.rate for b in breaks.values())
    best = [pol for pol, b in breaks.items() if (math.inf if b is None else b.rate) == last]
    top = max(rates)
    at_top = {pol: next(group.attainment[p.name] for p in group.series[pol] if p.rate == top)
              for pol in best if any(p.rate == top for p in group.series[pol])}
    shares = "; ".join(f"{at_top[p]:.0%} of requests within SLO at {top:g} req/s" for p in best if p in at_top)
    if len(best) == len(breaks):   # every policy breaks at the same rate
        ahead, clear = leaders(at_top, max, WIN_MARGIN)
        if not clear:
            return f"No policy sustains more load than the others: all break at {last:g} req/s."
        return (f"Every policy breaks at {last:g} req/s; there {' and '.join(ahead)} keeps the most "
                f"requests within SLO ({', '.join(f'{at_top[p]:.0%}' for p in ahead)}).")
    how = "never breaks at the rates run" if last == math.inf else f"breaks last, at {last:g} req/s"
    held_over = sorted({p.rate for pol in best for p in group.series[pol]
                        if group.overloaded[p.name] is not None
                        and (last == math.inf or p.rate < last)})
    one = len(best) == 1
    bound = (f" {'It holds' if one else 'They hold'} while overloaded at "
             f"{', '.join(f'{r:g}' for r in held_over)} req/s, where latencies grow with the run's "
             f"length: a longer run may break {'it' if one else 'them'} sooner."
             if held_over else "")
    return f"Most load within SLO: {' and '.join(best)} ({how}{'; ' + shares if shares else ''}).{bound}"


def _health(group: Group) -> list:
    doc = []
    over: dict[float, list[str]] = {}
    for p in group.points:
        if group.overloaded[p.name] is not None:
            over.setdefault(p.rate, []).append(p.policy)
    if over:
        where = "; ".join(f"at {rate:g} req/s: {', '.join(pols)}" for rate, pols in sorted(over.items()))
        doc.append(Text(f"Overloaded runs ({where}): the waiting queue never emptied over the last quarter "
                        "of the arrivals, held a backlog for most of them, or the run outlasted its arrivals "
                        "by far. Their latencies depend on how long the run is, so compare them across "
                        "policies, not with production numbers."))
    rejected = [(p, format_reasons(rejection_reasons(p.requests))) for p in group.points
                if p.summary["rejected"]]
    if rejected and len(rejected) == len(group.points) and len({why for _, why in rejected}) == 1:
        doc.append(Text(f"Rejected requests (counted as missing their SLOs), the same in every run: "
                        f"{rejected[0][1]}."))
    elif rejected:
        doc += [Text("Rejected requests (counted as missing their SLOs):"),
                Bullets([f"{p.policy} at {p.rate:g} req/s: {why}" for p, why in rejected])]
    if all(p.summary["num_preemptions"] == 0 for p in group.points):
        peak = max((p.summary["max_kv_cache_usage"] or 0.0) for p in group.points)
        doc.append(Text(f"No request was preempted at any rate (peak KV-cache usage {peak:.0%}), so "
                        "there is no preemptions figure."))
    return doc


def _winner_table(group: Group) -> Table:
    rows = []
    for key, name, better, unit, decimals in WIN_METRICS:
        row = [name + (f" ({unit})" if unit else "")]
        for rate in group.rates:
            at = [p for p in group.points if p.rate == rate and group.holds(p)]
            values = {p.policy: group.windowed[p.name] if key == "windowed_jain" else p.summary[key]
                      for p in at}
            won, clear = leaders(values, better, WIN_MARGIN)
            shown = sorted({f"{values[p]:,.{decimals}f}" for p in won}, key=lambda v: float(v.replace(",", "")))
            if not at:
                row.append("all break")
            elif len(at) == 1:
                row.append(f"{at[0].policy} (the only one holding)")
            elif len(set(values.values())) == 1:   # equal, not merely equal when rounded
                row.append(f"all equal ({shown[0]})")
            elif not clear:
                row.append(f"no clear winner (within {WIN_MARGIN:.0%})")
            else:
                row.append(f"{'/'.join(won)} ({' to '.join([shown[0], shown[-1]][:len(shown)])})")
        rows.append(row)
    return Table(["Metric", *(f"{r:g} req/s" for r in group.rates)], rows)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def summary_cells(point: ReportPoint, columns: Sequence[tuple[str, str, int]]) -> list[str]:
    """A point's summary values for the table, rounded; 'n/a' for a statistic of nothing."""
    return ["n/a" if point.summary[key] is None else f"{point.summary[key]:.{d}f}" for _, key, d in columns]


def constant(points: Sequence[ReportPoint], key: str, decimals: int) -> float | None:
    """The value of summary[key] when it reads the same at every point, rounded to
    `decimals` (else None)."""
    values = {None if p.summary[key] is None else round(p.summary[key], decimals) for p in points}
    return values.pop() if len(values) == 1 else None
