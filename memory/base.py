"""The block-manager protocol: the only way the scheduler touches KV-cache memory.

A block manager owns a GPU pool of `num_gpu_blocks` blocks of `block_size` token slots
and a CPU pool of `num_cpu_blocks` for swapping. It maps each sequence (keyed by a
hashable `seq_id`) to a block table: the list of physical GPU block ids holding its
tokens in order. The scheduler asks before it acts (`can_allocate`, `can_append_slots`,
`can_swap_in`, `can_swap_out`); an action whose precondition fails raises and leaves the
manager unchanged.

Prefix caching is described by *block contents*: one hashable key per full block of a
sequence (its token ids, or a trace's block hash). The manager chains them into hashes
(h_i = hash((h_{i-1}, content_i))), so a hit means "same content and same prefix"; on a
hit the stored content is compared too, so a hash collision is a miss, never a wrong
reuse.
"""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence


class AllocStatus(enum.Enum):
    OK = "ok"          # can be done now
    LATER = "later"    # not now; possible once other sequences free memory
    NEVER = "never"    # impossible even with an empty pool


class BlockManagerError(Exception):
    """A call that violates the protocol (unknown sequence, double free, no capacity).

    Raised before any state changes: the manager is exactly as it was."""


@dataclass(slots=True, frozen=True)
class BlockUsage:
    num_total_blocks: int
    num_used_blocks: int
    """Blocks referenced by at least one sequence."""
    num_free_blocks: int
    """Blocks on the free list (excluding evictable cached blocks)."""
    num_cached_blocks: int
    """Unreferenced blocks kept for prefix-cache reuse (evictable, LRU)."""
    token_slots_used: int
    """Token slots holding a sequence's token (shared blocks counted once)."""
    token_slots_allocated: int
    """Slots in used blocks; allocated - used is internal fragmentation."""
    reserved_unused_slots: int
    """Slots reserved ahead of need (contiguous managers); 0 for paging."""
    num_cpu_total_blocks: int
    num_cpu_used_blocks: int
    prefix_queries: int
    """Full blocks looked up in the prefix cache."""
    prefix_hits: int
    """Blocks reused (from either tier of the prefix cache)."""
    num_host_total_blocks: int = 0
    """Blocks of the host-memory tier of the prefix cache (0: no such tier)."""
    num_host_cached_blocks: int = 0
    host_offloaded_blocks: int = 0
    """Blocks copied GPU -> host tier so far (evicted prefix blocks kept there)."""
    host_loaded_blocks: int = 0
    """Blocks copied host tier -> GPU so far (prefix hits found there)."""

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def internal_fragmentation(self) -> float:
        """Fraction of allocated slots holding no token."""
        if not self.token_slots_allocated:
            return 0.0
        return 1.0 - self.token_slots_used / self.token_slots_allocated


def check_size(owner: str, name: str, value: object, lo: int) -> int:
    """Constructor argument check: an int >= lo, else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{owner}: {name} must be an integer >= {lo}, got {value!r}")
    return value


def check_pool(owner: str, block_size: object, num_gpu_blocks: object, num_cpu_blocks: object,
               watermark_blocks: object) -> None:
    """A block manager's constructor checks of its pools, one line each (ValueError)."""
    check_size(owner, "block_size", block_size, 1)
    check_size(owner, "num_gpu_blocks", num_gpu_blocks, 1)
    check_size(owner, "num_cpu_blocks", num_cpu_blocks, 0)
    check_size(owner, "watermark_blocks", watermark_blocks, 0)
    if watermark_blocks >= num_gpu_blocks:
        raise ValueError(f"{owner}: watermark_blocks ({watermark_blocks}) must be below "
                         f"num_gpu_blocks ({num_gpu_blocks})")


