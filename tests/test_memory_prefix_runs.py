"""The prefix cache keeps its entries per run (memory/prefix_runs.py): a commit enters a
stretch of blocks as one run, a release parks runs, an eviction takes runs' tails. None
of that may change a decision. The oracle here is the cache as its contract states it,
one block at a time: a dict from chain hash to block, an entry per block, an
OrderedDict for the LRU order. Random workloads whose prompts share prefixes (families)
must get the same hits, the same block ids, the same free count and the same eviction
order from both, after every call."""
from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings, strategies as st

from servelab.memory import AllocStatus
from servelab.simulator.speed import RunPagedBlockManager
from servelab.simulator.speed.block_keys import BlockKeys

BS = 2


class PlainPrefixManager:
    """Paged blocks with a per-block prefix cache: what `RunPagedBlockManager` with prefix
    caching decides, without forks, swaps, a watermark or a host tier."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))
        self.refs = [0] * num_blocks
        self.entry: dict[int, tuple[int, int, int, object]] = {}  # block -> (hash, id, parent id, content)
        self.by_hash: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()   # evictable, least recent first
        self.next_id = 1
        self.seqs: dict[str, dict] = {}

    def num_free(self) -> int:
        return len(self.free) + len(self.lru)

    def match(self, keys: BlockKeys, num_tokens: int) -> tuple[list[int], int]:
        blocks, pid = [], 0
        for i in range(min((num_tokens - 1) // BS, len(keys))):
            b = self.by_hash.get(keys.hashes[i])
            if b is None or self.entry[b][2] != pid or self.entry[b][3] != keys.keys[i]:
                break
            blocks.append(b)
            pid = self.entry[b][1]
        return blocks, pid

    def can_allocate(self, num_tokens: int, keys: BlockKeys) -> bool:
        hits, _ = self.match(keys, num_tokens)
        need = -(-num_tokens // BS) - len(hits) + sum(b in self.lru for b in hits)
        return need <= self.num_free()

    def take(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.pop()
            else:
                b, _ = self.lru.popitem(last=False)
                self.forget(b)
            self.refs[b] = 1
            out.append(b)
        return out

    def forget(self, b: int) -> None:
        del self.by_hash[self.entry.pop(b)[0]]

    def allocate(self, seq: str, num_tokens: int, keys: BlockKeys) -> int:
        hits, pid = self.match(keys, num_tokens)
        for b in hits:
            self.lru.pop(b, None)
            self.refs[b] += 1
        blocks = hits + self.take(-(-num_tokens // BS) - len(hits))
        self.seqs[seq] = dict(blocks=blocks, tokens=num_tokens, keys=keys, committed=len(hits),
                              pid=pid, broken=False)
        return len(hits) * BS

    def mark_computed(self, seq: str, num_tokens: int) -> None:
        s = self.seqs[seq]
        if s["broken"]:
            return
        keys, pid = s["keys"], s["pid"]
        i = s["committed"]
        for i in range(s["committed"], min(num_tokens // BS, len(keys))):
            h, content = keys.hashes[i], keys.keys[i]
            b = self.by_hash.get(h)
            if b is not None:
                if self.entry[b][2] == pid and self.entry[b][3] == content:
                    pid = self.entry[b][1]   # another sequence's entry continues the chain
                    s["committed"] = i + 1
                    continue
                if b not in self.lru:   # held by referenced other content: the chain stops
                    s["broken"] = True
                    break
                del self.lru[b]
                self.forget(b)
                self.free.append(b)
            block = s["blocks"][i]
            self.entry[block] = (h, self.next_id, pid, content)
            self.by_hash[h] = block
            pid = self.next_id
            self.next_id += 1
            s["committed"] = i + 1
        s["pid"] = pid

    def append(self, seq: str, k: int) -> bool:
        s = self.seqs[seq]
        need = -(-(s["tokens"] + k) // BS) - len(s["blocks"])
        if need > self.num_free():
            return False
        s["blocks"] += self.take(need)
        s["tokens"] += k
        return True

    def release(self, seq: str) -> None:
        for b in reversed(self.seqs.pop(seq)["blocks"]):
            self.refs[b] -= 1
            if not self.refs[b]:
                if b in self.entry:
                    self.lru[b] = None
                else:
                    self.free.append(b)


def prompt(family: int, nblocks: int, ahead: int) -> list:
    """Block contents: families 0-3 share their first two blocks in pairs (0 with 2, 1
    with 3), then their own; `ahead` more keys than the prompt holds (known output)."""
    return [(family % 2, i) if i < 2 else (family, i) for i in range(nblocks + ahead)]


OPS = st.lists(st.tuples(st.sampled_from(["admit", "admit", "compute", "compute", "grow", "free"]),
                         st.integers(0, 3), st.integers(1, 6), st.integers(0, 2)),
               min_size=10, max_size=120)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, num_blocks=st.integers(6, 16))
def test_runs_decide_as_one_block_at_a_time(ops, num_blocks):
    m = RunPagedBlockManager(BS, num_blocks, enable_prefix_caching=True)
    plain = PlainPrefixManager(num_blocks)
    live: list[str] = []
    for n, (op, a, b, c) in enumerate(ops):
        if op == "admit":
            contents = prompt(a, b, c)
            tokens = b * BS + c % BS
            keys = BlockKeys.of(contents)
            ok = m.can_allocate(tokens, keys) is AllocStatus.OK
            assert ok == plain.can_allocate(tokens, keys)
            if ok:
                seq = f"s{n}"
                assert m.allocate(seq, tokens, keys) == plain.allocate(seq, tokens, keys)
                live.append(seq)
        elif live:
            seq = live[a % len(live)]
            if op == "compute":
                tokens = m.num_tokens(seq) * b // 6 if b < 6 else m.num_tokens(seq)
                m.mark_computed(seq, tokens)
                plain.mark_computed(seq, tokens)
            elif op == "grow":
                grown = m.can_append_slots(seq, b)
                assert grown == plain.append(seq, b)
                if grown:
                    m.append_slots(seq, b)
            else:
                live.remove(seq)
                m.free(seq)
                plain.release(seq)
        assert m.num_free_blocks == plain.num_free()
        assert m.evictable_blocks() == list(plain.lru)
        assert [m.block_table(s) for s in live] == [plain.seqs[s]["blocks"] for s in live]
        assert sorted(m._cache.hash_index().items()) == sorted(plain.by_hash.items())
    m.check_invariants()


def test_a_referenced_orphan_stops_the_chain_as_one_block_at_a_time():
    """The path random workloads rarely reach: X continues its chain through Y's
    entries (its own blocks stay uncached), commits its third block under Y's second
    entry, and that entry is evicted while X lives. Z then recomputes the second block
    (a new entry) and finds its third block's hash held by X's entry, whose parent is
    gone: referenced, so Z's chain stops there, in both."""
    m = RunPagedBlockManager(BS, 10, enable_prefix_caching=True)
    plain = PlainPrefixManager(10)
    a = BlockKeys.of(prompt(0, 3, 0))
    filler = [BlockKeys.of([("w", n, i) for i in range(4)]) for n in range(2)]

    def both(method: str, *args) -> None:
        model_method = {"free": "release", "allocate": "allocate",
                        "mark_computed": "mark_computed"}[method]
        assert getattr(m, method)(*args) == getattr(plain, model_method)(*args)
        assert m.evictable_blocks() == list(plain.lru)
        assert sorted(m._cache.hash_index().items()) == sorted(plain.by_hash.items())

    both("allocate", "x", 7, a)
    both("allocate", "y", 7, a)
    both("mark_computed", "y", 7)   # Y's blocks hold entries A0 A1 A2
    both("mark_computed", "x", 4)   # X goes through A0 A1; its blocks stay uncached
    both("free", "y")               # evictable, A2 first
    both("allocate", "w1", 8, filler[0])   # 3 free blocks and A2
    both("mark_computed", "x", 7)   # X's third block: a new entry, parent A1
    both("allocate", "w2", 2, filler[1])   # evicts A1
    both("free", "w1")
    both("free", "w2")
    both("allocate", "z", 7, a)     # hits A0
    both("mark_computed", "z", 7)   # recomputes A1, meets X's entry under A2's hash
    assert plain.seqs["z"]["broken"] and plain.seqs["z"]["committed"] == 2
    assert m._seqs["z"].chain_broken and m._seqs["z"].num_committed == 2
    m.check_invariants()


