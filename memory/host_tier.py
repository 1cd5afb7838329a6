"""The host (CPU) tier of the plain prefix cache (memory/prefix_cache.py), one block at a time.

The tier keeps blocks the GPU cache evicted: the entry moves to a host block (an
*offload* copy) and a later hit copies it back into a fresh GPU block (a *load*). Each
content sits in one tier at a time. The GPU cache talks to the tier in one direction
only, by calls with plain values (`store`, `find`, `load`, `loading`, `dropped`,
`discard`); the tier never calls back, and the block manager collects the copies once per
engine step (`take_transfers`). Within one step's calls: a host block loaded from is not
reused until the copies are taken; an offload whose entry leaves the tier again is
dropped; a GPU block whose load is pending and is evicted again gives its entry back to
the host block it came from.

The simulator's speed layer keeps the same entries in runs of blocks
(simulator/speed/host_runs.py); tests/test_plain_paged.py checks that both decide alike.
Costs: O(1) dict/OrderedDict steps per block involved.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

from .base import invariant
from .prefix_cache import Entry

__all__ = ["HostTier"]


class HostTier:
    """Evicted prefix blocks kept in host memory: host blocks by chain hash, an LRU list,
    a free stack, and the copies pending until `take_transfers`."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))   # host block 0 is taken first
        self._by_hash: dict[int, int] = {}
        self._entries: dict[int, Entry] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._pending_free: list[int] = []     # loaded from: reusable once copies are taken
        self._offloads: dict[int, int] = {}    # host block -> GPU block it copies
        self._loads: dict[int, int] = {}       # GPU block -> host block it copies
        self.offloaded = 0
        """Offload copies taken so far (dropped ones not counted)."""
        self.loaded = 0

    @property
    def num_cached(self) -> int:
        return len(self._entries)

    def entries(self) -> dict[int, Entry]:
        return dict(self._entries)

    def find(self, chain_hash: int, parent_id: int, content: Hashable) -> tuple[int, Entry] | None:
        """The host block and entry of this chain position, if cached here. A peek."""
        block = self._by_hash.get(chain_hash)
        if block is None:
            return None
        entry = self._entries[block]
        if entry.parent_id != parent_id or entry.content != content:
            return None
        return block, entry

    def load(self, block: int) -> Entry:
        """A hit takes host `block`'s entry out of the tier; the block is copied to the
        GPU (`loading` says where) and reused once the copies are taken."""
        entry = self._forget(block)
        self._pending_free.append(block)
        return entry

    def loading(self, gpu_block: int, block: int) -> None:
        self._loads[gpu_block] = block

    def store(self, gpu_block: int, entry: Entry) -> None:
        """GPU block `gpu_block` was evicted with `entry`: keep it here, in a free host
        block, else in the least recently used one's; dropped if every host block waits
        for a load."""
        block = self._loads.pop(gpu_block, None)
        if block is not None:   # loaded and evicted within one step: nothing moved yet
            self._pending_free.remove(block)
        elif self._free:
            block = self._free.pop()
            self._offloads[block] = gpu_block
        elif self._lru:
            block, _ = self._lru.popitem(last=False)
            self._forget(block)
            self._offloads.pop(block, None)   # its own offload, if pending, is moot
            self._offloads[block] = gpu_block
        else:
            return
        self._entries[block] = entry
        self._by_hash[entry.hash] = block
        self._lru[block] = None

    def dropped(self, gpu_block: int) -> None:
        """The GPU cache dropped `gpu_block`'s entry: a load into it is cancelled."""
        block = self._loads.pop(gpu_block, None)
        if block is not None:
            self._pending_free.remove(block)
            self._offloads.pop(block, None)
            self._free.append(block)

    def discard(self, chain_hash: int) -> None:
        """The GPU cache committed this hash: the host copy, if any, goes."""
        block = self._by_hash.get(chain_hash)
        if block is not None:
            self._forget(block)
            self._offloads.pop(block, None)
            self._free.append(block)

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies since the last call: (GPU, host) offloads and (host, GPU) loads.
        Host blocks loaded from become free."""
        offloads = [(gpu, host) for host, gpu in self._offloads.items()]
        loads = [(host, gpu) for gpu, host in self._loads.items()]
        self._offloads.clear()
        self._loads.clear()
        self._free += self._pending_free
        self._pending_free.clear()
        self.offloaded += len(offloads)
        self.loaded += len(loads)
        return offloads, loads

    def check_invariants(self) -> None:
        """Every host block is exactly one of free, pending free, or cached; the index
        and LRU name exactly the cached blocks."""
        cached = set(self._entries)
        pools = sorted(self._free) + sorted(self._pending_free) + sorted(cached)
        invariant(sorted(pools) == list(range(self.num_blocks)), "host blocks are lost or doubled")
        invariant(set(self._lru) == cached, "host LRU differs from the cached blocks")
        invariant({e.hash: b for b, e in self._entries.items()} == self._by_hash,
                  "host hash index differs from the entries")
        invariant(set(self._offloads) <= cached | set(self._pending_free),
                  "an offload targets a free host block")
        invariant(set(self._loads.values()) <= set(self._pending_free),
                  "a load reads a host block not waiting for it")

    def _forget(self, block: int) -> Entry:
        entry = self._entries.pop(block)
        del self._by_hash[entry.hash]
        self._lru.pop(block, None)
        return entry