def check_prefix_options(owner: str, enable_prefix_caching: object, num_host_blocks: object) -> None:
    """A paged manager's constructor checks of its prefix-cache options (ValueError)."""
    if not isinstance(enable_prefix_caching, bool):
        raise ValueError(f"{owner}: enable_prefix_caching must be a bool, "
                         f"got {enable_prefix_caching!r}")
    check_size(owner, "num_host_blocks", num_host_blocks, 0)
    if num_host_blocks and not enable_prefix_caching:
        raise ValueError(f"{owner}: a host tier ({num_host_blocks} blocks) holds prefix-cache "
                         "blocks and needs enable_prefix_caching")


def swap_in_status(manager: BlockManager, num_blocks: int) -> AllocStatus:
    """Can a swapped group of `num_blocks` distinct blocks come back to `manager`'s GPU?
    Like admission, the watermark stays free, unless nothing else holds GPU blocks: then
    waiting could not help, so LATER would never turn into OK. The one rule of every
    paged manager (memory/swap.py, simulator/speed/paged_swap.py)."""
    if num_blocks > manager.num_gpu_blocks:
        return AllocStatus.NEVER
    free = manager.num_free_blocks
    if free - num_blocks >= manager.watermark_blocks:
        return AllocStatus.OK
    if num_blocks <= free and manager.num_used_blocks == 0:
        return AllocStatus.OK
    return AllocStatus.LATER


def invariant(condition: bool, message: str) -> None:
    """One check of a block manager's `check_invariants`: AssertionError with `message`
    when `condition` is false (not an `assert`, which `python -O` strips)."""
    if not condition:
        raise AssertionError(message)


def require_swap_in_room(manager: BlockManager, num_blocks: int) -> None:
    """Raise BlockManagerError unless `swap_in_status` says OK."""
    status = swap_in_status(manager, num_blocks)
    if status is not AllocStatus.OK:
        raise BlockManagerError(f"swap_in: no GPU room ({status.value}): needs {num_blocks} "
                                f"blocks, {manager.num_free_blocks} free, watermark "
                                f"{manager.watermark_blocks}")


