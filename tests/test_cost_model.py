"""The step-time model: physics anchors, internal consistency, fast-forward, capacity,
calibration profiles.

Physics anchors use the bare roofline (`calibration="none"`: peaks reached, no floors, no
overhead), where every figure can be derived by hand; the default (measured) profiles are
checked for the qualitative behaviour the measurements show.
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.models import ModelSpec
from servelab.outputs import BatchShape
from servelab.simulator import kernels as K
from servelab.simulator.calibration import (
    FORMAT, CalibrationProfile, bare_roofline, packaged, packaged_names, resolve)
from servelab.simulator.cost_model import CostModel
from servelab.simulator.footprint import kv_capacity_blocks
from servelab.simulator.gpus import get_gpu, gpu_names

A100_BW = 2.039e12
A100_PEAK = 312e12
LAYER_GEMMS = ("qkv_proj", "o_proj", "mlp_gate_up", "mlp_down")


def decode(n: int, context: int) -> BatchShape:
    """n decoding sequences, each with `context` tokens of KV read (Σ(c + 1))."""
    return BatchShape(num_decode_seqs=n, decode_context_sum=n * context)


def prefill(*chunks: tuple[int, int]) -> BatchShape:
    """Prefill chunks given as (tokens, cached context) pairs."""
    return BatchShape(num_prefill_seqs=len(chunks), num_prefill_tokens=sum(q for q, _ in chunks),
                      prefill_context_sum=sum(c for _, c in chunks),
                      prefill_q_context_sum=sum(q * c for q, c in chunks),
                      prefill_q_sq_sum=sum(q * q for q, _ in chunks),
                      prefill_max_keys=max((q + c for q, c in chunks), default=0))


def step(chunks, contexts, swaps=0, copies=0) -> BatchShape:
    """Prefill chunks (tokens, cached), decoding sequences' contexts, swaps and copies."""
    return dataclasses.replace(prefill(*chunks), num_decode_seqs=len(contexts),
                               decode_context_sum=sum(contexts), num_swap_blocks=swaps,
                               num_copy_blocks=copies)


def gemm_time(cm: CostModel, shape: BatchShape, names=LAYER_GEMMS) -> float:
    ops = cm.breakdown(shape)
    return sum(ops[n].time_s for n in names)


@pytest.fixture(scope="module")
def bare7b() -> CostModel:
    return CostModel("llama-2-7b", "a100-80gb", calibration="none")


@pytest.fixture(scope="module")
def llama7b_a100() -> CostModel:
    return CostModel("llama-2-7b", "a100-80gb")


# --- physics anchors (bare roofline) ------------------------------------------------------------

def test_bare_decode_is_weights_and_kv_over_bandwidth(bare7b):
    """32 sequences x 2048 context: every GEMM streams its weights; with no floors and no
    overhead the step is (streamed weights + KV + activations) / bandwidth, and weights
    plus KV are 99% of it."""
    m, cm = bare7b.model, bare7b
    shape = decode(32, 2048)
    ops = cm.breakdown(shape)
    assert all(op.bound in ("memory", "fixed") for op in ops.values())
    streamed = (2 * m.num_params - 2 * m.vocab_size * m.hidden_size      # embedding: gathered
                - 2 * (2 * m.num_layers + 1) * m.hidden_size)            # norms: elementwise
    kv = shape.decode_context_sum * m.kv_bytes_per_token()
    t = cm.step_time(shape)
    assert cm.step_overhead_s == 0.0
    assert (streamed + kv) / A100_BW == pytest.approx(t, rel=0.02)
    assert (streamed + kv) / A100_BW < t


