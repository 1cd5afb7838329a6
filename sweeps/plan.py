"""Deployment planning: the cheapest layout that meets the SLO targets at a given traffic.

    layouts = [Layout((("gpu", "h100-sxm"), ("tp", 1), ("policy", "fcfs")), gpus_per_replica=1,
                      cost_per_replica=4.76, build=lambda n: replace(base, replicas=n), max_replicas=64)]
    with SweepRunner(Path("runs/plan"), workers=2) as runner:
        plan = search_plan(layouts, runner, targets=SloTargets(None, (PercentileTarget("ttft", 99, 2000),)))
    plan.best.replicas, plan.best.cost                  # 5 replicas, $23.80 an hour

A layout is every knob but the replica count (GPU kind, tensor parallelism, policy,
router, ...); for each, the search finds the fewest replicas whose run meets every
target, and across layouts the one that costs least (per hour, or in GPUs). A
disaggregated layout's count is of pool units instead: n units of a P:D shape are n x P
prefill and n x D decode replicas (its `build` says so; the search is the same).

Replica count is searched as a monotone quantity: at the same total traffic, another
replica lowers every replica's load, so a count that meets the targets is taken to mean
every larger count does. Per layout, in rounds (each round one batch on the runner, every
layout together, like `sweeps/capacity.py`):

1. doubling from one replica (1, 2, 4, ...) until a count meets the targets or the layout
   reaches its most replicas (`max_replicas`);
2. bisection between the largest count that missed and the smallest that met, until they
   are neighbours: the smaller of them is then known to miss, so the answer is checked on
   both sides by runs that exist.

Pruning: a layout whose next count to try already costs more than a count known to meet
the targets elsewhere cannot win; it stops there, reported as pruned with its lower bound.
Layouts that tie the best keep going, so runner-ups at the same cost are found too.

Monotonicity is checked, not trusted: where a count missed although a smaller one met
(a round-robin split or a seeded burst can do that), the layout carries a note, and the
answer stands on the bisected pair (the smallest count met, the one below missed).

Every run is an ordinary sweep point (`sweeps/sweep.py`), stored under DIR/runs and reused
when found there: an interrupted plan resumes, and a second plan over an overlapping
space reruns nothing it already ran.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servelab.labels import count_words
from servelab.reports.slo import SloTargets
from servelab.simulator.run import SimulationConfig
from servelab.sweeps.runner import SweepRunner
from servelab.sweeps.sweep import PointOutcome, Progress, SweepPoint

PLAN_FILE = "plan.json"
PLAN_FORMAT = "servelab.plan/1"
EDGE = 0.05
"""A run within 5% of a target (`SloTargets.tightness` within 1 ± EDGE) decided its count
by a hair: the answer carries a note."""


@dataclass(frozen=True)
class Layout:
    """One way to deploy, all but the replica count."""

    labels: tuple[tuple[str, Any], ...]
    """(axis, value) in axis order, e.g. (("gpu", "h100-sxm"), ("tp", 2), ("policy", "fcfs"))."""
    gpus_per_replica: int
    cost_per_replica: float
    """What one replica costs in the objective's unit ($ an hour, or GPUs)."""
    build: Callable[[int], SimulationConfig]
    """The config at a replica count."""
    max_replicas: int

    def __post_init__(self) -> None:
        if self.max_replicas < 1:
            raise ValueError(f"a layout needs room for one replica, got max_replicas={self.max_replicas}")


@dataclass(frozen=True)
class Trial:
    """One run of a layout at a replica count."""

    replicas: int
    name: str
    """The run's directory under DIR/runs."""
    held: bool
    misses: tuple[str, ...] = ()
    """The targets it missed, with the values reached (`SloTargets.misses`)."""
    tightness: float | None = None
    """`SloTargets.tightness`: <= 1 when it held; None when the run failed."""
    summary: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    error: str | None = None


