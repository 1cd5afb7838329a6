"""Figures against the request rate: latencies per SLO tier with the SLOs drawn, SLO
attainment and goodput (`rate_sweep`), and the capacity search's attainment curves
(`attainment_curves`). Like `reports/plots.py`, each function takes plain data and returns
a matplotlib Figure; every series carries a gid naming what it shows ("policy:<name>",
"tier:<policy>:<metric>:<tenant>", "slo:<metric>:<tenant>", "breakmark:<policy>:<panel>",
"capacity:<policy>", "target").

Honesty rules these figures keep: every SLO that can break is drawn (one line per tenant
when requests carry their own), and a break is marked only on a panel where the value
crossed its line (or attainment fell below its target), never on every panel.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from servelab.reports.plots import _legend_on_top, _log_scale, _margins, _style, _width, tenant_styles
from servelab.reports.slo import Tier, describe_tier, tenants_tightest_first


@dataclass(frozen=True)
class RatePoint:
    rate: float
    summary: Mapping
    """The run's summary.json."""
    attainment: float
    """Share of all requests within their SLOs."""
    tier_p99: Mapping[Tier, float | None] = field(default_factory=dict)
    """p99 of each SLO tier's latency (its tenant's finished requests)."""


@dataclass(frozen=True)
class BreakMarks:
    """Where a policy broke, and on which panels to mark it."""

    rate: float
    tiers: tuple[Tier, ...]
    """SLO tiers whose p99 exceeded their SLO at that rate."""
    attainment: bool
    """Attainment fell below the target there."""


def _tenant_styles(tiers: Sequence[Tier]) -> dict[str | None, str]:
    """Line style per tenant: solid for the tenant with the tightest SLO (whose breaks
    matter first), then dashed, dotted, ..."""
    tenants = tenants_tightest_first(tiers)
    styles: dict[str | None, str] = {None: "-"}
    styles.update(tenant_styles(tenants, tenants))
    return styles


def rate_sweep(series: Mapping[str, Sequence[RatePoint]], tiers: Sequence[Tier],
               colours: Mapping[str, str], title: str, *, breaks: Mapping[str, BreakMarks | None],
               target: float) -> Figure:
    """Four panels against the request rate, one colour per policy: p99 TTFT and p99 TPOT of
    each SLO tier (line style per tenant, the tier's SLO as a grey line of that style; the
    overall p99 when no SLO applies), SLO attainment with its target, and goodput
    (throughput dashed). A break (`breaks[policy]`) is marked with an X only on the panels
    whose value crossed its line at that rate."""
    styles = _tenant_styles(tiers)
    height = 9.5
    with _style():
        fig = Figure(figsize=(12, height))
        axes = fig.subplots(2, 2, gridspec_kw=_margins(height, 1.5, left=0.08, right=0.985,
                                                        hspace=0.38, wspace=0.22)).ravel()
        for ax, metric, name in ((axes[0], "ttft", "time to first token"),
                                 (axes[1], "tpot", "time per output token")):
            _latency_panel(ax, series, [t for t in tiers if t.metric == metric], metric, styles,
                           colours, breaks)
            ax.set_title(f"p99 {name}" + (" per tenant" if len(styles) > 1 else ""))
            ax.set_ylabel(f"p99 {metric.upper()} (ms, log scale)")
        _attainment_panel(axes[2], series, colours, breaks, target)
        _goodput_panel(axes[3], series, colours)
        for ax in axes:
            ax.set_xlabel("request rate (req/s)")
        handles = [Line2D([], [], color=colours[p], lw=2.5, marker="o", label=p) for p in series]
        handles += [Line2D([], [], color="black", ls=styles[t], lw=1.5, label=t)
                    for t in styles if t is not None]
        fig.suptitle(title + "\n(X: the rate at which a policy breaks, on the metric that broke)",
                     y=1 - 0.12 / height)
        _legend_on_top(fig, handles, [h.get_label() for h in handles], y=1 - 0.85 / height)
    return fig


