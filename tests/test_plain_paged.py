"""The plain block manager (memory/paged.py, one block at a time) and the speed layer's
(simulator/speed/paged.py: runs of cache entries, bulk growth, memos) must decide alike.

Random op lists drive both side by side, built by constructor with the same arguments
(block size, pools, watermark, prefix caching, host tier), through every protocol call:
admission with shared-prefix prompts (families, as tests/test_memory_prefix_runs.py
draws them, as plain key lists, as `BlockKeys`, and with Mooncake-style region offsets),
imports (blocks allocated with no contents and marked computed at once, as a
disaggregated decode replica does), chunked commits, growth by one and several slots,
forks and copy-on-write, frees, group swaps, host-tier transfers. Every call must return
the same value or raise the same error, and after each one every sequence's block table,
the free counts, `usage()` and the eviction order must be equal, and both managers'
invariants must hold.
"""
from __future__ import annotations

from typing import Callable

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from servelab.memory import AllocStatus, BlockManagerError
from servelab.simulator.speed import RunPagedBlockManager
from servelab.simulator.speed.block_keys import BlockKeys
from servelab.memory.paged import PagedBlockManager
from servelab.memory.prefix_cache import chain_hashes
from servelab.request import region_offsets

REGION = 3


def prompt(family: int, nblocks: int, regions: bool) -> list:
    """Block contents: families of the same parity share their first two blocks, then
    each has its own. With `regions`, every third block names its region and the others
    are offsets in it (simulator/speed/block_keys.py's layout)."""
    keys = [(family % 2, i) if i < 2 else (family, i) for i in range(nblocks)]
    if regions:
        offsets = region_offsets(REGION)
        keys = [keys[i] if i % REGION == 0 else offsets[i % REGION - 1] for i in range(nblocks)]
    return keys


class Both:
    """A fast and a plain manager driven by the same calls, compared after each."""

    def __init__(self, **kwargs) -> None:
        self.fast = RunPagedBlockManager(**kwargs)
        self.plain = PagedBlockManager(**kwargs)
        self.seqs: list[str] = []
        """Every sequence id named so far (freed ones included)."""

    def call(self, name: str, *args, **kwargs):
        """Call `name` on both; the same result, or the same error, from each."""
        results = []
        for m in (self.fast, self.plain):
            try:
                results.append(("ok", getattr(m, name)(*args, **kwargs)))
            except BlockManagerError as e:
                results.append(("error", str(e)))
        assert results[0] == results[1], f"{name}{args}: fast {results[0]}, plain {results[1]}"
        self.check()
        return results[0][1] if results[0][0] == "ok" else None

    def check(self) -> None:
        fast, plain = self.fast, self.plain
        for seq in self.seqs:
            assert fast.has_seq(seq) == plain.has_seq(seq), seq
            if not fast.has_seq(seq):
                continue
            assert fast.block_table(seq) == plain.block_table(seq), seq
            assert fast.is_swapped(seq) == plain.is_swapped(seq), seq
            assert fast.host_hit_tokens(seq) == plain.host_hit_tokens(seq), seq
        assert fast.num_free_blocks == plain.num_free_blocks
        assert fast.num_used_blocks == plain.num_used_blocks
        assert fast.usage() == plain.usage()
        assert fast.evictable_blocks() == plain.evictable_blocks()
        fast.check_invariants()
        plain.check_invariants()


OP_NAMES = ["admit"] * 4 + ["compute"] * 3 + ["free"] * 3 + ["grow"] * 2 + ["step"] * 2 \
    + ["fork", "swap_out", "swap_in", "import", "peek"]
OPS = st.lists(st.tuples(st.sampled_from(OP_NAMES), st.integers(0, 5), st.integers(0, 7),
                         st.integers(0, 3)), min_size=30, max_size=100)


@st.composite
def configs(draw) -> dict:
    block_size = draw(st.integers(1, 4))
    num_gpu_blocks = draw(st.integers(4, 20))
    prefix = draw(st.sampled_from([False, True, True, True]))
    return dict(block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                num_cpu_blocks=draw(st.integers(0, 12)),
                watermark_blocks=draw(st.integers(0, min(2, num_gpu_blocks - 1))),
                enable_prefix_caching=prefix,
                num_host_blocks=draw(st.sampled_from([0, 1, 2, 4, 6, 8])) if prefix else 0)


