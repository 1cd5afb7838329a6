"""Multi-head latent attention (DeepSeek-V2/V3 style) kernel times, prefill and decode.

MLA caches one latent per token and layer: `kv_lora_rank` values plus `qk_rope_head_dim`
rotary values (512 + 64 = 576 for DeepSeek-V3), shared by every head. vLLM runs it in two
ways (`vllm/v1/attention/backends/mla/common.py`), and so does this model:

- prefill: the latent is up-projected to per-head keys and values (`kv_b_proj`, a GEMM of
  rank -> heads x (qk_nope + v)) and ordinary attention runs with a query/key head of
  qk_nope + qk_rope = 192 and a value head of 128;
- decode: the up-projection is absorbed into the query and the output (two batched GEMMs
  per token and head, 128 x 512), and every head attends to the 576-value latents
  directly, like multi-query attention with a 576-wide key and a 512-wide value.

Heads are those of one GPU (tensor parallelism splits heads; every GPU caches the whole
latent). What the measured kernels include (aiconfigurator's `collect_mla.py`, vLLM 0.14):
the MLA backend's forward — the cache write, the up-projection or absorption GEMMs and the
attention — not the q/kv down-projections or the output projection, which are dense GEMMs
the cost model prices with `gemm_time`.

Those tables were timed eagerly (`impl.forward` in a loop, no CUDA graph): the host launches
one call's kernels in a roughly fixed time (0.13-0.31 ms) while the GPU runs the previous
call's, so a measured call takes the larger of that launch time and the GPU's time, not
their sum (A100, 2 heads, one sequence: 0.33 ms flat up to 8k cached tokens, then the
GPU's 25 ns per token). `eager_floor_s` is that launch time: the fitter prices measured
rows with it (`eager=True`); the simulator's steps replay a CUDA graph and pay the GPU's
time alone (`floor_s` and the work).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from servelab.simulator.gpus import GPUSpec
from servelab.simulator.kernels.base import INF, _check_fields, _overlap, _Params, l2_hit

KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
QK_NOPE_HEAD_DIM = 128
V_HEAD_DIM = 128
"""DeepSeek-V3's MLA dimensions (its Hugging Face config.json; ../shared/REFERENCE.md)."""
TILE_ROWS = 128
"""Query rows per flash-attention thread block."""


@dataclass(frozen=True, slots=True)
class MLAPrefillParams(_Params):
    """MLA prefill: up-projection GEMM, attention, cache write; summed (they are separate
    kernels) after a floor."""

    floor_s: float = 0.0
    """Seconds no MLA prefill call beats (several launches)."""
    compute_eff: float = 1.0
    """Fraction of the BF16 tensor-core peak on QKᵀ and PV."""
    gemm_eff: float = 1.0
    """Fraction of the BF16 peak on the up-projection GEMM."""
    memory_eff: float = 1.0
    """Fraction of HBM bandwidth on the latents, the expanded K/V, Q and O."""
    padded_tile_pairs: float = 0.0
    """(query, key) pairs wasted per sequence and head on partly filled query tiles."""
    critical_path: float = 0.0
    """Weight of the longest thread block's work (one 128-row tile over all keys at one
    SM's share of the peak)."""
    eager_floor_s: float = 0.0
    """Seconds the host takes to launch one eager call's kernels (the measuring loop's
    floor, see the module docstring); 0: measured times are GPU times."""
    overlap: float = INF
    """Soft-maximum exponent of that launch time against the GPU's (inf: the larger)."""

    _fractions = ("compute_eff", "gemm_eff", "memory_eff")
    _added = ("eager_floor_s", "overlap")

    def __post_init__(self) -> None:
        _check_fields(self)


