"""Remembering that a waiting sequence does not fit, until it might.

Under overload the head of the waiting queue is asked about every step (`can_allocate`)
and answers LATER for hundreds of steps in a row. With a prefix cache each answer walks
the sequence's cached prefix (a long prompt: about a thousand blocks). This memo keeps
the answer for a `BlockKeys` object (the admission hands the same one every time) while
it provably stands.

Why it stands. A paging manager says LATER when free - need < watermark, where need =
blocks - (hits on blocks some sequence references): a hit on an evictable block saves no
free block (reviving it takes it out of the free count). So LATER stays LATER while

- the free blocks have not grown,
- the sequence (its token count and keys) is unchanged, and
- no hit can have turned into a referenced block: none of its evictable hits was revived
  (the manager counts revivals: `touched`), and no entry appeared under one of its chain
  hashes up to its first miss (a `Watch` on the cache: a commit or a host-tier move could
  extend the match or refill a position whose block was evicted).

Evictions only shorten a match and releases only turn referenced hits evictable: both
raise the need, which keeps LATER. Each memo costs a set of its watched hashes, and a
commit that reaches its watched positions one set test; at most `limit` are kept (the
oldest goes first).
"""
from __future__ import annotations

from dataclasses import dataclass

from .block_keys import BlockKeys
from .prefix_runs import PrefixCache, Watch


@dataclass(slots=True, eq=False)
class _Later:
    num_tokens: int
    num_keys: int
    free: int
    touches: int
    watch: Watch


class LaterMemos:
    """LATER answers by BlockKeys object (identity), with what keeps them valid."""

    __slots__ = ("_cache", "_limit", "_memos", "touches")

    def __init__(self, cache: PrefixCache, limit: int = 8) -> None:
        self._cache = cache
        self._limit = limit
        self._memos: dict[BlockKeys, _Later] = {}
        self.touches = 0
        """Evictable cached blocks revived by a hit so far."""

    def known_later(self, keys: BlockKeys, num_tokens: int, num_free: int) -> bool:
        """Is LATER still the answer for these keys? O(1). A memo that no longer holds
        is dropped."""
        memo = self._memos.get(keys)
        if memo is None:
            return False
        if not memo.watch.dirty and memo.num_tokens == num_tokens and memo.num_keys == len(keys) \
                and memo.touches == self.touches and num_free <= memo.free:
            return True
        self.forget(keys)
        return False

    def remember(self, keys: BlockKeys, num_tokens: int, num_free: int, watched: int) -> None:
        """Keep a LATER answer; `watched` is how many leading chain hashes to watch
        (through the first miss)."""
        self.forget(keys)
        if len(self._memos) >= self._limit:
            self.forget(next(iter(self._memos)))
        self._memos[keys] = _Later(num_tokens, len(keys), num_free, self.touches,
                                   self._cache.watch(keys.hashes[:watched]))

    def forget(self, keys: BlockKeys) -> None:
        memo = self._memos.pop(keys, None)
        if memo is not None:
            self._cache.unwatch(memo.watch)

    def valid(self) -> list[tuple[BlockKeys, int]]:
        """(keys, num_tokens) of every memo that still holds given the free blocks it
        saw (for invariant checks: each must still be LATER)."""
        return [(keys, m.num_tokens) for keys, m in self._memos.items()
                if not m.watch.dirty and m.num_keys == len(keys) and m.touches == self.touches]

    def free_then(self, keys: BlockKeys) -> int:
        return self._memos[keys].free
