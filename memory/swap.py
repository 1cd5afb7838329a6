"""Swapping for the plain paged block manager (memory/paged.py): sequences move as a group
to a CPU pool of `num_cpu_blocks` blocks with reference counts of its own, and back.

Part of `PagedBlockManager` (a mixin: the pools, reference counts and sequences it moves
are that class's). A block shared inside the group moves once and stays shared; the
watermark is kept on the way back as at admission. Costs: O(blocks of the group).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, Iterable

from .base import AllocStatus, BlockManagerError, require_swap_in_room, swap_in_status, unique_ids

if TYPE_CHECKING:
    from .paged import _Seq

__all__ = ["Swapping"]


class Swapping:
    """`can_swap_out`, `swap_out`, `can_swap_in`, `swap_in` of `PagedBlockManager` (the
    speed layer's `PagedSwapping` keeps the checks and moves blocks its own way)."""

    __slots__ = ()

    def can_swap_out(self, seq_ids: Iterable[Hashable]) -> bool:
        group = self._group("can_swap_out", seq_ids, on_gpu=True)
        return len(self._group_blocks(group)) <= len(self._cpu_free)

    def swap_out(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """A block shared inside the group moves once and stays shared on the CPU; one
        also held outside the group stays on the GPU for the others. The group's chains
        restart: its blocks are committed again after swap-in."""
        group = self._group("swap_out", seq_ids, on_gpu=True)
        moving = self._group_blocks(group)
        if len(moving) > len(self._cpu_free):
            raise BlockManagerError(f"swap_out: needs {len(moving)} CPU blocks, "
                                    f"{len(self._cpu_free)} free")
        mapping = {}
        for gpu_block, refs in moving.items():
            mapping[gpu_block] = self._cpu_free.pop()
            self._cpu_refs[mapping[gpu_block]] = refs
            self._refs[gpu_block] -= refs
        for gpu_block in reversed(moving):
            if not self._refs[gpu_block]:
                self._unreferenced(gpu_block)
        for seq in group:
            seq.blocks = [mapping[b] for b in seq.blocks]
            seq.on_gpu = False
            seq.num_committed, seq.last_entry_id, seq.chain_broken = 0, 0, False
        return list(mapping.items())

    def can_swap_in(self, seq_ids: Iterable[Hashable]) -> AllocStatus:
        group = self._group("can_swap_in", seq_ids, on_gpu=False)
        return swap_in_status(self, len(self._group_blocks(group)))

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        group = self._group("swap_in", seq_ids, on_gpu=False)
        moving = self._group_blocks(group)
        require_swap_in_room(self, len(moving))
        mapping = dict(zip(moving, self._take(len(moving))))
        for cpu_block, refs in moving.items():
            self._refs[mapping[cpu_block]] = refs
            self._cpu_refs[cpu_block] -= refs
            if not self._cpu_refs[cpu_block]:
                self._cpu_free.append(cpu_block)
        for seq in group:
            seq.blocks = [mapping[b] for b in seq.blocks]
            seq.on_gpu = True
        return list(mapping.items())

    def _group(self, op: str, seq_ids: Iterable[Hashable], *, on_gpu: bool) -> list[_Seq]:
        group = []
        for seq_id in unique_ids(op, seq_ids):
            seq = self._seq(op, seq_id)
            if seq.on_gpu != on_gpu:
                where = "swapped out" if on_gpu else "not swapped out"
                raise BlockManagerError(f"{op}: sequence {seq_id!r} is {where}")
            group.append(seq)
        return group

    @staticmethod
    def _group_blocks(group: list[_Seq]) -> dict[int, int]:
        """Distinct blocks of the group, first seen first -> references inside it."""
        refs: dict[int, int] = {}
        for seq in group:
            for b in seq.blocks:
                refs[b] = refs.get(b, 0) + 1
        return refs
