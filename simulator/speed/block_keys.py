"""A sequence's block content keys with their chain hashes, computed once.

Prefix caching names a full block by its content key (its token ids, or a trace's block
hash) and by the chain hash h_i = chain_hash(h_{i-1}, content_i), which stands for the
block and everything before it. A waiting request is looked up in the cache step after
step, and a long prompt has about a thousand blocks: building the keys and hashing the
chain again at every look-up is what made prefix caching slow. `BlockKeys` holds both
lists for one sequence and only ever appends (a sequence's tokens only grow), so each key
is built and hashed once.

The plain path stays beside it: a block manager given a plain list of keys wraps it in a
fresh `BlockKeys`, which hashes the same chain in the same way (`chain_hash`, looked up in
`prefix_runs` at every extension so that tests can replace it). Cost: O(new keys) per
`extend`, one tuple hash each; `prefix` copies O(n) references.

Region offsets. A trace that names content only per region of several blocks (Mooncake's
512-token `hash_ids` over 16-token blocks: 32 blocks a region) gives each region's first
block a key of its own and the others just their offset j in the region, as a
`RegionOffset`. Such a block's chain hash is the region's first block's hash plus j: that
hash already stands for everything up to the region, and j for the rest. A region's
offsets are then hashed in C (`range`) instead of one tuple hash each: on issue #16's
Mooncake case, 0.4 to 0.6 s of a 12 s prefix-caching run. The rule is part of the chain's definition, so
every path that hashes the same keys agrees; a key list that breaks the layout (an
offset that does not follow its region's first block) still hashes deterministically
and, as any hash, only finds candidates that the cache then checks.
"""
from __future__ import annotations

from operator import is_
from typing import Hashable, Iterable, Sequence

from servelab.request import Request, RegionOffset, region_offsets   # the keys Request.block_contents makes
from servelab.request import Sequence as Sequence_

from . import prefix_runs

_DEFAULT_CHAIN_HASH = prefix_runs.chain_hash


class BlockKeys(Sequence):
    """Content keys of full blocks (`keys`) and their chain hashes (`hashes`), parallel
    and append-only. Indexing, slicing and `len` read the keys, so a `BlockKeys` is a
    drop-in `block_contents` sequence. Identity equality: two objects with equal keys are
    still two objects (a block manager may remember what it computed for one)."""

    __slots__ = ("keys", "hashes")

    def __init__(self, keys: Iterable[Hashable] = ()) -> None:
        self.keys: list[Hashable] = []
        self.hashes: list[int] = []
        self.extend(keys)

    @classmethod
    def of(cls, contents: Sequence[Hashable]) -> "BlockKeys":
        """`contents` itself if it is a BlockKeys, else its keys hashed (the plain path)."""
        return contents if type(contents) is cls else cls(contents)

    def extend_to(self, req: Request, seq: Sequence_, block_size: int) -> None:
        """Extend these keys (`seq`'s, `req.block_contents` from 0) to the sequence's full
        blocks: the same keys and hashes as `extend(req.block_contents(...))`, a region of
        trace hashes laid out in bulk (`Request.region_layout`). O(new blocks), in C but
        for one step per region."""
        start = len(self.keys)
        layout = req.region_layout(seq, block_size, start)
        if layout is not None:
            self.extend_regions(*layout)
        elif start < seq.num_tokens // block_size:
            self.extend(req.block_contents(seq, block_size, start))

    def extend(self, keys: Iterable[Hashable]) -> None:
        """Append keys of the blocks that follow, hashing them onto the chain (region
        offsets by the rule in the module docstring)."""
        new = list(keys)
        if not new:
            return
        if RegionOffset in map(type, new):   # tested in C
            self._extend_regions(new)
            return
        h = self.hashes[-1] if self.hashes else None
        out = self.hashes
        chain = prefix_runs.chain_hash
        if chain is _DEFAULT_CHAIN_HASH:   # the same function, inlined: a third faster
            for content in new:
                h = hash((h, content))
                out.append(h)
        else:
            for content in new:
                h = chain(h, content)
                out.append(h)
        self.keys += new

    def _extend_regions(self, new: list[Hashable]) -> None:
        """`extend` for keys holding region offsets, key by key by the rule, except that
        a run of one region's offsets in order (checked by identity: they are shared
        objects) is hashed as one range, in C."""
        hashes = self.hashes
        chain = prefix_runs.chain_hash
        i, n = 0, len(new)
        while i < n:
            key = new[i]
            pos = len(hashes)
            if type(key) is RegionOffset and 0 < key <= pos:
                offsets = region_offsets(key.size)
                run = min(key.size - key, n - i)
                if all(map(is_, new[i:i + run], offsets[key - 1:key - 1 + run])):
                    anchor = hashes[pos - key]
                    hashes += range(anchor + key, anchor + key + run)
                    i += run
                    continue
                hashes.append(hashes[pos - key] + key)
                i += 1
                continue
            hashes.append(chain(hashes[-1] if hashes else None, key))
            i += 1
        self.keys += new

    def extend_regions(self, firsts: Sequence[Hashable], size: int, skip: int,
                       count: int) -> None:
        """Append `count` keys laid out in regions of `size` blocks: firsts[k] is region
        k's first key, the others are its offsets (`region_offsets(size)`), and the
        layout's first `skip` blocks (skip < size) are held already. The same keys and
        hashes as `extend` of that list, without checking the layout: one Python step
        per region, each region's offsets added and hashed in C."""
        if count <= 0:
            return
        end = skip + count
        whole_from = 1 if skip else 0   # regions [whole_from, whole_to) are whole
        whole_to = max(end // size, whole_from)
        if skip:
            self._extend_region(firsts[0], size, skip, min(end, size))
        if whole_to > whole_from:
            chain = prefix_runs.chain_hash
            keys, hashes = self.keys, self.hashes
            offsets = region_offsets(size)
            tail = size - 1
            h = hashes[-1] if hashes else None
            for first in firsts[whole_from:whole_to]:
                h = chain(h, first)
                hashes += range(h, h + size)
                keys.append(first)
                keys += offsets
                h += tail
        if end > whole_to * size:   # a partial last region
            self._extend_region(firsts[whole_to], size, 0, end - whole_to * size)

    def _extend_region(self, first: Hashable, size: int, lo: int, hi: int) -> None:
        """Append blocks lo .. hi - 1 of a region whose first key is `first` (its earlier
        blocks are held already)."""
        keys, hashes = self.keys, self.hashes
        if lo == 0:
            hashes.append(prefix_runs.chain_hash(hashes[-1] if hashes else None, first))
            keys.append(first)
            lo = 1
        if hi > lo:
            anchor = hashes[len(hashes) - lo]
            hashes += range(anchor + lo, anchor + hi)
            keys += region_offsets(size)[lo - 1:hi - 1]

    def prefix(self, n: int) -> "BlockKeys":
        """A new BlockKeys of the first n blocks (no hashing: the chain is the same)."""
        out = BlockKeys.__new__(BlockKeys)
        out.keys, out.hashes = self.keys[:n], self.hashes[:n]
        return out

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index):
        return self.keys[index]

    def __iter__(self):
        return iter(self.keys)

    def __repr__(self) -> str:
        return f"BlockKeys({self.keys!r})"
