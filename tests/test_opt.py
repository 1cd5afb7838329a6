"""OPT-13B in the catalog: its config, parameters and weight bytes, the GEMMs and kernels a
step of it runs, its 2,048-token context, and the new `ModelSpec` fields leaving every
other model as it was.

Reference figures: facebook/opt-13b's config.json (servelab/data/models/opt-13b.json) and
transformers' `OPTForCausalLM`, which this file builds on the meta device to count what
the spec counts by hand.
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from servelab.cli import main
from servelab.models import ModelSpec, catalog_names, load_model_spec
from servelab.outputs import BatchShape
from servelab.simulator.cost_model import CostModel
from servelab.simulator.footprint import (Footprint, ShardedShapes, kv_capacity_blocks,
                                          weight_bytes_per_gpu)

H, F, L, V = 5120, 20480, 40, 50272
"""OPT-13B: hidden, ffn_dim, layers, vocabulary (its config.json)."""
POSITIONS = 2048 + 2
"""transformers' `OPTLearnedPositionalEmbedding`: max_position_embeddings + an offset of 2."""
OPT_13B_PARAMS = 12_853_473_280
"""What transformers' OPTForCausalLM builds from the config (the test below rebuilds it)."""


def _opt_config() -> dict:
    return load_model_spec("opt-13b").hf_config


def test_opt_13b_reads_its_config():
    m = load_model_spec("opt-13b")
    assert m.architecture == "OPTForCausalLM"
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim,
            m.intermediate_size, m.vocab_size, m.max_position_embeddings) == \
        (L, H, 40, 40, 128, F, V, 2048)
    assert (m.gated_mlp, m.hidden_act, m.attention_bias, m.linear_bias, m.norm_bias) == \
        (False, "relu", True, True, True)
    assert m.learned_positions == POSITIONS and m.tie_word_embeddings
    assert m.kv_bytes_per_token() == 2 * L * H * 2 == 800 * 1024


def test_opt_13b_parameters_by_hand():
    # per layer: q, k, v, out_proj 4·h² + 4h biases; fc1, fc2 2·h·f + f + h biases;
    # two LayerNorms 2·2h; then the tied embedding, the position table, the final LayerNorm
    layer = 4 * H * H + 4 * H + 2 * H * F + F + H + 4 * H
    total = L * layer + V * H + POSITIONS * H + 2 * H
    m = load_model_spec("opt-13b")
    assert m.num_params == total == OPT_13B_PARAMS
    assert m.num_linear_params == L * (4 * H * H + 2 * H * F)
    # ≈ 25.7 GB in FP16 at tp 1, on one GPU exactly the spec's bytes
    assert m.weight_bytes() == 2 * OPT_13B_PARAMS == 25_706_946_560
    assert weight_bytes_per_gpu(m) == m.weight_bytes()
    # FP8 quantises the blocks' GEMM weights only
    assert m.weight_bytes(1) == m.num_linear_params + 2 * (OPT_13B_PARAMS - m.num_linear_params)


