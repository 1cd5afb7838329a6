"""Unit tests of the paged block manager: accounting, admission, prefix caching (hits,
content checks, LRU eviction), fork with copy-on-write, swapping, invariants."""
from __future__ import annotations

import pytest

from servelab.config import CacheConfig
from servelab.memory import AllocStatus, BlockManagerError, ContiguousBlockManager, make_block_manager
from servelab.memory import PagedBlockManager
from servelab.simulator import speed
from servelab.simulator.speed import RunPagedBlockManager
from servelab.simulator.speed import prefix_runs
from servelab.request import Request

OK, LATER, NEVER = AllocStatus.OK, AllocStatus.LATER, AllocStatus.NEVER


def blocks_of(tokens: list[int], bs: int) -> list[tuple[int, ...]]:
    """Content keys of the full blocks of a token list."""
    return [tuple(tokens[i:i + bs]) for i in range(0, len(tokens) - bs + 1, bs)]


def cached_seq(m: RunPagedBlockManager, seq_id, tokens: list[int]) -> int:
    """Allocate a sequence, mark all of it computed (commits its full blocks)."""
    hit = m.allocate(seq_id, len(tokens), blocks_of(tokens, m.block_size))
    m.mark_computed(seq_id, len(tokens))
    return hit


# --------------------------------------------------------------------------- basics
def test_allocate_append_free_accounting():
    m = RunPagedBlockManager(4, 10)
    assert m.allocate("a", 6) == 0
    assert m.block_table("a") == [0, 1]
    u = m.usage()
    assert (u.num_used_blocks, u.num_free_blocks) == (2, 8)
    assert (u.token_slots_used, u.token_slots_allocated) == (6, 8)
    assert m.append_slots("a", 2) == []          # fills block 1
    assert m.block_table("a") == [0, 1]
    assert m.append_slots("a", 1) == []          # opens block 2
    assert m.block_table("a") == [0, 1, 2]
    assert m.num_tokens("a") == 9
    u = m.usage()
    assert (u.num_used_blocks, u.token_slots_used, u.token_slots_allocated) == (3, 9, 12)
    assert u.internal_fragmentation == pytest.approx(3 / 12)
    m.check_invariants()
    m.free("a")
    u = m.usage()
    assert (u.num_used_blocks, u.num_free_blocks, u.token_slots_used) == (0, 10, 0)
    assert not m.has_seq("a")
    m.check_invariants()


def test_append_many_tokens_spans_blocks():
    m = RunPagedBlockManager(4, 10)
    m.allocate("a", 3)
    assert m.can_append_slots("a", 30)
    assert not m.can_append_slots("a", 38)       # 41 tokens need 11 blocks
    m.append_slots("a", 30)
    assert len(m.block_table("a")) == 9
    assert m.append_slots("a", 0) == []
    m.check_invariants()


def test_freed_blocks_are_reused_first():
    m = RunPagedBlockManager(4, 10)
    m.allocate("a", 8)
    m.allocate("b", 4)
    m.free("a")
    m.allocate("c", 12)
    assert m.block_table("c") == [0, 1, 3]       # a's blocks, then a fresh one


# --------------------------------------------------------------------------- admission
def test_can_allocate_ok_later_never():
    m = RunPagedBlockManager(4, 10)
    assert m.can_allocate(40) is OK
    assert m.can_allocate(41) is NEVER           # 11 blocks > 10
    m.allocate("a", 24)                          # 6 blocks
    assert m.can_allocate(16) is OK
    assert m.can_allocate(17) is LATER           # 5 blocks, 4 free
    m.free("a")
    assert m.can_allocate(40) is OK


