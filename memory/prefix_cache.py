"""The prefix cache of the paged block manager.

A full GPU block whose tokens are known can be *committed*: it is entered under the
chained hash of its content, h_i = chain_hash(h_{i-1}, content_i), so one hash names a
block's content *and* everything before it. A new sequence then reuses the longest run
of leading blocks found this way instead of recomputing them. The hashes come with the
keys (`BlockKeys`), computed once per sequence.

Hashes only find candidates; they never decide a hit. Each committed block carries an
entry: a unique id (never reused, so a stale parent cannot match), the id of its parent
entry and its content; a hit at position i requires the candidate's parent id to equal
the entry matched at i - 1 and its content to compare equal. By induction a hit means
the same contents all the way from the first block, so a hash collision is a miss,
never a wrong reuse. `CacheIndex` holds the entries; the host tier (`host_tier.py`) keeps
a second one, and an entry moves between them whole, id included.

Committed blocks nobody references are *evictable*: they stay cached, in least- to
most-recently-used order (`BlockLRU`), until the manager needs a block and its free list
is empty.

The manager owns the free list and the reference counts. It hands the cache blocks
that just lost their last reference (`release`: committed ones are parked, the rest go
back to the free list), blocks a hit revives (`touch`), and asks for the least recently
used ones when its free list runs dry (`evict`).

Cost: work is per block, but done in bulk where it can be: a run of blocks committed
for the first time is entered with one `dict.update` and one loop of list stores;
parking and evicting go through `BlockLRU` (list slices); releasing splits the blocks
with one comprehension.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable, Iterable, Sequence

from .lru import BlockLRU

if TYPE_CHECKING:
    from .block_keys import BlockKeys
    from .host_tier import HostTier


def chain_hash(parent_hash: int | None, content: Hashable) -> int:
    """Hash of a full block from its content and the hash of the block before it
    (None for a sequence's first block): an int in the signed 64-bit range, as `hash`
    gives. `BlockKeys` looks it up as a module attribute whenever it hashes, so a test
    can replace it to force collisions."""
    return hash((parent_hash, content))


Entry = tuple[int, int, int, Hashable]
"""A committed block's entry: (chain hash, entry id, parent entry id, content)."""


@dataclass(slots=True, frozen=True)
class Entries:
    """Several entries as parallel columns, in their blocks' order: what an eviction
    moves to the host tier in bulk."""

    hashes: list[int]
    ids: list[int]
    parent_ids: list[int]
    contents: list[Hashable]


@dataclass(slots=True, frozen=True)
class PrefixMatch:
    """The longest cached run of leading blocks for some block contents."""

    blocks: list[int]
    """GPU block ids, except at `on_host` positions: host-tier block ids."""
    last_entry_id: int
    """Entry id of the last matched block (0 when nothing matched)."""
    on_host: tuple[int, ...] = ()
    """Positions (indices into `blocks`) whose entry is in the host tier."""


NO_MATCH = PrefixMatch([], 0)


@dataclass(slots=True, frozen=True)
class ChainLink:
    """Where a sequence's committed chain stands after `PrefixCache.commit`."""

    num_committed: int
    """Leading blocks now in the chain."""
    last_entry_id: int
    broken: bool
    """A collision stopped the chain at block num_committed."""


class CacheIndex:
    """Entries by block, and the block of each chain hash (one block per hash).

    The entry of each block is kept in parallel per-block sequences (entering a block
    costs four stores, not an object): its hash (None while the block holds no entry),
    its id, its parent's id (0 for a first block) and its content. The ids are machine
    integers in `array`s: a store into a list frees the int object it replaces, one that
    was made long ago and is no longer in the CPU's caches, and on a long-prompt trace
    those misses cost more than the array's conversions (a sixth of committing)."""

    __slots__ = ("block_of_hash", "hash", "entry_id", "parent_id", "content")

    def __init__(self, num_blocks: int) -> None:
        self.block_of_hash: dict[int, int] = {}
        self.hash: list[int | None] = [None] * num_blocks
        self.entry_id = array("q", bytes(8 * num_blocks))
        self.parent_id = array("q", bytes(8 * num_blocks))
        self.content: list[Hashable] = [None] * num_blocks

    def find(self, h: int, parent_id: int, content: Hashable) -> int | None:
        """The block holding (parent, content) under hash h, or None (a collision too)."""
        block = self.block_of_hash.get(h)
        if block is None or self.parent_id[block] != parent_id or self.content[block] != content:
            return None
        return block

    def put(self, block: int, entry: Entry) -> None:
        """Enter `entry` for `block`; its hash must be free in this index."""
        h, eid, pid, content = entry
        self.block_of_hash[h] = block
        self.hash[block], self.entry_id[block] = h, eid
        self.parent_id[block], self.content[block] = pid, content

    def take(self, block: int) -> Entry:
        """Remove and return the entry of `block`."""
        h = self.hash[block]
        entry = (h, self.entry_id[block], self.parent_id[block], self.content[block])
        del self.block_of_hash[h]
        self.hash[block] = self.content[block] = None
        return entry

    def take_many(self, blocks: list[int]) -> Entries:
        """Remove and return the entries of `blocks` (each holds one), in their order.
        O(blocks), the columns read in C."""
        out = Entries(list(map(self.hash.__getitem__, blocks)),
                      list(map(self.entry_id.__getitem__, blocks)),
                      list(map(self.parent_id.__getitem__, blocks)),
                      list(map(self.content.__getitem__, blocks)))
        self.drop(blocks)
        return out

    def put_many(self, blocks: list[int], entries: Entries) -> None:
        """Enter entries[i] for blocks[i]; their hashes must be distinct and free in this
        index. O(blocks)."""
        by_hash = self.block_of_hash
        size = len(by_hash)
        by_hash.update(zip(entries.hashes, blocks))
        if len(by_hash) - size != len(blocks):
            raise AssertionError("put_many: a hash is taken or repeated")
        hashes, entry_ids, parent_ids, stored = self.hash, self.entry_id, self.parent_id, self.content
        for b, h, eid, pid, content in zip(blocks, entries.hashes, entries.ids,
                                           entries.parent_ids, entries.contents):
            hashes[b] = h
            entry_ids[b] = eid
            parent_ids[b] = pid
            stored[b] = content

    def drop(self, blocks: list[int]) -> None:
        """Remove the entries of `blocks` (each holds one). O(blocks)."""
        by_hash, hashes, stored = self.block_of_hash, self.hash, self.content
        for b in blocks:
            del by_hash[hashes[b]]
            hashes[b] = stored[b] = None  # drop the reference to the content key

    def check(self) -> list[int]:
        """Raise AssertionError unless the hash map and the entries agree; returns the
        blocks holding an entry."""
        for h, block in self.block_of_hash.items():
            if self.hash[block] != h:
                raise AssertionError(f"hash {h} maps to block {block}, which is not cached under it")
        cached = [b for b, h in enumerate(self.hash) if h is not None]
        if len(cached) != len(self.block_of_hash):
            raise AssertionError(f"{len(cached)} cached blocks but {len(self.block_of_hash)} hashes")
        return cached


class Watch:
    """Raised flag for a set of chain hashes: `dirty` turns True when an entry is put
    under one of them (see `PrefixCache.watch`)."""

    __slots__ = ("hashes", "dirty")

    def __init__(self, hashes: Iterable[int]) -> None:
        self.hashes = set(hashes)
        self.dirty = False


class PrefixCache(CacheIndex):
    """Chained-hash index over committed GPU blocks plus their LRU eviction order.

    One block per hash: committing content that another block already holds under the
    same prefix leaves the new block uncached and continues the chain through the
    existing entry (see `commit`).
    """

    __slots__ = ("_lru", "_next_entry_id", "_watches", "host")

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._lru = BlockLRU(num_blocks)
        """Unreferenced committed blocks; least recently used first."""
        self._next_entry_id = 1
        self._watches: list[Watch] = []
        self.host: HostTier | None = None
        """The host-memory tier behind this cache, if any (set by the block manager)."""

    # ------------------------------------------------------------------ lookups
    def match(self, keys: BlockKeys, max_blocks: int) -> PrefixMatch:
        """Cached blocks for the leading `keys`, at most `max_blocks` of them.

        O(matched blocks): one dict probe and one content comparison per block (the
        chain hashes come with the keys). A peek: it changes neither the LRU order nor
        any statistic.
        """
        by_hash = self.block_of_hash
        parent_ids, stored, entry_ids = self.parent_id, self.content, self.entry_id
        hashes, contents = keys.hashes, keys.keys
        parent_id = 0
        blocks: list[int] = []
        for i in range(min(max_blocks, len(hashes))):
            block = by_hash.get(hashes[i])
            if block is None:
                break
            if parent_ids[block] != parent_id or stored[block] != contents[i]:
                break  # a hash collision: different content or a different prefix
            blocks.append(block)
            parent_id = entry_ids[block]
        if len(blocks) < min(max_blocks, len(hashes)) and self.host is not None:
            return self._match_tiers(keys, max_blocks, blocks, parent_id)
        if not blocks:
            return NO_MATCH
        return PrefixMatch(blocks, parent_id)

    def _match_tiers(self, keys: BlockKeys, max_blocks: int, blocks: list[int],
                     parent_id: int) -> PrefixMatch:
        """`match` continued past the GPU: each further position is looked up on the GPU,
        then on the host. O(further matched blocks)."""
        host = self.host
        hashes, contents = keys.hashes, keys.keys
        on_host = []
        for i in range(len(blocks), min(max_blocks, len(hashes))):
            h, content = hashes[i], contents[i]
            block = self.find(h, parent_id, content)
            if block is not None:
                parent_id = self.entry_id[block]
            else:
                block = host.find(h, parent_id, content)
                if block is None:
                    break
                on_host.append(i)
                parent_id = host.entry_id(block)
            blocks.append(block)
        if not blocks:
            return NO_MATCH
        return PrefixMatch(blocks, parent_id, tuple(on_host))

    def is_cached(self, block: int) -> bool:
        return self.hash[block] is not None

    def block_hash(self, block: int) -> int | None:
        """The chain hash a block is cached under, or None."""
        return self.hash[block]

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def is_evictable(self, block: int) -> bool:
        return block in self._lru

    def num_evictable_of(self, blocks: list[int]) -> int:
        """How many of `blocks` are evictable. O(blocks)."""
        return sum(map(self._lru.__contains__, blocks))

    def new_entry_id(self) -> int:
        eid = self._next_entry_id
        self._next_entry_id = eid + 1
        return eid

    # ------------------------------------------------------------------ updates
    def commit(self, blocks: Sequence[int], keys: BlockKeys, start: int, end: int,
               parent_id: int, free: list[int]) -> ChainLink:
        """Enter full, computed blocks[start:end] (keys[i] is block i's content),
        continuing a chain whose block start - 1 has entry id `parent_id` (0 when start
        is 0). O(end - start): one dict probe per block, the hashes coming with the keys.

        If a block's hash is free, the block gets a new entry. If it names a block with
        the same parent and content (another sequence computed the same prefix), that
        entry continues the chain and this block stays uncached. Otherwise the hash is
        held by other content: a collision, or an orphan (a block whose parent was
        evicted, unreachable from now on). An unreferenced holder is dropped (onto
        `free`) and the block takes its place; a referenced one stops the chain, since
        nothing from there on could be found: the link says `broken`.
        """
        by_hash = self.block_of_hash
        chain_hashes = keys.hashes[start:end]
        if self._watches:
            self._notify(chain_hashes)
        if chain_hashes[0] not in by_hash:   # a run meeting an entry mostly starts on one
            size = len(by_hash)
            by_hash.update(zip(chain_hashes, blocks[start:end]))
            if len(by_hash) - size == end - start:   # every hash was free, none repeats
                if self.host is not None:
                    self.host.discard_hashes(chain_hashes)
                return self._commit_new(blocks, keys, start, end, parent_id, chain_hashes)
            self._undo_update(chain_hashes)
        hashes, entry_ids = self.hash, self.entry_id
        parent_ids, stored = self.parent_id, self.content
        contents = keys.keys
        entry_id = self._next_entry_id
        for i in range(start, end):
            content = contents[i]
            h = chain_hashes[i - start]
            other = by_hash.get(h)
            if other is not None:
                if parent_ids[other] == parent_id and stored[other] == content:
                    parent_id = entry_ids[other]
                    continue
                if other not in self._lru:
                    self._next_entry_id = entry_id
                    return ChainLink(i, parent_id, True)
                self._lru.remove(other)
                self.drop([other])
                free.append(other)
            block = blocks[i]
            if self.host is not None:
                self.host.discard_hashes((h,))
            by_hash[h] = block
            hashes[block] = h
            entry_ids[block] = entry_id
            parent_ids[block] = parent_id
            stored[block] = content
            parent_id = entry_id
            entry_id += 1
        self._next_entry_id = entry_id
        return ChainLink(end, parent_id, False)

    def _commit_new(self, blocks: Sequence[int], keys: BlockKeys, start: int, end: int,
                    parent_id: int, chain_hashes: list[int]) -> ChainLink:
        """`commit` when no hash of the run was taken and the run's are distinct (they
        are in the hash map already): every block gets a new entry."""
        new = blocks[start:end]
        hashes, entry_ids = self.hash, self.entry_id
        parent_ids, stored = self.parent_id, self.content
        entry_id = self._next_entry_id
        for b, h, content in zip(new, chain_hashes, keys.keys[start:end]):
            hashes[b] = h
            entry_ids[b] = entry_id
            parent_ids[b] = parent_id
            stored[b] = content
            parent_id = entry_id
            entry_id += 1
        self._next_entry_id = entry_id
        return ChainLink(end, parent_id, False)

    def _undo_update(self, chain_hashes: list[int]) -> None:
        """Put the hash map back as it was before `commit` entered `chain_hashes` in
        bulk: a hash that some block held maps to that block again (the per-block hashes
        still say which), the others go. O(num_blocks), on the rare run that meets a
        taken or repeated hash past its first (the common run pays one look-up before its
        bulk update, not one per block)."""
        wanted = set(chain_hashes)
        held = {h: b for b, h in enumerate(self.hash) if h in wanted}
        by_hash = self.block_of_hash
        for h in chain_hashes:
            b = held.get(h)
            if b is None:
                by_hash.pop(h, None)
            else:
                by_hash[h] = b

    def adopt(self, block: int, entry: Entry) -> None:
        """Enter an entry that moves in from the host tier for a (referenced) block."""
        if self._watches:
            self._notify((entry[0],))
        self.put(block, entry)

    def release(self, blocks: list[int], free: list[int]) -> None:
        """Blocks that just lost their last reference, in order: committed ones become
        the most recently used evictable blocks, the others go onto `free`."""
        hashes = self.hash
        committed = [b for b in blocks if hashes[b] is not None]
        if len(committed) != len(blocks):
            free += [b for b in blocks if hashes[b] is None]
        self._lru.park(committed)

    def touch(self, block: int) -> None:
        """An evictable block was hit: it is referenced again, so not evictable. O(1)."""
        self._lru.remove(block)

    def evict(self, n: int) -> list[int]:
        """Forget the n least recently used evictable blocks and return them, LRU
        first. The caller has checked that there are n."""
        out = self._lru.pop_oldest(n)
        self.drop(out)
        return out

    def evict_entries(self, n: int) -> tuple[list[int], Entries]:
        """`evict`, handing back the blocks' entries too (in the same order)."""
        out = self._lru.pop_oldest(n)
        return out, self.take_many(out)

    def evictable_blocks(self) -> list[int]:
        """Evictable blocks, least recently used first (for tests and invariants)."""
        return self._lru.blocks()

    # ------------------------------------------------------------------ watches
    def watch(self, hashes: Iterable[int]) -> Watch:
        """A flag raised the next time an entry is put under one of `hashes` (a commit
        or an adoption; a commit that continues through an existing entry counts too).
        What a memo of a failed look-up relies on: nothing it missed can have appeared
        while its watch stays down. Costs one set test per commit while it is kept."""
        w = Watch(hashes)
        self._watches.append(w)
        return w

    def unwatch(self, w: Watch) -> None:
        self._watches.remove(w)

    def notify_host(self, hashes) -> None:
        """Entries were put in the host tier under these hashes: a match may now run
        further (through them), so watches on them are raised too."""
        if self._watches:
            self._notify(hashes)

    def _notify(self, hashes) -> None:
        for w in self._watches:
            if not w.dirty and not w.hashes.isdisjoint(hashes):
                w.dirty = True

    # ------------------------------------------------------------------ checks
    def check_invariants(self, refcounts: Sequence[int]) -> None:
        """Raise AssertionError unless the hash index and the entries agree and the
        evictable blocks are exactly the committed blocks with no references."""
        cached = self.check()
        self._lru.check(b for b in cached if refcounts[b] == 0)
        ids = [self.entry_id[b] for b in cached]
        if len(set(ids)) != len(ids) or any(i >= self._next_entry_id for i in ids):
            raise AssertionError("cache entry ids are not unique")