def test_opt_13b_params_match_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.OPTConfig(**{k: v for k, v in _opt_config().items() if not k.startswith("_")})
    with torch.device("meta"):
        model = transformers.OPTForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == OPT_13B_PARAMS
    assert model.model.decoder.embed_positions.weight.shape == (POSITIONS, H)
    assert model.model.decoder.layers[0].fc1.weight.shape == (F, H)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_opt_13b_gemms_and_kernels(tp):
    s = ShardedShapes.of(load_model_spec("opt-13b"), tp)
    a = 2                                             # BF16/FP16 bytes
    q, f = H // tp, F // tp
    assert [(g.name, g.n, g.k, g.weight_bytes, g.repeat) for g in s.gemms] == [
        ("qkv_proj", 3 * q, H, H * 3 * q * a + 3 * q * a, L),      # column-parallel bias: split
        ("o_proj", H, q, q * H * a + H * a, L),                    # row-parallel bias: whole
        ("mlp_fc1", f, H, H * f * a + f * a, L),
        ("mlp_fc2", H, f, f * H * a + H * a, L),
        ("lm_head", -(-V // tp), H, H * -(-V // tp) * a, 1),
    ]
    names = [e.name for e in s.elementwise]
    assert "rotary" not in names and "silu_mul" not in names
    assert {"relu", "position_embedding", "position_add"} <= set(names)
    relu = next(e for e in s.elementwise if e.name == "relu")
    assert (relu.bytes_per_row, relu.repeat) == (2 * f * a, L)     # reads and writes fc1's output
    assert s.kv_bytes_per_token == 2 * L * q * a


def test_opt_13b_weights_per_gpu_under_tp():
    m = load_model_spec("opt-13b")
    a = 2
    # tp 2: GEMM shards and column-parallel biases halve; the row-parallel biases, the norms
    # and the position table stay whole; the tied embedding is the LM head's shard
    sharded = L * ((4 * H * H + 2 * H * F) // 2 + (3 * H + F) // 2 + 2 * H) + V * H // 2
    whole = (2 * L + 1) * 2 * H + POSITIONS * H
    assert Footprint.of(m, 2).weight_bytes == (sharded + whole) * a
    # DistServe's simulator (LLMServe/DistServe simdistserve/estimators/profile_data/
    # max_num_tokens.csv) fits 66,144 tokens at tp 1 and 163,008 at tp 2 on an A100-80GB;
    # servelab's derivation (vLLM's formula) lands within 10 % of both
    for tp, theirs in ((1, 66_144), (2, 163_008)):
        ours = kv_capacity_blocks(m, "a100-80gb", tp) * 16
        assert 0.9 * theirs < ours < theirs


def test_opt_13b_step_prices_its_own_kernels():
    cost = CostModel("opt-13b", "a100-80gb")
    zero = dict.fromkeys(BatchShape.__slots__, 0)
    shape = BatchShape(**{**zero, "num_prefill_seqs": 1, "num_prefill_tokens": 512,
                          "prefill_q_sq_sum": 512 * 512, "prefill_max_keys": 512,
                          "num_decode_seqs": 16, "decode_context_sum": 16_000})
    ops = cost.breakdown(shape)
    assert {"mlp_fc1", "mlp_fc2", "relu", "position_embedding", "position_add"} <= set(ops)
    assert not {"mlp_gate_up", "mlp_down", "silu_mul", "rotary"} & set(ops)
    assert sum(op.time_s for op in ops.values()) == pytest.approx(cost.step_time(shape), rel=1e-9)
    # two MLP matrices of f = 20,480 against Llama-2-13B's three of 13,824: 10 % less to
    # stream per decode step of one sequence (same attention)
    one = BatchShape(**{**zero, "num_decode_seqs": 1, "decode_context_sum": 100})
    llama = CostModel("llama-2-13b", "a100-80gb").breakdown(one)
    mine = cost.breakdown(one)
    assert mine["mlp_fc1"].bytes + mine["mlp_fc2"].bytes < llama["mlp_gate_up"].bytes + llama["mlp_down"].bytes


@pytest.mark.parametrize("name", [n for n in catalog_names() if n != "opt-13b"])
def test_new_fields_keep_every_other_model_as_it_was(name):
    """The fields OPT added default to the Llama-style decoder, and with them every other
    catalog model keeps the GEMM list, kernels and weights the builder gave before OPT:
    SwiGLU's gate_up (2 × intermediate) and down, rotary, silu_mul, no position table."""
    m = load_model_spec(name)
    defaults = {f.name: f.default for f in dataclasses.fields(ModelSpec)
                if f.name in ("gated_mlp", "hidden_act", "linear_bias", "norm_bias", "learned_positions")}
    assert defaults == {"gated_mlp": True, "hidden_act": "silu", "linear_bias": False,
                        "norm_bias": False, "learned_positions": 0}
    assert (m.gated_mlp, m.linear_bias, m.norm_bias, m.learned_positions) == (True, False, False, 0)
    s = ShardedShapes.of(m, 1, ep=1)
    names = [e.name for e in s.elementwise]
    assert "position_embedding" not in names and "relu" not in names
    assert "rotary" in names
    h, a = m.hidden_size, 2
    o_proj = next(g for g in s.gemms if g.name == "o_proj")
    assert o_proj.weight_bytes == o_proj.n * o_proj.k * a          # no bias
    if m.num_moe_layers < m.num_layers:                            # it has dense MLP layers
        inter = m.intermediate_size
        by_name = {g.name: g for g in s.gemms}
        assert (by_name["mlp_gate_up"].n, by_name["mlp_gate_up"].weight_bytes) == (2 * inter, h * 2 * inter * a)
        assert (by_name["mlp_down"].k, by_name["mlp_down"].weight_bytes) == (inter, inter * h * a)
        assert "mlp_fc1" not in by_name and "silu_mul" in names
    if m.moe is None and m.mla is None:
        assert weight_bytes_per_gpu(m) == 2 * m.num_params


def test_opt_layouts_servelab_does_not_model_are_refused():
    config = dict(_opt_config())
    with pytest.raises(ValueError, match="word_embed_proj_dim 512 != hidden_size 5120"):
        ModelSpec.from_hf_config({**config, "word_embed_proj_dim": 512})
    with pytest.raises(ValueError, match="do_layer_norm_before"):
        ModelSpec.from_hf_config({**config, "do_layer_norm_before": False})
    with pytest.raises(ValueError, match="lacks the field 'ffn_dim'"):
        ModelSpec.from_hf_config({k: v for k, v in config.items() if k != "ffn_dim"})
    # enable_bias false drops every bias of the blocks
    plain = ModelSpec.from_hf_config({**config, "enable_bias": False})
    assert not plain.attention_bias and not plain.linear_bias
    assert plain.num_params == OPT_13B_PARAMS - L * (4 * H + F + H)


def test_the_2048_token_context_bounds_requests_as_for_any_model(tmp_path, capsys):
    """max_model_len defaults to the model's context (2,048): as vLLM does, a prompt with
    no room for one output token is rejected, and a longer request stops at the limit."""
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n"
                     "0.0,500,20\n0.1,2040,20\n0.2,2048,10\n0.3,1000,30\n")
    out = tmp_path / "run"
    assert main(["simulate", "--trace", str(trace), "--model", "opt-13b", "--gpu", "a100-80gb",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["completed"], summary["rejected"]) == (3, 1)
    assert "prompt of 2048 tokens + 1 exceeds max_model_len 2048" in capsys.readouterr().out
    rows = (out / "requests.csv").read_text().splitlines()[1:]
    assert [r.split(",")[3] for r in rows][:2] == ["20", "8"]      # 2,040 + 8 = 2,048


def test_the_real_backend_refuses_opt_in_one_line():
    pytest.importorskip("torch")
    from servelab.backends.model import check_model_supported
    with pytest.raises(ValueError, match=r"^opt-13b \(OPTForCausalLM\) is simulation-only"):
        check_model_supported(load_model_spec("opt-13b"))
