"""Attention metadata for a flattened, unpadded batch, and the per-layer call into the kernels.

A step's batch is one flat run of tokens: the prefill chunks of S_p sequences first, then
one decode token for each of S_d sequences. `AttentionMetadata` says where each token's K/V
goes (`slot_mapping`) and what each query attends to (per-sequence lengths and block
tables), so every layer can write its K/V into the paged cache and then attend over it
without any padding.

Building the metadata costs O(total tokens + total block-table entries) of host work and
one host-to-device copy per tensor; it is built once per step and shared by all layers.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from servelab.backends import kernels

__all__ = ["SeqWork", "AttentionMetadata", "build_attention_metadata", "paged_attention"]


@dataclass(slots=True, frozen=True)
class SeqWork:
    """One sequence's share of a step, in the executor's terms.

    `token_ids` are the tokens computed this step (a prefill chunk, or the one token of a
    decode); their positions are `context_len, context_len + 1, ...`. `block_table` lists
    the sequence's KV blocks in order and must cover `context_len + len(token_ids)` slots.
    """

    token_ids: list[int]
    context_len: int
    block_table: list[int]
    is_prefill: bool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Tokens in the cache once this step's K/V is written."""
        return self.context_len + len(self.token_ids)


@dataclass(slots=True)
class AttentionMetadata:
    """Where a step's K/V lands and what each query sees; tensors live on the model's device.

    Token order is prefill tokens (`num_prefill_tokens` of them, sequence after sequence)
    then decode tokens (one per decode sequence).
    """

    slot_mapping: torch.Tensor
    """[T] int64: cache slot (block * block_size + offset) of each token's K/V."""
    num_prefill_tokens: int
    prefill_query_start_loc: torch.Tensor
    """[S_p + 1] int32: prefill sequence s owns tokens start[s]:start[s+1]."""
    prefill_seq_lens: torch.Tensor
    """[S_p] int32: tokens in the cache after this chunk is written (context + chunk)."""
    prefill_block_tables: torch.Tensor
    """[S_p, max_blocks] int32, padded with block 0 past each table's end (never read)."""
    decode_seq_lens: torch.Tensor
    """[S_d] int32: context + the new token."""
    decode_block_tables: torch.Tensor
    """[S_d, max_blocks] int32."""
    use_triton: bool

    @property
    def num_prefill_seqs(self) -> int:
        return self.prefill_seq_lens.shape[0]

    @property
    def num_decode_tokens(self) -> int:
        return self.decode_seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


