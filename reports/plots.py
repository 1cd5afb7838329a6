"""Figures of a policy comparison: each function takes plain data and returns a matplotlib
`Figure` (never shown, never saved here), so tests inspect its lines and bars before
`png_bytes` renders it. Figures against the request rate live in `reports/plots_load.py`.

Figures are built on `matplotlib.figure.Figure` directly, not through pyplot: no global
figure registry, nothing to close, safe to build many in one process. One colour per
policy across every figure (`policy_colours`); tenants are told apart by line style.
Every plotted series carries a gid ("policy:<name>", "throughput:<name>",
"break:<name>", "slo:<metric>", "tenant:<policy>:<tenant>") naming what it shows.

Costs: latency CDFs draw at most CDF_POINTS points per line and timelines at most `bins`
points per line, whatever the run's size; rendering a figure to PNG takes ~0.1-0.5 s.
"""
from __future__ import annotations

import contextlib
import io
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter

from servelab.records import StepRecord

POLICY_COLOURS: dict[str, str] = {
    "fcfs": "#1f77b4", "priority": "#ff7f0e", "sjf": "#2ca02c", "fair": "#d62728",
}
"""The fixed colour of each built-in policy (matplotlib's tab10 blue, orange, green, red)."""
_EXTRA_COLOURS = ("#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")
TENANT_STYLES = ("-", "--", ":", "-.")
CDF_POINTS = 2000
LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2E latency"))
_STYLE = {
    "font.size": 11, "axes.titlesize": 12, "axes.labelsize": 11, "legend.fontsize": 10,
    "xtick.labelsize": 10, "ytick.labelsize": 10, "figure.titlesize": 14,
    "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False,
}


def policy_colours(policies: Iterable[str]) -> dict[str, str]:
    """Built-in policies keep their fixed colour; others get the extra colours in name order."""
    policies = list(dict.fromkeys(policies))
    extra = sorted(p for p in policies if p not in POLICY_COLOURS)
    colours = {p: _EXTRA_COLOURS[i % len(_EXTRA_COLOURS)] for i, p in enumerate(extra)}
    return {p: POLICY_COLOURS.get(p) or colours[p] for p in policies}


@contextlib.contextmanager
def _style() -> Iterator[None]:
    """Readable fonts and light grids for the figures built inside (restored on exit)."""
    with matplotlib.rc_context(_STYLE):
        yield


def png_bytes(fig: Figure, dpi: int = 100) -> bytes:
    """The figure as PNG bytes (no software-version metadata: same figure, same bytes)."""
    buf = io.BytesIO()
    with _style():  # ticks created while drawing read the style too
        fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


def _rate_label(rate: float) -> str:
    return f"{rate:g} req/s"


def _legend_on_top(fig: Figure, handles, labels, y: float) -> None:
    """One legend for the whole figure, centred at height y (figure fraction)."""
    fig.legend(handles, labels, loc="upper center", ncol=max(1, len(labels)),
               bbox_to_anchor=(0.5, y), frameon=False)


def _width(i: int, n: int) -> float:
    """Line width of the i-th of n series: the first drawn widest, so that series lying on
    top of each other still show every colour."""
    return 1.4 + 0.5 * (n - 1 - i)


