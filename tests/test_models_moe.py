"""Mixture-of-experts and MLA model descriptions and their footprint on a GPU.

Published parameter counts (model cards): Mixtral-8x7B 46.7B total / 12.9B active
(mistral.ai, "Mixtral of experts"), Qwen3-30B-A3B 30.5B / 3.3B and Qwen3-235B-A22B 235B /
22B (the Qwen3 model cards), DeepSeek-V3 671B / 37B (the DeepSeek-V3 model card; its
14B multi-token-prediction module is not counted, as servelab does not model it).
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from servelab.models import MLASpec, ModelSpec, MoESpec, catalog_names, load_model_spec
from servelab.simulator.footprint import (Footprint, ShardedShapes, _sparse_footprint,
                                          activation_reserve_bytes, kv_capacity_blocks,
                                          weight_bytes_per_gpu)
from servelab.simulator.gpus import DTYPE_BYTES, GIB, get_gpu

MOE_MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "tiny-moe")
DENSE_MODELS = ("llama-2-7b", "llama-2-70b", "llama-3.1-8b", "llama-3.1-70b", "mistral-7b",
                "qwen2.5-7b", "qwen3-32b", "tiny-llama")

PUBLISHED = {   # (total, active) parameters
    "mixtral-8x7b": (46.7e9, 12.9e9), "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "qwen3-235b-a22b": (235e9, 22e9), "deepseek-v3": (671e9, 37e9),
}
# name: (layers, hidden, heads, kv heads, routed experts, top-k, expert width, shared width,
#        dense layers) from each model's config.json (docs/models.md names the repos)
SHAPES = {
    "mixtral-8x7b": (32, 4096, 32, 8, 8, 2, 14336, 0, ()),
    "qwen3-30b-a3b": (48, 2048, 32, 4, 128, 8, 768, 0, ()),
    "qwen3-235b-a22b": (94, 4096, 64, 4, 128, 8, 1536, 0, ()),
    "deepseek-v3": (61, 7168, 128, 128, 256, 8, 2048, 2048, (0, 1, 2)),
    "tiny-moe": (2, 64, 4, 2, 4, 2, 96, 0, ()),
}


def _raw(name: str) -> dict:
    folder = resources.files("servelab") / "data" / "models"
    return json.loads((folder / f"{name}.json").read_text())


# --------------------------------------------------------------------------- the specs


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_catalog_entry_reads_its_experts(name):
    m = load_model_spec(name)
    e = m.moe
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, e.num_experts,
            e.experts_per_token, e.expert_intermediate_size, e.shared_intermediate_size,
            e.dense_layers) == SHAPES[name]
    assert e.norm_topk_prob and m.name == name


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_total_and_active_params_match_the_model_cards(name):
    m = load_model_spec(name)
    total, active = PUBLISHED[name]
    assert m.num_params == pytest.approx(total, rel=0.02)
    assert m.num_active_params == pytest.approx(active, rel=0.02)


def test_tiny_moe_params_by_hand():
    # attention 12,288 + 4 experts × 3·64·96 = 73,728 + router 4·64 = 256 + norms 128
    # → 86,400 × 2 layers + embed and LM head 2·256·64 = 32,768 + final norm 64 = 205,632
    m = load_model_spec("tiny-moe")
    assert m.num_params == 205_632
    assert m.num_active_params == 205_632 - 2 * 2 * 3 * 64 * 96
    assert m.kv_bytes_per_token() == load_model_spec("tiny-llama").kv_bytes_per_token()


def test_mla_caches_576_values_per_token_and_layer():
    m = load_model_spec("deepseek-v3")
    assert m.mla == MLASpec(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                            qk_rope_head_dim=64, v_head_dim=128)
    assert m.mla.cached_values == 576 and m.head_dim == 192
    assert m.kv_bytes_per_token() == 61 * 576 * 2          # 70,272 B: ~70 KB (REFERENCE.md)
    assert m.kv_bytes_per_token(dtype_bytes=1) == 61 * 576
    assert m.checkpoint_weight_dtype == "fp8"
    assert load_model_spec("qwen3-30b-a3b").checkpoint_weight_dtype == "bf16"


def test_deepseek_v2_lite_queries_without_a_low_rank_bottleneck():
    # deepseek-ai/DeepSeek-V2-Lite config.json; 15.7B parameters (its model card)
    config = {"architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048,
              "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 64,
              "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
              "moe_layer_freq": 1, "num_attention_heads": 16, "num_key_value_heads": 16,
              "num_hidden_layers": 27, "q_lora_rank": None, "kv_lora_rank": 512,
              "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
              "vocab_size": 102400, "norm_topk_prob": False}
    m = ModelSpec.from_hf_config(config)
    assert m.mla.q_lora_rank is None and m.moe.dense_layers == (0,) and not m.moe.norm_topk_prob
    assert m.num_params == pytest.approx(15.7e9, rel=0.02)


def test_qwen3_moe_dense_layers_from_sparse_step_and_mlp_only_layers():
    config = {**_raw("tiny-moe"), "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 6,
              "num_experts": 4, "moe_intermediate_size": 32, "decoder_sparse_step": 2,
              "mlp_only_layers": [3]}
    del config["num_local_experts"]
    m = ModelSpec.from_hf_config(config)
    assert m.moe.dense_layers == (0, 2, 3, 4) and m.num_moe_layers == 2 and m.qk_norm
    assert not m.moe.norm_topk_prob        # transformers' default when the config is silent


def test_dense_specs_are_unchanged():
    for name in DENSE_MODELS:
        m = load_model_spec(name)
        assert m.moe is None and m.mla is None
        assert m.num_active_params == m.num_params and m.weight_bytes() == 2 * m.num_params


# --------------------------------------------------------------------------- refusals


def _tiny(arch: str, **changes) -> dict:
    config = {**_raw("tiny-moe"), "architectures": [arch], **changes}
    return {k: v for k, v in config.items() if v is not None}


@pytest.mark.parametrize("config, line", [
    (_tiny("Qwen2MoeForCausalLM", num_experts=4),
     r"^Qwen2MoeForCausalLM is a mixture-of-experts model \(num_experts, num_local_experts in "
     r"its config\) whose "
     r"layout servelab does not model; mixture-of-experts architectures: MixtralForCausalLM, "),
    (_tiny("GptOssForCausalLM", num_local_experts=4),
     r"^GptOssForCausalLM is a mixture-of-experts model \(num_local_experts"),
    (_tiny("MixtralForCausalLM", num_experts_per_tok=None),
     r"^MixtralForCausalLM is a mixture-of-experts model whose config lacks "
     r"'num_experts_per_tok'$"),
    (_tiny("Qwen3MoeForCausalLM"),
     r"^Qwen3MoeForCausalLM is a mixture-of-experts model whose config lacks "
     r"'moe_intermediate_size'$"),
    (_tiny("MixtralForCausalLM", num_experts_per_tok=5),
     r"^experts per token must be in \[1, 4\], got 5$"),
    (_tiny("MixtralForCausalLM", layer_types=["full_attention", "sliding_attention"]),
     r"^MixtralForCausalLM: per-layer attention types \['sliding_attention'\] are not modelled"),
    (_tiny("Qwen3MoeForCausalLM", moe_intermediate_size=32, use_sliding_window=True),
     r"^Qwen3MoeForCausalLM: use_sliding_window .* is not modelled"),
    ({**_raw("deepseek-v3"), "kv_lora_rank": None},
     r"^DeepseekV3ForCausalLM is a multi-head latent attention model whose config lacks "
     r"'kv_lora_rank'$"),
    ({k: v for k, v in _raw("deepseek-v3").items() if k != "q_lora_rank"},
     r"^DeepseekV3ForCausalLM is a multi-head latent attention model whose config lacks "
     r"'q_lora_rank' \(null when queries are projected directly\)$"),
    ({k: v for k, v in _raw("deepseek-v3").items() if k != "first_k_dense_replace"},
     r"^DeepseekV3ForCausalLM is a mixture-of-experts model whose config lacks "
     r"'first_k_dense_replace'$"),
])
def test_unknown_or_incomplete_layouts_are_refused_in_one_line(config, line):
    with pytest.raises(ValueError, match=line) as info:
        ModelSpec.from_hf_config(config)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("field, value", [
    ("num_hidden_layers", 0), ("num_hidden_layers", None), ("hidden_size", -4096),
    ("hidden_size", "abc"), ("num_attention_heads", 0), ("intermediate_size", 0),
    ("vocab_size", 0), ("num_key_value_heads", 2.5), ("max_position_embeddings", True),
])
def test_a_config_number_that_cannot_be_is_refused_naming_file_and_field(tmp_path, field, value):
    """Before any pricing: a zero layer count used to divide by zero, a zero vocabulary or
    MLP width to price nonsense silently."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**_raw("llama-3.1-8b"), field: value}))
    shown = "null" if value is None else repr(value)
    with pytest.raises(ValueError) as info:
        load_model_spec(str(folder))
    assert str(info.value) == (f"{folder / 'config.json'}: model config field {field!r} must be "
                               f"a whole number >= 1, got {shown}")


