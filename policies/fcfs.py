"""First come, first served: vLLM's default."""
from __future__ import annotations

from servelab.policies.base import Policy, register_policy
from servelab.request import Request


@register_policy("fcfs")
class FCFSPolicy(Policy):
    """Admit in arrival order; preempt the most recently admitted running request.

    Key: (arrival_s, request_id)."""

    def waiting_key(self, req: Request) -> tuple:
        return (req.arrival_s, req.request_id)
