"""Step prices of mixture-of-experts and MLA models: the fused experts over the step's
tokens, expert parallelism (and its data-parallel token exchange), MLA attention with
1- or 2-byte latents, the flags that choose a layout and the layouts refused before a run,
and whole simulations of MoE models (fast-forward included)."""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from servelab.cli import main
from servelab.models import ModelSpec
from servelab.outputs import BatchShape
from servelab.simulator.cost_model import CostModel
from servelab.simulator.run import SimulationConfig, run_simulation

H100 = "h100-sxm"


def decode(n: int, context: int) -> BatchShape:
    return BatchShape(num_decode_seqs=n, decode_context_sum=n * context)


def prefill(tokens: int, context: int = 0) -> BatchShape:
    return BatchShape(num_prefill_seqs=1, num_prefill_tokens=tokens, prefill_context_sum=context,
                      prefill_q_context_sum=tokens * context, prefill_q_sq_sum=tokens * tokens,
                      prefill_max_keys=tokens + context)


def mixed(chunks: list[tuple[int, int]], contexts: list[int]) -> BatchShape:
    return BatchShape(num_prefill_seqs=len(chunks), num_prefill_tokens=sum(q for q, _ in chunks),
                      prefill_context_sum=sum(c for _, c in chunks),
                      prefill_q_context_sum=sum(q * c for q, c in chunks),
                      prefill_q_sq_sum=sum(q * q for q, _ in chunks),
                      prefill_max_keys=max(q + c for q, c in chunks),
                      num_decode_seqs=len(contexts), decode_context_sum=sum(contexts))


@pytest.fixture(scope="module")
def qwen() -> CostModel:
    return CostModel("qwen3-30b-a3b", H100)


@pytest.fixture(scope="module")
def qwen_ep2() -> CostModel:
    return CostModel("qwen3-30b-a3b", H100, ep=2)


@pytest.fixture(scope="module")
def deepseek() -> CostModel:
    return CostModel("deepseek-v3", "h200", tp=8, weight_dtype="fp8")


# --------------------------------------------------------------------------- the experts


def test_moe_step_time_grows_with_the_tokens(qwen):
    times = [qwen.step_time(prefill(n)) for n in (1, 16, 128, 512, 2048, 8192)]
    assert times == sorted(times) and times[-1] > 4 * times[0]
    per_token_count = [qwen.step_time(decode(n, 1000)) for n in range(1, 300)]
    assert all(b >= a for a, b in zip(per_token_count, per_token_count[1:]))


def test_moe_layers_price_the_routed_experts_at_their_load(qwen):
    """Few tokens read few experts: one decoding sequence streams its 8 experts per layer,
    64 sequences nearly all 128; and a skewed (power-law) load prices another time."""
    one, many = qwen.breakdown(decode(1, 500)), qwen.breakdown(decode(64, 500))
    assert many["moe_experts"].time_s > 5 * one["moe_experts"].time_s
    expert = 3 * 2048 * 768 * 2
    assert one["moe_experts"].bytes >= 48 * 8 * expert
    skewed = CostModel("qwen3-30b-a3b", H100, expert_load="power-law:1.2")
    assert skewed.step_time(prefill(2048)) != qwen.step_time(prefill(2048))


def test_expert_parallelism_cuts_expert_time_and_adds_the_token_exchange(qwen, qwen_ep2):
    for n in (16, 128):     # (at one token per rank, each GPU still reads its 8 experts)
        tp1, ep2 = qwen.breakdown(decode(n, 1000)), qwen_ep2.breakdown(decode(n, 1000))
        assert ep2["moe_experts"].time_s < tp1["moe_experts"].time_s, n
        assert "ep_dispatch" not in tp1 and ep2["ep_dispatch"].time_s > 0
        assert ep2["ep_combine"].op_class == "collective"
    # each rank's tokens are gathered from both ranks: dp x tokens x hidden BF16 values
    assert qwen_ep2.breakdown(decode(16, 100))["ep_dispatch"].bytes == 48 * 2 * 16 * 2048 * 2
    # EP over the TP GPUs alone exchanges nothing: the TP all-reduce combines the experts
    tp2_ep2 = CostModel("qwen3-30b-a3b", H100, tp=2, ep=2).breakdown(decode(16, 100))
    assert "ep_dispatch" not in tp2_ep2 and tp2_ep2["allreduce"].time_s > 0


def test_a_moe_decode_step_is_cheaper_than_a_dense_model_of_its_total_size(qwen):
    """Qwen3-30B-A3B (30.5B parameters, 3.3B active) against the dense Qwen3-32B: a small
    decode batch reads only its tokens' experts (by 16 sequences, 128 pairs, balanced
    routing reads them all)."""
    dense = CostModel("qwen3-32b", H100)
    for n in (1, 2, 4):
        assert qwen.step_time(decode(n, 2000)) < 0.6 * dense.step_time(decode(n, 2000)), n


