"""SLOs in a report: which ones apply, who met them, and where a policy breaks them.

    slo_attainment(summary)                          # share of all requests within their SLOs
    tiers = slo_tiers(config, requests)              # every SLO that can break, per tenant
    find_break([(rate, summary), ...], ...)          # the first rate that broke, and why
    broken_metrics(point_requests, config, ...)      # which drawn SLOs a run exceeded

A request's own SLO (the default workload's tenants carry theirs) takes precedence over the
global --slo-ttft-ms / --slo-tpot-ms, as in goodput. A figure that draws one line per SLO
that can break, and marks a break only where a value crosses its line, must agree with
these rules, so they live here, once.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from servelab.records import RequestRecord

MIN_ATTAINMENT = 0.9
SLO_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"))
ALL_TENANTS = None
"""The tenant key of a global SLO that applies to everyone (no request carries its own)."""


def slo_attainment(summary: Mapping[str, Any]) -> float:
    """Fraction of all requests (finished + rejected) that finished within their SLOs
    (0.0 for a run with no request)."""
    total = summary["completed"] + summary["rejected"]
    if total == 0:
        return 0.0
    return min(1.0, round(summary["request_goodput"] * summary["duration"]) / total)


@dataclass(frozen=True)
class Tier:
    """One SLO that can break: a tenant's (or everyone's) bound on one latency."""

    metric: str
    """'ttft' or 'tpot'."""
    tenant: str | None
    """None: a global SLO over all requests (no request carries its own)."""
    slo_ms: float


def slo_tiers(config: Mapping[str, Any], requests: Sequence[RequestRecord]) -> list[Tier]:
    """Every SLO that applies to some request, per tenant when requests carry their own
    (a tenant without its own gets the global one), else the global SLOs for everyone."""
    tenants = sorted({r.tenant for r in requests})
    own = {(m, t): v for r in requests for m, t, v in
           (("ttft", r.tenant, r.slo_ttft_ms), ("tpot", r.tenant, r.slo_tpot_ms)) if v is not None}
    tiers = []
    for metric, _ in SLO_METRICS:
        default = config.get(f"slo_{metric}_ms")
        if not any(m == metric for m, _ in own):
            if default is not None:
                tiers.append(Tier(metric, ALL_TENANTS, float(default)))
            continue
        for tenant in tenants:
            value = own.get((metric, tenant), default)
            if value is not None:
                tiers.append(Tier(metric, tenant, float(value)))
    return tiers


def tenants_tightest_first(tiers: Sequence[Tier]) -> list[str]:
    """The tenants with their own SLOs, ordered by their first (TTFT, when they have one)
    SLO, tightest first: the interactive tenant before the batch one, whose breaks matter
    first (figures draw it solid)."""
    first: dict[str, float] = {}   # slo_tiers lists every tenant's TTFT tier before TPOT
    for t in tiers:
        if t.tenant is not None:
            first.setdefault(t.tenant, t.slo_ms)
    return sorted(first, key=lambda name: (first[name], name))


def tier_p99(requests: Sequence[RequestRecord], tier: Tier) -> float | None:
    """p99 of the tier's latency over its tenant's finished requests (None: no value)."""
    values = [getattr(r, f"{tier.metric}_ms") for r in requests
              if r.status == "finished" and (tier.tenant is None or r.tenant == tier.tenant)]
    values = [v for v in values if v is not None]
    return float(np.percentile(values, 99)) if values else None


@dataclass(frozen=True)
class Break:
    rate: float
    reason: str


def find_break(series: Sequence[tuple[float, Mapping[str, Any]]], *, slo_ttft_ms: float | None,
               slo_tpot_ms: float | None, min_attainment: float = MIN_ATTAINMENT) -> Break | None:
    """The first (lowest) rate of (rate, summary) pairs at which the SLOs break, and why:
    fewer than `min_attainment` of the requests met their SLOs, or the p99 TTFT / TPOT
    exceeded a global SLO."""
    for rate, s in sorted(series, key=lambda pair: pair[0]):
        reasons = []
        attained = slo_attainment(s)
        if attained < min_attainment:
            reasons.append(f"{attained:.0%} of requests met their SLOs")
        for key, slo, name in (("p99_ttft_ms", slo_ttft_ms, "TTFT"), ("p99_tpot_ms", slo_tpot_ms, "TPOT")):
            if slo is not None and s[key] is not None and s[key] > slo:
                reasons.append(f"p99 {name} {s[key]:,.0f} ms > SLO {slo:g} ms")
        if not s["completed"]:
            reasons.append("no request finished")
        if reasons:
            return Break(rate, "; ".join(reasons))
    return None


def broken_tiers(requests: Sequence[RequestRecord], tiers: Sequence[Tier]) -> list[Tier]:
    """The tiers whose p99 exceeds their SLO in this run: where a figure may mark a break."""
    out = []
    for tier in tiers:
        p99 = tier_p99(requests, tier)
        if p99 is not None and p99 > tier.slo_ms:
            out.append(tier)
    return out


def describe_tier(tier: Tier) -> str:
    who = "everyone" if tier.tenant is None else tier.tenant
    value = f"{tier.slo_ms / 1000:g} s" if tier.slo_ms >= 1000 else f"{tier.slo_ms:g} ms"
    return f"{who} {tier.metric.upper()} {value}"
