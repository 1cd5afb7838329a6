"""The host (CPU) tier keeps its entries per run (memory/host_tier.py): an eviction moves
stretches of GPU runs as runs, a hit takes a stretch out, a commit drops the host copies
of what it enters by looking at run heads. None of that may change a decision. The
oracle here is both tiers as their contract states it, one block at a time: the GPU
cache of tests/test_memory_prefix_runs.py plus a host tier with a dict from chain hash to
host block, an entry per block, an OrderedDict for its LRU order, a free stack, and the
copies pending until they are taken (an offload dropped when its entry leaves the tier
again within the step, a load dropped when its GPU block is reused first). Random
workloads whose prompts share prefixes, on a GPU and a host tier small enough that
evictions overflow the tier and hits come back from it, must get the same hits (from the
same tier), the same block tables, the same copies (host block ids included), the same
eviction order in both tiers and the same free stacks, after every call."""
from __future__ import annotations

from collections import OrderedDict

from hypothesis import example, given, settings, strategies as st

from servelab.memory import AllocStatus
from servelab.simulator.speed import RunPagedBlockManager
from servelab.simulator.speed.block_keys import BlockKeys

BS = 2


class PlainTwoTierManager:
    """Paged blocks with a per-block prefix cache and a per-block host tier: what
    `RunPagedBlockManager` with prefix caching and `num_host_blocks` decides, without forks,
    swaps or a watermark, and with a chain hash that does not collide."""

    def __init__(self, num_blocks: int, num_host_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, -1, -1))
        self.refs = [0] * num_blocks
        # block -> (hash, id, parent id, content)
        self.entry: dict[int, tuple[int, int, int, object]] = {}
        self.by_hash: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()   # evictable, least recent first
        self.next_id = 1
        self.seqs: dict[str, dict] = {}
        # the host tier
        self.host_free = list(range(num_host_blocks - 1, -1, -1))
        self.host_entry: dict[int, tuple[int, int, int, object]] = {}
        self.host_by_hash: dict[int, int] = {}
        self.host_lru: OrderedDict[int, None] = OrderedDict()
        self.pending_free: list[int] = []    # loaded from: free once the copies are taken
        self.offloads: dict[int, int] = {}   # host block -> GPU block
        self.loads: dict[int, int] = {}      # GPU block -> host block

    # ------------------------------------------------------------------ look-ups
    def match(self, keys: BlockKeys, num_tokens: int) -> tuple[list[tuple[str, int]], int]:
        """[(tier, block)] of the cached leading blocks, and the last one's entry id."""
        hits, pid = [], 0
        for i in range(min((num_tokens - 1) // BS, len(keys))):
            h, content = keys.hashes[i], keys.keys[i]
            for tier, index, entries in (("gpu", self.by_hash, self.entry),
                                         ("host", self.host_by_hash, self.host_entry)):
                b = index.get(h)
                if b is not None and entries[b][2] == pid and entries[b][3] == content:
                    hits.append((tier, b))
                    pid = entries[b][1]
                    break
            else:
                break
        return hits, pid

    def can_allocate(self, num_tokens: int, keys: BlockKeys) -> bool:
        hits, _ = self.match(keys, num_tokens)
        need = -(-num_tokens // BS) - len(hits) \
            + sum(tier == "host" or b in self.lru for tier, b in hits)
        return need <= len(self.free) + len(self.lru)

    # ------------------------------------------------------------------ moves
    def take(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.pop()
            else:
                b, _ = self.lru.popitem(last=False)
                entry = self.entry.pop(b)
                del self.by_hash[entry[0]]
                self.store(b, entry)
            self.refs[b] = 1
            out.append(b)
        return out

    def store(self, b: int, entry: tuple) -> None:
        """GPU block b was evicted: its entry goes to the host tier."""
        hb = self.loads.pop(b, None)
        if hb is not None:   # loaded and evicted within the step: back where it was
            self.pending_free.remove(hb)
        elif self.host_free:
            hb = self.host_free.pop()
            self.offloads[hb] = b
        elif self.host_lru:
            hb, _ = self.host_lru.popitem(last=False)
            del self.host_by_hash[self.host_entry.pop(hb)[0]]
            self.offloads.pop(hb, None)
            self.offloads[hb] = b
        else:   # every host block waits for a load
            return
        self.host_entry[hb] = entry
        self.host_by_hash[entry[0]] = hb
        self.host_lru[hb] = None

    def host_discard(self, h: int) -> None:
        hb = self.host_by_hash.pop(h, None)
        if hb is not None:
            del self.host_entry[hb]
            del self.host_lru[hb]
            self.offloads.pop(hb, None)
            self.host_free.append(hb)

    def allocate(self, seq: str, num_tokens: int, keys: BlockKeys) -> tuple[int, int]:
        hits, pid = self.match(keys, num_tokens)
        loaded = []
        for tier, b in hits:
            if tier == "gpu":
                self.lru.pop(b, None)
                self.refs[b] += 1
            else:
                entry = self.host_entry.pop(b)
                del self.host_by_hash[entry[0]]
                del self.host_lru[b]
                self.pending_free.append(b)
                loaded.append((b, entry))
        new = self.take(-(-num_tokens // BS) - len(hits) + len(loaded))
        blocks = []
        for tier, b in hits:
            if tier == "host":
                hb, entry = loaded.pop(0)
                b = new.pop(0)
                self.loads[b] = hb
                self.entry[b] = entry
                self.by_hash[entry[0]] = b
            blocks.append(b)
        self.seqs[seq] = dict(blocks=blocks + new, tokens=num_tokens, keys=keys,
                              committed=len(hits), pid=pid, broken=False)
        return len(hits) * BS, sum(tier == "host" for tier, _ in hits) * BS

    def mark_computed(self, seq: str, num_tokens: int) -> None:
        s = self.seqs[seq]
        if s["broken"]:
            return
        keys, pid = s["keys"], s["pid"]
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
                del self.by_hash[self.entry.pop(b)[0]]
                self.free.append(b)
                hb = self.loads.pop(b, None)   # a pending load into it is cancelled
                if hb is not None:
                    self.pending_free.remove(hb)
                    self.offloads.pop(hb, None)
                    self.host_free.append(hb)
            self.host_discard(h)   # one tier at a time
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
        if need > len(self.free) + len(self.lru):
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

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        offloads = [(g, h) for h, g in self.offloads.items()]
        loads = [(h, g) for g, h in self.loads.items()]
        self.offloads.clear()
        self.loads.clear()
        self.host_free += self.pending_free
        self.pending_free.clear()
        return offloads, loads


def prompt(family: int, nblocks: int, ahead: int) -> list:
    """Block contents: families of the same parity share their first two blocks, then
    each has its own; `ahead` more keys than the prompt holds (known output)."""
    return [(family % 2, i) if i < 2 else (family, i) for i in range(nblocks + ahead)]


OPS = st.lists(st.tuples(st.sampled_from(["admit", "admit", "admit", "compute", "compute",
                                          "compute", "grow", "free", "free", "free", "step",
                                          "step"]),
                         st.integers(0, 5), st.integers(1, 7), st.integers(0, 2)),
               min_size=20, max_size=150)


def check_same(m: RunPagedBlockManager, plain: PlainTwoTierManager, live: list[str]) -> None:
    assert m.evictable_blocks() == list(plain.lru)
    assert [m.block_table(s) for s in live] == [plain.seqs[s]["blocks"] for s in live]
    assert sorted(m._cache.hash_index().items()) == sorted(plain.by_hash.items())
    host = m._host
    assert host.index.block_of_hash == plain.host_by_hash
    assert host.lru_blocks() == list(plain.host_lru)
    assert host._free == plain.host_free
    assert list(host._pending_free) == plain.pending_free
    assert host.pending_offloads() == [(g, h) for h, g in plain.offloads.items()]
    assert list(host._loads.items()) == list(plain.loads.items())


@settings(max_examples=300, deadline=None)
@example(  # hits loaded from the host, then, in the same step, an eviction larger than
    # the tier can take (its other blocks wait for those loads): one entry at a time
    ops=[("admit", 0, 7, 0), ("compute", 0, 5, 0), ("free", 0, 0, 0), ("admit", 1, 7, 0),
         ("compute", 0, 5, 0), ("free", 0, 0, 0), ("step", 0, 0, 0), ("admit", 2, 3, 0),
         ("admit", 0, 7, 1), ("free", 0, 0, 0), ("admit", 5, 7, 0), ("step", 0, 0, 0)],
    num_blocks=10, num_host_blocks=6)
@given(ops=OPS, num_blocks=st.integers(5, 12), num_host_blocks=st.integers(1, 10))
def test_host_runs_decide_as_one_block_at_a_time(ops, num_blocks, num_host_blocks):
    m = RunPagedBlockManager(BS, num_blocks, enable_prefix_caching=True,
                          num_host_blocks=num_host_blocks)
    plain = PlainTwoTierManager(num_blocks, num_host_blocks)
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
                hit = m.allocate(seq, tokens, keys)
                assert (hit, m.host_hit_tokens(seq)) == plain.allocate(seq, tokens, keys)
                live.append(seq)
        elif op == "step":
            assert m.take_transfers() == plain.take_transfers()
        elif live:
            seq = live[a % len(live)]
            if op == "compute":
                tokens = m.num_tokens(seq) * b // 5 if b < 5 else m.num_tokens(seq)
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
        check_same(m, plain, live)
    m.check_invariants()
    assert m.take_transfers() == plain.take_transfers()
    m.check_invariants()


# --------------------------------------------------------------------------- the rare paths
class Both:
    """The manager and the oracle driven by the same calls, compared after each."""

    def __init__(self, num_blocks: int, num_host_blocks: int) -> None:
        self.m = RunPagedBlockManager(BS, num_blocks, enable_prefix_caching=True,
                                   num_host_blocks=num_host_blocks)
        self.plain = PlainTwoTierManager(num_blocks, num_host_blocks)
        self.live: list[str] = []

    def allocate(self, seq: str, contents: list) -> None:
        tokens = len(contents) * BS + 1
        keys = BlockKeys.of(contents)
        hit = self.m.allocate(seq, tokens, keys)
        assert (hit, self.m.host_hit_tokens(seq)) == self.plain.allocate(seq, tokens, keys)
        self.live.append(seq)
        self.check()

    def compute(self, seq: str, num_blocks: int) -> None:
        self.m.mark_computed(seq, num_blocks * BS)
        self.plain.mark_computed(seq, num_blocks * BS)
        self.check()

    def free(self, seq: str) -> None:
        self.live.remove(seq)
        self.m.free(seq)
        self.plain.release(seq)
        self.check()

    def step(self) -> None:
        assert self.m.take_transfers() == self.plain.take_transfers()
        self.check()

    def check(self) -> None:
        check_same(self.m, self.plain, self.live)
        self.m.check_invariants()


A = [("a", i) for i in range(4)]


def filler(name: str) -> list:
    return [(name, i) for i in range(4)]


def test_a_commit_after_a_chain_end_on_the_host_drops_the_entry_after_it():
    """X continues its chain through Y's entries (its own blocks stay uncached); Y's run
    then goes to the host whole. X's next block commits on the GPU after an entry that is
    on the host: the host copy of that block sits inside the host run, after X's chain
    end, and must go (the run splits), as one block at a time it would."""
    t = Both(num_blocks=10, num_host_blocks=6)
    t.allocate("x", A)
    t.allocate("y", A)
    t.compute("y", 4)
    t.compute("x", 2)          # through Y's first two entries
    t.free("y")                # Y's entries evictable
    t.allocate("f", filler("f"))   # evicts them: one host run of four
    t.step()
    assert len(t.m._host._runs()) == 1
    t.compute("x", 3)          # X's third block: its host copy goes, the run splits
    assert len(t.m._host._runs()) == 2 and t.m._host.num_cached == 3
    t.compute("x", 4)          # the fourth: the upper part's head goes
    assert t.m._host.num_cached == 2
    t.step()


def test_a_commit_whose_chain_end_left_both_tiers_drops_copies_inside_host_runs():
    """X's chain ends at Y's second entry, which then leaves both tiers; W recomputes
    the same prompt (new entries under the same hashes), and W's run goes to the host.
    X's next blocks recompute entries W's host run holds inside it: found by scanning
    the tier, as one block at a time would drop them."""
    t = Both(num_blocks=10, num_host_blocks=4)
    t.allocate("x", A)
    t.allocate("y", A)
    t.compute("y", 4)
    t.compute("x", 2)
    t.free("y")
    t.allocate("f1", filler("f1"))   # Y's entries to the host
    t.step()
    t.free("f1")
    t.allocate("f2", filler("f2"))
    t.compute("f2", 4)
    t.free("f2")
    t.allocate("f3", filler("f3"))   # F2's entries to the host, Y's out of it
    t.step()
    t.free("f3")
    t.allocate("w", A)               # no hit: W makes new entries under Y's hashes
    t.compute("w", 4)
    t.free("w")
    t.allocate("f4", filler("f4"))   # W's entries to the host
    t.step()
    t.compute("x", 3)
    assert t.m._host.num_cached == 3
    t.compute("x", 4)
    assert t.m._host.num_cached == 2
    t.step()
