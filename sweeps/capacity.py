"""Capacity search: per policy (and per value of any other swept knob), the highest request
rate at which at least a target share of the requests meet their SLOs.

    searches = [Search((("policy", p),), lambda rate, p=p: config_for(p, rate)) for p in policies]
    with SweepRunner(Path("runs/cap"), workers=2) as runner:
        found = search_capacity(searches, runner, start_rates=[15.2], target=0.9, tolerance=0.02)
    found[0].held.rate, found[0].broke.rate     # the bracket: last rate that held, first that broke

Every probe is an ordinary sweep point (`sweeps/sweep.py`): the same seeded workload
rescaled to the probe's rate, stored under DIR/runs/<point>/ and skipped when found there,
so an interrupted search resumes and a search with another tolerance reuses what it can.

The search, per group, in rounds (each round runs one batch on the runner, all groups
together):

1. the start rates, for every group (a shared ladder: comparable curves);
2. bracketing: while every rate held, the next is the highest x a factor (FIRST_STEP,
   squared at each further step: 1.1, 1.21, 1.46, 2.14, ...), while every rate broke, the
   lowest / that factor; at most MAX_BRACKET_STEPS steps either way (a start within 10% of
   the capacity brackets it in one step, one 400x off in six);
3. bisection in log space between the last rate that held and the first that broke, with
   `workers // groups` probes per group and round (so one group alone still fills the
   workers), until the bracket is within `tolerance` of its lower end.

Attainment need not be monotone in the rate (the seeded arrivals differ in detail): the
bracket is always the first (lowest) rate that broke and the highest rate below it that
held, so the capacity is conservative, and a rate above it that held is reported as a note.

A probe that fails (its run raised) stops its group's search, not the others': the group's
status is 'failed', its capacity unknown, and its bracket is what its other probes found.

Cost: one simulation per probe; about log2(log(step) / log(1 + tolerance)) + 2 rounds,
e.g. 5 rounds of one probe per group from a start within 10% of the capacity.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servelab.reports.slo import PercentileTarget, SloTargets
from servelab.simulator.run import SimulationConfig
from servelab.sweeps.runner import SweepRunner
from servelab.sweeps.sweep import PointOutcome, Progress, SweepPoint

DEFAULT_ATTAINMENT = 0.9
DEFAULT_TOLERANCE = 0.02
FIRST_STEP = 1.1
MAX_BRACKET_STEPS = 6
"""Bracketing steps either way (x1.1, 1.21, 1.46, 2.14, 4.59, 21.1: 400x in all): beyond
them a group is reported as holding (or breaking) at every rate tried."""
CAPACITY_FILE = "capacity.json"
CAPACITY_FORMAT = "servelab.capacity/1"
LATE_ALLOWANCE = 0.02
"""How far below the target the attainment of a run's second half may fall before the
run counts as carried by its empty start (`steady_state_warning`): a run right at the
target is not flagged for a point or two between its halves."""
RATE_DIGITS = 4
"""Significant digits of a probe rate (15.63 req/s): readable names, far finer than any
useful tolerance."""


@dataclass(frozen=True)
class Search:
    """One capacity to find: the values of the other axes, and the config at a rate."""

    labels: tuple[tuple[str, Any], ...]
    """(axis, value) in axis order, e.g. (("policy", "sjf"),); "rate" is appended per probe."""
    build: Callable[[float], SimulationConfig]


@dataclass(frozen=True)
class Probe:
    rate: float
    name: str
    """The point's directory under DIR/runs."""
    attainment: float | None
    """Share of all requests (rejected ones count as misses) that met their SLOs; None
    when the point failed."""
    held: bool
    error: str | None = None
    misses: tuple[str, ...] = ()
    """The targets the probe missed, with the values it reached (`SloTargets.misses`)."""


