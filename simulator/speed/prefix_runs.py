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
never a wrong reuse. The GPU cache keeps its entries in runs (`Run`, below), the host
tier (`host_runs.py`) in runs of its own, and entries move between them whole, ids
included, a run's worth at a time (`Entries`). The GPU cache calls the host tier; the
host tier never calls back.

Committed blocks nobody references are *evictable*: they stay cached, least recently
used first, until the manager needs a block and its free list is empty.

The manager owns the free list and the reference counts, and keeps per sequence the
runs it references (its *spans*). It hands the cache the runs that just lost their last
reference (`park`), the runs a hit revives (`revive`), and asks for the least recently
used blocks when its free list runs dry (`evict`).

Cost: per run of entries, not per block. On a long-prompt trace a request commits,
parks and evicts thousands of blocks, nearly always as a few runs: each run costs O(1)
Python steps and its blocks move as list slices, in C. Without hash collisions the
decisions are those of a per-block cache (same hits, same blocks, same eviction order:
the oracle in tests/test_memory_prefix_runs.py).
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import Counter, deque
from itertools import compress, count, repeat
from operator import ne
from typing import TYPE_CHECKING, Hashable, NamedTuple, Sequence

from servelab.memory.base import invariant

if TYPE_CHECKING:
    from .block_keys import BlockKeys
    from .host_runs import HostTier


RUN_IDS = 1 << 24
"""Entry ids each run reserves, one per chain position from its first entry's on."""


def chain_hash(parent_hash: int | None, content: Hashable) -> int:
    """Hash of a full block from its content and the hash of the block before it
    (None for a sequence's first block): an int in the signed 64-bit range, as `hash`
    gives. `BlockKeys` looks it up as a module attribute whenever it hashes, so a test
    can replace it to force collisions."""
    return hash((parent_hash, content))


class Entries(NamedTuple):
    """Consecutive entries of one chain, as they move between the tiers: those at chain
    positions lo .. hi - 1, position k's with hash hashes[k], content contents[k] (the
    key lists of the sequence that committed them, shared, never copied) and id
    id0 + k; the parent of the entry at `origin` is entry `parent_id`, of any later one
    the entry before it."""

    hashes: list[int]
    contents: list[Hashable]
    id0: int
    origin: int
    parent_id: int
    lo: int
    hi: int


class PrefixMatch(NamedTuple):
    """The longest cached run of leading blocks for some block contents."""

    blocks: list[int]
    """GPU block ids, except where a host-tier hit matched: host-tier block ids."""
    last_entry_id: int
    """Entry id of the last matched block (0 when nothing matched)."""
    num_on_host: int = 0
    """How many matched blocks are in the host tier."""
    pieces: tuple | list = ()
    """What matched, in order: (run, a, b) for entries a..b-1 of a GPU run (a plain
    tuple), or a `HostHit` (entries a..b-1 of a host-tier run)."""


NO_MATCH = PrefixMatch([], 0)


class ChainLink(NamedTuple):
    """Where a sequence's committed chain stands after `PrefixCache.commit`."""

    num_committed: int
    """Leading blocks now in the chain."""
    last_entry_id: int
    broken: bool
    """A collision stopped the chain at block num_committed."""
    loc: tuple | None
    """(run, index) of the chain's last entry on the GPU, or the location given."""
    runs: list
    """The runs the commit made (the sequence's own blocks, now cached), in order."""
    grown: bool = False
    """The run at the location given grew: the sequence's last span ends at its new end."""


class Watch:
    """Raised flag for the chain hashes of a sequence's leading blocks: `dirty` turns
    True when an entry is put under one of them (see `PrefixCache.watch`)."""

    __slots__ = ("hashes", "length", "dirty")

    def __init__(self, hashes: Sequence[int]) -> None:
        self.hashes = set(hashes)
        self.length = len(hashes)
        """The watched blocks are chain positions 0 .. length - 1."""
        self.dirty = False


