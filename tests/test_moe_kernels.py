"""The forms added to the fused-MoE, MLA and all-to-all kernel models (docs/moe-mla.md):
no expert gets more than one pair per token, the generator's round-robin top-up, weight
passes per group of tiles, L2-resident expert weights in replayed benchmarks, the eager
launch floor of the MLA tables, and NCCL's three protocol lines.

Shapes are real models' (../shared/REFERENCE.md): DeepSeek-V3's experts (7168 x 2048, 256
experts, top-8) and Mixtral's (4096 x 14336, 8 experts, top-2).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from servelab.simulator import kernels as K
from servelab.simulator.calibration import packaged
from servelab.simulator.gpus import get_gpu
from servelab.simulator.kernels import moe as M
from servelab.simulator.kernels.mla import runs_triton_mla
from servelab.validation.kernel_families import _protocols_in_order

H100, A100, L40S = get_gpu("h100-sxm"), get_gpu("a100-80gb"), get_gpu("l40s")
TOP_UPS = (M.LARGEST_FIRST, M.SMALLEST_FIRST, M.ROUND_ROBIN)


# --- expert load ------------------------------------------------------------------------------


@pytest.mark.parametrize("top_up", TOP_UPS)
def test_no_expert_gets_more_than_one_pair_per_token(top_up):
    """Mixtral at EP 8 holds one expert per GPU: the power law's heaviest expert would get
    more pairs than there are tokens, which top-2 routing cannot do."""
    tokens = np.array([64, 1024, 16384, 65536])
    active, pairs, *_ = K.expert_load(tokens, 8, 2, ep=8, load="power-law:1.01", top_up=top_up)
    assert (active == 1).all()
    assert (pairs <= tokens).all() and (pairs > 0.4 * tokens).all(), pairs
    two = K.expert_load(tokens, 8, 2, ep=4, load="power-law:1.01", top_up=top_up)[1]
    assert (two <= 2 * tokens).all()


@pytest.mark.parametrize("top_up", TOP_UPS)
@pytest.mark.parametrize("ep", [1, 8, 32])
def test_touched_experts_are_bounded_by_the_gpus_experts_and_its_pairs(top_up, ep):
    tokens = np.array([1, 2, 4, 16, 128, 4096])
    active, pairs, *tiles = K.expert_load(tokens, 256, 8, ep=ep, load="power-law:1.2",
                                          top_up=top_up)
    assert (active <= 256 // ep + 1e-9).all() and (active <= pairs + 1e-9).all()
    assert (pairs <= tokens * 8 + 1e-9).all()
    for rows, count in zip(M.TILE_ROWS, tiles):         # taller blocks, fewer of them
        assert (count >= active - 1e-9).all() and (count <= np.maximum(pairs, active) + 1e-9).all()
    assert all((a >= b - 1e-9).all() for a, b in zip(tiles, tiles[1:]))


def test_the_round_robin_top_up_keeps_every_pair_and_spreads_small_batches_over_ranks():
    """The helper as written now deals the rounding deficit to the EP ranks in turn: one
    token's 8 pairs over 16 ranks leave rank 0 (the busiest, all tied) one expert, where the
    first helper's largest-first top-up put about two there."""
    rng = np.random.default_rng(3)
    counts = np.rint(rng.random((M.LOAD_SAMPLES, 256)) * 3)
    for target in (100, int(counts.sum(axis=1).min()), 2000):
        dealt = M._round_robin_counts(counts, 16, target, 8)
        assert (dealt.sum(axis=1) == target).all()
        assert dealt.max() <= 16 and dealt.min() >= 0
    rr = K.expert_load(1, 256, 8, ep=16, load="power-law:1.2", top_up=M.ROUND_ROBIN)
    largest = K.expert_load(1, 256, 8, ep=16, load="power-law:1.2")
    assert rr[0] == pytest.approx(1.0) and largest[0] > 1.5


def test_serving_load_is_unchanged_by_the_top_up_at_large_batches():
    a = K.expert_load(8192, 256, 8, ep=8, load="power-law:1.2")
    b = K.expert_load(8192, 256, 8, ep=8, load="power-law:1.2", top_up=M.ROUND_ROBIN)
    assert a[1] == pytest.approx(b[1], rel=0.01)
    with pytest.raises(ValueError, match="top_up must be"):
        K.expert_load(8, 256, 8, top_up="random")


