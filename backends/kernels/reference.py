"""Plain-PyTorch references for the paged-attention kernels, and the argument checks they share.

Every reference walks the block table explicitly: for each sequence it gathers the blocks
its table names (``k_cache[block_ids]``), keeps the first ``seq_len`` token slots and
attends over them in fp32, so a bug in the Triton kernels' address arithmetic cannot hide
behind the same bug here. They loop over sequences in Python and read lengths back to the
host, so they cost one device sync per call and are meant for tests, CPU runs and as a
benchmark baseline, not for speed.

Layout (one layer): ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``;
token slot ``s`` lives at block ``s // block_size``, offset ``s % block_size``. GQA: query
head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``.

This module imports only torch, so CPU paths work without triton installed. The
``validate_*`` functions check shapes and dtypes (no device sync) and are called by both the
references and the Triton launch wrappers; the references additionally check values
(lengths, block ids), which needs a sync.
"""
from __future__ import annotations

import torch

__all__ = [
    "write_kv_reference",
    "paged_decode_attention_reference",
    "paged_prefill_attention_reference",
    "validate_write_kv_args",
    "validate_decode_args",
    "validate_prefill_args",
    "validate_kernel_layout",
]

ATTENTION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEFAULT_SPLIT_SIZE = 512  # context tokens per split-KV partition of paged decode