def _ecdf(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted values, fraction <= value), thinned to CDF_POINTS quantiles for large inputs."""
    values = np.sort(np.asarray(values, dtype=float))
    if len(values) > CDF_POINTS:
        probs = np.linspace(0.0, 1.0, CDF_POINTS)
        return np.quantile(values, probs), probs
    return values, np.arange(1, len(values) + 1) / len(values)


def _margins(height_in: float, top_in: float, bottom_in: float = 0.6, **kw) -> dict:
    """Subplot margins for a figure `height_in` tall with `top_in` inches above the axes
    (title, legend) and `bottom_in` below: fixed margins, no layout engine (whose extra
    draw pass would double the rendering time)."""
    return {"top": 1 - top_in / height_in, "bottom": bottom_in / height_in, **kw}


def _log_scale(axis) -> None:
    """Log scale with plain-number labels (10, 200, 5000), minor ticks labelled when the
    data spans too few decades for the major ones to read."""
    if axis is axis.axes.xaxis:
        axis.axes.set_xscale("log")
    else:
        axis.axes.set_yscale("log")
    axis.set_major_formatter(_PlainLogFormatter(labelOnlyBase=False))
    axis.set_minor_formatter(_PlainLogFormatter(labelOnlyBase=False, minor_thresholds=(1.2, 0.5)))


class _PlainLogFormatter(LogFormatter):
    """LogFormatter's choice of which log ticks to label, written as plain numbers
    (0.5, 20, 12,000) rather than 1e+04."""

    def _num_to_string(self, x, vmin, vmax):
        return f"{x:,.0f}" if x >= 1000 else f"{x:g}"


# --------------------------------------------------------------------------- latency CDFs
def latency_cdfs(latencies: Mapping[float, Mapping[str, Mapping[str, np.ndarray]]],
                 colours: Mapping[str, str], title: str) -> Figure:
    """One row per request rate, one column per latency (TTFT, TPOT, E2E), one line per
    policy: latencies[rate][policy][metric] holds the finished requests' values in ms."""
    rates = sorted(latencies)
    height = 3.0 * len(rates) + 1.3
    with _style():
        fig = Figure(figsize=(13, height))
        axes = fig.subplots(len(rates), len(LATENCIES), squeeze=False, gridspec_kw=_margins(
            height, 1.1, left=0.06, right=0.985, hspace=0.55, wspace=0.22))
        for row, rate in zip(axes, rates):
            for ax, (metric, name) in zip(row, LATENCIES):
                by_policy = latencies[rate]
                for i, (policy, by_metric) in enumerate(by_policy.items()):
                    values = np.asarray(by_metric.get(metric, ()), dtype=float)
                    values = values[values > 0]
                    if not len(values):
                        continue
                    x, y = _ecdf(values)
                    ax.step(x, y, where="post", color=colours[policy], lw=_width(i, len(by_policy)),
                            label=policy, gid=f"policy:{policy}")
                _log_scale(ax.xaxis)
                ax.set_ylim(0, 1.02)
                ax.set_title(f"{name} at {_rate_label(rate)}")
                ax.set_xlabel(f"{name} (ms, log scale)")
                ax.set_ylabel("fraction of requests")
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.suptitle(title, y=1 - 0.15 / height)
        _legend_on_top(fig, handles, labels, y=1 - 0.5 / height)
    return fig


