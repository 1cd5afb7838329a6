"""The CPU (host) tier of the prefix cache: unit tests of each move and of the
same-step hazards, and a shadow-memory state machine that plays whole engine steps.

The machine is the executor: within a step it only records what the manager's calls ask
for (swaps, copy-on-write copies, the tokens to compute); at the end of the step it takes
the host-tier copies (`take_transfers`) and performs everything in the executor's order
(offloads, swap-outs, swap-ins, loads, copies, then compute, then `mark_computed`). Then
every sequence must read exactly its own tokens through its block table, and every prefix
hit must have handed out the right content, whichever tier it came from.
"""
from __future__ import annotations

import copy
from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import example, given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from _batch_growth import append_many_as_one_by_one

from servelab.memory import AllocStatus, BlockManagerError
from servelab.simulator.speed import RunPagedBlockManager
from servelab.simulator.speed import prefix_runs
from servelab.simulator.speed.block_keys import BlockKeys
from servelab.simulator.speed.host_runs import HostTier

BS = 2


def keys(*contents):
    return [tuple(c) if isinstance(c, (list, tuple)) else (c, c) for c in contents]


def manager(gpu=4, host=4, cpu=0):
    return RunPagedBlockManager(BS, gpu, cpu, enable_prefix_caching=True, num_host_blocks=host)


def fill(m, seq, contents, tokens):
    """Allocate, compute and free one sequence: its full blocks end up evictable."""
    m.allocate(seq, tokens, contents)
    m.mark_computed(seq, tokens)
    m.free(seq)


# --------------------------------------------------------------------------- unit tests
def test_evicted_prefix_blocks_move_to_the_host_and_hits_come_back():
    m = manager(gpu=4, host=4)
    a = keys(1, 2, 3)
    fill(m, "a", a, 7)                      # 4 blocks: 3 committed + a partial one
    assert m.take_transfers() == ([], [])
    fill(m, "b", keys(9, 8, 7), 7)          # evicts a's committed blocks (LRU: tail first)
    offloads, loads = m.take_transfers()
    assert len(offloads) == 3 and loads == []
    assert m.usage().num_host_cached_blocks == 3
    hit = m.allocate("c", 7, a)             # a's prefix again: all three from the host
    assert hit == 6 and m.host_hit_tokens("c") == 6
    offloads2, loads = m.take_transfers()
    assert sorted(h for h, _ in loads) == sorted(h for _, h in offloads)
    assert {g for _, g in loads} <= set(m.block_table("c")[:3])
    m.check_invariants()


def test_a_host_hit_needs_a_fresh_gpu_block_like_a_miss():
    m = manager(gpu=4, host=4)
    fill(m, "a", keys(1, 2, 3), 7)
    fill(m, "b", keys(9, 8, 7), 7)
    m.take_transfers()
    held = m.allocate("x", 3)               # 2 of 4 GPU blocks held by someone else
    assert held == 0
    # a's 3 blocks are on the host now: 4 blocks are needed on the GPU, 2 are free
    assert m.can_allocate(7, keys(1, 2, 3)) is AllocStatus.LATER
    m.free("x")
    assert m.can_allocate(7, keys(1, 2, 3)) is AllocStatus.OK


def test_an_eviction_larger_than_the_tier_keeps_its_newest_entries():
    """A freed sequence's tail is released (and evicted) before its head; a tier of two
    blocks that receives all four must keep the head, the only part a later prompt can hit."""
    m = manager(gpu=5, host=2)
    a = keys(1, 2, 3, 4)
    fill(m, "a", a, 9)                      # 4 committed blocks + a partial one
    fill(m, "b", keys(9, 8, 7, 6), 9)       # evicts all four of a's, tail first
    offloads, _ = m.take_transfers()
    assert len(offloads) == 2
    assert m.usage().num_host_cached_blocks == 2
    assert m.allocate("c", 9, a) == 2 * BS     # a's first two blocks, from the host
    assert m.host_hit_tokens("c") == 2 * BS
    m.check_invariants()


