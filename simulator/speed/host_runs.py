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

The GPU cache (`PrefixCache`) is the only caller: it hands the tier what it evicts
(`store`), asks it for hits (`find`, `load`), tells it what a commit entered (`discard`)
and which GPU blocks a load fills (`loading`, `dropped`). The tier never calls back; the
block manager takes the copies (`take_transfers`) once per engine step, and the executor
performs them before anything else in that step: offloads first (they read GPU blocks
about to be reused), then, after swaps, loads. Within one step's worth of calls:

- a host block that was loaded from is not reused until the copies are taken (it waits
  in `_pending_free`), so an offload cannot overwrite it before the load reads it;
- an offload into a host block whose entry is evicted again in the same step is dropped
  (nothing will read it);
- a GPU block whose pending load has not happened yet and is evicted again gives its
  entry back to the host block it came from (no copy either way).

Copy-on-write copies run last, after the loads, so a block freed during a step may still
be the source (or target) of one of that step's copies: a step that frees a sequence
after a copy-on-write must not then swap in or allocate blocks that a load writes. The
scheduler keeps to this, since a step that preempted anything admits nothing and swaps
nothing in; the host-tier state machine in the tests does the same.

Runs. An eviction hands over the tails of GPU runs (`Entries`: consecutive entries of one
chain, over a sequence's own key lists), and each becomes one `HostRun` over the same
lists, its entries in a stretch of the host blocks that `store` took (one list, shared
with the copies it records). The LRU order is a queue of runs, each given up from its
top entry down (the order the GPU evicted them in, as a per-block LRU would keep them).
The index holds each run's first entry under its chain hash, as the GPU cache's does
(`heads`, with the chain positions those entries sit at). A hit takes a stretch out of a
run, splitting it if it lies inside.

Why looking up heads finds what a per-block index would: each hash names one entry
across both tiers (a GPU commit drops the host copy, a move moves the entry), an entry
holding the chain hash of position p sits at position p, and it is reached only through
the entry at p - 1. A match that reaches an entry inside a host run came through the
entry before it, in the same run: it compares the run's contents by slices. A GPU commit
of positions start .. end - 1 can meet a host entry inside a run only at `start`, after
the chain's last entry, when that one is on the host too (the lowest position met has
its parent in the run; a parent at a new position would have been met lower): `discard`
looks there and at the heads sitting at the new positions. Finding the run that holds a
given entry scans the runs: only a commit whose chain's last entry left the GPU asks
(`holds`; never on the Mooncake benchmark). A commit whose chain's last entry left both
tiers scans the tier (`discard_anywhere`, rare, as the GPU cache's own `_commit_each`
is). All of this holds without hash collisions; under one, runs whose first entries
share a hash are chained (`HostRun.same`), several entries may share a hash, and the
decisions may differ from a per-block cache's, but a hit still compares parent ids and
contents: never a wrong reuse. (tests/test_host_tier_runs.py checks the decisions
against a per-block oracle of both tiers.)

Costs: O(1) Python steps per run stored, given up, hit or dropped; host blocks, key
lists and copies move as list slices or not at all. A commit costs a bisection of the
head positions, and a look-up of each head sitting among its positions. A `store`
goes one entry at a time (`_store_each`) only when the eviction overflows the tier or
evicts a block whose load is still pending.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import Counter, deque
from typing import Hashable, NamedTuple, Sequence

from servelab.memory.base import invariant
from servelab.outputs import BlockPairs

from .prefix_runs import Entries, agree, index_run, unindex_run


