"""A policy comparison as stored on disk, and the analyses the report draws on.

    c = load_comparison(Path("runs/cmp"))          # DIR as `servelab compare` left it
    c.points, c.groups(), windowed_jain(point.requests)

It reads files only: DIR/sweep.json (the grid) and each point's run directory under
DIR/runs (config.json, summary.json, requests.csv, steps.csv), so a report can be rebuilt
at any time, and a resumed sweep's report covers every point.

Cost: every point's records are loaded (about 200 bytes per request and per step record).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from servelab.labels import show_value
from servelab.records import RequestRecord, StepRecord
from servelab.reports.columns import floats, ints
from servelab.reports.metrics import VTC_INPUT_WEIGHT, VTC_OUTPUT_WEIGHT
from servelab.reports.plots import MemoryStats
from servelab.reports.runio import read_json, read_requests, read_steps

# The sweep layout `servelab.sweeps.sweep` writes (reports do not import the simulator).
SWEEP_FILE, RUNS_DIR, DONE_MARKER = "sweep.json", "runs", "done.json"
SWEEP_FORMAT = "servelab.sweep/1"
SERVICE_WINDOWS = 24


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
            missing.append(describe_labels(labels))
            continue
        config = read_json(run_dir / "config.json")
        requests = read_requests(run_dir)
        rate = labels.get("rate")
        points.append(ReportPoint(entry["name"], labels, config["config"], config.get("derived", {}),
                                  read_json(run_dir / "summary.json"), requests,
                                  read_steps(run_dir),
                                  float(rate) if rate is not None else offered_rate(requests)))
    if not points:
        raise ValueError(f"{out_dir}: none of the sweep's {len(sweep['points'])} points is stored yet")
    return Comparison(out_dir, sweep["axes"], points, missing)


def offered_rate(requests: Sequence[RequestRecord]) -> float:
    """Requests over the span of their arrivals: the traffic a run was offered (req/s)."""
    arrivals = floats(requests, "arrival_s")
    span = float(arrivals.max() - arrivals.min())
    return round(len(arrivals) / span, 3) if span > 0 else 0.0


def describe_labels(labels: Mapping[str, Any]) -> str:
    return ", ".join(f"{a}={show_value(v, a)}" for a, v in labels.items())


# --------------------------------------------------------------------------- analysis
def leaders(values: Mapping[str, float | None], better: Callable, margin: float) -> tuple[list[str], bool]:
    """(the policies with the best value, whether they lead by more than `margin`).

    `better` is max or min; policies without a value (None) do not compete. Policies
    within `margin` of the best (relative to the larger magnitude of the two) are all
    leaders; the lead is clear when some policy lies beyond that margin, i.e. the
    leaders are not everyone. A 0.5% difference in a simulated p99 is no reason to prefer
    a policy.
    """
    present = {p: v for p, v in values.items() if v is not None}
    if not present:
        return [], False
    best = better(present.values())
    tied = [p for p, v in present.items()
            if abs(v - best) <= margin * max(abs(v), abs(best)) or math.isclose(v, best, abs_tol=1e-9)]
    return tied, len(tied) < len(present)


def memory_stats(point: ReportPoint) -> MemoryStats:
    """KV memory held vs allocated, from steps.csv: tokens of the step's sequences (prefill
    context + chunk, decode context + 1) over KV blocks in use x block size."""
    steps = point.steps
    if not steps:
        return MemoryStats(0.0, 0, 0.0)
    block_size = point.config["block_size"]
    tokens = (ints(steps, "prefill_context_sum") + ints(steps, "num_prefill_tokens")
              + ints(steps, "decode_context_sum")).astype(float)
    slots = (ints(steps, "kv_blocks_used") * block_size).astype(float)
    weight = floats(steps, "duration_s")
    if weight.sum() <= 0:
        weight = ints(steps, "num_steps").astype(float)
    held = slots > 0
    utilization = float(np.dot(tokens[held] / slots[held], weight[held]) / weight[held].sum()) \
        if held.any() and weight[held].sum() > 0 else 0.0
    return MemoryStats(utilization, int(ints(steps, "num_running").max()),
                       float(point.summary["mean_kv_cache_usage"] or 0.0))


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
