"""Longest prefix match first (SGLang's `lpm`): the waiting request whose prompt the
prefix cache already holds furthest is admitted first, so requests sharing a prefix run
while it is cached instead of after it was evicted."""
from __future__ import annotations

from typing import Callable

from servelab._validate import check_float, check_int
from servelab.options import positive_int
from servelab.policies.base import Policy, PolicyFlag, max_wait_flag, register_policy
from servelab.traits import SHARED_PREFIXES
from servelab.request import Request


@register_policy("lpm")
class LongestPrefixMatchPolicy(Policy):
    """Admit the waiting request with the most tokens the prefix cache would serve now
    (either tier), ties in arrival order. Key, taken at each admission:
    (-cached tokens, arrival_s, request_id).

    What is cached changes with every commit and eviction, so the order is not a static
    key: each `peek` probes every waiting request (O(waiting × blocks hit)) while at most
    `max_queue` wait; beyond that the order is arrival order (FCFS), as in SGLang, whose
    threshold (128) is the default: probing a long queue at every admission costs more
    than the hits save. Without prefix caching every probe reads 0, so the order is FCFS.

    Starvation guard (on by default, as SJF's): once the oldest waiting request has
    waited `max_wait_s`, it is admitted before all others. So a request is passed over
    for its cache misses for at most `max_wait_s` seconds; after that only requests that
    arrived before it go first.

    Victim: the most recently admitted running request (the default).
    """

    acts_on = (SHARED_PREFIXES,)
    reads_prefix_cache = True
    order_moves = True
    flags = (
        max_wait_flag("lpm-max-wait-s"),
        PolicyFlag("lpm-max-queue", "max_queue", "order by cached prefix while at most N "
                   "requests wait (arrival order beyond)", parse=positive_int, metavar="N"),
    )

    def __init__(self, max_wait_s: float | None = 30.0, max_queue: int = 128) -> None:
        super().__init__()
        if max_wait_s is not None:
            check_float("LongestPrefixMatchPolicy", "max_wait_s", max_wait_s, 0.0, lo_open=True)
        check_int("LongestPrefixMatchPolicy", "max_queue", max_queue, 1)
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self._cached_tokens: Callable[[Request], int] | None = None

    def attach_prefix_probe(self, cached_tokens: Callable[[Request], int]) -> None:
        self._cached_tokens = cached_tokens

    def waiting_key(self, req: Request) -> tuple:
        """The arrival order: what the guard and a long queue fall back to."""
        return (req.arrival_s, req.request_id)

    def _probing(self) -> bool:
        return self._cached_tokens is not None and len(self._queue) <= self.max_queue

    def _overdue(self, req: Request, now: float) -> bool:
        return self.max_wait_s is not None and now - req.arrival_s >= self.max_wait_s

    def peek(self, now: float) -> Request | None:
        oldest = self._queue.peek()
        if oldest is None or not self._probing() or self._overdue(oldest, now):
            return oldest
        probe = self._cached_tokens
        best, most = oldest, probe(oldest)
        for req in self._queue.ordered()[1:]:
            cached = probe(req)
            if cached > most:
                best, most = req, cached
        return best

    def candidates(self, now: float) -> list[Request]:
        """Any waiting request while probing (what is cached changes as decodes evict);
        the oldest otherwise."""
        if self._probing():
            return self._queue.ordered()
        head = self._queue.peek()
        return [head] if head is not None else []

    def waiting(self, now: float) -> list[Request]:
        """Overdue requests oldest first, then the rest by cached prefix as it stands."""
        ordered = self._queue.ordered()
        if not self._probing():
            return ordered
        overdue = [r for r in ordered if self._overdue(r, now)]
        probe = self._cached_tokens
        rest = sorted((r for r in ordered if not self._overdue(r, now)),
                      key=lambda r: (-probe(r), r.arrival_s, r.request_id))
        return overdue + rest

    def describe(self) -> dict:
        return {"name": self.name, "max_wait_s": self.max_wait_s, "max_queue": self.max_queue}