def mla_prefill_coefficients(heads, gpu: GPUSpec, p: MLAPrefillParams, kv_bytes=2.0,
                             kv_lora_rank: int = KV_LORA_RANK,
                             qk_rope_head_dim: int = QK_ROPE_HEAD_DIM,
                             qk_nope_head_dim: int = QK_NOPE_HEAD_DIM,
                             v_head_dim: int = V_HEAD_DIM):
    """One layer's MLA prefill as (floor, per causal pair, per sequence, per key of the
    longest chunk, per new token, per cached token) seconds — the layout of
    `attention.prefill_attention_coefficients`, so that ragged chunks are priced from
    their sums: Σ q·c + (Σ q² + Σ q)/2 pairs, the chunks, the longest chunk's keys,
    Σ q and Σ c. The up-projection and K/V traffic run over every key (new and cached),
    so they fall on the new- and cached-token coefficients alike."""
    h = np.asarray(heads, dtype=np.float64)
    peak = gpu.peak_flops("bf16")
    bw = gpu.hbm_bandwidth_gbps * 1e9 * p.memory_eff
    qk, latent = qk_nope_head_dim + qk_rope_head_dim, kv_lora_rank + qk_rope_head_dim
    per_pair = 2.0 * (qk + v_head_dim)                     # FLOPs per (query, key) pair and head
    pair = h * per_pair / (peak * p.compute_eff)
    per_key = (2.0 * kv_lora_rank * h * (qk_nope_head_dim + v_head_dim) / (peak * p.gemm_eff)
               + h * (qk_nope_head_dim + v_head_dim) * 2.0 * 2.0 / bw)   # expand, K/V traffic
    per_token = per_key + (h * (qk + v_head_dim) * 2.0 + latent * (2.0 + kv_bytes)) / bw
    per_ctx = per_key + latent * kv_bytes / bw
    critical = p.critical_path * TILE_ROWS * per_pair / (peak / gpu.sm_count)
    return p.floor_s, pair, p.padded_tile_pairs * pair, critical, per_token, per_ctx


def mla_prefill_time(batch, tokens, heads, gpu: GPUSpec, p: MLAPrefillParams, context=0,
                     kv_bytes=2.0, kv_lora_rank: int = KV_LORA_RANK,
                     qk_rope_head_dim: int = QK_ROPE_HEAD_DIM,
                     qk_nope_head_dim: int = QK_NOPE_HEAD_DIM, v_head_dim: int = V_HEAD_DIM,
                     eager: bool = False):
    """Seconds of one layer's MLA prefill of `batch` sequences of `tokens` new tokens each
    after `context` cached ones, `heads` heads on this GPU (all arguments broadcast).
    The cached latents are up-projected too (vLLM's chunked-context path). `eager`: as
    an eager measuring loop times it (`eager_time`)."""
    b = np.asarray(batch, dtype=np.float64)
    s = np.asarray(tokens, dtype=np.float64)
    c = np.asarray(context, dtype=np.float64)
    floor, pair, per_seq, per_key, per_token, per_ctx = mla_prefill_coefficients(
        heads, gpu, p, kv_bytes, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim)
    pairs = b * (s * c + 0.5 * s * (s + 1.0))
    t = (floor + pairs * pair + b * per_seq + (s + c) * per_key + b * s * per_token
         + b * c * per_ctx)
    if eager:
        t = eager_time(t, p)
    return np.where((b > 0) & (s > 0), t, 0.0)


def eager_time(gpu_time, p: "MLAPrefillParams | MLADecodeParams"):
    """What an eager measuring loop sees of a call whose kernels take `gpu_time` on the GPU:
    the soft maximum of that and the host's launch time (`eager_floor_s`)."""
    if not p.eager_floor_s:
        return gpu_time
    floor = np.broadcast_to(np.float64(p.eager_floor_s), np.shape(gpu_time))
    return _overlap(np.asarray(gpu_time, dtype=np.float64), floor, p.overlap)