def test_host_lru_evicts_least_recently_offloaded_first():
    m = manager(gpu=2, host=2)
    fill(m, "a", keys(1), 3)
    fill(m, "b", keys(2), 3)                # a's block goes to the host
    fill(m, "c", keys(3), 3)                # b's block goes to the host
    fill(m, "d", keys(4), 3)                # c's: the host is full, a's is dropped
    m.take_transfers()
    assert m.can_allocate(3, keys(1)) is AllocStatus.OK
    assert m._match(3, keys(1)).blocks == []          # a's is gone
    assert m.allocate("y", 3, keys(2)) == 2 and m.host_hit_tokens("y") == 2   # b's is not
    m.check_invariants()


def test_loaded_then_evicted_in_one_step_moves_nothing():
    m = manager(gpu=4, host=4)
    fill(m, "a", keys(1, 2), 5)
    fill(m, "b", keys(5, 6, 7), 7)          # a's two blocks go to the host
    m.take_transfers()
    assert m.allocate("c", 5, keys(1, 2)) == 4   # loads pending
    m.free("c")                                  # before the step ran
    fill(m, "d", keys(8, 9, 10), 7)              # evicts c's blocks again
    offloads, loads = m.take_transfers()
    assert loads == [], "a load into a block evicted before the step must be dropped"
    assert not {g for g, _ in offloads} & set(), "nothing to copy for the cancelled load"
    assert m.allocate("e", 5, keys(1, 2)) == 4 and m.host_hit_tokens("e") == 4
    m.check_invariants()


def test_a_host_block_loaded_from_is_not_reused_in_the_same_step():
    m = manager(gpu=3, host=2)
    fill(m, "a", keys(1, 2), 5)
    fill(m, "b", keys(5, 6), 5)             # a's blocks on the host (it is full)
    m.take_transfers()
    assert m.allocate("c", 5, keys(1, 2)) == 4   # takes both host entries: loads pending
    offloads, loads = m.take_transfers()
    assert len(loads) == 2
    # in one step: both host blocks are read by loads, so an eviction in the same step
    # finds no host block to write and drops the evicted entry instead
    m2 = manager(gpu=3, host=2)
    fill(m2, "a", keys(1, 2), 5)
    fill(m2, "b", keys(5, 6), 5)
    m2.take_transfers()
    m2.allocate("c", 5, keys(1, 2))
    m2.free("c")
    fill(m2, "d", keys(7), 3)
    offloads, loads = m2.take_transfers()
    sources = {h for h, _ in loads}
    assert not sources & {h for _, h in offloads}, "an offload overwrote a host block a load reads"
    m2.check_invariants()


def test_an_offload_into_a_host_block_evicted_again_in_the_step_is_dropped():
    m = manager(gpu=2, host=1)
    fill(m, "a", keys(1), 3)
    fill(m, "b", keys(2), 3)                # a's block -> the host block (pending offload)
    fill(m, "c", keys(3), 3)                # b's block -> the same host block: a's dropped
    offloads, _ = m.take_transfers()
    assert len(offloads) == 1, offloads
    assert len({h for _, h in offloads}) == len(offloads)
    m.check_invariants()


def test_a_gpu_commit_drops_the_host_copy_of_the_same_content():
    m = manager(gpu=3, host=4)
    fill(m, "a", keys(1, 2), 5)
    fill(m, "b", keys(3, 4), 5)             # a's blocks -> host
    m.take_transfers()
    assert m.usage().num_host_cached_blocks == 2
    # the last block of a fully cached prompt is computed again: its commit on the GPU
    # drops the host copy (each content sits in one tier)
    assert m.allocate("c", 4, keys(1, 2)) == 2   # hits 1 block (the last is computed)
    second = BlockKeys(keys(1, 2)).hashes[1]
    assert second in m._host.index.block_of_hash
    m.mark_computed("c", 4)
    m.take_transfers()
    assert second not in m._host.index.block_of_hash
    assert m._cache.hash_index()[second] == m.block_table("c")[1]
    m.check_invariants()


def test_tier_needs_prefix_caching_and_counts_blocks():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        RunPagedBlockManager(BS, 4, num_host_blocks=2)
    with pytest.raises(ValueError, match="num_host_blocks"):
        RunPagedBlockManager(BS, 4, enable_prefix_caching=True, num_host_blocks=-1)
    m = manager(gpu=4, host=3)
    assert m.num_host_blocks == 3 and m.usage().num_host_total_blocks == 3


