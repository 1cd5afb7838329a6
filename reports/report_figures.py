"""The figures of a comparison report, for one variant group: latency CDFs, latencies,
attainment and goodput against the rate, KV cache and queue over time, preemptions, and
per-tenant service with Jain's index. A figure with nothing to show (no preemption
anywhere) is left out with one line saying so. Time series are drawn at the rate where
the policies differ most (`findings.analyse`), not at an arbitrary middle rate.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from servelab.records import RequestRecord
from servelab.reports import plots
from servelab.reports.comparison import ReportPoint, memory_stats, tenant_service
from servelab.reports.document import Image, Text
from servelab.reports.findings import Group, break_tiers
from servelab.reports.plots_load import BreakMarks, RatePoint, rate_sweep
from servelab.reports.slo import MIN_ATTAINMENT, tenants_tightest_first


def figures(group: Group, colours, suffix: str, slug: str) -> list:
    slug = f"_{slug}" if slug else ""
    rate = group.divergent_rate
    at = {p.policy: p for p in group.points if p.rate == rate}
    why = _why_this_rate(group)
    latencies = {}
    for p in group.points:
        done = [r for r in p.requests if r.status == "finished"]
        latencies.setdefault(p.rate, {})[p.policy] = {
            "ttft": np.array([r.ttft_ms for r in done]),
            "tpot": np.array([r.tpot_ms for r in done if r.tpot_ms is not None]),
            "e2el": np.array([r.e2el_ms for r in done])}
    blocks = [
        Image(f"latency_cdf{slug}", "Latency CDFs" + suffix,
              "TTFT, TPOT and end-to-end latency CDFs of the finished requests, per policy, one "
              "row per request rate. Further left is better; the right tail is the p99 story.",
              plots.latency_cdfs(latencies, colours, "Latency CDFs per policy" + suffix)),
        _vs_rate(group, colours, suffix, slug),
        Image(f"timeline{slug}", f"KV cache and queue at {rate:g} req/s" + suffix,
              f"KV-cache usage and waiting requests over simulated time at {rate:g} req/s, {why} "
              "(time-weighted means over short bins). A queue that keeps climbing to the end "
              "means arrivals outpace service.",
              plots.timeline({pol: p.steps for pol, p in at.items()}, colours,
                             f"KV cache and queue over time at {rate:g} req/s" + suffix)),
    ]
    if any(p.summary["num_preemptions"] for p in group.points):
        blocks.append(Image(f"preemptions{slug}", "Preemptions" + suffix,
                            "Preemptions per policy at each request rate.",
                            plots.preemptions({pol: [(p.rate, p.summary["num_preemptions"]) for p in pts]
                                               for pol, pts in group.series.items()}, colours,
                                              "Preemptions per policy" + suffix)))
    else:
        blocks.append(Text("Preemptions: none at any rate, so no figure."))
    tenants = {r.tenant for p in group.points for r in p.requests}
    if len(tenants) < 2:
        who = f"one tenant ({next(iter(tenants))})" if tenants else "no requests"
        blocks.append(Text(f"Fairness across tenants: {who}, so no figure."))
        return blocks
    blocks.append(Image(
        f"fairness{slug}", "Fairness across tenants" + suffix,
        f"Top: each tenant's service (1 x prompt + 2 x output tokens per second, as VTC counts it) "
        f"over time at {rate:g} req/s, per policy. Bottom: Jain's index over the tenants' service "
        "(divided by their weights under fair share; 1 = every tenant served alike, 1/k = one "
        "tenant served alone). Solid: over the whole run, which only sees totals: when every "
        "request finishes, every policy served each tenant the same total, so the solid lines "
        "coincide and describe the workload's mix, not the policy. Dashed: the mean over time "
        "windows among the tenants with work waiting, which shows who was served when.",
        plots.fairness({pol: _service_curves(p.requests) for pol, p in at.items()},
                       {pol: [(p.rate, p.summary["jain_fairness_index"] or 0.0, group.windowed[p.name])
                              for p in pts] for pol, pts in group.series.items()}, colours,
                       f"Per-tenant service at {rate:g} req/s and Jain's index" + suffix,
                       tenants_first=tenants_tightest_first(group.tiers))))
    return blocks


def _why_this_rate(group: Group) -> str:
    rate = group.divergent_rate
    att = [group.attainment[p.name] for p in group.points if p.rate == rate]
    if len(group.rates) == 1:
        return "the only rate run"
    if max(att) - min(att) >= 0.0005:
        return f"the rate where the policies' SLO attainment differs most ({min(att):.1%} to {max(att):.1%})"
    return "the rate where the policies' p99 TTFT differs most"


def _vs_rate(group: Group, colours, suffix: str, slug: str) -> Image:
    series = {pol: [RatePoint(p.rate, p.summary, group.attainment[p.name], group.tier_p99[p.name])
                    for p in pts] for pol, pts in group.series.items()}
    marks = {}
    for pol, b in group.breaks.items():
        if b is not None:
            point = next(p for p in group.series[pol] if p.rate == b.rate)
            marks[pol] = BreakMarks(b.rate, tuple(break_tiers(group, pol)),
                                    group.attainment[point.name] < MIN_ATTAINMENT)
    tiers = ", ".join(f"{t.tenant or 'everyone'} {t.metric.upper()} {t.slo_ms:g} ms" for t in group.tiers)
    return Image(f"vs_rate{slug}", "Latency, SLO attainment and goodput vs request rate" + suffix,
                 "p99 TTFT and TPOT per tenant (line style) with every SLO that applies drawn in grey "
                 f"({tiers or 'none given'}), the share of requests within their SLOs against the "
                 f"{MIN_ATTAINMENT:.0%} target, and goodput (throughput dashed). An X marks the rate at "
                 "which a policy breaks, only on the panels whose value crossed its line there. A "
                 f"policy holds while at least {MIN_ATTAINMENT:.0%} of the requests meet their SLOs "
                 "and no global SLO is exceeded at p99, so a tenant's p99 may cross that tenant's "
                 "own SLO line (its slowest requests miss) while the policy still holds.",
                 rate_sweep(series, group.tiers, colours,
                            "Latency, SLO attainment and goodput vs request rate" + suffix,
                            breaks=marks, target=MIN_ATTAINMENT))


def _service_curves(requests: Sequence[RequestRecord]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    edges, service = tenant_service(requests)
    centres = (edges[:-1] + edges[1:]) / 2
    return {tenant: (centres, rate) for tenant, rate in service.items()}


def memory_figure(points: Sequence[ReportPoint], rate: float, colours, suffix: str, slug: str) -> Image:
    stats: dict[str, dict[str, plots.MemoryStats]] = {}
    for p in points:
        if p.rate == rate:
            stats.setdefault(p.config["block_manager"], {})[p.policy] = memory_stats(p)
    return Image(f"memory{'_' + slug if slug else ''}", "KV memory held vs reserved" + suffix,
                 f"At {rate:g} req/s, per block manager and policy: the share of allocated KV slots "
                 "that hold tokens (contiguous managers reserve ahead: the rest is waste), how much "
                 "of the pool is allocated, and the most requests that ran at once.",
                 plots.memory_waste(stats, colours, f"KV memory held vs reserved at {rate:g} req/s" + suffix))
