"""Sizing the CPU tier of the prefix cache, and the checks a run makes before it starts.

`--kv-offload-gb GB` gives each replica GB GiB of host memory for prefix blocks evicted
from its GPUs (the CPU tier, `memory/host_tier.py`). A block there holds the whole
replica's KV for `block_size` tokens (every tensor-parallel shard), so the tier holds
floor(GB × 2^30 / replica block bytes) blocks.

The machine model bounds it: a GPU's catalog entry may say how much host memory the
reference server has per GPU (`GPUSpec.host_memory_gb`, e.g. 256 GB on a DGX H100); a
replica of `tp` GPUs may keep at most tp × that in host memory, the swap pool included.
"""
from __future__ import annotations

import math

GIB = 1 << 30


def host_tier_blocks(kv_offload_gb: float, replica_block_bytes: int) -> int:
    """Blocks of a CPU tier of `kv_offload_gb` GiB, each `replica_block_bytes` bytes;
    ValueError when a tier was asked for but cannot hold one block (a run would go on
    without one, silently)."""
    blocks = int(kv_offload_gb * GIB // replica_block_bytes)
    if kv_offload_gb > 0 and blocks == 0:
        raise ValueError(f"--kv-offload-gb {kv_offload_gb:g} holds no KV block: one takes "
                         f"{replica_block_bytes / GIB:.6g} GiB (the whole replica's KV for "
                         f"one block of tokens); give at least that, or 0 for no CPU tier")
    return blocks


def check_host_memory(gpu, tp: int, kv_offload_gb: float, swap_bytes: int) -> None:
    """ValueError, naming the limit and where it comes from, when the CPU tier and the
    swap pool of one replica need more host memory than its GPUs' share of the reference
    server (`gpu.host_memory_gb` per GPU; no check when the catalog gives none)."""
    per_gpu = getattr(gpu, "host_memory_gb", None)
    if per_gpu is None or not (kv_offload_gb or swap_bytes):
        return
    limit = per_gpu * tp
    need = kv_offload_gb + swap_bytes / GIB
    if need > limit:
        parts = [f"--kv-offload-gb {kv_offload_gb:g}"] if kv_offload_gb else []
        if swap_bytes:
            parts.append(f"{swap_bytes / GIB:.1f} GiB swap pool (--cpu-kv-blocks)")
        raise ValueError(
            f"{' + '.join(parts)} needs {need:.1f} GiB of host memory per "
            f"replica, more than its {tp} x {gpu.name} can have: {limit:g} GiB ({per_gpu:g} GiB "
            f"host memory per GPU on the reference server, host_memory_gb in the GPU catalog)")


def check_prefix_block_sizes(trace, block_size: int) -> None:
    """ValueError unless the KV block size divides every prefix-hash block size of the
    trace. A trace's hash names a block of prefix_block_size tokens; a KV block must lie
    inside one such block for the cache to reuse exactly what the trace says is shared
    (a KV block straddling two could be reused only where both hashes match, and one
    holding several only where all do)."""
    sizes = sorted({r.prefix_block_size for r in trace.records if r.prefix_hashes is not None})
    bad = [s for s in sizes if s % block_size]
    if bad:
        g = math.gcd(*sizes)
        raise ValueError(
            f"the trace's prefix hashes name {bad[0]}-token blocks, which the KV block size "
            f"{block_size} does not divide: a KV block would span hashed blocks and be reused "
            f"only where all of them match; use a --block-size that divides {bad[0]} "
            f"(e.g. {16 if g % 16 == 0 else g}), or turn prefix caching off "
            f"(--no-prefix-caching)")
