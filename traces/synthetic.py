"""Synthetic workloads: multi-tenant mixes of seeded arrival processes and length distributions,
optional shared-prefix groups, and the embedded default workload fitted to azure-conv-2023.

Each tenant draws from its own random streams, derived from (seed, tenant index, purpose)
with `numpy.random.SeedSequence`: changing one tenant's rate leaves the other tenants'
requests unchanged, and a tenant's lengths do not shift when its arrival rate changes.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from importlib import resources

import numpy as np

from servelab.traces.distributions import ArrivalProcess, LengthDist, length_dist_from_dict
from servelab.traces.record import Trace, TraceError, TraceRecord

_ARRIVALS, _LENGTHS, _PREFIX = 0, 1, 2  # stream purposes within a tenant


@dataclass(frozen=True)
class SharedPrefix:
    """A system prompt of `blocks` blocks of `block_size` tokens, shared by a `fraction` of
    the tenant's requests (each picks one of `groups` distinct system prompts uniformly).

    The prompt lengths stay as drawn: a sharing request's first min(blocks, its full
    blocks) hash ids are its group's, the rest are unique. Requests that do not share get
    all-unique ids, so a prefix cache hits exactly on the system prompts.
    """

    blocks: int
    fraction: float
    groups: int = 1
    block_size: int = 16

    def __post_init__(self) -> None:
        if not (isinstance(self.blocks, int) and self.blocks >= 1 and isinstance(self.groups, int)
                and self.groups >= 1 and isinstance(self.block_size, int) and self.block_size >= 1):
            raise TraceError(f"SharedPrefix needs blocks, groups, block_size >= 1, got {self}")
        if not 0.0 <= self.fraction <= 1.0:
            raise TraceError(f"SharedPrefix.fraction must be in [0, 1], got {self.fraction!r}")


@dataclass(frozen=True)
class TenantSpec:
    name: str
    rate: float
    """Mean requests per second of this tenant."""
    prompt: LengthDist
    output: LengthDist
    cv: float = 1.0
    """Coefficient of variation of inter-arrival gaps (1 = Poisson)."""
    priority: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    prefix: SharedPrefix | None = None

    def __post_init__(self) -> None:
        ArrivalProcess(self.rate, self.cv)  # validates rate and cv
        if not self.name or not self.name.isprintable():
            raise TraceError(f"TenantSpec.name must be a non-empty printable string, got {self.name!r}")


@dataclass(frozen=True)
class WorkloadSpec:
    tenants: tuple[TenantSpec, ...]
    duration_s: float
    name: str = "synthetic"

    def __post_init__(self) -> None:
        if not self.tenants:
            raise TraceError("WorkloadSpec needs at least one tenant")
        if len({t.name for t in self.tenants}) != len(self.tenants):
            raise TraceError("WorkloadSpec tenant names must be unique")
        if not (isinstance(self.duration_s, (int, float)) and 0 < self.duration_s < math.inf):
            raise TraceError(f"WorkloadSpec.duration_s must be a finite number > 0, got {self.duration_s!r}")

    @property
    def total_rate(self) -> float:
        return sum(t.rate for t in self.tenants)

    def with_total_rate(self, rate: float) -> "WorkloadSpec":
        """The same mix with every tenant's rate scaled so that they sum to `rate`."""
        if not (isinstance(rate, (int, float)) and 0 < rate < math.inf):
            raise TraceError(f"rate must be a finite number > 0, got {rate!r}")
        k = rate / self.total_rate
        return replace(self, tenants=tuple(replace(t, rate=t.rate * k) for t in self.tenants))


def _rng(seed: int, tenant: int, purpose: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(tenant, purpose)))