def test_a_config_that_is_not_json_names_its_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"a":')
    with pytest.raises(ValueError, match=rf"^{path}: not valid JSON \(Expecting value at line 1\)$"):
        load_model_spec(str(path))


def test_other_quantisations_are_refused_when_asked_for_the_weight_dtype():
    awq = {"quant_method": "awq"}
    m = ModelSpec.from_hf_config({**_raw("tiny-moe"), "quantization_config": awq})
    with pytest.raises(ValueError, match="quantization 'awq' is not modelled"):
        m.checkpoint_weight_dtype


def test_moe_spec_validation():
    with pytest.raises(ValueError, match="2 shared experts cannot be 0 wide"):
        MoESpec(8, 2, 64, num_shared_experts=2)
    with pytest.raises(ValueError, match="needs experts"):
        MoESpec(0, 1, 64)


# --------------------------------------------------------------------------- footprint


@pytest.mark.parametrize("name", MOE_MODELS)
@pytest.mark.parametrize("weight_dtype", ["bf16", "fp8"])
def test_one_gpu_holds_the_whole_model(name, weight_dtype):
    m = load_model_spec(name)
    assert weight_bytes_per_gpu(m, 1, weight_dtype) == m.weight_bytes(DTYPE_BYTES[weight_dtype])
    if weight_dtype == "bf16":
        assert weight_bytes_per_gpu(m) == 2 * m.num_params