@dataclass(frozen=True)
class Capacity:
    """What the search found for one group."""

    labels: Mapping[str, Any]
    target: float | None
    """The attainment target (None: percentile targets alone decide)."""
    tolerance: float
    probes: tuple[Probe, ...]
    """Every probe of the group, by rate."""
    held: Probe | None
    """The highest rate that held below the first that broke (None: none held)."""
    broke: Probe | None
    """The first (lowest) rate that broke (None: none broke)."""
    notes: tuple[str, ...] = ()

    @property
    def status(self) -> str:
        """'found' (a bracket within the tolerance), 'holds' (held at every rate tried),
        'breaks' (broke at every rate tried), 'failed' (a probe could not run) or
        'unresolved' (stopped before the bracket was narrow enough)."""
        if self.failed:
            return "failed"
        if self.broke is None:
            return "holds"
        if self.held is None:
            return "breaks"
        return "found" if self.width <= self.tolerance * (1 + 1e-9) else "unresolved"

    @property
    def rate(self) -> float | None:
        """The capacity: the last rate that held (None when none did, or a probe failed)."""
        return self.held.rate if self.held is not None and not self.failed else None

    @property
    def failed(self) -> tuple[Probe, ...]:
        """The probes that could not run, by rate."""
        return tuple(p for p in self.probes if p.error)

    @property
    def width(self) -> float | None:
        """(first broken - last held) / last held."""
        if self.held is None or self.broke is None:
            return None
        return self.broke.rate / self.held.rate - 1

    def to_dict(self) -> dict[str, Any]:
        def probe(p: Probe | None) -> dict | None:
            return None if p is None else {"rate": p.rate, "attainment": p.attainment, "run": p.name,
                                           "misses": list(p.misses)}
        return {"labels": dict(self.labels), "status": self.status, "capacity": self.rate,
                "held": probe(self.held), "broke": probe(self.broke), "bracket_width": self.width,
                "notes": list(self.notes),
                "probes": [{"rate": p.rate, "attainment": p.attainment, "held": p.held, "run": p.name,
                            "error": p.error} for p in self.probes]}


@dataclass
class _State:
    search: Search
    probes: dict[float, Probe] = field(default_factory=dict)
    step: float = FIRST_STEP
    steps_taken: int = 0

    def bracket(self) -> tuple[Probe | None, Probe | None]:
        """(the highest rate that held below the first that broke, that one); probes that
        failed neither hold nor break."""
        ordered = sorted((p for p in self.probes.values() if not p.error), key=lambda p: p.rate)
        broke = next((p for p in ordered if not p.held), None)
        below = [p for p in ordered if p.held and (broke is None or p.rate < broke.rate)]
        return (below[-1] if below else None), broke


