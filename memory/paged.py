"""vLLM-style paged KV-cache block manager.

The GPU pool is `num_gpu_blocks` fixed-size blocks. A sequence holds a block table (its
blocks in token order), and only its last block can be partly filled, so the waste per
sequence is under one block. Blocks carry reference counts: `fork` shares a parent's
blocks with a child, and the first write into a shared partial block copies it
(copy-on-write, reported by `append_slots`). With prefix caching, full blocks whose
contents are known are committed to a `PrefixCache` and reused by later sequences with
the same prefix; unreferenced committed blocks stay cached until a block is needed and
the free list is empty, then go least recently used first. Sequences can be swapped as a
group to a CPU pool with its own capacity and back.

Costs. Free blocks sit on a LIFO stack (a Python list): taking n blocks is one slice and
giving one back is an append, O(1) per block, and the most recently freed block is reused
first, which keeps the working set compact. The reference count of a block nobody
references (a free one, or an evictable cached one) is *parked* at 1, the count a block
gets when it is taken, and the manager keeps the total of references beyond the first
(`_extra_refs`, from forks, swaps and prefix hits): while that is 0, taking blocks and
freeing a sequence write no count at all, and without a prefix cache a free is one
`extend` of the free stack. What tells an evictable block from a referenced one is the
cache's LRU order, which holds exactly the evictable ones. Every operation works per
block, never per token: appending k tokens costs O(1 + new blocks), `can_append_slots`
is O(1). Allocation, free and swap are O(blocks of the sequences involved); a
prefix-cache lookup adds one hash and one content comparison per looked-up block.

Every mutating method checks its preconditions before it changes anything and raises
`BlockManagerError` on a violation, leaving the manager exactly as it was.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter
from typing import Hashable, Iterable, Sequence

from .base import AllocStatus, BlockManager, BlockManagerError, BlockUsage, unique_ids
from .block_keys import BlockKeys
from .host_tier import HostTier
from .later_memo import LaterMemos
from .prefix_cache import NO_MATCH, PrefixCache, PrefixMatch
from .registry import register_block_manager

_OK, _LATER, _NEVER = AllocStatus.OK, AllocStatus.LATER, AllocStatus.NEVER
NO_KEYS = BlockKeys()
"""The contents of a sequence with no known keys (never extended)."""


@dataclass(slots=True, eq=False)
class _SeqBlocks:
    """A sequence's block table and prefix-cache progress."""

    blocks: list[int]
    """GPU block ids, or CPU block ids while swapped out."""
    num_tokens: int
    on_gpu: bool = True
    contents: BlockKeys = NO_KEYS
    """Content keys (and chain hashes) of its full blocks, as far as known (may run ahead
    of num_tokens). Never extended while the manager holds it."""
    num_committed: int = 0
    """Leading blocks whose content is in the cache chain (its own or an equal block)."""
    last_entry_id: int = 0
    chain_broken: bool = False
    """A collision stopped the chain: no later block of this sequence is committed."""
    num_loaded: int = 0
    """Of its prefix hits at allocation, the blocks loaded from the host tier."""


def check_size(owner: str, name: str, value: object, lo: int) -> int:
    """Constructor argument check: an int >= lo, else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{owner}: {name} must be an integer >= {lo}, got {value!r}")
    return value


def check_count(op: str, name: str, value: object, lo: int) -> None:
    """Method argument check: an int >= lo, else BlockManagerError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise BlockManagerError(f"{op}: {name} must be an integer >= {lo}, got {value!r}")