def test_fp8_weights_run_the_fp8_fused_moe(qwen):
    fp8 = CostModel("qwen3-30b-a3b", H100, weight_dtype="fp8")
    assert fp8.breakdown(decode(32, 500))["moe_experts"].time_s < \
        0.75 * qwen.breakdown(decode(32, 500))["moe_experts"].time_s
    assert fp8.breakdown(decode(1, 500))["moe_router"].bytes == \
        qwen.breakdown(decode(1, 500))["moe_router"].bytes           # the router stays BF16


# --------------------------------------------------------------------------- MLA


def _mha_twin(m: ModelSpec) -> ModelSpec:
    """DeepSeek-V3's layers and heads with multi-head attention of 128-wide heads."""
    return ModelSpec(name="mha-twin", num_layers=m.num_layers, hidden_size=m.hidden_size,
                     num_heads=m.num_heads, num_kv_heads=m.num_heads, head_dim=128,
                     intermediate_size=m.intermediate_size, vocab_size=m.vocab_size)


def test_mla_decode_reads_one_latent_per_token_far_less_than_mha(deepseek):
    shape = decode(32, 8192)
    mla = deepseek.breakdown(shape)["attn_decode"]
    assert mla.bytes == 61 * 32 * 8192 * 576 * 2
    mha = CostModel(_mha_twin(deepseek.model), "h200", tp=8, weight_dtype="fp8")
    assert mha.breakdown(shape)["attn_decode"].bytes > 3 * mla.bytes
    assert mha.breakdown(shape)["attn_decode"].time_s > 2 * mla.time_s


def test_an_fp8_kv_cache_for_mla_is_refused_where_vllm_runs_its_triton_kernel():
    """vLLM's Triton MLA decode (Ampere, Ada, sm_120) has no FP8 KV cache: one line."""
    for gpu in ("a100-80gb", "l40s", "rtx-pro-6000"):
        with pytest.raises(ValueError, match=f"FP8 KV cache for MLA on {gpu}: vLLM decodes MLA "
                                             "there with its Triton kernel"):
            CostModel("deepseek-v3", gpu, tp=8, weight_dtype="fp8", kv_dtype="fp8")
    CostModel("deepseek-v3", "l40s", tp=8, weight_dtype="fp8")            # bf16 KV runs
    CostModel("deepseek-v3", "h200", tp=8, weight_dtype="fp8", kv_dtype="fp8")   # FlashMLA
    CostModel("llama-3.1-8b", "a100-80gb", kv_dtype="fp8")                 # no MLA


def test_fp8_kv_prices_mla_with_one_byte_latents(deepseek):
    fp8 = CostModel("deepseek-v3", "h200", tp=8, weight_dtype="fp8", kv_dtype="fp8")
    long = decode(64, 32768)
    a, b = fp8.breakdown(long)["attn_decode"], deepseek.breakdown(long)["attn_decode"]
    assert 2 * a.bytes == b.bytes and a.time_s < 0.8 * b.time_s
    assert fp8.block_bytes * 2 == deepseek.block_bytes == 16 * 61 * 576 * 2


@pytest.mark.parametrize("name, kw", [
    ("qwen3-30b-a3b", {"ep": 2}), ("deepseek-v3", {"tp": 8, "weight_dtype": "fp8"}),
    ("mixtral-8x7b", {"tp": 2, "expert_load": "power-law:1.2"}), ("tiny-moe", {})])
def test_breakdown_sums_to_the_step_time(name, kw):
    cm = CostModel(name, "h200" if name == "deepseek-v3" else H100, **kw)
    for shape in (mixed([(300, 0), (700, 1500)], [900, 40, 2000]), decode(7, 3000), prefill(5)):
        assert sum(op.time_s for op in cm.breakdown(shape).values()) == \
            pytest.approx(cm.step_time(shape), rel=1e-9)


@pytest.mark.parametrize("name, kw", [("qwen3-30b-a3b", {"ep": 2}),
                                      ("deepseek-v3", {"tp": 8, "weight_dtype": "fp8"})])
def test_a_decode_run_in_closed_form_is_the_sum_of_its_steps(name, kw):
    """The experts' cost depends on the token count only and MLA decode is linear in the
    context: the fast-forward's closed form holds for these models."""
    cm = CostModel(name, "h200" if name == "deepseek-v3" else H100, **kw)
    for n, ctx, k in ((1, 10, 500), (24, 24 * 700, 300), (200, 200 * 50, 90)):
        shape = BatchShape(num_decode_seqs=n, decode_context_sum=ctx)
        steps = [cm.step_time(dataclasses.replace(shape, decode_context_sum=ctx + j * n))
                 for j in range(k)]
        assert cm.decode_run_duration(shape, k)[0] == pytest.approx(math.fsum(steps), rel=1e-9)


# --------------------------------------------------------------------------- flags and refusals


def _config(tmp_path, *argv) -> dict:
    out = tmp_path / "run"
    assert main(["simulate", "--num-requests", "12", "--kv-blocks", "3000", "--out", str(out),
                 *argv]) == 0
    return json.loads((out / "config.json").read_text())["config"]