def test_watermark_limits_admission_but_not_appends():
    m = RunPagedBlockManager(4, 10, watermark_blocks=2)
    assert m.can_allocate(32) is OK              # 8 blocks leaves exactly 2
    assert m.can_allocate(33) is NEVER           # 9 > 10 - 2: never, even when empty
    m.allocate("a", 28)                          # 7 blocks, 3 free
    assert m.can_allocate(4) is OK
    assert m.can_allocate(5) is LATER            # 2 blocks would leave 1 < 2
    assert m.can_append_slots("a", 12)           # appends may use the watermark
    m.append_slots("a", 12)
    assert m.num_free_blocks == 0
    assert not m.can_append_slots("a", 1)
    with pytest.raises(BlockManagerError, match="no room"):
        m.append_slots("a", 1)
    m.check_invariants()


def test_allocate_without_room_raises():
    m = RunPagedBlockManager(4, 4)
    m.allocate("a", 12)
    with pytest.raises(BlockManagerError, match="no room for sequence 'b' \\(later\\)"):
        m.allocate("b", 8)
    with pytest.raises(BlockManagerError, match="\\(never\\)"):
        m.allocate("b", 17)
    assert not m.has_seq("b")
    m.check_invariants()


# --------------------------------------------------------------------------- prefix caching
def test_prefix_hit_after_commit_and_stats():
    m = RunPagedBlockManager(4, 16, enable_prefix_caching=True)
    prompt = list(range(10))                      # 2 full blocks + 2 tokens
    assert cached_seq(m, "a", prompt) == 0
    a_blocks = m.block_table("a")
    hit = m.allocate("b", 11, blocks_of(prompt + [99], 4))
    assert hit == 8
    assert m.block_table("b")[:2] == a_blocks[:2]
    assert m.block_table("b")[2] != a_blocks[2]   # the partial block is never shared
    u = m.usage()
    assert (u.prefix_queries, u.prefix_hits) == (2 + 2, 2)
    assert u.prefix_hit_rate == pytest.approx(0.5)
    assert u.num_used_blocks == 4 and u.token_slots_used == 10 + 3   # shared blocks once
    m.check_invariants()


def test_no_hit_before_mark_computed_and_partial_commit():
    m = RunPagedBlockManager(4, 16, enable_prefix_caching=True)
    prompt = list(range(16))
    m.allocate("a", 16, blocks_of(prompt, 4))
    assert m.allocate("b", 16, blocks_of(prompt, 4)) == 0     # nothing committed yet
    m.mark_computed("a", 9)                                   # blocks 0 and 1 are full and computed
    assert m.allocate("c", 16, blocks_of(prompt, 4)) == 8
    m.mark_computed("a", 16)
    assert m.allocate("d", 16, blocks_of(prompt, 4)) == 12    # never all 16 tokens
    m.check_invariants()


def test_all_blocks_hit_still_computes_the_last_token():
    m = RunPagedBlockManager(4, 16, enable_prefix_caching=True)
    prompt = list(range(8))
    cached_seq(m, "a", prompt)
    assert m.allocate("b", 8, blocks_of(prompt, 4)) == 4      # the last block is dropped
    assert m.allocate("c", 9, blocks_of(prompt, 4)) == 8      # here the 9th token is computed
    assert m.usage().prefix_hits == 1 + 2


def test_different_prefix_same_block_content_does_not_hit():
    m = RunPagedBlockManager(2, 16, enable_prefix_caching=True)
    cached_seq(m, "a", [1, 2, 3, 4, 5])
    assert m.allocate("b", 5, [(9, 9), (3, 4)]) == 0          # (3, 4) follows another block
    assert m.allocate("c", 5, [(1, 2), (3, 4)]) == 4


def test_forced_hash_collision_is_a_miss(monkeypatch):
    monkeypatch.setattr(prefix_runs, "chain_hash", lambda parent, content: 7)
    m = RunPagedBlockManager(2, 16, enable_prefix_caching=True)
    cached_seq(m, "a", [1, 2, 3])
    assert m.allocate("b", 3, [(5, 6)]) == 0                  # same hash, other content
    assert m.allocate("c", 3, [(1, 2)]) == 2                  # same content still hits
    m.check_invariants()