@pytest.mark.parametrize("name", DENSE_MODELS)
@pytest.mark.parametrize("dtypes", [("bf16", "bf16"), ("fp8", "fp8")])
def test_the_expert_layout_agrees_with_the_priced_shapes_on_dense_models(name, dtypes):
    """The MoE/MLA path's accounting of attention, embeddings and norms is the priced one:
    fed a dense model it gives the dense answer, at every tp the model splits."""
    m = load_model_spec(name)
    for tp in (t for t in (1, 2, 4, 8) if m.num_heads % t == 0):
        dense = Footprint.of(m, tp, *dtypes)
        assert _sparse_footprint(m, tp, 1, *(DTYPE_BYTES[d] for d in dtypes)) == dense


def test_dense_footprint_is_read_off_the_priced_shapes():
    m = load_model_spec("llama-2-70b")
    s, f = ShardedShapes.of(m, 4, "fp8", "fp8"), Footprint.of(m, 4, "fp8", "fp8")
    assert f.kv_bytes_per_token == s.kv_bytes_per_token == 2 * 80 * 2 * 128
    assert f.weight_bytes == weight_bytes_per_gpu(m, 4, "fp8")


def test_expert_parallelism_spreads_the_routed_experts_only():
    m = load_model_spec("qwen3-30b-a3b")
    expert = 3 * 2048 * 768 * 2                          # one expert, BF16
    one, ep2 = Footprint.of(m), Footprint.of(m, ep=2)
    assert one.weight_bytes - ep2.weight_bytes == 48 * 64 * expert
    assert ep2.kv_bytes_per_token == one.kv_bytes_per_token       # attention replicated (DP)
    # tp=2 splits every expert in two instead: the same bytes, and half the KV heads
    tp2 = Footprint.of(m, 2)
    assert tp2.weight_bytes < ep2.weight_bytes and tp2.kv_bytes_per_token == 98304 // 2
    # EP over the TP × DP GPUs: attention split tp ways, experts whole
    tp2_ep4 = Footprint.of(m, 2, ep=4)
    assert tp2_ep4.kv_bytes_per_token == tp2.kv_bytes_per_token
    assert tp2_ep4.intermediate == 8 * 768 and tp2.intermediate == 8 * 768 // 2


def test_shared_experts_and_dense_layers_stay_tensor_parallel():
    m = load_model_spec("deepseek-v3")
    f8, f1 = Footprint.of(m, 1, "fp8", ep=8), Footprint.of(m, 1, "fp8")
    assert f1.weight_bytes - f8.weight_bytes == 58 * (256 - 32) * 3 * 7168 * 2048
    # MLA's latent is not split over TP ranks
    assert Footprint.of(m, 8, "fp8", "fp8").kv_bytes_per_token == 61 * 576