def generate(spec: WorkloadSpec, seed: int = 0) -> Trace:
    """Draw a trace: each tenant's arrivals over [0, duration_s), its lengths, its prefixes;
    merged in time order (ties by tenant order, then draw order). Cost O(n log n)."""
    rows = []  # (arrival, tenant index, k, prompt, output, group or -1)
    for ti, tenant in enumerate(spec.tenants):
        times = ArrivalProcess(tenant.rate, tenant.cv).times(_rng(seed, ti, _ARRIVALS),
                                                            duration_s=spec.duration_s)
        n = len(times)
        lengths_rng = _rng(seed, ti, _LENGTHS)
        prompts = tenant.prompt.sample(n, lengths_rng)
        outputs = tenant.output.sample(n, lengths_rng)
        groups = np.full(n, -1)
        if tenant.prefix is not None:
            prng = _rng(seed, ti, _PREFIX)
            shares = prng.random(n) < tenant.prefix.fraction
            groups = np.where(shares, prng.integers(0, tenant.prefix.groups, size=n), -1)
        rows.extend(zip(times.tolist(), [ti] * n, range(n), prompts.tolist(), outputs.tolist(),
                        groups.tolist()))
    rows.sort()
    return Trace(tuple(_records(spec, rows)), source=f"synthetic:{spec.name}", format="synthetic",
                 notes=(f"generated {spec.name} seed={seed} duration={spec.duration_s:g}s",
                        *(f"tenant {t.name}: {ArrivalProcess(t.rate, t.cv).describe()} "
                          f"priority={t.priority}" for t in spec.tenants)))


def _records(spec: WorkloadSpec, rows: list[tuple]) -> list[TraceRecord]:
    # Block ids: each tenant's system prompts first, then fresh ids in arrival order.
    group_base, next_id = [], 0
    for t in spec.tenants:
        group_base.append(next_id)
        if t.prefix is not None:
            next_id += t.prefix.groups * t.prefix.blocks
    out = []
    for arrival, ti, _, prompt, output, group in rows:
        t = spec.tenants[ti]
        hashes = bs = None
        if t.prefix is not None:
            bs = t.prefix.block_size
            n_blocks = -(-prompt // bs)
            head: tuple[int, ...] = ()
            if group >= 0:  # the leading full blocks are the group's system prompt
                first = group_base[ti] + group * t.prefix.blocks
                head = tuple(range(first, first + min(t.prefix.blocks, prompt // bs)))
            hashes = head + tuple(range(next_id, next_id + n_blocks - len(head)))
            next_id += n_blocks - len(head)
        out.append(TraceRecord(arrival, prompt, output, hashes, bs, t.name, t.priority,
                               t.slo_ttft_ms, t.slo_tpot_ms))
    return out


# ----------------------------------------------------------------------------- default workload
def load_default_spec() -> WorkloadSpec:
    """The default workload, read from traces/data/default_workload.json (see its `note`)."""
    text = resources.files("servelab.traces").joinpath("data/default_workload.json").read_text("utf-8")
    return spec_from_dict(json.loads(text)["workload"])


def default_workload(seed: int = 0, *, rate: float | None = None, duration_s: float | None = None) -> Trace:
    """The embedded default workload; `rate` rescales the total request rate (tenant shares kept)."""
    spec = load_default_spec()
    if rate is not None:
        spec = spec.with_total_rate(rate)
    if duration_s is not None:
        spec = replace(spec, duration_s=duration_s)
    return generate(spec, seed)


def spec_from_dict(d: dict) -> WorkloadSpec:
    tenants = []
    for t in d["tenants"]:
        prefix = t.get("prefix")
        tenants.append(TenantSpec(
            name=t["name"], rate=float(t["rate"]), cv=float(t.get("cv", 1.0)),
            prompt=length_dist_from_dict(t["prompt"]), output=length_dist_from_dict(t["output"]),
            priority=int(t.get("priority", 0)), slo_ttft_ms=t.get("slo_ttft_ms"),
            slo_tpot_ms=t.get("slo_tpot_ms"), prefix=SharedPrefix(**prefix) if prefix else None))
    return WorkloadSpec(tuple(tenants), float(d["duration_s"]), d.get("name", "synthetic"))


def spec_to_dict(spec: WorkloadSpec) -> dict:
    return {"name": spec.name, "duration_s": spec.duration_s, "tenants": [
        {"name": t.name, "rate": t.rate, "cv": t.cv, "priority": t.priority,
         "slo_ttft_ms": t.slo_ttft_ms, "slo_tpot_ms": t.slo_tpot_ms,
         "prefix": None if t.prefix is None else {"blocks": t.prefix.blocks, "fraction": t.prefix.fraction,
                                                  "groups": t.prefix.groups, "block_size": t.prefix.block_size},
         "prompt": t.prompt.to_dict(), "output": t.output.to_dict()} for t in spec.tenants]}
