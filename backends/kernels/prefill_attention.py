"""Paged (chunked) prefill attention: a chunk of new query tokens per sequence over its
paged KV cache, which already holds the cached prefix and the chunk itself.

Program (query tile, kv head) takes ``BLOCK_M`` query rows, where a row is a
(token, query head of the kv head's GQA group) pair: ``BLOCK_M // group`` tokens times the
whole group, so each K/V tile is loaded once for all heads that share it and a group of 3
pads only the rows left over. It walks the sequence's context ``BLOCK_N`` token positions
at a time through the block table (any block size: the block id is looked up per position),
from position 0 to its last query's position, with an fp32 online softmax; the causal mask
compares absolute positions (query i of a chunk of q_len sits at ``seq_len - q_len + i``).

Query tiles never straddle sequences. Without a host sync the number of tiles is unknown,
so the grid is an upper bound, ``cdiv(T, tokens_per_tile) + num_seqs``, and a small device
side table (two torch ops) maps each program to (sequence, first token); programs past the
last tile find no rows and loop zero times.

Cost: each tile reads its context's K/V once per kv head, so the chunk reads
``ceil(q_len / tokens_per_tile)`` times the context; compute is two tl.dot per step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_attention import LOG2E
from .launch import KernelLaunch
from .reference import (
    paged_prefill_attention_reference,
    validate_kernel_layout,
    validate_prefill_args,
)

__all__ = ["paged_prefill_attention", "plan_paged_prefill"]


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, tile_seq_ptr, tile_first_ptr,
    scale_log2, max_context,
    stride_q_token, stride_q_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_table_seq,
    stride_out_token, stride_out_head,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, TOKENS_PER_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile).to(tl.int64)
    first = tl.load(tile_first_ptr + tile)  # index of the tile's first query in its chunk
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    seq_len = tl.minimum(tl.load(seq_lens_ptr + seq), max_context)
    chunk_start = seq_len - q_len  # absolute position of the chunk's first query

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    q_index = first + r // GROUP
    heads = kv_head * GROUP + r % GROUP
    row_ok = (r < TOKENS_PER_TILE * GROUP) & (q_index < q_len)
    q_pos = chunk_start + q_index
    d_ok = d < HEAD_DIM
    q_rows = (q_begin + q_index).to(tl.int64) * stride_q_token + heads * stride_q_head
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # The tile's last query sees positions [0, its position]; an empty tile sees none.
    num_queries = tl.minimum(tl.maximum(q_len - first, 0), TOKENS_PER_TILE)
    kv_end = tl.where(num_queries > 0, chunk_start + first + num_queries, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq * stride_table_seq
    head_offset = kv_head.to(tl.int64) * stride_cache_head
    for start in range(0, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_end
        block_ids = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        slot_offset = (block_ids * stride_cache_block
                       + (pos % BLOCK_SIZE).to(tl.int64) * stride_cache_slot + head_offset)
        kv_ptrs = slot_offset[:, None] + d[None, :]
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :] & row_ok[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with nothing visible yet (padding rows) keep m = -inf; exponentiate against 0
        # there so they stay all-zero instead of producing NaN from -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_rows = (q_begin + q_index).to(tl.int64) * stride_out_token + heads * stride_out_head
    tl.store(out_ptr + out_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def _tile_table(query_start_loc: torch.Tensor, tokens_per_tile: int,
                num_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Maps program ids to (sequence, first query index in its chunk) on device, no sync.

    Tiles past the last real one map to the last sequence with a first index beyond its
    chunk, so they have no rows."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    tiles_end = torch.cumsum(torch.div(q_lens + tokens_per_tile - 1, tokens_per_tile,
                                       rounding_mode="floor"), 0)
    tile_ids = torch.arange(num_tiles, device=query_start_loc.device, dtype=tiles_end.dtype)
    tile_seq = torch.searchsorted(tiles_end, tile_ids, right=True)
    tile_seq = tile_seq.clamp_(max=q_lens.shape[0] - 1)
    tiles_before = tiles_end[tile_seq] - torch.div(q_lens[tile_seq] + tokens_per_tile - 1,
                                                   tokens_per_tile, rounding_mode="floor")
    tile_first = (tile_ids - tiles_before) * tokens_per_tile
    return tile_seq.to(torch.int32), tile_first.to(torch.int32)


def _cuda_tiles(dtype: torch.dtype, group: int, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) on GPU: the largest tiles with which every
    configuration compiles for sm_80 to sm_100 without spilling and within sm_89's 99 KiB
    of shared memory (tests/test_kernels_cuda_compile.py, docs/kernels.md). A 64-token K/V
    tile spilled on sm_80/sm_89 at head_dim 128. fp32 runs tl.dot on FMA units with its
    operands in registers: a 16-token K/V tile, two pipeline stages, and 8 warps at
    head_dim 128 (4 at 64, where ptxas spilled 8 warps at 80 registers)."""
    if dtype == torch.float32:
        return 64, 16, (8 if head_dim > 64 else 4), 2
    if group >= 4:
        return 128, 32, 8, 3  # 128 rows keep 18 tokens x 7 heads (Qwen2.5) in one tile
    return 64, 32, 4, 3