def test_hash_that_ignores_the_prefix_cannot_cause_a_wrong_hit(monkeypatch):
    # With the parent left out of the hash, (3, 4) after (9, 9) collides with (3, 4)
    # after (1, 2): only the parent-entry check stands between it and a wrong reuse.
    monkeypatch.setattr(prefix_runs, "chain_hash", lambda parent, content: hash(content))
    m = RunPagedBlockManager(2, 16, enable_prefix_caching=True)
    cached_seq(m, "a", [1, 2, 3, 4, 0])
    cached_seq(m, "b", [9, 9, 7, 7, 0])
    assert m.allocate("c", 5, [(9, 9), (3, 4)]) == 2          # (9, 9) hits, (3, 4) must not
    assert m.block_table("c")[0] == m.block_table("b")[0]
    m.check_invariants()


def test_trace_hash_keys_hit_only_under_an_equal_chain():
    # Past a region's first block a trace-hash key is just its index in the region, so
    # equal keys at one position are common; only an equal chain before them may hit.
    bs = 4
    reqs = [Request(i, 0.0, 48, 1, prefix_hashes=h, prefix_block_size=16)
            for i, h in enumerate([(5, 7, 9), (5, 8, 9), (5, 7, 10)])]
    keys = [r.block_contents(r.seqs[0], bs) for r in reqs]
    assert keys[0] == [(5, 16), 1, 2, 3, (7, 16), 1, 2, 3, (9, 16), 1, 2, 3]
    assert keys[0][:6] + reqs[0].block_contents(reqs[0].seqs[0], bs, 6) == keys[0]
    m = RunPagedBlockManager(bs, 40, enable_prefix_caching=True)
    m.allocate("a", 48, keys[0])
    m.mark_computed("a", 48)
    assert m.allocate("b", 48, keys[1]) == 16      # region 5; not region 9 after 8
    assert m.allocate("c", 48, keys[2]) == 32      # regions 5 and 7
    m.check_invariants()


def test_trace_hash_keys_of_different_region_sizes_never_meet():
    # hashes (2, 3) in 8-token regions and (1, 9) in 16-token regions: as integers
    # (hash x size) their first keys were both 16 and their blocks shared a chain
    bs = 4
    a = Request(0, 0.0, 16, 1, prefix_hashes=(2, 3), prefix_block_size=8)
    b = Request(1, 0.0, 16, 1, prefix_hashes=(1,), prefix_block_size=16)
    m = RunPagedBlockManager(bs, 40, enable_prefix_caching=True)
    m.allocate("a", 16, a.block_contents(a.seqs[0], bs))
    m.mark_computed("a", 16)
    assert m.allocate("b", 16, b.block_contents(b.seqs[0], bs)) == 0
    m.check_invariants()


def test_lru_eviction_order_exact():
    m = RunPagedBlockManager(2, 6, enable_prefix_caching=True)
    cached_seq(m, "a", [1, 2, 3, 4])                          # blocks 0, 1
    cached_seq(m, "b", [5, 6, 7, 8])                          # blocks 2, 3
    m.free("a")                                               # tail first: 1 is older than 0
    m.free("b")
    assert m.evictable_blocks() == [1, 0, 3, 2]
    u = m.usage()
    assert (u.num_free_blocks, u.num_cached_blocks, u.num_used_blocks) == (2, 4, 0)
    # A hit takes block 0 out of the evictable set ...
    assert m.allocate("c", 3, [(1, 2)]) == 2
    assert m.block_table("c")[0] == 0
    assert m.evictable_blocks() == [1, 3, 2]
    assert m.block_table("c") == [0, 4]                       # plus the top of the free stack
    # New blocks come from the free list first, then the LRU cached block (1).
    m.allocate("d", 4)
    assert m.block_table("d") == [5, 1]
    assert m.evictable_blocks() == [3, 2]
    assert m.allocate("e", 5, [(1, 2), (3, 4)]) == 2          # (3, 4) was evicted with block 1
    assert m.block_table("e") == [0, 3, 2]
    assert m.evictable_blocks() == []
    m.free("c")
    m.free("e")                                               # block 0 is parked, the rest free
    assert m.evictable_blocks() == [0]
    m.check_invariants()


