"""The report of a policy comparison: DIR/index.html (self-contained) and DIR/report.md.

    files = write_report(Path("runs/cmp"))    # DIR as `servelab compare` left it

It reads files only: DIR/sweep.json (the grid) and each point's run directory under
DIR/runs (config.json, summary.json, requests.csv, steps.csv), so it can be rebuilt at any
time, and a resumed sweep's report covers every point. The report holds: what was run; where
each policy breaks and which policy wins each metric, in prose; a summary table per policy
and load (values are the runs' summary.json, rounded); and figures (`reports/plots.py`):
latency CDFs, latencies and goodput against the rate with the breaking points marked,
KV-cache usage and queue length over time and per-tenant service at the middle rate,
preemptions, Jain's index, and, when contiguous baselines are in the grid, KV memory held
vs reserved. index.html embeds the PNGs as data URIs and its CSS inline; report.md links
them from DIR/figures/. Both are rendered from one document, so they say the same.

Breaking point: the first rate at which fewer than MIN_ATTAINMENT of the requests met their
SLOs (goodput x duration / all requests, rejected ones counting as misses; a request's own
SLO takes precedence over the global one), or the p99 TTFT / TPOT exceeded a global SLO.

Cost: every point's records are loaded (about 200 bytes per request and per step record),
then each figure is drawn once; seconds for a dozen points of thousands of requests.
"""
from __future__ import annotations

import base64
import html
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from servelab.records import RequestRecord, StepRecord
from servelab.reports import plots
from servelab.reports.metrics import VTC_INPUT_WEIGHT, VTC_OUTPUT_WEIGHT
from servelab.reports.runio import read_json, read_requests_csv, read_steps_csv

# The sweep layout `servelab.sweeps.sweep` writes (reports do not import the simulator).
SWEEP_FILE, RUNS_DIR, DONE_MARKER = "sweep.json", "runs", "done.json"
SWEEP_FORMAT = "servelab.sweep/1"
MIN_ATTAINMENT = 0.9
SERVICE_WINDOWS = 24

#: Summary table: (header, summary.json key, decimals).
TABLE_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("Throughput (req/s)", "request_throughput", 2),
    ("Output (tok/s)", "output_throughput", 0),
    ("Mean TTFT (ms)", "mean_ttft_ms", 1),
    ("P99 TTFT (ms)", "p99_ttft_ms", 1),
    ("Mean TPOT (ms)", "mean_tpot_ms", 2),
    ("P99 TPOT (ms)", "p99_tpot_ms", 2),
    ("P99 E2E (ms)", "p99_e2el_ms", 0),
    ("Goodput (req/s)", "request_goodput", 2),
    ("Preemptions", "num_preemptions", 0),
    ("Rejected", "rejected", 0),
    ("Jain index", "jain_fairness_index", 3),
)
#: Metrics a policy can win: (summary key, name, better = max or min, unit, decimals);
#: windowed_jain is computed here (`windowed_jain`), the others are summary.json's.
WIN_METRICS: tuple[tuple[str, str, Callable, str, int], ...] = (
    ("request_goodput", "goodput", max, "req/s", 2),
    ("p99_ttft_ms", "p99 TTFT", min, "ms", 0),
    ("mean_ttft_ms", "mean TTFT", min, "ms", 0),
    ("p99_tpot_ms", "p99 TPOT", min, "ms", 1),
    ("p99_e2el_ms", "p99 E2E latency", min, "ms", 0),
    ("windowed_jain", "Jain's index over time windows", max, "", 3),
    ("num_preemptions", "preemptions", min, "", 0),
)
_AXIS_NAMES = {"model": "Model", "gpu": "GPU", "tp": "TP", "block_manager": "Block manager",
               "block_size": "Block size", "chunked_prefill": "Chunk size", "preemption": "Preemption"}


# --------------------------------------------------------------------------- data
@dataclass(frozen=True)
class ReportPoint:
    name: str
    labels: Mapping[str, Any]
    config: Mapping[str, Any]
    derived: Mapping[str, Any]
    summary: Mapping[str, Any]
    requests: list[RequestRecord]
    steps: list[StepRecord]
    rate: float
    """The --rates value, or (no rate given) the arrival rate measured from the trace."""

    @property
    def policy(self) -> str:
        return self.config["policy"]


