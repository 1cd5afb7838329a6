"""A paged KV-cache block manager, one block at a time: the plain version the real
backend runs (the simulator's speed layer, simulator/speed/paged.py, decides alike,
faster: tests/test_plain_paged.py).

A sequence holds a block table of GPU blocks in token order; only its last block can be
partly filled. Blocks carry reference counts: `fork` shares a parent's blocks, and the
first write into a shared partial block copies it (copy-on-write). With prefix caching,
computed full blocks enter a `PrefixCache` (prefix_cache.py) and later sequences with
the same prefix reuse them; unreferenced cached blocks stay until the free list is
empty, least recently used first (then to the host tier, host_tier.py, if any).
Sequences swap as a group to a CPU pool and back (swap.py). Free blocks are a stack, and
a sequence's blocks go back last first, so its tail is evicted before its head (what
other prompts share).

Costs: O(blocks involved) per call; `usage` and `check_invariants` walk every table.
A mutating call checks first and raises `BlockManagerError`, changing nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

from .base import AllocStatus, BlockManager, BlockManagerError, check_count, check_pool, check_prefix_options
from .host_tier import HostTier
from .paged_checks import PagedChecks
from .paged_common import PagedCommon
from .swap import Swapping
from .prefix_cache import Hit, PrefixCache, chain_hashes
from .registry import register_block_manager

_OK, _LATER, _NEVER = AllocStatus.OK, AllocStatus.LATER, AllocStatus.NEVER


@dataclass(slots=True, eq=False)
class _Seq:
    """A sequence's block table and how far its chain of cache entries reaches."""

    blocks: list[int]                 # GPU block ids, or CPU ones while swapped out
    num_tokens: int
    keys: list[Hashable] = field(default_factory=list)   # of full blocks, may run ahead
    hashes: list[int] = field(default_factory=list)      # their chain hashes
    on_gpu: bool = True
    num_committed: int = 0            # leading blocks in the cache (own entry or equal one)
    last_entry_id: int = 0
    chain_broken: bool = False        # no block from num_committed on is committed
    num_loaded: int = 0               # prefix hits loaded from the host tier


