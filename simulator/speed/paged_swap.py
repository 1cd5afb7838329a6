"""Swapping a paged block manager's sequences to its CPU pool and back.

Part of `RunPagedBlockManager` (see paged.py for its state and invariants). Sequences move
as a group; a block several of them share moves once and stays shared, and the CPU pool
has its own reference counts and free list (`_cpu_refcount`, `_cpu_free`), separate from
the prefix cache's host tier.
"""
from __future__ import annotations

from itertools import repeat
from typing import TYPE_CHECKING, Hashable, Iterable

from servelab.memory.base import BlockManagerError, require_swap_in_room
from servelab.memory.swap import Swapping

if TYPE_CHECKING:
    from .paged import _SeqBlocks


class PagedSwapping(Swapping):
    """Group swap-out and swap-in of a paged manager: the plain `Swapping`'s checks and
    groups (memory/swap.py), with blocks moved and prefix entries kept run by run."""

    __slots__ = ()

    def swap_out(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """O(blocks of the group). A block shared inside the group moves once and
        stays shared on the CPU; one also held outside the group stays on the GPU for
        the others and the group gets a copy."""
        group = self._group("swap_out", seq_ids, on_gpu=True)
        moving = self._group_blocks(group)
        if len(moving) > len(self._cpu_free):
            raise BlockManagerError(f"swap_out: needs {len(moving)} CPU blocks, "
                                    f"{len(self._cpu_free)} free")
        cpu_free = self._cpu_free
        mapping = {}
        for gpu_block, (refs, _) in moving.items():
            cpu_block = cpu_free.pop()
            self._cpu_refcount[cpu_block] = refs
            mapping[gpu_block] = cpu_block
        refcount = self._refcount
        released = []
        for gpu_block, (refs, filled) in moving.items():
            left = refcount[gpu_block] - refs
            if left:
                refcount[gpu_block] = left
                self._extra_refs -= refs
            else:
                refcount[gpu_block] = 1   # parked
                self._extra_refs -= refs - 1
                released.append(gpu_block)
                self._slots_used -= filled
        if self._cache is None:
            self._free.extend(reversed(released))
        else:
            self._release_cached(group, released[::-1])
        for seq in group:
            seq.blocks = [mapping[b] for b in seq.blocks]
            seq.on_gpu = False
            # Its GPU copies may be reused by others: recommit after swap-in.
            seq.num_committed, seq.last_entry_id = 0, 0
            seq.chain_broken = False
            seq.spans, seq.loc = [], None
        return list(mapping.items())

    def _release_cached(self, group: list[_SeqBlocks], released: list[int]) -> None:
        """Blocks of a swapped-out group that lost their last reference, in release
        order: the cached ones are parked in the prefix cache (consecutive entries of a
        run as one piece), the others go onto the free stack. O(blocks of the group)."""
        where = {}
        for seq in group:
            for run, a, b in seq.spans:
                where.update(zip(run.blocks[a:b], zip(repeat(run), range(a, b))))
        pieces = []
        for b in released:
            got = where.get(b)
            if got is None:
                self._free.append(b)
                continue
            run, k = got
            if pieces and pieces[-1][0] is run and pieces[-1][1] == k + 1:
                pieces[-1][1] = k
            else:
                pieces.append([run, k, k + 1])
        if pieces:
            self._cache.park([tuple(p) for p in pieces])

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """O(blocks of the group); sharing inside the group is kept, as in swap_out."""
        group = self._group("swap_in", seq_ids, on_gpu=False)
        moving = self._group_blocks(group)
        require_swap_in_room(self, len(moving))
        gpu_blocks = self._take(len(moving))
        refcount = self._refcount
        cpu_refcount = self._cpu_refcount
        cpu_free = self._cpu_free
        mapping = {}
        for (cpu_block, (refs, filled)), gpu_block in zip(moving.items(), gpu_blocks):
            refcount[gpu_block] = refs
            self._extra_refs += refs - 1
            self._slots_used += filled
            mapping[cpu_block] = gpu_block
            cpu_refcount[cpu_block] -= refs
            if not cpu_refcount[cpu_block]:
                cpu_free.append(cpu_block)
        shared = any(refs > 1 for refs, _ in moving.values())
        for seq in group:
            seq.blocks = [mapping[b] for b in seq.blocks]
            seq.on_gpu = True
            seq.forked = seq.forked or shared
        return list(mapping.items())

    def _group_blocks(self, group: list[_SeqBlocks]) -> dict[int, tuple[int, int]]:
        """Distinct blocks of the group in first-seen order -> (references inside the
        group, token slots filled). Sharers of a block agree on its fill."""
        bs = self.block_size
        out: dict[int, tuple[int, int]] = {}
        for seq in group:
            blocks = seq.blocks
            last = len(blocks) - 1
            for i, b in enumerate(blocks):
                refs = out[b][0] + 1 if b in out else 1
                out[b] = (refs, bs if i < last else seq.num_tokens - last * bs)
        return out