@dataclass(frozen=True, slots=True)
class MLADecodeParams(_Params):
    """MLA decode: one query token per sequence over its cached latents, with the absorbed
    up-projections. The attention is the larger of streaming the latents (HBM-bound at
    large batch, bound by how few sequences split the work at small batch) and its FLOPs
    (576 + 512 per cached token and head: with many heads it nears the ridge)."""

    floor_s: float = 0.0
    """Seconds no MLA decode call beats."""
    compute_eff: float = 1.0
    """Fraction of the BF16 tensor-core peak on the attention and absorption FLOPs."""
    memory_eff: float = 1.0
    """Fraction of HBM bandwidth streaming latents at large batch."""
    seq_stream_gbps: float = 0.0
    """GB/s one sequence's split-KV work streams at (parallelism-bound small batches);
    0: no such limit."""
    seq_s: float = 0.0
    """Seconds per sequence (page-table walk, the split results' merge)."""
    absorb_eff: float = 1.0
    """Fraction of HBM bandwidth reading the absorbed up-projection weights."""
    seq_head_s: float = 0.0
    """Seconds per (sequence, head) whatever the context: the split-KV kernel's programs
    (sequences x head groups x splits) each load their queries and write and merge partial
    results (A100, 512 sequences x 128 heads: 2 ms at 8-128 cached tokens)."""
    one_head_stream_gbps: float = 0.0
    """`seq_stream_gbps` when a GPU holds one head: vLLM's Triton decode attention runs its
    plain (MHA) kernel when query heads per KV head is 1 and its grouped kernel otherwise
    (`decode_attention_fwd`), measured 3-5x slower per sequence (A100, L40S); 0: the same
    rate as for more heads (FlashMLA on Hopper has one path)."""
    eager_floor_s: float = 0.0
    """Seconds the host takes to launch one eager call's kernels (the measuring loop's
    floor, see the module docstring); 0: measured times are GPU times."""
    overlap: float = INF
    """Soft-maximum exponent of that launch time against the GPU's (inf: the larger)."""
    head_block: float = 0.0
    """Query heads one program of the decode kernel serves; the latents are read once per
    block of heads. vLLM's Triton MLA backend (`runs_triton_mla`) launches its grouped
    decode kernel over (sequences, ceil(heads / 16), KV splits) programs, BLOCK_H = 16
    (`triton_decode_attention.py::_decode_grouped_att_m_fwd`); 0: one read for every head
    (FlashMLA). An engine setting."""
    kv_splits: float = 4.0
    """KV splits of every sequence (vLLM's Triton MLA: `num_kv_splits = 4`); an engine
    setting."""
    reread_l2_fraction: float = 0.0
    """Share of L2 that one KV split of every sequence's latents may fill and still serve
    the head blocks after the first from L2: programs run sequences fastest, so a block of
    heads re-reads a split's latents after every sequence's were read for the block
    before. Beyond it, each further block reads from HBM (`mla_decode_lines`' second
    line). L40S (vLLM 0.14, aiconfigurator's `mla_generation_module_perf`, 128 heads, 1,024
    sequences of 8k tokens): 110.8 ms, eight times the 13.3 ms of 8 heads (one block);
    32 heads (two blocks) 27.5 ms; 128 heads at 64 sequences of 1k tokens read the latents
    about once. A GPU file without an L2 size: every re-read from HBM. Fitted values:
    docs/moe-mla.md. Unused when `head_block` is 0."""
    reread_seqs: float = 0.0
    """Sequences below which a block of heads' programs run alongside the next block's (the
    grid runs sequences fastest, so they are that many programs apart) and share their
    reads whatever the size; the re-reads fall off as a smooth step in the batch around
    it. L40S: 16-32 sequences of 16k-128k tokens with 32-128 heads read the latents about
    once, 64 sequences about four times at 128 heads, 128 and more up to eight times.
    0: no such overlap."""
    partials_l2_fraction: float = 0.0
    """Share of L2 the split results may fill and still pass from the kernel's first stage
    to its second through L2: stage 1 writes, for every (sequence, head, KV split), the
    split's output and log-sum-exp in FP32 (`attn_logits`, sequences x heads x kv_splits x
    (512 + 1) floats, vLLM's `triton_mla.py`), and stage 2 reads them back to merge them
    (`_decode_softmax_reducev_fwd`). `seq_head_s` is their cost from HBM; a batch whose
    results L2 holds pays less (a streamed set's soft step, sharpness 2). L40S (vLLM 0.14,
    aiconfigurator's `mla_generation_module_perf`, 128 heads, 7-1k cached tokens): about
    38 ns per (sequence, head) at 128 sequences (134 MB of results), 48-51 ns at 256-1,024.
    0: always from HBM (the kernels on Hopper and Blackwell are not described)."""
    partials_l2_gain: float = 1.0
    """How much cheaper a (sequence, head)'s results are when L2 holds them."""

    _fractions = ("compute_eff", "memory_eff", "absorb_eff")
    _added = ("seq_head_s", "one_head_stream_gbps", "eager_floor_s", "overlap", "head_block",
              "kv_splits", "reread_l2_fraction", "reread_seqs", "partials_l2_fraction",
              "partials_l2_gain")

    def __post_init__(self) -> None:
        _check_fields(self)