def search_capacity(searches: Sequence[Search], runner: SweepRunner, *, start_rates: Sequence[float],
                    target: float | None = DEFAULT_ATTAINMENT, tolerance: float = DEFAULT_TOLERANCE,
                    percentiles: Sequence[PercentileTarget] = (), progress: Progress | None = None,
                    on_round: Callable[[int, int], None] | None = None) -> list[Capacity]:
    """Find each search's capacity (see the module docstring); one `Capacity` per search,
    in order. A rate holds when at least `target` of the requests met their SLOs and every
    percentile target held (`SloTargets`; target None: the percentiles alone).
    `on_round(round, points)` is called before each round's batch runs."""
    targets = SloTargets(target, tuple(percentiles))
    if not 0 < tolerance < 1:
        raise ValueError(f"the tolerance must be in (0, 1), got {tolerance!r}")
    rates = sorted({_rounded(r) for r in start_rates})
    if not rates or rates[0] <= 0:
        raise ValueError(f"start rates must be > 0, got {list(start_rates)!r}")
    states = [_State(s) for s in searches]
    wanted = {id(st): list(rates) for st in states}
    round_no = 0
    while any(wanted.values()):
        round_no += 1
        batch: list[tuple[_State, SweepPoint]] = []
        for st in states:
            for rate in wanted.get(id(st), ()):
                batch.append((st, SweepPoint(st.search.build(rate), (*st.search.labels, ("rate", rate)))))
        if on_round is not None:
            on_round(round_no, len(batch))
        outcomes = runner.run([point for _, point in batch], progress)
        for (st, _), outcome in zip(batch, outcomes):
            st.probes[outcome.point.config.rate] = _probe(outcome, targets)
        active = [st for st in states if not _done(st, tolerance)]
        per_group = max(1, runner.workers // max(1, len(active)))
        wanted = {id(st): _next_rates(st, tolerance, per_group) for st in active}
    return [_result(st, target, tolerance) for st in states]


def _probe(outcome: PointOutcome, targets: SloTargets) -> Probe:
    from servelab.reports.slo import slo_attainment

    rate = outcome.point.config.rate
    if outcome.status == "failed" or outcome.summary is None:
        return Probe(rate, outcome.point.name, None, False, outcome.error or "no summary stored")
    misses = tuple(targets.misses(outcome.summary))
    return Probe(rate, outcome.point.name, slo_attainment(outcome.summary), not misses, misses=misses)


def _done(st: _State, tolerance: float) -> bool:
    """A probe failed, the bracket is narrow enough (or cannot narrow at RATE_DIGITS), or
    bracketing ran out of steps."""
    if any(p.error for p in st.probes.values()):
        return True
    held, broke = st.bracket()
    if held is None or broke is None:
        return st.steps_taken >= MAX_BRACKET_STEPS
    return broke.rate / held.rate - 1 <= tolerance * (1 + 1e-9) or \
        _between(math.sqrt(held.rate * broke.rate), held.rate, broke.rate) is None


def _next_rates(st: _State, tolerance: float, count: int) -> list[float]:
    """The rates to probe next for a group that is not done (advances its bracketing step)."""
    held, broke = st.bracket()
    if broke is None or held is None:
        rates = sorted(st.probes)
        rate = rates[-1] * st.step if broke is None else rates[0] / st.step
        st.step, st.steps_taken = st.step ** 2, st.steps_taken + 1
        return [_rounded(rate)]
    ratio = broke.rate / held.rate
    rates: list[float] = []
    for j in range(1, count + 1):
        rate = _between(held.rate * ratio ** (j / (count + 1)), held.rate, broke.rate)
        if rate is not None and rate not in st.probes and rate not in rates:
            rates.append(rate)
    return rates


def _rounded(rate: float, digits: int = RATE_DIGITS) -> float:
    return float(f"{rate:.{digits}g}")


def _between(rate: float, low: float, high: float) -> float | None:
    """`rate` rounded to as few digits as keep it strictly between low and high."""
    for digits in range(RATE_DIGITS, 16):
        r = _rounded(rate, digits)
        if low < r < high:
            return r
    return None


def _result(st: _State, target: float | None, tolerance: float) -> Capacity:
    held, broke = st.bracket()
    probes = tuple(sorted(st.probes.values(), key=lambda p: p.rate))
    notes = []
    if broke is not None:
        above = [p for p in probes if p.held and p.rate > broke.rate]
        if above:
            notes.append(f"attainment is not monotone in the rate: {_list(above)} held although "
                         f"{broke.rate:g} req/s broke ({broke.attainment:.1%}); the capacity is "
                         "the bracket below the first rate that broke")
    return Capacity(dict(st.search.labels), target, tolerance, probes, held, broke, tuple(notes))


def _list(probes: Sequence[Probe]) -> str:
    return ", ".join(f"{p.rate:g} req/s ({p.attainment:.1%})" for p in probes)


def steady_state_warning(capacity: Capacity, runs_dir: Path) -> str | None:
    """What shows that the run at the capacity had not reached a steady state, or None.

    A run starts with an empty system, so its first requests are served fast whatever the
    load; if the requests arriving in the second half of the run met their SLOs less often
    than the target (by more than LATE_ALLOWANCE, the sampling noise of half a run), the
    empty start carried the run, and a longer run at that rate would miss it. A waiting queue that never emptied over the last quarter of the arrivals
    (`reports.health.overload`) says the same from the queue's side. Either way the
    capacity found is an upper bound. Reads that run's records.
    """
    from servelab.reports.health import overload
    from servelab.reports.metrics import slo_outcomes
    from servelab.reports.runio import read_json, read_requests

    if capacity.held is None:
        return None
    run = runs_dir / capacity.held.name
    requests = read_requests(run)
    config = read_json(run / "config.json")["config"]
    met = slo_outcomes(requests, slo_ttft_ms=config["slo_ttft_ms"], slo_tpot_ms=config["slo_tpot_ms"]).met
    arrivals = requests.column("arrival_s").tolist()
    middle = (min(arrivals) + max(arrivals)) / 2
    late = [ok for ok, t in zip(met, arrivals) if t >= middle]
    evidence = []
    late_share = sum(late) / len(late) if late else 1.0
    if capacity.target is not None and late_share < capacity.target - LATE_ALLOWANCE:
        evidence.append(f"only {late_share:.1%} of the requests arriving in the second half of the run met "
                        f"their SLOs ({capacity.held.attainment:.1%} of all)")
    sign = overload(requests)
    if sign is not None:
        evidence.append(sign.evidence())
    return f"at {capacity.held.rate:g} req/s " + "; ".join(evidence) if evidence else None


def write_capacity_file(out_dir: Path, found: Sequence[Capacity], warnings: Mapping[int, str | None], *,
                        start_rates: Sequence[float], num_requests: int | None,
                        percentiles: Sequence[PercentileTarget] = ()) -> None:
    """DIR/capacity.json: the settings (the targets, and `criterion`: them in words), and
    per group its bracket, probes, notes and the steady-state warning (warnings[i] for
    found[i])."""
    from servelab.reports.runio import write_json

    groups = []
    for i, c in enumerate(found):
        entry = c.to_dict()
        entry["steady_state_warning"] = warnings.get(i)
        groups.append(entry)
    target = found[0].target if found else DEFAULT_ATTAINMENT
    tolerance = found[0].tolerance if found else DEFAULT_TOLERANCE
    targets = SloTargets(target, tuple(percentiles))
    write_json(Path(out_dir) / CAPACITY_FILE, {
        "format": CAPACITY_FORMAT, "attainment_target": target, "tolerance": tolerance,
        "percentile_targets": targets.to_dict()["percentiles"], "criterion": str(targets),
        "start_rates": list(start_rates), "num_requests": num_requests, "groups": groups})
