"""Growing the sequences of a paged block manager: one token after another, or a whole
decode step's batch at once.

Part of `RunPagedBlockManager` (see paged.py for its state and invariants), kept apart
because it is what every running sequence pays on every step: the common case of
`can_append_slots` and `append_slots` is inlined, and `append_slots_many` grows a
decode batch in one pass that hands out the same blocks, in the same order, as calling
`append_slots` for each sequence in turn.
"""
from __future__ import annotations

from typing import Hashable, Sequence

from servelab.memory.base import BlockManagerError, check_count, unique_ids


class PagedGrowth:
    """Token growth, copy-on-write of a shared partial last block, and the exact
    uniform-growth bound of a paged manager."""

    __slots__ = ()

    # can_append_slots and append_slots run for every sequence on every step: their
    # common case is inlined (no helper calls); the error paths are not.
    def can_append_slots(self, seq_id: Hashable, num_new_tokens: int) -> bool:
        """O(1)."""
        seq = self._seqs.get(seq_id)
        if seq is None or not seq.on_gpu or type(num_new_tokens) is not int or num_new_tokens < 0:
            self._reject_append("can_append_slots", seq_id, num_new_tokens)
        t = seq.num_tokens
        bs = self.block_size
        blocks = seq.blocks
        need = (t + num_new_tokens + bs - 1) // bs - len(blocks)
        if num_new_tokens and t % bs and self._refcount[blocks[-1]] > 1:
            need += 1  # the copy of the shared partial last block
        if need <= len(self._free):
            return True
        return self._cache is not None and need <= len(self._free) + self._cache.num_evictable

    def append_slots(self, seq_id: Hashable, num_new_tokens: int) -> list[tuple[int, int]]:
        """O(1 + new blocks). Returns [(src, dst)] when a shared partial last block
        was copied first (copy-on-write), else []."""
        seq = self._seqs.get(seq_id)
        if seq is None or not seq.on_gpu or type(num_new_tokens) is not int or num_new_tokens < 0:
            self._reject_append("append_slots", seq_id, num_new_tokens)
        t = seq.num_tokens
        bs = self.block_size
        blocks = seq.blocks
        need = (t + num_new_tokens + bs - 1) // bs - len(blocks)
        filled = t % bs
        cow = num_new_tokens and filled and self._refcount[blocks[-1]] > 1
        copies: list[tuple[int, int]] = []
        if need or cow:
            if need + bool(cow) > self.num_free_blocks:
                raise BlockManagerError(
                    f"append_slots: no room for {num_new_tokens} more tokens of sequence "
                    f"{seq_id!r}: needs {need + bool(cow)} blocks, {self.num_free_blocks} free")
            refcount = self._refcount
            if cow:
                src = blocks[-1]
                dst, = self._take(1)   # its count reads 1 already (parked)
                refcount[src] -= 1
                self._extra_refs -= 1
                blocks[-1] = dst
                copies.append((src, dst))
                self._slots_used += filled
            if need:
                blocks += self._take(need)
        seq.num_tokens = t + num_new_tokens
        self._slots_used += num_new_tokens
        return copies

    def append_slots_many(self, growth: Sequence[tuple[Hashable, int]]) -> list[tuple[int, int]]:
        """`append_slots` for several sequences (each at most once) in one pass, all or
        nothing: the same blocks, in the same order, as calling it for each in turn.
        O(sequences + new blocks): what growing many decodes at once costs."""
        # One pass that grows as it goes, undone (rarely) when a sequence needs a copy or
        # is bad or listed twice: what a decode step pays. Once the free stack runs dry
        # (a full prefix cache: every new block is an eviction) the rest goes in bulk.
        seqs = self._seqs
        bs = self.block_size
        refcount = self._refcount
        free = self._free
        slots = done = 0
        for seq_id, n in growth:
            try:
                seq = seqs.get(seq_id)
            except TypeError:   # an unhashable id: nothing stays grown
                self._undo_growth(growth, done)
                raise
            if seq is None or not seq.on_gpu or type(n) is not int or n < 0:
                self._undo_growth(growth, done)
                self._reject_append("append_slots_many", seq_id, n)   # raises if bad
                return self._append_slots_each(growth)   # an int of another type
            t = seq.num_tokens
            blocks = seq.blocks
            if n and t % bs and refcount[blocks[-1]] > 1:
                break  # a copy-on-write: take the general path
            need = (t + n + bs - 1) // bs - len(blocks)
            if need == 1 and free:
                blocks.append(free.pop())
            elif need:
                if need > len(free):   # evictions (in bulk), or no room: _grow_rest decides
                    return self._grow_rest(growth, done, slots)
                blocks += free[:-need - 1:-1]  # top of the stack first, as _take
                del free[-need:]
            seq.num_tokens = t + n
            slots += n
            done += 1
        else:
            if len(dict(growth)) == done:
                self._slots_used += slots
                return []
            self._undo_growth(growth, done)
            raise BlockManagerError(f"append_slots_many: a sequence is listed twice in "
                                    f"{[seq_id for seq_id, _ in growth]!r}")
        self._undo_growth(growth, done)
        return self._append_slots_each(growth)

    def _grow_rest(self, growth: Sequence[tuple[Hashable, int]], done: int,
                   slots: int) -> list[tuple[int, int]]:
        """`append_slots_many` from entry `done` on, where the free stack runs dry: the
        rest of the batch takes its blocks with one `_take` (free, then evicted) and hands
        them out in order, the blocks one `append_slots` per sequence would take, since
        growing neither frees nor evicts anything else. The general path when an entry
        needs a copy or is bad, a sequence is listed twice, or the blocks do not exist.
        O(rest + new blocks)."""
        seqs = self._seqs
        bs = self.block_size
        refcount = self._refcount
        rest = []
        need = 0
        for seq_id, n in growth[done:]:
            try:
                seq = seqs.get(seq_id)
            except TypeError:   # an unhashable id: nothing stays grown
                self._undo_growth(growth, done)
                raise
            if seq is None or not seq.on_gpu or type(n) is not int or n < 0 \
                    or n and seq.num_tokens % bs and refcount[seq.blocks[-1]] > 1:
                break
            k = (seq.num_tokens + n + bs - 1) // bs - len(seq.blocks)
            rest.append((seq, n, k))
            need += k
        else:
            if need <= self.num_free_blocks and len(dict(growth)) == len(growth):
                taken = self._take(need)
                pos = 0
                for seq, n, k in rest:
                    if k:
                        seq.blocks += taken[pos:pos + k]
                        pos += k
                    seq.num_tokens += n
                    slots += n
                self._slots_used += slots
                return []
        self._undo_growth(growth, done)
        return self._append_slots_each(growth)

    def _undo_growth(self, growth: Sequence[tuple[Hashable, int]], done: int) -> None:
        """Take back the growth of the first `done` entries of an `append_slots_many`
        pass, last first: their blocks go back on top of the free stack as they came."""
        bs = self.block_size
        free = self._free
        for seq_id, n in reversed(growth[:done]):
            seq = self._seqs[seq_id]
            seq.num_tokens -= n
            extra = len(seq.blocks) - -(-seq.num_tokens // bs)
            if extra:   # their counts still read 1, as the free stack's do
                back = seq.blocks[-extra:]
                del seq.blocks[-extra:]
                free += reversed(back)

    def _append_slots_each(self, growth: Sequence[tuple[Hashable, int]]) -> list[tuple[int, int]]:
        """append_slots_many's general path (copies, eviction), checked as a whole first.
        The blocks needed are counted as the calls in turn will take them: a sequence
        that copies a shared partial block drops a reference to it, so the last of its
        holders in the batch may write in place."""
        ids = unique_ids("append_slots_many", (seq_id for seq_id, _ in growth))
        need = 0
        refcount = self._refcount
        copied: dict[int, int] = {}   # shared block -> holders that copied it so far
        bs = self.block_size
        for seq_id, n in growth:
            seq = self._gpu_seq("append_slots_many", seq_id)
            check_count("append_slots_many", "num_new_tokens", n, 0)
            t = seq.num_tokens
            need += (t + n + bs - 1) // bs - len(seq.blocks)
            last = seq.blocks[-1]
            if n and t % bs and refcount[last] - copied.get(last, 0) > 1:
                copied[last] = copied.get(last, 0) + 1
                need += 1
        if need > self.num_free_blocks:
            raise BlockManagerError(f"append_slots_many: no room to grow {ids!r}: needs "
                                    f"{need} blocks, {self.num_free_blocks} free")
        copies: list[tuple[int, int]] = []
        for seq_id, n in growth:
            copies += self.append_slots(seq_id, n)
        return copies

    def max_uniform_growth(self, seq_ids: Sequence[Hashable], limit: int) -> int:
        """Exact, in O(n log n) for n sequences: 0 if any has a shared partial last
        block (its next token is copied first); otherwise, with `room` the free slots in
        each last block, k = q * block_size + r tokens each take n * q blocks plus one
        for every sequence whose room is below r, so the free blocks F allow
        q = F // n and r up to the (F % n + 1)-th smallest room."""
        check_count("max_uniform_growth", "limit", limit, 0)
        seqs = [self._gpu_seq("max_uniform_growth", s)
                for s in unique_ids("max_uniform_growth", seq_ids)]
        if not seqs:
            return limit
        bs = self.block_size
        refcount = self._refcount
        rooms = []
        for seq in seqs:
            room = len(seq.blocks) * bs - seq.num_tokens
            if room and refcount[seq.blocks[-1]] > 1:
                return 0
            rooms.append(room)
        rooms.sort()
        q, spare = divmod(self.num_free_blocks_without_offload, len(seqs))
        return min(limit, q * bs + min(bs - 1, rooms[spare]))

    def _reject_append(self, op: str, seq_id: Hashable, num_new_tokens: object) -> None:
        self._gpu_seq(op, seq_id)
        check_count(op, "num_new_tokens", num_new_tokens, 0)
