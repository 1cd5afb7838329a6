"""Speed layer for `memory/paged.py` `PagedBlockManager`: the same paged block manager,
its prefix cache and host tier kept per run of blocks instead of per block.

It decides exactly as the plain manager (tests/test_plain_paged.py drives both with the
same calls and compares every answer, block table, copy and statistic) and adds what the
simulator's speed layer needs by name: `grows_by_block`, `append_slots_many`,
`max_uniform_growth`, `num_free_blocks_without_offload` (paged_growth.py) and
`known_later` (later_memo.py). `simulator/speed` builds it for a `paged` cache
(`make_block_manager`).

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
prefix cache (a run's entries from `ev` on, in its LRU stretches). Every operation works per
block, never per token: appending k tokens costs O(1 + new blocks), `can_append_slots`
is O(1). Allocation, free and swap are O(blocks of the sequences involved), in C where
they can be. With prefix caching, a look-up, a commit and a release cost O(1) Python
steps per run of cache entries involved (see prefix_runs.py): a sequence keeps the runs
it references (`_SeqBlocks.spans`), and their blocks are compared and moved as slices.

Every mutating method checks its preconditions before it changes anything and raises
`BlockManagerError` on a violation, leaving the manager exactly as it was.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Hashable, Sequence

from servelab.memory.base import (AllocStatus, BlockManager, BlockManagerError, check_count,
                                  check_pool, check_prefix_options, invariant)
from servelab.memory.paged_common import PagedCommon
from .block_keys import BlockKeys
from .host_runs import HostTier
from .later_memo import LaterMemos
from .paged_growth import PagedGrowth
from .paged_swap import PagedSwapping
from .prefix_runs import NO_MATCH, PrefixCache, PrefixMatch

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
    spans: list = field(default_factory=list)
    """The cache entries it references, in block order: (run, a, b) for its blocks at
    positions a .. b - 1, entries of that run (a run is indexed by chain position).
    Its other blocks are uncached."""
    loc: tuple | None = None
    """(run, index) where the last entry of its chain was on the GPU, or None."""
    forked: bool = False
    """It may share blocks beyond its cache entries (a fork, or a group swapped back
    in): committing then goes through `_commit_shared`, and releasing it reads every
    block's count."""