class Run:
    """Entries committed together, each the parent of the next: a stretch of one
    sequence's blocks that its commits entered one after another, or a stretch loaded
    from the host tier. Its lists are that sequence's own (its block table, its keys'
    hashes and contents), indexed by chain position: no copy is made, and a sequence
    that keeps committing after the run's last entry just moves `hi`. The entry at
    position k has id id0 + k; the first one made, at `origin`, has parent `parent_id`.

    The run is a *view* [lo, hi) of those positions: its tail is evicted first (hi
    falls), an orphan's head may be taken over by a commit (lo rises), and taking one
    from the middle splits the view (the part above moves to a new view, `moved`).
    Entries [lo, ev) are referenced by some sequence, [ev, hi) are evictable: a sequence
    holding entry k holds every entry of the view before it (the block manager commits
    a shared block only where that holds: `RunPagedBlockManager._commit_shared`)."""

    __slots__ = ("blocks", "hashes", "contents", "origin", "id0", "parent_id", "room",
                 "lo", "hi", "ev", "segs", "key", "same", "moved")

    def __init__(self, blocks: list[int], hashes: list[int], contents: list[Hashable],
                 origin: int, id0: int, parent_id: int, room: int, lo: int, hi: int) -> None:
        self.blocks, self.hashes, self.contents = blocks, hashes, contents
        self.origin, self.id0, self.parent_id = origin, id0, parent_id
        self.room = room
        """How many positions from `origin` on its ids leave room for."""
        self.lo = lo
        self.hi = self.ev = hi
        self.segs: list[_Segment] = []
        """Its stretches in the LRU order, lowest entries (most recently parked) first;
        together they cover [ev, hi)."""
        self.key: int | None = None
        """The hash it is indexed under (its entry lo's); None once it is retired."""
        self.same: Run | None = None
        """The next view indexed under the same hash (a hash collision), or None."""
        self.moved: Run | None = None
        """The view that took this one's entries above hi when it was split."""

    def parent_of(self, k: int) -> int:
        return self.id0 + k - 1 if k > self.origin else self.parent_id

    def __repr__(self) -> str:
        return f"Run(ids {self.id0}+[{self.lo}:{self.hi}], ev={self.ev})"


class _Segment:
    """Entries a..b-1 of a run, parked at one time: evicted from b - 1 down. Dead once
    a >= b (a hit revived it, or it was evicted)."""

    __slots__ = ("run", "a", "b")

    def __init__(self, run: Run, a: int, b: int) -> None:
        self.run, self.a, self.b = run, a, b


def _live(run: Run, k: int) -> Run | None:
    """The view holding entry k of `run`'s entries (following splits), or None if it
    left the GPU cache."""
    while k >= run.hi:
        run = run.moved
        if run is None:
            return None
    return run if k >= run.lo else None


def _grows(run: Run, off: int, blocks: list[int], start: int, end: int) -> bool:
    """Can `run` take positions start .. end - 1 of the sequence whose block table is
    `blocks`, its chain's last entry being entry `off`? When the run is over that very
    table, ends there (off = start - 1), is referenced all through, is the top view of
    its entries (not split below another) and has ids left for them."""
    return run.blocks is blocks and off + 1 == start == run.hi == run.ev \
        and run.moved is None and end - run.origin <= run.room


def agree(contents: list[Hashable], keys: list[Hashable], i: int, n: int) -> int:
    """How many of a run's n entries at positions i.. have the contents of the keys
    there, counted up to the first that does not: list slices compared in C. The caller
    has matched the entry at i - 1, every entry's parent inside a run is the one before
    it, so equal contents are equal chains: hashes need no comparing. (Any two lists
    compare this way: the host tier compares a run's hashes with a commit's.)"""
    a, b = contents[i:i + n], keys[i:i + n]
    if a != b:
        n = next(compress(count(), map(ne, a, b)))
    return n


