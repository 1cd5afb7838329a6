"""What the plain paged block manager (paged.py) and the simulator's speed-layer one
(simulator/speed/paged.py) share: construction from a `CacheConfig` and the queries read
straight off their tables, so that the two cannot answer differently."""
from __future__ import annotations

from typing import Hashable

from .base import BlockManagerError, BlockUsage


class PagedCommon:
    """What both paged managers share, the plain one and the speed layer's
    (simulator/speed/paged.py): the constructor from a `CacheConfig`, and the queries
    answered from their state: the pool sizes (`block_size`, `num_gpu_blocks`,
    `num_cpu_blocks`, `num_host_blocks`), the sequence table (`_seqs`: seq id -> an entry
    with `blocks`, `num_tokens`, `on_gpu`), the free lists (`_free`, `_cpu_free`), the
    prefix cache (`_cache`, None when off, with `num_evictable` and `evictable_blocks()`),
    the host tier (`_host`, None when off) and the prefix counters (`_prefix_queries`,
    `_prefix_hits`)."""

    __slots__ = ()

    @classmethod
    def from_config(cls, cache, max_model_len: int):
        """The manager a `CacheConfig` describes (`max_model_len` is not needed)."""
        return cls(cache.block_size, cache.num_gpu_blocks, cache.num_cpu_blocks,
                   watermark_blocks=cache.watermark_blocks,
                   enable_prefix_caching=cache.enable_prefix_caching,
                   num_host_blocks=cache.num_host_blocks)

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._seq("block_table", seq_id).blocks)

    def has_seq(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def is_swapped(self, seq_id: Hashable) -> bool:
        return not self._seq("is_swapped", seq_id).on_gpu

    def num_tokens(self, seq_id: Hashable) -> int:
        """Token slots the sequence holds."""
        return self._seq("num_tokens", seq_id).num_tokens

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + (self._cache.num_evictable if self._cache is not None else 0)

    @property
    def num_used_blocks(self) -> int:
        return self.num_gpu_blocks - self.num_free_blocks

    def evictable_blocks(self) -> list[int]:
        """Cached blocks nobody references, least recently used (next evicted) first."""
        return self._cache.evictable_blocks() if self._cache is not None else []

    def _token_slots_used(self) -> int:
        """Token slots the GPU block tables fill (each manager counts them its own way)."""
        raise NotImplementedError

    def usage(self) -> BlockUsage:
        """O(1), plus what `_token_slots_used` costs (the plain manager walks its tables)."""
        cached = self._cache.num_evictable if self._cache is not None else 0
        used = self.num_gpu_blocks - len(self._free) - cached
        host = self._host
        return BlockUsage(
            num_total_blocks=self.num_gpu_blocks, num_used_blocks=used,
            num_free_blocks=len(self._free), num_cached_blocks=cached,
            token_slots_used=self._token_slots_used(), token_slots_allocated=used * self.block_size,
            reserved_unused_slots=0, num_cpu_total_blocks=self.num_cpu_blocks,
            num_cpu_used_blocks=self.num_cpu_blocks - len(self._cpu_free),
            prefix_queries=self._prefix_queries, prefix_hits=self._prefix_hits,
            num_host_total_blocks=self.num_host_blocks,
            num_host_cached_blocks=host.num_cached if host is not None else 0,
            host_offloaded_blocks=host.offloaded if host is not None else 0,
            host_loaded_blocks=host.loaded if host is not None else 0)

    def _seq(self, op: str, seq_id: Hashable):
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise BlockManagerError(f"{op}: unknown sequence {seq_id!r}")
        return seq

    def _gpu_seq(self, op: str, seq_id: Hashable):
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise BlockManagerError(f"{op}: unknown sequence {seq_id!r}")
        if not seq.on_gpu:
            raise BlockManagerError(f"{op}: sequence {seq_id!r} is swapped out")
        return seq