def mla_decode_lines(batch, heads, gpu: GPUSpec, p: MLADecodeParams, kv_bytes=2.0,
                     kv_lora_rank: int = KV_LORA_RANK, qk_rope_head_dim: int = QK_ROPE_HEAD_DIM,
                     qk_nope_head_dim: int = QK_NOPE_HEAD_DIM, v_head_dim: int = V_HEAD_DIM):
    """One layer's MLA decode of `batch` sequences costs max(a + b·C, c + d·C) seconds for
    C cached tokens in all: (a, b, c, d). Streaming the latents and their FLOPs are both
    proportional to C, so their maximum is the steeper line (a, b); (c, d) is the HBM
    traffic of every block of heads (`MLADecodeParams.head_block`): one read, and the
    re-reads of the blocks after the first for the latents beyond what L2 holds
    (`reread_l2_fraction`), below which the first line wins.
    For a fixed batch the time is the larger of two lines in C (a run of decode steps sums
    in closed form); without re-reads the two lines are one."""
    b = np.asarray(batch, dtype=np.float64)
    h = np.asarray(heads, dtype=np.float64)
    peak = gpu.peak_flops("bf16") * p.compute_eff
    hbm = gpu.hbm_bandwidth_gbps * 1e9
    latent = kv_lora_rank + qk_rope_head_dim
    rate = hbm * p.memory_eff
    if p.seq_stream_gbps:
        per_seq = p.seq_stream_gbps
        if p.one_head_stream_gbps:
            per_seq = np.where(h == 1, p.one_head_stream_gbps, p.seq_stream_gbps)
        rate = np.minimum(rate, per_seq * 1e9 * np.maximum(b, 1.0))
    stream = latent * kv_bytes / rate
    slope = np.maximum(stream, 2.0 * h * (latent + kv_lora_rank) / peak)
    absorb_weights = 2.0 * h * qk_nope_head_dim * kv_lora_rank * 2.0   # W_UK and W_UV, BF16
    absorb = (absorb_weights / (hbm * p.absorb_eff)
              + 2.0 * b * h * kv_lora_rank * (qk_nope_head_dim + v_head_dim) / peak)
    live = b > 0
    per_pair = p.seq_head_s
    if p.partials_l2_fraction:   # the split results handed from stage 1 to stage 2 via L2
        partials = b * h * p.kv_splits * (kv_lora_rank + 1) * 4.0
        hit = l2_hit(partials, gpu, p.partials_l2_fraction, sharpness=2.0)
        per_pair = per_pair * ((1.0 - hit) + hit / p.partials_l2_gain)
    intercept = np.where(live, p.floor_s + absorb + b * p.seq_s + b * h * per_pair, 0.0)
    slope = np.where(live, slope, 0.0)
    if not p.head_block:
        return intercept, slope, intercept, slope
    # every block's reads share HBM (a small batch's few programs are bound by their own
    # rate instead, in the first line): the first read, and the re-reads L2 does not hold
    again, held = _rereads(b, h, gpu, p, latent * kv_bytes)
    hbm_read = np.where(live, latent * kv_bytes / (hbm * p.memory_eff), 0.0)
    return intercept, slope, intercept - again * hbm_read * held, (1.0 + again) * hbm_read


