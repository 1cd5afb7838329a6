"""Sweeps: a grid of simulations, each point run once, stored atomically, resumable.

    points = expand_grid({"policy": ["fcfs", "sjf"], "rate": [12.0, 16.0]}, override_builder(base))
    outcome = run_sweep(points, Path("runs/cmp"), workers=4)            # sweeps/runner.py

Layout of the sweep directory DIR:

    DIR/sweep.json            the grid: axes, and every point's name, key and axis values
    DIR/runs/<name>/          one `servelab simulate` run directory per point (config.json,
                              summary.json, requests.csv, steps.csv) and, written last,
                              done.json holding the point's key

A point is identified by `config_key`: the SHA-256 of the canonical JSON of its full
`SimulationConfig`, so any change to any field is another point, and a rerun finds the
points that are already done and skips them: an interrupted sweep resumes where it stopped.
The key covers the config, not the simulator's code: after changing the simulator, sweep
into a fresh DIR (or delete DIR/runs).

Atomicity: a point is written into a hidden temporary directory beside its final place
(marker last), then renamed into place with one `os.rename`, so a killed sweep leaves
either a complete point or a temporary directory that the next run deletes, never a half
point. Two writers of the same point (a retried task, an orphaned worker of a killed
sweep) cannot both land: the second rename finds the first one's directory and discards
its own copy. One sweep per DIR at a time: the driver holds an exclusive lock on
DIR/.sweep.lock (released by the kernel if the driver is killed).

Running the points (a process pool or Ray) is `sweeps/runner.py`: `run_sweep` for a grid,
`SweepRunner` for batches chosen as a search goes.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from servelab.config import SchedulerConfig
from servelab.labels import show_value
from servelab.simulator.run import SimulationConfig

KEY_FORMAT = "servelab.sweep-key/1"
SWEEP_FORMAT = "servelab.sweep/1"
SWEEP_FILE = "sweep.json"
RUNS_DIR = "runs"
DONE_MARKER = "done.json"
LOCK_FILE = ".sweep.lock"
RAY_INSTALL_HINT = "pip install 'servelab[ray]'"

#: Errors that belong to one point (its inputs cannot be simulated: a model that does not
#: fit the GPU, a missing trace file): the point is reported as failed, the sweep goes on.
#: Anything else is a bug and stops the sweep.
POINT_ERRORS = (ValueError, OSError)


class SweepError(Exception):
    """The sweep as a whole cannot go on (DIR locked, Ray missing, a corrupt DIR)."""


# --------------------------------------------------------------------------- keys and points
def config_key(config: SimulationConfig) -> str:
    """SHA-256 (hex) of the canonical JSON of `config.to_dict()`.

    Canonical: keys sorted, no whitespace, and integral floats written as integers, so
    configs that compare equal (rate=15 and rate=15.0) share a key; any field that changes
    the config changes the key. Costs one JSON encoding, microseconds.
    """
    payload = {"format": KEY_FORMAT, "config": _canonical(config.to_dict())}
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _canonical(value: Any) -> Any:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


@dataclass(frozen=True)
class SweepPoint:
    """One simulation of a grid: its config and the values of the swept axes that made it."""

    config: SimulationConfig
    labels: tuple[tuple[str, Any], ...]
    """(axis, value) in axis order, e.g. (("policy", "sjf"), ("rate", 12.0))."""
    key: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", config_key(self.config))

    @property
    def name(self) -> str:
        """Directory name: the axis values for people, a key prefix for uniqueness."""
        parts = [_slug(v) if axis == "policy" else f"{_AXIS_SHORT.get(axis, axis)}{_slug(v)}"
                 for axis, v in self.labels]
        return "_".join([*parts, self.key[:12]])

    def describe(self) -> str:
        return " ".join(f"{axis}={show_value(v, axis)}" for axis, v in self.labels) or self.key[:12]


_AXIS_SHORT = {"rate": "r", "block_size": "bs", "chunked_prefill": "chunk", "preemption": "",
               "router": "", "block_manager": "", "gpu": "", "model": "", "tp": "tp",
               "replicas": "x", "speculative": "spec-", "num_speculative_tokens": "k",
               "prefill_replicas": "p", "decode_replicas": "d"}


def _slug(value: Any) -> str:
    text = Path(value).name if isinstance(value, str) and os.sep in value else show_value(value)
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", text).strip("-") or "x"


def expand_grid(axes: Mapping[str, Sequence[Any]],
                build: Callable[[dict[str, Any]], SimulationConfig]) -> list[SweepPoint]:
    """Every combination of the axis values (the last axis varies fastest), each turned
    into a config by `build({axis: value, ...})`.

    Raises ValueError for an empty axis, a value given twice, or two combinations that
    build the same config (an axis that changes nothing would run each point twice).
    """
    for axis, values in axes.items():
        if not values:
            raise ValueError(f"sweep axis {axis!r} has no values")
        seen: list[Any] = []
        for v in values:
            if v in seen:
                raise ValueError(f"sweep axis {axis!r} lists {show_value(v, axis)} twice")
            seen.append(v)
    points, by_key = [], {}
    for combo in itertools.product(*axes.values()):
        values = dict(zip(axes, combo))
        point = SweepPoint(build(values), tuple(values.items()))
        if point.key in by_key:
            other = dict(by_key[point.key].labels)
            moot = [f"{axis} ({show_value(other[axis], axis)} or {show_value(v, axis)})"
                    for axis, v in point.labels if other[axis] != v]
            fixed = [f"{axis}={show_value(v, axis)}" for axis, v in point.labels
                     if other[axis] == v and axis not in ("policy", "rate")]
            raise ValueError(f"grid points {by_key[point.key].describe()} and {point.describe()} "
                             f"are the same simulation: {', '.join(moot)} changes nothing"
                             + (f" with {' '.join(fixed)}" if fixed else "")
                             + "; sweep it in a comparison of its own")
        by_key[point.key] = point
        points.append(point)
    return points


_SCHEDULER_FIELDS = {f.name for f in fields(SchedulerConfig)}
_CONFIG_FIELDS = {f.name for f in fields(SimulationConfig)}


def override_builder(base: SimulationConfig) -> Callable[[dict[str, Any]], SimulationConfig]:
    """A `build` for `expand_grid` that sets each axis on `base`: a SimulationConfig field
    (policy, rate, gpu, model, block_size, ...) or a SchedulerConfig field (chunked_prefill,
    preemption, ...). Policy options are kept only for the policy they were given with."""
    def build(values: dict[str, Any]) -> SimulationConfig:
        top = {k: v for k, v in values.items() if k in _CONFIG_FIELDS}
        sched = {k: v for k, v in values.items() if k in _SCHEDULER_FIELDS and k not in top}
        unknown = set(values) - set(top) - set(sched)
        if unknown:
            raise ValueError(f"unknown sweep axis {sorted(unknown)[0]!r}: not a field of "
                             f"SimulationConfig or SchedulerConfig")
        if "policy" in top and top["policy"] != base.policy and "policy_options" not in top:
            top["policy_options"] = {}
        scheduler = replace(base.scheduler, **sched) if sched else base.scheduler
        return replace(base, scheduler=scheduler, **top)
    return build


# --------------------------------------------------------------------------- outcomes
@dataclass(frozen=True)
class PointOutcome:
    point: SweepPoint
    run_dir: Path
    status: str
    """'ran' (this sweep), 'done before' (found complete and skipped) or 'failed'."""
    summary: dict[str, Any] | None = None
    error: str | None = None


@dataclass(frozen=True)
class SweepOutcome:
    out_dir: Path
    outcomes: tuple[PointOutcome, ...]
    """One per point, in grid order."""

    def with_status(self, status: str) -> list[PointOutcome]:
        return [o for o in self.outcomes if o.status == status]

    @property
    def failed(self) -> list[PointOutcome]:
        return self.with_status("failed")


Progress = Callable[[PointOutcome, int, int], None]
"""Called in the driver as each point is settled: (outcome, points settled, total)."""


# --------------------------------------------------------------------------- storage
def is_done(run_dir: Path, key: str) -> bool:
    """True when run_dir holds a complete point with this key (its marker is written last)."""
    try:
        marker = json.loads((run_dir / DONE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("key") == key


def commit_point(point: SweepPoint, runs_dir: Path, write: Callable[[Path], None]) -> Path:
    """Write a point with `write(tmp_dir)` and move it into runs_dir/<name> atomically.

    If the point is already there (another writer finished first), this copy is discarded.
    Returns the final directory.
    """
    from servelab.reports.runio import write_json

    final = runs_dir / point.name
    tmp = runs_dir / f".{point.name}.{os.getpid()}.tmp"
    if tmp.exists():  # left by a killed process that had our pid
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        write_json(tmp / DONE_MARKER, {"key": point.key, "labels": dict(point.labels)})
        try:
            os.rename(tmp, final)
        except OSError:
            if not is_done(final, point.key):
                raise
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def sweep_lock(out_dir: Path):
    """Hold DIR/.sweep.lock while a sweep writes DIR (`outdir.exclusive_lock`)."""
    from servelab.outdir import exclusive_lock

    return exclusive_lock(out_dir / LOCK_FILE, lambda: SweepError(
        f"another sweep is writing {out_dir} (locked: {out_dir / LOCK_FILE})"))


def write_sweep_file(out_dir: Path, points: Sequence[SweepPoint],
                     axes: Mapping[str, Sequence[Any]] | None = None) -> None:
    """DIR/sweep.json: what the report reads to find the grid's points."""
    from servelab.reports.runio import write_json

    axes = axes if axes is not None else _axes_of(points)
    write_json(out_dir / SWEEP_FILE, {
        "format": SWEEP_FORMAT,
        "axes": {axis: list(values) for axis, values in axes.items()},
        "points": [{"name": p.name, "key": p.key, "labels": dict(p.labels)} for p in points],
    })


def _axes_of(points: Sequence[SweepPoint]) -> dict[str, list[Any]]:
    axes: dict[str, list[Any]] = {}
    for p in points:
        for axis, value in p.labels:
            values = axes.setdefault(axis, [])
            if value not in values:
                values.append(value)
    return axes
