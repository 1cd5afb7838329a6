"""Admission control and load shedding: a stage before the scheduler's policy, for any
policy.

Every arrival passes `AdmissionControl.refusal(req, now)` before the policy sees it; a
refused request is rejected at once with the reason, and its record counts it as a
request that missed its SLOs (goodput and attainment count rejected requests in their
denominators: `reports/slo.py`). Three rules, each off unless configured
(`servelab.config.AdmissionConfig`):

- per-tenant queue limit: at most `tenant_queue_limit` requests of one tenant wait to
  start (the HTTP 429 a gateway answers per API key);
- per-tenant token bucket: each tenant's arrivals are admitted at `tenant_rate`
  requests/s on average, with bursts of `tenant_burst` (the token bucket of traffic
  metering, as RFC 2697's committed-rate bucket: it refills at the rate, up to the burst);
- shedding by tier: a request of priority `shed_from_priority` or lower (larger value)
  is shed when its predicted wait exceeds its TTFT SLO (`shed_default_slo_ms` for a
  request without one): it would miss its SLO anyway, and the work it would take is
  given to requests that can still meet theirs. Higher tiers are never shed.

Predicted wait of a request of tier p: the larger of the wait of the last request of
tier p to start (arrival to its first admission) and how long the oldest request of
tier p still waiting to start has waited. It is a measured sojourn time, as CoDel's
(Nichols & Jacobson, "Controlling Queue Delay", ACM Queue 10(5), 2012), not a model:
it needs no throughput estimate, holds for any policy that serves a tier in arrival
order (fcfs, priority, edf with one SLO per tier), and reacts when a tier stops being
served (the oldest one's wait grows). It lags a queue that is building up by about one
request's wait. Both terms are read at arrivals and admissions, which a fast-forwarded
simulation and a stepped one make at the same times, so the stage decides alike in both.

Cost: O(1) per arrival and admission (amortised: a queue of arrivals per tier, counts per
tenant).
"""
from __future__ import annotations

from collections import deque

from servelab.config import AdmissionConfig
from servelab.request import Request


class AdmissionControl:
    """The admission stage of one scheduler (see the module docstring)."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._waiting_by_tier: dict[int, _Arrivals] = {}
        self._waiting_by_tenant: dict[str, int] = {}
        self._last_wait_s: dict[int, float] = {}                  # tier -> last start's wait
        self._buckets: dict[str, tuple[float, float]] = {}        # tenant -> (tokens, at)

    def predicted_wait_s(self, tier: int, now: float) -> float:
        """How long a request of `tier` arriving now is predicted to wait to start."""
        wait = self._last_wait_s.get(tier, 0.0)
        waiting = self._waiting_by_tier.get(tier)
        oldest = waiting.oldest() if waiting is not None else None
        return wait if oldest is None else max(wait, now - oldest)

    def refusal(self, req: Request, now: float) -> str | None:
        """Why `req`, arriving now, is refused, or None (then it is counted as waiting;
        call `started` or `left` when it stops waiting)."""
        c = self.config
        tenant = req.tenant
        if c.tenant_queue_limit is not None \
                and self._waiting_by_tenant.get(tenant, 0) >= c.tenant_queue_limit:
            return f"tenant queue full ({c.tenant_queue_limit} requests of {tenant} waiting)"
        if c.shed_from_priority is not None and req.priority >= c.shed_from_priority:
            slo_ms = req.slo_ttft_ms if req.slo_ttft_ms is not None else c.shed_default_slo_ms
            wait_ms = self.predicted_wait_s(req.priority, now) * 1e3
            if wait_ms > slo_ms:
                return (f"shed: predicted wait {wait_ms:.0f} ms exceeds the TTFT SLO "
                        f"{slo_ms:g} ms (priority {req.priority})")
        if c.tenant_rate is not None and not self._take_token(tenant, now):
            return f"tenant {tenant} over its rate ({c.tenant_rate:g} req/s, burst {c.tenant_burst:g})"
        waiting = self._waiting_by_tier.get(req.priority)
        if waiting is None:
            waiting = self._waiting_by_tier[req.priority] = _Arrivals()
        waiting.add(req)
        self._waiting_by_tenant[tenant] = self._waiting_by_tenant.get(tenant, 0) + 1
        return None

    def _take_token(self, tenant: str, now: float) -> bool:
        c = self.config
        tokens, at = self._buckets.get(tenant, (c.tenant_burst, now))
        tokens = min(c.tenant_burst, tokens + (now - at) * c.tenant_rate)
        if tokens < 1.0:
            self._buckets[tenant] = (tokens, now)
            return False
        self._buckets[tenant] = (tokens - 1.0, now)
        return True

    def started(self, req: Request, now: float) -> None:
        """`req` was admitted (called at every admission; only the first counts)."""
        if self._forget(req):
            self._last_wait_s[req.priority] = now - req.arrival_s

    def left(self, req: Request) -> None:
        """`req` was rejected while it waited to start."""
        self._forget(req)

    def _forget(self, req: Request) -> bool:
        waiting = self._waiting_by_tier.get(req.priority)
        if waiting is None or not waiting.discard(req):
            return False
        self._waiting_by_tenant[req.tenant] -= 1
        return True


class _Arrivals:
    """Requests waiting to start, oldest first: O(1) add and discard, amortised O(1)
    `oldest` (discarded entries leave the front lazily)."""

    __slots__ = ("_order", "_live")

    def __init__(self) -> None:
        self._order: deque[tuple[float, int]] = deque()   # (arrival_s, id), arrival order
        self._live: set[int] = set()

    def add(self, req: Request) -> None:
        self._order.append((req.arrival_s, req.request_id))
        self._live.add(req.request_id)

    def discard(self, req: Request) -> bool:
        """Forget `req`; False if it was not here."""
        if req.request_id not in self._live:
            return False
        self._live.remove(req.request_id)
        return True

    def oldest(self) -> float | None:
        """The arrival time of the oldest request here, or None."""
        order, live = self._order, self._live
        while order and order[0][1] not in live:
            order.popleft()
        return order[0][0] if order else None