@dataclass(frozen=True)
class Comparison:
    out_dir: Path
    axes: Mapping[str, list]
    points: list[ReportPoint]
    """The grid's stored points, in grid order."""
    missing: list[str]
    """Grid points with no stored run (failed, or not run yet)."""

    @property
    def policies(self) -> list[str]:
        return list(dict.fromkeys(p.policy for p in self.points))

    def variant_axes(self, exclude: Sequence[str] = ()) -> list[str]:
        """Swept axes other than policy and rate: each combination gets its own figures."""
        return [a for a, values in self.axes.items()
                if a not in ("policy", "rate", *exclude) and len(values) > 1]

    def groups(self, exclude: Sequence[str] = ()) -> list[tuple[dict[str, Any], list[ReportPoint]]]:
        """Points grouped by the values of the variant axes, in grid order."""
        axes = self.variant_axes(exclude)
        groups: dict[tuple, list[ReportPoint]] = {}
        for p in self.points:
            groups.setdefault(tuple(p.labels[a] for a in axes), []).append(p)
        return [(dict(zip(axes, key)), pts) for key, pts in groups.items()]


def load_comparison(out_dir: Path) -> Comparison:
    """The grid of DIR/sweep.json and the records of its stored points."""
    out_dir = Path(out_dir)
    sweep = read_json(out_dir / SWEEP_FILE)
    if not isinstance(sweep, dict) or sweep.get("format") != SWEEP_FORMAT:
        raise ValueError(f"{out_dir / SWEEP_FILE}: not a servelab sweep file ({SWEEP_FORMAT})")
    points, missing = [], []
    for entry in sweep["points"]:
        run_dir = out_dir / RUNS_DIR / entry["name"]
        labels = entry["labels"]
        try:
            stored = read_json(run_dir / DONE_MARKER).get("key") == entry["key"]
        except (OSError, ValueError, AttributeError):
            stored = False
        if not stored:
            missing.append(_describe(labels))
            continue
        config = read_json(run_dir / "config.json")
        requests = read_requests_csv(run_dir / "requests.csv")
        rate = labels.get("rate")
        points.append(ReportPoint(entry["name"], labels, config["config"], config.get("derived", {}),
                                  read_json(run_dir / "summary.json"), requests,
                                  read_steps_csv(run_dir / "steps.csv"),
                                  float(rate) if rate is not None else _offered_rate(requests)))
    if not points:
        raise ValueError(f"{out_dir}: none of the sweep's {len(sweep['points'])} points is stored yet")
    return Comparison(out_dir, sweep["axes"], points, missing)


def _offered_rate(requests: Sequence[RequestRecord]) -> float:
    arrivals = [r.arrival_s for r in requests]
    span = max(arrivals) - min(arrivals)
    return round(len(arrivals) / span, 3) if span > 0 else 0.0


def _show(value: Any) -> str:
    return "off" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _describe(labels: Mapping[str, Any]) -> str:
    return ", ".join(f"{a}={_show(v)}" for a, v in labels.items())


# --------------------------------------------------------------------------- analysis
def slo_attainment(summary: Mapping[str, Any]) -> float:
    """Fraction of all requests (finished + rejected) that finished within their SLOs."""
    total = summary["completed"] + summary["rejected"]
    if total == 0:
        return 0.0
    return min(1.0, round(summary["request_goodput"] * summary["duration"]) / total)


@dataclass(frozen=True)
class Break:
    rate: float
    reason: str