@dataclass(frozen=True)
class LayoutResult:
    labels: Mapping[str, Any]
    gpus_per_replica: int
    cost_per_replica: float
    max_replicas: int
    trials: tuple[Trial, ...]
    """Every run of the layout, by replica count."""
    pruned_at: int | None = None
    """The count the layout would have tried next when it was pruned."""
    notes: tuple[str, ...] = ()

    @property
    def met(self) -> Trial | None:
        """The smallest count that met the targets below every count that missed above it
        (the bisected answer), else the smallest that met."""
        held = [t for t in self.trials if t.held]
        return held[0] if held else None

    @property
    def below(self) -> Trial | None:
        """The run with one replica fewer than `met`, when there is one."""
        met = self.met
        return next((t for t in self.trials if met is not None and t.replicas == met.replicas - 1), None)

    @property
    def status(self) -> str:
        """'found' (the fewest replicas that meet the targets), 'pruned' (cannot beat the
        best), 'unmet' (missed at max_replicas), 'failed' (a run raised) or 'unresolved'."""
        if any(t.error for t in self.trials):
            return "failed"
        met = self.met
        if met is not None and (met.replicas == 1 or self.below is not None):
            return "found"
        if self.pruned_at is not None:
            return "pruned"
        missed = [t for t in self.trials if not t.held]
        if met is None and missed and missed[-1].replicas >= self.max_replicas:
            return "unmet"
        return "unresolved"

    @property
    def replicas(self) -> int | None:
        return self.met.replicas if self.status == "found" else None

    @property
    def gpus(self) -> int | None:
        return None if self.replicas is None else self.replicas * self.gpus_per_replica

    @property
    def cost(self) -> float | None:
        return None if self.replicas is None else self.replicas * self.cost_per_replica

    @property
    def lower_bound(self) -> float:
        """The least this layout can cost: its fewest replicas not known to miss."""
        missed = [t.replicas for t in self.trials if not t.held and not t.error]
        below_met = [r for r in missed if self.met is None or r < self.met.replicas]
        return (max(below_met, default=0) + 1) * self.cost_per_replica

    def to_dict(self) -> dict[str, Any]:
        return {"labels": dict(self.labels), "status": self.status, "replicas": self.replicas,
                "gpus_per_replica": self.gpus_per_replica, "cost_per_replica": self.cost_per_replica,
                "cost": self.cost, "max_replicas": self.max_replicas, "pruned_at": self.pruned_at,
                "lower_bound": self.lower_bound, "notes": list(self.notes),
                "trials": [{"replicas": t.replicas, "run": t.name, "held": t.held, "misses": list(t.misses),
                            "tightness": t.tightness, "error": t.error} for t in self.trials]}


@dataclass
class _State:
    layout: Layout
    trials: dict[int, Trial] = field(default_factory=dict)
    pruned_at: int | None = None

    def bounds(self) -> tuple[int, int | None]:
        """(the largest count that missed below the smallest that met, that one)."""
        ok = sorted(n for n, t in self.trials.items() if t.held)
        hi = ok[0] if ok else None
        lo = max((n for n, t in self.trials.items() if not t.held and (hi is None or n < hi)), default=0)
        return lo, hi

    def done(self) -> bool:
        if self.pruned_at is not None or any(t.error for t in self.trials.values()):
            return True
        lo, hi = self.bounds()
        return (hi is not None and hi == lo + 1) or (hi is None and lo >= self.layout.max_replicas)

    def next_counts(self, count: int) -> list[int]:
        lo, hi = self.bounds()
        if hi is None:   # doubling: 1, 2, 4, ... capped at the layout's most
            out, n = [], max(1, 2 * lo)
            while len(out) < count and lo < self.layout.max_replicas:
                n = min(n, self.layout.max_replicas)
                if n not in out:
                    out.append(n)
                if n == self.layout.max_replicas:
                    break
                n *= 2
            return out
        step = (hi - lo) / (count + 1)
        return sorted({min(hi - 1, max(lo + 1, round(lo + step * j))) for j in range(1, count + 1)})

    def result(self) -> LayoutResult:
        trials = tuple(self.trials[n] for n in sorted(self.trials))
        notes = []
        _, hi = self.bounds()
        above = [t.replicas for t in trials if hi is not None and not t.held and not t.error and t.replicas > hi]
        if above:
            notes.append(f"not monotone: {_counts(above)} missed although {hi} met; the answer is the "
                         f"smallest count that met with the one below it missing")
        return LayoutResult(dict(self.layout.labels), self.layout.gpus_per_replica,
                            self.layout.cost_per_replica, self.layout.max_replicas, trials,
                            self.pruned_at, tuple(notes))