def test_free_blocks_without_offload_exclude_evictable_ones():
    m = manager(gpu=4, host=2)
    fill(m, "a", keys(1, 2), 5)
    assert m.num_free_blocks == 4 and m.num_free_blocks_without_offload == 2
    plain = RunPagedBlockManager(BS, 4, enable_prefix_caching=True)
    fill(plain, "a", keys(1, 2), 5)
    assert plain.num_free_blocks_without_offload == plain.num_free_blocks == 4


def test_check_invariants_catches_a_host_block_both_free_and_cached():
    m = manager(gpu=2, host=2)
    fill(m, "a", keys(1), 3)
    fill(m, "b", keys(2), 3)
    m.take_transfers()
    m.check_invariants()
    cached = next(iter(m._host.index.block_of_hash.values()))
    m._host._free.append(cached)
    with pytest.raises(AssertionError, match="host"):
        m.check_invariants()


def test_check_invariants_catches_content_in_both_tiers():
    m = manager(gpu=2, host=2)
    fill(m, "a", keys(1), 3)
    fill(m, "b", keys(2), 3)
    m.take_transfers()
    h = next(iter(m._host.index.block_of_hash))
    gpu_block = m._cache.evictable_blocks()[0]
    run, k = m._cache.cached()[gpu_block]   # the GPU entry takes the host entry's place
    hb = m._host.index.block_of_hash[h]
    run.hashes[k], run.contents[k] = h, m._host.index.content[hb]
    if k > run.origin:
        run.id0 = m._host.index.parent_id[hb] + 1 - k
    else:
        run.parent_id = m._host.index.parent_id[hb]
    if k == run.lo:
        del m._cache.heads[run.key]
        m._cache.heads[h] = run
        run.key = h
    with pytest.raises(AssertionError):
        m.check_invariants()


# --------------------------------------------------------------------------- state machine
def family_tokens(family: int, n: int) -> list[int]:
    return [(i * (family + 1)) % 3 for i in range(n)]