class PagedBlockManager(Swapping, PagedChecks, PagedCommon, BlockManager):
    """Paged blocks with reference counts, prefix caching, copy-on-write and swap.

    `watermark_blocks` stay free when admitting (`allocate`, `swap_in`) so running
    sequences have room to grow. Prefix statistics count at `allocate` only: queries are
    the request's full blocks with known contents, hits the blocks reused."""

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int = 0, *,
                 watermark_blocks: int = 0, enable_prefix_caching: bool = False,
                 num_host_blocks: int = 0) -> None:
        owner = type(self).__name__
        check_pool(owner, block_size, num_gpu_blocks, num_cpu_blocks, watermark_blocks)
        check_prefix_options(owner, enable_prefix_caching, num_host_blocks)
        self.block_size, self.num_gpu_blocks, self.num_cpu_blocks = block_size, num_gpu_blocks, num_cpu_blocks
        self.watermark_blocks, self.num_host_blocks = watermark_blocks, num_host_blocks
        self._seqs: dict[Hashable, _Seq] = {}
        self._free = list(range(num_gpu_blocks - 1, -1, -1))   # block 0 is taken first
        self._refs = [0] * num_gpu_blocks
        self._cpu_free = list(range(num_cpu_blocks - 1, -1, -1))
        self._cpu_refs = [0] * num_cpu_blocks
        self._host = HostTier(num_host_blocks) if num_host_blocks else None
        self._cache = PrefixCache(self._host) if enable_prefix_caching else None
        self._prefix_queries = 0
        self._prefix_hits = 0

    # ------------------------------------------------------------------ admission
    def can_allocate(self, num_tokens: int, block_contents: Sequence[Hashable] = (), *,
                     max_total_tokens: int | None = None,
                     expected_total_tokens: int | None = None) -> AllocStatus:
        check_count("can_allocate", "num_tokens", num_tokens, 1)
        return self._admission(num_tokens, self._match(num_tokens, block_contents)[0])

    def allocate(self, seq_id: Hashable, num_tokens: int,
                 block_contents: Sequence[Hashable] = (), *,
                 max_total_tokens: int | None = None,
                 expected_total_tokens: int | None = None) -> int:
        if seq_id in self._seqs:
            raise BlockManagerError(f"allocate: sequence {seq_id!r} already has blocks")
        check_count("allocate", "num_tokens", num_tokens, 1)
        hits, last_entry_id = self._match(num_tokens, block_contents)
        status = self._admission(num_tokens, hits)
        if status is not _OK:
            raise BlockManagerError(
                f"allocate: no room for sequence {seq_id!r} ({status.value}): needs "
                f"{-(-num_tokens // self.block_size) - len(hits)} new blocks, "
                f"{self.num_free_blocks} free, watermark {self.watermark_blocks}")
        cache = self._cache
        keys = list(block_contents) if cache is not None else []
        if cache is not None:
            self._prefix_queries += min(len(keys), num_tokens // self.block_size)
            self._prefix_hits += len(hits)
        # Host hits leave the host tier before blocks are taken (taking may evict into
        # it), then are loaded into the first new blocks.
        loaded = [cache.host.load(hit.block) for hit in hits if hit.on_host]
        for hit in hits:
            if not hit.on_host:
                cache.revive(hit.block)
                self._refs[hit.block] += 1
        new = self._take(-(-num_tokens // self.block_size) - len(hits) + len(loaded))
        blocks = []
        for hit in hits:
            if hit.on_host:
                blocks.append(new.pop(0))
                cache.adopt(blocks[-1], loaded.pop(0), hit.block)
            else:
                blocks.append(hit.block)
        self._seqs[seq_id] = _Seq(blocks + new, num_tokens, keys, chain_hashes(keys),
                                  num_committed=len(hits), last_entry_id=last_entry_id,
                                  num_loaded=sum(hit.on_host for hit in hits))
        return len(hits) * self.block_size

    def cached_prefix_tokens(self, num_tokens: int, block_contents: Sequence[Hashable] = ()) -> int:
        check_count("cached_prefix_tokens", "num_tokens", num_tokens, 1)
        return len(self._match(num_tokens, block_contents)[0]) * self.block_size

    def host_hit_tokens(self, seq_id: Hashable) -> int:
        return self._seq("host_hit_tokens", seq_id).num_loaded * self.block_size

    def take_transfers(self) -> tuple[Sequence[tuple[int, int]], Sequence[tuple[int, int]]]:
        return self._host.take_transfers() if self._host is not None else ([], [])

    # ------------------------------------------------------------------ prefix commits
    def mark_computed(self, seq_id: Hashable, num_computed_tokens: int) -> None:
        """Commit the sequence's full computed blocks with known contents, in order.

        A block other sequences also hold is committed only where each of them holds
        the same blocks before it too (forks do; a group swapped back in may not): the
        others then share the chain as it stands there. Elsewhere the chain stops. This
        keeps every holder of an entry a holder of the entries before it, as the run
        cache of simulator/speed/prefix_runs.py needs, so both decide alike. O(blocks committed),
        plus O(sequences x blocks) when blocks are shared."""
        seq = self._gpu_seq("mark_computed", seq_id)
        check_count("mark_computed", "num_computed_tokens", num_computed_tokens, 0)
        if num_computed_tokens > seq.num_tokens:
            raise BlockManagerError(f"mark_computed: sequence {seq_id!r} has {seq.num_tokens} "
                                    f"tokens, not {num_computed_tokens}")
        end = min(num_computed_tokens // self.block_size, len(seq.keys))
        if self._cache is None or seq.chain_broken or end <= seq.num_committed:
            return
        if all(self._refs[b] == 1 for b in seq.blocks[seq.num_committed:end]):
            self._commit(seq, end)
        else:
            self._commit_shared(seq, end)

    def _commit_shared(self, seq: _Seq, end: int) -> None:
        """`_commit` where some of the blocks are shared: each other holder of a block
        must be a *sharer* (it holds the same blocks up to there), else the chain stops
        there; each sharer takes the chain as it stands where its shared blocks end."""
        blocks, start = seq.blocks, seq.num_committed
        sharers = []   # (how many leading blocks it shares with seq, it), block start included
        for other in self._seqs.values():
            if other is not seq and other.on_gpu:
                shared = _common_prefix(other.blocks, blocks)
                if shared > start:
                    sharers.append((shared, other))
        stopped = False
        for p in range(start, end):
            if self._refs[blocks[p]] - 1 != sum(1 for shared, _ in sharers if shared > p):
                end, stopped = p, True
                break
        for stop in sorted({min(shared, end) for shared, _ in sharers} | {end}):
            if stop > seq.num_committed and not seq.chain_broken:
                self._commit(seq, stop)
            for shared, other in sharers:
                if shared >= stop:
                    other.num_committed, other.last_entry_id = seq.num_committed, seq.last_entry_id
                    other.chain_broken = seq.chain_broken
        if stopped and seq.num_committed == end:
            seq.chain_broken = True

    def _commit(self, seq: _Seq, end: int) -> None:
        """Enter the sequence's blocks num_committed .. end - 1 into the cache, one by
        one, until the chain stops."""
        for i in range(seq.num_committed, end):
            entry_id, freed = self._cache.commit(seq.blocks[i], seq.hashes[i], seq.last_entry_id,
                                                 seq.keys[i])
            if freed is not None:
                self._free.append(freed)
            if entry_id is None:
                seq.chain_broken = True
                return
            seq.num_committed, seq.last_entry_id = i + 1, entry_id

    # ------------------------------------------------------------------ growth
    def can_append_slots(self, seq_id: Hashable, num_new_tokens: int) -> bool:
        seq = self._gpu_seq("can_append_slots", seq_id)
        check_count("can_append_slots", "num_new_tokens", num_new_tokens, 0)
        need, copy = self._growth(seq, num_new_tokens)
        return need + copy <= self.num_free_blocks

    def append_slots(self, seq_id: Hashable, num_new_tokens: int) -> list[tuple[int, int]]:
        """Returns [(src, dst)] when a shared partial last block was copied first."""
        seq = self._gpu_seq("append_slots", seq_id)
        check_count("append_slots", "num_new_tokens", num_new_tokens, 0)
        need, copy = self._growth(seq, num_new_tokens)
        if need + copy > self.num_free_blocks:
            raise BlockManagerError(
                f"append_slots: no room for {num_new_tokens} more tokens of sequence "
                f"{seq_id!r}: needs {need + copy} blocks, {self.num_free_blocks} free")
        copies = []
        if copy:
            src, (dst,) = seq.blocks[-1], self._take(1)
            self._refs[src] -= 1
            seq.blocks[-1] = dst
            copies.append((src, dst))
        seq.blocks += self._take(need)
        seq.num_tokens += num_new_tokens
        return copies

    def _growth(self, seq: _Seq, num_new_tokens: int) -> tuple[int, bool]:
        """New blocks these tokens need, and whether a shared, partly filled last block
        is copied first."""
        need = -(-(seq.num_tokens + num_new_tokens) // self.block_size) - len(seq.blocks)
        copy = num_new_tokens > 0 and seq.num_tokens % self.block_size != 0 \
            and self._refs[seq.blocks[-1]] > 1
        return need, copy

    # ------------------------------------------------------------------ sharing and release
    def fork(self, parent_seq_id: Hashable, child_seq_id: Hashable) -> None:
        """The child keeps only the parent's contents of full blocks."""
        parent = self._gpu_seq("fork", parent_seq_id)
        if child_seq_id in self._seqs:
            raise BlockManagerError(f"fork: child sequence {child_seq_id!r} already has blocks")
        for b in parent.blocks:
            self._refs[b] += 1
        full = parent.num_tokens // self.block_size
        self._seqs[child_seq_id] = _Seq(
            list(parent.blocks), parent.num_tokens, parent.keys[:full], parent.hashes[:full],
            num_committed=parent.num_committed, last_entry_id=parent.last_entry_id,
            chain_broken=parent.chain_broken)

    def free(self, seq_id: Hashable) -> None:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise BlockManagerError(f"free: unknown sequence {seq_id!r} "
                                    "(never allocated, or already freed)")
        del self._seqs[seq_id]
        for b in reversed(seq.blocks):   # last block first
            if seq.on_gpu:
                self._refs[b] -= 1
                if not self._refs[b]:
                    self._unreferenced(b)
            else:
                self._cpu_refs[b] -= 1
                if not self._cpu_refs[b]:
                    self._cpu_free.append(b)

    # ------------------------------------------------------------------ internals
    def _match(self, num_tokens: int, block_contents: Sequence[Hashable]) -> tuple[list[Hit], int]:
        """Cached leading blocks, never all of the tokens: at least the last token is
        computed, since the next token is sampled from its output. O(keys) to hash."""
        if self._cache is None or not block_contents:
            return [], 0
        keys = list(block_contents)
        return self._cache.match(chain_hashes(keys), keys, (num_tokens - 1) // self.block_size)

    def _admission(self, num_tokens: int, hits: list[Hit]) -> AllocStatus:
        """Room for a new sequence: blocks it lacks, plus evictable and host hits (each
        takes a block off the free count), keeping the watermark free."""
        num_blocks = -(-num_tokens // self.block_size)
        if num_blocks > self.num_gpu_blocks - self.watermark_blocks:
            return _NEVER
        need = num_blocks - len(hits) + sum(
            hit.on_host or self._cache.is_evictable(hit.block) for hit in hits)
        return _OK if self.num_free_blocks - need >= self.watermark_blocks else _LATER

    def _take(self, n: int) -> list[int]:
        """n blocks off the free stack, then least recently used cached ones, each with
        one reference. The caller has checked that they exist."""
        taken = []
        for _ in range(n):
            block = self._free.pop() if self._free else self._cache.evict()
            self._refs[block] = 1
            taken.append(block)
        return taken

    def _unreferenced(self, block: int) -> None:
        """A GPU block lost its last reference: cached, it becomes evictable; else free."""
        if self._cache is not None and self._cache.holds(block):
            self._cache.park(block)
        else:
            self._free.append(block)

    def _token_slots_used(self) -> int:
        return sum(self._fills().values())

    def _fills(self) -> dict[int, int]:
        """Referenced GPU block -> token slots filled (sharers agree)."""
        fills: dict[int, int] = {}
        for seq in self._seqs.values():
            if seq.on_gpu:
                for i, b in enumerate(seq.blocks):
                    fills[b] = min(self.block_size, seq.num_tokens - i * self.block_size)
        return fills


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading blocks two block tables share."""
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


register_block_manager("paged", PagedBlockManager.from_config)