@dataclass(frozen=True)
class Plan:
    targets: SloTargets
    results: tuple[LayoutResult, ...]
    """One per layout, in the order given."""

    @property
    def ranked(self) -> list[LayoutResult]:
        """The layouts that found their fewest replicas, cheapest first (then fewer GPUs,
        then more margin below the targets)."""
        found = [r for r in self.results if r.status == "found"]
        return sorted(found, key=lambda r: (round(r.cost, 9), r.gpus, r.met.tightness))

    @property
    def best(self) -> LayoutResult | None:
        ranked = self.ranked
        return ranked[0] if ranked else None

    def edge_notes(self, result: LayoutResult) -> list[str]:
        """Where a layout's answer was decided by a hair, in words."""
        notes = []
        below = result.below
        if below is not None and below.tightness is not None and below.tightness <= 1 + EDGE:
            notes.append(f"{count_words(result.labels, below.replicas)} missed by a hair "
                         f"({'; '.join(below.misses)})")
        met = result.met
        if met is not None and met.tightness is not None and met.tightness >= 1 - EDGE:
            notes.append(f"{count_words(result.labels, met.replicas)} met with little margin "
                         f"({_margin(met.tightness)} below the tightest target)")
        return notes



def search_plan(layouts: Sequence[Layout], runner: SweepRunner, *, targets: SloTargets,
                progress: Progress | None = None,
                on_round: Callable[[int, int], None] | None = None) -> Plan:
    """Search every layout (see the module docstring). `on_round(round, runs)` is called
    before each round's batch runs."""
    if not layouts:
        raise ValueError("no layout to search")
    states = [_State(layout) for layout in layouts]
    round_no = 0
    while True:
        _prune(states)
        active = [st for st in states if not st.done()]
        if not active:
            break
        per_layout = max(1, runner.workers // len(active))
        batch: list[tuple[_State, int, SweepPoint]] = []
        for st in active:
            for n in st.next_counts(per_layout):
                labels = (*st.layout.labels, ("replicas", n))
                batch.append((st, n, SweepPoint(st.layout.build(n), labels)))
        round_no += 1
        if on_round is not None:
            on_round(round_no, len(batch))
        outcomes = runner.run([point for _, _, point in batch], progress)
        for (st, n, _), outcome in zip(batch, outcomes):
            st.trials[n] = _trial(n, outcome, targets)
    return Plan(targets, tuple(st.result() for st in states))


def _prune(states: Sequence[_State]) -> None:
    """Stop every layout whose next count costs more than a count known to meet elsewhere."""
    best = min((st.layout.cost_per_replica * hi for st in states
                if (hi := st.bounds()[1]) is not None), default=None)
    if best is None:
        return
    for st in states:
        if st.done():
            continue
        lo, _ = st.bounds()
        if (lo + 1) * st.layout.cost_per_replica > best * (1 + 1e-9):
            st.pruned_at = lo + 1


def _trial(replicas: int, outcome: PointOutcome, targets: SloTargets) -> Trial:
    if outcome.status == "failed" or outcome.summary is None:
        return Trial(replicas, outcome.point.name, False, error=outcome.error or "no summary stored")
    misses = tuple(targets.misses(outcome.summary))
    return Trial(replicas, outcome.point.name, not misses, misses, targets.tightness(outcome.summary),
                 outcome.summary)


def _counts(values: Sequence[int]) -> str:
    return ", ".join(str(v) for v in values) + (" replicas" if values[-1] != 1 or len(values) > 1 else " replica")


def _margin(tightness: float) -> str:
    return f"{(1 - tightness):.0%}"


def write_plan_file(out_dir: Path, plan: Plan, *, settings: Mapping[str, Any],
                    unsettled: Mapping[int, str | None]) -> None:
    """DIR/plan.json: the settings (traffic, objective, prices), the targets, and per layout
    its runs, answer and notes (`unsettled[i]`: why layout i's answer had not settled)."""
    from servelab.reports.runio import write_json

    layouts = []
    for i, r in enumerate(plan.results):
        entry = r.to_dict()
        entry["edge_notes"] = plan.edge_notes(r)
        entry["unsettled"] = unsettled.get(i)
        layouts.append(entry)
    best = plan.best
    write_json(Path(out_dir) / PLAN_FILE, {
        "format": PLAN_FORMAT, "targets": plan.targets.to_dict(), "criterion": str(plan.targets),
        **settings, "best": None if best is None else plan.results.index(best), "layouts": layouts})
