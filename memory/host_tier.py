"""The host-memory (CPU) tier of the prefix cache.

A GPU prefix cache holds a few hundred thousand tokens; on a long-prompt trace most reuse
comes back after its blocks were evicted. Real engines (Mooncake, LMCache, SGLang's
HiCache, vLLM's CPU offloading) keep evicted prefix blocks in host memory instead. Here a
block evicted from the GPU cache is copied to a host block (an *offload*), its entry
moving with it, id included; a later hit on it copies it back into a fresh GPU block
before the request's prefill (a *load*), the entry moving back. Each cached content sits
in one tier at a time (a GPU commit of a content the host holds drops the host copy). The
host tier evicts least recently used first, like the GPU cache. Its blocks are its own
pool: the swap pool's accounting is separate.

The block manager asks for the copies (`take_transfers`) once per engine step, and the
executor performs them before anything else in that step: offloads first (they read GPU
blocks about to be reused), then, after swaps, loads. Within one step's worth of calls:

- a host block that was loaded from is not reused until the copies are taken (it waits
  in `pending_free`), so an offload cannot overwrite it before the load reads it;
- an offload into a host block whose entry is evicted again in the same step is dropped
  (nothing will read it);
- a GPU block whose pending load has not happened yet and is evicted again gives its
  entry back to the host block it came from (no copy either way).

Copy-on-write copies run last, after the loads, so a block freed during a step may still
be the source (or target) of one of that step's copies: a step that frees a sequence
after a copy-on-write must not then swap in or allocate blocks that a load writes. The
scheduler keeps to this, since a step that preempted anything admits nothing and swaps
nothing in; the host-tier state machine in the tests does the same.

Costs: O(1) per block moved. An eviction is offloaded in bulk: its entries come as
columns, the host blocks are taken with slices and one LRU pop, entered with one dict
update and one loop of stores, and parked as one LRU segment; one entry at a time only
when the eviction overflows the tier, or a hash collision repeats a hash in it or in the
tier.
"""
from __future__ import annotations

from typing import Hashable

from .lru import BlockLRU
from .prefix_cache import CacheIndex, Entries, Entry, PrefixCache