def run_ops(config: dict, ops: list[tuple[str, int, int, int]]) -> None:
    t = Both(**config)
    bs = config["block_size"]
    for n, (op, a, b, c) in enumerate(ops):
        held = [s for s in t.seqs if t.fast.has_seq(s)]
        live = [s for s in held if not t.fast.is_swapped(s)]
        swapped = [s for s in held if t.fast.is_swapped(s)]
        t.seqs.append(f"s{n}")
        if op in ("admit", "peek"):
            keys = prompt(a, b + c, regions=a >= 4)   # `c` keys past the prompt: known output
            tokens = max(1, b * bs + c % bs)
            contents = BlockKeys.of(keys) if c % 2 else keys   # both shapes a caller passes
            kw = dict(max_total_tokens=tokens + c, expected_total_tokens=tokens + 1) if c > 1 else {}
            t.call("cached_prefix_tokens", tokens, contents)
            ok = t.call("can_allocate", tokens, contents, **kw) is AllocStatus.OK
            if op == "admit" and (ok or c == 3):   # sometimes a refused allocate: same error
                t.call("allocate", f"s{n}", tokens, contents, **kw)
        elif op == "import":
            tokens = max(1, b * bs + c % bs)
            if t.call("can_allocate", tokens, ()) is AllocStatus.OK:
                t.call("allocate", f"s{n}", tokens, ())
                t.call("mark_computed", f"s{n}", tokens)
        elif op == "step":
            t.call("take_transfers")
        elif op == "swap_in" and swapped:
            group = swapped[a % len(swapped):][:1 + c % 2]
            if t.call("can_swap_in", group) is AllocStatus.OK or c == 3:
                t.call("swap_in", group)
        elif op == "swap_out" and live:
            group = live[a % len(live):][:1 + c % 3]
            if t.call("can_swap_out", group) or c == 3:
                t.call("swap_out", group)
        elif live:
            seq = live[a % len(live)]
            if op == "compute":
                tokens = t.fast.num_tokens(seq) * min(b, 4) // 4   # often all of it
                t.call("mark_computed", seq, tokens)
            elif op == "grow":
                k = (0, 1, 1, bs + 1)[c] if b < 5 else b
                if t.call("can_append_slots", seq, k) or c == 3:
                    t.call("append_slots", seq, k)
            elif op == "fork":
                t.call("fork", seq, f"s{n}")
            elif op == "free":
                t.call("free", seq)
    t.call("take_transfers")


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(config=dict(block_size=2, num_gpu_blocks=10, num_cpu_blocks=4, watermark_blocks=0,
                     enable_prefix_caching=True, num_host_blocks=6),
         ops=[("admit", 0, 3, 0), ("compute", 0, 7, 0), ("fork", 0, 0, 0), ("grow", 0, 1, 1),
              ("grow", 1, 1, 1), ("compute", 1, 7, 0), ("swap_out", 0, 0, 2), ("admit", 0, 3, 0),
              ("free", 0, 0, 0), ("admit", 1, 7, 0), ("step", 0, 0, 0), ("swap_in", 0, 0, 1),
              ("admit", 0, 3, 1), ("step", 0, 0, 0)])
@given(config=configs(), ops=OPS)
def test_plain_and_fast_decide_alike(config, ops):
    run_ops(config, ops)


# --------------------------------------------------------------------------- the rare paths
def fresh(**kwargs) -> Both:
    return Both(**{"block_size": 1, "num_gpu_blocks": 12, "num_cpu_blocks": 12, **kwargs})


def test_a_swapped_group_sharing_a_block_without_the_one_before_stops_the_chain():
    """tests/test_memory_prefix_runs.py's swap case, through both managers: Q hits P's
    block at position 0 and S's at 1, and keeps sharing them after the group's round
    trip. S recommitting stops its chain at 1 (a block Q holds without S's block
    before it), so a later prompt hits only the first block, in both."""
    t = fresh(enable_prefix_caching=True)
    t.seqs = ["P", "S", "Q", "F", "G", "H"]
    t.call("allocate", "P", 2, ["k0"])
    t.call("allocate", "S", 4, ["k0", "k1", "k2"])
    t.call("mark_computed", "P", 1)
    t.call("mark_computed", "S", 3)      # S goes through P's entry at 0
    assert t.call("allocate", "Q", 3, ["k0", "k1"]) == 2
    t.call("swap_out", ["Q", "P", "S"])
    t.call("swap_in", ["Q", "P", "S"])
    t.call("allocate", "F", 5)
    t.call("free", "F")                  # evicts the old entries
    t.call("mark_computed", "S", 3)
    t.call("free", "S")
    assert t.call("allocate", "H", 4, ["k0", "k1", "k2"]) == 1
    t.call("allocate", "G", 6)