def test_release_behind_shared_leading_blocks_is_tail_first():
    """A sequence whose leading blocks another one still holds (a prefix hit) parks the
    rest of its blocks last first, and the shared ones keep their other reference."""
    m = RunPagedBlockManager(2, 12, enable_prefix_caching=True)
    cached_seq(m, "a", [1, 2, 3, 4, 5, 6, 7, 8])              # blocks 0-3
    assert m.allocate("b", 8, [(1, 2), (3, 4), (9, 9), (8, 8)]) == 4
    m.mark_computed("b", 8)
    assert m.block_table("b") == [0, 1, 4, 5]
    m.free("b")                                               # 0, 1 still held by a
    assert m.evictable_blocks() == [5, 4]
    assert m.usage().num_used_blocks == 4
    m.free("a")
    assert m.evictable_blocks() == [5, 4, 3, 2, 1, 0]
    m.check_invariants()


def test_eviction_order_follows_last_use():
    m = RunPagedBlockManager(2, 4, enable_prefix_caching=True)
    cached_seq(m, "a", [1, 2, 0])                             # blocks 0 (cached), 1 (partial)
    cached_seq(m, "b", [3, 4, 0])                             # blocks 2, 3
    m.free("a")
    m.free("b")
    assert m.evictable_blocks() == [0, 2]
    m.allocate("c", 3, [(1, 2)])                              # touch 0
    m.free("c")
    assert m.evictable_blocks() == [2, 0]                     # 2 goes first now
    m.allocate("d", 8)                                        # needs all 4 blocks
    assert m.evictable_blocks() == []
    assert m.usage().num_cached_blocks == 0
    m.free("d")
    assert m.allocate("e", 3, [(1, 2)]) == 0                  # evicted content is gone
    m.check_invariants()


def test_hit_on_evictable_block_counts_against_free_space():
    m = RunPagedBlockManager(2, 3, enable_prefix_caching=True)
    cached_seq(m, "a", [1, 2, 3, 4, 5])                       # 3 blocks, 2 committed
    m.free("a")
    assert m.num_free_blocks == 3
    # 3 blocks, 2 hit but both evictable: all 3 leave the free count; fits exactly.
    assert m.can_allocate(5, [(1, 2), (3, 4)]) is OK
    assert m.allocate("b", 5, [(1, 2), (3, 4)]) == 4
    assert m.num_free_blocks == 0
    m.check_invariants()


def test_only_hits_on_referenced_blocks_save_free_blocks():
    m = RunPagedBlockManager(2, 5, enable_prefix_caching=True)
    cached_seq(m, "a", [1, 2, 3, 4, 5])                       # 3 blocks, 2 committed
    m.allocate("c", 1)                                        # 1 free block left
    assert m.can_allocate(5, [(1, 2), (3, 4)]) is OK          # a holds both hits: 1 new block
    m.free("a")                                               # the hits are evictable now
    assert m.num_free_blocks == 4
    assert m.can_allocate(7, [(1, 2), (3, 4)]) is OK          # 2 new + 2 revived = 4
    assert m.can_allocate(9, [(1, 2), (3, 4)]) is LATER       # 3 new + 2 revived > 4
    m.check_invariants()


def test_duplicate_content_continues_the_chain():
    m = RunPagedBlockManager(2, 16, enable_prefix_caching=True)
    tokens = [1, 2, 3, 4, 5, 6, 0]
    contents = blocks_of(tokens, 2)
    m.allocate("a", 7, contents)
    m.allocate("b", 7, contents)                              # computed twice, in parallel
    m.mark_computed("a", 4)
    m.mark_computed("b", 7)                                   # b's blocks 0, 1 duplicate a's
    m.mark_computed("a", 7)
    assert m.allocate("c", 7, contents) == 6
    m.check_invariants()


