"""The prefix cache of the plain paged block manager (memory/paged.py), one block at a time.

A full GPU block whose tokens are known can be *committed*: it gets an entry under the
chained hash of its content, h_i = hash((h_{i-1}, content_i)), so one hash names a block
and everything before it. A new sequence reuses the longest run of leading blocks found
this way. Hashes only find candidates: each entry also carries a unique id (never
reused) and its parent entry's id, and a hit at position i needs the candidate's parent
to be the entry matched at i - 1 and its content to compare equal, so by induction a hit
is the same contents from the first block on and a hash collision is a miss, never a
wrong reuse (nano-vllm's block manager checks hash and token ids the same way). Committed
blocks nobody references stay cached, least recently used first, until the manager needs
a block and its free list is empty; with a host tier (memory/host_tier.py) an evicted
entry moves there.

The simulator's speed layer keeps the same entries in runs of blocks
(simulator/speed/prefix_runs.py); tests/test_plain_paged.py checks that both decide
alike. Costs: every operation is O(1) dict/OrderedDict steps per block involved.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable, NamedTuple, Sequence

from servelab.request import RegionOffset

if TYPE_CHECKING:
    from .host_tier import HostTier

__all__ = ["Entry", "Hit", "PrefixCache", "chain_hashes"]


def chain_hashes(keys: Sequence[Hashable]) -> list[int]:
    """The chain hash of each key's block: hash((previous hash, key)), None before the
    first. A `RegionOffset` j at position p >= j (the j-th block after its region's first,
    in a trace that names content per region) hashes as the region's first block's hash
    plus j, the rule simulator/speed/block_keys.py defines, so both managers compute the same
    hashes. O(len(keys))."""
    hashes: list[int] = []
    for pos, key in enumerate(keys):
        if type(key) is RegionOffset and 0 < key <= pos:
            hashes.append(hashes[pos - key] + key)
        else:
            hashes.append(hash((hashes[-1] if hashes else None, key)))
    return hashes


@dataclass(slots=True, frozen=True)
class Entry:
    """What a cached block holds: its chain hash, a unique id, its parent's id (0 for a
    sequence's first block) and its content key."""

    hash: int
    id: int
    parent_id: int
    content: Hashable


class Hit(NamedTuple):
    """One matched leading block: a GPU block id, or a host block id when `on_host`."""

    block: int
    on_host: bool


class PrefixCache:
    """GPU blocks by chain hash, with an LRU list of the evictable ones.

    The block manager owns the free list and the reference counts; it tells the cache
    when a cached block is referenced again (`revive`) or loses its last reference
    (`park`), and takes the least recently used one when its free list is empty
    (`evict`)."""

    def __init__(self, host: HostTier | None = None) -> None:
        self.host = host
        self._by_hash: dict[int, int] = {}         # chain hash -> GPU block
        self._entries: dict[int, Entry] = {}       # GPU block -> its entry
        self._lru: OrderedDict[int, None] = OrderedDict()   # evictable, least recent first
        self._next_id = 1

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def holds(self, block: int) -> bool:
        return block in self._entries

    def is_evictable(self, block: int) -> bool:
        return block in self._lru

    def evictable_blocks(self) -> list[int]:
        """Least recently used (next evicted) first."""
        return list(self._lru)

    def entries(self) -> dict[int, Entry]:
        """GPU block -> entry (a copy, for checks)."""
        return dict(self._entries)

    def match(self, hashes: Sequence[int], keys: Sequence[Hashable], max_blocks: int) -> tuple[list[Hit], int]:
        """The cached leading blocks (at most `max_blocks`), from the GPU where it has
        them, else from the host tier, and the last one's entry id (0: none). A peek."""
        hits: list[Hit] = []
        parent_id = 0
        for i in range(min(max_blocks, len(keys))):
            block = self._by_hash.get(hashes[i])
            entry = self._entries[block] if block is not None else None
            if entry is not None and entry.parent_id == parent_id and entry.content == keys[i]:
                hits.append(Hit(block, False))
            elif self.host is not None \
                    and (found := self.host.find(hashes[i], parent_id, keys[i])) is not None:
                block, entry = found
                hits.append(Hit(block, True))
            else:
                break
            parent_id = entry.id
        return hits, parent_id

    def revive(self, block: int) -> None:
        """A hit references cached `block` again: it is no longer evictable."""
        self._lru.pop(block, None)

    def park(self, block: int) -> None:
        """Cached `block` lost its last reference: it becomes the most recently used
        evictable block."""
        self._lru[block] = None

    def evict(self) -> int:
        """Forget the least recently used evictable block and return it; its entry goes
        to the host tier, if any. The caller has checked that there is one."""
        block, _ = self._lru.popitem(last=False)
        entry = self._forget(block)
        if self.host is not None:
            self.host.store(block, entry)
        return block

    def adopt(self, block: int, entry: Entry, host_block: int) -> None:
        """`entry`, taken out of the host tier (`HostTier.load`), now belongs to the
        referenced GPU `block`, which `host_block` is copied into."""
        self._entries[block] = entry
        self._by_hash[entry.hash] = block
        self.host.loading(block, host_block)

    def commit(self, block: int, chain_hash: int, parent_id: int, content: Hashable) -> tuple[int | None, int | None]:
        """Enter referenced `block` with this content after entry `parent_id`. Returns
        (the entry id the chain continues from, or None if it stops; a GPU block to put
        on the free list, or None). An equal entry elsewhere continues the chain and
        `block` stays uncached; an evictable entry under the hash is dropped (its block
        is freed); a referenced one with other content stops the chain."""
        freed = None
        other = self._by_hash.get(chain_hash)
        if other is not None:
            entry = self._entries[other]
            if entry.parent_id == parent_id and entry.content == content:
                return entry.id, None
            if other not in self._lru:
                return None, None
            del self._lru[other]
            self._forget(other)
            if self.host is not None:
                self.host.dropped(other)
            freed = other
        if self.host is not None:
            self.host.discard(chain_hash)   # one tier at a time
        entry = Entry(chain_hash, self._next_id, parent_id, content)
        self._next_id += 1
        self._entries[block] = entry
        self._by_hash[chain_hash] = block
        return entry.id, freed

    def _forget(self, block: int) -> Entry:
        entry = self._entries.pop(block)
        del self._by_hash[entry.hash]
        return entry