class HostRun:
    """Entries lo .. hi - 1 of a chain (as `Entries` names them: hashes[k], contents[k],
    id id0 + k, the parent of the one at `origin` parent_id), held in host blocks: the
    entry at position k in blocks[top - k] (the list is in eviction order and may hold
    other runs' blocks too). Given up from hi - 1 down; empty (lo == hi) once all of it
    left the tier."""

    __slots__ = ("hashes", "contents", "id0", "origin", "parent_id", "lo", "hi", "blocks",
                 "top", "key", "same", "batch")

    def __init__(self, hashes: list[int], contents: list[Hashable], id0: int, origin: int,
                 parent_id: int, lo: int, hi: int, blocks: list[int], top: int,
                 batch: _Batch | None) -> None:
        self.hashes, self.contents = hashes, contents
        self.id0, self.origin, self.parent_id = id0, origin, parent_id
        self.lo, self.hi = lo, hi
        self.blocks, self.top = blocks, top
        self.key: int | None = None
        """The hash it is indexed under (its entry lo's)."""
        self.same: HostRun | None = None
        """The next run indexed under the same hash (a hash collision), or None."""
        self.batch = batch
        """The `store` that offloaded its entries (its copies may still be pending)."""

    def parent_of(self, k: int) -> int:
        return self.id0 + k - 1 if k > self.origin else self.parent_id

    def blocks_of(self, a: int, b: int) -> list[int]:
        """The host blocks of entries a .. b - 1, in position order."""
        top = self.top
        return self.blocks[top - b + 1:top - a + 1][::-1]

    def __repr__(self) -> str:
        return f"HostRun(ids {self.id0}+[{self.lo}:{self.hi}])"


class _Batch:
    """The offloads of one `store`: gpu[i] is copied to host[i], in eviction order.
    `cancelled`: host blocks whose entry left the tier again before the copies were
    taken (nothing will read them); `pending` until they are taken."""

    __slots__ = ("gpu", "host", "cancelled", "pending")

    def __init__(self, gpu: list[int], host: list[int]) -> None:
        self.gpu, self.host = gpu, host
        self.cancelled: set[int] | None = None
        self.pending = True

    def cancel(self, host_blocks: list[int]) -> None:
        if self.cancelled is None:
            self.cancelled = set(host_blocks)
        else:
            self.cancelled.update(host_blocks)


class HostHit(NamedTuple):
    """Entries a .. b - 1 of a host run that a look-up matched."""

    run: HostRun
    a: int
    b: int
    blocks: list[int]
    """Their host blocks."""
    last_id: int
    """The entry id of the last one."""


class HostIndex(NamedTuple):
    """The tier one block at a time (for tests and checks): the host block under each
    hash (the most recently used one, should hashes collide) and each held block's
    entry."""

    block_of_hash: dict[int, int]
    entry_id: dict[int, int]
    parent_id: dict[int, int]
    content: dict[int, Hashable]


