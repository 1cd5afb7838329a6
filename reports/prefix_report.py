"""The prefix-caching section of a comparison report: how many prompt tokens the cache
served at each point and over each run, and what prefix-aware scheduling (the `lpm`
policy) and routing (`--router prefix-affinity`) bought against the others.

    blocks = prefix_section(c)    # [] when no point kept a prefix cache that hit

A hit rate is cached prompt tokens over prompt tokens of finished requests (summary.json's
`prefix_cache_hit_rate`; per window, from requests.csv's `cached_tokens`), so a trace
without prefix hashes or token ids reads 0 everywhere, and the section is left out.

Cost: one pass over each point's request records.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from servelab.reports.columns import finished_mask, floats, ints
from servelab.reports.comparison import Comparison, ReportPoint, show_value
from servelab.reports.document import Bullets, Table, Text

TIME_WINDOWS = 6
"""Windows of arrival time the hit rate over a run is shown in."""
LEAD = 0.005
"""A hit-rate difference below this (half a percentage point) is called even."""


def hit_rate_windows(point: ReportPoint, windows: int = TIME_WINDOWS) -> list[float | None]:
    """The hit rate of the requests that arrived in each of `windows` equal windows of the
    run's arrivals (finished requests only; None for a window where none finished)."""
    reqs = point.requests
    cached = floats(reqs, "cached_tokens")
    done = finished_mask(reqs) & ~np.isnan(cached)
    arrival = floats(reqs, "arrival_s")[done]
    prompt = ints(reqs, "prompt_tokens")[done].astype(float)
    cached = cached[done]
    if not len(arrival):
        return [None] * windows
    lo, hi = float(arrival.min()), float(arrival.max())
    edges = np.linspace(lo, hi if hi > lo else lo + 1.0, windows + 1)
    hits, _ = np.histogram(arrival, bins=edges, weights=cached)
    total, _ = np.histogram(arrival, bins=edges, weights=prompt)
    return [float(h / t) if t else None for h, t in zip(hits, total)]


def prefix_section(c: Comparison) -> list:
    """Blocks of the section, or [] when no point's prefix cache served a token."""
    points = [p for p in c.points if p.summary.get("prefix_cache_hit_rate")]
    if not points:
        return []
    tier = any(p.summary.get("prefix_cache_cpu_hit_rate") for p in points)
    label_axes = [a for a in c.axes if a not in ("policy", "rate") and len(c.axes[a]) > 1]
    axis_names = [a.replace("_", " ").capitalize() for a in label_axes]
    headers = ["Policy", "Rate (req/s)", *axis_names, "Hit rate (%)"]
    if tier:
        headers += ["from GPU (%)", "from CPU tier (%)"]
    rows = []
    for p in c.points:
        s = p.summary
        row = [p.policy, f"{p.rate:g}", *(show_value(p.labels[a]) for a in label_axes),
               _pct(s.get("prefix_cache_hit_rate"))]
        if tier:
            row += [_pct(s.get("prefix_cache_gpu_hit_rate")), _pct(s.get("prefix_cache_cpu_hit_rate"))]
        rows.append(row)
    windows = [[p.policy, f"{p.rate:g}", *(show_value(p.labels[a]) for a in label_axes),
                *(_pct(v) for v in hit_rate_windows(p))] for p in c.points]
    doc: list = [Text("Prefix-cache hit rate: prompt tokens served from the cache over prompt "
                      "tokens of finished requests" + (", split by the tier the hits came from"
                                                       if tier else "") + "."),
                 Table(headers, rows),
                 Text(f"Hit rate over each run (%), requests by when they arrived, in "
                      f"{TIME_WINDOWS} equal windows of the arrivals: a cache warms up, and a "
                      "rate that falls late in a run means reuse outran the cache."),
                 Table(["Policy", "Rate (req/s)", *axis_names,
                        *(f"{i + 1}/{TIME_WINDOWS}" for i in range(TIME_WINDOWS))], windows)]
    found = prefix_findings(c.points)
    if found:
        doc += [Text("What prefix-aware scheduling and routing bought:"), Bullets(found)]
    return doc


def prefix_findings(points: Sequence[ReportPoint]) -> list[str]:
    """Sentences comparing `lpm` with the best other policy, and the prefix-affinity
    router with round-robin, on hit rate: each among points that differ in nothing else."""
    out = []
    for mine, others in _alternatives(points, ("policy", "policy_options"), "policy", "lpm"):
        best = max(others, key=_rate)
        out.append(_compare("lpm", mine, f"the best other policy's ({best.policy})", best,
                            show_router=True))
    for mine, others in _alternatives(points, ("router",), "router", "prefix-affinity"):
        for other in others:
            if other.config["router"] == "round-robin":
                out.append(_compare(f"prefix-affinity routing ({mine.policy})", mine,
                                    "round-robin's", other, show_router=False))
    return out


def _alternatives(points: Sequence[ReportPoint], fields: tuple[str, ...], field: str, value: str):
    """(a point whose config[field] is `value`, the points whose config differs from its
    in `fields` only and whose config[field] is another value), for every such point."""
    def rest(p: ReportPoint) -> tuple:
        return tuple(sorted((k, repr(v)) for k, v in p.config.items() if k not in fields))

    groups: dict[tuple, list[ReportPoint]] = {}
    for p in points:
        groups.setdefault(rest(p), []).append(p)
    for group in groups.values():
        others = [p for p in group if p.config[field] != value]
        for mine in (p for p in group if p.config[field] == value):
            if others:
                yield mine, others


def _compare(what: str, mine: ReportPoint, name: str, other: ReportPoint, *, show_router: bool) -> str:
    a, b = _rate(mine), _rate(other)
    verdict = "even with" if abs(a - b) < LEAD else "above" if a > b else "below"
    cfg = mine.config
    where = f"{mine.rate:g} req/s"
    if cfg["replicas"] > 1:
        where += f", {cfg['replicas']} replicas" + (f" ({cfg['router']})" if show_router else "")
    return (f"{what} at {where}: hit rate {_pct(a)}%, {verdict} {name} {_pct(b)}% "
            f"({(a - b) * 100:+.1f} pp).")


def _rate(p: ReportPoint) -> float:
    return p.summary.get("prefix_cache_hit_rate") or 0.0


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}"