# --- weight passes and L2 -------------------------------------------------------------------


def _time(tokens, p, gpu=H100, ep=8, warm_l2=False, load="balanced"):
    stats = K.expert_load(tokens, 256, 8, ep, load)
    return K.fused_moe_time(tokens, 7168, 2048, 256, 8, ep, stats, gpu, p, "bf16", warm_l2)


def test_small_tiles_stream_each_experts_weights_once_per_tile():
    """vLLM's small-batch config (tokens <= the GPU's experts) runs an expert's 16-row
    tiles one after another: 32 touched experts with 40 pairs each fill three tiles apiece
    and read their weights three times; with 8 pairs each (one tile) once, as a pass per
    touched expert would say."""
    once = replace(K.MoEParams(), small_tile_rows=16.0, large_tile_rows=64.0)
    per_tile = replace(once, small_stream_rows=16.0, large_stream_rows=512.0)

    def time(per_expert: int, p) -> float:
        stats = np.array([32.0, 32.0 * per_expert]
                         + [32.0 * np.ceil(per_expert / r) for r in M.TILE_ROWS])
        return float(K.fused_moe_time(160, 7168, 2048, 256, 8, 1, stats, H100, p))

    assert time(8, per_tile) == pytest.approx(time(8, once))
    assert time(40, per_tile) == pytest.approx(3 * time(40, once), rel=0.05)
    big = np.array([32.0, 32.0 * 600] + [32.0 * np.ceil(600 / r) for r in M.TILE_ROWS])
    large = [float(K.fused_moe_time(4096, 7168, 2048, 256, 8, 8, big, H100, q))
             for q in (once, per_tile)]
    assert large[1] >= large[0]                           # 600 pairs: two 512-row passes


def test_more_tokens_never_take_less_time_with_the_new_terms():
    p = packaged("h100-sxm").kernels.moe
    tokens = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384])
    for load in ("balanced", "power-law:1.2"):
        for ep in (1, 8):
            t = _time(tokens, p, ep=ep, load=load)
            assert (np.diff(t) >= -1e-12).all(), (load, ep, t)