def test_orphaned_block_gives_way_to_a_reachable_one():
    m = RunPagedBlockManager(2, 8, enable_prefix_caching=True)
    contents = [(1, 2), (3, 4)]
    m.allocate("a", 5, contents)
    m.allocate("b", 5, contents)                              # both compute the same prompt
    m.mark_computed("a", 2)                                   # a's (1, 2) is cached ...
    m.mark_computed("b", 5)                                   # ... b adopts it, caches its (3, 4)
    m.free("a")                                               # a's (1, 2) block: evictable
    m.allocate("x", 10)                                       # all 5 free blocks: evicts it
    m.free("x")
    m.free("b")                                               # b's (3, 4) is now an orphan
    assert m.usage().num_cached_blocks == 1
    assert m.allocate("c", 5, contents) == 0                  # unreachable without its parent
    m.mark_computed("c", 5)                                   # c's (3, 4) replaces the orphan
    assert m.usage().num_cached_blocks == 0
    assert m.allocate("d", 5, contents) == 4
    m.check_invariants()


def test_prefix_caching_off_ignores_contents():
    m = RunPagedBlockManager(2, 16)
    cached_seq(m, "a", [1, 2, 3])
    assert m.allocate("b", 3, [(1, 2)]) == 0
    u = m.usage()
    assert (u.prefix_queries, u.prefix_hits, u.num_cached_blocks) == (0, 0, 0)


# --------------------------------------------------------------------------- fork / CoW
def test_fork_shares_blocks_and_copy_on_write_happens_once():
    m = RunPagedBlockManager(4, 10)
    m.allocate("p", 6)                                        # blocks 0, 1 (1 half full)
    m.fork("p", "c")
    assert m.block_table("c") == m.block_table("p") == [0, 1]
    assert m.usage().num_used_blocks == 2 and m.usage().token_slots_used == 6
    assert m.can_append_slots("c", 1)
    copies = m.append_slots("c", 1)
    assert copies == [(1, 2)]
    assert m.block_table("c") == [0, 2] and m.block_table("p") == [0, 1]
    assert m.usage().token_slots_used == 4 + 2 + 3           # shared block 0 counted once
    assert m.append_slots("p", 1) == []                       # p is now sole owner of 1
    assert m.append_slots("c", 1) == []
    m.check_invariants()


def test_fork_at_block_boundary_needs_no_copy():
    m = RunPagedBlockManager(4, 10)
    m.allocate("p", 8)
    m.fork("p", "c")
    assert m.append_slots("c", 1) == []
    assert m.append_slots("p", 1) == []
    assert m.block_table("c")[:2] == m.block_table("p")[:2]
    assert m.block_table("c")[2] != m.block_table("p")[2]
    m.check_invariants()


def test_three_samples_two_copies_last_writes_in_place():
    m = RunPagedBlockManager(4, 10)
    m.allocate("s0", 5)
    m.fork("s0", "s1")
    m.fork("s0", "s2")
    copies = [m.append_slots(s, 1) for s in ("s0", "s1", "s2")]
    assert [len(c) for c in copies] == [1, 1, 0]
    assert copies[0][0][0] == copies[1][0][0] == 1            # both copied the shared block 1
    assert len({m.block_table(s)[1] for s in ("s0", "s1", "s2")}) == 3
    m.check_invariants()


def test_can_append_counts_the_copy_block():
    m = RunPagedBlockManager(4, 2)
    m.allocate("p", 5)
    m.fork("p", "c")
    assert not m.can_append_slots("c", 1)                     # the copy needs a block; none free
    assert m.can_append_slots("c", 0)
    m.free("p")
    assert m.append_slots("c", 1) == []                       # sole owner again: no copy


def test_fork_truncates_future_contents_and_child_commits():
    m = RunPagedBlockManager(2, 16, enable_prefix_caching=True)
    m.allocate("p", 3, [(1, 2), (3, 4)])                      # (3, 4) describes a future block
    m.mark_computed("p", 3)
    m.fork("p", "c")
    m.append_slots("c", 1)                                    # the child's 4th token is its own
    m.mark_computed("c", 4)
    assert m.allocate("x", 5, [(1, 2), (3, 4)]) == 2          # child did not commit (3, 4)
    m.append_slots("p", 1)
    m.mark_computed("p", 4)
    assert m.allocate("y", 5, [(1, 2), (3, 4)]) == 4          # the parent did
    m.check_invariants()