class PagedBlockManager(BlockManager):
    """Paged KV-cache blocks with reference counts, prefix caching, copy-on-write and swap.

    `watermark_blocks` is kept free when admitting new sequences (`allocate`,
    `swap_in`) so running sequences have room to grow; appends may use it.

    Prefix statistics count at `allocate` only (`can_allocate` merely peeks): queries
    are the request's full blocks with known contents, hits the blocks reused. A
    block-aligned prompt that is fully cached still computes its last block, so the
    hit rate of a repeated prompt stays below 1, as the work done does.
    """

    grows_by_block = True

    __slots__ = ("block_size", "num_gpu_blocks", "num_cpu_blocks", "watermark_blocks",
                 "_seqs", "_refcount", "_extra_refs", "_free", "_cache",
                 "_cpu_refcount", "_cpu_free", "_slots_used", "_prefix_queries", "_prefix_hits",
                 "_later", "num_host_blocks", "_host")

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int = 0, *,
                 watermark_blocks: int = 0, enable_prefix_caching: bool = False,
                 num_host_blocks: int = 0) -> None:
        owner = type(self).__name__
        self.block_size = check_size(owner, "block_size", block_size, 1)
        self.num_gpu_blocks = check_size(owner, "num_gpu_blocks", num_gpu_blocks, 1)
        self.num_cpu_blocks = check_size(owner, "num_cpu_blocks", num_cpu_blocks, 0)
        self.watermark_blocks = check_size(owner, "watermark_blocks", watermark_blocks, 0)
        if watermark_blocks >= num_gpu_blocks:
            raise ValueError(f"{owner}: watermark_blocks ({watermark_blocks}) must be below "
                             f"num_gpu_blocks ({num_gpu_blocks})")
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"{owner}: enable_prefix_caching must be a bool, "
                             f"got {enable_prefix_caching!r}")
        self.num_host_blocks = check_size(owner, "num_host_blocks", num_host_blocks, 0)
        if num_host_blocks and not enable_prefix_caching:
            raise ValueError(f"{owner}: a host tier ({num_host_blocks} blocks) holds prefix-cache "
                             "blocks and needs enable_prefix_caching")
        self._seqs: dict[Hashable, _SeqBlocks] = {}
        self._free = list(range(num_gpu_blocks - 1, -1, -1))  # block 0 is taken first
        self._cache = PrefixCache(num_gpu_blocks) if enable_prefix_caching else None
        self._refcount = [1] * num_gpu_blocks
        """GPU block-table references of each used block; a block nobody references reads
        1 (parked: see the module docstring)."""
        self._extra_refs = 0
        """Sum over GPU blocks of (references - 1) where above 1: 0 means nothing is shared."""
        self._cpu_refcount = [0] * num_cpu_blocks
        self._cpu_free = list(range(num_cpu_blocks - 1, -1, -1))
        self._slots_used = 0
        """Token slots filled in referenced GPU blocks, each block counted once."""
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._later = LaterMemos(self._cache) if self._cache is not None else None
        """LATER answers kept for waiting sequences' keys (see later_memo.py)."""
        self._host = HostTier(num_host_blocks, self._cache) if num_host_blocks else None
        """The host-memory tier of the prefix cache (see host_tier.py), or None."""
        if self._host is not None:
            self._cache.host = self._host

    @classmethod
    def from_config(cls, cache, max_model_len: int) -> PagedBlockManager:
        """The manager a `CacheConfig` describes (`max_model_len` is not needed)."""
        return cls(cache.block_size, cache.num_gpu_blocks, cache.num_cpu_blocks,
                   watermark_blocks=cache.watermark_blocks,
                   enable_prefix_caching=cache.enable_prefix_caching,
                   num_host_blocks=cache.num_host_blocks)

    # ------------------------------------------------------------------ admission
    def can_allocate(self, num_tokens: int, block_contents: Sequence[Hashable] = (), *,
                     max_total_tokens: int | None = None,
                     expected_total_tokens: int | None = None) -> AllocStatus:
        """O(1) without prefix caching. With it, O(blocks hit), or O(1) when the same
        `BlockKeys` was found LATER before and nothing that could change that happened
        since (`LaterMemos`). Changes nothing visible (cache lookups here are not counted
        as queries and do not refresh the LRU order)."""
        check_count("can_allocate", "num_tokens", num_tokens, 1)
        num_blocks = -(-num_tokens // self.block_size)
        if self._cache is None or not block_contents:
            return self._admission(num_blocks, NO_MATCH)
        keys = BlockKeys.of(block_contents)
        later = self._later
        if keys is block_contents and later.known_later(keys, num_tokens, self.num_free_blocks):
            return _LATER
        match = self._match(num_tokens, keys)
        status = self._admission(num_blocks, match)
        if status is _LATER and keys is block_contents:
            cap = min(len(keys), (num_tokens - 1) // self.block_size)
            later.remember(keys, num_tokens, self.num_free_blocks, min(len(match.blocks) + 1, cap))
        return status

    def allocate(self, seq_id: Hashable, num_tokens: int,
                 block_contents: Sequence[Hashable] = (), *,
                 max_total_tokens: int | None = None,
                 expected_total_tokens: int | None = None) -> int:
        if seq_id in self._seqs:
            raise BlockManagerError(f"allocate: sequence {seq_id!r} already has blocks")
        check_count("allocate", "num_tokens", num_tokens, 1)
        bs = self.block_size
        num_blocks = -(-num_tokens // bs)
        cache = self._cache
        contents = BlockKeys.of(block_contents) if cache is not None and block_contents else NO_KEYS
        match = self._match(num_tokens, contents)
        status = self._admission(num_blocks, match)
        if status is not _OK:
            raise BlockManagerError(
                f"allocate: no room for sequence {seq_id!r} ({status.value}): needs "
                f"{num_blocks - len(match.blocks)} new blocks, {self.num_free_blocks} free, "
                f"watermark {self.watermark_blocks}")
        refcount = self._refcount
        hits = gpu_hits = match.blocks
        loaded: list = []
        if match.on_host:   # pinned out of the host tier before _take can evict there
            on_host = set(match.on_host)
            gpu_hits = [b for i, b in enumerate(hits) if i not in on_host]
            loaded = [self._host.load(hits[i]) for i in match.on_host]
        if cache is not None:
            self._later.forget(contents)
            self._prefix_queries += min(len(contents), num_tokens // bs)
            self._prefix_hits += len(hits)
            for b in gpu_hits:
                if cache.is_evictable(b):   # revived: its parked count becomes its one reference
                    cache.touch(b)
                    self._later.touches += 1
                    self._slots_used += bs
                else:
                    refcount[b] += 1
                    self._extra_refs += 1
        new = self._take(num_blocks - len(gpu_hits))
        self._slots_used += num_tokens - len(gpu_hits) * bs
        if loaded:   # the first new blocks receive the host hits
            hits = list(hits)
            for i, gb, entry in zip(match.on_host, new, loaded):
                self._host.loading(gb, hits[i])
                cache.adopt(gb, entry)
                hits[i] = gb
            new = new[len(loaded):]
        self._seqs[seq_id] = _SeqBlocks(hits + new if hits else new, num_tokens, True, contents,
                                        len(hits), match.last_entry_id, num_loaded=len(loaded))
        return len(hits) * bs

    def cached_prefix_tokens(self, num_tokens: int, block_contents: Sequence[Hashable] = ()) -> int:
        """O(blocks hit) with the keys' chain hashes at hand (a `BlockKeys`)."""
        check_count("cached_prefix_tokens", "num_tokens", num_tokens, 1)
        return len(self._match(num_tokens, block_contents).blocks) * self.block_size

    def host_hit_tokens(self, seq_id: Hashable) -> int:
        return self._seq("host_hit_tokens", seq_id).num_loaded * self.block_size

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The host-tier copies the calls since the last one need: (GPU, host) offloads
        and (host, GPU) loads (see host_tier.py); ([], []) without a host tier."""
        return self._host.take_transfers() if self._host is not None else ([], [])

    def mark_computed(self, seq_id: Hashable, num_computed_tokens: int) -> None:
        """O(newly committed blocks): one hash and one dict probe each."""
        seq = self._gpu_seq("mark_computed", seq_id)
        check_count("mark_computed", "num_computed_tokens", num_computed_tokens, 0)
        if num_computed_tokens > seq.num_tokens:
            raise BlockManagerError(f"mark_computed: sequence {seq_id!r} has {seq.num_tokens} "
                                    f"tokens, not {num_computed_tokens}")
        cache = self._cache
        if cache is None or seq.chain_broken:
            return
        end = min(num_computed_tokens // self.block_size, len(seq.contents))
        if end > seq.num_committed:
            link = cache.commit(seq.blocks, seq.contents, seq.num_committed, end,
                                seq.last_entry_id, self._free)
            seq.num_committed = link.num_committed
            seq.last_entry_id, seq.chain_broken = link.last_entry_id, link.broken

    # ------------------------------------------------------------------ growth
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

    def fork(self, parent_seq_id: Hashable, child_seq_id: Hashable) -> None:
        """O(blocks). The child keeps only the parent's contents of full blocks: what
        comes after the fork point is its own."""
        parent = self._gpu_seq("fork", parent_seq_id)
        if child_seq_id in self._seqs:
            raise BlockManagerError(f"fork: child sequence {child_seq_id!r} already has blocks")
        refcount = self._refcount
        for b in parent.blocks:
            refcount[b] += 1
        self._extra_refs += len(parent.blocks)
        self._seqs[child_seq_id] = _SeqBlocks(
            list(parent.blocks), parent.num_tokens, True,
            parent.contents.prefix(parent.num_tokens // self.block_size), parent.num_committed,
            parent.last_entry_id, parent.chain_broken)

    def free(self, seq_id: Hashable) -> None:
        """O(blocks). Blocks go back last-first, so a cached sequence's tail is
        evicted before its head (the head is what other prefixes share)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise BlockManagerError(f"free: unknown sequence {seq_id!r} "
                                    "(never allocated, or already freed)")
        del self._seqs[seq_id]
        if seq.on_gpu:
            self._release(seq.blocks, seq.num_tokens)
        else:
            cpu_refcount = self._cpu_refcount
            cpu_free = self._cpu_free
            for b in reversed(seq.blocks):
                cpu_refcount[b] -= 1
                if not cpu_refcount[b]:
                    cpu_free.append(b)

    # ------------------------------------------------------------------ swapping
    def can_swap_out(self, seq_ids: Iterable[Hashable]) -> bool:
        group = self._group("can_swap_out", seq_ids, on_gpu=True)
        return len(self._group_blocks(group)) <= len(self._cpu_free)

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
            self._cache.release(released[::-1], self._free)
        for seq in group:
            seq.blocks = [mapping[b] for b in seq.blocks]
            seq.on_gpu = False
            # Its GPU copies may be reused by others: recommit after swap-in.
            seq.num_committed, seq.last_entry_id = 0, 0
            seq.chain_broken = False
        return list(mapping.items())

    def can_swap_in(self, seq_ids: Iterable[Hashable]) -> AllocStatus:
        group = self._group("can_swap_in", seq_ids, on_gpu=False)
        return self._swap_in_status(len(self._group_blocks(group)))

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """O(blocks of the group); sharing inside the group is kept, as in swap_out."""
        group = self._group("swap_in", seq_ids, on_gpu=False)
        moving = self._group_blocks(group)
        status = self._swap_in_status(len(moving))
        if status is not _OK:
            raise BlockManagerError(f"swap_in: no GPU room ({status.value}): needs "
                                    f"{len(moving)} blocks, {self.num_free_blocks} free, "
                                    f"watermark {self.watermark_blocks}")
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
        for seq in group:
            seq.blocks = [mapping[b] for b in seq.blocks]
            seq.on_gpu = True
        return list(mapping.items())

    def _swap_in_status(self, num_blocks: int) -> AllocStatus:
        """Like admission, the watermark stays free, unless nothing else holds GPU
        blocks: then waiting could not help, so LATER would never turn into OK."""
        if num_blocks > self.num_gpu_blocks:
            return _NEVER
        free = self.num_free_blocks
        if free - num_blocks >= self.watermark_blocks:
            return _OK
        if num_blocks <= free and self.num_used_blocks == 0:
            return _OK
        return _LATER

    def _group(self, op: str, seq_ids: Iterable[Hashable], *, on_gpu: bool) -> list[_SeqBlocks]:
        group = []
        for seq_id in unique_ids(op, seq_ids):
            seq = self._seqs.get(seq_id)
            if seq is None:
                raise BlockManagerError(f"{op}: unknown sequence {seq_id!r}")
            if seq.on_gpu != on_gpu:
                where = "swapped out" if on_gpu else "not swapped out"
                raise BlockManagerError(f"{op}: sequence {seq_id!r} is {where}")
            group.append(seq)
        return group

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

    # ------------------------------------------------------------------ queries
    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._seq("block_table", seq_id).blocks)

    def has_seq(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def is_swapped(self, seq_id: Hashable) -> bool:
        return not self._seq("is_swapped", seq_id).on_gpu

    def num_tokens(self, seq_id: Hashable) -> int:
        """Token slots the sequence holds."""
        return self._seq("num_tokens", seq_id).num_tokens

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + (self._cache.num_evictable if self._cache is not None else 0)

    @property
    def num_free_blocks_without_offload(self) -> int:
        """With a host tier, taking an evictable block copies it to the host: only the
        free list is free of copies. Without one, every free block."""
        return len(self._free) if self._host is not None else self.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_gpu_blocks - self.num_free_blocks

    def evictable_blocks(self) -> list[int]:
        """Cached blocks nobody references, least recently used (next evicted) first."""
        return self._cache.evictable_blocks() if self._cache is not None else []

    def evictable_hashes(self) -> list[int]:
        """The chain hashes of `evictable_blocks()`, in the same order: what is cached
        and in which eviction order, independent of which block ids hold it."""
        return [self._cache.block_hash(b) for b in self.evictable_blocks()]

    def usage(self) -> BlockUsage:
        cached = self._cache.num_evictable if self._cache is not None else 0
        used = self.num_gpu_blocks - len(self._free) - cached
        return BlockUsage(
            num_total_blocks=self.num_gpu_blocks, num_used_blocks=used,
            num_free_blocks=len(self._free), num_cached_blocks=cached,
            token_slots_used=self._slots_used, token_slots_allocated=used * self.block_size,
            reserved_unused_slots=0, num_cpu_total_blocks=self.num_cpu_blocks,
            num_cpu_used_blocks=self.num_cpu_blocks - len(self._cpu_free),
            prefix_queries=self._prefix_queries, prefix_hits=self._prefix_hits,
            num_host_total_blocks=self.num_host_blocks,
            num_host_cached_blocks=self._host.num_cached if self._host is not None else 0,
            host_offloaded_blocks=self._host.offloaded if self._host is not None else 0,
            host_loaded_blocks=self._host.loaded if self._host is not None else 0)

    # ------------------------------------------------------------------ internals
    def _seq(self, op: str, seq_id: Hashable) -> _SeqBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise BlockManagerError(f"{op}: unknown sequence {seq_id!r}")
        return seq

    def _gpu_seq(self, op: str, seq_id: Hashable) -> _SeqBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise BlockManagerError(f"{op}: unknown sequence {seq_id!r}")
        if not seq.on_gpu:
            raise BlockManagerError(f"{op}: sequence {seq_id!r} is swapped out")
        return seq

    def _match(self, num_tokens: int, block_contents: Sequence[Hashable]) -> PrefixMatch:
        """Cached leading blocks, never all of the tokens: at least the last token is
        computed, since the next token is sampled from its output."""
        if self._cache is None or not block_contents:
            return NO_MATCH
        return self._cache.match(BlockKeys.of(block_contents), (num_tokens - 1) // self.block_size)

    def _admission(self, num_blocks: int, match: PrefixMatch) -> AllocStatus:
        if num_blocks > self.num_gpu_blocks - self.watermark_blocks:
            return _NEVER
        need = num_blocks - len(match.blocks)
        if match.blocks:  # reviving an evictable hit takes it out of the free count
            gpu_hits = match.blocks
            if match.on_host:   # a host hit needs a fresh GPU block, as a miss does
                need += len(match.on_host)
                on_host = set(match.on_host)
                gpu_hits = [b for i, b in enumerate(gpu_hits) if i not in on_host]
            need += self._cache.num_evictable_of(gpu_hits)
        return _OK if self.num_free_blocks - need >= self.watermark_blocks else _LATER

    def _take(self, n: int) -> list[int]:
        """n blocks off the free stack, then least recently used cached ones. The
        caller has checked that they exist."""
        free = self._free
        if n <= len(free):
            if not n:
                return []
            taken = free[:-n - 1:-1]  # top of the stack first
            del free[-n:]
            return taken
        taken = free[::-1]
        free.clear()
        if self._host is None:
            taken += self._cache.evict(n - len(taken))
            return taken
        evicted, entries = self._cache.evict_entries(n - len(taken))
        self._host.store(evicted, entries)
        return taken + evicted

    def _release(self, blocks: list[int], num_tokens: int) -> None:
        """Drop one reference to each of a sequence's GPU blocks, last block first. A
        block that loses its last one keeps its count, parked at 1. O(1) Python steps
        when nothing is shared and no prefix cache is kept: every block goes back."""
        if not self._extra_refs:   # nothing is shared: every block goes
            if self._cache is None:
                self._free.extend(reversed(blocks))
            else:
                self._cache.release(blocks[::-1], self._free)
            self._slots_used -= num_tokens
            return
        refcount = self._refcount
        bs = self.block_size
        last_released = refcount[blocks[-1]] == 1
        # The counts are read in C. Shared blocks, when any, are mostly leading ones
        # (prefix hits, e.g. a system prompt every request shares): only those are
        # visited (each loses a reference) and the others go as one slice.
        counts = itemgetter(*blocks)(refcount) if len(blocks) > 1 else (refcount[blocks[0]],)
        ones = counts.count(1)
        lead = len(blocks) - ones
        if not lead:   # nothing shared: every block goes
            unreferenced = blocks[::-1]
        elif counts[lead:].count(1) == ones:
            for b in blocks[:lead]:
                refcount[b] -= 1
            self._extra_refs -= lead
            unreferenced = blocks[lead:]
            unreferenced.reverse()
        else:
            unreferenced = []
            extra = 0
            for b in reversed(blocks):
                if refcount[b] == 1:
                    unreferenced.append(b)
                else:
                    refcount[b] -= 1
                    extra += 1
            self._extra_refs -= extra
        released = len(unreferenced) * bs
        if self._cache is None:
            self._free += unreferenced
        else:
            self._cache.release(unreferenced, self._free)
        if last_released:  # the last block was only partly filled
            released -= len(blocks) * bs - num_tokens
        self._slots_used -= released

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        bs = self.block_size
        refs = [0] * self.num_gpu_blocks
        cpu_refs = [0] * self.num_cpu_blocks
        fill: dict[int, int] = {}
        for seq_id, seq in self._seqs.items():
            blocks = seq.blocks
            _require(seq.num_tokens >= 1 and len(blocks) == -(-seq.num_tokens // bs),
                     f"sequence {seq_id!r}: {len(blocks)} blocks for {seq.num_tokens} tokens")
            _require(len(set(blocks)) == len(blocks), f"sequence {seq_id!r} holds a block twice")
            counts = refs if seq.on_gpu else cpu_refs
            for i, b in enumerate(blocks):
                counts[b] += 1
                if seq.on_gpu:
                    f = bs if i < len(blocks) - 1 else seq.num_tokens - i * bs
                    _require(fill.setdefault(b, f) == f, f"sharers of block {b} disagree on its fill")
            _require(seq.num_committed <= min(len(seq.contents), seq.num_tokens // bs),
                     f"sequence {seq_id!r} committed {seq.num_committed} blocks")
            if seq.on_gpu and seq.num_tokens % bs and self._cache is not None:
                _require(not self._cache.is_cached(blocks[-1]),
                         f"sequence {seq_id!r}: partial block {blocks[-1]} is cached")
        _require([r or 1 for r in refs] == self._refcount,   # unreferenced blocks read 1
                 "GPU reference counts differ from the block tables")
        _require(self._extra_refs == sum(r - 1 for r in refs if r > 1),
                 f"extra reference total {self._extra_refs} differs from the block tables")
        _require(cpu_refs == self._cpu_refcount, "CPU reference counts differ from the block tables")
        _check_pool("GPU", self._free, refs)
        _check_pool("CPU", self._cpu_free, cpu_refs)
        used = sum(1 for r in refs if r)
        cached = 0
        if self._cache is not None:
            self._cache.check_invariants(refs)
            cached = self._cache.num_evictable
            _require(not set(self._free) & set(self._cache.evictable_blocks()),
                     "a block is both free and evictable")
            _require(not any(self._cache.is_cached(b) for b in self._free), "a free block is cached")
        if self._host is not None:
            self._host.check_invariants(self._cache.block_of_hash.get)
            gpu_ids = {self._cache.entry_id[b] for b in self._cache.block_of_hash.values()}
            host_ids = {self._host.entry_id(b) for b in self._host.index.block_of_hash.values()}
            _require(not gpu_ids & host_ids, "an entry is in both tiers")
        _require(used + len(self._free) + cached == self.num_gpu_blocks,
                 f"used {used} + free {len(self._free)} + cached {cached} != {self.num_gpu_blocks}")
        cpu_used = sum(1 for r in cpu_refs if r)
        _require(cpu_used + len(self._cpu_free) == self.num_cpu_blocks,
                 f"CPU used {cpu_used} + free {len(self._cpu_free)} != {self.num_cpu_blocks}")
        _require(sum(fill.values()) == self._slots_used,
                 f"slot count {self._slots_used} != {sum(fill.values())} from the tables")
        _require(self._prefix_hits <= self._prefix_queries, "more prefix hits than queries")
        if self._later is not None:
            for keys, num_tokens in self._later.valid():
                if self.num_free_blocks <= self._later.free_then(keys):
                    status = self._admission(-(-num_tokens // bs), self._match(num_tokens, keys))
                    _require(status is _LATER, f"a kept LATER answer is {status.value} now")


register_block_manager("paged", PagedBlockManager.from_config)


def _check_pool(name: str, free: list[int], refs: list[int]) -> None:
    _require(len(set(free)) == len(free), f"{name} free list holds a block twice")
    for b in free:
        _require(refs[b] == 0, f"{name} block {b} is both free and referenced")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
