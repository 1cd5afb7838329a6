"""What a workload offers a policy to act on, and when a policy has nothing there.

Priority scheduling orders by priority, fair share by tenant, lpm by cached prefix, edf by
TTFT deadline. On a workload with one priority, one tenant, no shared prefixes or one TTFT
SLO each orders its waiting queue exactly as FCFS does (only a preemption victim may still
differ: priority's is the latest arrival, FCFS's the latest admitted), and a comparison
that ranks them mostly ranks identical runs. A policy declares the
traits its order depends on (`Policy.acts_on`); `servelab.policies.nothing_to_act_on`
says, in words, when a workload lacks every one of them, and the reports say which
traits a workload lacks.

    traits = WorkloadTraits.of(records)   # anything with .tenant, .priority, .cached_tokens, .slo_ttft_ms
    traits.lacks(PRIORITIES)                      # "every request has priority 0", or None
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

TENANTS = "tenants"
PRIORITIES = "priorities"
SHARED_PREFIXES = "shared prefixes"
TTFT_SLOS = "TTFT SLOs"
TRAITS = (TENANTS, PRIORITIES, SHARED_PREFIXES, TTFT_SLOS)
TRAIT_COLUMNS = ("tenant", "priority", "slo_ttft_ms", "cached_tokens")
"""The request-record fields `WorkloadTraits.of_columns` reads, in its argument order."""


@dataclass(frozen=True)
class WorkloadTraits:
    tenants: frozenset[str]
    priorities: frozenset[int]
    shared_prefixes: bool
    """Some request found part of its prompt in the prefix cache (so prefix caching was on
    and prompts shared prefixes)."""
    ttft_slos: frozenset = frozenset()
    """The requests' own TTFT SLOs in ms (None for a request without one)."""

    @classmethod
    def of(cls, records: Iterable) -> "WorkloadTraits":
        """From per-request records (`servelab.records.RequestRecord` or alike); for a
        columnar table, `of_columns` reads the four columns without making records."""
        records = list(records)
        return cls.of_columns(*([getattr(r, name) for r in records] for name in TRAIT_COLUMNS))

    @classmethod
    def of_columns(cls, tenants: Iterable[str], priorities: Iterable[int],
                   slo_ttft_ms: Iterable[float | None],
                   cached_tokens: Iterable[int | None]) -> "WorkloadTraits":
        """From the requests' columns (None where a request has no value)."""
        return cls(frozenset(tenants), frozenset(priorities), any(map(bool, cached_tokens)),
                   frozenset(slo_ttft_ms))

    def lacks(self, trait: str) -> str | None:
        """Why this workload gives `trait` nothing to act on, or None when it does."""
        if trait == TENANTS:
            return (None if len(self.tenants) > 1 else
                    f"one tenant ({next(iter(self.tenants))})" if self.tenants else "no requests")
        if trait == PRIORITIES:
            return (None if len(self.priorities) > 1 else
                    f"every request has priority {next(iter(self.priorities))}"
                    if self.priorities else "no requests")
        if trait == TTFT_SLOS:
            return (None if len(self.ttft_slos) > 1 else
                    "no request has a TTFT SLO of its own" if self.ttft_slos == {None} else
                    f"every request has the TTFT SLO {next(iter(self.ttft_slos))} ms"
                    if self.ttft_slos else "no requests")
        if trait == SHARED_PREFIXES:
            return None if self.shared_prefixes else (
                "no prompt found a cached prefix (prefix caching off, or no shared prefixes)")
        raise ValueError(f"unknown workload trait {trait!r}; known: {', '.join(TRAITS)}")


    def missing(self) -> list[str]:
        """Why each trait this workload lacks is missing, in TRAITS order."""
        return [why for trait in TRAITS if (why := self.lacks(trait))]