class HostTier:
    """Prefix blocks in host memory: an index, an LRU order, a free list and the copies
    not yet handed to the executor."""

    __slots__ = ("num_blocks", "index", "_lru", "_free", "_pending_free", "_offloads",
                 "_loads", "_gpu", "offloaded", "loaded")

    def __init__(self, num_blocks: int, gpu: PrefixCache) -> None:
        self.num_blocks = num_blocks
        self.index = CacheIndex(num_blocks)
        self._lru = BlockLRU(num_blocks)
        """Host blocks holding an entry, least recently used first (all of them: no
        sequence references a host block)."""
        self._free = list(range(num_blocks - 1, -1, -1))
        self._pending_free: dict[int, None] = {}
        """Host blocks loaded from since the copies were last taken (reusable after)."""
        self._offloads: dict[int, int] = {}
        """host block -> GPU block: copies GPU -> host not yet taken."""
        self._loads: dict[int, int] = {}
        """GPU block -> host block: copies host -> GPU not yet taken."""
        self._gpu = gpu
        self.offloaded = 0
        """Blocks copied to the host so far (offloads taken, cancelled ones excluded)."""
        self.loaded = 0

    # ------------------------------------------------------------------ queries
    def find(self, h: int, parent_id: int, content: Hashable) -> int | None:
        return self.index.find(h, parent_id, content)

    def entry_id(self, block: int) -> int:
        return self.index.entry_id[block]

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    # ------------------------------------------------------------------ moves
    def load(self, host_block: int) -> Entry:
        """Take a hit's entry out (the caller adopts it into a GPU block and calls
        `loading`); the host block is reused only after the copies are taken."""
        self._lru.remove(host_block)
        self._pending_free[host_block] = None
        return self.index.take(host_block)

    def loading(self, gpu_block: int, host_block: int) -> None:
        self._loads[gpu_block] = host_block

    def dropped(self, gpu_block: int) -> None:
        """A GPU block's entry was forgotten (a commit took its hash) and the block
        freed: a load into it not yet performed is cancelled, with an offload into its
        host block not yet performed either (it only fed that load), and the host block,
        which nothing will read now, is free at once."""
        hb = self._loads.pop(gpu_block, None)
        if hb is not None:
            del self._pending_free[hb]
            self._offloads.pop(hb, None)
            self._free.append(hb)

    def store(self, gpu_blocks: list[int], entries: Entries) -> None:
        """Entries evicted from the GPU (LRU first) with the blocks they leave. A block
        whose own load is still pending hands its entry back to its host block; the
        others are offloaded, newest in the host LRU order. When one eviction is larger
        than the tier, its newest entries are the ones kept (a sequence's head, released
        after its tail), as an LRU keeps them.

        In bulk when the free and parked host blocks suffice (the common case): host
        blocks are taken as `_take_block` would take them one by one (free ones from
        the top of the stack, then the least recently used), entered with one
        `put_many` and parked as one segment."""
        loads = self._loads
        back = None   # tested in C first: a load is rarely evicted in its own step
        if loads and not loads.keys().isdisjoint(gpu_blocks):
            back = [loads.pop(gb, None) for gb in gpu_blocks]
        need = len(gpu_blocks) if back is None else back.count(None)
        if need > len(self._free) + len(self._lru) \
                or not self.index.block_of_hash.keys().isdisjoint(entries.hashes) \
                or len(set(entries.hashes)) != len(entries.hashes):   # GPU hash collisions
            self._store_each(gpu_blocks, entries, back)
            return
        free, offloads = self._free, self._offloads
        k = min(need, len(free))
        fresh = free[:-k - 1:-1]   # top of the stack first
        del free[len(free) - k:]
        if need > k:
            old = self._lru.pop_oldest(need - k)
            self.index.drop(old)
            if offloads and not offloads.keys().isdisjoint(old):
                for hb in old:
                    offloads.pop(hb, None)
            fresh += old
        if back is None:
            host_blocks = fresh
            offloads.update(zip(fresh, gpu_blocks))
        else:
            host_blocks = []
            taken = iter(fresh)
            for gb, hb in zip(gpu_blocks, back):
                if hb is None:
                    hb = next(taken)
                    offloads[hb] = gb
                else:   # loaded and evicted in one step: nothing moved yet
                    del self._pending_free[hb]
                host_blocks.append(hb)
        self.index.put_many(host_blocks, entries)
        self._lru.park(host_blocks)
        self._gpu.notify_host(entries.hashes)

    def _store_each(self, gpu_blocks: list[int], entries: Entries, back: list | None) -> None:
        """`store` one entry at a time: an eviction larger than the free and parked host
        blocks (it then evicts its own oldest entries), or one whose hashes the tier
        already holds. `back`: each GPU block's host block when its load was pending."""
        parked = []
        for i, gb in enumerate(gpu_blocks):
            hb = back[i] if back is not None else None
            if hb is not None:    # loaded and evicted in one step: nothing moved yet
                del self._pending_free[hb]
            else:
                hb = self._take_block()
                if hb is None and parked:   # full of this call's own entries: LRU among them
                    self._lru.park(parked)
                    parked = []
                    hb = self._take_block()
                if hb is None:    # every host block waits for a load: drop the entry
                    continue
                self._offloads[hb] = gb
            h = entries.hashes[i]
            other = self.index.block_of_hash.get(h)
            if other is not None:   # the newer copy of this hash wins
                if other in parked:   # this call's own (a hash the GPU held twice)
                    parked.remove(other)
                    self.index.drop([other])
                    self._offloads.pop(other, None)
                    self._free.append(other)
                else:
                    self._discard(other)
            self.index.put(hb, (h, entries.ids[i], entries.parent_ids[i], entries.contents[i]))
            parked.append(hb)
        self._lru.park(parked)
        self._gpu.notify_host(entries.hashes)

    def discard_hashes(self, hashes: list[int]) -> None:
        """Drop host entries under these hashes (the GPU just committed them)."""
        by_hash = self.index.block_of_hash
        if by_hash.keys().isdisjoint(hashes):   # the common case, tested in C
            return
        for h in hashes:
            hb = by_hash.get(h)
            if hb is not None:
                self._discard(hb)

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies since the last call: (GPU block, host block) offloads, then
        (host block, GPU block) loads. Host blocks loaded from become free again."""
        offloads = list(zip(self._offloads.values(), self._offloads))
        loads = list(zip(self._loads.values(), self._loads))
        self._offloads.clear()
        self._loads.clear()
        if self._pending_free:
            self._free += self._pending_free
            self._pending_free.clear()
        self.offloaded += len(offloads)
        self.loaded += len(loads)
        return offloads, loads

    def _take_block(self) -> int | None:
        """A host block for an offload: a free one, else the least recently used (its
        entry is forgotten; a pending offload into it is dropped); None when no host
        block is free or parked in the LRU (the rest wait for a load to read them, or
        were just filled and are not parked yet)."""
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        hb, = self._lru.pop_oldest(1)
        self.index.drop([hb])
        self._offloads.pop(hb, None)
        return hb

    def _discard(self, hb: int) -> None:
        self._lru.remove(hb)
        self.index.drop([hb])
        self._offloads.pop(hb, None)
        self._free.append(hb)

    # ------------------------------------------------------------------ checks
    def check_invariants(self, gpu_entries: set) -> None:
        """Raise AssertionError unless host blocks are conserved (free + holding an
        entry + waiting to be free = all, disjoint), the LRU holds exactly the blocks
        with entries, pending copies name blocks in the right state, and no content is
        cached in both tiers (`gpu_entries`: (hash, parent id, content) of every GPU
        entry; under a hash collision, other content may share a hash across tiers)."""
        cached = self.index.check()
        self._lru.check(cached)
        free, pending = set(self._free), set(self._pending_free)
        if len(free) != len(self._free):
            raise AssertionError("host free list holds a block twice")
        if free & set(cached) or pending & set(cached) or free & pending:
            raise AssertionError("a host block is both free (or waiting to be) and holding an entry")
        if len(free) + len(pending) + len(cached) != self.num_blocks:
            raise AssertionError(f"host blocks: {len(free)} free + {len(pending)} pending + "
                                 f"{len(cached)} cached != {self.num_blocks}")
        if not set(self._offloads) <= set(cached) | pending:   # pending: loaded after it
            raise AssertionError("a pending offload targets a host block without an entry")
        if set(self._loads.values()) != pending:
            raise AssertionError("pending loads and host blocks waiting to be free disagree")
        for h, hb in self.index.block_of_hash.items():
            if (h, self.index.parent_id[hb], self.index.content[hb]) in gpu_entries:
                raise AssertionError(f"hash {h} is cached on the GPU and on the host")