def index_run(cache, run) -> None:
    """Enter `run` under its first entry's hash in `cache.heads` (after the runs already
    there, under a hash collision: a chain through `same`), and count its chain position
    in `cache._head_at` / `cache._head_positions` (kept sorted). The GPU prefix cache and
    the host tier keep the same three fields and share this as their `_index`."""
    h = run.key = run.hashes[run.lo]
    p = run.lo
    n = cache._head_at.get(p)
    if n is None:
        insort(cache._head_positions, p)
        cache._head_at[p] = 1
    else:
        cache._head_at[p] = n + 1
    first = cache.heads.get(h)
    if first is None:
        cache.heads[h] = run
    else:
        while first.same is not None:
            first = first.same
        first.same = run


def unindex_run(cache, run) -> None:
    """Undo `index_run` (both classes' `_unindex`)."""
    p = run.lo
    n = cache._head_at[p] - 1
    if n:
        cache._head_at[p] = n
    else:
        del cache._head_at[p]
        positions = cache._head_positions
        del positions[bisect_left(positions, p)]
    h = run.key
    first = cache.heads[h]
    if first is run:
        if run.same is None:
            del cache.heads[h]
        else:
            cache.heads[h] = run.same
    else:
        while first.same is not run:
            first = first.same
        first.same = run.same
    run.key = run.same = None

