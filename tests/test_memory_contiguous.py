"""Unit tests of the contiguous-reservation baselines: reservation sizes per mode,
first-fit placement and external fragmentation, in-place growth, fork, swap, usage."""
from __future__ import annotations

import pytest

from servelab.memory import AllocStatus, BlockManagerError, ContiguousBlockManager

OK, LATER, NEVER = AllocStatus.OK, AllocStatus.LATER, AllocStatus.NEVER


def oracle(num_gpu_blocks: int, num_cpu_blocks: int = 0, **kw) -> ContiguousBlockManager:
    return ContiguousBlockManager(4, num_gpu_blocks, num_cpu_blocks, mode="oracle",
                                  max_model_len=1024, **kw)


def test_reservation_size_per_mode():
    def size(mode, *args):
        m = ContiguousBlockManager(16, 1000, mode=mode, max_model_len=2048)
        return m.reservation_blocks(*args)

    assert size("max", 10) == 2048 // 16
    assert size("pow2", 10, 300) == 512 // 16
    assert size("pow2", 10, 512) == 512 // 16
    assert size("pow2", 10, 3000) == 2048 // 16               # capped at max_model_len
    assert size("oracle", 10, 300, 170) == 11                 # ceil(170 / 16)
    assert size("oracle", 200, 300, 170) == 13                # never below the tokens held now
    assert size("max", 3000) == 188                           # nor in max mode


def test_missing_size_hint_is_an_error():
    pow2 = ContiguousBlockManager(16, 100, mode="pow2", max_model_len=512)
    with pytest.raises(BlockManagerError, match="max_total_tokens"):
        pow2.can_allocate(10)
    orc = ContiguousBlockManager(16, 100, mode="oracle", max_model_len=512)
    with pytest.raises(BlockManagerError, match="expected_total_tokens"):
        orc.allocate("a", 10, max_total_tokens=40)
    assert not orc.has_seq("a")


def test_allocate_reserves_up_front_and_appends_are_free():
    m = ContiguousBlockManager(4, 100, mode="max", max_model_len=64)
    assert m.allocate("a", 5) == 0
    assert m.reserved_blocks("a") == 16
    assert m.block_table("a") == [0, 1]                       # blocks holding tokens
    u = m.usage()
    assert (u.num_used_blocks, u.num_free_blocks, u.token_slots_used) == (16, 84, 5)
    assert (u.token_slots_allocated, u.reserved_unused_slots) == (64, 59)
    assert u.internal_fragmentation == pytest.approx(59 / 64)
    for _ in range(10):
        assert m.can_append_slots("a", 1)
        assert m.append_slots("a", 1) == []
    assert m.block_table("a") == [0, 1, 2, 3]
    assert m.usage().reserved_unused_slots == 64 - 15
    m.check_invariants()


def test_first_fit_external_fragmentation_gives_later():
    m = oracle(10)
    for s in "abc":
        m.allocate(s, 12, expected_total_tokens=12)            # 3 blocks each
    assert [m.block_table(s)[0] for s in "abc"] == [0, 3, 6]
    m.free("a")
    m.free("c")                                               # free runs [0, 3) and [6, 10)
    assert m.num_free_blocks == 7
    assert m.can_allocate(20, expected_total_tokens=20) is LATER   # 5 blocks: 7 free, largest run 4
    with pytest.raises(BlockManagerError, match="largest free run 4"):
        m.allocate("d", 20, expected_total_tokens=20)
    assert m.can_allocate(41, expected_total_tokens=41) is NEVER
    assert m.can_allocate(16, expected_total_tokens=16) is OK
    m.allocate("e", 8, expected_total_tokens=8)               # first fit: the run at 0
    assert m.block_table("e") == [0, 1]
    m.free("b")                                               # [2, 10) coalesces
    assert m.can_allocate(32, expected_total_tokens=32) is OK
    m.check_invariants()


def test_free_coalesces_neighbours():
    m = oracle(9)
    for s in "abc":
        m.allocate(s, 12, expected_total_tokens=12)
    m.free("a")
    m.free("c")
    m.free("b")                                               # joins both sides
    assert m.can_allocate(36, expected_total_tokens=36) is OK
    m.check_invariants()


def test_growth_past_the_reservation_extends_in_place_or_fails():
    m = oracle(10)
    m.allocate("a", 4, expected_total_tokens=8)               # 2 blocks at 0
    m.append_slots("a", 4)
    assert m.can_append_slots("a", 4)                         # block 2 is free: grow
    assert m.append_slots("a", 4) == []
    assert m.reserved_blocks("a") == 3
    m.allocate("b", 4, expected_total_tokens=4)               # block 3
    assert not m.can_append_slots("a", 1)                     # b sits right after a
    with pytest.raises(BlockManagerError, match="cannot grow in place"):
        m.append_slots("a", 1)
    assert m.num_tokens("a") == 12
    m.free("b")
    assert m.can_append_slots("a", 28)                        # blocks 3..9
    assert not m.can_append_slots("a", 29)
    m.check_invariants()


