"""Bad input: every protocol violation raises a clear error naming what was wrong, and
leaves the manager exactly as it was (same tables, same usage, invariants intact)."""
from __future__ import annotations

import pytest

from servelab.memory import BlockManagerError, ContiguousBlockManager
from servelab.simulator.speed import RunPagedBlockManager

MANAGERS = {
    "paged": lambda: RunPagedBlockManager(4, 8, 4, enable_prefix_caching=True),
    "contiguous": lambda: ContiguousBlockManager(4, 8, 4, mode="oracle", max_model_len=64),
}


def alloc(m, seq_id, num_tokens, contents=()):
    return m.allocate(seq_id, num_tokens, contents, max_total_tokens=num_tokens,
                      expected_total_tokens=num_tokens)


@pytest.fixture(params=sorted(MANAGERS))
def m(request):
    """A manager holding a running sequence 'a' (6 tokens, 2 blocks) and a swapped
    sequence 's' (4 tokens, 1 block on the CPU); 6 GPU blocks free, 3 CPU blocks."""
    return _holding_a_and_s(MANAGERS[request.param]())


@pytest.fixture
def paged():
    """`m` for the speed layer's manager alone, which grows in bulk (`append_slots_many`)."""
    return _holding_a_and_s(MANAGERS["paged"]())


def _holding_a_and_s(m):
    alloc(m, "a", 6, [(1, 2, 3, 4)])
    m.mark_computed("a", 6)
    alloc(m, "s", 4)
    m.swap_out(["s"])
    return m


def snapshot(m):
    seqs = {sid: (m.block_table(sid), m.is_swapped(sid), m.num_tokens(sid))
            for sid in ("a", "s", "big", "c") if m.has_seq(sid)}
    return m.usage(), seqs, m.num_free_blocks, m.num_used_blocks


def assert_rejected(m, call, match):
    before = snapshot(m)
    with pytest.raises(BlockManagerError, match=match):
        call()
    m.check_invariants()
    assert snapshot(m) == before


# --------------------------------------------------------------------------- sequences
def test_free_unknown_sequence(m):
    assert_rejected(m, lambda: m.free("zz"), "free: unknown sequence 'zz'")


def test_double_free(m):
    m.free("a")
    assert_rejected(m, lambda: m.free("a"), "free: unknown sequence 'a' .*already freed")
    m.free("s")
    assert_rejected(m, lambda: m.free("s"), "free: unknown sequence 's'")


@pytest.mark.parametrize("seq_id", ["a", "s"])
def test_allocate_existing_seq_id(m, seq_id):
    assert_rejected(m, lambda: alloc(m, seq_id, 4), f"allocate: sequence '{seq_id}' already has blocks")


@pytest.mark.parametrize("n", [0, -3, 1.5, "4", None])
def test_allocate_bad_token_count(m, n):
    assert_rejected(m, lambda: m.allocate("c", n, max_total_tokens=8, expected_total_tokens=8),
                    "allocate: num_tokens must be an integer >= 1")
    assert_rejected(m, lambda: m.can_allocate(n, max_total_tokens=8, expected_total_tokens=8),
                    "can_allocate: num_tokens must be an integer >= 1")


def test_allocate_without_room(m):
    assert_rejected(m, lambda: alloc(m, "c", 28), "allocate: no room for sequence 'c' \\(later\\)")
    assert_rejected(m, lambda: alloc(m, "c", 33), "allocate: no room for sequence 'c' \\(never\\)")


def test_append_to_unknown_or_swapped_sequence(m):
    assert_rejected(m, lambda: m.append_slots("zz", 1), "append_slots: unknown sequence 'zz'")
    assert_rejected(m, lambda: m.can_append_slots("zz", 1), "can_append_slots: unknown sequence 'zz'")
    assert_rejected(m, lambda: m.append_slots("s", 1), "append_slots: sequence 's' is swapped out")


@pytest.mark.parametrize("k", [-1, 0.5])
def test_append_bad_count(m, k):
    assert_rejected(m, lambda: m.append_slots("a", k),
                    "append_slots: num_new_tokens must be an integer >= 0")


def test_append_many_bad_input(paged):
    m = paged
    assert_rejected(m, lambda: m.append_slots_many([("a", 1), ("zz", 1)]),
                    "unknown sequence 'zz'")
    assert_rejected(m, lambda: m.append_slots_many([("a", 1), ("s", 1)]), "'s' is swapped out")
    assert_rejected(m, lambda: m.append_slots_many([("a", -1)]), "num_new_tokens must be an integer >= 0")