def test_a_referenced_orphan_stops_the_chain():
    """tests/test_memory_prefix_runs.py's orphan case: Z recomputes a block whose hash
    is held by X's referenced entry with a parent that is gone; Z's chain stops."""
    t = fresh(block_size=2, num_gpu_blocks=10, num_cpu_blocks=0, enable_prefix_caching=True)
    t.seqs = ["x", "y", "w1", "w2", "z", "v"]
    a = BlockKeys.of(prompt(0, 3, False))
    t.call("allocate", "x", 7, a)
    t.call("allocate", "y", 7, a)
    t.call("mark_computed", "y", 7)
    t.call("mark_computed", "x", 4)      # through Y's entries
    t.call("free", "y")
    t.call("allocate", "w1", 8, [("w", 0, i) for i in range(4)])
    t.call("mark_computed", "x", 7)
    t.call("allocate", "w2", 2, [("w", 1, i) for i in range(4)])   # evicts Y's second entry
    t.call("free", "w1")
    t.call("free", "w2")
    t.call("allocate", "z", 7, a)
    t.call("mark_computed", "z", 7)      # meets X's entry under the third block's hash
    assert t.plain._seqs["z"].chain_broken and t.plain._seqs["z"].num_committed == 2
    t.call("free", "x")
    t.call("allocate", "v", 7, a)


A = [("a", i) for i in range(4)]


def filler(name: str) -> list:
    return [(name, i) for i in range(4)]


def test_a_commit_after_a_chain_end_on_the_host_drops_the_host_copies():
    """tests/test_host_tier_runs.py's rare paths: X continues through Y's entries,
    which go to the host; X's next commits drop their host copies."""
    t = fresh(block_size=2, num_gpu_blocks=10, num_cpu_blocks=0, enable_prefix_caching=True,
              num_host_blocks=6)
    t.seqs = ["x", "y", "f", "g"]
    for seq in ("x", "y"):
        t.call("allocate", seq, 9, A)
    t.call("mark_computed", "y", 8)
    t.call("mark_computed", "x", 4)
    t.call("free", "y")
    t.call("allocate", "f", 9, filler("f"))   # evicts Y's entries to the host
    assert t.call("take_transfers")[0]
    t.call("mark_computed", "x", 6)
    t.call("mark_computed", "x", 8)
    assert t.plain.usage().num_host_cached_blocks == 2
    t.call("take_transfers")
    t.call("free", "f")
    assert t.call("allocate", "g", 9, A) == 8   # two blocks from each tier
    assert t.call("host_hit_tokens", "g") == 4
    assert t.call("take_transfers")[1]


def test_a_load_cancelled_by_a_commit_frees_its_host_block():
    """Z continues through Y's first entry, which then leaves both tiers; W recomputes
    the prompt (new entries under the same hashes), its second entry goes to the host,
    and B's hit loads it back into a GPU block. B is freed within the step, and Z's
    commit meets that entry under its hash with another parent: the evictable entry
    is dropped, its pending load cancelled and its host block freed, in both."""
    t = fresh(block_size=1, num_gpu_blocks=8, num_cpu_blocks=0, enable_prefix_caching=True,
              num_host_blocks=1)
    t.seqs = ["y", "z", "w", "b"] + [f"f{i}" for i in range(4)]
    keys = ["k0", "k1"]

    def evict(name: str, n: int) -> None:   # exactly n least recently used cached blocks
        t.call("allocate", name, t.plain.usage().num_free_blocks + n)
        t.call("free", name)

    t.call("allocate", "y", 3, keys)
    t.call("allocate", "z", 3, keys)
    t.call("mark_computed", "y", 1)
    t.call("mark_computed", "z", 1)          # through Y's entry: Z's block stays uncached
    t.call("free", "y")
    evict("f0", 1)                           # Y's entry to the host
    t.call("allocate", "f1", 2, ["other"])
    t.call("mark_computed", "f1", 1)
    t.call("free", "f1")
    evict("f2", 1)                           # and out of it
    t.call("allocate", "w", 3, keys)
    t.call("mark_computed", "w", 2)
    t.call("free", "w")
    evict("f3", 1)                           # W's second entry to the host
    t.call("take_transfers")
    assert t.call("allocate", "b", 3, keys) == 2 and t.call("host_hit_tokens", "b") == 1
    t.call("free", "b")
    t.call("mark_computed", "z", 2)
    assert t.call("take_transfers") == ([], [])   # the load was cancelled
    assert t.plain.usage().num_host_cached_blocks == 0


