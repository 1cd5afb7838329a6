"""Preemption strategies: what a running request that must give up its GPU memory gets.

The scheduler chooses the victim (the policy's `victim_key`) and asks the strategy that
`SchedulerConfig.preemption` names for the outcome: `RECOMPUTE` (the KV is freed and the
request waits to prefill again) or `SWAP` (the KV moves to the CPU pool and comes back by
swap-in). The scheduler carries the outcome out; executors see it in
`SchedulerOutput.preempted` and `swap_out`.

A new strategy is one file holding a subclass registered with
`@register_preemption("name")` (docs/extending.md); `--preemption name` then picks it.
"""
from __future__ import annotations

import abc
from typing import Callable, ClassVar, Sequence

from servelab.memory.base import BlockManager
from servelab.outputs import PreemptionMode
from servelab.registry import Registry
from servelab.request import Request, SeqId

PREEMPTIONS: Registry[type["Preemption"]] = Registry("preemption")


def register_preemption(name: str) -> Callable[[type["Preemption"]], type["Preemption"]]:
    """Class decorator adding a strategy under `name`; a duplicate name is an error."""
    return PREEMPTIONS.named(name)


def preemption_names() -> list[str]:
    return PREEMPTIONS.names()


def make_preemption(name: str) -> "Preemption":
    """The registered strategy `name`; an unknown name is a ValueError listing the known."""
    return PREEMPTIONS.get(name)()


class Preemption(abc.ABC):
    """One preemption mode: the outcome each victim gets."""

    name: ClassVar[str] = "abstract"

    @abc.abstractmethod
    def outcome(self, victim: Request, seq_ids: Sequence[SeqId], block_manager: BlockManager,
                swap_allowed: bool) -> PreemptionMode:
        """RECOMPUTE or SWAP for `victim`, whose live sequences are `seq_ids`. SWAP only
        when `swap_allowed` (False for a multi-sample request that ran out of memory
        halfway through growing its samples) and `block_manager.can_swap_out(seq_ids)`."""


@register_preemption("recompute")
class Recompute(Preemption):
    """Free the KV; the request computes it again when it is readmitted (vLLM's default)."""

    def outcome(self, victim, seq_ids, block_manager, swap_allowed) -> PreemptionMode:
        return PreemptionMode.RECOMPUTE


@register_preemption("swap")
class Swap(Preemption):
    """Move the KV to the CPU pool; recompute when the pool has no room."""

    def outcome(self, victim, seq_ids, block_manager, swap_allowed) -> PreemptionMode:
        if swap_allowed and block_manager.can_swap_out(seq_ids):
            return PreemptionMode.SWAP
        return PreemptionMode.RECOMPUTE
