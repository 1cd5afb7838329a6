"""Fair share across tenants with the Virtual Token Counter (VTC, OSDI'24)."""
from __future__ import annotations

import argparse

from servelab._validate import check_float
from servelab.options import positive_float
from servelab.policies.base import KeyedQueue, Policy, PolicyFlag, register_policy
from servelab.traits import TENANTS
from servelab.request import Request


def parse_tenant_weights(text: str) -> dict[str, float]:
    """'a=1,b=2.5' -> {'a': 1.0, 'b': 2.5}; each tenant once, each weight > 0."""
    weights: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"expected TENANT=WEIGHT items, got {item!r}")
        if name in weights:
            raise argparse.ArgumentTypeError(f"tenant {name!r} is given twice")
        weights[name] = positive_float(value)
    if not weights:
        raise argparse.ArgumentTypeError("expected at least one TENANT=WEIGHT item")
    return weights


@register_policy("fair")
class FairSharePolicy(Policy):
    """Virtual Token Counter fair share.

    Each tenant t has a counter of the service it received: input tokens × w_in plus
    output tokens × w_out, divided by the tenant's weight (share). Admission takes the
    head (arrival order) of the backlogged tenant with the smallest counter (ties by
    tenant name). When a tenant becomes backlogged again, its counter is lifted to the
    smallest counter among backlogged tenants, so idling banks no credit. Output tokens
    are charged every step they are computed. Victim: a running request of the tenant
    with the largest counter (most recently admitted among its requests).

    Cost of `peek`: O(number of backlogged tenants).
    """

    victims_by_admission = False
    acts_on = (TENANTS,)
    charges_service = True
    order_moves = True
    flags = (PolicyFlag("tenant-weights", "weights", "tenant shares (default 1 each)",
                        parse=parse_tenant_weights, metavar="A=W,B=W"),)

    def __init__(self, weights: dict[str, float] | None = None, input_weight: float = 1.0,
                 output_weight: float = 2.0) -> None:
        super().__init__()
        check_float("FairSharePolicy", "input_weight", input_weight, 0.0)
        check_float("FairSharePolicy", "output_weight", output_weight, 0.0)
        self.weights = dict(weights or {})
        for tenant, w in self.weights.items():
            check_float("FairSharePolicy", f"weights[{tenant!r}]", w, 0.0, lo_open=True)
        self.input_weight, self.output_weight = float(input_weight), float(output_weight)
        # counter = base + (w_in·input + w_out·output) / weight, with integer token
        # counts since the last lift: the value does not depend on how the service was
        # batched into calls (a fast-forwarded run charges k tokens at once).
        self._base: dict[str, float] = {}
        self._tokens: dict[str, list[int]] = {}
        self._queues: dict[str, KeyedQueue] = {}

    @property
    def tenant_weights(self) -> dict[str, float]:
        return self.weights

    def counter(self, tenant: str) -> float:
        base = self._base.get(tenant, 0.0)
        tokens = self._tokens.get(tenant)
        if tokens is None:
            return base
        return base + (self.input_weight * tokens[0] + self.output_weight * tokens[1]) \
            / self.weights.get(tenant, 1.0)

    @property
    def counters(self) -> dict[str, float]:
        return {t: self.counter(t) for t in sorted(set(self._base) | set(self._tokens))}

    def waiting_key(self, req: Request) -> tuple:
        return (req.arrival_s, req.request_id)

    def _backlogged(self) -> list[str]:
        return [t for t, q in self._queues.items() if len(q)]

    def add(self, req: Request, now: float) -> None:
        tenant = req.tenant
        q = self._queues.get(tenant)
        if q is None:
            q = self._queues[tenant] = KeyedQueue()
        if not len(q):
            others = [self.counter(t) for t in self._backlogged() if t != tenant]
            own = self.counter(tenant)
            if others and min(others) > own:
                self._base[tenant] = min(others)
                self._tokens[tenant] = [0, 0]
        q.push(self.waiting_key(req), req)
        self._queue.push(self.waiting_key(req), req)

    requeue = add

    def remove(self, req: Request) -> None:
        self._queue.remove(req)
        q = self._queues.get(req.tenant)
        if q is not None:
            q.remove(req)

    def candidates(self, now: float) -> list[Request]:
        return [h for h in (q.peek() for q in self._queues.values()) if h is not None]

    def peek(self, now: float) -> Request | None:
        best = None
        for tenant, q in self._queues.items():
            head = q.peek()
            if head is None:
                continue
            key = (self.counter(tenant), tenant)
            if best is None or key < best[0]:
                best = (key, head)
        return best[1] if best else None

    def waiting(self, now: float) -> list[Request]:
        # Admission order if nothing were served meanwhile: by counter, then arrival.
        return sorted(self._queue.ordered(),
                      key=lambda r: (self.counter(r.tenant), r.tenant, r.arrival_s, r.request_id))

    def on_service(self, req: Request, prefill_tokens: int, output_tokens: int) -> None:
        tokens = self._tokens.get(req.tenant)
        if tokens is None:
            tokens = self._tokens[req.tenant] = [0, 0]
        tokens[0] += prefill_tokens
        tokens[1] += output_tokens

    def victim_key(self, req: Request, admit_seq: int) -> tuple:
        return (self.counter(req.tenant), admit_seq, req.request_id)

    def describe(self) -> dict:
        return {"name": self.name, "weights": self.weights, "input_weight": self.input_weight,
                "output_weight": self.output_weight}
