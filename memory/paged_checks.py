"""The paged block manager's self-check (`PagedBlockManager.check_invariants`), kept apart
from the manager it checks: tests call it after every operation; serving never does."""
from __future__ import annotations

from .base import invariant

__all__ = ["PagedChecks"]


class PagedChecks:
    """`check_invariants` of `PagedBlockManager` (memory/paged.py): a mixin reading the
    manager's block tables (`_seqs`), reference counts, free lists, prefix cache and host
    tier."""

    def check_invariants(self) -> None:
        """Every block table, reference count, free list and cache entry agrees with the
        others (AssertionError naming the first that does not); O(blocks). For tests."""
        bs = self.block_size
        refs, cpu_refs = [0] * self.num_gpu_blocks, [0] * self.num_cpu_blocks
        fills: dict[int, int] = {}
        for seq_id, seq in self._seqs.items():
            invariant(seq.num_tokens >= 1 and len(seq.blocks) == -(-seq.num_tokens // bs),
                      f"sequence {seq_id!r}: {len(seq.blocks)} blocks for {seq.num_tokens} tokens")
            invariant(len(set(seq.blocks)) == len(seq.blocks), f"sequence {seq_id!r} holds a block twice")
            invariant(seq.num_committed <= min(len(seq.keys), seq.num_tokens // bs),
                      f"sequence {seq_id!r} committed {seq.num_committed} blocks")
            for i, b in enumerate(seq.blocks):
                (refs if seq.on_gpu else cpu_refs)[b] += 1
                if seq.on_gpu:
                    fill = min(bs, seq.num_tokens - i * bs)
                    invariant(fills.setdefault(b, fill) == fill, f"sharers of block {b} disagree on its fill")
        invariant(refs == self._refs, "GPU reference counts differ from the block tables")
        invariant(cpu_refs == self._cpu_refs, "CPU reference counts differ from the block tables")
        evictable = self.evictable_blocks()
        for name, free, counts in (("GPU", self._free + evictable, refs), ("CPU", self._cpu_free, cpu_refs)):
            invariant(len(set(free)) == len(free), f"{name} free and evictable blocks repeat")
            invariant(all(counts[b] == 0 for b in free), f"a {name} block is both free and referenced")
            invariant(len(free) + sum(1 for r in counts if r) == len(counts),
                      f"{name} blocks are neither free nor referenced")
        if self._cache is not None:
            entries = self._cache.entries()
            invariant(not set(self._free) & set(entries), "a free block is cached")
            invariant(set(evictable) == {b for b in entries if not refs[b]},
                      "evictable blocks differ from the unreferenced cached ones")
            invariant(len({e.id for e in entries.values()}) == len(entries), "an entry id repeats")
            for seq_id, seq in self._seqs.items():
                if seq.on_gpu and seq.num_tokens % bs:
                    invariant(seq.blocks[-1] not in entries, f"sequence {seq_id!r}: partial block cached")
        if self._host is not None:
            self._host.check_invariants()
            gpu_hashes = {e.hash for e in self._cache.entries().values()}
            invariant(not gpu_hashes & {e.hash for e in self._host.entries().values()},
                      "a content is cached in both tiers")
        invariant(self._prefix_hits <= self._prefix_queries, "more prefix hits than queries")
