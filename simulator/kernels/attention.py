"""Attention kernel times: prefill chunks and decode tokens over a paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from servelab.simulator.gpus import GPUSpec
from servelab.simulator.kernels.base import _Params, l2_hit

# ---------------------------------------------------------------------------- attention
#
# A serving step writes the step's new K and V into the paged cache: both attention models
# price that write (as its own kernel or inside the attention call, as the engine runs it).


def _l2_factor(nbytes, gpu: GPUSpec, gain: float, warm_l2: bool):
    """Bandwidth multiplier for a working set of `nbytes`: `gain` when it fits in L2 and
    the caller prices an isolated, repeated kernel (a benchmark replays one layer, so its
    operands stay in L2); 1 in a forward pass, which reads each layer's data once."""
    if not warm_l2 or gain == 1.0 or not gpu.l2_mb:
        return 1.0
    return np.where(np.asarray(nbytes) <= gpu.l2_bytes, gain, 1.0)


@dataclass(frozen=True, slots=True)
class PrefillAttentionParams(_Params):
    """Causal attention of prefill chunks over a paged cache (flash-attention style): the
    time is the sum of a floor, the tensor-core work, the longest thread block's critical
    path and the memory traffic (measured kernels overlap them little)."""

    floor_s: float = 0.0
    """Seconds no prefill launch beats (the cache write and the attention kernel)."""
    compute_eff: float = 1.0
    """Fraction of the BF16 tensor-core peak on QKᵀ and PV at long sequences."""
    memory_eff: float = 1.0
    """Fraction of HBM bandwidth on Q, O, the K/V read and the cache write."""
    padded_tile_pairs: float = 0.0
    """(query, key) pairs of work wasted per sequence and thread-block head on partly
    filled query tiles: why many short sequences cost more than one long one. A padded
    pair costs what a real one does, its softmax (`pair_head_s`) included: the kernel
    runs the whole tile through QKᵀ, the exponentials and PV (with it the vLLM 0.24
    B200 fit reads 12.1% held-out at 513-4,096 tokens, against 15.1% when padding paid
    the tensor-core part alone, which over-priced short sequences at head_dim 256)."""
    critical_path: float = 0.0
    """Weight of the longest thread block's work (one 128-row query tile over its keys,
    at one SM's share of the peak): a long sequence's last tile cannot be split."""
    packs_gqa: float = 0.0
    """1 where the kernel packs the query heads sharing a KV head into one thread block
    (FlashAttention 3 on Hopper), 0 where each query head is its own (FlashAttention 2):
    what the padding waste is counted per."""
    l2_gain: float = 1.0
    """Bandwidth multiplier on the share of the working set that stays in L2 between
    replays of one kernel (isolated benchmarks only; a forward pass reads from HBM)."""
    pair_head_s: float = 0.0
    """Seconds per causal (query, key) pair and query head that do not scale with the head
    dimension: the softmax's exponential and rescaling, on the SMs' special-function units.
    Where tensor cores outpace them (Blackwell: FlashAttention 4 and TRT-LLM's kernels are
    built around it) a head of 64 costs well over half a head of 128. 0: the time is all
    tensor-core work, linear in the head dimension (the fits of vLLM 0.14's kernels)."""

    _fractions = ("compute_eff", "memory_eff")
    _added = ("pair_head_s",)

    def __post_init__(self) -> None:
        self._check()
        if self.packs_gqa not in (0.0, 1.0):
            raise ValueError(f"PrefillAttentionParams.packs_gqa must be 0 or 1, got {self.packs_gqa!r}")


TILE_ROWS = 128
"""Query rows per flash-attention thread block."""


