"""KV write: scatter this step's key/value rows into their paged-cache token slots.

Each token's K (or V) row is ``num_kv_heads * head_dim`` contiguous elements, and so is a
token slot of a contiguous cache, so the kernel copies a [BLOCK_T tokens, BLOCK_R elements]
tile per program: slot ``s`` starts at ``s * cache.stride(1)`` (block ``s // block_size``
times ``stride(0) = block_size * stride(1)`` plus offset ``s % block_size``). Negative slots
(padding tokens) are masked out, so they cost a load of the slot id and nothing else.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import KernelLaunch
from .reference import validate_write_kv_args, write_kv_reference

__all__ = ["write_kv", "plan_write_kv"]

_ELEMENTS_PER_PROGRAM = 4096  # tokens x row elements copied by one program


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    num_tokens, row_size,
    stride_k_token, stride_v_token, stride_cache_slot,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    token_ok = tokens < num_tokens
    slots = tl.load(slot_mapping_ptr + tokens, mask=token_ok, other=-1)  # int64
    mask = (token_ok & (slots >= 0))[:, None] & (cols < row_size)[None, :]

    src_row = tokens.to(tl.int64)[:, None]
    dst = slots[:, None] * stride_cache_slot + cols[None, :]
    k = tl.load(k_ptr + src_row * stride_k_token + cols[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + src_row * stride_v_token + cols[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def plan_write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> list[KernelLaunch]:
    """Checks the arguments and decides the one launch (none for zero tokens). A copy has
    no interpreter-specific tiles, so the plan is the same for CUDA and the interpreter."""
    validate_write_kv_args(k, v, k_cache, v_cache, slot_mapping)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous for the Triton KV write")
    head_dim = k.shape[2]
    for name, t in (("k", k), ("v", v)):
        # A row may be a view into a fused qkv projection (any token stride), but its heads
        # and head_dim must be packed so one token is row_size contiguous elements.
        if t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError(f"{name} must be packed within a token (strides [*, {head_dim}, 1]), "
                             f"got strides {t.stride()}")
    if slot_mapping.stride(0) != 1:
        raise ValueError("slot_mapping must be contiguous")
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return []
    row_size = k.shape[1] * head_dim
    block_r = min(triton.next_power_of_2(row_size), _ELEMENTS_PER_PROGRAM)
    block_t = max(1, _ELEMENTS_PER_PROGRAM // block_r)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(row_size, block_r))
    return [KernelLaunch(
        _write_kv_kernel, grid,
        (k, v, k_cache, v_cache, slot_mapping,
         num_tokens, row_size,
         k.stride(0), v.stride(0), k_cache.stride(1)),
        dict(BLOCK_T=block_t, BLOCK_R=block_r),
        num_warps=4, num_stages=3)]


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, use_triton: bool) -> None:
    """Writes k[i], v[i] ([T, num_kv_heads, head_dim]) into token slot slot_mapping[i]
    (int64, ``block_id * block_size + offset``) of the caches, in place; slots < 0 are
    skipped. The Triton path does no value checks (no device sync): slots must be in range
    and distinct."""
    if not use_triton:
        write_kv_reference(k, v, k_cache, v_cache, slot_mapping)
        return
    for launch in plan_write_kv(k, v, k_cache, v_cache, slot_mapping):
        launch.run()
