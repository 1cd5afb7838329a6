"""What a scheduling policy is: one object owning the waiting order, admission order
and the choice of preemption victim.

The scheduler never branches on a policy's name. It asks the policy for the next
request to admit (`peek`), tells it what happened (`add`, `requeue`, `remove`,
`on_service`), and asks which running request to give up when memory runs out
(`victim_key`: the running request with the largest key is preempted first). What a
policy can do beyond ordering is declared, never guessed: `preemptive` (it may preempt
running requests for a waiting one), `reorders_running` (whom it may preempt changes as
running requests draw tokens), `victims_by_admission` (its victim is the most recently
admitted request), `charges_service` (it accounts each step's service),
`reads_prefix_cache` (it orders by what the prefix cache holds), its command-line
`flags`, the `tenant_weights` it shares service by, and the workload traits it `acts_on`.

A new policy is one file holding a subclass decorated with `@register_policy("name")`
(docs/extending.md); nothing else changes. Keys are tuples ending in the unique request
id, so no two requests ever compare equal and runs are reproducible.
"""
from __future__ import annotations

import abc
import heapq
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, Mapping

from servelab.options import positive_float
from servelab.registry import Registry
from servelab.request import Request
from servelab.traits import WorkloadTraits

POLICIES: Registry[type["Policy"]] = Registry("policy")


class SchedulerError(RuntimeError):
    """The scheduler was driven against its protocol (e.g. update() with a foreign output)."""


def register_policy(name: str) -> Callable[[type["Policy"]], type["Policy"]]:
    """Class decorator adding a policy under `name`; a duplicate name is an error."""
    return POLICIES.named(name)


def policy_names() -> list[str]:
    return sorted(POLICIES.names())


def make_policy(name: str, **options) -> "Policy":
    """Build a registered policy; unknown names and options are clear errors."""
    cls = POLICIES.get(name)
    try:
        return cls(**options)
    except TypeError as exc:
        raise ValueError(f"bad options for policy {name!r}: {exc}") from None


def nothing_to_act_on(name: str, traits: WorkloadTraits) -> str | None:
    """Why policy `name` orders requests as FCFS does on a workload with these traits
    (every trait it `acts_on` is missing), or None when it has something to act on or
    declares no trait."""
    acts_on = POLICIES.get(name).acts_on
    reasons = [traits.lacks(t) for t in acts_on]
    if not acts_on or not all(reasons):
        return None
    return "; ".join(reasons)


@dataclass(frozen=True)
class PolicyFlag:
    """A command-line flag a policy declares: `--<flag> VALUE` sets its constructor
    keyword `keyword` to `parse(VALUE)` (then `to_option`, if given). The help shows
    the constructor's default unless it is None (say it in `help` then)."""

    flag: str
    """Without the dashes, e.g. "sjf-predictor"."""
    keyword: str
    help: str
    parse: Callable[[str], Any] | None = None
    """argparse `type`; None for a switch."""
    switch: bool = False
    """A flag without a value: giving it sets the keyword to True."""
    choices: tuple | None = None
    metavar: str | None = None
    to_option: Callable[[Any], Any] | None = None

    @property
    def dest(self) -> str:
        return self.flag.replace("-", "_")


def max_wait_flag(flag: str) -> PolicyFlag:
    """The starvation guard's flag (`--<flag> S|off`, keyword `max_wait_s`): once the
    oldest waiting request has waited S seconds it is admitted first; 'off' is None."""
    return PolicyFlag(flag, "max_wait_s", "starvation guard: admit the oldest first once it "
                      "waited S seconds, or 'off'", parse=_wait_seconds, metavar="S|off",
                      to_option=_off_is_none)


def _wait_seconds(text: str) -> float:
    """SECONDS (> 0) or 'off' (infinity: the guard never fires)."""
    if text.strip().lower() == "off":
        return math.inf
    return positive_float(text)


def _off_is_none(seconds: float) -> float | None:
    return None if seconds == math.inf else seconds


class KeyedQueue:
    """A priority queue of requests by key, with O(log n) push/pop and O(1) lazy removal
    (removed entries are skipped when they reach the top). A request pushed again (after
    a preemption) may come back with another key: only its latest entry counts."""

    __slots__ = ("_heap", "_live")

    def __init__(self) -> None:
        self._heap: list[tuple] = []
        self._live: dict[int, tuple[tuple, Request]] = {}   # id -> (its latest key, request)

    def push(self, key: tuple, req: Request) -> None:
        heapq.heappush(self._heap, (key, req.request_id))
        self._live[req.request_id] = (key, req)

    def remove(self, req: Request) -> None:
        self._live.pop(req.request_id, None)

    def peek(self) -> Request | None:
        heap, live = self._heap, self._live
        while heap:
            key, rid = heap[0]
            entry = live.get(rid)
            if entry is not None and entry[0] is key:
                return entry[1]
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
        return [entry[1] for key, rid in sorted(self._heap)
                if (entry := live.get(rid)) is not None and entry[0] is key]

    def __iter__(self) -> Iterator[Request]:
        return iter(self.ordered())


