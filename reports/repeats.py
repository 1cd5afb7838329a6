"""Policies whose runs repeat another policy's, and why: a report ranks distinct runs only.

On a workload with one tenant, one priority and no shared prefixes, fair share, priority
and lpm order the waiting queue exactly as FCFS does (`servelab.traits`, `Policy.acts_on`);
unless their preemption victims differ, their runs are the same runs, which is what
`repeated_policies` checks. Ranking them, or drawing a fairness figure per policy, would tell a reader that
"the policy does not matter" when the workload gave the policies nothing to act on.

    repeats = repeated_policies(points)   # {"priority": "fcfs", "fair": "fcfs"}
    text = repeats_text(repeats, points)  # one paragraph: who repeats whom, and why
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from servelab.reports.columns import column
from servelab.reports.comparison import ReportPoint
from servelab.traits import TRAIT_COLUMNS, WorkloadTraits


SAME_TO = 1e-9
"""Relative tolerance of 'the same time': a policy that charges service runs the engine
one decode at a time where FCFS batches them, so the same schedule can sum its step
times in another order and differ in the last bits."""


def repeated_policies(points: Sequence[ReportPoint]) -> dict[str, str]:
    """Policy -> the first policy (in the points' order) that made the same schedule at
    every rate it ran: every request scheduled, first served, finished (or rejected) at the
    same times, to SAME_TO, and preempted as often. (Summaries can differ where they
    average over step records, which a batched and an unbatched engine write differently.)"""
    series: dict[str, dict[float, list[tuple]]] = {}
    for p in points:
        series.setdefault(p.policy, {})[p.rate] = _schedule(p.requests)
    repeats: dict[str, str] = {}
    distinct: list[str] = []
    for policy, runs in series.items():
        same = next((d for d in distinct if _same(series[d], runs)), None)
        if same is None:
            distinct.append(policy)
        else:
            repeats[policy] = same
    return repeats


def _schedule(requests) -> list[tuple]:
    return sorted((r.request_id, r.status, r.num_preemptions, r.scheduled_s, r.first_token_s,
                   r.finish_s) for r in requests)


def repeats_text(repeats: dict[str, str], points: Sequence[ReportPoint]) -> str | None:
    """'priority and fair made the same schedule as fcfs at every rate (...). They are
    shown once, as fcfs.' (None when every policy ran differently)."""
    if not repeats:
        return None
    missing = WorkloadTraits.of_columns(*(
        [v for p in points for v in column(p.requests, name)] for name in TRAIT_COLUMNS)).missing()
    why = (f"this workload: {'; '.join(missing)}" if missing else
           "at these rates nothing waited long enough for them to reorder it")
    sentences = []
    for original in dict.fromkeys(repeats.values()):
        copies = [p for p, o in repeats.items() if o == original]
        sentences.append(f"{_names(copies)} made the same schedule as {original} at every rate ({why}). "
                         f"The findings and figures below show {'them' if len(copies) > 1 else 'it'} "
                         f"once, as {original}.")
    return " ".join(sentences)


def _same(a, b) -> bool:
    """Equal structure; numbers equal to SAME_TO."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return (a is not None and b is not None
                and math.isclose(a, b, rel_tol=SAME_TO, abs_tol=SAME_TO))
    return a == b


def _names(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