def check_count(op: str, name: str, value: object, lo: int) -> None:
    """Method argument check: an int >= lo, else BlockManagerError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise BlockManagerError(f"{op}: {name} must be an integer >= {lo}, got {value!r}")


def unique_ids(op: str, seq_ids: Iterable[Hashable]) -> list[Hashable]:
    """The ids as a list, or BlockManagerError if one is listed twice."""
    ids = list(seq_ids)
    if len(set(ids)) != len(ids):
        raise BlockManagerError(f"{op}: a sequence is listed twice in {ids!r}")
    return ids


class BlockManager(abc.ABC):
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    watermark_blocks: int = 0
    """Blocks admission (`can_allocate`) keeps free for running sequences to grow into."""

    num_host_blocks: int = 0
    """Blocks of a host-memory (CPU) tier of the prefix cache; 0 for a manager without
    one. With one, the manager's calls imply copies between the tiers, which the
    scheduler collects once per step (`take_transfers`) for the executor."""

    @abc.abstractmethod
    def can_allocate(self, num_tokens: int, block_contents: Sequence[Hashable] = (), *,
                     max_total_tokens: int | None = None,
                     expected_total_tokens: int | None = None) -> AllocStatus:
        """Could a new sequence of `num_tokens` tokens get its blocks?

        OK: now, keeping the watermark free. LATER: once others free memory. NEVER: not
        even in an empty pool. `block_contents` (keys of the full blocks) lets cached
        prefix blocks count as already present. `max_total_tokens` (prompt + max tokens)
        and `expected_total_tokens` (the true final length) are the reservation sizes
        used by contiguous managers; paging ignores them.
        """

    @abc.abstractmethod
    def allocate(self, seq_id: Hashable, num_tokens: int,
                 block_contents: Sequence[Hashable] = (), *,
                 max_total_tokens: int | None = None,
                 expected_total_tokens: int | None = None) -> int:
        """Give a new sequence slots for its first `num_tokens` tokens.

        Reuses prefix-cached blocks for the longest run of leading full blocks whose
        contents match, and returns how many tokens were hit (a multiple of block_size,
        always < num_tokens so that at least one token is computed and sampled from).
        Blocks are only committed to the prefix cache by `mark_computed`.
        """

    def cached_prefix_tokens(self, num_tokens: int, block_contents: Sequence[Hashable] = ()) -> int:
        """How many tokens `allocate` would hit now for a new sequence of `num_tokens`
        tokens with these contents (either tier of the prefix cache). A peek: nothing
        changes, no statistic counts. Default 0: a manager without a prefix cache."""
        return 0

    def host_hit_tokens(self, seq_id: Hashable) -> int:
        """Of the tokens `allocate` hit for this (allocated) sequence, how many were
        loaded from a host (CPU) tier of the prefix cache rather than found on the GPU.
        Default 0: a manager without such a tier."""
        return 0

    def take_transfers(self) -> tuple[Sequence[tuple[int, int]], Sequence[tuple[int, int]]]:
        """Host-tier copies implied by the calls since the last one: (GPU, host) block
        pairs to copy to the host first of all in the step, and (host, GPU) pairs to
        copy back after swaps, before compute. Default: none (no host tier)."""
        return [], []

    @abc.abstractmethod
    def mark_computed(self, seq_id: Hashable, num_computed_tokens: int) -> None:
        """Record that the first `num_computed_tokens` tokens of the sequence have KV
        (or will by the end of the current step), so its full blocks among them with
        known contents enter the prefix cache. A no-op without prefix caching."""

    @abc.abstractmethod
    def can_append_slots(self, seq_id: Hashable, num_new_tokens: int) -> bool:
        """Are there free blocks for `num_new_tokens` more tokens (including a
        copy-on-write copy of a shared last block)? Ignores the watermark: running
        sequences may use it."""

    @abc.abstractmethod
    def append_slots(self, seq_id: Hashable, num_new_tokens: int) -> list[tuple[int, int]]:
        """Extend the sequence by `num_new_tokens` slots. If its last block is shared
        (after a fork) and partially filled, it is first copied: the returned
        (src, dst) GPU block pairs are copies the executor must perform."""

    @abc.abstractmethod
    def fork(self, parent_seq_id: Hashable, child_seq_id: Hashable) -> None:
        """The child shares all the parent's blocks (refcounts + 1). Writing into a
        shared partial block later triggers copy-on-write in `append_slots`."""

    @abc.abstractmethod
    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence's references; blocks reaching refcount 0 go to the free
        list, or stay as evictable cached blocks if they are in the prefix cache."""

    @abc.abstractmethod
    def can_swap_out(self, seq_ids: Iterable[Hashable]) -> bool:
        """Does the CPU pool have room for all GPU blocks of these sequences (a group
        that shares blocks is moved together, shared blocks once)?"""

    @abc.abstractmethod
    def swap_out(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Move the sequences' blocks to the CPU pool; returns (gpu, cpu) copies."""

    @abc.abstractmethod
    def can_swap_in(self, seq_ids: Iterable[Hashable]) -> AllocStatus:
        """Could the swapped sequences come back to the GPU now / later / never?"""

    @abc.abstractmethod
    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Move the sequences' blocks back to the GPU; returns (cpu, gpu) copies."""

    @abc.abstractmethod
    def block_table(self, seq_id: Hashable) -> list[int]:
        """Physical block ids of the sequence (GPU ids while on the GPU, CPU ids while
        swapped out). A copy: callers may keep it."""

    @abc.abstractmethod
    def has_seq(self, seq_id: Hashable) -> bool: ...

    @abc.abstractmethod
    def is_swapped(self, seq_id: Hashable) -> bool: ...

    @abc.abstractmethod
    def usage(self) -> BlockUsage: ...

    @property
    @abc.abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks available for allocation now (free list + evictable cached)."""

    @property
    @abc.abstractmethod
    def num_used_blocks(self) -> int:
        """GPU blocks referenced by at least one sequence."""

    @abc.abstractmethod
    def check_invariants(self) -> None:
        """Raise AssertionError if any internal invariant is broken: free + used +
        cached = total; no block both free and referenced; each refcount equals the
        number of block tables holding the block; cached blocks' hashes map back to them;
        the same for the CPU pool."""