# --------------------------------------------------------------------------- fast-forward bound
def test_max_uniform_growth_is_exact():
    m = RunPagedBlockManager(4, 6)
    m.allocate("a", 4)                                        # room 0
    m.allocate("b", 7)                                        # room 1; 3 blocks free
    # k = 4q + r takes 2q blocks plus one per sequence whose room is below r.
    assert m.max_uniform_growth(["a", "b"], 100) == 5         # q = 1, spare 1: r <= room of b
    assert m.max_uniform_growth(["a", "b"], 3) == 3
    assert m.max_uniform_growth(["a"], 100) == 12
    assert m.max_uniform_growth([], 7) == 7
    for _ in range(5):
        assert m.append_slots("a", 1) == [] and m.append_slots("b", 1) == []
    assert m.num_free_blocks == 0 and not m.can_append_slots("b", 1)   # the bound was tight
    assert m.max_uniform_growth(["a", "b"], 100) == 0
    assert m.max_uniform_growth(["a"], 100) == 3                      # a's last block: 9 of 12


def test_max_uniform_growth_is_zero_before_a_copy():
    m = RunPagedBlockManager(4, 10)
    m.allocate("p", 5)
    m.fork("p", "c")
    assert m.max_uniform_growth(["p"], 10) == 0               # its next token copies block 1
    m.append_slots("c", 1)
    assert m.max_uniform_growth(["p", "c"], 10) > 0
    with pytest.raises(BlockManagerError, match="listed twice"):
        m.max_uniform_growth(["p", "p"], 10)


# --------------------------------------------------------------------------- swapping
def test_swap_round_trip_keeps_sharing():
    m = RunPagedBlockManager(4, 8, 8)
    m.allocate("p", 6)
    m.fork("p", "c")
    m.append_slots("c", 3)                                    # c: [0, 2, 3]; shares block 0
    assert m.can_swap_out(["p", "c"])
    out = m.swap_out(["p", "c"])
    assert len(out) == 4 and {g for g, _ in out} == {0, 1, 2, 3}
    assert m.is_swapped("p") and m.is_swapped("c")
    assert m.block_table("p")[0] == m.block_table("c")[0]     # still shared, on the CPU
    u = m.usage()
    assert (u.num_used_blocks, u.num_cpu_used_blocks, u.token_slots_used) == (0, 4, 0)
    m.check_invariants()
    gpu_of = {cpu: gpu for gpu, cpu in out}
    assert m.can_swap_in(["p", "c"]) is OK
    back = m.swap_in(["p", "c"])
    assert len(back) == 4
    assert m.block_table("p")[0] == m.block_table("c")[0]
    u = m.usage()
    assert (u.num_used_blocks, u.num_cpu_used_blocks, u.token_slots_used) == (4, 0, 6 + 5)
    assert set(gpu_of) == {cpu for cpu, _ in back}
    m.check_invariants()


def test_swap_out_part_of_a_sharing_group_copies_the_shared_block():
    m = RunPagedBlockManager(4, 8, 8)
    m.allocate("p", 6)
    m.fork("p", "c")
    out = m.swap_out(["c"])
    assert [g for g, _ in out] == [0, 1]
    assert m.block_table("p") == [0, 1] and m.usage().num_used_blocks == 2
    m.free("c")
    assert m.usage().num_cpu_used_blocks == 0
    m.check_invariants()


def test_swap_capacity_and_status():
    m = RunPagedBlockManager(4, 6, 2, watermark_blocks=1)
    m.allocate("a", 12)                                       # 3 blocks
    assert not m.can_swap_out(["a"])                          # 3 > 2 CPU blocks
    m.free("a")
    m.allocate("a", 8)
    m.swap_out(["a"])
    m.allocate("b", 12)                                       # 3 blocks, 3 free
    assert m.can_swap_in(["a"]) is OK                         # 3 - 2 >= 1
    m.append_slots("b", 4)                                    # 2 free
    assert m.can_swap_in(["a"]) is LATER                      # would cut into the watermark
    m.free("b")
    m.swap_in(["a"])
    m.check_invariants()