def test_max_uniform_growth_counts_room_and_in_place_growth():
    m = oracle(10)
    m.allocate("a", 5, expected_total_tokens=8)               # blocks 0-1, room 3
    m.allocate("b", 2, expected_total_tokens=8)               # blocks 2-3, room 6, then 6 free
    assert m.max_uniform_growth(["a"], 100) == 3              # b sits right after a
    assert m.max_uniform_growth(["b"], 100) == 6 + 6 * 4
    assert m.max_uniform_growth(["a", "b"], 2) == 2
    m.fork("b", "c")
    assert m.max_uniform_growth(["a", "b"], 100) == 0         # b's next token copies its run
    m.free("a")
    assert m.max_uniform_growth(["c"], 1) == 0


def test_watermark():
    m = oracle(10, watermark_blocks=2)
    assert m.can_allocate(32, expected_total_tokens=32) is OK
    assert m.can_allocate(33, expected_total_tokens=33) is NEVER
    m.allocate("a", 28, expected_total_tokens=28)             # 7 blocks, 3 free
    assert m.can_allocate(8, expected_total_tokens=8) is LATER
    assert m.can_append_slots("a", 12)                        # growth may use the watermark


def test_fork_shares_until_the_first_append_copies_the_run():
    m = oracle(20)
    m.allocate("p", 6, expected_total_tokens=16)              # blocks 0..3
    m.fork("p", "c1")
    m.fork("p", "c2")
    assert m.block_table("c1") == m.block_table("p") == [0, 1]
    assert m.usage().num_used_blocks == 4
    copies = m.append_slots("c1", 1)
    assert copies == [(0, 4), (1, 5)]                         # the blocks holding tokens
    assert m.reserved_blocks("c1") == 4 and m.block_table("c1") == [4, 5]
    assert m.append_slots("p", 1) == [(0, 8), (1, 9)]
    assert m.append_slots("c2", 1) == []                      # the last sharer keeps the run
    assert m.block_table("c2") == [0, 1]
    u = m.usage()
    assert (u.num_used_blocks, u.token_slots_used) == (12, 21)
    m.check_invariants()


def test_fork_copy_needs_a_free_run():
    m = oracle(6)
    m.allocate("p", 6, expected_total_tokens=16)              # 4 blocks, 2 left
    m.fork("p", "c")
    assert not m.can_append_slots("c", 1)
    assert m.can_append_slots("c", 0)
    m.free("p")
    assert m.append_slots("c", 1) == []


def test_swap_round_trip_moves_whole_reservations():
    m = oracle(16, 16)
    m.allocate("p", 6, expected_total_tokens=16)              # 4 blocks at 0
    m.fork("p", "c")                                          # shares p's run
    m.allocate("q", 3, expected_total_tokens=8)               # 2 blocks at 4
    assert m.can_swap_out(["p", "c", "q"])
    out = m.swap_out(["p", "c", "q"])
    assert out == [(0, 0), (1, 1), (4, 4)]                    # the shared run moves once
    assert m.is_swapped("c") and m.block_table("c") == m.block_table("p") == [0, 1]
    u = m.usage()
    assert (u.num_used_blocks, u.num_cpu_used_blocks, u.token_slots_used) == (0, 6, 0)
    m.allocate("x", 4, expected_total_tokens=4)               # block 0 is taken meanwhile
    assert m.can_swap_in(["p", "c", "q"]) is OK
    back = m.swap_in(["p", "c", "q"])
    assert back == [(0, 1), (1, 2), (4, 5)]
    assert m.block_table("p") == m.block_table("c") == [1, 2]
    assert m.append_slots("c", 1) == [(1, 7), (2, 8)]         # still shared: copy on write
    u = m.usage()
    assert (u.num_cpu_used_blocks, u.token_slots_used) == (0, 4 + 6 + 7 + 3)
    m.check_invariants()


def test_swap_needs_a_cpu_run_and_gpu_room():
    m = oracle(8, 4)
    m.allocate("a", 12, expected_total_tokens=20)             # 5 blocks
    assert not m.can_swap_out(["a"])
    m.free("a")
    m.allocate("a", 8, expected_total_tokens=8)
    m.allocate("b", 8, expected_total_tokens=8)
    m.swap_out(["a"])
    m.swap_out(["b"])
    m.allocate("c", 24, expected_total_tokens=24)             # 6 of 8 GPU blocks
    assert m.can_swap_in(["a"]) is OK
    assert m.can_swap_in(["a", "b"]) is LATER
    m.free("c")
    assert m.can_swap_in(["a", "b"]) is OK


def test_no_prefix_cache_and_mark_computed_checks():
    m = oracle(8)
    m.allocate("a", 8, [(1, 2, 3, 4), (5, 6, 7, 8)], expected_total_tokens=8)
    m.mark_computed("a", 8)
    assert m.allocate("b", 8, [(1, 2, 3, 4), (5, 6, 7, 8)], expected_total_tokens=8) == 0
    u = m.usage()
    assert (u.prefix_queries, u.prefix_hits, u.num_cached_blocks) == (0, 0, 0)
    with pytest.raises(BlockManagerError, match="has 8 tokens, not 9"):
        m.mark_computed("a", 9)


def test_check_invariants_detects_overlap():
    m = oracle(8)
    m.allocate("a", 8, expected_total_tokens=8)
    m.allocate("b", 8, expected_total_tokens=8)
    m._seqs["b"].res.start = 1
    with pytest.raises(AssertionError, match="overlap"):
        m.check_invariants()
