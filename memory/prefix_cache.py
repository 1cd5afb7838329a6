"""The prefix cache of the paged block manager.

A full GPU block whose tokens are known can be *committed*: it is entered under the
chained hash of its content, h_i = chain_hash(h_{i-1}, content_i), so one hash names a
block's content *and* everything before it. A new sequence then reuses the longest run
of leading blocks found this way instead of recomputing them.

Hashes only find candidates; they never decide a hit. Each committed block carries an
entry: a unique id (never reused, so a stale parent cannot match), the id of its parent
entry and its content; a hit at position i requires the candidate's parent id to equal
the entry matched at i - 1 and its content to compare equal. By induction a hit means
the same contents all the way from the first block, so a hash collision is a miss,
never a wrong reuse.

Committed blocks nobody references are *evictable*: they stay cached, in least- to
most-recently-used order, until the manager needs a block and its free list is empty.
The set is an `OrderedDict` (a hash map over a doubly linked list): parking a block at
the most-recently-used end, removing one from the middle on a hit and evicting the
least recently used are all O(1).

The manager owns the free list and the reference counts. It hands the cache blocks
that just lost their last reference (`release`: committed ones are parked, the rest go
back to the free list), blocks a hit revives (`touch`), and asks for the least recently
used ones when its free list runs dry (`evict`).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence


def chain_hash(parent_hash: int | None, content: Hashable) -> int:
    """Hash of a full block from its content and the hash of the block before it
    (None for a sequence's first block). Looked up as a module attribute on every
    call, so a test can replace it to force collisions."""
    return hash((parent_hash, content))


@dataclass(slots=True, frozen=True)
class PrefixMatch:
    """The longest cached run of leading blocks for some block contents."""

    blocks: list[int]
    last_hash: int | None
    """Chained hash of the last matched block (None when nothing matched)."""
    last_entry_id: int
    """Entry id of the last matched block (0 when nothing matched)."""


NO_MATCH = PrefixMatch([], None, 0)


@dataclass(slots=True, frozen=True)
class ChainLink:
    """Where a sequence's committed chain stands after `PrefixCache.commit`."""

    num_committed: int
    """Leading blocks now in the chain."""
    last_hash: int | None
    last_entry_id: int
    broken: bool
    """A collision stopped the chain at block num_committed."""


class PrefixCache:
    """Chained-hash index over committed GPU blocks plus their LRU eviction order.

    One block per hash: committing content that another block already holds under the
    same prefix leaves the new block uncached and continues the chain through the
    existing entry (see `commit`).
    """

    __slots__ = ("_block_of_hash", "_hash", "_entry_id", "_parent_id", "_content",
                 "_evictable", "_next_entry_id")

    def __init__(self, num_blocks: int) -> None:
        self._block_of_hash: dict[int, int] = {}
        # The entry of each block, as parallel per-block arrays (committing a block
        # then costs four list stores rather than an object): its hash (None while
        # the block is not cached), its id, its parent's id (0 for a first block) and
        # its content.
        self._hash: list[int | None] = [None] * num_blocks
        self._entry_id = [0] * num_blocks
        self._parent_id = [0] * num_blocks
        self._content: list[Hashable] = [None] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()
        """Unreferenced committed blocks; least recently used first."""
        self._next_entry_id = 1

    # ------------------------------------------------------------------ lookups
    def match(self, contents: Sequence[Hashable], max_blocks: int) -> PrefixMatch:
        """Cached blocks for the leading `contents`, at most `max_blocks` of them.

        O(matched blocks): one hash, one dict probe and one content comparison per
        block. A peek: it changes neither the LRU order nor any statistic.
        """
        by_hash = self._block_of_hash
        parent_ids, stored, entry_ids = self._parent_id, self._content, self._entry_id
        chain = chain_hash
        h: int | None = None
        parent_id = 0
        blocks: list[int] = []
        for content in contents[:max_blocks]:
            h_next = chain(h, content)
            block = by_hash.get(h_next)
            if block is None:
                break
            if parent_ids[block] != parent_id or stored[block] != content:
                break  # a hash collision: different content or a different prefix
            blocks.append(block)
            h = h_next
            parent_id = entry_ids[block]
        if not blocks:
            return NO_MATCH
        return PrefixMatch(blocks, h, parent_id)

    def is_cached(self, block: int) -> bool:
        return self._hash[block] is not None

    def block_hash(self, block: int) -> int | None:
        """The chain hash a block is cached under, or None."""
        return self._hash[block]

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    # ------------------------------------------------------------------ updates
    def commit(self, blocks: Sequence[int], contents: Sequence[Hashable], start: int,
               end: int, parent_hash: int | None, parent_id: int, free: list[int]) -> ChainLink:
        """Enter full, computed blocks[start:end] (contents[i] is block i's content),
        continuing a chain whose block start - 1 has `parent_hash` / `parent_id`.
        O(end - start): one hash and one dict probe per block.

        If a block's hash is free, the block gets a new entry. If it names a block with
        the same parent and content (another sequence computed the same prefix), that
        entry continues the chain and this block stays uncached. Otherwise the hash is
        held by other content: a collision, or an orphan (a block whose parent was
        evicted, unreachable from now on). An unreferenced holder is dropped (onto
        `free`) and the block takes its place; a referenced one stops the chain, since
        nothing from there on could be found: the link says `broken`.
        """
        by_hash = self._block_of_hash
        hashes, entry_ids = self._hash, self._entry_id
        parent_ids, stored = self._parent_id, self._content
        chain = chain_hash
        entry_id = self._next_entry_id
        h = parent_hash
        for i in range(start, end):
            content = contents[i]
            h_next = chain(h, content)
            other = by_hash.get(h_next)
            if other is not None:
                if parent_ids[other] == parent_id and stored[other] == content:
                    parent_id = entry_ids[other]
                    h = h_next
                    continue
                if other not in self._evictable:
                    self._next_entry_id = entry_id
                    return ChainLink(i, h, parent_id, True)
                del self._evictable[other]
                hashes[other] = stored[other] = None
                free.append(other)
            block = blocks[i]
            by_hash[h_next] = block
            hashes[block] = h_next
            entry_ids[block] = entry_id
            parent_ids[block] = parent_id
            stored[block] = content
            parent_id = entry_id
            entry_id += 1
            h = h_next
        self._next_entry_id = entry_id
        return ChainLink(end, h, parent_id, False)

    def release(self, blocks: Iterable[int], free: list[int]) -> None:
        """Blocks that just lost their last reference, in order: committed ones become
        the most recently used evictable blocks, the others go onto `free`. O(1) each."""
        hashes = self._hash
        evictable = self._evictable
        for b in blocks:
            if hashes[b] is None:
                free.append(b)
            else:
                evictable[b] = None

    def touch(self, block: int) -> None:
        """An evictable block was hit: it is referenced again, so not evictable. O(1)."""
        del self._evictable[block]

    def evict(self, n: int) -> list[int]:
        """Forget the n least recently used evictable blocks and return them, LRU
        first. O(1) each; the caller has checked that there are n."""
        popitem = self._evictable.popitem
        hashes, stored = self._hash, self._content
        by_hash = self._block_of_hash
        out = []
        for _ in range(n):
            block, _ = popitem(last=False)
            del by_hash[hashes[block]]
            hashes[block] = None
            stored[block] = None  # drop the reference to the content key
            out.append(block)
        return out

    def evictable_blocks(self) -> list[int]:
        """Evictable blocks, least recently used first (for tests and invariants)."""
        return list(self._evictable)

    # ------------------------------------------------------------------ checks
    def check_invariants(self, refcounts: Sequence[int]) -> None:
        """Raise AssertionError unless the hash index and the entries agree and the
        evictable blocks are exactly the committed blocks with no references."""
        for h, block in self._block_of_hash.items():
            if self._hash[block] != h:
                raise AssertionError(f"hash {h} maps to block {block}, which is not cached under it")
        cached = [b for b, h in enumerate(self._hash) if h is not None]
        if len(cached) != len(self._block_of_hash):
            raise AssertionError(f"{len(cached)} cached blocks but {len(self._block_of_hash)} hashes")
        unreferenced = {b for b in cached if refcounts[b] == 0}
        if unreferenced != set(self._evictable):
            raise AssertionError(f"evictable set {sorted(self._evictable)} differs from the "
                                 f"unreferenced cached blocks {sorted(unreferenced)}")
        ids = [self._entry_id[b] for b in cached]
        if len(set(ids)) != len(ids) or any(i >= self._next_entry_id for i in ids):
            raise AssertionError("cache entry ids are not unique")