def find_break(series: Sequence[tuple[float, Mapping[str, Any]]], *, slo_ttft_ms: float | None,
               slo_tpot_ms: float | None, min_attainment: float = MIN_ATTAINMENT) -> Break | None:
    """The first (lowest) rate of (rate, summary) pairs at which the SLOs break, and why."""
    for rate, s in sorted(series, key=lambda pair: pair[0]):
        reasons = []
        attained = slo_attainment(s)
        if attained < min_attainment:
            reasons.append(f"{attained:.0%} of requests met their SLOs")
        for key, slo, name in (("p99_ttft_ms", slo_ttft_ms, "TTFT"), ("p99_tpot_ms", slo_tpot_ms, "TPOT")):
            if slo is not None and s[key] > slo:
                reasons.append(f"p99 {name} {s[key]:,.0f} ms > SLO {slo:g} ms")
        if reasons:
            return Break(rate, "; ".join(reasons))
    return None


def winners(summaries: Mapping[str, Mapping[str, Any]], key: str, better: Callable) -> list[str]:
    """The policies with the best value of `key` (several on a tie, within 1e-6 relative)."""
    best = better(s[key] for s in summaries.values())
    return [p for p, s in summaries.items() if math.isclose(s[key], best, rel_tol=1e-6, abs_tol=1e-9)]


def memory_stats(point: ReportPoint) -> plots.MemoryStats:
    """KV memory held vs allocated, from steps.csv: tokens of the step's sequences (prefill
    context + chunk, decode context + 1) over KV blocks in use x block size."""
    steps = point.steps
    if not steps:
        return plots.MemoryStats(0.0, 0, 0.0)
    block_size = point.config["block_size"]
    tokens = np.array([s.prefill_context_sum + s.num_prefill_tokens + s.decode_context_sum
                       for s in steps], float)
    slots = np.array([s.kv_blocks_used * block_size for s in steps], float)
    weight = np.array([s.duration_s for s in steps], float)
    if weight.sum() <= 0:
        weight = np.array([s.num_steps for s in steps], float)
    held = slots > 0
    utilization = float(np.dot(tokens[held] / slots[held], weight[held]) / weight[held].sum()) \
        if held.any() and weight[held].sum() > 0 else 0.0
    return plots.MemoryStats(utilization, max(s.num_running for s in steps),
                             float(point.summary["mean_kv_cache_usage"]))