LOG_SPAN = 3.0
"""A latency panel goes to a log scale only when its values and SLO lines span more than
this factor; a narrower range is drawn linear from 0."""


def _latency_panel(ax, series, tiers, metric, styles, colours, breaks) -> None:
    key = f"p99_{metric}_ms"
    lines = tiers or [None]   # no SLO on this metric: the overall p99, nothing can break
    shown = [t.slo_ms for t in tiers]
    for i, (policy, points) in enumerate(series.items()):
        points = sorted(points, key=lambda p: p.rate)
        for tier in lines:
            x, y = [], []
            for p in points:
                value = p.summary.get(key) if tier is None else p.tier_p99.get(tier)
                if value is not None and value > 0:
                    x.append(p.rate)
                    y.append(value)
            tenant = tier.tenant if tier is not None else None
            shown += y
            ax.plot(x, y, marker="o", ls=styles.get(tenant, "-"), color=colours[policy],
                    lw=_width(i, len(series)) * 0.8, ms=4, gid=f"tier:{policy}:{metric}:{tenant}")
            mark = breaks.get(policy)
            if tier is not None and mark is not None and tier in mark.tiers and mark.rate in x:
                ax.plot([mark.rate], [y[x.index(mark.rate)]], "X", color=colours[policy], ms=11,
                        mec="black", mew=0.8, gid=f"breakmark:{policy}:{metric}:{tenant}")
    for tier in tiers:
        ax.axhline(tier.slo_ms, color="0.35", ls=styles[tier.tenant], lw=1.2,
                   gid=f"slo:{metric}:{tier.tenant}")
        ax.annotate(f"SLO {describe_tier(tier)}", (0.01, tier.slo_ms), xycoords=("axes fraction", "data"),
                    va="bottom", fontsize=9, color="0.25")
    if shown and max(shown) > LOG_SPAN * min(shown):
        _log_scale(ax.yaxis)
    elif shown:   # a narrow range on a log axis reads as ticks like 51.99 and 52.01 ms
        ax.set_ylim(0, 1.15 * max(shown))


def _attainment_panel(ax, series, colours, breaks, target: float) -> None:
    for i, (policy, points) in enumerate(series.items()):
        points = sorted(points, key=lambda p: p.rate)
        x, y = [p.rate for p in points], [100 * p.attainment for p in points]
        ax.plot(x, y, "o-", color=colours[policy], lw=_width(i, len(series)), ms=5, gid=f"policy:{policy}")
        mark = breaks.get(policy)
        if mark is not None and mark.attainment and mark.rate in x:
            ax.plot([mark.rate], [y[x.index(mark.rate)]], "X", color=colours[policy], ms=11,
                    mec="black", mew=0.8, gid=f"breakmark:{policy}:attainment")
    ax.axhline(100 * target, color="black", ls="--", lw=1, gid="target")
    ax.annotate(f"target {target:.0%}", (0.01, 100 * target), xycoords=("axes fraction", "data"),
                va="bottom", fontsize=9)
    low = min((100 * p.attainment for pts in series.values() for p in pts), default=100.0)
    ax.set_ylim(max(0.0, min(low, 100 * target) - 5), 101)
    ax.set_title("SLO attainment")
    ax.set_ylabel("requests within their SLOs (%)")


def _goodput_panel(ax, series, colours) -> None:
    for i, (policy, points) in enumerate(series.items()):
        points = sorted(points, key=lambda p: p.rate)
        x = [p.rate for p in points]
        ax.plot(x, [p.summary["request_goodput"] for p in points], "o-", color=colours[policy],
                lw=_width(i, len(series)), ms=5, gid=f"goodput:{policy}")
        ax.plot(x, [p.summary["request_throughput"] for p in points], "--", color=colours[policy],
                lw=1.2, alpha=0.7, gid=f"throughput:{policy}")
    ax.set_ylim(bottom=0)
    ax.set_title("goodput (solid) and throughput (dashed)")
    ax.set_ylabel("requests per second")