def _rereads(batch, heads, gpu: GPUSpec, p: MLADecodeParams, token_bytes: float):
    """(reads of every cached token past `held` beyond the first, held): the blocks of heads
    after the first (`head_block`), fewer while few sequences let them run alongside
    (`reread_seqs`), and the cached tokens whose re-reads L2 holds (`reread_l2_fraction`)."""
    again = np.ceil(np.asarray(heads, dtype=np.float64) / p.head_block) - 1.0
    if p.reread_seqs:
        again = again / (1.0 + (p.reread_seqs / np.maximum(batch, 1.0)) ** 4)
    held = p.kv_splits * p.reread_l2_fraction * gpu.l2_bytes / token_bytes
    return again, held


def mla_latent_reads(batch, context_sum, heads, gpu: GPUSpec, p: MLADecodeParams,
                     kv_bytes=2.0, kv_lora_rank: int = KV_LORA_RANK,
                     qk_rope_head_dim: int = QK_ROPE_HEAD_DIM):
    """How many times one layer's MLA decode reads the cached latents from HBM: 1, plus
    the re-reads of the blocks of heads after the first beyond what L2 holds (the traffic
    of `mla_decode_lines`' second line, whether or not that line sets the time)."""
    c = np.asarray(context_sum, dtype=np.float64)
    if not p.head_block:
        return np.ones_like(c)
    again, held = _rereads(np.asarray(batch, dtype=np.float64), heads, gpu, p,
                           (kv_lora_rank + qk_rope_head_dim) * kv_bytes)
    return 1.0 + again * np.maximum(0.0, 1.0 - held / np.maximum(c, 1.0))


FLASH_MLA_MAJORS = (9, 10)
"""Compute capabilities (major) on which vLLM decodes MLA with FlashMLA, FlashAttention-3
MLA or the CUTLASS/FlashInfer MLA kernels (Hopper, datacenter Blackwell); elsewhere
(Ampere, Ada, the RTX PRO 6000's sm_120) with its Triton MLA kernel
(`vllm/platforms/cuda.py::_get_backend_priorities`)."""


def runs_triton_mla(gpu: GPUSpec) -> bool:
    """Whether vLLM decodes MLA with its Triton kernel on this GPU (`FLASH_MLA_MAJORS`; a GPU
    file without a compute capability: by architecture). That kernel has no FP8 KV cache
    (`TritonMLAImpl._forward_decode` raises "FP8 Triton MLA not yet supported")."""
    if gpu.compute_capability:
        return int(gpu.compute_capability.split(".")[0]) not in FLASH_MLA_MAJORS
    return gpu.architecture in ("ampere", "ada")


def triton_fp8_kv_refusal(gpu_name: str) -> str:
    """The one line refusing an FP8 KV cache for MLA where vLLM runs its Triton kernel."""
    return (f"an FP8 KV cache for MLA on {gpu_name}: vLLM decodes MLA there with its Triton "
            "kernel, which has none (TritonMLAImpl raises 'FP8 Triton MLA not yet "
            "supported'); use a bf16 KV cache, or a Hopper or Blackwell GPU")


def mla_decode_time(batch, context_sum, heads, gpu: GPUSpec, p: MLADecodeParams, kv_bytes=2.0,
                    kv_lora_rank: int = KV_LORA_RANK, qk_rope_head_dim: int = QK_ROPE_HEAD_DIM,
                    qk_nope_head_dim: int = QK_NOPE_HEAD_DIM, v_head_dim: int = V_HEAD_DIM,
                    eager: bool = False):
    """Seconds of one layer's MLA decode of `batch` sequences with `context_sum` cached
    tokens in all, `heads` heads on this GPU (`mla_decode_lines`). `eager`: as an eager
    measuring loop times it (`eager_time`)."""
    a, b, c, d = mla_decode_lines(batch, heads, gpu, p, kv_bytes, kv_lora_rank,
                                  qk_rope_head_dim, qk_nope_head_dim, v_head_dim)
    ctx = np.asarray(context_sum, dtype=np.float64)
    t = np.maximum(a + b * ctx, c + d * ctx)
    if eager:
        t = np.where(np.asarray(batch) > 0, eager_time(t, p), 0.0)
    return t