class RunPagedBlockManager(PagedGrowth, PagedSwapping, PagedCommon, BlockManager):
    """Paged KV-cache blocks with reference counts, prefix caching, copy-on-write and swap.

    `watermark_blocks` is kept free when admitting new sequences (`allocate`,
    `swap_in`) so running sequences have room to grow; appends may use it.

    Prefix statistics count at `allocate` only (`can_allocate` merely peeks): queries
    are the request's full blocks with known contents, hits the blocks reused. A
    block-aligned prompt that is fully cached still computes its last block, so the
    hit rate of a repeated prompt stays below 1, as the work done does.

    Growth (`append_slots` and its batch form) lives in `PagedGrowth` (paged_growth.py)
    and swapping in `PagedSwapping` (paged_swap.py); the state they share is this class's.
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
        check_pool(owner, block_size, num_gpu_blocks, num_cpu_blocks, watermark_blocks)
        check_prefix_options(owner, enable_prefix_caching, num_host_blocks)
        self.block_size, self.num_gpu_blocks, self.num_cpu_blocks = block_size, num_gpu_blocks, num_cpu_blocks
        self.watermark_blocks, self.num_host_blocks = watermark_blocks, num_host_blocks
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
        self._host = HostTier(num_host_blocks) if num_host_blocks else None
        """The host-memory tier of the prefix cache (see host_runs.py), or None."""
        if self._host is not None:
            self._cache.host = self._host

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
        hits = match.blocks
        # host-tier hits are taken out of it first: _take may evict into it
        loaded = cache.take_host_hits(match) if match.num_on_host else ()
        if cache is not None:
            self._later.forget(contents)
            self._prefix_queries += min(len(contents), num_tokens // bs)
            self._prefix_hits += len(hits)
            for p in match.pieces:
                if p.__class__ is not tuple:
                    continue
                run, a, b = p
                ev = run.ev
                if ev > a:   # referenced already: one more reference each
                    shared = run.blocks[a:ev if ev < b else b]
                    for blk in shared:
                        refcount[blk] += 1
                    self._extra_refs += len(shared)
                if b > ev:   # revived: their parked counts become their one reference
                    k = cache.revive(run, b)
                    self._later.touches += k
                    self._slots_used += k * bs
        num_gpu_hits = len(hits) - match.num_on_host
        new = self._take(num_blocks - num_gpu_hits)
        self._slots_used += num_tokens - num_gpu_hits * bs
        blocks = hits + new if hits else new
        if loaded:   # the first new blocks receive the host hits, in order
            spans = []
            moved = iter(loaded)
            used = 0
            for p in match.pieces:
                if p.__class__ is not tuple:
                    entries = next(moved)
                    blocks[p.a:p.b] = new[used:used + p.b - p.a]
                    used += p.b - p.a
                    p = (cache.adopt(blocks, contents, entries, p.blocks), p.a, p.b)
                spans.append(p)
            del blocks[len(hits):len(hits) + used]
        else:
            spans = [p for p in match.pieces if p.__class__ is tuple]
        loc = None
        if spans:
            run, _, b = spans[-1]
            loc = (run, b - 1)
        self._seqs[seq_id] = _SeqBlocks(blocks, num_tokens, True, contents, len(hits),
                                        match.last_entry_id, num_loaded=match.num_on_host,
                                        spans=spans, loc=loc)
        return len(hits) * bs

    def cached_prefix_tokens(self, num_tokens: int, block_contents: Sequence[Hashable] = ()) -> int:
        """O(blocks hit) with the keys' chain hashes at hand (a `BlockKeys`)."""
        check_count("cached_prefix_tokens", "num_tokens", num_tokens, 1)
        return len(self._match(num_tokens, block_contents).blocks) * self.block_size

    def known_later(self, num_tokens: int, block_contents: Sequence[Hashable]) -> bool:
        later = self._later
        return later is not None and type(block_contents) is BlockKeys \
            and later.known_later(block_contents, num_tokens, self.num_free_blocks)

    def host_hit_tokens(self, seq_id: Hashable) -> int:
        return self._seq("host_hit_tokens", seq_id).num_loaded * self.block_size

    def take_transfers(self) -> tuple[Sequence[tuple[int, int]], Sequence[tuple[int, int]]]:
        """The host-tier copies the calls since the last one need: (GPU, host) offloads
        and (host, GPU) loads (see host_runs.py); ([], []) without a host tier."""
        return self._host.take_transfers() if self._host is not None else ([], [])

    def mark_computed(self, seq_id: Hashable, num_computed_tokens: int) -> None:
        """O(runs met) Python steps, the newly committed blocks compared and entered as
        slices (see `PrefixCache.commit`)."""
        seq = self._seqs.get(seq_id)
        if seq is None or not seq.on_gpu or type(num_computed_tokens) is not int \
                or num_computed_tokens < 0:   # (one test for the valid case: called per chunk)
            seq = self._gpu_seq("mark_computed", seq_id)
            check_count("mark_computed", "num_computed_tokens", num_computed_tokens, 0)
        if num_computed_tokens > seq.num_tokens:
            raise BlockManagerError(f"mark_computed: sequence {seq_id!r} has {seq.num_tokens} "
                                    f"tokens, not {num_computed_tokens}")
        cache = self._cache
        if cache is None or seq.chain_broken:
            return
        end = min(num_computed_tokens // self.block_size, len(seq.contents.keys))
        if end <= seq.num_committed:
            return
        if seq.forked and self._extra_refs:
            self._commit_shared(seq, end)
        else:   # only its committed blocks (prefix hits) can be shared
            self._commit(seq, end)

    def _commit(self, seq: _SeqBlocks, end: int) -> None:
        """Commit the sequence's blocks up to `end` and record where its chain stands."""
        loc = seq.loc
        if loc is not None:
            run, off = loc
            if self._cache.grow(run, off, seq.blocks, seq.contents.hashes, seq.num_committed, end):
                seq.num_committed, seq.last_entry_id, seq.loc = end, run.id0 + end - 1, (run, end - 1)
                _, a, _ = seq.spans[-1]   # its last span is that run's
                seq.spans[-1] = (run, a, end)
                return
        link = self._cache.commit(seq.blocks, seq.contents, seq.num_committed, end,
                                  seq.last_entry_id, loc, self._free)
        seq.num_committed, seq.last_entry_id, seq.chain_broken, seq.loc = link[:4]
        if link.grown:
            run, a, _ = seq.spans[-1]
            seq.spans[-1] = (run, a, run.hi)
        if link.runs:
            seq.spans += [(run, run.lo, run.hi) for run in link.runs]

    def _commit_shared(self, seq: _SeqBlocks, end: int) -> None:
        """`_commit` for a sequence that may share blocks it has not committed yet (a
        fork, or a group swapped back in). A run needs whoever holds one of its entries
        to hold the entries before it, so shared blocks are committed only where every
        other holder shares all of the sequence's blocks up to there (a fork's sharers
        do; a swapped group's members may not): those *sharers* keep the same chain over
        their shared blocks, so the commit stops where each sharer's shared blocks end
        and the sharer takes the sequence's chain as it stands there (runs made over its
        blocks included). At a block held otherwise the chain stops (`chain_broken`): it
        stays uncached. O(sequences x blocks): rare."""
        blocks, c = seq.blocks, seq.num_committed
        refcount = self._refcount
        if all(refcount[b] == 1 for b in blocks[c:end]):
            self._commit(seq, end)
            return
        sharers = []   # (how many leading blocks it shares with seq, it)
        for other in self._seqs.values():
            theirs = other.blocks
            if other is not seq and other.on_gpu and len(theirs) > c and theirs[c] == blocks[c]:
                f = 0
                while f < len(theirs) and f < len(blocks) and theirs[f] == blocks[f]:
                    f += 1
                if f > c:
                    sharers.append((f, other))
        broken = False
        for p in range(c, end):   # every other holder of block p must be a sharer
            if refcount[blocks[p]] - 1 != sum(1 for f, _ in sharers if f > p):
                end, broken = p, True
                break
        for stop in sorted({min(f, end) for f, _ in sharers} | {end}):
            if stop > seq.num_committed and not seq.chain_broken:
                self._commit(seq, stop)
            for f, other in sharers:
                if f >= stop:
                    other.num_committed, other.last_entry_id = seq.num_committed, seq.last_entry_id
                    other.chain_broken, other.loc = seq.chain_broken, seq.loc
                    other.spans = list(seq.spans)
        if broken and seq.num_committed == end:
            seq.chain_broken = True

    # ------------------------------------------------------------------ sharing and release
    # (growth: paged_growth.py; swapping: paged_swap.py)
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
        parent.forked = True
        self._seqs[child_seq_id] = _SeqBlocks(
            list(parent.blocks), parent.num_tokens, True,
            parent.contents.prefix(parent.num_tokens // self.block_size), parent.num_committed,
            parent.last_entry_id, parent.chain_broken, spans=list(parent.spans), loc=parent.loc,
            forked=True)

    def free(self, seq_id: Hashable) -> None:
        """O(blocks). Blocks go back last-first, so a cached sequence's tail is
        evicted before its head (the head is what other prefixes share)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise BlockManagerError(f"free: unknown sequence {seq_id!r} "
                                    "(never allocated, or already freed)")
        del self._seqs[seq_id]
        if seq.on_gpu:
            self._release(seq)
        else:
            cpu_refcount = self._cpu_refcount
            cpu_free = self._cpu_free
            for b in reversed(seq.blocks):
                cpu_refcount[b] -= 1
                if not cpu_refcount[b]:
                    cpu_free.append(b)

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks_without_offload(self) -> int:
        """With a host tier, taking an evictable block copies it to the host: only the
        free list is free of copies. Without one, every free block."""
        return len(self._free) if self._host is not None else self.num_free_blocks

    @property
    def offload_room(self) -> int:
        """Blocks beyond `num_free_blocks_without_offload` a run of decode steps may take,
        each evicted with a copy to the host tier: the evictable ones, at most the tier's
        size, so that the tier gives up none of the run's own offloads before their copies
        are taken. 0 without a host tier."""
        host = self._host
        if host is None:
            return 0
        return min(self.num_free_blocks - len(self._free), host.num_blocks)

    def evictable_hashes(self) -> list[int]:
        """The chain hashes of `evictable_blocks()`, in the same order: what is cached
        and in which eviction order, independent of which block ids hold it."""
        if self._cache is None:
            return []
        cached = self._cache.cached()
        return [run.hashes[k] for run, k in map(cached.__getitem__, self.evictable_blocks())]

    def _token_slots_used(self) -> int:
        return self._slots_used

    # ------------------------------------------------------------------ internals
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
            # (a host hit needs a fresh GPU block, as a miss does)
            need += match.num_on_host + self._cache.num_evictable_in(match.pieces)
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
        return self._cache.evict(n - len(taken), taken)   # into the host tier, if any

    def _release(self, seq: _SeqBlocks) -> None:
        """Drop one reference to each of a sequence's GPU blocks, last block first. A
        block that loses its last one keeps its count, parked at 1. O(1) Python steps
        when nothing is shared and no prefix cache is kept: every block goes back; with
        a prefix cache, O(1) per run of entries the sequence references."""
        blocks, num_tokens = seq.blocks, seq.num_tokens
        cache = self._cache
        if cache is not None and (not seq.forked or not self._extra_refs):
            self._release_spans(seq)   # only its cache entries can be shared
            return
        if not self._extra_refs:   # nothing is shared: every block goes
            self._free.extend(reversed(blocks))
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
        if cache is not None:
            if lead:
                if counts[lead:].count(1) == ones:
                    shared = blocks[:lead]
                else:
                    shared = [b for b, c in zip(blocks, counts) if c != 1]
                for b in shared:
                    refcount[b] -= 1
                self._extra_refs -= lead
            self._park(blocks, seq.spans, counts)
            released = ones * bs
        else:
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
            self._free += unreferenced
        if last_released:  # the last block was only partly filled
            released -= len(blocks) * bs - num_tokens
        self._slots_used -= released

    def _release_spans(self, seq: _SeqBlocks) -> None:
        """`_release` of a sequence whose only shared blocks are cache entries (prefix
        hits): its other blocks all go, and in each span the entries others still hold
        come first (whoever holds an entry holds the run before it), so the counts are
        read at a span's ends, and bisected in between only when some are held. O(1)
        Python steps per span, plus one per entry still held."""
        blocks, spans = seq.blocks, seq.spans
        refcount, free = self._refcount, self._free
        last_released = refcount[blocks[-1]] == 1
        pieces = []
        held = 0
        end = len(blocks)
        for run, a, b in reversed(spans):   # (run, a, b): the blocks at positions a .. b - 1
            if b < end:
                free += blocks[b:end][::-1]
            end = a
            entries = run.blocks
            if refcount[entries[a]] == 1:
                u = a
            elif refcount[entries[b - 1]] > 1:
                u = b
            else:   # the first entry only this sequence holds
                u = bisect_left(range(a, b), True, key=lambda k: refcount[entries[k]] == 1) + a
            if u > a:
                for blk in entries[a:u]:
                    refcount[blk] -= 1
                held += u - a
            if u < b:
                pieces.append((run, u, b))
        if end:
            free += blocks[:end][::-1]
        self._extra_refs -= held
        if pieces:
            self._cache.park(pieces)
        released = (len(blocks) - held) * self.block_size
        if last_released:  # the last block was only partly filled
            released -= len(blocks) * self.block_size - seq.num_tokens
        self._slots_used -= released

    def _park(self, blocks: list[int], spans: list, counts: tuple) -> None:
        """The blocks of a forked sequence whose count read 1 (`counts`, one per block)
        just lost their last reference, last block first: the cached ones become the
        most recently used evictable entries, the others go onto the free stack.
        O(blocks)."""
        free = self._free
        pieces = []
        end = len(blocks)
        for run, a, b in reversed(spans):   # (run, a, b): the blocks at positions a .. b - 1
            if b < end:
                free += [blocks[k] for k in range(end - 1, b - 1, -1) if counts[k] == 1]
            u = b - counts[a:b].count(1)
            if u < b:
                pieces.append((run, u, b))
            end = a
        if end:
            free += [blocks[k] for k in range(end - 1, -1, -1) if counts[k] == 1]
        if pieces:
            self._cache.park(pieces)

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        bs = self.block_size
        refs = [0] * self.num_gpu_blocks
        cpu_refs = [0] * self.num_cpu_blocks
        fill: dict[int, int] = {}
        for seq_id, seq in self._seqs.items():
            blocks = seq.blocks
            invariant(seq.num_tokens >= 1 and len(blocks) == -(-seq.num_tokens // bs),
                      f"sequence {seq_id!r}: {len(blocks)} blocks for {seq.num_tokens} tokens")
            invariant(len(set(blocks)) == len(blocks), f"sequence {seq_id!r} holds a block twice")
            counts = refs if seq.on_gpu else cpu_refs
            for i, b in enumerate(blocks):
                counts[b] += 1
                if seq.on_gpu:
                    f = bs if i < len(blocks) - 1 else seq.num_tokens - i * bs
                    invariant(fill.setdefault(b, f) == f, f"sharers of block {b} disagree on its fill")
            invariant(seq.num_committed <= min(len(seq.contents), seq.num_tokens // bs),
                      f"sequence {seq_id!r} committed {seq.num_committed} blocks")
            invariant(seq.on_gpu or not seq.spans, f"swapped sequence {seq_id!r} holds cache entries")
        invariant([r or 1 for r in refs] == self._refcount,   # unreferenced blocks read 1
                  "GPU reference counts differ from the block tables")
        invariant(self._extra_refs == sum(r - 1 for r in refs if r > 1),
                  f"extra reference total {self._extra_refs} differs from the block tables")
        invariant(cpu_refs == self._cpu_refcount, "CPU reference counts differ from the block tables")
        _check_pool("GPU", self._free, refs)
        _check_pool("CPU", self._cpu_free, cpu_refs)
        used = sum(1 for r in refs if r)
        cached = 0
        if self._cache is not None:
            in_cache = self._cache.check_invariants(refs)
            cached = self._cache.num_evictable
            invariant(not set(self._free) & set(self._cache.evictable_blocks()),
                      "a block is both free and evictable")
            invariant(not any(b in in_cache for b in self._free), "a free block is cached")
            for seq_id, seq in self._seqs.items():
                if seq.on_gpu:
                    self._check_spans(seq_id, seq, in_cache)
        if self._host is not None:
            self._host.check_invariants({(run.hashes[k], run.parent_of(k), run.contents[k])
                                         for run, k in in_cache.values()})
            invariant(not set(self._cache.entry_ids()) & set(self._host.entry_ids()),
                      "an entry is in both tiers")
        invariant(used + len(self._free) + cached == self.num_gpu_blocks,
                  f"used {used} + free {len(self._free)} + cached {cached} != {self.num_gpu_blocks}")
        cpu_used = sum(1 for r in cpu_refs if r)
        invariant(cpu_used + len(self._cpu_free) == self.num_cpu_blocks,
                  f"CPU used {cpu_used} + free {len(self._cpu_free)} != {self.num_cpu_blocks}")
        invariant(sum(fill.values()) == self._slots_used,
                  f"slot count {self._slots_used} != {sum(fill.values())} from the tables")
        invariant(self._prefix_hits <= self._prefix_queries, "more prefix hits than queries")
        if self._later is not None:
            for keys, num_tokens in self._later.valid():
                if self.num_free_blocks <= self._later.free_then(keys):
                    status = self._admission(-(-num_tokens // bs), self._match(num_tokens, keys))
                    invariant(status is _LATER, f"a kept LATER answer is {status.value} now")


    def _check_spans(self, seq_id: Hashable, seq: _SeqBlocks, in_cache: dict) -> None:
        """A sequence's spans name, in order, exactly its cached blocks, and its partial
        last block is not cached."""
        named = []
        for run, a, b in seq.spans:
            invariant(run.lo <= a < b <= run.ev, f"sequence {seq_id!r}: span {run}[{a}:{b}] is not held")
            invariant(seq.blocks[a:b] == run.blocks[a:b],
                      f"sequence {seq_id!r}: span {run}[{a}:{b}] is not its blocks")
            named += range(a, b)
        invariant(named == sorted(set(named)), f"sequence {seq_id!r}: spans overlap or are out of order")
        held = [i for i, b in enumerate(seq.blocks) if b in in_cache]
        invariant(held == named, f"sequence {seq_id!r}: cached blocks at {held}, spans name {named}")
        if seq.num_tokens % self.block_size:
            invariant(seq.blocks[-1] not in in_cache,
                      f"sequence {seq_id!r}: partial block {seq.blocks[-1]} is cached")




def _check_pool(name: str, free: list[int], refs: list[int]) -> None:
    invariant(len(set(free)) == len(free), f"{name} free list holds a block twice")
    for b in free:
        invariant(refs[b] == 0, f"{name} block {b} is both free and referenced")