# --------------------------------------------------------------------------- capacity
@dataclass(frozen=True)
class CapacityCurve:
    """One policy's probes and what the search concluded."""

    probes: Sequence[tuple[float, float]]
    """(rate, attainment) of every probe."""
    per_tenant: Mapping[str, Sequence[tuple[float, float]]]
    """tenant -> (rate, attainment of that tenant's requests)."""
    capacity: float | None
    """The last rate that held (None: none held)."""
    broke: float | None
    """The first rate that broke (None: none broke)."""


def attainment_curves(curves: Mapping[str, CapacityCurve], target: float | None, colours: Mapping[str, str],
                      title: str, tenants: Sequence[str] | None = None) -> Figure:
    """Left: SLO attainment against the request rate per policy (every probe a marker), the
    target as a dashed line, each policy's capacity as a dotted vertical line with a star
    (and its value in the legend). Right: the same per tenant (line style per tenant, in
    the order of `tenants`: solid first), which shows whose requests a policy gives up first."""
    present = {t for c in curves.values() for t in c.per_tenant}
    styles = tenant_styles(tenants or (), present)
    tenants = list(styles)
    two = len(tenants) > 1
    height = 6.0
    with _style():
        fig = Figure(figsize=(14 if two else 9, height))
        axes = fig.subplots(1, 2 if two else 1, squeeze=False, gridspec_kw=_margins(
            height, 1.25, left=0.06, right=0.985, wspace=0.14))[0]
        ax = axes[0]
        for i, (policy, c) in enumerate(curves.items()):
            x, y = zip(*sorted(c.probes)) if c.probes else ((), ())
            colour = colours[policy]
            ax.plot(x, [100 * v for v in y], "o-", color=colour, lw=_width(i, len(curves)), ms=5,
                    gid=f"policy:{policy}")
            if c.capacity is not None:
                ax.axvline(c.capacity, color=colour, ls=":", lw=1.6, gid=f"capacity:{policy}")
                ax.plot([c.capacity], [100 * dict(c.probes)[c.capacity]], "*", color=colour,
                        ms=18 - 2 * i, mec="black", mew=0.8, gid=f"capacitymark:{policy}")
        if target is not None:   # None: percentile targets decided, no attainment line to draw
            ax.axhline(100 * target, color="black", ls="--", lw=1.2, gid="target")
        ax.set_title("all requests (star: the capacity, the last rate that held)")
        ax.set_ylabel("requests within their SLOs (%)")
        low = min((100 * v for c in curves.values() for _, v in c.probes), default=100.0)
        if two:
            right = axes[1]
            for policy, c in curves.items():
                for tenant in tenants:
                    x, y = zip(*sorted(c.per_tenant.get(tenant, ()))) if c.per_tenant.get(tenant) else ((), ())
                    right.plot(x, [100 * v for v in y], marker="o", ms=3.5, ls=styles[tenant],
                               color=colours[policy], lw=1.6, gid=f"tenant:{policy}:{tenant}")
                    low = min([low, *(100 * v for v in y)])
            if target is not None:
                right.axhline(100 * target, color="black", ls="--", lw=1.0)
            right.set_title("per tenant")
            right.legend([Line2D([], [], color="black", ls=styles[t]) for t in tenants], tenants,
                         title="tenant", frameon=False, loc="lower left")
            right.sharey(ax)
        ax.set_ylim(max(0.0, min(low, 100 * (target or 1)) - 5), 101.5)
        for a in axes:
            a.set_xlabel("request rate (req/s)")
        handles = [Line2D([], [], color=colours[p], lw=2.5, marker="*" if c.capacity is not None else "o",
                          ms=10, mec="black", mew=0.5,
                          label=f"{p}: {c.capacity:g} req/s" if c.capacity is not None else f"{p}: none held")
                   for p, c in curves.items()]
        if target is not None:
            handles.append(Line2D([], [], color="black", ls="--", lw=1.2, label=f"target {target:.0%}"))
        fig.suptitle(title, y=1 - 0.15 / height)
        _legend_on_top(fig, handles, [h.get_label() for h in handles], y=1 - 0.55 / height)
    return fig
