"""Paged decode attention: one query token per sequence over its paged KV cache.

Split-KV (flash-decoding). A sequence's context is cut into splits of a FIXED number of
tokens (``split_size``); program (sequence, kv head, split) runs an online softmax over its
split for all query heads of the kv head's GQA group at once, so each K/V tile is loaded
once per group rather than once per query head. A second kernel merges the splits'
partial outputs with their log-sum-exps. Because the split size is fixed, a request's
partition, and hence its rounding, does not depend on which other requests share the
batch. When the widest block table holds at most one split, the first kernel writes the
output directly and the merge is skipped.

Memory traffic is what bounds decode: each program streams ``split_size`` tokens of K and V
for one kv head; the partials add ``B x H x num_splits x (head_dim + 1)`` fp32 writes and
reads, small next to the cache for head_dim >= 64. The grid is sized from the block table
width (no host sync), so programs of splits past a sequence's length exit without work.

Addressing: token ``p`` of sequence ``b`` lives at block ``block_tables[b, p // block_size]``,
offset ``p % block_size``; block ids are widened to int64 before multiplying by strides.
Loads beyond the sequence are masked, so poisoned (NaN) slots never reach the result.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import KernelLaunch
from .reference import (
    DEFAULT_SPLIT_SIZE,
    paged_decode_attention_reference,
    validate_decode_args,
    validate_kernel_layout,
)

__all__ = ["paged_decode_attention", "plan_paged_decode"]

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2,
    stride_q_seq, stride_q_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_table_seq,
    stride_out_seq, stride_out_head,
    stride_part_seq, stride_part_head, stride_part_split,
    stride_lse_seq, stride_lse_head,
    max_context,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SPLIT_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Clamped to the table width so a bad length cannot read past the table's row.
    seq_len = tl.minimum(tl.load(seq_lens_ptr + seq), max_context)
    split_start = split * SPLIT_SIZE
    split_end = tl.minimum(split_start + SPLIT_SIZE, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    row_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
                mask=row_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq * stride_table_seq
    head_offset = kv_head.to(tl.int64) * stride_cache_head
    for start in range(split_start, split_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < split_end
        block_ids = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        slot_offset = (block_ids * stride_cache_block
                       + (pos % BLOCK_SIZE).to(tl.int64) * stride_cache_slot + head_offset)
        kv_ptrs = slot_offset[:, None] + d[None, :]
        kv_mask = pos_ok[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile has a valid position
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_tokens = l_i > 0  # false only in an empty split (past the end, or seq_len 0)
    out = acc / tl.where(has_tokens, l_i, 1.0)[:, None]
    if SINGLE_SPLIT:
        tl.store(out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        # The merge reads only splits that hold tokens, so empty splits store nothing.
        store_rows = (g < GROUP) & has_tokens
        tl.store(part_out_ptr + seq * stride_part_seq + heads[:, None] * stride_part_head
                 + split * stride_part_split + d[None, :], out,
                 mask=store_rows[:, None] & (d < HEAD_DIM)[None, :])
        lse = m_i + tl.log2(tl.where(has_tokens, l_i, 1.0))
        tl.store(part_lse_ptr + seq * stride_lse_seq + heads * stride_lse_head + split, lse,
                 mask=store_rows)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, seq_lens_ptr, out_ptr,
    stride_part_seq, stride_part_head, stride_part_split,
    stride_lse_seq, stride_lse_head,
    stride_out_seq, stride_out_head,
    max_context,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT_SIZE: tl.constexpr, MERGE_TILE: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    seq_len = tl.minimum(tl.load(seq_lens_ptr + seq), max_context)
    num_live = tl.cdiv(seq_len, SPLIT_SIZE)

    d = tl.arange(0, BLOCK_D)
    lse_row = part_lse_ptr + seq * stride_lse_seq + head * stride_lse_head
    part_row = part_out_ptr + seq * stride_part_seq + head * stride_part_head
    # Online merge over MERGE_TILE splits at a time: the tile, not the context length,
    # sets the kernel's registers, so one compiled kernel serves every context.
    lse_max = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, num_live, MERGE_TILE):
        s = start + tl.arange(0, MERGE_TILE)
        live = s < num_live
        lse = tl.load(lse_row + s, mask=live, other=float("-inf"))
        new_max = tl.maximum(lse_max, tl.max(lse, 0))  # finite: split `start` is live
        alpha = tl.exp2(lse_max - new_max)
        weight = tl.exp2(lse - new_max)  # 0 for masked splits
        parts = tl.load(part_row + s[:, None] * stride_part_split + d[None, :],
                        mask=live[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
        acc = acc * alpha + tl.sum(parts * weight[:, None], 0)
        total = total * alpha + tl.sum(weight, 0)
        lse_max = new_max
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + d,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def plan_paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                      split_size: int, *, for_cuda: bool) -> tuple[torch.Tensor, list[KernelLaunch]]:
    """Checks the arguments, allocates the output (and the splits' partials) and decides the
    launches: the split kernel, then the merge kernel when the table holds several splits.

    ``for_cuda`` picks the CUDA tiles (16-bit tl.dot operands, tiles sized for registers)
    rather than the interpreter's (fp32, wide tiles, few loop steps); the wrapper passes
    ``q.is_cuda`` and the CUDA compile check passes True for CPU stand-in tensors."""
    group = validate_decode_args(q, k_cache, v_cache, block_tables, seq_lens, scale, split_size)
    validate_kernel_layout(q, k_cache, v_cache, block_tables, ("seq_lens", seq_lens))
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    max_context = block_tables.shape[1] * block_size
    if batch == 0:
        return out, []
    if max_context == 0:
        return out.zero_(), []

    # The interpreter has no bf16 arithmetic and pays per loop step: compute in fp32 with
    # wide tiles there. On GPU keep 16-bit operands for tl.dot (fp32 accumulation) and
    # force IEEE fp32 for fp32 inputs (tl.dot would otherwise use tf32).
    upcast = not for_cuda
    dot_precision = "ieee" if (upcast or q.dtype == torch.float32) else "tf32"
    # On GPU a 64-token K/V tile and 4 warps for 16-bit types. fp32's tl.dot runs on FMA
    # units with its operands in registers and spilled with those (sm_80 to sm_100, see
    # tests/test_kernels_cuda_compile.py): a 32-token tile over 8 warps there.
    if not for_cuda:
        widest, num_warps = 256, 4
    elif q.dtype == torch.float32:
        widest, num_warps = 32, 8
    else:
        widest, num_warps = 64, 4
    block_n = max(16, min(triton.next_power_of_2(split_size), widest))
    group_pad = max(16, triton.next_power_of_2(group))  # tl.dot needs M >= 16 on GPU
    block_d = triton.next_power_of_2(head_dim)
    num_splits = triton.cdiv(max_context, split_size)
    single = num_splits == 1

    if single:
        part_out = part_lse = out  # unused by the kernel
        part_strides = (0, 0, 0)
        lse_strides = (0, 0)
    else:
        part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32,
                               device=q.device)
        part_strides = part_out.stride()[:3]
        lse_strides = part_lse.stride()[:2]

    split = KernelLaunch(
        _decode_split_kernel, (batch, num_kv_heads, num_splits),
        (q, k_cache, v_cache, block_tables, seq_lens,
         out, part_out, part_lse,
         scale * LOG2E,
         q.stride(0), q.stride(1),
         k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
         block_tables.stride(0),
         out.stride(0), out.stride(1),
         *part_strides, *lse_strides,
         max_context),
        dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_D=block_d,
             BLOCK_SIZE=block_size, SPLIT_SIZE=split_size, BLOCK_N=block_n,
             SINGLE_SPLIT=single, UPCAST=upcast, DOT_PRECISION=dot_precision),
        num_warps=num_warps, num_stages=3)
    if single:
        return out, [split]
    merge = KernelLaunch(
        _decode_merge_kernel, (batch, num_heads),
        (part_out, part_lse, seq_lens, out,
         *part_strides, *lse_strides,
         out.stride(0), out.stride(1),
         max_context),
        dict(HEAD_DIM=head_dim, BLOCK_D=block_d, SPLIT_SIZE=split_size,
             MERGE_TILE=16 if for_cuda else 64),
        num_warps=4, num_stages=3)
    return out, [split, merge]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                           use_triton: bool, split_size: int = DEFAULT_SPLIT_SIZE) -> torch.Tensor:
    """Attention of one query token per sequence (q: [B, num_heads, head_dim], already in the
    cache, so seq_lens counts it) over its paged context; returns [B, num_heads, head_dim] in
    q's dtype, zeros where seq_lens is 0.

    ``split_size`` is the fixed number of context tokens per split-KV partition. The Triton
    path does no value checks (no device sync): seq_lens must fit the block table width and
    the used block ids must exist."""
    if not use_triton:
        return paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens,
                                                scale, split_size)
    out, launches = plan_paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                      split_size, for_cuda=q.is_cuda)
    for launch in launches:
        launch.run()
    return out
