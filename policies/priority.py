"""Priority scheduling (lower value first), as vLLM's `priority` policy, with aging."""
from __future__ import annotations

from servelab._validate import check_float
from servelab.options import non_negative_float
from servelab.policies.base import Policy, PolicyFlag, register_policy
from servelab.traits import PRIORITIES
from servelab.request import Request


@register_policy("priority")
class PriorityPolicy(Policy):
    """Lower `priority` value first, ties by arrival.

    Aging: a waiting request's effective priority improves by `aging_rate` per second
    waited, i.e. priority - aging_rate·(now - arrival). That orders requests exactly
    like the static key priority + aging_rate·arrival, so aging costs nothing per step.
    Key: (priority + aging_rate·arrival_s, arrival_s, request_id).

    Victim: the lowest priority (largest value), latest arrival — vLLM's
    max(priority, arrival). With `preemptive=True`, a waiting request that does not fit
    may preempt running requests of strictly lower priority (larger value) — under
    continuous batching only: a static batch is never preempted for a waiting request.
    """

    victims_by_admission = False
    acts_on = (PRIORITIES,)
    flags = (
        PolicyFlag("priority-aging-rate", "aging_rate", "effective priority improves by R per "
                   "second waited", parse=non_negative_float, metavar="R"),
        PolicyFlag("preemptive-priority", "preemptive", "a waiting request may preempt "
                   "lower-priority running ones", switch=True),
    )

    def __init__(self, aging_rate: float = 0.0, preemptive: bool = False) -> None:
        super().__init__()
        check_float("PriorityPolicy", "aging_rate", aging_rate, 0.0)
        self.aging_rate = float(aging_rate)
        self.preemptive = bool(preemptive)

    def waiting_key(self, req: Request) -> tuple:
        return (req.priority + self.aging_rate * req.arrival_s, req.arrival_s, req.request_id)

    def victim_key(self, req: Request, admit_seq: int) -> tuple:
        return (req.priority, req.arrival_s, req.request_id)

    def may_preempt_for(self, head: Request, running: Request) -> bool:
        return self.preemptive and running.priority > head.priority

    def describe(self) -> dict:
        return {"name": self.name, "aging_rate": self.aging_rate, "preemptive": self.preemptive}