class EpochMachine(RuleBasedStateMachine):
    """Random calls grouped into steps; copies and writes performed at each step's end."""

    host_blocks = 3

    def __init__(self) -> None:
        super().__init__()
        self.m = RunPagedBlockManager(BS, 7, 6, watermark_blocks=1, enable_prefix_caching=True,
                                   num_host_blocks=self.host_blocks)
        self.tokens: dict[int, list[int]] = {}
        self.shadow: dict[tuple[str, int, int], int] = {}
        self.next_seq = 0
        self.next_value = 100
        self.kept_keys: dict[tuple[int, int], BlockKeys] = {}
        self.history: list[list[int]] = []
        self._new_step()

    def _new_step(self) -> None:
        self.swaps: list[tuple[str, str, list]] = []     # (src pool, dst pool, pairs) in order
        self.copies: list[tuple[int, int]] = []
        self.writes: dict[int, int] = {}                 # seq -> first token to compute
        self.hit_checks: list[tuple[int, int]] = []      # (seq, hit tokens)
        self.touched: set[int] = set()                   # seqs swapped in this step
        self.frozen = False
        """A sequence was freed while copies were pending: as a scheduler that preempted
        admits nothing new and swaps nothing in, the step takes no new blocks to write
        (a freed copy-on-write source must stay as it is until the copies run, last)."""

    def gpu_seqs(self):
        return [s for s in self.tokens if not self.m.is_swapped(s)]

    def contents(self, tokens):
        return [tuple(tokens[i:i + BS]) for i in range(0, len(tokens) - BS + 1, BS)]

    # --------------------------------------------------------------- rules
    @rule(family=st.integers(0, 2), n=st.integers(1, 10), diverge=st.integers(0, 10),
          reuse=st.booleans())
    def allocate(self, family, n, diverge, reuse):
        tokens = family_tokens(family, n)
        for i in range(diverge, n):
            tokens[i] = self.next_value
            self.next_value += 1
        contents = self.contents(tokens)
        if reuse and diverge >= n:   # the same BlockKeys object each time: LATER memos
            contents = self.kept_keys.setdefault((family, n), BlockKeys(contents))
        self.history = (self.history + [tokens])[-4:]
        self._allocate(tokens, contents)

    @rule(pick=st.integers(0, 3), extra=st.integers(0, 3))
    def allocate_again(self, pick, extra):
        """A prompt seen before (plus a few new tokens): hits in whichever tier its
        blocks have reached since."""
        if not self.history:
            return
        tokens = self.history[pick % len(self.history)] + list(
            range(self.next_value, self.next_value + extra))
        self.next_value += extra
        self._allocate(tokens, self.contents(tokens))

    def _allocate(self, tokens, contents):
        """Allocate, freeing the oldest sequences first while memory is short (as
        finishing requests would): the churn that pushes blocks to the host and back."""
        n = len(tokens)
        while not self.frozen and self.m.can_allocate(n, contents) is AllocStatus.LATER \
                and self.idle():
            self.free(min(self.idle()))
        if self.frozen:
            return
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        if self.m.can_allocate(n, contents) is not AllocStatus.OK:
            with pytest.raises(BlockManagerError):
                self.m.allocate(seq, n, contents)
            return
        hit = self.m.allocate(seq, n, contents)
        assert hit % BS == 0 and 0 <= hit < n
        assert 0 <= self.m.host_hit_tokens(seq) <= hit
        self.tokens[seq] = tokens
        self.writes[seq] = hit
        self.hit_checks.append((seq, hit))

    @rule(pick=st.integers(0, 1 << 16), k=st.integers(1, 3))
    def append(self, pick, k):
        seqs = [s for s in self.gpu_seqs()]
        if not seqs:
            return
        seq = seqs[pick % len(seqs)]
        if not self.m.can_append_slots(seq, k):
            return
        self.copies += self.m.append_slots(seq, k)
        start = len(self.tokens[seq])
        self.tokens[seq] += list(range(self.next_value, self.next_value + k))
        self.next_value += k
        self.writes.setdefault(seq, start)

    @rule(mask=st.integers(1, (1 << 16) - 1),
          ks=st.lists(st.integers(0, 3), min_size=16, max_size=16))
    def append_many(self, mask, ks):
        """append_slots_many takes the very blocks, makes the very copies and leaves the
        very host-tier transfers of append_slots called for each sequence in turn (the
        batch that runs the GPU dry evicts, and offloads, in bulk), or fails changing
        nothing."""
        group = [(s, ks[i % 16]) for i, s in enumerate(self.gpu_seqs()) if mask >> (i % 16) & 1]
        if not group:
            return
        copies, before = append_many_as_one_by_one(self.m, group, self.state)
        if copies is None:
            assert self.state(self.m) == self.state(before)
            return
        self.copies += copies
        for s, k in group:
            start = len(self.tokens[s])
            self.tokens[s] += list(range(self.next_value, self.next_value + k))
            self.next_value += k
            self.writes.setdefault(s, start)

    def state(self, m):
        """What a call can change, pending host transfers included (read off a copy)."""
        tables = {s: (m.block_table(s), m.num_tokens(s)) for s in self.tokens}
        return tables, m.usage(), m.evictable_blocks(), copy.deepcopy(m).take_transfers()

    @rule(pick=st.integers(0, 1 << 16))
    def fork(self, pick):
        seqs = [s for s in self.gpu_seqs() if s not in self.writes]
        if not seqs:
            return
        parent = seqs[pick % len(seqs)]
        child, self.next_seq = self.next_seq, self.next_seq + 1
        self.m.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    def idle(self) -> list:
        """Sequences that may finish now: not written this step (a scheduler frees a
        request after the step that computed it, never within it)."""
        return sorted(s for s in self.tokens if s not in self.writes)

    @rule(pick=st.integers(0, 1 << 16))
    def free_one(self, pick):
        if self.idle():
            self.free(self.idle()[pick % len(self.idle())])

    def free(self, seq):
        self.m.free(seq)
        del self.tokens[seq]
        self.writes.pop(seq, None)
        self.hit_checks = [(s, h) for s, h in self.hit_checks if s != seq]
        self.frozen = self.frozen or bool(self.copies)

    @rule()
    def free_all(self):
        """Everything not computed this step finishes: its full blocks become evictable,
        to be pushed to the host by the next allocations and hit there by later ones."""
        for seq in self.idle():
            self.free(seq)

    @rule(mask=st.integers(1, (1 << 16) - 1))
    def swap_out(self, mask):
        seqs = [s for s in self.gpu_seqs() if s not in self.writes and s not in self.touched]
        group = [s for i, s in enumerate(seqs) if mask >> (i % 16) & 1]
        if group and self.m.can_swap_out(group):
            self.swaps.append(("gpu", "cpu", self.m.swap_out(group)))

    @rule(mask=st.integers(1, (1 << 16) - 1))
    def swap_in(self, mask):
        seqs = [s for s in self.tokens if self.m.is_swapped(s)]
        group = [s for i, s in enumerate(seqs) if mask >> (i % 16) & 1]
        if group and not self.frozen and self.m.can_swap_in(group) is AllocStatus.OK:
            self.swaps.append(("cpu", "gpu", self.m.swap_in(group)))
            self.touched.update(group)

    @rule()
    def end_step(self):
        offloads, loads = self.m.take_transfers()
        for pairs in (offloads, loads, self.copies):
            assert len({dst for _, dst in pairs}) == len(pairs), "two copies to one block"
        self._copy(offloads, "gpu", "host")
        for src, dst, pairs in self.swaps:
            self._copy(pairs, src, dst)
        self._copy(loads, "host", "gpu")
        self._copy(self.copies, "gpu", "gpu")
        holders = Counter(b for s in self.gpu_seqs() for b in self.m.block_table(s))
        for seq, start in self.writes.items():
            table = self.m.block_table(seq)
            for i in range(start, len(self.tokens[seq])):
                block = table[i // BS]
                assert holders[block] == 1, f"write into block {block}, shared by {holders[block]}"
                self.shadow[("gpu", block, i % BS)] = self.tokens[seq][i]
        for seq in self.writes:
            self.m.mark_computed(seq, len(self.tokens[seq]))
        for seq, hit in self.hit_checks:
            for i in range(hit):
                assert self.read(seq, i) == self.tokens[seq][i], f"prefix hit on wrong content at {i}"
        for seq, tokens in self.tokens.items():
            for i, value in enumerate(tokens):
                assert self.read(seq, i) == value, f"sequence {seq} lost token {i}"
        self._new_step()

    def read(self, seq, i):
        pool = "cpu" if self.m.is_swapped(seq) else "gpu"
        return self.shadow.get((pool, self.m.block_table(seq)[i // BS], i % BS))

    def _copy(self, pairs, src_pool, dst_pool):
        for src, dst in pairs:
            for o in range(BS):
                value = self.shadow.get((src_pool, src, o))
                if value is None:
                    self.shadow.pop((dst_pool, dst, o), None)
                else:
                    self.shadow[(dst_pool, dst, o)] = value

    @invariant()
    def manager_invariants_hold(self):
        self.m.check_invariants()
        u = self.m.usage()
        assert u.num_host_cached_blocks <= u.num_host_total_blocks
        assert u.num_free_blocks + u.num_used_blocks + u.num_cached_blocks == u.num_total_blocks

    @invariant()
    def swap_pool_is_accounted_apart(self):
        """The swap pool holds exactly the swapped sequences' blocks and the host tier
        exactly its cached entries: blocks never pass from one to the other."""
        u = self.m.usage()
        swapped = {b for s in self.tokens if self.m.is_swapped(s) for b in self.m.block_table(s)}
        assert u.num_cpu_used_blocks == len(swapped) and u.num_cpu_total_blocks == 6
        assert u.num_host_total_blocks == self.host_blocks
        assert u.num_host_cached_blocks == len(self.m._host.index.entry_id)


class TinyHostMachine(EpochMachine):
    host_blocks = 1


class LargeHostMachine(EpochMachine):
    host_blocks = 12


SETTINGS = settings(max_examples=150, deadline=None, stateful_step_count=60)


@pytest.mark.parametrize("machine", [EpochMachine, TinyHostMachine, LargeHostMachine])
def test_host_tier_steps_keep_every_token(machine):
    run_state_machine_as_test(machine, settings=SETTINGS)


def test_host_tier_with_a_weak_hash(monkeypatch):
    """Collisions everywhere: hits from either tier must still be exact."""
    monkeypatch.setattr(prefix_runs, "chain_hash", lambda parent, content: hash(content) % 3)
    run_state_machine_as_test(EpochMachine, settings=SETTINGS)


# --------------------------------------------------------------------------- bulk offloads
class OneAtATimeTier(HostTier):
    """The host tier storing every eviction through its one-entry-at-a-time path."""

    __slots__ = ()

    def store(self, gpu_blocks, entries):
        back = [self._loads.pop(gb, None) for gb in gpu_blocks] if self._loads else None
        self._store_each(gpu_blocks, entries, back)


def host_state(m):
    host = m._host
    return (host._free, host.lru_blocks(), dict(host.index.block_of_hash),
            list(host._pending_free), list(host._loads.items()), host.pending_offloads())


@settings(max_examples=200, deadline=None)
@example(  # a commit drops an evictable entry whose load from the host is still pending
    ops=[(2, 3, 0), (1, 4, 1), (0, 1, 0), (0, 1, 0), (0, 1, 0), (0, 1, 0), (0, 1, 3),
         (0, 4, 0), (1, 2, 0), (0, 1, 3), (0, 1, 3), (2, 3, 4), (0, 3, 4), (1, 3, 0),
         (0, 1, 0), (0, 1, 0), (0, 1, 0), (0, 1, 0), (0, 1, 3), (0, 2, 0)],
    host=2, weak_hash=True)
@example(  # the same, the load's host block also awaiting an offload in that step
    ops=[(0, 1, 0), (0, 1, 0), (1, 5, 0), (0, 1, 0), (0, 1, 0), (0, 1, 0), (0, 1, 0),
         (0, 1, 0), (0, 1, 0), (0, 1, 0), (0, 1, 3), (0, 1, 3), (0, 1, 3), (0, 1, 0),
         (0, 4, 4), (0, 1, 3), (1, 5, 0), (3, 4, 0), (0, 1, 3), (0, 1, 0)],
    host=1, weak_hash=True)
@given(ops=st.lists(st.tuples(st.integers(0, 11), st.integers(1, 5),
                              st.sampled_from([0, 1, 2, 3, 4, 4, 4])),
                    min_size=20, max_size=80),
       host=st.integers(1, 12), weak_hash=st.booleans())
def test_bulk_offloads_move_the_same_blocks_as_one_at_a_time(ops, host, weak_hash):
    """`HostTier.store` in bulk and entry by entry must take the same host blocks in the
    same order: same copies, same LRU order, same free stack, on random workloads whose
    prompts share prefixes (families share their first blocks), with evictions larger
    than the tier, loads evicted again within a step, and colliding hashes. Actions:
    0 and 4 admit and compute a prompt (4 frees it at once), 1 admit it only (its loads
    stay pending), 2 end the step (take the copies), 3 free the oldest live sequence."""
    original = prefix_runs.chain_hash
    if weak_hash:
        prefix_runs.chain_hash = lambda parent, content: hash(content) % 5
    try:
        bulk, each = manager(gpu=9, host=host), manager(gpu=9, host=host)
        each._host.__class__ = OneAtATimeTier
        live: list[str] = []
        for n, (family, nblocks, action) in enumerate(ops):
            if action == 2:
                assert bulk.take_transfers() == each.take_transfers()
            elif action == 3:
                if live:
                    seq = live.pop(0)
                    bulk.free(seq)
                    each.free(seq)
            else:
                contents = keys(*[(family % 2, i) if i < 2 else (family, i) for i in range(nblocks)])
                tokens, seq = nblocks * BS + 1, f"s{n}"
                status = bulk.can_allocate(tokens, contents)
                assert each.can_allocate(tokens, contents) is status
                if status is AllocStatus.OK:
                    assert bulk.allocate(seq, tokens, contents) == each.allocate(seq, tokens, contents)
                    if action != 1:
                        bulk.mark_computed(seq, tokens)
                        each.mark_computed(seq, tokens)
                    if action == 4:
                        bulk.free(seq)
                        each.free(seq)
                    else:
                        live.append(seq)
            assert host_state(bulk) == host_state(each)
            assert [bulk.block_table(s) for s in live] == [each.block_table(s) for s in live]
        bulk.check_invariants()
        each.check_invariants()
    finally:
        prefix_runs.chain_hash = original
