"""Shared by the kernel tests: a NaN-poisoned paged KV cache, per-dtype tolerances and the
device the kernel tests run on.

The kernel tests run on CPU tensors under the Triton interpreter. `scripts/gpu_check.sh`
runs the same cases on a CUDA GPU with ``SERVELAB_KERNEL_DEVICE=cuda`` (and the interpreter
off): inputs are still drawn on the CPU from the same seeded generators, then moved, so
both devices check the very same numbers."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

DEVICE = torch.device(os.environ.get("SERVELAB_KERNEL_DEVICE", "cpu"))

# (atol, rtol). fp32: kernel and reference differ only in summation order (online softmax
# over tiles vs one softmax). fp16/bf16: inputs are exact in both, the result is rounded to
# the dtype once (fp16 ulp 2^-11, bf16 2^-8 relative; |out| <~ 3), and on GPU the kernel
# also feeds 16-bit probabilities to tl.dot.
TOLERANCE = {
    torch.float32: (1e-5, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@dataclass(frozen=True)
class PagedKV:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32, a strided view (rows wider than max_blocks)
    keys: list[torch.Tensor]  # per sequence, [seq_len, num_kv_heads, head_dim], dense
    values: list[torch.Tensor]


def make_paged_kv(seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, gen: torch.Generator, spare_blocks: int = 2) -> PagedKV:
    """Random per-sequence K/V scattered into a NaN-poisoned cache through shuffled blocks."""
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + spare_blocks
    max_blocks = max(blocks_needed, default=0) + 1  # one unused column for every row
    physical = torch.randperm(num_blocks, generator=gen)
    nan_block = int(physical[-1])  # a spare block: never written, stays NaN
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    wide = torch.full((len(seq_lens), max_blocks + 3), nan_block, dtype=torch.int32)
    keys, values, next_block = [], [], 0
    for s, n in enumerate(seq_lens):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        ids = physical[next_block : next_block + blocks_needed[s]]
        next_block += blocks_needed[s]
        wide[s, : len(ids)] = ids.to(torch.int32)
        for p in range(n):
            k_cache[ids[p // block_size], p % block_size] = k[p]
            v_cache[ids[p // block_size], p % block_size] = v[p]
        keys.append(k)
        values.append(v)
    wide = wide.to(DEVICE)
    return PagedKV(k_cache.to(DEVICE), v_cache.to(DEVICE), wide[:, :max_blocks],
                   [k.to(DEVICE) for k in keys], [v.to(DEVICE) for v in values])
