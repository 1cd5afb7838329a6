"""Least-recently-used order over block ids, built for blocks that come and go in runs.

A prefix cache parks the blocks of a finished sequence all at once (`park`), hands back
single blocks when a later sequence hits them (`remove`), and gives up the oldest ones
in batches when memory runs short (`pop_oldest`). An `OrderedDict` does each of these
one block at a time through the interpreter; on a long-prompt trace that was a third of
a run. Here a park appends one *segment* (a list of blocks sharing a segment number), a
removal only clears the block's segment number (the stale entry is skipped later), and
`pop_oldest` slices the oldest segments, keeping the blocks whose number still matches:
list slices and one tight loop per segment.

Cost: `park` O(blocks) in one loop; `remove` O(1); `pop_oldest(n)` O(n + stale entries
skipped), in slices between runs of stale entries; memory O(live + stale entries), with
stale entries dropped whenever they outnumber the live ones and the blocks (amortised
O(1) per entry).
"""
from __future__ import annotations

from collections import deque
from typing import Iterable


class BlockLRU:
    """Blocks in least- to most-recently-parked order; each block at most once."""

    __slots__ = ("_seg_of", "_segments", "_head", "_next_seg", "_live", "_stored")

    def __init__(self, num_blocks: int) -> None:
        self._seg_of = [0] * num_blocks
        """Segment number of each parked block; 0 when it is not parked."""
        self._segments: deque[tuple[int, list[int]]] = deque()
        """(segment number, blocks), oldest first; entries may be stale."""
        self._head = 0
        """Entries of the oldest segment already consumed."""
        self._next_seg = 1
        self._live = 0
        self._stored = 0
        """Entries held in segments (live and stale)."""

    def __len__(self) -> int:
        return self._live

    def __contains__(self, block: int) -> bool:
        return self._seg_of[block] != 0

    def park(self, blocks: list[int]) -> None:
        """Make `blocks` (none of them parked) the most recently used, in their order.
        The list is kept: the caller must not change it afterwards."""
        if not blocks:
            return
        seg = self._next_seg
        self._next_seg = seg + 1
        seg_of = self._seg_of
        for b in blocks:
            seg_of[b] = seg
        self._segments.append((seg, blocks))
        self._live += len(blocks)
        self._stored += len(blocks)

    def remove(self, block: int) -> None:
        """Take one parked block out (it stays in its segment as a stale entry). O(1)."""
        self._seg_of[block] = 0
        self._live -= 1
        if self._stored > 2 * self._live + len(self._seg_of):
            self._compact()

    def pop_oldest(self, n: int) -> list[int]:
        """Take out and return the n least recently used blocks, oldest first; the caller
        has checked that n <= len(self)."""
        out: list[int] = []
        seg_of, segments = self._seg_of, self._segments
        while len(out) < n:
            seg, blocks = segments[0]
            pos = self._head
            live = blocks[pos:pos + n - len(out)]
            for b in live:   # taken out as they are checked, up to the first stale entry
                if seg_of[b] != seg:
                    break
                seg_of[b] = 0
            else:
                b = None
            if b is None:
                pos += len(live)
            else:   # a stale entry: keep the blocks before it, skip the stale run, slice again
                i = live.index(b)   # a segment lists a block once
                del live[i:]
                pos += i + 1
                while pos < len(blocks) and seg_of[blocks[pos]] != seg:
                    pos += 1
            out += live
            if pos >= len(blocks):
                segments.popleft()
                self._stored -= len(blocks)
                pos = 0
            self._head = pos
        self._live -= n
        return out

    def blocks(self) -> list[int]:
        """Parked blocks, least recently used first (for tests and invariants). O(entries)."""
        seg_of = self._seg_of
        out = []
        for i, (seg, blocks) in enumerate(self._segments):
            out += [b for b in (blocks[self._head:] if i == 0 else blocks) if seg_of[b] == seg]
        return out

    def _compact(self) -> None:
        """Drop stale entries: one segment per surviving segment. O(entries)."""
        seg_of = self._seg_of
        kept: deque[tuple[int, list[int]]] = deque()
        for i, (seg, blocks) in enumerate(self._segments):
            live = [b for b in (blocks[self._head:] if i == 0 else blocks) if seg_of[b] == seg]
            if live:
                kept.append((seg, live))
        self._segments = kept
        self._head = 0
        self._stored = self._live

    def check(self, expected: Iterable[int]) -> None:
        """Raise AssertionError unless the parked blocks are exactly `expected` (any
        order), each once, and the counts agree."""
        listed = self.blocks()
        held = set(listed)
        if len(listed) != len(held) or held != set(expected):
            raise AssertionError(f"LRU holds {sorted(listed)}, expected {sorted(set(expected))}")
        if len(listed) != self._live:
            raise AssertionError(f"LRU counts {self._live} parked blocks, holds {len(listed)}")
        if any((s != 0) != (b in held) for b, s in enumerate(self._seg_of)):
            raise AssertionError("LRU segment numbers disagree with its segments")