def plan_paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                       seq_lens: torch.Tensor, scale: float,
                       *, for_cuda: bool) -> tuple[torch.Tensor, list[KernelLaunch]]:
    """Checks the arguments, allocates the output and the tile table, and decides the one
    launch (none for an empty batch). ``for_cuda`` as in ``plan_paged_decode``."""
    group = validate_prefill_args(q, k_cache, v_cache, block_tables, query_start_loc,
                                  seq_lens, scale)
    validate_kernel_layout(q, k_cache, v_cache, block_tables, ("seq_lens", seq_lens),
                           ("query_start_loc", query_start_loc))
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out, []

    # See decode_attention: fp32 compute and wide tiles under the interpreter.
    upcast = not for_cuda
    dot_precision = "ieee" if (upcast or q.dtype == torch.float32) else "tf32"
    block_m, block_n, num_warps, num_stages = (_cuda_tiles(q.dtype, group, head_dim)
                                               if for_cuda else (128, 128, 4, 1))
    if group > block_m:
        raise ValueError(f"GQA group {group} larger than the query tile ({block_m} rows)")
    tokens_per_tile = block_m // group
    num_tiles = triton.cdiv(num_tokens, tokens_per_tile) + num_seqs
    tile_seq, tile_first = _tile_table(query_start_loc, tokens_per_tile, num_tiles)

    launch = KernelLaunch(
        _prefill_kernel, (num_tiles, num_kv_heads),
        (q, k_cache, v_cache, out,
         block_tables, query_start_loc, seq_lens, tile_seq, tile_first,
         scale * LOG2E, block_tables.shape[1] * block_size,
         q.stride(0), q.stride(1),
         k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
         block_tables.stride(0),
         out.stride(0), out.stride(1)),
        dict(GROUP=group, BLOCK_M=block_m, TOKENS_PER_TILE=tokens_per_tile,
             HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
             BLOCK_SIZE=block_size, BLOCK_N=block_n,
             UPCAST=upcast, DOT_PRECISION=dot_precision),
        num_warps=num_warps, num_stages=num_stages)
    return out, [launch]


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, *,
                            use_triton: bool) -> torch.Tensor:
    """Causal attention of each sequence's chunk of queries (q: [T, num_heads, head_dim],
    sequence s owning rows query_start_loc[s]:query_start_loc[s+1]) over its paged cache of
    seq_lens[s] tokens (prefix + chunk, already written); returns [T, num_heads, head_dim]
    in q's dtype. The Triton path does no value checks (no device sync)."""
    if not use_triton:
        return paged_prefill_attention_reference(q, k_cache, v_cache, block_tables,
                                                 query_start_loc, seq_lens, scale)
    out, launches = plan_paged_prefill(q, k_cache, v_cache, block_tables, query_start_loc,
                                       seq_lens, scale, for_cuda=q.is_cuda)
    for launch in launches:
        launch.run()
    return out
