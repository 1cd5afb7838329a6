"""Earliest deadline first: admit the request whose time-to-first-token deadline is nearest."""
from __future__ import annotations

from servelab._validate import check_float
from servelab.options import positive_float
from servelab.policies.base import Policy, PolicyFlag, register_policy
from servelab.request import Request
from servelab.traits import TTFT_SLOS

DEFAULT_SLO_MS = 10_000.0
"""The TTFT deadline of a request without an SLO of its own: the batch tier of servelab's
default workload (`traces/data/default_workload.json`)."""


@register_policy("edf")
class EDFPolicy(Policy):
    """Deadline = arrival_s + the request's TTFT SLO (`slo_ttft_ms`, else `default_slo_ms`).
    Key: (deadline, arrival_s, request_id).

    Ordering by deadline minimises the largest lateness on one server (Jackson's rule,
    1955), so while the load can meet every deadline EDF meets them where FCFS may not; in
    overload it spends service on requests that are already late, and the misses spread
    (the "domino effect" of real-time scheduling, Buttazzo, *Hard Real-Time Computing
    Systems*, 2011). With one SLO for every request it orders the waiting queue exactly as FCFS does.

    Victim: the running request with the latest deadline (the most slack), then the most
    recently admitted.
    """

    victims_by_admission = False
    acts_on = (TTFT_SLOS,)
    flags = (
        PolicyFlag("edf-default-slo-ms", "default_slo_ms", "TTFT deadline in ms of requests "
                   "without an SLO of their own", parse=positive_float, metavar="MS"),
    )

    def __init__(self, default_slo_ms: float = DEFAULT_SLO_MS) -> None:
        super().__init__()
        check_float("EDFPolicy", "default_slo_ms", default_slo_ms, 0.0, lo_open=True)
        self.default_slo_ms = float(default_slo_ms)

    def deadline(self, req: Request) -> float:
        slo = req.slo_ttft_ms if req.slo_ttft_ms is not None else self.default_slo_ms
        return req.arrival_s + slo / 1e3

    def waiting_key(self, req: Request) -> tuple:
        return (self.deadline(req), req.arrival_s, req.request_id)

    def victim_key(self, req: Request, admit_seq: int) -> tuple:
        return (self.deadline(req), admit_seq, req.request_id)

    def describe(self) -> dict:
        return {"name": self.name, "default_slo_ms": self.default_slo_ms}