def test_fp8_weights_and_kv_raise_capacity():
    bf16 = kv_capacity_blocks("qwen3-30b-a3b", "h100-sxm")
    fp8_kv = kv_capacity_blocks("qwen3-30b-a3b", "h100-sxm", kv_dtype="fp8")
    fp8_both = kv_capacity_blocks("qwen3-30b-a3b", "h100-sxm", kv_dtype="fp8", weight_dtype="fp8")
    assert fp8_kv == 2 * bf16 or fp8_kv == 2 * bf16 + 1
    assert fp8_both > fp8_kv
    m, gpu = load_model_spec("qwen3-30b-a3b"), get_gpu("h100-sxm")
    free = gpu.memory_bytes * 0.9 - m.weight_bytes(1) - activation_reserve_bytes(m)
    assert fp8_both == int(free // (16 * 48 * 2 * 4 * 128))


def test_deepseek_v3_fits_eight_h200_in_fp8_but_not_bf16():
    blocks = kv_capacity_blocks("deepseek-v3", "h200", tp=8, weight_dtype="fp8")
    assert blocks * 16 * 61 * 576 * 2 > 40 * GIB             # tens of GiB of latent KV per GPU
    with pytest.raises(ValueError, match=r"^deepseek-v3 weights need 157\.9 GiB per GPU at "
                                         r"tp=8, ep=1 \(bf16\), .*: raise tp or ep, split the "
                                         r"layers over pipeline stages \(pp\) or use fp8 weights$"):
        kv_capacity_blocks("deepseek-v3", "h200", tp=8)
    # already in FP8: the hint does not say to use it
    with pytest.raises(ValueError, match=r"\(fp8\), .*: raise tp or ep or split the layers over "
                                         r"pipeline stages \(pp\)$"):
        kv_capacity_blocks("deepseek-v3", "h100-sxm", tp=8, weight_dtype="fp8")


@pytest.mark.parametrize("model, tp, ep, line", [
    ("mixtral-8x7b", 1, 3, r"^ep=3 \(tp 1 x dp 3\) must divide mixtral-8x7b's 8 routed experts$"),
    ("mixtral-8x7b", 4, 2, r"^ep=2 must be a multiple of tp=4: vLLM spreads the experts over "
                           r"the TP × DP GPUs of a replica$"),
    ("llama-2-7b", 1, 2, r"^ep=2 spreads experts over GPUs, and llama-2-7b has none$"),
    ("qwen3-30b-a3b", 3, 1, r"^tp=3 must divide qwen3-30b-a3b's 32 attention heads$"),
    ("qwen3-30b-a3b", 1, 0, r"^ep must be an integer >= 1, got 0$"),
])
def test_layouts_that_cannot_run_are_refused_in_one_line(model, tp, ep, line):
    with pytest.raises(ValueError, match=line):
        kv_capacity_blocks(model, "h100-sxm", tp=tp, ep=ep)


def test_expert_width_and_kv_heads_must_split_under_tp():
    odd = ModelSpec.from_hf_config({**_raw("tiny-moe"), "intermediate_size": 90}, name="odd")
    with pytest.raises(ValueError, match=r"^tp=4 must divide odd's expert width \(90\), or "
                                         r"spread the experts with ep$"):
        Footprint.of(odd, 4)
    assert Footprint.of(odd, 2, ep=2).weight_bytes > 0       # whole experts: no split needed
    gqa = ModelSpec.from_hf_config({**_raw("tiny-moe"), "num_attention_heads": 12,
                                    "num_key_value_heads": 4}, name="gqa")
    with pytest.raises(ValueError, match=r"^tp=6 must divide, or be a multiple of, gqa's 4 KV "
                                         r"heads$"):
        Footprint.of(gqa, 6)


@pytest.mark.parametrize("name, tp, ep, weights", [
    ("qwen3-30b-a3b", 1, 1, "bf16"), ("qwen3-30b-a3b", 1, 2, "bf16"), ("qwen3-30b-a3b", 2, 1, "fp8"),
    ("mixtral-8x7b", 2, 2, "bf16"), ("deepseek-v3", 8, 1, "fp8"), ("deepseek-v3", 1, 8, "fp8"),
    ("tiny-moe", 1, 2, "bf16")])
def test_every_weight_a_gpu_holds_is_streamed_by_a_priced_kernel(name, tp, ep, weights):
    """The step's priced shapes and the memory footprint agree: the GEMMs, the routed
    experts this GPU holds (the fused-MoE kernel) and MLA's per-head up-projection (inside
    the MLA kernels), plus the embedding and norms no kernel streams, are the weights."""
    m = load_model_spec(name)
    s, f = ShardedShapes.of(m, tp, weights, ep=ep), Footprint.of(m, tp, weights, ep=ep)
    wb, a, h, L = DTYPE_BYTES[weights], 2, m.hidden_size, m.num_layers
    x = s.experts
    total = sum(g.weight_bytes * g.repeat for g in s.gemms)
    total += x.num_layers * (x.experts // ep) * 3 * h * x.width * wb
    norms = (2 * L + 1) * h * a
    if m.mla is not None:
        total += L * m.mla.kv_lora_rank * s.heads * (m.mla.qk_nope_head_dim + m.mla.v_head_dim) * wb
        norms += L * (m.mla.q_lora_rank + m.mla.kv_lora_rank) * a
    if m.qk_norm:
        norms += L * 2 * m.head_dim * a
    embedding = 0 if m.tie_word_embeddings else s.vocab * h * a
    assert total + embedding + norms == f.weight_bytes
    assert s.kv_bytes_per_token == f.kv_bytes_per_token
    assert x.dp == (ep // tp if ep > tp else 1)


# --------------------------------------------------------------------------- docs/models.md

DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"


def _params(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e3:.1f}K"


def _kv(b: int) -> str:
    return f"{b / 1024:.1f} KiB" if b >= 1024 else f"{b} B"


def _catalog_row(name: str) -> str:
    m = load_model_spec(name)
    repo = m.hf_config["_name_or_path"]
    source = ("servelab's own (tests)" if repo.startswith("servelab/")
              else f"[{repo}](https://huggingface.co/{repo})")
    e = m.moe
    experts = "dense" if e is None else (
        f"{e.num_experts}" + (f" + {e.num_shared_experts}" if e.num_shared_experts else "")
        + f" / {e.experts_per_token} / {e.expert_intermediate_size}"
        + (f" ({len(e.dense_layers)} dense layers)" if e.dense_layers else ""))
    mla = ("—" if m.mla is None
           else f"{m.mla.q_lora_rank} / {m.mla.kv_lora_rank} / {m.mla.qk_rope_head_dim}")
    heads = f"{m.num_heads} / {m.num_kv_heads}" + ("" if m.mla else f" × {m.head_dim}")
    return (f"| `{name}` | {source} | {m.num_layers} | {m.hidden_size} | {heads} | {experts} | "
            f"{mla} | {_params(m.num_params)} / {_params(m.num_active_params)} | "
            f"{_kv(m.kv_bytes_per_token(2))} / {_kv(m.kv_bytes_per_token(1))} |")


def _capacity_row(model: str, gpu: str, tp: int, ep: int, wd: str, kd: str) -> str:
    blocks = kv_capacity_blocks(model, gpu, tp=tp, ep=ep, weight_dtype=wd, kv_dtype=kd)
    weights = weight_bytes_per_gpu(load_model_spec(model), tp, wd, ep=ep)
    groups = ep // tp if ep > 1 else 1       # data-parallel attention groups
    return (f"| `{model}` | {tp * groups} × {gpu} | {tp} | {ep} | {wd} | {kd} | "
            f"{weights / GIB:.1f} | {blocks * 16:,} | {blocks * 16 * groups:,} |")


def test_the_doc_tables_are_what_the_code_computes():
    text = DOC.read_text(encoding="utf-8")
    catalog = [line for line in text.splitlines() if line.startswith("| `")]
    rows = [_catalog_row(name) for name in catalog_names()]
    assert catalog[:len(rows)] == rows
    capacity = [tuple(line.split(" | ")[i].strip("`| ") for i in (0, 1, 2, 3, 4, 5))
                for line in catalog[len(rows):]]
    assert capacity, "docs/models.md lost its capacity table"
    for model, gpus, tp, ep, wd, kd in capacity:
        line = _capacity_row(model, gpus.split(" × ")[1], int(tp), int(ep), wd, kd)
        assert line in catalog, line