def test_flags_reach_the_config(tmp_path):
    c = _config(tmp_path, "--model", "tiny-moe", "--dp", "2", "--expert-load", "power-law:1.2")
    assert (c["ep"], c["replicas"], c["tp"], c["expert_load"]) == (2, 2, 1, "power-law:1.2")
    config = SimulationConfig.from_dict(c)
    assert SimulationConfig.from_dict(config.to_dict()) == config
    c = _config(tmp_path, "--model", "tiny-moe", "--ep", "2", "--force")
    assert (c["ep"], c["replicas"]) == (2, 2) and "expert_load" not in c
    c = _config(tmp_path, "--model", "tiny-moe", "--dp", "2", "--tp", "2", "--replicas", "4",
                "--force")
    assert (c["ep"], c["replicas"], c["tp"]) == (4, 4, 2)
    dense = _config(tmp_path, "--model", "tiny-llama", "--dp", "2", "--force")
    assert dense["replicas"] == 2 and "ep" not in dense and "expert_load" not in dense


@pytest.mark.parametrize("argv, line", [
    (["--model", "qwen3-30b-a3b", "--ep", "3"], "ep=3 (tp 1 x dp 3) must divide qwen3-30b-a3b's 128 routed experts"),
    (["--model", "tiny-llama", "--ep", "2"], "ep=2 spreads experts over GPUs, and tiny-llama has none"),
    (["--model", "tiny-moe", "--ep", "2", "--replicas", "3"],
     "--replicas 3 must be a multiple of the 2 data-parallel ranks of a deployment"),
    (["--model", "tiny-moe", "--dp", "2", "--ep", "4"], "--ep 4 disagrees with --dp 2 x --tp 1"),
    (["--model", "tiny-moe", "--ep", "3", "--tp", "2"], "--ep 3 must be a multiple of --tp 2"),
    (["--model", "tiny-moe", "--expert-load", "zipf"], "unknown expert load 'zipf'"),
    (["--model", "tiny-llama", "--expert-load", "power-law:1.2"],
     "expert load 'power-law:1.2' applies to mixture-of-experts models; tiny-llama has no experts"),
    (["--model", "tiny-moe", "--weight-dtype", "fp32"],
     "the fused-MoE kernel is priced for bf16 and fp8 weights, not fp32"),
    (["--model", "deepseek-v3", "--gpu", "h100-sxm", "--tp", "8"],   # its checkpoint's FP8
     "deepseek-v3 weights need 79.3 GiB per GPU at tp=8, ep=1 (fp8)"),
    (["--model", "deepseek-v3", "--gpu", "h200", "--tp", "8", "--weight-dtype", "bf16"],
     "deepseek-v3 weights need 157.9 GiB per GPU at tp=8, ep=1 (bf16)"),
])
def test_layouts_that_cannot_run_are_refused_in_one_line_before_the_run(tmp_path, capsys, argv, line):
    assert main(["simulate", "--num-requests", "5", "--out", str(tmp_path / "x"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert line in err and len(err.splitlines()) == 1 and not (tmp_path / "x").exists()


# --------------------------------------------------------------------------- whole runs


def _run(model: str, fast_forward: bool, **kw):
    if model.startswith("tiny"):    # a few KiB of KV per token: cap the blocks an H100 would hold
        kw = {"kv_blocks": 6000, **kw}
    config = SimulationConfig(trace="default", model=model, num_requests=60, rate=8.0,
                              fast_forward=fast_forward, engine="vllm-0.24", **kw)
    return run_simulation(config, out_dir=None)


@pytest.mark.parametrize("model, kw", [("tiny-moe", {}), ("qwen3-30b-a3b", {"ep": 2, "replicas": 2}),
                                       ("qwen3-30b-a3b", {"expert_load": "power-law:1.2"})])
def test_moe_models_simulate_end_to_end_and_fast_forward_changes_nothing(model, kw):
    fast, slow = _run(model, True, **kw), _run(model, False, **kw)
    assert fast.summary["completed"] == 60 and fast.summary["rejected"] == 0
    for a, b in zip(fast.requests, slow.requests):
        assert (a.request_id, a.status, a.output_tokens) == (b.request_id, b.status, b.output_tokens)
        assert a.finish_s == pytest.approx(b.finish_s, rel=1e-9)
        assert a.first_token_s == pytest.approx(b.first_token_s, rel=1e-9)
    assert len(fast.steps) < len(slow.steps)         # runs of decode steps were fast-forwarded


def test_a_data_parallel_moe_deployment_serves_more_than_one_rank():
    """Two DP ranks with the experts spread over both GPUs: each rank holds half the
    experts, so more KV fits, and the pair finishes the same trace sooner than one GPU."""
    one = _run("qwen3-30b-a3b", True)
    two = _run("qwen3-30b-a3b", True, ep=2, replicas=2)
    assert two.derived["kv_blocks_per_replica"] > 2 * one.derived["kv_blocks_per_replica"]
    assert np.mean([r.finish_s - r.arrival_s for r in two.requests]) < \
        np.mean([r.finish_s - r.arrival_s for r in one.requests])