def test_append_many_is_all_or_nothing(paged):
    """'c' fits, 'a' then does not: 'c' has not grown either."""
    m = paged
    alloc(m, "c", 1)
    assert_rejected(m, lambda: m.append_slots_many([("c", 3), ("a", 64)]),
                    "append_slots_many: no room")
    assert_rejected(m, lambda: m.append_slots_many([("c", 1), ("c", 1)]), "listed twice")


@pytest.mark.parametrize("dry", [False, True])
def test_paged_append_many_with_an_unhashable_id_grows_nothing(dry):
    """An unhashable id after sequences that grew raises TypeError, as append_slots
    does, and takes their growth back: with free blocks at hand, and once the free stack
    has run dry after 'a' took the last free block, so that 'c' would evict (cached
    blocks of 'old')."""
    m = RunPagedBlockManager(4, 7, enable_prefix_caching=True)
    alloc(m, "a", 4)
    alloc(m, "c", 4)
    if dry:
        alloc(m, "old", 16, [(1,), (2,), (3,), (4,)])
        m.mark_computed("old", 16)
        m.free("old")
    before = (snapshot(m), m.evictable_blocks())
    with pytest.raises(TypeError):
        m.append_slots_many([("a", 1), ("c", 1), (["bad"], 1)])
    m.check_invariants()
    assert (snapshot(m), m.evictable_blocks()) == before


def test_paged_append_many_checks_the_batch_as_a_whole():
    """Each growth fits alone, not both together: paging (which overrides the default)
    refuses the batch before touching either sequence."""
    m = RunPagedBlockManager(4, 4)
    alloc(m, "x", 4)
    alloc(m, "y", 4)  # 2 blocks free
    assert m.can_append_slots("x", 8) and m.can_append_slots("y", 8)
    assert_rejected(m, lambda: m.append_slots_many([("x", 8), ("y", 8)]), "no room")
    assert m.append_slots_many([("x", 4), ("y", 4)]) == [] and m.num_free_blocks == 0


def test_paged_append_many_counts_copies_as_one_by_one_does():
    """Three holders of a shared partial block all grow: the first two copy it, the last
    writes in place (it is the only holder by then). Two free blocks are enough."""
    m = RunPagedBlockManager(4, 4)
    alloc(m, "p", 6)                    # 2 blocks, the last half full
    m.fork("p", "c1")
    m.fork("p", "c2")
    assert m.num_free_blocks == 2
    copies = m.append_slots_many([("p", 1), ("c1", 1), ("c2", 1)])
    assert len(copies) == 2 and m.num_free_blocks == 0
    m.check_invariants()


def test_append_without_room(m):
    assert_rejected(m, lambda: m.append_slots("a", 64),
                    "append_slots: no room for 64 more tokens of sequence 'a'")


def test_mark_computed_bad_input(m):
    assert_rejected(m, lambda: m.mark_computed("a", 7),
                    "mark_computed: sequence 'a' has 6 tokens, not 7")
    assert_rejected(m, lambda: m.mark_computed("a", -1), "num_computed_tokens must be an integer >= 0")
    assert_rejected(m, lambda: m.mark_computed("zz", 1), "mark_computed: unknown sequence 'zz'")
    assert_rejected(m, lambda: m.mark_computed("s", 1), "mark_computed: sequence 's' is swapped out")


def test_fork_bad_input(m):
    assert_rejected(m, lambda: m.fork("zz", "c"), "fork: unknown sequence 'zz'")
    assert_rejected(m, lambda: m.fork("a", "s"), "fork: child sequence 's' already has blocks")
    assert_rejected(m, lambda: m.fork("s", "c"), "fork: sequence 's' is swapped out")


def test_queries_on_unknown_sequence(m):
    assert_rejected(m, lambda: m.block_table("zz"), "block_table: unknown sequence 'zz'")
    assert_rejected(m, lambda: m.is_swapped("zz"), "is_swapped: unknown sequence 'zz'")
    assert not m.has_seq("zz")


# --------------------------------------------------------------------------- swapping
def test_swap_in_without_gpu_capacity(m):
    alloc(m, "big", 24)                                       # the last 6 GPU blocks
    assert_rejected(m, lambda: m.swap_in(["s"]), "swap_in: no GPU room \\(later\\)")


def test_swap_out_without_cpu_capacity(m):
    alloc(m, "big", 24)                                       # 6 blocks; the CPU has 3 free
    assert not m.can_swap_out(["big"])
    assert_rejected(m, lambda: m.swap_out(["big"]), "swap_out: .*CPU")


