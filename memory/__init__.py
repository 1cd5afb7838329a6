"""KV-cache block managers: the one way the scheduler touches KV memory.

`PagedBlockManager` is the vLLM-style manager (paging, prefix caching, copy-on-write,
swap); `ContiguousBlockManager` is the reserve-up-front baseline it replaced. Both follow
the `BlockManager` protocol in `base`, so policies and executors never know which one
is behind it. Pure standard library: no torch, triton, simpy or numpy.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .base import AllocStatus, BlockManager, BlockManagerError, BlockUsage
from .contiguous import ContiguousBlockManager
from .paged import PagedBlockManager

if TYPE_CHECKING:
    from servelab.config import CacheConfig

__all__ = ["AllocStatus", "BlockManager", "BlockManagerError", "BlockUsage",
           "ContiguousBlockManager", "PagedBlockManager", "make_block_manager"]


def make_block_manager(cache: CacheConfig, max_model_len: int) -> BlockManager:
    """The block manager a `CacheConfig` names: "paged", or "contiguous-<mode>" with
    mode max, pow2 or oracle. `max_model_len` sizes the contiguous reservations.
    Contiguous managers have no prefix cache, so `enable_prefix_caching` leaves them
    unchanged (their prefix hits stay 0, which is the comparison being made)."""
    kind = cache.block_manager
    if kind == "paged":
        return PagedBlockManager(cache.block_size, cache.num_gpu_blocks, cache.num_cpu_blocks,
                                 watermark_blocks=cache.watermark_blocks,
                                 enable_prefix_caching=cache.enable_prefix_caching)
    prefix, _, mode = kind.partition("-")
    if prefix != "contiguous":
        raise ValueError(f"CacheConfig.block_manager: unknown block manager {kind!r}")
    return ContiguousBlockManager(cache.block_size, cache.num_gpu_blocks, cache.num_cpu_blocks,
                                  mode=mode, max_model_len=max_model_len,
                                  watermark_blocks=cache.watermark_blocks)