def prefill_attention_coefficients(heads, kv_heads, head_dim, gpu: GPUSpec,
                                   p: PrefillAttentionParams, kv_bytes=2.0,
                                   act_bytes: float = 2.0, cache_write=True) -> tuple:
    """Seconds per unit of each statistic of a prefill batch, one layer: (floor, per
    causal pair, per sequence [padding], per key a tile attends to on average [critical
    path], per new token, per cached token [memory]). `prefill_attention_time` combines
    them; the cost model folds them into its hot path. `cache_write` False leaves out
    writing the new K and V into the cache (a benchmark that times the attention kernel
    alone: `validation.measurements.forward_writes_cache`); serving always pays it."""
    rate = gpu.peak_flops("bf16") * p.compute_eff
    bw = gpu.hbm_bandwidth_gbps * 1e9 * p.memory_eff
    block_heads = kv_heads if p.packs_gqa else heads
    kv_row = 2.0 * kv_heads * head_dim * kv_bytes             # one token's K and V in the cache
    per_token = (2.0 * heads * head_dim * act_bytes           # Q read, O written
                 + kv_row)                                    # its own K/V, read by attention
    write = 2.0 * kv_heads * head_dim * act_bytes + kv_row    # cache write: read, store
    per_token = per_token + write * cache_write               # a bool, or one per measured row
    return (p.floor_s,
            4.0 * head_dim * heads / rate + heads * p.pair_head_s,   # QKᵀ, PV; softmax
            block_heads * p.padded_tile_pairs * (4.0 * head_dim / rate + p.pair_head_s),
            p.critical_path * 4.0 * head_dim * TILE_ROWS / (rate / gpu.sm_count)
            + p.critical_path * TILE_ROWS * p.pair_head_s * gpu.sm_count,   # (+ 0.0: as before)
            per_token / bw,
            kv_row / bw)


def prefill_attention_time(seqs, tokens, q_ctx_sum, q_sq_sum, ctx_sum, heads, kv_heads,
                           head_dim, gpu: GPUSpec, p: PrefillAttentionParams, kv_bytes=2.0,
                           act_bytes: float = 2.0, warm_l2: bool = False, max_keys=0,
                           cache_write=True):
    """Seconds of one layer's prefill attention over `seqs` chunks of `tokens` new tokens
    in all; chunk i has q_i new tokens after c_i cached ones, and the sums are
    Σ q_i·c_i, Σ q_i², Σ c_i. `max_keys` is max (c_i + q_i), the keys the longest
    chunk's last tile attends to (the critical path); where unknown (0) the token-weighted
    mean (Σ q_i² + Σ q_i·c_i) / Σ q_i stands in, exact when the chunks are alike. Zero
    when there is nothing to prefill. `cache_write`: as `prefill_attention_coefficients`."""
    floor, per_pair, per_seq, per_key, per_token, per_ctx = prefill_attention_coefficients(
        heads, kv_heads, head_dim, gpu, p, kv_bytes, act_bytes, cache_write)
    tokens = np.asarray(tokens, dtype=np.float64)
    pairs = q_ctx_sum + 0.5 * (q_sq_sum + tokens)            # causal (query, key) pairs
    keys = np.maximum(max_keys, (q_sq_sum + q_ctx_sum) / np.maximum(tokens, 1.0))
    compute = pairs * per_pair + seqs * per_seq + keys * per_key
    memory = tokens * per_token + ctx_sum * per_ctx
    if warm_l2:     # the streamed set keeps a share of itself in L2, fading past its size
        bw_bytes = memory * gpu.hbm_bandwidth_gbps * 1e9 * p.memory_eff
        memory = memory / (1.0 + (p.l2_gain - 1.0) * l2_hit(bw_bytes, gpu, sharpness=2.0))
    return np.where(tokens > 0, floor + compute + memory, 0.0)