class PrefixCache:
    """Chained-hash index over committed GPU blocks plus their LRU eviction order, kept
    per run of entries (see `Run`): committing, parking, reviving and evicting cost
    O(1) Python steps per run touched, the blocks moving in list slices.

    The index holds each run's first entry under its hash (`heads`). That finds every
    entry a per-block index would find, save under a hash collision: a match or a
    commit reaches an entry inside a run only through the entry before it, which it
    compares by slices. The exception is a commit whose chain's last entry has left both
    tiers (`_commit_each`): a block inside some run may then hold the next hash, so that
    commit looks every position up in a full index, built for it.

    Each content is cached once under a given parent: committing content that another
    block already holds under the same prefix leaves the new block uncached and
    continues the chain through the existing entry (see `commit`). Without collisions
    that makes one entry per hash. Under a collision, views whose first entries share a
    hash are chained (`Run.same`) and a look-up tries each.
    """

    __slots__ = ("num_blocks", "heads", "_head_at", "_head_positions", "_lru",
                 "_num_evictable", "_num_dead", "_runs", "_next_entry_id", "_watches",
                 "_watch_reach", "host")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.heads: dict[int, Run] = {}
        self._head_at: dict[int, int] = {}
        """Chain position -> how many indexed views have their first entry there."""
        self._head_positions: list[int] = []
        """The keys of `_head_at`, sorted."""
        self._lru: deque[_Segment] = deque()
        """Parked stretches, least recently used first; dead ones are skipped."""
        self._num_evictable = 0
        self._num_dead = 0
        """Dead stretches still in `_lru`."""
        self._runs: dict[Run, None] = {}
        """Views with at least one entry, in the order they were made (a dict, so that
        walking them is deterministic)."""
        self._next_entry_id = 1
        self._watches: list[Watch] = []
        self._watch_reach = 0
        """No watch covers a chain position from this one on."""
        self.host: HostTier | None = None
        """The host-memory tier behind this cache, if any (set by the block manager)."""

    # ------------------------------------------------------------------ lookups
    def match(self, keys: BlockKeys, max_blocks: int) -> PrefixMatch:
        """Cached blocks for the leading `keys`, at most `max_blocks` of them, from the
        GPU and then, where the GPU has none, from the host tier.

        O(runs matched) Python steps and O(matched blocks) in C: a head is looked up,
        then the run is compared with the keys by slices. A peek: it changes neither the
        LRU order nor any statistic.
        """
        heads, host = self.heads, self.host
        hashes, contents = keys.hashes, keys.keys
        limit = min(max_blocks, len(hashes))
        i = pid = 0
        blocks: list[int] = []
        pieces: list = []
        num_on_host = 0
        while i < limit:
            run = heads.get(hashes[i])
            while run is not None:   # more than one view only under a hash collision
                lo = run.lo
                if (run.id0 + lo - 1 if lo > run.origin else run.parent_id) == pid \
                        and run.contents[lo] == contents[i]:
                    n = min(run.hi - lo, limit - i)
                    m = agree(run.contents, contents, i, n)
                    blocks += run.blocks[lo:lo + m]
                    pieces.append((run, lo, lo + m))
                    i += m
                    pid = run.id0 + lo + m - 1
                    break
                run = run.same
            if run is not None:
                continue
            if host is None:
                break
            hit = host.find(hashes, contents, i, pid, limit)
            if hit is None:
                break
            blocks += hit.blocks
            pieces.append(hit)
            num_on_host += hit.b - i
            pid = hit.last_id
            i = hit.b
        if not blocks:
            return NO_MATCH
        return PrefixMatch(blocks, pid, num_on_host, pieces)

    def num_evictable_in(self, pieces) -> int:
        """How many blocks of a match's GPU pieces are evictable. O(pieces)."""
        n = 0
        for p in pieces:
            if p.__class__ is tuple:
                run, a, b = p
                ev = run.ev
                if b > ev:
                    n += b - (ev if ev > a else a)
        return n

    @property
    def num_evictable(self) -> int:
        return self._num_evictable

    # ------------------------------------------------------------------ updates
    def commit(self, blocks: Sequence[int], keys: BlockKeys, start: int, end: int,
               parent_id: int, loc: tuple | None, free: list[int]) -> ChainLink:
        """Enter full, computed blocks[start:end] (keys[i] is block i's content),
        continuing a chain whose block start - 1 has entry id `parent_id` (0 when start
        is 0), found at `loc` ((run, index), or None) when it was last seen on the GPU.

        Per position: if the hash is free, the block gets a new entry. If it names an
        entry with the same parent and content (another sequence computed the same
        prefix), that entry continues the chain and this block stays uncached. Otherwise
        the hash is held by other content: a collision, or an orphan (an entry whose
        parent was evicted, unreachable from now on). An evictable holder is dropped
        (onto `free`) and the block takes its place; a referenced one stops the chain,
        since nothing from there on could be found: the link says `broken`.

        O(runs met) Python steps, blocks in slices: the entries that continue the chain
        are compared with the keys by slices, and the new ones enter as one run (or
        extend the sequence's own) up to the next hash that heads a view. Only views
        whose first entry sits at a position of the new entries are looked at: an entry
        holding the chain hash of position p sits at position p, hash collisions aside
        (which `Run.same` chains absorb).
        """
        hashes, contents = keys.hashes, keys.keys
        if start < self._watch_reach:
            self._notify_at(hashes, start, end, start)
        if loc is not None:
            run, off = loc
            run = _live(run, off)
        else:
            run, off = None, -1
        host = self.host
        if start and run is None:   # the chain's last entry left the GPU
            if host is None or not host.holds(parent_id, start - 1):
                return self._commit_each(blocks, keys, start, end, parent_id, loc, free)
            on_host = parent_id   # ... for the host tier, where the entries after it may be
        else:
            on_host = 0
        heads = self.heads
        pid = parent_id
        made: list[Run] = []
        grown = False
        i = start
        while i < end:
            other = None
            if run is not None and off + 1 < run.hi:   # the chain's run goes on: walk it
                k = agree(run.contents, contents, i, min(run.hi - off - 1, end - i))
                if k:
                    i += k
                    off += k
                    pid = run.id0 + off
                    continue
                if run.hashes[off + 1] == hashes[i]:   # same hash, other content
                    other, at = run, off + 1
            if other is None:
                x = y = heads.get(hashes[i])
                while y is not None:   # more than one view only under a hash collision
                    yl = y.lo
                    if (y.id0 + yl - 1 if yl > y.origin else y.parent_id) == pid \
                            and y.contents[yl] == contents[i]:
                        break
                    y = y.same
                if y is not None:
                    run, off, pid = y, yl, y.id0 + yl
                    i += 1
                    continue
                if x is not None:
                    other, at = x, x.lo
            if other is not None:
                if at < other.ev:   # referenced: the chain stops here
                    return ChainLink(i, pid, True, (run, off) if run is not None else loc, made,
                                     grown)
                self._drop(other, at, free)
            j = end   # the new entries stop before a hash that heads a view
            if i + 1 < end:   # (one at the same chain position: hash collisions aside)
                positions = self._head_positions
                for k in range(bisect_right(positions, i), len(positions)):
                    p = positions[k]
                    if p >= end:
                        break
                    if hashes[p] in heads:
                        j = p
                        break
            if host is not None:
                host.discard(hashes, i, j, on_host if i == start else 0)
            if run is not None and _grows(run, off, blocks, i, j):
                run.hi = run.ev = j
                if not made:
                    grown = True
            else:
                run = self._new_run(blocks, keys, i, j, pid)
                made.append(run)
            off = j - 1
            pid = run.id0 + off
            i = j
        return ChainLink(end, pid, False, (run, off) if run is not None else loc, made, grown)

    def grow(self, run: Run, off: int, blocks: list[int], hashes: list[int], start: int,
             end: int) -> bool:
        """`commit`'s common case, a prefill's next chunk: the chain's last entry is
        entry `off` = start - 1 of `run`, the run is over this sequence's blocks and ends
        there, and nothing cached sits under the new hashes (the first one heads no view
        and no view's first entry lies among the new positions). Then the run grows to
        `end` and this returns True; otherwise it changes nothing and returns False."""
        if _grows(run, off, blocks, start, end) and hashes[start] not in self.heads:
            positions = self._head_positions
            k = bisect_right(positions, start)
            if k == len(positions) or positions[k] >= end:
                if start < self._watch_reach:
                    self._notify_at(hashes, start, end, start)
                if self.host is not None:
                    self.host.discard(hashes, start, end)
                run.hi = run.ev = end
                return True
        return False

    def _commit_each(self, blocks: Sequence[int], keys: BlockKeys, start: int, end: int,
                     parent_id: int, loc: tuple | None, free: list[int]) -> ChainLink:
        """`commit` when the chain's last entry has left both tiers: another run may
        then hold the next hash inside it (it recomputed that entry), so every position
        is looked up in a full index of the GPU's entries, built here. Rare. O(cached
        entries + blocks)."""
        holder: dict[int, tuple[Run, int]] = {}
        num_entries = 0
        for r in self._runs:
            holder.update(zip(r.hashes[r.lo:r.hi], zip(repeat(r), range(r.lo, r.hi))))
            num_entries += r.hi - r.lo
        holders: dict[int, list[tuple[Run, int]]] = {}
        """Every holder of a hash held more than once (a hash collision)."""
        if len(holder) != num_entries:
            for r in self._runs:
                for k in range(r.lo, r.hi):
                    holders.setdefault(r.hashes[k], []).append((r, k))
        hashes, contents = keys.hashes, keys.keys
        host = self.host
        pid = parent_id
        made: list[Run] = []
        fresh = fresh_parent = None   # the new entries not yet entered as a run

        def flush(i: int) -> None:
            nonlocal fresh, loc
            if fresh is not None:
                if host is not None:
                    host.discard_anywhere(hashes, fresh, i)
                run = self._new_run(blocks, keys, fresh, i, fresh_parent)
                made.append(run)
                loc = (run, i - 1)
                fresh = None

        for i in range(start, end):
            got = holder.get(hashes[i])
            r = _live(*got) if got is not None else None
            if holders and hashes[i] in holders:   # the live holder of equal content, if any
                live = [(v, at) for v, at in ((_live(*g), g[1]) for g in holders[hashes[i]])
                        if v is not None]
                same = [(v, at) for v, at in live
                        if v.parent_of(at) == pid and v.contents[at] == contents[i]]
                r, at = (same or live or [(None, 0)])[0]
                got = (r, at)
            if r is not None:
                at = got[1]
                if r.parent_of(at) == pid and r.contents[at] == contents[i]:
                    flush(i)
                    loc, pid = (r, at), r.id0 + at
                    continue
                if at < r.ev:
                    flush(i)
                    return ChainLink(i, pid, True, loc, made)
                self._drop(r, at, free)
            if fresh is None:
                fresh, fresh_parent = i, pid
            pid = self._next_entry_id + (i - fresh)
        flush(end)
        return ChainLink(end, pid, False, loc, made)

    def _new_run(self, blocks: list[int], keys: BlockKeys, lo: int, hi: int,
                 parent_id: int) -> Run:
        """A run of positions lo .. hi - 1 of a sequence's blocks and keys."""
        run = Run(blocks, keys.hashes, keys.keys, lo, self._next_entry_id - lo, parent_id,
                  RUN_IDS, lo, hi)
        self._next_entry_id += RUN_IDS
        self._index(run)
        self._runs[run] = None
        return run

    _index = index_run
    _unindex = unindex_run

    def _retire(self, run: Run) -> None:
        """The view lost its last entry."""
        self._unindex(run)
        self._runs.pop(run, None)

    def _drop(self, run: Run, at: int, free: list[int]) -> None:
        """Forget evictable entry `at` of `run` (a commit takes its hash); its block goes
        onto `free` (a pending host-tier load into it is cancelled). Inside the view,
        the entries above move to a new view."""
        block = run.blocks[at]
        free.append(block)
        if self.host is not None:
            self.host.dropped(block)
        self._num_evictable -= 1
        segs = run.segs
        idx = next(n for n, s in enumerate(segs) if s.a <= at < s.b)
        seg = segs[idx]
        if at == run.lo:   # its first entry (at == ev == seg.a)
            seg.a += 1
            if seg.a == seg.b:
                del segs[idx]
                self._num_dead += 1
            self._unindex(run)
            run.lo = run.ev = at + 1
            if run.lo == run.hi:
                self._runs.pop(run, None)
            else:
                self._index(run)
            return
        hi = run.hi
        run.hi = at
        if at + 1 == hi:   # its last entry: the top of its oldest stretch
            seg.b = at
            if seg.a == seg.b:
                del segs[idx]
                self._num_dead += 1
            return
        upper = Run(run.blocks, run.hashes, run.contents, run.origin, run.id0,
                    run.parent_id, run.room, at + 1, hi)
        upper.ev = at + 1
        upper.moved, run.moved = run.moved, upper
        upper.segs = segs[idx + 1:]
        for s in upper.segs:
            s.run = upper
        del segs[idx + 1:]
        if seg.b > at + 1:   # the part above `at` is evicted first: it keeps the place
            if seg.a < at:
                lower = _Segment(run, seg.a, at)
                self._lru.insert(self._lru.index(seg) + 1, lower)
                segs[idx] = lower
            else:
                del segs[idx]
            seg.run, seg.a = upper, at + 1
            upper.segs.insert(0, seg)
        else:
            seg.b = at
            if seg.a == seg.b:
                del segs[idx]
                self._num_dead += 1
        self._runs[upper] = None
        self._index(upper)

    def take_host_hits(self, match: PrefixMatch) -> list[Entries]:
        """Take a match's host-tier hits out of the host tier, in order (before blocks
        are taken for them: taking blocks may evict into the host tier)."""
        return [self.host.load(p) for p in match.pieces if p.__class__ is not tuple]

    def adopt(self, blocks: list[int], keys: BlockKeys, entries: Entries,
              host_blocks: list[int]) -> Run:
        """Enter entries that move in from the host tier (`take_host_hits`) for a
        sequence's (referenced) blocks at their chain positions lo .. hi - 1:
        blocks[lo:hi] are those blocks, loaded from `host_blocks`, and the keys there are
        the entries' hashes and contents (a match found them by them). One run."""
        a, b = entries.lo, entries.hi
        self.host.loading(blocks[a:b], host_blocks)
        if a < self._watch_reach:
            self._notify_at(keys.hashes, a, b, a)
        parent_id = entries.id0 + a - 1 if a > entries.origin else entries.parent_id
        run = Run(blocks, keys.hashes, keys.keys, a, entries.id0, parent_id, b - a, a, b)
        self._index(run)
        self._runs[run] = None
        return run

    def revive(self, run: Run, b: int) -> int:
        """Evictable entries of `run` below b were hit: referenced again, so no longer
        evictable. Returns how many. O(stretches revived)."""
        k = b - run.ev
        run.ev = b
        segs = run.segs
        while segs and segs[0].b <= b:
            seg = segs.pop(0)
            seg.a = seg.b
            self._num_dead += 1
        if segs and segs[0].a < b:
            segs[0].a = b
        self._num_evictable -= k
        return k

    def park(self, pieces: list[tuple[Run, int, int]]) -> None:
        """Entries a..b-1 of each run lost their last reference (b is the run's `ev`):
        they become the most recently used evictable ones, the pieces in the order given
        (least recently used first), each evicted from its top down. O(pieces)."""
        lru = self._lru
        n = 0
        for run, a, b in pieces:
            seg = _Segment(run, a, b)
            run.segs.insert(0, seg)
            run.ev = a
            lru.append(seg)
            n += b - a
        self._num_evictable += n
        if self._num_dead > 64 and self._num_dead > len(lru) // 2:
            self._lru = deque(s for s in lru if s.a < s.b)
            self._num_dead = 0

    def evict(self, n: int, out: list[int] | None = None) -> list[int]:
        """Forget the n least recently used evictable blocks and return them, LRU
        first, appended to `out` if given. The caller has checked that there are n.
        With a host tier, their entries move there, a run's stretch at a time."""
        out = [] if out is None else out
        host = self.host
        if host is None:
            return self._pop(n, None, out)
        start = len(out)
        moved: list[Entries] = []
        self._pop(n, moved, out)
        host.store(out[start:], moved)
        if self._watch_reach:   # a match may now run further, through them
            for e in moved:
                if e.lo < self._watch_reach:
                    self._notify_at(e.hashes, e.lo, e.hi, e.lo)
        return out

    def _pop(self, n: int, moved: list[Entries] | None, out: list[int]) -> list[int]:
        """`evict`; the stretches evicted are appended to `moved` if given (each from its
        top down, as the blocks come)."""
        lru = self._lru
        self._num_evictable -= n
        while n:
            seg = lru[0]
            a, b = seg.a, seg.b
            if a >= b:
                lru.popleft()
                self._num_dead -= 1
                continue
            run = seg.run
            k = b - a if b - a <= n else n
            c = b - k
            down = slice(b - 1, c - 1 if c else None, -1)   # top first
            out += run.blocks[down]
            if moved is not None:
                moved.append(Entries(run.hashes, run.contents, run.id0, run.origin,
                                     run.parent_id, c, b))
            seg.b = run.hi = c
            n -= k
            if c == a:
                lru.popleft()
                run.segs.pop()
                if c == run.lo:
                    self._retire(run)
        return out

    # ------------------------------------------------------------------ per block (tests, checks)
    def cached(self) -> dict[int, tuple[Run, int]]:
        """Every cached block -> (its view, its entry index). O(cached blocks)."""
        out: dict[int, tuple[Run, int]] = {}
        for run in self._runs:
            out.update(zip(run.blocks[run.lo:run.hi], zip(repeat(run), range(run.lo, run.hi))))
        return out

    def hash_index(self) -> dict[int, int]:
        """Chain hash -> GPU block, over every cached block. O(cached blocks)."""
        return {run.hashes[k]: block for block, (run, k) in self.cached().items()}

    def entry_ids(self) -> list[int]:
        return [run.id0 + k for run, k in self.cached().values()]

    def evictable_blocks(self) -> list[int]:
        """Evictable blocks, least recently used first (for tests and invariants)."""
        out: list[int] = []
        for seg in self._lru:
            if seg.a < seg.b:
                out += seg.run.blocks[seg.a:seg.b][::-1]
        return out

    # ------------------------------------------------------------------ watches
    def watch(self, hashes: Sequence[int]) -> Watch:
        """A flag raised the next time an entry is put under one of `hashes`, the chain
        hashes of some keys' leading blocks (a commit, an adoption, or an eviction into
        the host tier; a commit that continues through an existing entry counts too).
        What a memo of a failed look-up relies on: nothing it missed can have appeared
        while its watch stays down. A commit, adoption or eviction is compared only when
        its chain positions overlap the watched ones, and only over those positions: a
        match reaches the entry at position p only through the one at p - 1, so an
        entry elsewhere cannot lengthen it, even under a hash collision. Costs one
        comparison per commit or evicted stretch while kept, and a set test when the
        positions overlap."""
        w = Watch(hashes)
        self._watches.append(w)
        self._watch_reach = max(self._watch_reach, w.length)
        return w

    def unwatch(self, w: Watch) -> None:
        self._watches.remove(w)
        self._watch_reach = max((v.length for v in self._watches), default=0)

    def _notify_at(self, hashes: list[int], start: int, end: int, position: int) -> None:
        """Entries are put under hashes[start:end], at chain positions `position` on."""
        for w in self._watches:   # only positions below w.length can raise it
            if not w.dirty and position < w.length and not w.hashes.isdisjoint(
                    hashes[start:start + min(end - start, w.length - position)]):
                w.dirty = True

    # ------------------------------------------------------------------ checks
    def check_invariants(self, refcounts: Sequence[int]) -> dict[int, tuple[Run, int]]:
        """Raise AssertionError unless the runs, their index and the LRU order agree:
        no block or entry id twice, no content twice under the same parent, every view
        indexed under its first entry's hash (once), its evictable entries exactly its unreferenced
        ones and covered by its stretches, the stretches in the LRU. Returns `cached()`."""
        cached: dict[int, tuple[Run, int]] = {}
        ids = []
        for run in self._runs:
            invariant(run.lo < run.hi, f"{run} is empty but listed")
            invariant(run.lo <= run.ev <= run.hi, f"{run}: ev outside the view")
            for k in range(run.lo, run.hi):
                b = run.blocks[k]
                invariant(b not in cached, f"block {b} is cached twice")
                cached[b] = (run, k)
                ids.append(run.id0 + k)
                invariant((refcounts[b] > 0) == (k < run.ev),
                          f"{run}: entry {k} (block {b}) has {refcounts[b]} references")
                invariant(k == run.lo or refcounts[b] <= refcounts[run.blocks[k - 1]],
                          f"{run}: entry {k} has more holders than the entry before it")
            invariant(run.key == run.hashes[run.lo], f"{run} is indexed under {run.key}")
            covered = [k for s in run.segs for k in range(s.a, s.b)]
            invariant(covered == list(range(run.ev, run.hi)),
                      f"{run}: stretches cover {covered}, not {run.ev}..{run.hi - 1}")
            invariant(all(s.run is run and s.a < s.b for s in run.segs), f"{run}: a stretch is stale")
        indexed = []
        for h, first in self.heads.items():
            r = first
            while r is not None:
                invariant(r.key == h, f"{r} is indexed under {h}, not its key {r.key}")
                indexed.append(r)
                r = r.same
        invariant(len(indexed) == len(self._runs) and set(indexed) == set(self._runs),
                  "the index and the views disagree")
        at = Counter(r.lo for r in self._runs)
        invariant(at == Counter(self._head_at) and self._head_positions == sorted(at),
                  "the chain positions of the views' first entries are off")
        held = Counter((run.hashes[k], run.parent_of(k), run.contents[k]) for run, k in cached.values())
        invariant(held.most_common(1)[0][1] == 1 if held else True,
                  "the same content under the same parent is cached twice")
        invariant(len(set(ids)) == len(ids) and all(i < self._next_entry_id for i in ids),
                  "cache entry ids are not unique")
        live = [s for s in self._lru if s.a < s.b]
        invariant(len(self._lru) - len(live) == self._num_dead, "dead stretch count is off")
        invariant(sorted(map(id, live)) == sorted(id(s) for r in self._runs for s in r.segs),
                  "the LRU order and the runs' stretches disagree")
        place = {id(s): n for n, s in enumerate(live)}
        for r in self._runs:   # a run's stretches: higher entries parked earlier
            order = [place[id(s)] for s in r.segs]
            invariant(order == sorted(order, reverse=True), f"{r}: stretches out of LRU order")
        invariant(sum(s.b - s.a for s in live) == self._num_evictable, "evictable count is off")
        return cached