class Policy(abc.ABC):
    """Base class. Subclasses define `waiting_key` (and may override anything else), and
    declare what they do beyond ordering in the attributes below."""

    name: ClassVar[str] = "abstract"

    preemptive: bool = False
    """May this policy preempt running requests for a waiting one? The scheduler asks
    `may_preempt_for` only when True. A class attribute, or set per instance from an
    option (priority's `preemptive=True`)."""

    charges_service: ClassVar[bool] = False
    """Does `on_service` account each step's service (fair share)? Only then does the
    scheduler call it — every step, for every scheduled request — which also keeps the
    simulator from batching decodes and a fast-forward run from passing an arrival."""

    reads_prefix_cache: ClassVar[bool] = False
    """Does the waiting order depend on what the prefix cache holds (lpm)? Only then does
    the scheduler hand the policy a probe, once (`attach_prefix_probe`)."""

    reorders_running: ClassVar[bool] = False
    """Does `may_preempt_for` of a running request change as it draws tokens (mlfq's
    demotion)? Such a policy may also say how long it stays as it is,
    `tokens_until_preemptible(heads, running)`: how many more tokens every one of
    `running` may draw (one per decode step) before `may_preempt_for(head, r)` could first
    hold for one of the waiting `heads` and one `r` of them (0 if it may hold now). The
    simulator's speed layer reads it by name (`simulator/speed/scheduler.py`): its
    fast-forward ends its runs there, and its memory of a waiting head it found no victim
    for ends there too; without it, neither is used while requests wait. (Victim order may
    change freely: nothing is preempted within a run of plain decode steps.)"""

    order_moves: ClassVar[bool] = False
    """Can `peek` return another request as time passes or service is charged, with no
    request added or removed (sjf's and mlfq's starvation guards, lpm as the prefix cache
    fills, fair share as tenants are served)? Such a policy overrides `peek`; defining
    `peek` without declaring this either way is an error when the class is created. It
    may also say which requests `peek` could return meanwhile, `candidates(now)`: the
    simulator's fast-forward needs that to skip decode steps while requests wait
    (`simulator/speed/scheduler.py` `waiting_candidates`), and steps one by one without
    it. With static keys (the default) that is the head alone."""

    victims_by_admission: ClassVar[bool] = True
    """Is the victim always the most recently admitted running request (the default
    `victim_key`)? Then the scheduler keeps running requests in admission order instead
    of sorting them by `victim_key` every step. A policy that defines `victim_key` sets
    it False; defining one without doing so is an error when the class is created."""

    flags: ClassVar[tuple[PolicyFlag, ...]] = ()
    """Command-line flags of this policy's options (`servelab simulate`, `run`, `compare`)."""

    acts_on: ClassVar[tuple[str, ...]] = ()
    """Workload traits (`servelab/traits.py`: tenants, priorities, shared prefixes) this
    policy's order depends on beyond arrival; on a workload with none of them it orders as
    FCFS does, and the reports say so. Empty: it acts on every workload."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.on_service is not Policy.on_service and not cls.charges_service:
            raise TypeError(f"{cls.__qualname__} overrides on_service but does not declare "
                            "charges_service = True, so it would never be called")
        if cls.peek is not Policy.peek and not any(
                "order_moves" in vars(k) for k in cls.__mro__ if k is not Policy):
            raise TypeError(f"{cls.__qualname__} overrides peek but does not declare "
                            "order_moves (True if the head can change with time or service "
                            "alone), so the simulator would assume it cannot")
        if cls.victim_key is not Policy.victim_key and cls.victims_by_admission:
            raise TypeError(f"{cls.__qualname__} overrides victim_key but does not declare "
                            "victims_by_admission = False, so running requests would be "
                            "preempted in admission order instead")

    def __init__(self) -> None:
        self._queue = KeyedQueue()

    @classmethod
    def options_from_flags(cls, options: dict, seed: int) -> dict:
        """Constructor options from the flags given (`flags`), with the run's seed for a
        policy that draws random numbers. Default: the options as they are."""
        return options

    @property
    def tenant_weights(self) -> Mapping[str, float] | None:
        """The tenants' shares this policy divides service by, which a run's fairness
        index is measured against; None (the default): every tenant counts the same."""
        return None

    def attach_prefix_probe(self, cached_tokens: Callable[[Request], int]) -> None:
        """Called once, before any request arrives, by the scheduler of a policy that
        declares `reads_prefix_cache`: `cached_tokens(req)` is how many tokens of the
        waiting `req` the prefix cache would serve if it were admitted now (0 without
        prefix caching). O(cached blocks) per call."""
        raise NotImplementedError(f"{type(self).__qualname__} declares reads_prefix_cache "
                                  "but does not take the probe")

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

    def waiting(self, now: float) -> list[Request]:
        """All waiting requests in admission order (O(n log n); for tests and reports)."""
        return self._queue.ordered()

    def __len__(self) -> int:
        return len(self._queue)

    # --- preemption ----------------------------------------------------------------
    def victim_key(self, req: Request, admit_seq: int) -> tuple:
        """The running request with the largest key is preempted first. Default: the
        most recently admitted (`admit_seq` grows with every admission). A policy that
        defines its own declares `victims_by_admission = False`."""
        return (admit_seq, req.request_id)

    def may_preempt_for(self, head: Request, running: Request) -> bool:
        """May `running` be preempted so that the waiting `head` can be admitted? Asked
        only of a policy that declares `preemptive`; every request it is shown is
        current. The answer depends on the two requests alone (not on the time or on
        other requests), and changes while `head` waits only as `running` draws tokens,
        under a policy that declares `reorders_running` (the simulator's scheduler
        remembers a head no running request may be preempted for until then)."""
        return False

    # --- accounting ----------------------------------------------------------------
    def on_service(self, req: Request, prefill_tokens: int, output_tokens: int) -> None:
        """Called, when the policy declares `charges_service`, once per scheduled request
        per step (or once per request for a fast-forwarded run of steps): the prompt (or
        recomputed) tokens it computed and the output tokens it drew."""

    def describe(self) -> dict:
        """The policy's name and options, for config.json."""
        return {"name": self.name}