def test_fork_copy_on_write_returns_the_same_copies():
    t = fresh(block_size=2, enable_prefix_caching=True)
    t.seqs = ["a", "b"]
    t.call("allocate", "a", 5, [1, 2])
    t.call("mark_computed", "a", 5)
    t.call("fork", "a", "b")
    assert t.call("append_slots", "b", 1) == [(t.plain.block_table("a")[2], t.plain.block_table("b")[2])]
    assert t.call("append_slots", "a", 2) == []
    t.call("swap_out", ["a", "b"])
    t.call("swap_in", ["b", "a"])


def test_swap_in_may_use_the_watermark_when_nothing_else_holds_blocks():
    """Waiting could not free more: a group that fits only into the watermark comes back
    when no other sequence holds GPU blocks, and waits (LATER) while one does."""
    t = fresh(block_size=1, num_gpu_blocks=6, num_cpu_blocks=6, watermark_blocks=2)
    t.seqs = ["a", "b"]
    t.call("allocate", "a", 4)
    t.call("swap_out", ["a"])
    t.call("allocate", "b", 1)
    assert t.call("can_swap_in", ["a"]) is AllocStatus.LATER
    t.call("free", "b")
    assert t.call("can_swap_in", ["a"]) is AllocStatus.OK
    t.call("swap_in", ["a"])


def test_the_plain_chain_hash_is_the_fast_one():
    """Same hashes, region offsets included, so the two caches index alike."""
    for regions in (False, True):
        keys = prompt(5, 10, regions)
        assert chain_hashes(keys) == BlockKeys.of(keys).hashes


@pytest.mark.parametrize("call, message", [
    (lambda m: m.free("x"), "free: unknown sequence 'x' (never allocated, or already freed)"),
    (lambda m: m.block_table("x"), "block_table: unknown sequence 'x'"),
    (lambda m: m.append_slots("x", 1), "append_slots: unknown sequence 'x'"),
    (lambda m: m.can_append_slots("a", -1), "can_append_slots: num_new_tokens must be an integer >= 0, got -1"),
    (lambda m: m.mark_computed("a", 9), "mark_computed: sequence 'a' has 3 tokens, not 9"),
    (lambda m: m.allocate("a", 1), "allocate: sequence 'a' already has blocks"),
    (lambda m: m.allocate("b", 0), "allocate: num_tokens must be an integer >= 1, got 0"),
    (lambda m: m.fork("a", "a"), "fork: child sequence 'a' already has blocks"),
    (lambda m: m.swap_in(["a"]), "swap_in: sequence 'a' is not swapped out"),
    (lambda m: m.swap_out(["a", "a"]), "swap_out: a sequence is listed twice in ['a', 'a']"),
    (lambda m: m.host_hit_tokens("x"), "host_hit_tokens: unknown sequence 'x'"),
])
def test_bad_calls_raise_the_fast_managers_errors_and_change_nothing(call: Callable, message: str):
    t = fresh(block_size=2, enable_prefix_caching=True)
    t.seqs = ["a"]
    t.call("allocate", "a", 3, [7])
    for m in (t.fast, t.plain):
        with pytest.raises(BlockManagerError) as err:
            call(m)
        assert str(err.value) == message
    t.check()


@pytest.mark.parametrize("kwargs", [
    dict(block_size=0, num_gpu_blocks=4), dict(block_size=2, num_gpu_blocks=0),
    dict(block_size=2, num_gpu_blocks=4, num_cpu_blocks=-1),
    dict(block_size=2, num_gpu_blocks=4, watermark_blocks=4),
    dict(block_size=2, num_gpu_blocks=4, enable_prefix_caching=1),
    dict(block_size=2, num_gpu_blocks=4, num_host_blocks=2),
    dict(block_size=True, num_gpu_blocks=4),
])
def test_bad_sizes_are_refused_as_the_fast_manager_refuses_them(kwargs):
    messages = []
    for cls in (RunPagedBlockManager, PagedBlockManager):
        with pytest.raises(ValueError) as err:
            cls(**kwargs)
        messages.append(str(err.value).replace(cls.__name__, "M"))
    assert messages[0] == messages[1]


def test_from_config_builds_the_same_manager():
    from types import SimpleNamespace
    cache = SimpleNamespace(block_size=4, num_gpu_blocks=9, num_cpu_blocks=3, watermark_blocks=1,
                            enable_prefix_caching=True, num_host_blocks=5)
    fast, plain = RunPagedBlockManager.from_config(cache, 100), PagedBlockManager.from_config(cache, 100)
    assert isinstance(plain, PagedBlockManager) and plain.usage() == fast.usage()