# --------------------------------------------------------------------------- checks


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    _require(k_cache.dim() == 4,
             f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got shape "
             f"{tuple(k_cache.shape)}")
    _require(v_cache.shape == k_cache.shape,
             f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    _require(v_cache.dtype == k_cache.dtype,
             f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    _require(v_cache.device == k_cache.device,
             f"v_cache device {v_cache.device} != k_cache device {k_cache.device}")


def _check_int_vector(name: str, t: torch.Tensor, dtype: torch.dtype, length: int | None,
                      device: torch.device) -> None:
    _require(t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}")
    _require(t.dim() == 1, f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if length is not None:
        _require(t.shape[0] == length, f"{name} has {t.shape[0]} entries, expected {length}")
    _require(t.device == device, f"{name} is on {t.device}, expected {device}")


def _check_query(q: torch.Tensor, k_cache: torch.Tensor, scale: float, shape_doc: str) -> int:
    """Checks q against the cache; returns the GQA group size (query heads per kv head)."""
    _require(q.dim() == 3, f"q must be {shape_doc}, got shape {tuple(q.shape)}")
    _require(q.dtype in ATTENTION_DTYPES, f"q dtype {q.dtype} not in {ATTENTION_DTYPES}")
    _require(k_cache.dtype == q.dtype, f"cache dtype {k_cache.dtype} != q dtype {q.dtype}")
    _require(q.device == k_cache.device, f"q is on {q.device}, cache on {k_cache.device}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, cache_head_dim = k_cache.shape[2], k_cache.shape[3]
    _require(head_dim == cache_head_dim,
             f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    _require(num_kv_heads > 0 and num_heads % num_kv_heads == 0,
             f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    _require(isinstance(scale, (int, float)) and scale > 0,
             f"scale must be a positive float, got {scale!r}")
    return num_heads // num_kv_heads


def _check_block_tables(block_tables: torch.Tensor, num_seqs: int, device: torch.device) -> None:
    _require(block_tables.dtype == torch.int32,
             f"block_tables must be torch.int32, got {block_tables.dtype}")
    _require(block_tables.dim() == 2 and block_tables.shape[0] == num_seqs,
             f"block_tables must be [{num_seqs}, max_blocks], got shape "
             f"{tuple(block_tables.shape)}")
    _require(block_tables.device == device,
             f"block_tables is on {block_tables.device}, expected {device}")


def validate_write_kv_args(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Shape/dtype/device checks for a KV write; raises ValueError naming the bad argument."""
    _check_cache_pair(k_cache, v_cache)
    _require(k.dim() == 3, f"k must be [T, num_kv_heads, head_dim], got shape {tuple(k.shape)}")
    _require(v.shape == k.shape, f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    _require(k.shape[1:] == k_cache.shape[2:],
             f"k rows are {tuple(k.shape[1:])} (heads, head_dim) but the cache holds "
             f"{tuple(k_cache.shape[2:])}")
    _require(k.dtype == k_cache.dtype and v.dtype == k_cache.dtype,
             f"k/v dtypes {k.dtype}/{v.dtype} != cache dtype {k_cache.dtype}")
    _require(k.device == k_cache.device and v.device == k_cache.device,
             f"k/v on {k.device}/{v.device}, cache on {k_cache.device}")
    _check_int_vector("slot_mapping", slot_mapping, torch.int64, k.shape[0], k_cache.device)


def validate_decode_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         split_size: int) -> int:
    """Shape/dtype/device checks for paged decode; returns the GQA group size."""
    _check_cache_pair(k_cache, v_cache)
    group = _check_query(q, k_cache, scale, "[batch, num_heads, head_dim]")
    _check_block_tables(block_tables, q.shape[0], q.device)
    _check_int_vector("seq_lens", seq_lens, torch.int32, q.shape[0], q.device)
    _require(isinstance(split_size, int) and split_size > 0,
             f"split_size must be a positive int, got {split_size!r}")
    return group


def validate_prefill_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                          seq_lens: torch.Tensor, scale: float) -> int:
    """Shape/dtype/device checks for paged (chunked) prefill; returns the GQA group size."""
    _check_cache_pair(k_cache, v_cache)
    group = _check_query(q, k_cache, scale, "[num_tokens, num_heads, head_dim]")
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    _check_int_vector("seq_lens", seq_lens, torch.int32, None, q.device)
    _check_int_vector("query_start_loc", query_start_loc, torch.int32, num_seqs + 1, q.device)
    _check_block_tables(block_tables, num_seqs, q.device)
    return group


def validate_kernel_layout(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor,
                           *vectors: tuple[str, torch.Tensor]) -> None:
    """Memory-layout requirements of the Triton attention kernels (beyond shapes/dtypes):
    contiguous caches (the kernels address a token slot as block * stride0 + offset * stride1),
    unit stride along head_dim for q, unit-stride 1-D metadata vectors, and a block table whose
    rows may be strided but whose columns are unit-stride."""
    _require(k_cache.is_contiguous() and v_cache.is_contiguous(),
             "k_cache and v_cache must be contiguous [num_blocks, block_size, num_kv_heads, "
             "head_dim] tensors")
    _require(q.stride(2) == 1, f"q must have unit stride along head_dim, got strides {q.stride()}")
    _require(block_tables.stride(1) == 1,
             f"block_tables must have unit column stride, got strides {block_tables.stride()}")
    for name, t in vectors:
        _require(t.stride(0) == 1, f"{name} must be contiguous, got stride {t.stride(0)}")


def _check_lengths_fit(seq_lens: list[int], block_tables: torch.Tensor, num_blocks: int,
                       block_size: int) -> None:
    """Value checks (host side): each length fits its table, each used block id exists."""
    capacity = block_tables.shape[1] * block_size
    for i, n in enumerate(seq_lens):
        _require(0 <= n <= capacity,
                 f"seq_lens[{i}] = {n} outside [0, {capacity}] (max_blocks x block_size)")
        used = block_tables[i, : -(-n // block_size)]
        _require(bool(((used >= 0) & (used < num_blocks)).all()),
                 f"block_tables[{i}] names a block outside [0, {num_blocks}) among its "
                 f"first {used.numel()} entries")


# --------------------------------------------------------------------------- references


def _gather_sequence(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len token rows of one sequence, [seq_len, num_kv_heads, head_dim] fp32."""
    block_size = cache.shape[1]
    block_ids = block_table[: -(-seq_len // block_size)].long()
    rows = cache[block_ids].reshape(-1, cache.shape[2], cache.shape[3])
    return rows[:seq_len].float()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            q_positions: torch.Tensor) -> torch.Tensor:
    """Causal attention of q [M, H, D] over k, v [N, Hkv, D] (all fp32); query m sees keys
    at positions 0..q_positions[m]. Returns [M, H, D] fp32."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q, k) * scale
    key_positions = torch.arange(k.shape[0], device=q.device)
    visible = key_positions[None, :] <= q_positions[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hmn,nhd->mhd", torch.softmax(scores, dim=-1), v)


def write_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes k[i], v[i] into token slot slot_mapping[i] of the caches; slots < 0 are skipped.

    Duplicate slots are undefined behaviour (as in the kernel)."""
    validate_write_kv_args(k, v, k_cache, v_cache, slot_mapping)
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    _require(bool((slots < num_blocks * block_size).all()),
             f"slot_mapping has a slot >= {num_blocks * block_size} (num_blocks x block_size)")
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[keep]
    v_cache[blocks, offsets] = v[keep]


def paged_decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor,
                                     v_cache: torch.Tensor, block_tables: torch.Tensor,
                                     seq_lens: torch.Tensor, scale: float,
                                     split_size: int = DEFAULT_SPLIT_SIZE) -> torch.Tensor:
    """One query token per sequence over its whole cached context; [B, H, D] in q's dtype.

    ``split_size`` is checked and otherwise unused: it only changes how the Triton kernel
    partitions the softmax, not the result. A sequence with seq_len 0 gets zeros."""
    validate_decode_args(q, k_cache, v_cache, block_tables, seq_lens, scale, split_size)
    lengths = seq_lens.tolist()
    _check_lengths_fit(lengths, block_tables, k_cache.shape[0], k_cache.shape[1])
    out = torch.zeros_like(q)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        k = _gather_sequence(k_cache, block_tables[b], n)
        v = _gather_sequence(v_cache, block_tables[b], n)
        last = torch.tensor([n - 1], device=q.device)
        out[b] = _attend(q[b : b + 1].float(), k, v, scale, last)[0].to(q.dtype)
    return out


def paged_prefill_attention_reference(q: torch.Tensor, k_cache: torch.Tensor,
                                      v_cache: torch.Tensor, block_tables: torch.Tensor,
                                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                                      scale: float) -> torch.Tensor:
    """Chunked prefill over paged KV; [T, H, D] in q's dtype.

    Sequence s owns queries query_start_loc[s]:query_start_loc[s+1]; its query i sits at
    absolute position seq_lens[s] - q_len + i and attends to cache positions 0..that one."""
    validate_prefill_args(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    _require(starts[0] == 0 and starts[-1] == q.shape[0],
             f"query_start_loc must run from 0 to num_tokens={q.shape[0]}, got "
             f"{starts[0]}..{starts[-1]}")
    _check_lengths_fit(lengths, block_tables, k_cache.shape[0], k_cache.shape[1])
    out = torch.empty_like(q)
    for s, n in enumerate(lengths):
        lo, hi = starts[s], starts[s + 1]
        _require(0 <= hi - lo <= n,
                 f"sequence {s}: q_len {hi - lo} must be in [0, seq_lens[{s}]={n}]")
        if hi == lo:
            continue
        k = _gather_sequence(k_cache, block_tables[s], n)
        v = _gather_sequence(v_cache, block_tables[s], n)
        positions = torch.arange(n - (hi - lo), n, device=q.device)
        out[lo:hi] = _attend(q[lo:hi].float(), k, v, scale, positions).to(q.dtype)
    return out