@dataclass(frozen=True, slots=True)
class DecodeAttentionParams(_Params):
    """One query token per sequence over its cached context (paged, split-KV).

    Time = floor + per-(sequence, KV head) overhead + the larger of the per-item work and
    the KV bytes over the streaming rate, where the rate is HBM-bound at large batch and
    parallelism-bound (too few work items to fill the GPU) at small batch."""

    floor_s: float = 0.0
    """Seconds no decode launch beats (the cache write and the attention kernel)."""
    split_floor_s: float = 0.0
    """Extra floor of the split-KV path's merge kernel, where it is a second launch
    (FlashAttention 2 with grouped-query attention); 0 where it is not. It is charged
    where FlashAttention 2 splits (`fa2_num_splits`)."""
    gqa_copy_s: float = 0.0
    """Extra floor of FlashAttention 2's grouped-query decode where it copies the query
    in and the output out. It folds each KV head's query group into the query length
    (`seqlenq_ngroups_swapped` in flash_api.cpp): a transpose, then a reshape that merges
    the batch with the group, which PyTorch can take as a view only when the batch is one
    sequence or there is one KV head, and otherwise materialises. Measured inside vLLM
    0.14 on A100 (and L40S; vLLM 0.19 on the RTX PRO 6000) at contexts of 1-127 tokens:
    12.3-12.8 µs for one sequence or one KV head, 18.3-19.5 µs from two sequences and two
    KV heads on, whatever the query heads; no such step under FlashAttention 3 (H100).
    0 where the kernel packs the groups itself."""
    seq_head_s: float = 0.0
    """Serial seconds per (sequence, KV head): page-table walk and kernel prologue."""
    work_item_s: float = 0.0
    """Seconds per (sequence, KV head) work item that streaming can hide."""
    q_head_s: float = 0.0
    """Seconds per (sequence, query head): loading Q, storing O, merging partial results."""
    memory_eff: float = 1.0
    """Fraction of HBM bandwidth streaming K/V at large batch and long context."""
    head_stream_gbps: float = 0.0
    """GB/s one KV head's split-KV work streams at small batch (parallelism-bound); 0: no
    such limit."""
    batch_saturation: float = 1.0
    """Sequences beyond which more sequences add streaming parallelism."""
    mha_block_gbps: float = 0.0
    """GB/s of one thread block on the multi-head path without split-KV (one block per
    sequence and head: FlashAttention 2 when query and KV heads are equal); 0: no such path."""
    l2_gain: float = 1.0
    """Multiplier on the HBM ceiling when the KV set fits in L2 and stays there between
    replays of one kernel (isolated benchmarks only; a forward pass reads from HBM). The
    per-item streaming limits (`head_stream_gbps`, `mha_block_gbps`) are latency-bound
    and stay as they are: a few thread blocks stream no faster from L2."""

    item_dim_share: float = 0.0
    """Share of the per-item costs (`work_item_s`, `q_head_s`, given at head_dim 128) that
    grows with head_dim: the query loaded, the output stored and the split results merged
    are head_dim wide. Measured inside vLLM 0.24 on H100, the short-context decode of 128
    sequences takes 32, 38 µs at head_dim 64, 128 (40 query heads, 8 KV heads) and 22, 26,
    30 µs at 64, 128, 192 (64 query heads, 4 KV heads): fitted 1.0 there, 0.63 on B200, 0.13
    on the RTX PRO 6000; 0 (no growth) where a table has one head_dim only, which cannot
    tell (the vLLM 0.14 tables: 128)."""

    _fractions = ("memory_eff",)
    _added = ("item_dim_share", "gqa_copy_s")

    def __post_init__(self) -> None:
        self._check()
        if self.batch_saturation < 1:
            raise ValueError(f"DecodeAttentionParams.batch_saturation must be >= 1, "
                             f"got {self.batch_saturation!r}")


FA2_FULL_GPU = 0.8
"""FlashAttention 2 never splits once its work items fill this share of its wave slots."""
FA2_MAX_SPLITS = 128
FA2_EFFICIENCY = 0.85
"""It takes the fewest splits whose wave efficiency is within this share of the best."""


def fa2_kv_block(head_dim) -> np.ndarray:
    """Tokens per KV block of FlashAttention 2's split-KV decode (`set_params_splitkv`:
    256 up to head_dim 64, 128 up to 128, 64 above)."""
    head_dim = np.asarray(head_dim, dtype=np.float64)
    return np.where(head_dim <= 64, 256.0, np.where(head_dim <= 128, 128.0, 64.0))


def fa2_num_splits(items, kv_blocks, sm_count: int) -> np.ndarray:
    """How many splits FlashAttention 2's decode takes (`num_splits_heuristic` in
    flash_api.cpp, which vLLM's build calls with twice the SMs as its wave slots): one
    once the `items` (sequences × KV heads × query blocks) fill `FA2_FULL_GPU` of the
    slots; else, of the split counts up to the KV blocks, `FA2_MAX_SPLITS` and the slots
    (a count counting only where it changes the blocks per split), the fewest whose wave
    efficiency (waves / whole waves) is within `FA2_EFFICIENCY` of the best. One KV block
    is never split. Elementwise."""
    items, kv_blocks = np.broadcast_arrays(np.asarray(items, dtype=np.float64),
                                           np.asarray(kv_blocks, dtype=np.float64))
    slots = 2.0 * sm_count
    cap = np.minimum(min(FA2_MAX_SPLITS, slots), kv_blocks)
    effs = []
    for n in range(1, FA2_MAX_SPLITS + 1):
        eligible = n <= cap
        if n > 1:
            eligible = eligible & (np.ceil(kv_blocks / n) != np.ceil(kv_blocks / (n - 1)))
        waves = items * n / slots
        effs.append(np.where(eligible & (items > 0), waves / np.maximum(np.ceil(waves), 1.0), -1.0))
    best = np.max(effs, axis=0)
    chosen = np.ones(items.shape)
    open_ = np.ones(items.shape, dtype=bool)
    for n, eff in enumerate(effs, 1):
        pick = open_ & (eff >= FA2_EFFICIENCY * best)
        chosen = np.where(pick, n, chosen)
        open_ &= ~pick
    return np.where(items >= FA2_FULL_GPU * slots, 1.0, chosen)