class HostTier:
    """Prefix blocks in host memory: runs of entries with their index and LRU order, a
    free list and the copies not yet handed to the executor."""

    __slots__ = ("num_blocks", "heads", "_head_at", "_head_positions", "_lru", "_num_dead",
                 "_num_cached", "_free",
                 "_pending_free", "_batches", "_loads", "offloaded", "loaded")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.heads: dict[int, HostRun] = {}
        """Each run under its first entry's hash (others under the same hash follow it
        through `HostRun.same`)."""
        self._head_at: dict[int, int] = {}
        """Chain position -> how many runs have their first entry there."""
        self._head_positions: list[int] = []
        """The keys of `_head_at`, sorted."""
        self._lru: deque[HostRun] = deque()
        """Runs, least recently used first, each given up from its top down; empty ones
        are skipped."""
        self._num_dead = 0
        """Empty runs still in `_lru`."""
        self._num_cached = 0
        self._free = list(range(num_blocks - 1, -1, -1))
        self._pending_free: dict[int, _Batch | None] = {}
        """Host blocks loaded from since the copies were last taken (reusable after),
        with the store whose offload into them may still be pending."""
        self._batches: list[_Batch] = []
        """The stores since the copies were last taken."""
        self._loads: dict[int, int] = {}
        """GPU block -> host block: copies host -> GPU not yet taken."""
        self.offloaded = 0
        """Blocks copied to the host so far (offloads taken, cancelled ones excluded)."""
        self.loaded = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_cached(self) -> int:
        return self._num_cached

    def find(self, hashes: list[int], contents: list[Hashable], i: int, parent_id: int,
             limit: int) -> HostHit | None:
        """The longest stretch of a host run that holds the keys' blocks i .. (at most
        limit - 1), the first one's parent being entry `parent_id`; None if there is none.
        O(1) Python steps, the run compared by slices."""
        run = self.heads.get(hashes[i])
        while run is not None:   # more than one run only under a hash collision
            lo = run.lo
            if (run.id0 + lo - 1 if lo > run.origin else run.parent_id) == parent_id \
                    and run.contents[lo] == contents[i]:
                b = i + agree(run.contents, contents, i, min(run.hi - lo, limit - i))
                return HostHit(run, i, b, run.blocks_of(i, b), run.id0 + b - 1)
            run = run.same
        return None

    def holds(self, entry_id: int, position: int) -> bool:
        """Is entry `entry_id`, at chain position `position`, in the tier?"""
        return self._holder(entry_id, position) is not None

    def entry_ids(self) -> list[int]:
        """The ids of every entry held. O(entries)."""
        return [run.id0 + k for run in self._runs() for k in range(run.lo, run.hi)]

    @property
    def index(self) -> HostIndex:
        """The tier one block at a time (for tests and checks). O(entries)."""
        out = HostIndex({}, {}, {}, {})
        for run in self._lru:
            for k in range(run.hi - 1, run.lo - 1, -1):   # least recently used first
                b = run.blocks[run.top - k]
                out.block_of_hash[run.hashes[k]] = b
                out.entry_id[b], out.parent_id[b] = run.id0 + k, run.parent_of(k)
                out.content[b] = run.contents[k]
        return out

    # ------------------------------------------------------------------ moves
    def store(self, gpu_blocks: list[int], evicted: list[Entries]) -> None:
        """Entries evicted from the GPU, in eviction order (each `Entries` from its top
        down), with the blocks they leave (`gpu_blocks`, in the same order). A block
        whose own load is still pending hands its entry back to its host block; the
        others are offloaded, newest in the host LRU order. When one eviction is larger
        than the tier, its newest entries are the ones kept (a sequence's head, released
        after its tail), as an LRU keeps them.

        In bulk when the free and held host blocks suffice (the common case): host blocks
        are taken as `_take_block` would take them one by one (free ones from the top of
        the stack, then the least recently used), each `Entries` becoming one run."""
        loads = self._loads
        if loads and not loads.keys().isdisjoint(gpu_blocks):   # rare: tested in C first
            self._store_each(gpu_blocks, evicted, [loads.pop(gb, None) for gb in gpu_blocks])
            return
        need = len(gpu_blocks)
        free = self._free
        if need > len(free) + self._num_cached:
            self._store_each(gpu_blocks, evicted, None)
            return
        k = min(need, len(free))
        if k:
            fresh = free[:-k - 1:-1]   # top of the stack first
            del free[len(free) - k:]
        else:
            fresh = []
        if need > k:
            self._evict(need - k, fresh)
        batch = _Batch(gpu_blocks, fresh)
        self._batches.append(batch)
        lru = self._lru
        top = -1
        for e in evicted:
            top += e.hi - e.lo
            run = HostRun(e.hashes, e.contents, e.id0, e.origin, e.parent_id, e.lo, e.hi,
                          fresh, top + e.lo, batch)
            self._index(run)
            lru.append(run)
        self._num_cached += need

    def _store_each(self, gpu_blocks: list[int], evicted: list[Entries], back: list | None) -> None:
        """`store` one entry at a time: an eviction larger than the free and held host
        blocks (it then evicts its own oldest entries), or one that evicts a block whose
        load is pending (`back`: each GPU block's host block then). This call's entries
        are parked when it ends, or when a host block can be had only by giving up one
        of them; they form the runs `store` would make (save where one was dropped or
        went back to its host block)."""
        waiting: list[tuple] = []   # (entries, position, GPU block or None, host block)
        i = 0
        for e in evicted:
            for k in range(e.hi - 1, e.lo - 1, -1):
                gb = gpu_blocks[i]
                hb = back[i] if back is not None else None
                i += 1
                if hb is not None:   # loaded and evicted in one step: nothing moved yet
                    waiting.append((e, k, None, hb))
                    continue
                hb = self._take_block()
                if hb is None and waiting:   # full of this call's own entries: LRU among them
                    self._park(waiting)
                    waiting = []
                    hb = self._take_block()
                if hb is None:   # every host block waits for a load: drop the entry
                    continue
                waiting.append((e, k, gb, hb))
        self._park(waiting)

    def _park(self, waiting: list[tuple]) -> None:
        """Enter `_store_each`'s entries (entries, position, GPU block or None when it
        went back to its host block, host block) in order, as runs of consecutive
        offloaded entries, each run's offloads one batch."""
        n = 0
        while n < len(waiting):
            e, k, gb, hb = waiting[n]
            m = n + 1
            if gb is None:   # back in its host block: an offload into it was another store's
                batch = self._pending_free.pop(hb)
                hbs = [hb]
            else:
                while m < len(waiting) and waiting[m][0] is e and waiting[m][2] is not None \
                        and waiting[m][1] == k - (m - n):
                    m += 1
                hbs = [w[3] for w in waiting[n:m]]
                batch = _Batch([w[2] for w in waiting[n:m]], hbs)
                self._batches.append(batch)
            lo = k - (m - n) + 1
            run = HostRun(e.hashes, e.contents, e.id0, e.origin, e.parent_id, lo, k + 1,
                          hbs, k, batch)
            self._index(run)
            self._lru.append(run)
            self._num_cached += m - n
            n = m

    def load(self, hit: HostHit) -> Entries:
        """Take a hit's entries out (the caller enters them on the GPU and calls
        `loading`); their host blocks are reused only after the copies are taken."""
        run, a, b = hit.run, hit.a, hit.b
        blocks = self._take_out(run, a, b)
        batch = run.batch if run.batch is not None and run.batch.pending else None
        pending = self._pending_free
        for hb in blocks:
            pending[hb] = batch
        return Entries(run.hashes, run.contents, run.id0, run.origin, run.parent_id, a, b)

    def loading(self, gpu_blocks: list[int], host_blocks: list[int]) -> None:
        """Copies host -> GPU for the blocks a load filled, pairwise."""
        self._loads.update(zip(gpu_blocks, host_blocks))

    def dropped(self, gpu_block: int) -> None:
        """A GPU block's entry was forgotten (a commit took its hash) and the block
        freed: a load into it not yet performed is cancelled, with an offload into its
        host block not yet performed either (it only fed that load), and the host block,
        which nothing will read now, is free at once."""
        hb = self._loads.pop(gpu_block, None)
        if hb is not None:
            batch = self._pending_free.pop(hb)
            if batch is not None and batch.pending:
                batch.cancel([hb])
            self._free.append(hb)

    def discard(self, hashes: list[int], start: int, end: int, parent_id: int = 0) -> None:
        """A GPU commit entered chain positions start .. end - 1 under hashes[start:end],
        after entry `parent_id` (pass it when that entry is in this tier, else 0): drop
        the host entries under those hashes, which (hash collisions aside) are the runs
        headed under them at those positions and the entries that follow `parent_id` in
        its run (see the module docstring). O(log runs) when there are none; O(1) Python
        steps per run headed at one of the positions (an entry holding the chain hash of
        position p sits at position p), the stretch that goes compared by slices."""
        if parent_id:
            run = self._holder(parent_id, start - 1)
            if run is not None and run.hi > start and run.hashes[start] == hashes[start]:
                stop = min(run.hi, end)
                n = agree(run.hashes, hashes, start, stop - start)
                self._drop(run, start, start + n)
        positions = self._head_positions
        k = bisect_left(positions, start)
        if k == len(positions) or positions[k] >= end:   # no run starts there
            return
        heads = self.heads
        for p in positions[k:bisect_left(positions, end, k)]:
            run = heads.get(hashes[p])
            while run is not None:   # more than one only under a hash collision
                lo = run.lo
                n = agree(run.hashes, hashes, lo, min(run.hi, end) - lo) if lo == p else 1
                self._drop(run, lo, lo + n)
                run = heads.get(hashes[p])

    def discard_anywhere(self, hashes: list[int], start: int, end: int) -> None:
        """`discard` for a commit whose chain's last entry left both tiers: any entry may
        then hold one of the hashes (it recomputes them). O(entries): rare."""
        wanted = set(hashes[start:end])
        where: dict[int, list[tuple[int, int]]] = {}
        for run in self._runs():
            for k in range(run.lo, run.hi):
                if run.hashes[k] in wanted:
                    where.setdefault(run.hashes[k], []).append((run.id0 + k, k))
        for h in hashes[start:end]:
            for entry_id, k in where.pop(h, ()):
                self._drop(self._holder(entry_id, k), k, k + 1)

    def take_transfers(self) -> tuple[Sequence[tuple[int, int]], Sequence[tuple[int, int]]]:
        """The copies since the last call: (GPU block, host block) offloads, then
        (host block, GPU block) loads, each as `BlockPairs` (two columns: no tuple per
        copy unless someone iterates them). Host blocks loaded from become free again."""
        if not self._batches and not self._loads:   # most steps: nothing moved
            return [], []
        gpu: list[int] = []
        host: list[int] = []
        for batch in self._batches:
            gone = batch.cancelled
            if gone is None:
                gpu += batch.gpu
                host += batch.host
            else:
                for g, h in zip(batch.gpu, batch.host):
                    if h not in gone:
                        gpu.append(g)
                        host.append(h)
            batch.pending = False
            batch.gpu = batch.host = batch.cancelled = None
        self._batches.clear()
        offloads = BlockPairs(gpu, host)
        loads = BlockPairs(list(self._loads.values()), list(self._loads))
        self._loads.clear()
        if self._pending_free:
            self._free += self._pending_free
            self._pending_free.clear()
        self.offloaded += len(offloads)
        self.loaded += len(loads)
        return offloads, loads

    # ------------------------------------------------------------------ internals
    def _evict(self, n: int, out: list[int]) -> None:
        """Give up the n least recently used entries (the caller has checked there are
        n) and append their host blocks to `out`, oldest first; pending offloads into
        them are cancelled. O(runs touched), blocks in slices."""
        lru = self._lru
        self._num_cached -= n
        while n:
            run = lru[0]
            lo, hi = run.lo, run.hi
            if lo >= hi:
                lru.popleft()
                self._num_dead -= 1
                continue
            c = hi - n if hi - lo > n else lo
            top = run.top
            out += run.blocks[top - hi + 1:top - c + 1]
            batch = run.batch
            if batch is not None and batch.pending:
                batch.cancel(run.blocks[top - hi + 1:top - c + 1])
            run.hi = c
            n -= hi - c
            if c == lo:
                lru.popleft()
                self._unindex(run)

    def _take_block(self) -> int | None:
        """A host block for an offload: a free one, else the least recently used (its
        entry is forgotten; a pending offload into it is dropped); None when no host
        block is free or holds an entry (the rest wait for a load to read them)."""
        if self._free:
            return self._free.pop()
        if not self._num_cached:
            return None
        out: list[int] = []
        self._evict(1, out)
        return out[0]

    def _drop(self, run: HostRun, a: int, b: int) -> None:
        """Forget entries a .. b - 1 of `run` (the GPU committed their hashes): their
        host blocks are free at once, pending offloads into them cancelled."""
        blocks = self._take_out(run, a, b)
        batch = run.batch
        if batch is not None and batch.pending:
            batch.cancel(blocks)
        self._free += blocks

    def _take_out(self, run: HostRun, a: int, b: int) -> list[int]:
        """Take entries a .. b - 1 out of `run` and return their host blocks, in position
        order. Inside the run, it keeps the part above (given up first, in its place in
        the LRU order) and a new run right after it takes the part below."""
        blocks = run.blocks_of(a, b)
        self._num_cached -= b - a
        lo, hi = run.lo, run.hi
        if b == hi:
            if a == lo:   # all of it
                self._unindex(run)
                run.lo = hi
                self._num_dead += 1
                if self._num_dead > 64 and self._num_dead > len(self._lru) // 2:
                    self._lru = deque(r for r in self._lru if r.lo < r.hi)
                    self._num_dead = 0
            else:
                run.hi = a
            return blocks
        self._unindex(run)
        run.lo = b
        self._index(run)
        if a > lo:
            lower = HostRun(run.hashes, run.contents, run.id0, run.origin, run.parent_id, lo, a,
                            run.blocks, run.top, run.batch)
            self._index(lower)
            self._lru.insert(self._lru.index(run) + 1, lower)
        return blocks

    def _holder(self, entry_id: int, position: int) -> HostRun | None:
        """The run holding entry `entry_id` at chain position `position`, or None.
        O(runs): rare (see the module docstring)."""
        id0 = entry_id - position
        for run in self._lru:
            if run.id0 == id0 and run.lo <= position < run.hi:
                return run
        return None

    def _runs(self) -> list[HostRun]:
        """The runs holding entries, least recently used first."""
        return [run for run in self._lru if run.lo < run.hi]

    _index = index_run      # shared with the GPU prefix cache (prefix_runs.py)
    _unindex = unindex_run

    # ------------------------------------------------------------------ checks
    def lru_blocks(self) -> list[int]:
        """Host blocks holding an entry, least recently used (next given up) first."""
        out: list[int] = []
        for run in self._runs():
            top = run.top
            out += run.blocks[top - run.hi + 1:top - run.lo + 1]
        return out

    def pending_offloads(self) -> list[tuple[int, int]]:
        """(GPU block, host block) offloads not yet taken, in order (for tests)."""
        return [(g, h) for batch in self._batches for g, h in zip(batch.gpu, batch.host)
                if batch.cancelled is None or h not in batch.cancelled]

    def check_invariants(self, gpu_entries: set) -> None:
        """Raise AssertionError unless host blocks are conserved (free + holding an
        entry + waiting to be free = all, disjoint), the LRU order and the index list
        exactly the runs holding entries, pending copies name blocks in the right state,
        and no content is cached in both tiers (`gpu_entries`: (hash, parent id, content)
        of every GPU entry; under a hash collision, other content may share a hash across
        tiers)."""
        runs = self._runs()
        invariant(len(self._lru) - len(runs) == self._num_dead, "host LRU: dead run count is off")
        invariant(len(set(map(id, runs))) == len(runs), "host LRU lists a run twice")
        cached = self.lru_blocks()
        invariant(len(cached) == self._num_cached, f"host tier counts {self._num_cached} entries, "
                                                  f"its runs hold {len(cached)}")
        indexed = []
        for h, first in self.heads.items():
            r = first
            while r is not None:
                invariant(r.key == h == r.hashes[r.lo], f"{r} is indexed under {h}")
                indexed.append(r)
                r = r.same
        invariant(sorted(map(id, indexed)) == sorted(map(id, runs)),
                  "the host index and the host runs disagree")
        at = Counter(r.lo for r in runs)
        invariant(at == Counter(self._head_at) and self._head_positions == sorted(at),
                  "the chain positions of the host runs' first entries are off")
        free, pending, held = set(self._free), set(self._pending_free), set(cached)
        invariant(len(free) == len(self._free), "host free list holds a block twice")
        invariant(len(held) == len(cached), "a host block holds two entries")
        invariant(not (free & held or pending & held or free & pending),
                  "a host block is both free (or waiting to be) and holding an entry")
        invariant(len(free) + len(pending) + len(held) == self.num_blocks,
                  f"host blocks: {len(free)} free + {len(pending)} pending + "
                  f"{len(held)} cached != {self.num_blocks}")
        targets = [h for _, h in self.pending_offloads()]
        invariant(len(set(targets)) == len(targets), "two pending offloads into one host block")
        invariant(set(targets) <= held | pending,   # pending: loaded after it
                  "a pending offload targets a host block without an entry")
        invariant(set(self._loads.values()) == pending,
                  "pending loads and host blocks waiting to be free disagree")
        for r in runs:
            for k in range(r.lo, r.hi):
                invariant((r.hashes[k], r.parent_of(k), r.contents[k]) not in gpu_entries,
                          f"hash {r.hashes[k]} is cached on the GPU and on the host")