def test_bare_long_prefill_is_flops_over_peak(bare7b):
    m, cm = bare7b.model, bare7b
    shape = prefill((4096, 0))
    ops = cm.breakdown(shape)
    assert all(ops[n].bound == "compute" for n in (*LAYER_GEMMS, "attn_prefill"))
    h, inter, L = m.hidden_size, m.intermediate_size, m.num_layers
    layer_flops = 2 * 4096 * L * (4 * h * h + 3 * h * inter)
    attn_flops = 4 * h * L * (4096 * 4097 // 2)            # causal pairs of one 4096 chunk
    assert gemm_time(cm, shape) == pytest.approx(layer_flops / A100_PEAK, rel=1e-9)
    # attention adds its traffic to its work (measured kernels overlap them little)
    assert ops["attn_prefill"].time_s == pytest.approx(
        attn_flops / A100_PEAK + ops["attn_prefill"].bytes / A100_BW, rel=1e-9)
    # per token and layer: Q read + O written (16 KiB), its K/V read by attention (16 KiB),
    # the cache write reading K/V and storing them (32 KiB)
    assert ops["attn_prefill"].bytes == L * 4096 * 64 * 1024


def test_prefill_attention_is_quadratic_in_chunk_and_linear_in_prefix(llama7b_a100):
    flops = {s: llama7b_a100.breakdown(prefill(s))["attn_prefill"].flops
             for s in [(1024, 0), (2048, 0), (1024, 1024), (1024, 3072)]}
    pair = flops[(1024, 0)] / (1024 * 1025 / 2)
    assert flops[(2048, 0)] == pytest.approx(pair * 2048 * 2049 / 2)
    assert flops[(1024, 3072)] - flops[(1024, 1024)] == pytest.approx(pair * 1024 * 2048)


def test_chunked_prefill_reads_the_cached_context_once():
    """A 512-token chunk after 8192 cached tokens reads their K/V from HBM once (query
    tiles re-read it from L2) and attends to all of it."""
    cm = CostModel("llama-3.1-8b", "h100-sxm", calibration="none")
    kv_token = cm.shapes.kv_bytes_per_token
    fresh, cached = (cm.breakdown(prefill((512, c)))["attn_prefill"] for c in (0, 8192))
    assert cached.bytes - fresh.bytes == pytest.approx(kv_token * 8192, rel=1e-9)
    assert cached.flops - fresh.flops == pytest.approx(4 * cm.shapes.q_dim * cm.shapes.num_layers
                                                       * 512 * 8192, rel=1e-9)


def test_doubling_tp_halves_gemms_and_adds_collectives():
    shapes = {"prefill": prefill((2048, 0)), "decode": decode(1, 100)}
    tp1 = CostModel("llama-2-13b", "a100-80gb", calibration="none")
    tp2 = CostModel("llama-2-13b", "a100-80gb", tp=2, calibration="none")
    # compute-bound GEMMs halve exactly; weight streaming halves up to its activations
    assert gemm_time(tp1, shapes["prefill"]) == pytest.approx(2 * gemm_time(tp2, shapes["prefill"]), rel=1e-9)
    assert gemm_time(tp1, shapes["decode"]) == pytest.approx(2 * gemm_time(tp2, shapes["decode"]), rel=0.01)
    for shape in shapes.values():
        assert "allreduce" not in tp1.breakdown(shape)
        assert tp2.breakdown(shape)["allreduce"].time_s > 0
    # 2 all-reduces x 40 layers of the 2048x5120 BF16 hidden state; a ring moves 2(n-1)/n
    # of it over the 300 GB/s (per direction) NVLink, with no latency in the bare roofline
    allreduce = 2 * 40 * (2048 * 5120 * 2) * 2 * (2 - 1) / 2 / 300e9
    assert tp2.breakdown(shapes["prefill"])["allreduce"].time_s == pytest.approx(allreduce, rel=1e-9)
    # the logits all-gather of one row: the full 32000-entry vocabulary, half of it moving
    assert tp2.breakdown(shapes["prefill"])["logits_gather"].time_s == pytest.approx(
        32000 * 2 / 2 / 300e9, rel=1e-9)


def test_fp8_weights_halve_weight_reads_and_double_the_h100_peak():
    for gpu in ("h100-sxm", "a100-80gb"):
        bf16 = CostModel("llama-3.1-8b", gpu, calibration="none")
        fp8 = CostModel("llama-3.1-8b", gpu, weight_dtype="fp8", calibration="none")
        shape = decode(1, 100)
        assert gemm_time(bf16, shape) == pytest.approx(2 * gemm_time(fp8, shape), rel=0.01)
        lm = ("lm_head",)   # the LM head stays BF16
        assert gemm_time(bf16, shape, lm) == gemm_time(fp8, shape, lm)
    # compute: FP8 tensor cores double the peak on H100 (1979 vs 989 TFLOP/s); A100 runs
    # weight-only FP8 at its BF16 peak
    big = prefill((4096, 0))
    h100 = [CostModel("llama-3.1-8b", "h100-sxm", weight_dtype=d, calibration="none")
            for d in ("bf16", "fp8")]
    a100 = [CostModel("llama-3.1-8b", "a100-80gb", weight_dtype=d, calibration="none")
            for d in ("bf16", "fp8")]
    assert gemm_time(h100[0], big) == pytest.approx(1979 / 989 * gemm_time(h100[1], big), rel=1e-9)
    assert gemm_time(a100[0], big) == pytest.approx(gemm_time(a100[1], big), rel=1e-9)


def test_fp8_kv_halves_decode_kv_reads():
    bf16 = CostModel("llama-3.1-8b", "h100-sxm")
    fp8 = CostModel("llama-3.1-8b", "h100-sxm", kv_dtype="fp8")
    shape = decode(64, 8192)
    ratio = bf16.breakdown(shape)["attn_decode"].time_s / fp8.breakdown(shape)["attn_decode"].time_s
    assert ratio == pytest.approx(2, rel=0.05)


def test_swap_time_scales_with_blocks_over_pcie(llama7b_a100):
    # 16-token blocks of 512 KiB tokens = 8 MiB each, over 32 GB/s PCIe at the host link's
    # efficiency, after its per-copy latency
    h = llama7b_a100.kernels.host_link
    per_block = 16 * 512 * 1024 / (32e9 * h.link_eff)
    for blocks in (1, 100, 200):
        t = llama7b_a100.step_time(BatchShape(num_swap_blocks=blocks))
        assert t - llama7b_a100.step_overhead_s == pytest.approx(h.latency_s + blocks * per_block,
                                                                 rel=1e-9)
    big_blocks = CostModel("llama-2-7b", "a100-80gb", block_size=32)
    small, big = (cm.breakdown(BatchShape(num_swap_blocks=10))["swap"].time_s
                  for cm in (llama7b_a100, big_blocks))
    assert big - h.latency_s == pytest.approx(2 * (small - h.latency_s))


def test_block_copies_read_and_write_hbm(llama7b_a100):
    op = llama7b_a100.breakdown(BatchShape(num_copy_blocks=3))["block_copy"]
    e = llama7b_a100.kernels.elementwise
    assert op.bytes == 3 * 2 * 16 * 512 * 1024
    assert op.time_s == pytest.approx(e.floor_s + op.bytes / (A100_BW * e.memory_eff))


# --- the measured profiles: what the data showed a bare roofline lacks ---------------------------

def test_every_kernel_has_a_time_floor():
    """Tiny kernels cost microseconds, not nanoseconds: a one-token step of a small model
    is priced at the sum of its kernels' floors at least."""
    cm = CostModel("llama-3.1-8b", "h100-sxm", step_overhead_s=0.0)
    bare = CostModel("llama-3.1-8b", "h100-sxm", calibration="none")
    ops = cm.breakdown(decode(1, 1))
    floors = {"gemm": cm.kernels.gemm.floor_s, "elementwise": cm.kernels.elementwise.floor_s,
              "attn_decode": cm.kernels.attn_decode.floor_s}
    for name, op in ops.items():
        if op.op_class in floors:
            assert op.time_s >= op.calls * floors[op.op_class] > 0, name
    assert bare.breakdown(decode(1, 1))["rotary"].time_s < 0.05 * ops["rotary"].time_s


def test_measured_gemms_run_below_peak_and_prefill_is_not_priced_at_whole_step_mfu():
    """Large GEMMs reach 0.6-0.9 of peak in the measurements, weight streaming 0.6-0.9 of
    the bandwidth (the old whole-step MFU of 0.38-0.45 priced prefill 1.5-2x too slow)."""
    for gpu in ("a100-80gb", "h100-sxm", "l40s"):
        spec, gemm = get_gpu(gpu), resolve(gpu).kernels.gemm
        n = k = 8192
        big = float(K.gemm_time(8192, n, k, spec, gemm))
        assert 0.6 <= 2 * 8192 * n * k / big / spec.peak_flops("bf16") <= 0.95, gpu
        skinny = float(K.gemm_time(1, n, k, spec, gemm))
        assert 0.6 <= 2 * n * k / skinny / (spec.hbm_bandwidth_gbps * 1e9) <= 0.95, gpu
        assert 1e-6 <= gemm.floor_s <= 1e-5, gpu


def test_decode_attention_costs_more_per_token_at_short_context():
    cm = CostModel("llama-3.1-8b", "h100-sxm")
    short, long = (cm.breakdown(decode(8, c))["attn_decode"].time_s / (8 * c) for c in (128, 8192))
    assert short > 2 * long


def test_flash_attention_2_decode_floors_follow_its_copies_and_its_splits():
    """FlashAttention 2's grouped-query decode copies the query and output when the batch
    and the KV heads are both above one (a transpose PyTorch cannot view), and launches
    its split-KV merge only where it splits (`fa2_num_splits`). The A100 tables show both:
    12.3 us for one sequence or one KV head at a short context, 18.3-19.5 us from two of
    each; one KV head at 255 tokens (two KV blocks) keeps its merge at 64 sequences and
    drops it at 128, where splitting no longer fills more of the GPU's wave slots."""
    a100 = get_gpu("a100-80gb")     # 108 SMs: 216 wave slots
    p = K.DecodeAttentionParams(floor_s=10e-6, split_floor_s=3e-6, gqa_copy_s=5e-6)

    def floor(batch, heads, kv_heads, context=None):
        return float(K.decode_attention_lines(batch, heads, kv_heads, 128, a100, p,
                                              seq_context=context)[0])

    # one KV block (contexts up to 127): no split; the copies only from 2 sequences x 2 KV heads
    assert floor(1, 8, 2, 127) == floor(8, 8, 1, 127) == pytest.approx(10e-6)
    assert floor(2, 8, 2, 127) == floor(8, 32, 8, 1) == pytest.approx(15e-6)
    # past one block the merge joins, while splitting fills more of the GPU
    assert floor(1, 8, 1, 128) == pytest.approx(13e-6)
    assert floor(2, 8, 2, 255) == pytest.approx(18e-6)
    assert floor(64, 8, 1, 255) == pytest.approx(13e-6)
    assert floor(128, 8, 1, 255) == pytest.approx(10e-6)       # two blocks: nothing to gain
    assert floor(16, 64, 8, 4096) == pytest.approx(18e-6)      # 128 items, 33 blocks: splits
    assert floor(32, 64, 8, 4096) == pytest.approx(15e-6)      # 256 items fill the slots
    # equal query and KV heads take neither (no groups to fold, and no split path)
    mha = dataclasses.replace(p, mha_block_gbps=25.0)
    assert float(K.decode_attention_lines(4, 32, 32, 128, a100, mha, seq_context=4096)[0]) \
        == pytest.approx(10e-6)
    # the simulator's tables know no per-sequence context: taken as long, the batch decides
    assert floor(4, 32, 8) == floor(4, 32, 8, 1 << 20) == pytest.approx(18e-6)
    assert floor(32, 64, 8) == pytest.approx(15e-6)


def test_flash_attention_2_splits_as_its_heuristic_does():
    """`num_splits_heuristic` with vLLM's 2 x SMs wave slots (A100: 216): the fewest splits
    within 85% of the best wave efficiency, counting only split counts that change the
    blocks per split; none once the items fill 80% of the slots, none over one block."""
    assert K.fa2_num_splits(64, 2, 108) == 2            # 0.30 of the slots; two do 0.59
    assert K.fa2_num_splits(128, 2, 108) == 1           # 0.59 either way
    assert K.fa2_num_splits(150, 128, 108) == 4         # 0.69, 0.69, 0.69, then 0.93
    assert K.fa2_num_splits(173, 128, 108) == 1         # past 0.8 x 216
    assert K.fa2_num_splits(8, 1, 108) == 1             # one block
    assert K.fa2_num_splits(1, 128, 108) == 128         # 64 blocks a split at 64: 0.30 < 0.85 x 0.59


def test_warm_l2_raises_the_bandwidth_ceiling_not_a_few_blocks_streaming():
    """An isolated benchmark with its KV set in L2 streams faster only where HBM was the
    limit: two thread blocks of the multi-head path stream at their own rate either way
    (the L40S measurements: 27.5 GB/s a block whether 67 MB or 537 MB are read)."""
    l40s = get_gpu("l40s")
    p = K.DecodeAttentionParams(memory_eff=0.8, mha_block_gbps=25.0, l2_gain=3.0)

    def seconds(batch, heads, context, warm):
        return float(K.decode_attention_time(batch, batch * context, heads, heads, 128, l40s,
                                             p, warm_l2=warm))

    few = 1 * 16_384 * 2 * 2 * 128 * 2 / (25e9 * 2)      # 2 blocks at 25 GB/s each
    assert seconds(1, 2, 16_384, warm=True) == pytest.approx(few)
    assert seconds(1, 2, 16_384, warm=False) == pytest.approx(few)
    # 128 blocks would stream beyond HBM, and beyond L2: there the L2-sized set (67 MB of
    # L40S's 96) is read 3x faster
    assert seconds(4, 32, 1024, warm=False) == pytest.approx(3 * seconds(4, 32, 1024, warm=True))


def test_prefill_l2_share_fades_past_the_cache_size_without_a_cliff():
    """A replayed prefill keeps part of its streamed Q, O and K/V in L2 past the L2 size
    (L40S measurements show no step where the set passes 96 MB): the memory term grows
    smoothly with the set, and a set twice the L2 still gains."""
    l40s = get_gpu("l40s")
    p = K.PrefillAttentionParams(memory_eff=1.0, l2_gain=3.0)

    def memory_s(tokens, warm):   # per token, of 16-token sequences: almost all memory
        seqs = tokens // 16
        return float(K.prefill_attention_time(seqs, tokens, 0.0, seqs * 256, 0.0, 32, 32,
                                              128, l40s, p, warm_l2=warm)) / tokens

    per_token = [memory_s(t, True) for t in (1024, 1400, 1536, 1700, 3072)]
    cold = memory_s(3072, False)
    assert all(b / a < 1.5 for a, b in zip(per_token, per_token[1:]))   # no 3x cliff
    assert per_token[-1] < cold


def test_gpus_without_measurements_borrow_a_named_profile():
    for name in gpu_names():
        spec = get_gpu(name)
        if spec.calibration is None:
            assert resolve(spec).kernels == K.KernelParams.roofline()
            continue
        assert spec.calibration in packaged_names(), name
        profile = resolve(spec)
        assert profile is packaged(spec.calibration)
        if profile.device != name:       # carried over: the catalog says why
            assert "carried over" in spec.source or "No public kernel measurements" in spec.source
    # H200 prices with H100's kernel parameters against its own, faster HBM
    h100 = CostModel("llama-3.1-8b", "h100-sxm")
    h200 = CostModel("llama-3.1-8b", "h200")
    assert h200.kernels == h100.kernels
    assert h200.step_time(decode(64, 4096)) < h100.step_time(decode(64, 4096))


def test_packaged_profiles_say_where_they_come_from():
    for name in packaged_names():
        profile = packaged(name)
        assert name.split(".")[0] == profile.device
        assert profile.source["kernels.gemm"].startswith("aiconfigurator")
        assert f"vllm {profile.engine_version}" in profile.source["kernels.gemm"].lower()
        assert "aiconfigurator" in profile.source["data"]
        assert "assumption" in profile.source["step_overhead_s"]
        assert profile.fit_stats["holdout_fraction"] > 0
        assert profile.fit_stats["gemm.heldout_mape_pct"] > 0


# --- errors ------------------------------------------------------------------------------------

def test_unknown_names_and_bad_setups_raise_clearly():
    with pytest.raises(ValueError, match="unknown GPU 'v100'"):
        CostModel("llama-2-7b", "v100")
    with pytest.raises(ValueError, match="unknown model 'gpt-5'"):
        CostModel("gpt-5", "h100-sxm")
    with pytest.raises(ValueError, match="tp=3 must divide"):
        CostModel("llama-2-7b", "h100-sxm", tp=3)
    odd = ModelSpec("odd", 2, 768, 12, 4, 64, 3072, 1000)
    with pytest.raises(ValueError, match="4 KV heads"):
        CostModel(odd, "h100-sxm", tp=3)
    with pytest.raises(ValueError, match="weight_dtype must be one of"):
        CostModel("llama-2-7b", "h100-sxm", weight_dtype="int4")
    with pytest.raises(ValueError, match="BatchShape.num_decode_seqs must be >= 0"):
        CostModel("llama-2-7b", "h100-sxm").breakdown(BatchShape(num_decode_seqs=-1))
    with pytest.raises(ValueError, match="GemmParams.compute_eff must be a fraction"):
        K.GemmParams(compute_eff=1.2)
    with pytest.raises(ValueError, match="overlap must be >= 1"):
        K.GemmParams(overlap=0.5)
    with pytest.raises(ValueError, match="profile is for device 'h100-sxm', not 'a100-80gb'"):
        CostModel("llama-3.1-8b", "a100-80gb", calibration="h100-sxm")


# --- KV capacity ---------------------------------------------------------------------------------
def test_kv_capacity_llama2_7b_a100_by_hand():
    # budget   80 GiB × 0.9                                  = 77,309,411,328 B
    # weights  6,738,415,616 params × 2 B                    = 13,476,831,232 B
    # reserve  1 GiB + 2048 tok × (2·4096 + 3·11008) × 2 B   =  1,242,562,560 B
    #          + 128 rows × 32000 × 4 B logits               =     16,384,000 B
    # free                                                   = 62,573,633,536 B
    # block    16 tokens × 512 KiB                           =      8,388,608 B  → 7459.3
    assert kv_capacity_blocks("llama-2-7b", "a100-80gb", block_size=16) == 7459
    assert kv_capacity_blocks("llama-2-7b", "a100-80gb", kv_dtype="fp8") == 14918   # 4 MiB blocks
    # a measured reserve of 0 leaves (77,309,411,328 − 13,476,831,232) / 8,388,608 = 7609.4
    assert kv_capacity_blocks("llama-2-7b", "a100-80gb", activation_reserve_gb=0.0) == 7609


def test_kv_capacity_under_tp_and_errors():
    with pytest.raises(ValueError, match="weights need 128.5 GiB per GPU at tp=1"):
        kv_capacity_blocks("llama-2-70b", "a100-80gb")
    tp2 = kv_capacity_blocks("llama-2-70b", "a100-80gb", tp=2)
    tp4 = kv_capacity_blocks("llama-2-70b", "a100-80gb", tp=4)
    assert 0 < tp2 < tp4 / 2      # halving the weights frees more than half again
    assert kv_capacity_blocks("llama-2-70b", "a100-80gb", weight_dtype="fp8") > 0
    with pytest.raises(ValueError, match="no room for a KV block"):
        kv_capacity_blocks("llama-2-7b", "l40s", activation_reserve_gb=31.0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_capacity_blocks("llama-2-7b", "a100-80gb", gpu_memory_utilization=1.5)


# --- internal consistency (properties) ------------------------------------------------------

SETUPS = {
    "7b-a100": CostModel("llama-2-7b", "a100-80gb"),
    "8b-h100-fp8": CostModel("llama-3.1-8b", "h100-sxm", weight_dtype="fp8", kv_dtype="fp8"),
    "70b-h200-tp4": CostModel("llama-3.1-70b", "h200", tp=4),
    "qwen-l40s-tp2": CostModel("qwen2.5-7b", "l40s", tp=2, block_size=32),
    "tiny-cpu": CostModel("tiny-llama", "cpu"),
    "b200-tp8-scaled": CostModel("llama-3.1-70b", "b200", tp=8, calibration=resolve("b200").with_fit(
        {"gemm": 1.2, "attn_decode": 0.7, "collective": 2.0}, 5e-4, {})),
    "bare-zero-overhead": CostModel("llama-3.1-8b", "a100-80gb", calibration="none"),
    # MLA on the Triton kernel: 64 heads a GPU, four blocks re-reading what L2 does not hold
    "deepseek-l40s-tp2": CostModel("deepseek-v3", "l40s", tp=2, weight_dtype="fp8"),
    # a large per-item decode cost: short-context decode sits on that flat line for many steps
    "floor-crossing": CostModel("llama-3.1-8b", "a100-80gb", step_overhead_s=0.0,
                                calibration=dataclasses.replace(resolve("a100-80gb"), kernels=dataclasses.replace(
                                    resolve("a100-80gb").kernels,
                                    attn_decode=K.DecodeAttentionParams(floor_s=5e-6, work_item_s=1e-6, memory_eff=0.8)))),
}


@st.composite
def parts(draw, max_decode: int = 64):
    """(prefill chunks, decode contexts, swap blocks, copy blocks) of a step."""
    return (draw(st.lists(st.tuples(st.integers(1, 4096), st.integers(0, 8192)), max_size=4)),
            draw(st.lists(st.integers(1, 8192), max_size=max_decode)),
            draw(st.integers(0, 50)), draw(st.integers(0, 10)))


@st.composite
def shapes(draw, max_decode: int = 64):
    return step(*draw(parts(max_decode)))


@settings(max_examples=200, deadline=None)
@given(setup=st.sampled_from(sorted(SETUPS)), shape=shapes())
def test_step_time_equals_breakdown_and_linear_form(setup, shape):
    cm = SETUPS[setup]
    t = cm.step_time(shape)
    assert t == pytest.approx(sum(op.time_s for op in cm.breakdown(shape).values()), rel=1e-12)
    row, coef = cm.features(shape), cm.coefficients()
    assert set(row) == set(coef)
    assert t == pytest.approx(sum(coef[k] * row[k] for k in row), rel=1e-12)


MORE_WORK = ("another chunk", "longer chunk", "more cached context", "longer decode context",
             "more swaps", "more copies")


@settings(max_examples=300, deadline=None)
@given(setup=st.sampled_from(sorted(SETUPS)), p=parts(), what=st.sampled_from(MORE_WORK),
       which=st.integers(0, 3), extra=st.integers(1, 5000))
def test_more_work_never_takes_less_time(setup, p, what, which, extra):
    """Every way a step can hold more work — a chunk more, a chunk longer or over more
    context, a decode over more context, more blocks moved — never takes less time."""
    cm = SETUPS[setup]
    chunks, contexts, swaps, copies = p
    chunks, contexts = list(chunks), list(contexts)
    if what == "another chunk" or (what in ("longer chunk", "more cached context") and not chunks):
        chunks.append((extra % 4096 + 1, which * 1000))
    elif what == "longer chunk":
        q, c = chunks[which % len(chunks)]
        chunks[which % len(chunks)] = (q + extra, c)
    elif what == "more cached context":
        q, c = chunks[which % len(chunks)]
        chunks[which % len(chunks)] = (q, c + extra)
    elif what == "longer decode context" and contexts:
        contexts[which % len(contexts)] += extra
    elif what == "more swaps":
        swaps += extra
    elif what == "more copies":
        copies += extra
    more, less = step(chunks, contexts, swaps, copies), step(*p)
    if _switches_allreduce_path(cm, less, more):
        # the engine picks its all-reduce by message size (vLLM: custom kernel, then
        # symmetric memory, then NCCL), and the path just above a threshold can be priced
        # faster than the one just below: every other op class still never gets cheaper
        more_t, less_t = cm.class_times(more), cm.class_times(less)
        assert all(more_t[c] >= less_t[c] for c in more_t if c != "collective")
        return
    assert cm.step_time(more) >= cm.step_time(less)


def _switches_allreduce_path(cm: CostModel, less: BatchShape, more: BatchShape) -> bool:
    """Whether the step's all-reduce or logits gather takes another path with more work."""
    if cm.tp == 1:
        return False
    s, p = cm.shapes, cm.kernels.collective
    paths = [K.allreduce_route([b.num_tokens * s.allreduce_bytes_per_token,
                                (b.num_prefill_seqs + b.num_decode_seqs) * s.gather_bytes_per_seq / 2], cm.tp, cm.gpu, p)
             for b in (less, more)]
    return bool((paths[0] != paths[1]).any())


@settings(max_examples=200, deadline=None)
@given(setup=st.sampled_from(sorted(SETUPS)), shape=shapes(), context=st.integers(1, 8192))
def test_another_decoding_sequence_never_takes_less_time(setup, shape, context):
    """A sequence brings its own context. (Splitting the same context over more sequences
    can be faster: decode attention streams more in parallel at small batch.)"""
    cm = SETUPS[setup]
    mean = -(-shape.decode_context_sum // shape.num_decode_seqs) if shape.num_decode_seqs else 1
    more = dataclasses.replace(shape, num_decode_seqs=shape.num_decode_seqs + 1,
                               decode_context_sum=shape.decode_context_sum + max(context, mean))
    assert cm.step_time(more) >= cm.step_time(shape)


# --- fast-forward --------------------------------------------------------------------------------

def stepwise(cm: CostModel, shape: BatchShape, k: int) -> list[float]:
    n, ctx = shape.num_decode_seqs, shape.decode_context_sum
    return [cm.step_time(dataclasses.replace(shape, decode_context_sum=ctx + j * n)) for j in range(k)]


@settings(max_examples=100, deadline=None)
@given(setup=st.sampled_from(sorted(SETUPS)), shape=shapes(), k=st.integers(0, 300))
def test_decode_run_duration_equals_stepwise_sum(setup, shape, k):
    cm = SETUPS[setup]
    steps = stepwise(cm, shape, k)
    total, ends = cm.decode_run_duration(shape, k, end_times=True)
    assert total == pytest.approx(math.fsum(steps), rel=1e-9, abs=1e-15)
    assert len(ends) == k
    if k:
        assert ends[-1] == pytest.approx(total, rel=1e-9)
        assert list(ends) == pytest.approx(list(_cumsum(steps)), rel=1e-9)
    assert cm.decode_run_duration(shape, k) == (total, None)


def test_mla_run_onto_the_reread_line():
    """MLA decode on the Triton kernel (L40S) reads the latents once while L2 holds their
    re-reads and once per block of heads past it: a run whose context grows across that
    point sums both lines in closed form."""
    cm = SETUPS["deepseek-l40s-tp2"]
    shape = decode(256, 64)
    first = cm.breakdown(shape)
    later = cm.breakdown(decode(256, 4000))
    per_token = 61 * 576 * 2   # layers x latent x BF16 KV bytes
    assert first["attn_decode"].bytes == pytest.approx(per_token * 256 * 64)
    assert later["attn_decode"].bytes > 2 * per_token * 256 * 4000     # re-reads past L2
    total, _ = cm.decode_run_duration(shape, 4000)
    assert total == pytest.approx(math.fsum(stepwise(cm, shape, 4000)), rel=1e-9)


def test_run_from_the_floor_onto_the_bandwidth_line():
    """Decode attention starts on its time floor at short context and crosses onto the
    bandwidth line as contexts grow: the closed form covers both pieces."""
    cm = SETUPS["floor-crossing"]
    shape = decode(2, 8)
    first = cm.breakdown(shape)["attn_decode"].bound
    last = cm.breakdown(dataclasses.replace(shape, decode_context_sum=2 * 6000))["attn_decode"].bound
    assert (first, last) == ("floor", "memory")
    total, _ = cm.decode_run_duration(shape, 6000)
    assert total == pytest.approx(math.fsum(stepwise(cm, shape, 6000)), rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(a=st.floats(0, 1), b=st.floats(0, 1e-2), c=st.floats(0, 1), d=st.floats(0, 1e-2),
       fixed=st.floats(0, 1), k=st.integers(0, 300))
def test_run_total_matches_brute_force_for_any_lines(a, b, c, d, fixed, k):
    brute = math.fsum(fixed + max(a + b * j, c + d * j) for j in range(k))
    assert CostModel._run_total(fixed, a, b, c, d, k) == pytest.approx(brute, rel=1e-9, abs=1e-12)


@settings(max_examples=150, deadline=None)
@given(setup=st.sampled_from(sorted(SETUPS)), shape=shapes(), frac=st.floats(0, 1.5),
       horizon=st.integers(1, 2000))
def test_steps_within_budget_is_the_largest_fitting_run(setup, shape, frac, horizon):
    cm = SETUPS[setup]
    if cm.step_time(shape) <= 0:
        return  # an empty shape in a zero-overhead setup: covered by the error test below
    budget = frac * cm.decode_run_duration(shape, horizon)[0]
    k = cm.decode_run_steps_within(shape, budget)
    assert cm.decode_run_duration(shape, k)[0] <= budget < cm.decode_run_duration(shape, k + 1)[0]
    capped = cm.decode_run_steps_within(shape, budget, max_steps=horizon // 2)
    assert capped == min(k, horizon // 2)


@settings(max_examples=150, deadline=None)
@given(setup=st.sampled_from(sorted(SETUPS)), shape=shapes(), frac=st.floats(0.001, 1.5),
       horizon=st.integers(1, 2000), cap=st.integers(0, 2500))
def test_run_until_takes_every_step_that_starts_before_the_budget(setup, shape, frac, horizon, cap):
    cm = SETUPS[setup]
    if cm.step_time(shape) <= 0:
        return
    budget = frac * cm.decode_run_duration(shape, horizon)[0]
    k, total = cm.decode_run_until(shape, cap, budget)
    assert total == cm.decode_run_duration(shape, k)[0]
    assert k <= cap
    if k:   # its last step starts before the budget ...
        assert cm.decode_run_duration(shape, k - 1)[0] < budget
    if k < cap:   # ... and the next one would not
        assert total >= budget


def test_run_until_edges(llama7b_a100):
    shape = decode(16, 1000)
    first = llama7b_a100.step_time(shape)
    assert llama7b_a100.decode_run_until(shape, 10, first * 0.5) == (1, first)  # under way
    k, total = llama7b_a100.decode_run_until(shape, 10, first)  # the second starts at the budget
    assert (k, total) == (1, first)
    assert llama7b_a100.decode_run_until(shape, 0, first)[0] == 0
    with pytest.raises(ValueError, match="budget_s must be > 0"):
        llama7b_a100.decode_run_until(shape, 5, 0.0)
    with pytest.raises(ValueError, match="max_steps must be an integer >= 0"):
        llama7b_a100.decode_run_until(shape, -1, 1.0)


def test_steps_within_edges(llama7b_a100):
    shape = decode(16, 1000)
    first = llama7b_a100.step_time(shape)
    assert llama7b_a100.decode_run_steps_within(shape, 0.0) == 0
    assert llama7b_a100.decode_run_steps_within(shape, first * 0.999) == 0
    assert llama7b_a100.decode_run_steps_within(shape, first) == 1
    with pytest.raises(ValueError, match="budget_s must be >= 0"):
        llama7b_a100.decode_run_steps_within(shape, -1.0)
    with pytest.raises(ValueError, match="num_steps must be an integer >= 0"):
        llama7b_a100.decode_run_duration(shape, -1)
    with pytest.raises(ValueError, match="pass max_steps"):
        SETUPS["bare-zero-overhead"].decode_run_steps_within(BatchShape(), 1.0)
    assert SETUPS["bare-zero-overhead"].decode_run_steps_within(BatchShape(), 1.0, max_steps=7) == 7


def _cumsum(values):
    total = 0.0
    for v in values:
        total += v
        yield total


# --- calibration profiles ----------------------------------------------------------------------

def make_profile(**overrides) -> CalibrationProfile:
    base = dict(device="h100-sxm", model="llama-3.1-8b", tp=1, kernels=resolve("h100-sxm").kernels,
                scales={"gemm": 1.1, "attn_decode": 0.9}, step_overhead_s=2.5e-3,
                source={"engine": "vllm 0.6.3", "software.torch": "2.4.0"},
                fit_stats={"samples": 500.0, "median_rel_error": 0.03}, notes="test")
    return CalibrationProfile(**{**base, **overrides})


def test_profile_round_trips_and_drives_the_model(tmp_path):
    profile = make_profile()
    path = profile.save(tmp_path / "h100.json")
    assert CalibrationProfile.load(path) == profile
    cm = CostModel.from_calibration(path)
    assert (cm.gpu.name, cm.model.name, cm.step_overhead_s) == ("h100-sxm", "llama-3.1-8b", 2.5e-3)
    assert cm.scales["gemm"] == 1.1 and cm.scales["elementwise"] == 1.0
    default = CostModel("llama-3.1-8b", "h100-sxm")
    assert default.with_calibration(profile).step_time(decode(8, 500)) == cm.step_time(decode(8, 500))
    with pytest.raises(ValueError, match="profile is for device 'h100-sxm', not 'a100-80gb'"):
        CostModel("llama-3.1-8b", "a100-80gb").with_calibration(profile)
    with pytest.raises(ValueError, match="describes a GPU, not a setup"):
        CostModel.from_calibration(packaged("h100-sxm"))


def test_scales_multiply_their_class():
    base = CostModel("llama-3.1-8b", "h100-sxm")
    scaled = base.with_calibration(base.profile.with_fit({"attn_decode": 3.0}, 0.0, {}))
    shape = decode(16, 2048)
    a, b = base.breakdown(shape), scaled.breakdown(shape)
    assert b["attn_decode"].time_s == pytest.approx(3 * a["attn_decode"].time_s)
    assert b["qkv_proj"].time_s == a["qkv_proj"].time_s


def test_gpu_overrides_replace_catalog_peaks():
    probed = bare_roofline("cpu")
    fast = CostModel("tiny-llama", "cpu", calibration=dataclasses.replace(
        probed, gpu_overrides={"hbm_bandwidth_gbps": 100.0}))
    slow = CostModel("tiny-llama", "cpu", calibration=probed)
    assert fast.gpu.hbm_bandwidth_gbps == 100.0
    shape = decode(4, 100)   # memory-bound throughout: twice the bandwidth, half the time
    assert slow.step_time(shape) == pytest.approx(2 * fast.step_time(shape), rel=1e-9)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(format="other/2"), "field 'format' must be"),
    (lambda d: d.update(format="servelab.calibration/1"), "is retired; refit"),
    (lambda d: d.pop("device"), "missing field 'device'"),
    (lambda d: d["kernels"]["gemm"].update(memory_eff=1.5), "kernels.gemm.*memory_eff must be a fraction"),
    (lambda d: d["kernels"]["gemm"].update(flux=0.5), "kernels.gemm: unknown field.*flux"),
    (lambda d: d["kernels"]["gemm"].pop("floor_s"), "kernels.gemm: missing field.*floor_s"),
    (lambda d: d["kernels"].update(tpu={}), "unknown kernel family.*tpu"),
    (lambda d: d.update(tp=0), "field 'tp' must be an integer >= 1"),
    (lambda d: d.update(kv_dtype="int8"), "field 'kv_dtype' must be one of"),
    (lambda d: d.update(step_overhead_s=-1), "field 'step_overhead_s'"),
    (lambda d: d.update(scales={"gemm": 0}), "scales': gemm must be a finite number > 0"),
    (lambda d: d.update(scales={"tensor": 1}), "unknown op class.*tensor"),
    (lambda d: d.update(source={"engine": 6}), "field 'source' must map names to strings"),
    (lambda d: d.update(extra=1), "unknown field.*extra"),
])
def test_bad_profiles_name_the_file_and_field(tmp_path, edit, message):
    data = make_profile().to_dict()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"{path}.*{message}"):
        CalibrationProfile.load(path)


def test_unreadable_profiles(tmp_path):
    with pytest.raises(ValueError, match="cannot read calibration profile"):
        CalibrationProfile.load(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="broken.json: not valid JSON"):
        CalibrationProfile.load(tmp_path / "broken.json")
    assert make_profile().to_dict()["format"] == FORMAT
    with pytest.raises(ValueError, match="no packaged calibration profile 'v100'"):
        packaged("v100")


def test_decode_per_item_costs_grow_with_head_dim_by_their_share():
    """Short-context decode is per-item work (query in, output out, partial results merged),
    head_dim wide: `item_dim_share` of it scales with head_dim/128, none of it at share 0."""
    gpu = get_gpu("h100-sxm")
    p = K.DecodeAttentionParams(floor_s=5e-6, work_item_s=2e-8, q_head_s=4e-10, memory_eff=0.9)

    def short(params, head_dim):
        return float(K.decode_attention_time(128, 128, 40, 8, head_dim, gpu, params))

    items = 128 * (8 * p.work_item_s + 40 * p.q_head_s)
    assert short(p, 64) == short(p, 128) == short(p, 256)    # one token each: the floor
    full = dataclasses.replace(p, item_dim_share=1.0)
    assert short(full, 128) == pytest.approx(short(p, 128), rel=1e-12)  # given at head_dim 128
    assert short(full, 64) == pytest.approx(short(p, 64) - items / 2, rel=1e-9)
    half = dataclasses.replace(p, item_dim_share=0.5)
    assert short(half, 256) == pytest.approx(short(p, 256) + items / 2, rel=1e-9)