def decode_attention_lines(batch, heads, kv_heads, head_dim, gpu: GPUSpec,
                           p: DecodeAttentionParams, kv_bytes=2.0, context_sum=None,
                           warm_l2: bool = False, seq_context=None):
    """Decode attention of `batch` sequences with C context tokens in all costs
    max(floor, intercept + slope·C) seconds per layer: (floor, intercept, slope).

    For a fixed batch the time is convex and piecewise linear in C — what lets a run of
    decode steps be summed in closed form. (`context_sum` is only needed for `warm_l2`,
    whose L2 residency depends on C.) Decode is bandwidth-bound for any grouped-query
    ratio a model uses (a few FLOPs per KV byte against a ridge in the hundreds).
    `seq_context`, each sequence's context where the caller knows it (a kernel table),
    says how many KV blocks FlashAttention 2 may split; without it (the simulator's
    per-batch tables) every sequence is taken to span `FA2_MAX_SPLITS` blocks or more (16k
    tokens at head_dim 128), where the split depends on the batch alone: below
    `FA2_FULL_GPU` of the wave slots it splits. A served batch of shorter contexts splits
    as often or less, so the merge's few microseconds may be charged where it is not run."""
    batch = np.asarray(batch, dtype=np.float64)
    heads, kv_heads = np.asarray(heads, np.float64), np.asarray(kv_heads, np.float64)
    kv_row = 2.0 * kv_heads * head_dim * kv_bytes
    hbm = gpu.hbm_bandwidth_gbps * 1e9 * p.memory_eff
    if warm_l2:     # L2 raises the bandwidth ceiling, not what too few work items stream
        hbm = hbm * _l2_factor(np.asarray(context_sum) * kv_row, gpu, p.l2_gain, True)
    mha = (heads == kv_heads) & (p.mha_block_gbps > 0)
    split = hbm if not p.head_stream_gbps else np.minimum(
        hbm, p.head_stream_gbps * 1e9 * kv_heads * np.maximum(1.0, batch / p.batch_saturation))
    rate = np.where(mha, np.minimum(hbm, p.mha_block_gbps * 1e9 * batch * kv_heads), split)
    floor = p.floor_s
    if p.split_floor_s:
        blocks = FA2_MAX_SPLITS if seq_context is None else \
            np.ceil((np.asarray(seq_context, dtype=np.float64) + 1) / fa2_kv_block(head_dim))
        items = batch * kv_heads * np.ceil(heads / np.maximum(kv_heads, 1.0) / 64.0)
        splits = ~mha & (fa2_num_splits(items, blocks, gpu.sm_count) > 1)
        floor = floor + np.where(splits, p.split_floor_s, 0.0)
    if p.gqa_copy_s:
        floor = floor + np.where(~mha & (heads > kv_heads) & (batch >= 2) & (kv_heads >= 2),
                                 p.gqa_copy_s, 0.0)
    base = floor + batch * kv_heads * p.seq_head_s
    items = batch * (kv_heads * p.work_item_s + heads * p.q_head_s) \
        * (1.0 + p.item_dim_share * (head_dim / 128.0 - 1.0))
    live = batch > 0
    slope = np.where(live, kv_row / np.maximum(rate, 1e-300), 0.0)
    return np.where(live, base + items, 0.0), np.where(live, base, 0.0), slope


def decode_attention_time(batch, context_sum, heads, kv_heads, head_dim, gpu: GPUSpec,
                          p: DecodeAttentionParams, kv_bytes=2.0, warm_l2: bool = False,
                          seq_context=None):
    floor, intercept, slope = decode_attention_lines(batch, heads, kv_heads, head_dim, gpu, p,
                                                     kv_bytes, context_sum, warm_l2,
                                                     seq_context)
    return np.maximum(floor, intercept + slope * context_sum)