# --------------------------------------------------------------------------- timelines
def _integral(start: np.ndarray, end: np.ndarray, values: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Sum over records of the integral of `values` over [start, end) up to each time in
    `at` (records may overlap: replicas). Prefix sums over the records sorted by start and by
    end: O(n log n + len(at) log n), no per-record-per-bin work."""
    def ramp(times: np.ndarray) -> np.ndarray:  # sum of v * max(0, t - time) over records
        order = np.argsort(times, kind="stable")
        t, v = times[order], values[order]
        cum_v = np.concatenate([[0.0], np.cumsum(v)])
        cum_vt = np.concatenate([[0.0], np.cumsum(v * t)])
        k = np.searchsorted(t, at, side="left")
        return at * cum_v[k] - cum_vt[k]
    return ramp(start) - ramp(end)


def _time_mean(start: np.ndarray, duration: np.ndarray, values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Time-weighted mean of a piecewise-constant signal per bin (NaN where nothing ran)."""
    end = start + duration
    covered = np.diff(_integral(start, end, np.ones_like(values), edges))
    total = np.diff(_integral(start, end, values, edges))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(covered > 1e-12 * (edges[-1] - edges[0]), total / covered, np.nan)


def timeline(steps: Mapping[str, Sequence[StepRecord]], colours: Mapping[str, str], title: str,
             bins: int = 240) -> Figure:
    """KV-cache usage (% of blocks) and waiting requests over simulated time, one line per
    policy; each step's values hold over its duration, averaged over `bins` time bins
    (gaps: no step ran, the engine was idle)."""
    height = 7.5
    with _style():
        fig = Figure(figsize=(12, height))
        ax_kv, ax_q = fig.subplots(2, 1, sharex=True, gridspec_kw=_margins(
            height, 1.1, left=0.08, right=0.985, hspace=0.25))
        for i, (policy, records) in enumerate(steps.items()):
            if not records:
                continue
            start = np.fromiter((s.start_s for s in records), float, len(records))
            dur = np.fromiter((s.duration_s for s in records), float, len(records))
            kv = np.fromiter((s.kv_blocks_used / s.kv_blocks_total for s in records), float, len(records))
            waiting = np.fromiter((s.num_waiting for s in records), float, len(records))
            edges = np.linspace(start.min(), (start + dur).max(), bins + 1)
            if edges[-1] <= edges[0]:
                edges = np.array([edges[0], edges[0] + 1.0])
            mid = (edges[:-1] + edges[1:]) / 2
            colour = colours[policy]
            width = _width(i, len(steps)) * 0.8
            ax_kv.plot(mid, 100 * _time_mean(start, dur, kv, edges), color=colour, lw=width,
                       label=policy, gid=f"policy:{policy}")
            ax_q.plot(mid, _time_mean(start, dur, waiting, edges), color=colour, lw=width,
                      label=policy, gid=f"policy:{policy}")
        ax_kv.set_title("KV-cache usage")
        ax_kv.set_ylabel("KV blocks in use (% of pool)")
        ax_kv.set_ylim(bottom=0)
        ax_q.set_title("queue length")
        ax_q.set_ylabel("waiting requests")
        ax_q.set_xlabel("simulated time (s)")
        ax_q.set_ylim(bottom=0)
        handles, labels = ax_kv.get_legend_handles_labels()
        fig.suptitle(title, y=1 - 0.15 / height)
        _legend_on_top(fig, handles, labels, y=1 - 0.5 / height)
    return fig


# --------------------------------------------------------------------------- bars
def _grouped_bars(ax, groups: Sequence[str], values: Mapping[str, Sequence[float]],
                  colours: Mapping[str, str], fmt: str) -> None:
    """Bars per group (x), one per policy side by side, with their values on top."""
    width = 0.8 / max(1, len(values))
    x = np.arange(len(groups))
    for i, (policy, ys) in enumerate(values.items()):
        bars = ax.bar(x - 0.4 + width * (i + 0.5), ys, width, color=colours[policy], label=policy,
                      gid=f"policy:{policy}")
        ax.bar_label(bars, fmt=fmt, fontsize=8, padding=2)
    ax.set_xticks(x, groups)
    ax.margins(y=0.15)
    ax.grid(axis="x", visible=False)


def preemptions(counts: Mapping[str, Sequence[tuple[float, int]]], colours: Mapping[str, str],
                title: str) -> Figure:
    """Preemptions per policy (bars) at each request rate (groups): counts[policy] = [(rate, n)]."""
    rates = sorted({rate for pairs in counts.values() for rate, _ in pairs})
    values = {p: [dict(pairs).get(rate, 0) for rate in rates] for p, pairs in counts.items()}
    height = 5.0
    with _style():
        fig = Figure(figsize=(10, height))
        ax = fig.subplots(gridspec_kw=_margins(height, 0.5, left=0.09, right=0.985))
        _grouped_bars(ax, [_rate_label(r) for r in rates], values, colours, "%d")
        ax.set_xlabel("request rate")
        ax.set_ylabel("preemptions (count)")
        ax.set_title(title)
        ax.set_ylim(bottom=0, top=max(1, ax.get_ylim()[1]))
        ax.legend(loc="upper left", frameon=False, ncol=len(values))
    return fig


@dataclass(frozen=True)
class MemoryStats:
    slot_utilization: float
    """Tokens held by the step's sequences / KV token slots allocated (reservations included),
    time-weighted; 1 - it is the waste."""
    max_concurrent: int
    """Most requests running at once."""
    mean_kv_usage: float
    """Mean fraction of the KV pool allocated."""


def memory_waste(stats: Mapping[str, Mapping[str, MemoryStats]], colours: Mapping[str, str],
                 title: str) -> Figure:
    """KV memory held vs reserved and the concurrency it buys, per block manager (groups)
    and policy (bars): stats[block_manager][policy]."""
    managers = list(stats)
    policies = list(dict.fromkeys(p for by_policy in stats.values() for p in by_policy))

    def column(attr: str, scale: float = 1.0) -> dict[str, list[float]]:
        return {p: [scale * getattr(stats[m][p], attr) if p in stats[m] else 0.0 for m in managers]
                for p in policies}

    height = 5.5
    with _style():
        fig = Figure(figsize=(14, height))
        ax_util, ax_pool, ax_conc = fig.subplots(1, 3, gridspec_kw=_margins(
            height, 1.15, 1.1, left=0.06, right=0.99, wspace=0.28))
        _grouped_bars(ax_util, managers, column("slot_utilization", 100), colours, "%.0f")
        ax_util.set_title("KV slots holding tokens")
        ax_util.set_ylabel("% of allocated slots (time-weighted)")
        _grouped_bars(ax_pool, managers, column("mean_kv_usage", 100), colours, "%.0f")
        ax_pool.set_title("KV pool allocated")
        ax_pool.set_ylabel("% of KV blocks (time-weighted)")
        _grouped_bars(ax_conc, managers, column("max_concurrent"), colours, "%d")
        ax_conc.set_title("peak concurrency")
        ax_conc.set_ylabel("max running requests")
        for ax in (ax_util, ax_pool, ax_conc):
            ax.set_xlabel("block manager")
            ax.tick_params(axis="x", labelrotation=15)
        handles, labels = ax_util.get_legend_handles_labels()
        fig.suptitle(title, y=1 - 0.12 / height)
        _legend_on_top(fig, handles, labels, y=1 - 0.45 / height)
    return fig


# --------------------------------------------------------------------------- fairness
def tenant_styles(first: Sequence[str], tenants) -> dict[str, str]:
    """Line style per tenant, the same in every figure of a report: the tenants of `first`
    in its order (the reports pass the tightest SLO first, drawn solid), then the rest by
    name."""
    order = [t for t in first if t in set(tenants)] + sorted(set(tenants) - set(first))
    return {t: TENANT_STYLES[i % len(TENANT_STYLES)] for i, t in enumerate(order)}


def fairness(service: Mapping[str, Mapping[str, tuple[np.ndarray, np.ndarray]]],
             jain: Mapping[str, Sequence[tuple[float, float, float]]], colours: Mapping[str, str],
             title: str, tenants_first: Sequence[str] = ()) -> Figure:
    """Top: per policy, each tenant's service rate over time (service[policy][tenant] =
    (window centres in s, tokens/s)), tenants styled by `tenant_styles(tenants_first, ...)`.
    Bottom: Jain's fairness index against the request rate, over the whole run (solid) and
    its mean over time windows (dashed): jain[policy] = [(rate, whole-run index, windowed
    index)]."""
    policies = list(service)
    style = tenant_styles(tenants_first, {t for by_tenant in service.values() for t in by_tenant})
    height = 8.5
    with _style():
        fig = Figure(figsize=(max(10.0, 3.6 * len(policies)), height))
        grid = fig.add_gridspec(2, max(1, len(policies)), **_margins(
            height, 0.95, left=0.07, right=0.985, hspace=0.4, wspace=0.12))
        top = [fig.add_subplot(grid[0, i]) for i in range(len(policies))]
        for ax in top[1:]:
            ax.sharey(top[0])
            ax.tick_params(labelleft=False)
        for ax, policy in zip(top, policies):
            for tenant, (t, rate) in sorted(service[policy].items()):
                ax.plot(t, rate, style[tenant], color=colours[policy], lw=1.8, label=tenant,
                        gid=f"tenant:{policy}:{tenant}")
            ax.set_title(policy)
            ax.set_xlabel("simulated time (s)")
            ax.legend(title="tenant", frameon=False, fontsize=9)
        if top:
            top[0].set_ylabel("service (weighted tokens/s)")
            top[0].set_ylim(bottom=0)
        ax_jain = fig.add_subplot(grid[1, :])
        low = 1.0
        for i, (policy, triples) in enumerate(jain.items()):
            triples = sorted(triples)
            rates = [t[0] for t in triples]
            ax_jain.plot(rates, [t[1] for t in triples], "o-", color=colours[policy], lw=_width(i, len(jain)),
                         label=policy, gid=f"policy:{policy}")
            ax_jain.plot(rates, [t[2] for t in triples], "s--", color=colours[policy], lw=1.4, ms=4,
                         label=f"_{policy} windowed", gid=f"windowed:{policy}")
            low = min([low, *(t[1] for t in triples), *(t[2] for t in triples)])
        ax_jain.set_ylim(max(0.0, low - 0.05), 1.005)
        ax_jain.set_title("Jain's index over tenants' service: whole run (solid), mean over time "
                          "windows (dashed); 1 = perfectly fair")
        ax_jain.set_xlabel("request rate (req/s)")
        ax_jain.set_ylabel("Jain's index")
        ax_jain.legend(frameon=False, ncol=max(1, len(jain)), loc="best")
        fig.suptitle(title + "\n(service: 1 x prompt + 2 x output tokens of finished requests, "
                     "as VTC counts it)", y=1 - 0.1 / height)
    return fig