def tenant_service(requests: Sequence[RequestRecord], windows: int = SERVICE_WINDOWS,
                   ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(window edges in s, per tenant: service in weighted tokens/s per window).

    Service is VTC's (1 x prompt + 2 x output tokens of finished requests); a request's
    prompt counts when its first token came out, its output evenly over its decode, so
    the curves show when each tenant was served. O(requests x windows).
    """
    done = [r for r in requests if r.status == "finished"]
    end = max((r.finish_s for r in done), default=0.0)
    edges = np.linspace(0.0, end if end > 0 else 1.0, windows + 1)
    width = edges[1] - edges[0]
    out = {}
    for tenant in sorted({r.tenant for r in requests}):
        mine = [r for r in done if r.tenant == tenant]
        first = np.array([r.first_token_s for r in mine], float)
        finish = np.array([r.finish_s for r in mine], float)
        prompt = VTC_INPUT_WEIGHT * np.array([r.prompt_tokens for r in mine], float)
        output = VTC_OUTPUT_WEIGHT * np.array([r.output_tokens * r.n for r in mine], float)
        served, _ = np.histogram(first, bins=edges, weights=prompt)
        span = np.maximum(finish - first, 1e-12)[:, None]
        overlap = np.clip(np.minimum(finish[:, None], edges[None, 1:])
                          - np.maximum(first[:, None], edges[None, :-1]), 0.0, None) / span
        instant = (finish - first <= 1e-12)  # one-token decode: all output at the finish
        overlap[instant] = 0.0
        served += overlap.T @ output + np.histogram(finish[instant], bins=edges, weights=output[instant])[0]
        out[tenant] = served / width
    return edges, out


def windowed_jain(requests: Sequence[RequestRecord], weights: Mapping[str, float] | None = None,
                  windows: int = SERVICE_WINDOWS) -> float:
    """Mean over time windows of Jain's index over the service of the tenants with work
    in the system during the window (divided by their weights); windows with fewer than
    two such tenants are left out (1.0 if none is left). Unlike the whole-run index,
    which only sees totals, this sees who was served *when*."""
    edges, service = tenant_service(requests, windows)
    weights = weights or {}
    x, active = [], []
    for tenant, per_window in service.items():
        mine = [r for r in requests if r.tenant == tenant]
        arrival = np.array([r.arrival_s for r in mine], float)
        leave = np.array([r.finish_s if r.status == "finished" else r.arrival_s for r in mine], float)
        present = (arrival[:, None] < edges[None, 1:]) & (leave[:, None] >= edges[None, :-1])
        active.append(present.any(axis=0))
        x.append(per_window / float(weights.get(tenant, 1.0)))
    x, active = np.array(x), np.array(active)
    values = []
    for w in range(windows):
        xs = x[active[:, w], w]
        if len(xs) >= 2 and xs.sum() > 0:
            values.append(xs.sum() ** 2 / (len(xs) * (xs ** 2).sum()))
    return float(np.mean(values)) if values else 1.0


# --------------------------------------------------------------------------- document
@dataclass(frozen=True)
class Heading:
    level: int
    text: str


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Bullets:
    items: list[str]


@dataclass(frozen=True)
class Table:
    headers: list[str]
    rows: list[list[str]]


@dataclass(frozen=True)
class Image:
    name: str
    title: str
    caption: str
    figure: Any
    """A matplotlib Figure, rendered to PNG only when the report is written."""


@dataclass(frozen=True)
class ReportFiles:
    html: Path
    markdown: Path
    figures: list[Path]


def write_report(out_dir: Path) -> ReportFiles:
    """Build the report of the sweep in out_dir and write index.html, report.md, figures/."""
    out_dir = Path(out_dir)
    blocks = build_document(load_comparison(out_dir))
    pngs = {b.name: plots.png_bytes(b.figure) for b in blocks if isinstance(b, Image)}
    fig_dir = out_dir / "figures"
    fig_dir.mkdir(exist_ok=True)
    for stale in fig_dir.glob("*.png"):
        stale.unlink()
    for name, png in pngs.items():
        _write_atomic(fig_dir / f"{name}.png", png)
    _write_atomic(out_dir / "report.md", render_markdown(blocks).encode("utf-8"))
    _write_atomic(out_dir / "index.html", render_html(blocks, pngs).encode("utf-8"))
    return ReportFiles(out_dir / "index.html", out_dir / "report.md",
                       [fig_dir / f"{name}.png" for name in pngs])


def build_document(c: Comparison) -> list:
    """The report as blocks (Heading, Text, Bullets, Table, Image), figures not yet rendered."""
    colours = plots.policy_colours(c.policies)
    first = c.points[0]
    doc: list = [Heading(1, f"Policy comparison: {first.config['trace']}"), *_what_was_run(c)]
    groups = c.groups()
    for labels, points in groups:
        suffix = f" ({_describe(labels)})" if labels else ""
        doc += [Heading(2, "Findings" + suffix), *_findings(points)]
    doc += [Heading(2, "Summary per policy and load"),
            Text("Values are each run's summary.json (vLLM benchmark definitions), rounded. "
                 "SLO met: requests that finished within their SLOs, over all requests."),
            summary_table(c)]
    for labels, points in groups:
        suffix = f" ({_describe(labels)})" if labels else ""
        slug = "_".join(f"{a}-{_show(v)}" for a, v in labels.items()).replace("/", "-")
        doc += [Heading(2, "Figures" + suffix), *_figures(points, colours, suffix, slug)]
    for labels, points in c.groups(exclude=("block_manager",)):
        if any(p.config["block_manager"].startswith("contiguous") for p in points):
            suffix = f" ({_describe(labels)})" if labels else ""
            slug = "_".join(f"{a}-{_show(v)}" for a, v in labels.items()).replace("/", "-")
            doc += [Heading(2, "KV memory: paged vs contiguous" + suffix),
                    _memory_figure(points, colours, suffix, slug)]
    if c.missing:
        doc += [Heading(2, "Points not in this report"),
                Text("These grid points have no stored run (they failed, or the sweep has not "
                     "reached them); rerun the same command to retry them."), Bullets(c.missing)]
    doc += [Heading(2, "Run directories"),
            Text(f"Each point is a `servelab simulate` run directory under {RUNS_DIR}/ (its "
                 f"config.json reruns it: python -m servelab.simulator.run RUN/config.json --out DIR)."),
            Bullets([f"{p.name}: {_describe(p.labels)}" for p in c.points])]
    return doc


def _what_was_run(c: Comparison) -> list:
    cfg, derived = c.points[0].config, c.points[0].derived
    sched = cfg["scheduler"]
    swept = {a for a, vals in c.axes.items() if len(vals) > 1}
    counts = sorted({p.summary["completed"] + p.summary["rejected"] for p in c.points})
    count = f"{counts[0]:,}" if len(counts) == 1 else f"{counts[0]:,} to {counts[-1]:,}"
    chunk = f"chunked prefill of {sched['chunked_prefill']} tokens" if sched["chunked_prefill"] \
        else "no chunked prefill"
    settings = [  # (the axis that would vary it, the words)
        ("model", f"model {cfg['model']}"), ("gpu", f"GPU {cfg['gpu']}"),
        ("tp", f"tensor parallelism {cfg['tp']}"), (None, f"{cfg['replicas']} replica(s)"),
        (None, f"{derived.get('kv_blocks_per_replica', cfg['kv_blocks']):,} KV blocks per replica"
            if "model" not in swept and "gpu" not in swept and "tp" not in swept else None),
        ("block_size", f"{cfg['block_size']}-token KV blocks"),
        ("block_manager", f"{cfg['block_manager']} block manager"),
        (None, f"{sched['batching']} batching of at most {sched['max_num_seqs']} sequences and "
               f"{sched['max_num_batched_tokens']} tokens per step"),
        ("chunked_prefill", chunk), (None, f"{sched['step_composition'].replace('_', '-')} steps"),
        ("preemption", f"{sched['preemption']} preemption"),
        (None, "prefix caching" if cfg["prefix_caching"] else None), (None, f"seed {cfg['seed']}"),
    ]
    fixed = [words for axis, words in settings if words and axis not in swept]
    axes = " x ".join(f"{a} ({', '.join(_show(v) for v in vals)})"
                      for a, vals in c.axes.items() if a in swept)
    text = [Text(f"{len(c.points)} simulations of the trace '{cfg['trace']}' ({count} requests each), "
                 f"sweeping {axes or 'nothing'}. Rates are mean request rates (req/s) to which the "
                 f"trace's arrivals are rescaled."),
            Text("Every point: " + "; ".join(fixed) + ".")]
    slo = _slo_text(c)
    if slo:
        text.append(Text(slo))
    return text


def _slo_text(c: Comparison) -> str:
    cfg = c.points[0].config
    own = {}
    for r in c.points[0].requests:
        if r.slo_ttft_ms is not None or r.slo_tpot_ms is not None:
            own.setdefault(r.tenant, (r.slo_ttft_ms, r.slo_tpot_ms))
    parts = []
    if cfg["slo_ttft_ms"] is not None or cfg["slo_tpot_ms"] is not None:
        parts.append(f"Global SLOs: TTFT {_ms(cfg['slo_ttft_ms'])}, TPOT {_ms(cfg['slo_tpot_ms'])}.")
    if own:
        tiers = "; ".join(f"{t}: TTFT {_ms(a)}, TPOT {_ms(b)}" for t, (a, b) in sorted(own.items()))
        parts.append(f"Requests carry their own SLOs, which goodput uses first ({tiers}).")
    if not parts:
        return "No SLO was given: goodput equals throughput, and a policy breaks only on rejections."
    parts.append(f"A policy breaks at the first rate where fewer than {MIN_ATTAINMENT:.0%} of requests "
                 "meet their SLOs, or its p99 TTFT or TPOT exceeds a global SLO.")
    return " ".join(parts)


def _ms(value: float | None) -> str:
    return "none" if value is None else f"{value:g} ms"


def _series(points: Sequence[ReportPoint]) -> dict[str, list[ReportPoint]]:
    out: dict[str, list[ReportPoint]] = {}
    for p in points:
        out.setdefault(p.policy, []).append(p)
    return {policy: sorted(pts, key=lambda p: p.rate) for policy, pts in out.items()}


def _breaks(points: Sequence[ReportPoint]) -> dict[str, Break | None]:
    return {policy: find_break([(p.rate, p.summary) for p in pts], slo_ttft_ms=pts[0].config["slo_ttft_ms"],
                               slo_tpot_ms=pts[0].config["slo_tpot_ms"])
            for policy, pts in _series(points).items()}


def _middle_rate(points: Sequence[ReportPoint]) -> float:
    rates = sorted({p.rate for p in points})
    return rates[(len(rates) - 1) // 2]


def _findings(points: Sequence[ReportPoint]) -> list:
    series, breaks = _series(points), _breaks(points)
    top = max(p.rate for p in points)
    items = []
    for policy, pts in series.items():
        b = breaks[policy]
        if b is None:
            worst = min(slo_attainment(p.summary) for p in pts)
            items.append(f"{policy} holds at every rate run (up to {top:g} req/s; lowest SLO "
                         f"attainment {worst:.0%}).")
        else:
            items.append(f"{policy} breaks at {b.rate:g} req/s: {b.reason}.")
    at_top = {p.policy: p.summary for p in points if p.rate == top}
    sustain = {pol: (math.inf if b is None else b.rate, slo_attainment(at_top[pol]) if pol in at_top else 0.0)
               for pol, b in breaks.items()}
    best = max(sustain.values())
    leaders = [pol for pol, v in sustain.items() if v == best]
    if len(leaders) == len(sustain) and best[0] == math.inf:
        verdict = "Every policy meets the SLOs at every rate run: raise the rates to find where they differ."
    else:
        how = "never breaks at the rates run" if best[0] == math.inf else \
            f"breaks last, at {best[0]:g} req/s"
        verdict = (f"Most load within SLO: {' and '.join(leaders)} ({how}; {best[1]:.0%} of "
                   f"requests within SLO at {top:g} req/s).")
    doc: list = [Bullets(items), Text(verdict)]
    if all(p.summary["num_preemptions"] == 0 for p in points):
        peak = max(p.summary["max_kv_cache_usage"] for p in points)
        doc.append(Text(f"No request was preempted at any rate; peak KV-cache usage was {peak:.0%}."))
    tenants = sorted({t for p in points for t in p.summary["per_tenant"]})
    if len(tenants) > 1:
        doc += [Text(f"Mean TTFT per tenant at {top:g} req/s (ms): who pays for the load."),
                Table(["Policy", *tenants],
                      [[pol, *(f"{s['per_tenant'][t]['mean_ttft_ms']:,.0f}" if t in s["per_tenant"] else "-"
                               for t in tenants)] for pol, s in at_top.items()])]
    rows = []
    rates = sorted({p.rate for p in points})
    scored = {p.name: {**p.summary, "windowed_jain": windowed_jain(p.requests, _weights(p))} for p in points}
    for key, name, better, unit, decimals in WIN_METRICS:
        row = [name + (f" ({unit})" if unit else "")]
        for rate in rates:
            at = {p.policy: scored[p.name] for p in points if p.rate == rate}
            won = winners(at, key, better)
            value = at[won[0]][key]
            row.append("all tie" if len(won) == len(at) > 1 else f"{'/'.join(won)} ({value:,.{decimals}f})")
        rows.append(row)
    doc += [Text("Best policy per metric at each rate (winner and its value):"),
            Table(["Metric", *(f"{r:g} req/s" for r in rates)], rows)]
    return doc


def summary_table(c: Comparison) -> Table:
    variant = c.variant_axes()
    headers = ["Policy", "Rate (req/s)", *(_AXIS_NAMES.get(a, a) for a in variant),
               *(h for h, _, _ in TABLE_COLUMNS), "SLO met (%)"]
    rows = []
    for p in c.points:
        rows.append([p.policy, f"{p.rate:g}", *(_show(p.labels[a]) for a in variant),
                     *(f"{p.summary[key]:.{d}f}" for _, key, d in TABLE_COLUMNS),
                     f"{100 * slo_attainment(p.summary):.1f}"])
    return Table(headers, rows)


def _figures(points: Sequence[ReportPoint], colours, suffix: str, slug: str) -> list:
    series, breaks = _series(points), _breaks(points)
    mid = _middle_rate(points)
    at_mid = {p.policy: p for p in points if p.rate == mid}
    slug = f"_{slug}" if slug else ""
    latencies = {}
    for p in points:
        done = [r for r in p.requests if r.status == "finished"]
        latencies.setdefault(p.rate, {})[p.policy] = {
            "ttft": np.array([r.ttft_ms for r in done]),
            "tpot": np.array([r.tpot_ms for r in done if r.tpot_ms is not None]),
            "e2el": np.array([r.e2el_ms for r in done])}
    cfg = points[0].config
    return [
        Image(f"latency_cdf{slug}", "Latency CDFs" + suffix,
               "TTFT, TPOT and end-to-end latency CDFs of the finished requests, per policy, one "
               "row per request rate. Further left is better; the right tail is the p99 story.",
               plots.latency_cdfs(latencies, colours, "Latency CDFs per policy" + suffix)),
        Image(f"vs_rate{slug}", "Latency and goodput vs request rate" + suffix,
               "p99 TTFT, TPOT and E2E latency and goodput (throughput dashed) against the request "
               "rate. The dotted vertical line and X mark the first rate at which each policy breaks "
               "its SLOs; dashed horizontal lines are global SLOs.",
               plots.rate_sweep({pol: [plots.RatePoint(p.rate, p.summary) for p in pts]
                                 for pol, pts in series.items()}, colours,
                                "Latency and goodput vs request rate" + suffix,
                                breaks={pol: (b.rate if b else None) for pol, b in breaks.items()},
                                slo_ttft_ms=cfg["slo_ttft_ms"], slo_tpot_ms=cfg["slo_tpot_ms"])),
        Image(f"timeline{slug}", f"KV cache and queue at {mid:g} req/s" + suffix,
               f"KV-cache usage and waiting requests over simulated time at {mid:g} req/s, the "
               "middle load (time-weighted means over short bins).",
               plots.timeline({pol: p.steps for pol, p in at_mid.items()}, colours,
                              f"KV cache and queue over time at {mid:g} req/s" + suffix)),
        Image(f"preemptions{slug}", "Preemptions" + suffix,
               "Preemptions per policy at each request rate.",
               plots.preemptions({pol: [(p.rate, p.summary["num_preemptions"]) for p in pts]
                                  for pol, pts in series.items()}, colours,
                                 "Preemptions per policy" + suffix)),
        Image(f"fairness{slug}", "Fairness across tenants" + suffix,
               f"Top: each tenant's service over time at {mid:g} req/s, per policy. Bottom: Jain's "
               "fairness index over the tenants' service (divided by their weights under fair "
               "share) against the request rate: over the whole run (solid; when every request "
               "finishes, every policy served the same totals) and averaged over time windows "
               "among the tenants with work waiting (dashed: who was served when).",
               plots.fairness({pol: _service_curves(p.requests) for pol, p in at_mid.items()},
                              {pol: [(p.rate, p.summary["jain_fairness_index"],
                                      windowed_jain(p.requests, _weights(p))) for p in pts]
                               for pol, pts in series.items()}, colours,
                              f"Per-tenant service at {mid:g} req/s and Jain's index" + suffix)),
    ]


def _service_curves(requests: Sequence[RequestRecord]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    edges, service = tenant_service(requests)
    centres = (edges[:-1] + edges[1:]) / 2
    return {tenant: (centres, rate) for tenant, rate in service.items()}


def _weights(point: ReportPoint) -> dict[str, float] | None:
    return point.config["policy_options"].get("weights") if point.policy == "fair" else None


def _memory_figure(points: Sequence[ReportPoint], colours, suffix: str, slug: str) -> Image:
    mid = _middle_rate(points)
    stats: dict[str, dict[str, plots.MemoryStats]] = {}
    for p in points:
        if p.rate == mid:
            stats.setdefault(p.config["block_manager"], {})[p.policy] = memory_stats(p)
    return Image(f"memory{'_' + slug if slug else ''}", "KV memory held vs reserved" + suffix,
                  f"At {mid:g} req/s, per block manager and policy: the share of allocated KV slots "
                  "that hold tokens (contiguous managers reserve ahead: the rest is waste), how much "
                  "of the pool is allocated, and the most requests that ran at once.",
                  plots.memory_waste(stats, colours, f"KV memory held vs reserved at {mid:g} req/s" + suffix))


# --------------------------------------------------------------------------- rendering
def render_markdown(blocks: Sequence) -> str:
    out = []
    for b in blocks:
        if isinstance(b, Heading):
            out.append(f"{'#' * b.level} {b.text}")
        elif isinstance(b, Text):
            out.append(b.text)
        elif isinstance(b, Bullets):
            out.append("\n".join(f"- {item}" for item in b.items))
        elif isinstance(b, Table):
            cell = lambda s: str(s).replace("|", "\\|")  # noqa: E731
            lines = ["| " + " | ".join(map(cell, b.headers)) + " |",
                     "|" + "|".join("---" if i == 0 else "---:" for i in range(len(b.headers))) + "|"]
            lines += ["| " + " | ".join(map(cell, row)) + " |" for row in b.rows]
            out.append("\n".join(lines))
        elif isinstance(b, Image):
            out.append(f"![{b.title}](figures/{b.name}.png)\n\n*{b.caption}*")
    return "\n\n".join(out) + "\n"


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;max-width:1280px;margin:2em auto;
padding:0 1.2em;color:#222;line-height:1.5}
h1{font-size:1.7em;border-bottom:2px solid #ddd;padding-bottom:.3em}h2{margin-top:2em;font-size:1.3em}
table{border-collapse:collapse;margin:1em 0;font-size:.88em}
th,td{border:1px solid #d4d4d4;padding:4px 8px}th{background:#f4f4f4;text-align:center}
td{text-align:right;font-variant-numeric:tabular-nums}td:first-child{text-align:left;white-space:nowrap}
tr:nth-child(even) td{background:#fafafa}
figure{margin:1.5em 0}figure img{max-width:100%;border:1px solid #eee}
figcaption{color:#555;font-size:.92em;margin-top:.4em}
.dot{display:inline-block;width:.8em;height:.8em;border-radius:50%;margin-right:.35em;vertical-align:middle}
"""


def render_html(blocks: Sequence, pngs: Mapping[str, bytes]) -> str:
    """One self-contained page: inline CSS, figures as base64 PNG data URIs (pngs[name])."""
    colours = plots.policy_colours(
        row[0] for b in blocks if isinstance(b, Table) and b.headers[0] == "Policy" for row in b.rows)
    esc = html.escape
    body = []
    for b in blocks:
        if isinstance(b, Heading):
            body.append(f"<h{b.level}>{esc(b.text)}</h{b.level}>")
        elif isinstance(b, Text):
            body.append(f"<p>{esc(b.text)}</p>")
        elif isinstance(b, Bullets):
            body.append("<ul>" + "".join(f"<li>{esc(i)}</li>" for i in b.items) + "</ul>")
        elif isinstance(b, Table):
            head = "".join(f"<th>{esc(h)}</th>" for h in b.headers)
            rows = []
            for row in b.rows:
                first = esc(row[0])
                if b.headers[0] == "Policy" and row[0] in colours:
                    first = f'<span class="dot" style="background:{colours[row[0]]}"></span>{first}'
                cells = "".join(f"<td>{esc(c)}</td>" for c in row[1:])
                rows.append(f"<tr><td>{first}</td>{cells}</tr>")
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>")
        elif isinstance(b, Image):
            data = base64.b64encode(pngs[b.name]).decode("ascii")
            body.append(f'<figure id="{esc(b.name)}"><img alt="{esc(b.title)}" '
                        f'src="data:image/png;base64,{data}"><figcaption><b>{esc(b.title)}.</b> '
                        f"{esc(b.caption)}</figcaption></figure>")
    title = next((b.text for b in blocks if isinstance(b, Heading)), "servelab report")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<style>{_CSS}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
