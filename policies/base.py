"""What a scheduling policy is: one object owning the waiting order, admission order
and the choice of preemption victim.

The scheduler never branches on a policy's name. It asks the policy for the next
request to admit (`peek`), tells it what happened (`add`, `requeue`, `remove`,
`on_service`), and asks which running request to give up when memory runs out
(`victim_key`: the running request with the largest key is preempted first).

A new policy is one subclass decorated with `@register_policy("name")`; nothing else
changes. Keys are tuples ending in the unique request id, so no two requests ever
compare equal and runs are reproducible.
"""
from __future__ import annotations

import abc
import heapq
from typing import Callable, ClassVar, Iterator

from servelab.request import Request

_REGISTRY: dict[str, type["Policy"]] = {}


class SchedulerError(RuntimeError):
    """The scheduler was driven against its protocol (e.g. update() with a foreign output)."""


def register_policy(name: str) -> Callable[[type["Policy"]], type["Policy"]]:
    """Class decorator adding a policy under `name`; a duplicate name is an error."""

    def deco(cls: type[Policy]) -> type[Policy]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"policy name {name!r} is already registered by "
                             f"{_REGISTRY[name].__module__}.{_REGISTRY[name].__qualname__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def make_policy(name: str, **options) -> "Policy":
    """Build a registered policy; unknown names and options are clear errors."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(policy_names())}") from None
    try:
        return cls(**options)
    except TypeError as exc:
        raise ValueError(f"bad options for policy {name!r}: {exc}") from None


class KeyedQueue:
    """A priority queue of requests by a static key, with O(log n) push/pop and O(1)
    lazy removal (removed entries are skipped when they reach the top)."""

    __slots__ = ("_heap", "_live")

    def __init__(self) -> None:
        self._heap: list[tuple] = []
        self._live: dict[int, Request] = {}

    def push(self, key: tuple, req: Request) -> None:
        heapq.heappush(self._heap, (key, req.request_id))
        self._live[req.request_id] = req

    def remove(self, req: Request) -> None:
        self._live.pop(req.request_id, None)

    def peek(self) -> Request | None:
        heap, live = self._heap, self._live
        while heap:
            rid = heap[0][1]
            req = live.get(rid)
            if req is not None:
                return req
            heapq.heappop(heap)
        return None

    def peek_key(self) -> tuple | None:
        return self._heap[0][0] if self.peek() is not None else None

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, req: Request) -> bool:
        return req.request_id in self._live

    def ordered(self) -> list[Request]:
        live = self._live
        return [live[rid] for _, rid in sorted(self._heap) if rid in live]

    def __iter__(self) -> Iterator[Request]:
        return iter(self.ordered())


class Policy(abc.ABC):
    """Base class. Subclasses define `waiting_key` (and may override anything else)."""

    name: ClassVar[str] = "abstract"

    def __init__(self) -> None:
        self._queue = KeyedQueue()

    # --- the waiting order -------------------------------------------------------
    @abc.abstractmethod
    def waiting_key(self, req: Request) -> tuple:
        """Static sort key of a waiting request (smaller = admitted first); must end in
        req.request_id. Time-varying preferences are expressed as static keys where
        possible (aging at rate a: priority - a·(now - arrival) orders like
        priority + a·arrival)."""

    def add(self, req: Request, now: float) -> None:
        """A request arrives in the waiting queue."""
        self._queue.push(self.waiting_key(req), req)

    def requeue(self, req: Request, now: float) -> None:
        """A request preempted by recompute goes back to its place in the order (its
        key is unchanged, so it lands ahead of anything that arrived after it)."""
        self._queue.push(self.waiting_key(req), req)

    def remove(self, req: Request) -> None:
        """Take a request out of the waiting queue (admitted or rejected)."""
        self._queue.remove(req)

    def peek(self, now: float) -> Request | None:
        """The request to admit next, or None when nothing waits."""
        return self._queue.peek()

    def candidates(self, now: float) -> list[Request]:
        """Every request `peek` could return while no request is added or removed
        (time and service may pass). The simulator's fast-forward uses it to prove that
        nothing waiting can be admitted during a run of decode steps."""
        head = self.peek(now)
        return [head] if head is not None else []

    def waiting(self, now: float) -> list[Request]:
        """All waiting requests in admission order (O(n log n); for tests and reports)."""
        return self._queue.ordered()

    def __len__(self) -> int:
        return len(self._queue)

    # --- preemption ----------------------------------------------------------------
    def victim_key(self, req: Request, admit_seq: int) -> tuple:
        """The running request with the largest key is preempted first. Default: the
        most recently admitted (`admit_seq` grows with every admission)."""
        return (admit_seq, req.request_id)

    def may_preempt_for(self, head: Request, running: Request) -> bool:
        """May `running` be preempted so that the waiting `head` can be admitted?
        Only preemptive policies say yes. Decide on request-level fields (priority,
        arrival, tenant): the sequence lengths of a running request may lag while the
        scheduler batches its decodes."""
        return False

    # --- accounting ----------------------------------------------------------------
    def on_service(self, req: Request, prefill_tokens: int, output_tokens: int) -> None:
        """Called once per scheduled request per step: the prompt (or recomputed) tokens
        it computed and the output tokens it drew."""

    def describe(self) -> dict:
        """The policy's name and options, for config.json."""
        return {"name": self.name}