def _check_seq(i: int, seq: SeqWork, block_size: int, num_blocks: int | None) -> None:
    if not isinstance(seq, SeqWork):
        raise TypeError(f"seqs[{i}] must be a SeqWork, got {type(seq).__name__}")
    if seq.num_tokens == 0:
        raise ValueError(f"seqs[{i}] computes no tokens (token_ids is empty)")
    if seq.context_len < 0:
        raise ValueError(f"seqs[{i}].context_len must be >= 0, got {seq.context_len}")
    if not seq.is_prefill and seq.num_tokens != 1:
        raise ValueError(f"seqs[{i}] is a decode but computes {seq.num_tokens} tokens; "
                         "a decode computes exactly one")
    needed = -(-seq.seq_len // block_size)
    if len(seq.block_table) < needed:
        raise ValueError(f"seqs[{i}] needs {needed} blocks of {block_size} slots for "
                         f"{seq.seq_len} tokens but its block_table has {len(seq.block_table)}")
    limit = num_blocks if num_blocks is not None else float("inf")
    if any(not 0 <= b < limit for b in seq.block_table[:needed]):
        raise ValueError(f"seqs[{i}].block_table has a block id outside [0, {limit}) among its "
                         f"first {needed} entries: {seq.block_table[:needed]}")


def _block_table_tensor(seqs: list[SeqWork], block_size: int) -> torch.Tensor:
    """[S, max_blocks] int32 (host), each row the blocks its sequence uses, zero-padded."""
    used = [-(-s.seq_len // block_size) for s in seqs]
    table = torch.zeros((len(seqs), max(used, default=0)), dtype=torch.int32)
    for row, (seq, n) in enumerate(zip(seqs, used)):
        table[row, :n] = torch.tensor(seq.block_table[:n], dtype=torch.int32)
    return table


def build_attention_metadata(seqs: list[SeqWork], block_size: int, device: torch.device | str,
                             use_triton: bool, num_blocks: int | None = None) -> AttentionMetadata:
    """Metadata for `seqs`, which must list every prefill before every decode.

    Raises ValueError when the order is wrong, a decode computes more than one token, or a
    block table does not cover its sequence or (given `num_blocks`, the cache's size) names
    a block the cache does not have — the Triton kernels do no such check on the device.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    for i, seq in enumerate(seqs):
        _check_seq(i, seq, block_size, num_blocks)
    num_prefill_seqs = sum(s.is_prefill for s in seqs)
    if any(not s.is_prefill for s in seqs[:num_prefill_seqs]):
        raise ValueError("seqs must list all prefill sequences before all decode sequences")
    prefill, decode = seqs[:num_prefill_seqs], seqs[num_prefill_seqs:]

    table = _block_table_tensor(seqs, block_size)
    lengths = torch.tensor([s.num_tokens for s in seqs], dtype=torch.int64)
    owner = torch.repeat_interleave(torch.arange(len(seqs)), lengths)
    first = torch.tensor([s.context_len for s in seqs], dtype=torch.int64)
    starts = torch.cumsum(lengths, 0) - lengths
    positions = first[owner] + torch.arange(int(lengths.sum())) - starts[owner]
    blocks = table[owner, positions // block_size].long()
    slot_mapping = blocks * block_size + positions % block_size

    query_start_loc = torch.zeros(num_prefill_seqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(lengths[:num_prefill_seqs], 0)
    seq_lens = torch.tensor([s.seq_len for s in seqs], dtype=torch.int32)
    prefill_width = max((-(-s.seq_len // block_size) for s in prefill), default=0)
    decode_width = max((-(-s.seq_len // block_size) for s in decode), default=0)

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    return AttentionMetadata(
        slot_mapping=put(slot_mapping),
        num_prefill_tokens=int(query_start_loc[-1]),
        prefill_query_start_loc=put(query_start_loc),
        prefill_seq_lens=put(seq_lens[:num_prefill_seqs]),
        prefill_block_tables=put(table[:num_prefill_seqs, :prefill_width].contiguous()),
        decode_seq_lens=put(seq_lens[num_prefill_seqs:]),
        decode_block_tables=put(table[num_prefill_seqs:, :decode_width].contiguous()),
        use_triton=use_triton,
    )


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One layer's attention: writes this step's k, v [T, Hkv, D] into the layer's cache, then
    attends q [T, H, D] over the cache (chunked prefill for the prefill tokens, single-query
    decode for the rest). Returns [T, H, D] in q's dtype.

    `meta.use_triton=False` calls the PyTorch references directly, so the reference path
    never imports triton."""
    if meta.use_triton:
        write = functools.partial(kernels.write_kv, use_triton=True)
        prefill = functools.partial(kernels.paged_prefill_attention, use_triton=True)
        decode = functools.partial(kernels.paged_decode_attention, use_triton=True)
    else:
        write = kernels.write_kv_reference
        prefill = kernels.paged_prefill_attention_reference
        decode = kernels.paged_decode_attention_reference
    write(k, v, k_cache, v_cache, meta.slot_mapping)
    num_prefill = meta.num_prefill_tokens
    prefill_args = (k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
                    meta.prefill_seq_lens, scale)
    decode_args = (k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale)
    if num_prefill == q.shape[0]:
        return prefill(q, *prefill_args)
    if num_prefill == 0:
        return decode(q, *decode_args)
    out = torch.empty_like(q)
    out[:num_prefill] = prefill(q[:num_prefill], *prefill_args)
    out[num_prefill:] = decode(q[num_prefill:], *decode_args)
    return out
