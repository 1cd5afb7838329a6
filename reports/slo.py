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


def unused_global_slos(config: Mapping[str, Any], requests: Sequence[RequestRecord]) -> list[str]:
    """The global SLO flags a run was given that apply to no request, every request
    carrying its own ("--slo-ttft-ms 500"): a reader would take them as applied."""
    unused = []
    for metric, _ in SLO_METRICS:
        value = config.get(f"slo_{metric}_ms")
        if value is not None and requests and all(getattr(r, f"slo_{metric}_ms") is not None
                                                  for r in requests):
            unused.append(f"--slo-{metric}-ms {float(value):g}")
    return unused


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


# --------------------------------------------------------------------------- what a run must meet
PERCENTILES = {50: "median", 90: "p90", 99: "p99"}
"""The latency percentiles every summary.json holds, by the prefix of its keys."""


@dataclass(frozen=True)
class PercentileTarget:
    """A bound on one latency percentile over the whole run, e.g. p99 TTFT <= 2000 ms."""

    metric: str
    """'ttft' or 'tpot'."""
    percentile: int
    """50, 90 or 99 (PERCENTILES)."""
    limit_ms: float

    def __post_init__(self) -> None:
        if self.metric not in dict(SLO_METRICS):
            raise ValueError(f"a percentile target bounds ttft or tpot, not {self.metric!r}")
        if self.percentile not in PERCENTILES:
            raise ValueError(f"percentile targets take the percentiles a run records "
                             f"({', '.join(map(str, PERCENTILES))}), not {self.percentile!r}")
        if not self.limit_ms > 0:
            raise ValueError(f"a percentile target must be > 0 ms, got {self.limit_ms!r}")

    @property
    def key(self) -> str:
        return f"{PERCENTILES[self.percentile]}_{self.metric}_ms"

    def __str__(self) -> str:
        return f"p{self.percentile} {dict(SLO_METRICS)[self.metric]} <= {self.limit_ms:g} ms"

    def value(self, summary: Mapping[str, Any]) -> float:
        """The run's percentile, infinite when too many requests were rejected for it to be
        finite: a rejected request never got a token, so it counts as slower than any
        finished one (more than 100 - P % rejected puts the P-th percentile among them)."""
        total = summary["completed"] + summary["rejected"]
        if not summary["completed"] or summary["rejected"] > total * (100 - self.percentile) / 100:
            return float("inf")
        value = summary[self.key]
        return float("inf") if value is None else float(value)


@dataclass(frozen=True)
class SloTargets:
    """What a run must meet to hold: at least `attainment` of all requests within their
    SLOs (a request's own first, then --slo-ttft-ms / --slo-tpot-ms; rejected requests
    count as misses), and every percentile target. None: no attainment target (the
    percentile targets alone decide).

    A percentile target is read from the summary over finished requests, with rejected
    requests counted as slower than all of them (`PercentileTarget.value`)."""

    attainment: float | None
    percentiles: tuple[PercentileTarget, ...] = ()

    def __post_init__(self) -> None:
        if self.attainment is None and not self.percentiles:
            raise ValueError("SLO targets need an attainment target or a percentile target")
        if self.attainment is not None and not 0 < self.attainment <= 1:
            raise ValueError(f"the attainment target must be in (0, 1], got {self.attainment!r}")

    def misses(self, summary: Mapping[str, Any]) -> list[str]:
        """Each target the run missed, with the value it reached ([] when it held)."""
        out = []
        if self.attainment is not None:
            attained = slo_attainment(summary)
            if attained < self.attainment:
                out.append(f"{attained:.1%} of requests within their SLOs (target {self.attainment:.0%})")
        for t in self.percentiles:
            value = t.value(summary)
            if value > t.limit_ms:
                shown = "unbounded (too many rejected)" if value == float("inf") else f"{_above(value, t.limit_ms)} ms"
                out.append(f"p{t.percentile} {dict(SLO_METRICS)[t.metric]} {shown} > {t.limit_ms:g} ms")
        return out

    def held(self, summary: Mapping[str, Any]) -> bool:
        return not self.misses(summary)

    def tightness(self, summary: Mapping[str, Any]) -> float:
        """How close the run came to its worst target: the largest of value / limit over the
        percentile targets and (1 - attained) / (1 - target) for attainment; at most 1 when
        it held, above 1 by how far it missed."""
        ratios = [t.value(summary) / t.limit_ms for t in self.percentiles]
        if self.attainment is not None:
            missed = 1 - slo_attainment(summary)
            allowed = 1 - self.attainment
            ratios.append(missed / allowed if allowed else (0.0 if missed <= 0 else float("inf")))
        return max(ratios)

    def to_dict(self) -> dict[str, Any]:
        return {"attainment": self.attainment,
                "percentiles": [{"metric": t.metric, "percentile": t.percentile, "limit_ms": t.limit_ms}
                                for t in self.percentiles]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SloTargets":
        return cls(data["attainment"], tuple(PercentileTarget(**t) for t in data["percentiles"]))

    def __str__(self) -> str:
        parts = [] if self.attainment is None else [f"{self.attainment:.0%} SLO attainment"]
        return " and ".join([*parts, *map(str, self.percentiles)])


def _above(value: float, limit: float) -> str:
    """`value` (> `limit`) in whole ms, or with as many decimals (up to 3) as it takes not
    to read as the limit itself ("150.4", not "150 > 150")."""
    for digits in range(4):
        shown = f"{value:,.{digits}f}"
        if float(shown.replace(",", "")) > limit:
            return shown
    return shown