def test_swap_in_waives_the_watermark_when_the_pool_is_otherwise_empty():
    m = RunPagedBlockManager(4, 4, 4, watermark_blocks=1)
    m.allocate("a", 12)
    m.append_slots("a", 4)                                    # grew into the watermark: 4 blocks
    m.swap_out(["a"])
    assert m.can_swap_in(["a"]) is OK                         # LATER would never resolve
    m.swap_in(["a"])
    m.check_invariants()


def test_swap_in_later_and_never():
    m = RunPagedBlockManager(4, 3, 8)
    m.allocate("a", 8)
    m.swap_out(["a"])
    m.allocate("b", 8)
    m.swap_out(["b"])
    m.allocate("c", 4)
    assert m.can_swap_in(["a"]) is OK
    assert m.can_swap_in(["b", "a"]) is NEVER                 # 4 blocks on a 3-block GPU
    m.append_slots("c", 1)
    assert m.can_swap_in(["a"]) is LATER
    m.free("c")
    assert m.can_swap_in(["a"]) is OK


def test_swap_in_evicts_cached_blocks_lru_first():
    m = RunPagedBlockManager(2, 4, 4, enable_prefix_caching=True)
    m.allocate("a", 3)
    m.swap_out(["a"])
    cached_seq(m, "b", [1, 2, 3, 4, 5, 6, 7])                 # 4 blocks, 3 committed
    m.free("b")
    assert m.evictable_blocks() == [2, 1, 0]
    assert m.num_free_blocks == 4 and m.usage().num_cached_blocks == 3
    assert m.swap_in(["a"]) == [(0, 3), (1, 2)]               # the free block, then LRU block 2
    assert m.evictable_blocks() == [1, 0]
    m.free("a")
    assert m.allocate("c", 7, [(1, 2), (3, 4), (5, 6)]) == 4  # (5, 6) went with block 2
    m.check_invariants()


def test_cached_block_stays_cached_when_its_holder_is_swapped_out():
    m = RunPagedBlockManager(2, 8, 8, enable_prefix_caching=True)
    cached_seq(m, "a", [1, 2, 3, 4, 5])
    m.swap_out(["a"])
    assert m.usage().num_cached_blocks == 2
    assert m.allocate("b", 5, [(1, 2), (3, 4)]) == 4
    m.swap_in(["a"])
    m.mark_computed("a", 5)                                   # recommits: duplicates of b's
    m.check_invariants()


# --------------------------------------------------------------------------- misc
def test_check_invariants_detects_corruption():
    m = RunPagedBlockManager(4, 4)
    m.allocate("a", 5)
    m._refcount[0] += 1
    with pytest.raises(AssertionError, match="reference counts"):
        m.check_invariants()


def test_make_block_manager_maps_config():
    """The registry builds the plain manager a config names; the simulator's speed layer
    builds its own for `paged` and the registered one for the others."""
    cache = CacheConfig(block_size=8, num_gpu_blocks=200, num_cpu_blocks=4, watermark=0.05,
                        enable_prefix_caching=True)
    for make, cls in ((make_block_manager, PagedBlockManager),
                      (speed.make_block_manager, RunPagedBlockManager)):
        paged = make(cache, 1024)
        assert type(paged) is cls
        assert (paged.block_size, paged.num_gpu_blocks, paged.num_cpu_blocks) == (8, 200, 4)
        assert paged.watermark_blocks == 10
        assert paged.usage().prefix_queries == 0
    for mode in ("max", "pow2", "oracle"):
        cfg = CacheConfig(block_manager=f"contiguous-{mode}", num_gpu_blocks=100)
        m = make_block_manager(cfg, 512)
        assert type(speed.make_block_manager(cfg, 512)) is ContiguousBlockManager
        assert isinstance(m, ContiguousBlockManager)
        assert (m.mode, m.max_model_len, m.watermark_blocks) == (mode, 512, 1)