def test_warm_l2_serves_replayed_weights_that_fit_and_never_costs_more():
    """L40S (96 MB of L2) replaying one DeepSeek-V3 expert of 88 MB reads it from L2; a
    forward pass (the simulator) reads every layer's weights from HBM."""
    p = replace(K.MoEParams(), small_tile_rows=16.0, large_tile_rows=64.0, l2_fraction=2.0,
                l2_gain=4.0)
    cold, warm = (float(_time(1, p, L40S, ep=256 // 8, warm_l2=w)) for w in (False, True))
    assert warm < 0.3 * cold
    tokens = np.array([1, 64, 4096])
    assert (_time(tokens, p, H100, warm_l2=True) <= _time(tokens, p, H100) + 1e-15).all()
    assert (_time(tokens, K.MoEParams(), warm_l2=True) == _time(tokens, K.MoEParams())).all()


def test_profiles_from_before_the_new_fields_read_as_before():
    """A profile file without the added fields prices as the model did before them."""
    p = packaged("h100-sxm").kernels.moe
    data = {k: v for k, v in p.to_dict().items() if k not in K.MoEParams._added}
    old = K.MoEParams.from_dict(data, "test")
    assert old.small_stream_rows == 0 and old.l2_fraction == 0
    assert old.tuned_compute_eff == 0 and old.width_knee == 0 and old.expert_s == 0
    with pytest.raises(ValueError, match="small_stream_rows must be 0 or one of"):
        replace(K.MoEParams(), small_stream_rows=20.0)


# --- tuned kernel configs and wide experts ----------------------------------------------------


def test_vllm_tuned_configs_are_looked_up_per_gpu_dtype_and_layer_shape():
    """Mixtral 8x7B at TP 2 (8 experts of width 7,168 per GPU) has an H100 config; at TP 1
    (14,336) it has none in BF16 but one in FP8; the B200 has none; EP divides the experts."""
    assert M.vllm_tuned("h100-sxm", "bf16", 8, 1, 7168)
    assert not M.vllm_tuned("h100-sxm", "bf16", 8, 1, 14336)
    assert M.vllm_tuned("h100-sxm", "fp8", 8, 1, 14336)
    assert not M.vllm_tuned("b200", "bf16", 8, 1, 7168)
    assert M.vllm_tuned("a100-80gb", "bf16", 8, 8, 14336)          # one expert per GPU
    rows = M.vllm_tuned("a100-80gb", "bf16", np.array([8, 8, 256]), np.array([1, 2, 32]),
                        np.array([3584.0, 3584.0, 2048.0]))
    assert rows.tolist() == [True, False, True]


def test_tuned_layers_take_their_own_compute_efficiency_at_large_batches():
    p = replace(K.MoEParams(), compute_eff=0.3, small_tile_rows=16.0, large_tile_rows=64.0)
    fast = replace(p, tuned_compute_eff=0.6)
    big = 65536                                           # compute-bound: time ~ 1 / efficiency
    tuned = [K.moe_experts_time(big, 4096, 14336, 8, 2, H100, q, tp=2) for q in (p, fast)]
    assert tuned[1] == pytest.approx(tuned[0] / 2, rel=0.02)
    untuned = [K.moe_experts_time(big, 4096, 14336, 8, 2, H100, q) for q in (p, fast)]
    assert untuned[0] == untuned[1]
    on_b200 = [K.moe_experts_time(big, 4096, 14336, 8, 2, get_gpu("b200"), q, tp=2)
               for q in (p, fast)]
    assert on_b200[0] == on_b200[1]
    with pytest.raises(ValueError, match="tuned_compute_eff must be 0"):
        replace(p, tuned_compute_eff=1.5)


def test_wide_untuned_experts_lose_compute_efficiency_by_the_knee():
    p = replace(K.MoEParams(), compute_eff=0.5, small_tile_rows=16.0, large_tile_rows=64.0)
    knee = replace(p, width_knee=14336.0)
    plain, slow = (K.moe_experts_time(65536, 4096, 14336, 8, 2, get_gpu("b200"), q)
                   for q in (p, knee))
    assert slow == pytest.approx(2 * plain, rel=0.02)     # width = knee: half the rate
    half = K.moe_experts_time(65536, 4096, 14336, 8, 2, get_gpu("b200"), knee, tp=2)
    assert half == pytest.approx(1.5 * K.moe_experts_time(65536, 4096, 14336, 8, 2,
                                                          get_gpu("b200"), p, tp=2), rel=0.02)
    tuned = replace(knee, tuned_compute_eff=0.5)          # a tuned layer keeps its own rate
    assert K.moe_experts_time(65536, 4096, 14336, 8, 2, H100, tuned, tp=2) == pytest.approx(
        K.moe_experts_time(65536, 4096, 14336, 8, 2, H100, p, tp=2))


def test_each_pass_over_an_experts_weights_costs_expert_s_on_the_memory_side():
    """Weight-bound (one token per expert, memory added to compute): the time rises by
    expert_s per expert touched; DeepSeek-V3's 256 experts, 64 tokens top-8, no EP."""
    p = replace(K.MoEParams(), overlap=1.0, small_tile_rows=16.0, large_tile_rows=16.0)
    per = replace(p, expert_s=2e-6)
    active = M.expert_load(np.array([64.0]), 256, 8)[0][0]
    plain, slow = (K.moe_experts_time(64, 7168, 2048, 256, 8, H100, q) for q in (p, per))
    assert slow - plain == pytest.approx(active * 2e-6, rel=1e-6)
    assert K.moe_experts_time(0, 7168, 2048, 256, 8, H100, per) == 0


def test_packaged_h100_vllm024_fp8_experts_follow_the_block_scaled_rows_and_beat_bf16():
    """vLLM 0.24's block-FP8 fused MoE on H100 (Triton; aiconfigurator's table, 128 experts
    of 4,096 x 1,536, 16 tokens top-8, balanced): 0.850, 0.443 and 0.248 ms at TP 1, 2 and 4
    (the per-tensor ModelOpt rows on FlashInfer's CUTLASS kernel: 4.09, 2.19, 1.26 ms; BF16:
    1.58, 0.81, 0.44 ms). The moe_fp8 fit follows the block rows, which the catalog's FP8
    checkpoints run, so FP8 weights cost less than BF16 ones, as they read half the bytes."""
    kernels = packaged("h100-sxm.vllm-0.24").kernels
    for tp, measured in ((1, 0.850e-3), (2, 0.443e-3), (4, 0.248e-3)):
        fp8 = float(K.moe_experts_time(16, 4096, 1536, 128, 8, H100, kernels.moe_fp8, tp=tp, dtype="fp8"))
        bf16 = float(K.moe_experts_time(16, 4096, 1536, 128, 8, H100, kernels.moe, tp=tp))
        assert fp8 == pytest.approx(measured, rel=0.06), tp
        assert fp8 < 0.7 * bf16, tp


def test_the_fit_gives_tuned_layers_their_own_rate_only_where_vllm_has_tuned_configs():
    """The Triton path fits tuned_compute_eff on A100, H100 and L40S (BF16) and pins it at
    0 (no tuned configs) elsewhere; the grouped-GEMM libraries never read vLLM's configs."""
    from servelab.validation.kernel_families import FAMILIES
    assert "tuned_compute_eff" not in FAMILIES["moe"].fixed(L40S)
    assert FAMILIES["moe_fp8"].fixed(L40S)["tuned_compute_eff"] == 0.0
    assert M.vllm_tuned("l40s", "bf16", 8, 1, 3584) and not M.vllm_tuned("l40s", "bf16", 8, 1, 14336)
    for family in ("moe", "moe_fp8"):
        fam = FAMILIES[family]
        for name in ("b200", "rtx-pro-6000"):
            assert fam.fixed(get_gpu(name))["tuned_compute_eff"] == 0.0, (family, name)
        assert "tuned_compute_eff" not in fam.fixed(H100), family
        for other in fam.alternatives(H100):
            assert other["tuned_compute_eff"] == 0.0
    assert "tuned_compute_eff" not in FAMILIES["moe"].fixed(A100)
    assert FAMILIES["moe_fp8"].fixed(A100)["tuned_compute_eff"] == 0.0   # weight-only FP8
    assert M.vllm_tuned("b200", "bf16", np.array([8, 8]), 1, 7168.0).tolist() == [False, False]


def test_a_layers_efficiency_is_the_tuned_rate_or_the_width_lowered_one():
    """What the step time and the cost breakdown both divide by (`layer_compute_eff`), on
    the packaged H100 profile: Mixtral at TP 2 (tuned) and TP 1 (untuned)."""
    p = packaged("h100-sxm").kernels.moe
    tuned = M.layer_compute_eff(p, H100, "bf16", 8, 1, 7168)
    untuned = M.layer_compute_eff(p, H100, "bf16", 8, 1, 14336)
    assert tuned == pytest.approx(p.tuned_compute_eff)
    assert untuned == pytest.approx(p.compute_eff / (1 + 14336 / p.width_knee))


def test_weight_only_fp8_takes_the_bf16_kernels_tuned_configs_and_is_never_slower():
    """On the A100 FP8 weights run weight-only with BF16 maths (docs/moe-mla.md): the tuned
    configs and efficiencies are the BF16 kernel's, so half the weight bytes never cost
    more than BF16 (Mixtral at TP 2, tuned for BF16 only: vllm_tuned has no A100 FP8 file)."""
    p = packaged("a100-80gb").kernels
    assert M.kernel_dtype("fp8", A100) == "bf16" and M.kernel_dtype("fp8", H100) == "fp8"
    assert M.layer_compute_eff(p.moe, A100, "fp8", 8, 1, 7168) == pytest.approx(p.moe.tuned_compute_eff)
    tokens = np.array([1, 8, 32, 256, 2048, 8192])
    bf16, fp8 = (K.moe_experts_time(tokens, 4096, 14336, 8, 2, A100, p.moe_for(d, A100), 1, 2, d)
                 for d in ("bf16", "fp8"))
    assert np.all(fp8 <= bf16 * (1 + 1e-9)), (bf16, fp8)
    assert fp8[0] < 0.7 * bf16[0]     # memory-bound: half the weight bytes


def test_the_shape_error_script_prints_the_held_out_rows_per_shape(monkeypatch, capsys):
    """scripts/moe_shape_errors.py (docs/moe-mla.md reads the per-shape misses from it): one
    line per (shape, tokens band) with its held-out rows, median and MAPE."""
    import runpy
    from pathlib import Path
    from _gpu_tables import real_measurements
    script = Path(__file__).resolve().parents[1] / "scripts" / "moe_shape_errors.py"
    tables = real_measurements() / "aiconfigurator-vllm-0.14.0" / "a100_sxm"   # the smallest
    monkeypatch.setattr("sys.argv", [str(script), "a100-80gb", "--measurements", str(tables)])
    runpy.run_path(str(script), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("a100-80gb moe: held-out rows")
    rows = [line.split() for line in lines[2:]]
    assert len(rows) > 20
    qwen = [r for r in rows if " ".join(r[:4]) == "(2048, 768, 128, 8)"]
    assert qwen and all(int(r[-3]) > 0 and abs(float(r[-2])) < 100 for r in qwen)


def test_packaged_a100_prices_tuned_mixtral_layers_faster_per_flop():
    """Measured on A100 (vLLM 0.14): 8 experts of width 7,168 per GPU (tuned) run at about
    twice the compute rate of width 14,336 (untuned) at 16k tokens (docs/moe-mla.md)."""
    p = packaged("a100-80gb").kernels.moe
    assert p.tuned_compute_eff > 1.3 * p.compute_eff
    tp1 = K.moe_experts_time(16384, 4096, 14336, 8, 2, A100, p)
    tp2 = K.moe_experts_time(16384, 4096, 14336, 8, 2, A100, p, tp=2)
    assert tp2 < 0.4 * tp1


# --- MLA: the eager launch floor ---------------------------------------------------------------


def test_mla_eager_timing_is_the_larger_of_launch_and_gpu_time():
    p = replace(K.MLADecodeParams(), floor_s=2e-5, memory_eff=0.5, eager_floor_s=3e-4)
    contexts = np.array([16, 1024, 65536, 1 << 20])
    gpu = K.mla_decode_time(1, contexts, 16, A100, p)
    eager = K.mla_decode_time(1, contexts, 16, A100, p, eager=True)
    assert np.allclose(eager, np.maximum(gpu, 3e-4))
    assert eager[0] == pytest.approx(3e-4) and eager[-1] == pytest.approx(gpu[-1])
    assert float(K.mla_decode_time(0, 0, 16, A100, p, eager=True)) == 0.0
    # the simulator's closed form stays a line in the context sum
    intercept, slope, c, d = K.mla_decode_lines(np.array([4.0]), 16, A100, p)
    assert (float(c[0]), float(d[0])) == (float(intercept[0]), float(slope[0]))   # no re-reads
    assert float(K.mla_decode_time(4, 1000, 16, A100, p)) == pytest.approx(
        float(intercept[0] + 1000 * slope[0]))
    pre = replace(K.MLAPrefillParams(), floor_s=2e-5, eager_floor_s=3e-4, overlap=4.0)
    small = K.mla_prefill_time(1, 16, 16, A100, pre, eager=True)
    assert float(small) >= 3e-4 > float(K.mla_prefill_time(1, 16, 16, A100, pre))


def test_packaged_mla_floors_are_gpu_floors_under_the_eager_ones():
    for name in ("a100-80gb", "h100-sxm", "l40s"):
        k = packaged(name).kernels
        for p in (k.mla_prefill, k.mla_decode):
            assert p.eager_floor_s > 1e-4 and p.floor_s < p.eager_floor_s, (name, p)


def test_mla_decode_with_one_head_takes_its_own_rate():
    p = replace(K.MLADecodeParams(), seq_stream_gbps=50.0, one_head_stream_gbps=10.0)
    one, two = (float(K.mla_decode_time(1, 65536, h, A100, p)) for h in (1, 2))
    assert one == pytest.approx(5 * two, rel=0.05)


def test_mla_decode_blocks_of_heads_reread_the_latents_l2_does_not_hold():
    """The Triton decode kernel reads the latents once per block of 16 heads: many sequences
    whose latents L2 cannot hold pay a read per block; a context L2 holds, or a batch small
    enough that the blocks' programs run alongside, reads them about once."""
    p = replace(K.MLADecodeParams(), compute_eff=1.0, memory_eff=0.8, head_block=16.0,
                kv_splits=4.0, reread_l2_fraction=0.5, reread_seqs=64.0)
    once = replace(p, head_block=0.0)            # one read for every head (FlashMLA)
    read = 1152 / (L40S.hbm_bandwidth_gbps * 1e9 * 0.8)   # seconds per cached token
    held = 4 * 0.5 * L40S.l2_bytes / 1152        # tokens whose re-reads L2 serves

    def extra(batch, context, heads):
        """Seconds the re-reads add."""
        return float(K.mla_decode_time(batch, batch * context, heads, L40S, p)
                     - K.mla_decode_time(batch, batch * context, heads, L40S, once))
    c = 1024 * 32768                             # 33.5M latents: far past L2
    assert extra(1024, 32768, 128) == pytest.approx(7 * read * (c - held), rel=0.01)
    assert extra(1024, 32768, 32) == pytest.approx(1 * read * (c - held), rel=0.01)
    assert extra(1024, 32768, 16) == 0.0         # one block
    assert extra(1024, int(0.5 * held / 1024), 128) == 0.0   # L2 holds them
    assert 0 < extra(1024, 2 * int(held / 1024), 128) < 7 * read * held * 1.01
    assert extra(4, 8 * 1024 * 1024, 128) < 0.01 * 7 * read * 4 * 8 * 1024 * 1024   # 4 sequences
    assert extra(1024, 32768, 24) == pytest.approx(1 * read * (c - held), rel=0.01)   # 2 blocks
    # the reads the second line carries, whichever line sets the time
    again = 7 / (1 + (64 / 1024) ** 4)          # 1,024 sequences: the blocks barely overlap
    assert float(K.mla.mla_latent_reads(1024, c, 128, L40S, p)) == pytest.approx(
        1 + again * (1 - held / c), rel=1e-12)
    assert float(K.mla.mla_latent_reads(1024, c, 128, L40S, once)) == 1.0
    # FP8 latents: half the bytes, twice the tokens L2 holds
    fp8 = float(K.mla_decode_time(1024, c, 128, L40S, p, kv_bytes=1.0)
                - K.mla_decode_time(1024, c, 128, L40S, once, kv_bytes=1.0))
    assert fp8 == pytest.approx(7 * read / 2 * (c - 2 * held), rel=0.01)
    # a GPU file without an L2 size: every re-read from HBM
    no_l2 = replace(L40S, l2_mb=None)
    assert float(K.mla.mla_latent_reads(1024, 1024, 128, no_l2, p)) == pytest.approx(8.0, rel=0.01)


def test_triton_mla_runs_where_no_flashmla_kernel_does():
    """vLLM's MLA decode kernel by compute capability: FlashMLA / CUTLASS on 9.x and 10.x,
    Triton on Ampere, Ada and sm_120; a GPU file without one is judged by architecture."""
    triton = {g: runs_triton_mla(get_gpu(g)) for g in
              ("a100-80gb", "l40s", "rtx-pro-6000", "h100-sxm", "h200", "b200", "b300")}
    assert triton == {"a100-80gb": True, "l40s": True, "rtx-pro-6000": True, "h100-sxm": False,
                      "h200": False, "b200": False, "b300": False}
    assert runs_triton_mla(replace(A100, compute_capability=""))
    assert not runs_triton_mla(replace(H100, compute_capability=""))


def test_mla_decode_split_results_pass_through_l2_when_they_fit():
    """Stage 1 writes each (sequence, head, split)'s FP32 result, stage 2 reads it back: a
    batch whose results L2 holds pays a fraction of the per-(sequence, head) cost."""
    p = replace(K.MLADecodeParams(), seq_head_s=40e-9, kv_splits=4.0)
    cached = replace(p, partials_l2_fraction=1.0, partials_l2_gain=10.0)
    per_pair = 4 * 513 * 4                                   # bytes of one's results

    def cost(params, batch, heads=128):                      # the context adds nothing here
        return float(K.mla_decode_time(batch, batch, heads, L40S, params))
    small = max(1, int(0.05 * L40S.l2_bytes / per_pair / 128))   # results: 5% of L2
    assert cost(p, small) - cost(cached, small) == pytest.approx(
        small * 128 * 40e-9 * 0.9, rel=0.05)                  # nearly all hit, 10x cheaper
    large = int(100 * L40S.l2_bytes / per_pair / 128)            # 100x L2: from HBM
    assert cost(cached, large) == pytest.approx(cost(p, large), rel=0.01)


# --- all-to-all: the least of three protocol lines -------------------------------------------


def test_alltoall_takes_the_fastest_protocol_and_is_concave_in_size():
    lines = ((8e-6, 0.1), (1.5e-5, 0.4), (3e-5, 0.9))
    p = replace(K.AllToAllParams(), hop_s=5e-7, copy_gbps=1500.0, latency_s=lines[0][0],
                link_eff=lines[0][1], ll128_latency_s=lines[1][0], ll128_link_eff=lines[1][1],
                simple_latency_s=lines[2][0], simple_link_eff=lines[2][1])
    sizes = 2.0 ** np.arange(10, 30)
    t = K.alltoall_time(sizes, 8, H100, p)
    alone = [K.alltoall_time(sizes, 8, H100, replace(p, latency_s=lat, link_eff=eff,
                                                     ll128_link_eff=0.0, simple_link_eff=0.0))
             for lat, eff in lines]
    assert np.allclose(t, np.minimum.reduce(alone))
    assert (np.diff(t) > 0).all()
    assert (np.diff(t / sizes) <= 1e-18).all()               # the cost per byte never rises
    assert float(K.alltoall_time(1 << 20, 1, H100, p)) == 0.0


def test_alltoall_without_protocols_prices_as_before():
    p = K.AllToAllParams(latency_s=1e-5, hop_s=1e-6, link_eff=0.6, fabric_gbps=16.0)
    n, size = 8, 4 << 20
    moved = size * (n - 1) / n
    before = 1e-5 + 7e-6 + max(moved / (L40S.interconnect_gbps * 1e9 * 0.6), n * moved / 16e9)
    assert float(K.alltoall_time(size, n, L40S, p)) == pytest.approx(before)


def test_fitted_protocol_lines_are_named_by_bandwidth():
    p = replace(K.AllToAllParams(), latency_s=2e-5, link_eff=0.9, ll128_latency_s=5e-6,
                ll128_link_eff=0.05, simple_latency_s=1e-5, simple_link_eff=0.4)
    q = _protocols_in_order(p)
    assert (q.link_eff, q.ll128_link_eff, q.simple_link_eff) == (0.05, 0.4, 0.9)
    assert (q.latency_s, q.ll128_latency_s, q.simple_latency_s) == (5e-6, 1e-5, 2e-5)
    sizes = 2.0 ** np.arange(10, 30)
    assert np.array_equal(K.alltoall_time(sizes, 4, H100, p), K.alltoall_time(sizes, 4, H100, q))


def test_the_fp8_family_takes_block_scaled_rows_where_a_table_has_them():
    """moe_fp8 describes the block-scaled (128 x 128) kernels the catalog's FP8 checkpoints
    run: a table's `fp8_block` rows where it has any, else its per-tensor `fp8` rows."""
    from servelab.validation.kernel_families import FAMILIES
    from servelab.validation.measurements import Table

    select = FAMILIES["moe_fp8"].select
    both = Table("moe", {"dtype": np.array(["bf16", "fp8", "fp8_block", "fp8"], dtype=object)},
                 ["r1", "r2", "r3", "r4"])
    per_tensor = both.select(np.array([True, True, False, True]))
    assert select(both).tolist() == [False, False, True, False]
    assert select(per_tensor).tolist() == [False, True, True]
    assert FAMILIES["moe"].select(both).tolist() == [True, False, False, False]


def test_flashinfer_cutlass_rows_are_their_own_family_only_beside_another_kernel():
    """A table that measured FlashInfer's CUTLASS BF16 kernel beside another (vLLM 0.24 on
    B200: TRT-LLM's) gives those rows to `moe_cutlass` and the rest to `moe`; a table with
    one BF16 kernel gives `moe` every BF16 row, whichever it is, and `moe_cutlass` none."""
    from servelab.validation.kernel_families import FAMILIES
    from servelab.validation.measurements import Table

    trt, cut = "vllm_x_flashinfer_trtllm_bf16", "vllm_x_flashinfer_cutlass_flashinferexperts"
    both = Table("moe", {"dtype": np.array(["bf16", "bf16", "fp8", "bf16"], dtype=object),
                         "kernel": np.array([trt, cut, cut, trt], dtype=object)},
                 ["r1", "r2", "r3", "r4"])
    assert FAMILIES["moe"].select(both).tolist() == [True, False, False, True]
    assert FAMILIES["moe_cutlass"].select(both).tolist() == [False, True, False, False]
    only = both.select(np.array([False, True, True, False]))
    assert FAMILIES["moe"].select(only).tolist() == [True, False]
    assert FAMILIES["moe_cutlass"].select(only).tolist() == [False, False]


def test_a_routing_the_default_kernel_does_not_take_is_priced_on_the_cutlass_path():
    """B200's profile prices BF16 layers of plain softmax top-k (a Qwen3-MoE config with
    norm_topk_prob false) with its CUTLASS fit, renormalised and DeepSeek-V3 routing with
    the default one; a profile without that path, and FP8, price every layer alike. The
    profile file keeps the section only where it was measured."""
    from servelab.models import load_model_spec
    from servelab.outputs import BatchShape
    from servelab.simulator.cost_model import CostModel

    b200, h100 = packaged("b200.vllm-0.24").kernels, packaged("h100-sxm.vllm-0.24").kernels
    gpu = get_gpu("b200")
    assert b200.moe_cutlass is not None and h100.moe_cutlass is None
    assert b200.moe_for("bf16", gpu, default_routing=False) is b200.moe_cutlass
    assert b200.moe_for("bf16", gpu) is b200.moe
    assert b200.moe_for("fp8", gpu, default_routing=False) is b200.moe_fp8
    assert h100.moe_for("bf16", get_gpu("h100-sxm"), default_routing=False) is h100.moe
    assert "moe_cutlass" not in h100.to_dict() and "moe_cutlass" in b200.to_dict()
    assert K.KernelParams.from_dict(b200.to_dict()) == b200

    qwen = load_model_spec("qwen3-30b-a3b")
    softmax = replace(qwen, moe=replace(qwen.moe, norm_topk_prob=False))
    shape = BatchShape(num_decode_seqs=64, decode_context_sum=64 * 500)
    priced = {}
    for name, model in (("renormalize", qwen), ("softmax", softmax), ("deepseek", "deepseek-v3")):
        cm = CostModel(model, "b200", calibration="b200.vllm-0.24")
        priced[name] = (cm.shapes.experts.default_routing, cm.breakdown(shape)["moe_experts"].time_s)
    assert [priced[n][0] for n in ("renormalize", "softmax", "deepseek")] == [True, False, True]
    x = CostModel(qwen, "b200", calibration="b200.vllm-0.24").shapes.experts
    per_layer = [float(K.fused_moe_time(64, x.hidden, x.width, x.experts, x.topk, 1,
                                        K.expert_load(64, x.experts, x.topk, 1), gpu, p, "bf16"))
                 for p in (b200.moe, b200.moe_cutlass)]
    assert priced["renormalize"][1] == pytest.approx(x.num_layers * per_layer[0], rel=1e-9)
    assert priced["softmax"][1] == pytest.approx(x.num_layers * per_layer[1], rel=1e-9)
    assert abs(per_layer[1] / per_layer[0] - 1) > 0.05


def test_fp8_rows_under_ep_are_their_own_family_where_they_ran_another_kernel():
    """Where a table's FP8 rows with EP above 1 ran one kernel and those without another
    (vLLM 0.24 on H100: FlashInfer's CUTLASS under EP, Triton without), the EP rows are
    `moe_fp8_ep`'s and layouts with EP are priced with it; one kernel throughout (or
    several on either side, as B200's TRT-LLM variants) keeps every row in `moe_fp8`."""
    from servelab.validation.kernel_families import FAMILIES
    from servelab.validation.measurements import Table

    cut, tri, other = "fi_cutlass", "triton", "trtllm_modular"
    split = Table("moe", {"dtype": np.array(["fp8_block"] * 4 + ["bf16"], dtype=object),
                          "ep": np.array([1, 2, 8, 1, 2]),
                          "kernel": np.array([tri, cut, cut, tri, cut], dtype=object)},
                  ["r1", "r2", "r3", "r4", "r5"])
    assert FAMILIES["moe_fp8_ep"].select(split).tolist() == [False, True, True, False, False]
    assert FAMILIES["moe_fp8"].select(split).tolist() == [True, False, False, True, False]
    mixed = Table("moe", {"dtype": np.array(["fp8_block"] * 3, dtype=object),
                          "ep": np.array([1, 2, 2]),
                          "kernel": np.array([tri, cut, other], dtype=object)}, ["a", "b", "c"])
    assert not FAMILIES["moe_fp8_ep"].select(mixed).any()
    assert FAMILIES["moe_fp8"].select(mixed).all()

    h100 = packaged("h100-sxm.vllm-0.24").kernels
    gpu = get_gpu("h100-sxm")
    assert h100.moe_for("fp8", gpu, ep=2) is h100.moe_fp8_ep is not None
    assert h100.moe_for("fp8", gpu) is h100.moe_fp8 and h100.moe_for("bf16", gpu, ep=2) is h100.moe
    b200 = packaged("b200.vllm-0.24").kernels
    assert b200.moe_fp8_ep is None and b200.moe_for("fp8", get_gpu("b200"), ep=8) is b200.moe_fp8