def test_swap_in_of_a_sequence_not_swapped(m):
    assert_rejected(m, lambda: m.swap_in(["a"]), "swap_in: sequence 'a' is not swapped out")
    assert_rejected(m, lambda: m.swap_in(["s", "a"]), "swap_in: sequence 'a' is not swapped out")
    assert_rejected(m, lambda: m.can_swap_in(["a"]), "can_swap_in: sequence 'a' is not swapped out")


def test_swap_out_of_a_swapped_sequence(m):
    assert_rejected(m, lambda: m.swap_out(["a", "s"]), "swap_out: sequence 's' is swapped out")


def test_swap_unknown_or_repeated_sequence(m):
    assert_rejected(m, lambda: m.swap_out(["zz"]), "swap_out: unknown sequence 'zz'")
    assert_rejected(m, lambda: m.swap_in(["zz"]), "swap_in: unknown sequence 'zz'")
    assert_rejected(m, lambda: m.swap_out(["a", "a"]), "swap_out: a sequence is listed twice")
    assert_rejected(m, lambda: m.can_swap_out(["a", "a"]), "can_swap_out: a sequence is listed twice")


# --------------------------------------------------------------------------- constructors
@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=0), "block_size must be an integer >= 1, got 0"),
    (dict(block_size=-4), "block_size must be an integer >= 1, got -4"),
    (dict(block_size=2.5), "block_size must be an integer >= 1, got 2.5"),
    (dict(num_gpu_blocks=0), "num_gpu_blocks must be an integer >= 1, got 0"),
    (dict(num_gpu_blocks=True), "num_gpu_blocks must be an integer >= 1, got True"),
    (dict(num_cpu_blocks=-1), "num_cpu_blocks must be an integer >= 0, got -1"),
    (dict(watermark_blocks=-1), "watermark_blocks must be an integer >= 0, got -1"),
    (dict(watermark_blocks=8), "watermark_blocks \\(8\\) must be below num_gpu_blocks \\(8\\)"),
])
@pytest.mark.parametrize("kind", sorted(MANAGERS))
def test_constructor_rejects_bad_sizes(kind, kwargs, match):
    args = dict(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark_blocks=0) | kwargs
    if kind == "paged":
        make = lambda: RunPagedBlockManager(**args)  # noqa: E731
    else:
        make = lambda: ContiguousBlockManager(**args, max_model_len=64)  # noqa: E731
    with pytest.raises(ValueError, match=match):
        make()


def test_constructor_rejects_bad_options():
    with pytest.raises(ValueError, match="enable_prefix_caching must be a bool, got 'yes'"):
        RunPagedBlockManager(4, 8, enable_prefix_caching="yes")
    with pytest.raises(ValueError, match="mode must be one of .* got 'lazy'"):
        ContiguousBlockManager(4, 8, mode="lazy", max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len must be an integer >= 1, got 0"):
        ContiguousBlockManager(4, 8, max_model_len=0)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_paged_append_many_undoes_a_refused_batch_exactly(prefix_caching):
    """The batch grows as it goes and is taken back when a later entry is refused: the
    free stack is as it was (the next growth takes the very blocks it would have), and
    so are the reference counts (with a prefix cache a free block counts 0, else 1)."""
    def manager():
        m = RunPagedBlockManager(4, 16, enable_prefix_caching=prefix_caching)
        alloc(m, "x", 4)
        alloc(m, "y", 4)
        return m

    fresh, m = manager(), manager()
    for bad in ([("x", 9), ("y", 1), ("nobody", 1)], [("x", 9), ("y", 5), ("x", 1)],
                [("y", 4), ("x", 100)]):
        with pytest.raises(BlockManagerError):
            m.append_slots_many(bad)
        m.check_invariants()
    m.append_slots_many([("x", 9), ("y", 5)])
    fresh.append_slots_many([("x", 9), ("y", 5)])
    assert (m.block_table("x"), m.block_table("y")) == (fresh.block_table("x"), fresh.block_table("y"))
    assert m.usage() == fresh.usage()


def test_paged_append_many_takes_an_int_of_another_type():
    """A count that is an int subclass (not bool) grows as an int does."""
    class Count(int):
        pass

    m, ref = RunPagedBlockManager(4, 8), RunPagedBlockManager(4, 8)
    for mgr in (m, ref):
        alloc(mgr, "x", 4)
        alloc(mgr, "y", 3)
    m.append_slots_many([("x", 2), ("y", Count(5))])
    ref.append_slots_many([("x", 2), ("y", 5)])
    assert (m.block_table("y"), m.num_tokens("y")) == (ref.block_table("y"), ref.num_tokens("y"))
    assert m.usage() == ref.usage()
    with pytest.raises(BlockManagerError, match="must be an integer"):
        m.append_slots_many([("x", True)])