def test_a_group_swapped_in_shares_blocks_a_run_may_not_hold():
    """After a swap, Q shares P's block at position 0 and S's at position 1 (its prefix
    hits came from two runs), so S and Q share a block without sharing the one before
    it. S recommitting must not make a run over that block (Q would hold an entry
    without the one before it, and releasing S would park Q's block): S's chain stops
    there, and no block ever goes to two sequences."""
    m = RunPagedBlockManager(1, 12, 12, enable_prefix_caching=True)
    m.allocate("P", 2, ["k0"])
    m.allocate("S", 4, ["k0", "k1", "k2"])
    m.mark_computed("P", 1)
    m.mark_computed("S", 3)            # S goes through P's entry at 0: its run is 1..2
    m.allocate("Q", 3, ["k0", "k1"])   # hits P's block at 0 and S's at 1
    m.swap_out(["Q", "P", "S"])
    m.swap_in(["Q", "P", "S"])
    s_blocks, q_blocks = m.block_table("S"), m.block_table("Q")
    assert s_blocks[1] == q_blocks[1] and s_blocks[0] != q_blocks[0]
    m.allocate("F", 5)
    m.free("F")                        # evicts the old entries
    m.mark_computed("S", 3)
    m.check_invariants()
    assert m._seqs["S"].chain_broken and m._seqs["S"].num_committed == 1
    m.free("S")
    m.check_invariants()
    m.allocate("G", 8)
    assert not set(m.block_table("G")) & set(q_blocks)
    m.check_invariants()
