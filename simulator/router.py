"""Routers: which replica serves an arriving request.

A router sees the request and each replica's outstanding requests (routed there and not
yet finished or rejected, as known at the arrival time) and returns a replica index.
Ties go to the lowest index, so routing is deterministic.

- round-robin: request i goes to replica i mod N. It ignores replica state, so the
  simulator assigns every request up front (`assign_upfront`), which lets a replica's
  fast-forward run extend to its own next arrival rather than the cluster's.
- least-outstanding: the replica with the fewest outstanding requests.
- prefix-affinity: a request goes to the replica that last served the longest prefix of
  its prompt that any replica served, so its prefix cache hits; a new prefix, a request
  without prefix information, or an affinity replica more than `max_imbalance` requests
  busier than the least-loaded one falls back to least-outstanding (and the prefix, all
  of it, moves there).

Routers register themselves by name (`@register_router("name")`, the registry of
`servelab.registry`): `--router`, `compare --routers` and `SimulationConfig.router` offer
every registered name, and `make_router` builds one. A new router is a subclass registered
where it is defined (docs/extending.md).
"""
from __future__ import annotations

import abc
from typing import Callable, ClassVar, Sequence

from servelab._validate import check_bounded
from servelab.registry import Registry
from servelab.request import Request

ROUTERS: Registry[type["Router"]] = Registry("router")


def register_router(name: str) -> Callable[[type["Router"]], type["Router"]]:
    """Class decorator adding a router under `name`; a duplicate name is an error."""
    return ROUTERS.named(name)


def router_names() -> list[str]:
    """In the order they were registered: the default, round-robin, first."""
    return ROUTERS.names()


def make_router(name: str, num_replicas: int) -> "Router":
    """The registered router `name` for `num_replicas` replicas; an unknown name is a
    ValueError listing the known ones."""
    return ROUTERS.get(name)(num_replicas)


class Router(abc.ABC):
    """Base class: a subclass implements `route` (or `assign_upfront`) and is registered
    with `@register_router`, which sets its `name`. Built as `cls(num_replicas)`."""

    name: ClassVar[str] = "abstract"
    serves_prefix_cache: ClassVar[bool] = False
    """It routes for prefix-cache hits: without a prefix cache it spreads load and no more."""

    def __init__(self, num_replicas: int) -> None:
        check_bounded("num_replicas", num_replicas, 1, integer=True, noun="an integer")
        self.num_replicas = num_replicas

    @abc.abstractmethod
    def route(self, req: Request, outstanding: Sequence[int]) -> int:
        """The replica for `req`, given each replica's outstanding requests now."""

    def assign_upfront(self, requests: Sequence[Request]) -> list[int] | None:
        """Every request's replica, when that does not depend on replica state (then
        `route` is never called); None for state-dependent routers."""
        return None

    def describe(self) -> dict:
        return {"name": self.name}


def least_loaded(outstanding: Sequence[int]) -> int:
    """Index of the smallest count, ties to the lowest index. O(replicas)."""
    best = 0
    for i in range(1, len(outstanding)):
        if outstanding[i] < outstanding[best]:
            best = i
    return best


@register_router("round-robin")
class RoundRobinRouter(Router):
    def route(self, req: Request, outstanding: Sequence[int]) -> int:
        raise NotImplementedError("round-robin assigns every request up front")

    def assign_upfront(self, requests: Sequence[Request]) -> list[int]:
        n = self.num_replicas
        return [i % n for i in range(len(requests))]


@register_router("least-outstanding")
class LeastOutstandingRouter(Router):
    def route(self, req: Request, outstanding: Sequence[int]) -> int:
        return least_loaded(outstanding)


@register_router("prefix-affinity")
class PrefixAffinityRouter(Router):
    """Routes to the replica that last served the longest known prefix of the prompt, so
    its prefix cache hits (SGLang's cache-aware routing, on an approximate prefix tree of
    chain keys: `affinity_keys`). `affinity_tokens` is the unit of that tree for prompts
    given as token ids; a trace with prefix hashes uses its hash blocks instead. Memory
    grows with the distinct prefix units seen, unbounded (a dict entry, ~100 bytes, per
    unit: tens of MB for the Mooncake traces); O(replicas + units of the prompt) per
    request."""

    name = "prefix-affinity"
    serves_prefix_cache = True

    def __init__(self, num_replicas: int, affinity_tokens: int = 256, max_imbalance: int = 8) -> None:
        super().__init__(num_replicas)
        for label, value in (("affinity_tokens", affinity_tokens), ("max_imbalance", max_imbalance)):
            check_bounded(label, value, 1, integer=True, noun="an integer")
        self.affinity_tokens = affinity_tokens
        self.max_imbalance = max_imbalance
        self._home: dict[int, int] = {}
        """Chain key of a prefix -> the replica that last served it. Prefix-closed: a
        prefix is entered with all of its own prefixes."""

    def route(self, req: Request, outstanding: Sequence[int]) -> int:
        least = least_loaded(outstanding)
        keys = affinity_keys(req, self.affinity_tokens)
        if not keys:
            return least
        homes = self._home
        home = None
        for key in keys:   # the deepest prefix some replica served
            served = homes.get(key)
            if served is None:
                break
            home = served
        if home is None or outstanding[home] - outstanding[least] > self.max_imbalance:
            home = least
        for key in keys:
            homes[key] = home
        return home

    def describe(self) -> dict:
        return {"name": self.name, "affinity_tokens": self.affinity_tokens,
                "max_imbalance": self.max_imbalance}


def affinity_keys(req: Request, unit_tokens: int) -> list[int]:
    """Chain keys of the prompt's leading units: key i = hash((key i-1, unit i)) stands
    for units 0..i, so equal keys mean equal prefixes (a hash collision can only misroute,
    never change what a request computes). Units are `unit_tokens` token ids (a prompt
    shorter than that is one unit), or the trace's prefix-hash blocks. Empty when the
    request carries neither."""
    if req.prompt_token_ids is not None:
        ids = req.prompt_token_ids[:req.prompt_len]
        n = max(1, len(ids) // unit_tokens)
        units = [ids[i * unit_tokens:(i + 1) * unit_tokens] for i in range(n)]
    elif req.prefix_hashes is not None:
        units = req.prefix_hashes
    else:
        return []
    keys = []
    key = None
    for unit in units:
        key = hash((key, unit))
        keys.append(key)
    return keys

