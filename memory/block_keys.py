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
`prefix_cache` at every extension so that tests can replace it). Cost: O(new keys) per
`extend`, one tuple hash each; `prefix` copies O(n) references.
"""
from __future__ import annotations

from typing import Hashable, Iterable, Sequence

from . import prefix_cache

_DEFAULT_CHAIN_HASH = prefix_cache.chain_hash


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

    def extend(self, keys: Iterable[Hashable]) -> None:
        """Append keys of the blocks that follow, hashing them onto the chain."""
        new = list(keys)
        if not new:
            return
        h = self.hashes[-1] if self.hashes else None
        out = self.hashes
        chain = prefix_cache.chain_hash
        if chain is _DEFAULT_CHAIN_HASH:   # the same function, inlined: a third faster
            for content in new:
                h = hash((h, content))
                out.append(h)
        else:
            for content in new:
                h = chain(h, content)
                out.append(h)
        self.keys += new

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
