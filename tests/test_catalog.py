"""The model and GPU catalogs hold the published figures (REFERENCE.md) and fail loudly."""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from servelab.models import catalog_names, load_model_spec
from servelab.simulator.gpus import GPUSpec, get_gpu, gpu_for_device_name, gpu_names
from servelab.simulator.footprint import weight_bytes_per_gpu

# name: (layers, hidden, heads, kv heads, head dim, intermediate, vocab) — REFERENCE.md's table
SHAPES = {
    "llama-2-7b": (32, 4096, 32, 32, 128, 11008, 32000),
    "llama-2-13b": (40, 5120, 40, 40, 128, 13824, 32000),
    "llama-2-70b": (80, 8192, 64, 8, 128, 28672, 32000),
    "llama-3.1-8b": (32, 4096, 32, 8, 128, 14336, 128256),
    "llama-3.1-70b": (80, 8192, 64, 8, 128, 28672, 128256),
    "mistral-7b": (32, 4096, 32, 8, 128, 14336, 32000),
    "qwen2.5-7b": (28, 3584, 28, 4, 128, 18944, 152064),
    "qwen3-32b": (64, 5120, 64, 8, 128, 25600, 151936),
    "tiny-llama": (2, 64, 4, 2, 16, 128, 256),
}

# Parameter counts as the model cards / safetensors indexes publish them.
PUBLISHED_PARAMS = {
    "llama-2-7b": 6.74e9, "llama-2-13b": 13.02e9, "llama-2-70b": 68.98e9,
    "llama-3.1-8b": 8.03e9, "llama-3.1-70b": 70.55e9, "mistral-7b": 7.24e9,
    "qwen2.5-7b": 7.62e9, "qwen3-32b": 32.8e9,
}

# (max_position_embeddings, rope_theta, rms_norm_eps) of the published config.json files
ROPE_AND_NORM = {
    "llama-2-7b": (4096, 10000.0, 1e-5), "llama-2-13b": (4096, 10000.0, 1e-5),
    "llama-2-70b": (4096, 10000.0, 1e-5), "llama-3.1-8b": (131072, 500000.0, 1e-5),
    "llama-3.1-70b": (131072, 500000.0, 1e-5), "mistral-7b": (32768, 10000.0, 1e-5),
    "qwen2.5-7b": (131072, 1000000.0, 1e-6), "qwen3-32b": (40960, 1000000.0, 1e-6),
    "tiny-llama": (2048, 10000.0, 1e-5),
}


def _raw(name: str) -> dict:
    return json.loads((resources.files("servelab") / "data" / "models" / f"{name}.json").read_text())


def test_catalog_lists_every_model():
    """Dense models here (OPT-13B in tests/test_opt.py); the mixture-of-experts ones in
    tests/test_models_moe.py."""
    dense = [n for n in catalog_names() if load_model_spec(n).moe is None and load_model_spec(n).mla is None]
    assert dense == sorted([*SHAPES, "opt-13b"])
    assert set(catalog_names()) - set(dense) == {"deepseek-v3", "mixtral-8x7b", "qwen3-235b-a22b",
                                                 "qwen3-30b-a3b", "tiny-moe"}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_catalog_entry_loads_with_its_published_shape(name):
    m = load_model_spec(name)
    assert m.name == name
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim,
            m.intermediate_size, m.vocab_size) == SHAPES[name]
    assert (m.max_position_embeddings, m.rope_theta, m.rms_norm_eps) == ROPE_AND_NORM[name]
    if name != "qwen3-32b":   # Qwen3-32B: 64 heads of 128 = 8192 wide, hidden 5120
        assert m.head_dim * m.num_heads == m.hidden_size
    assert not m.tie_word_embeddings


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_catalog_files_are_hf_config_json(name):
    raw = _raw(name)
    for key in ("architectures", "model_type", "hidden_size", "intermediate_size",
                "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
                "vocab_size", "max_position_embeddings", "rope_theta", "rms_norm_eps",
                "tie_word_embeddings", "torch_dtype", "head_dim", "hidden_act"):
        assert key in raw, f"{name}.json lacks {key}"
    assert raw["hidden_act"] == "silu"


def test_architectures_and_biases():
    assert load_model_spec("qwen2.5-7b").architecture == "Qwen2ForCausalLM"
    assert load_model_spec("qwen2.5-7b").attention_bias  # Qwen2 has a QKV bias
    assert load_model_spec("mistral-7b").architecture == "MistralForCausalLM"
    qwen3 = load_model_spec("qwen3-32b")
    assert qwen3.architecture == "Qwen3ForCausalLM" and qwen3.qk_norm and not qwen3.attention_bias
    for name in ("llama-2-7b", "llama-3.1-8b", "mistral-7b", "tiny-llama"):
        assert not load_model_spec(name).attention_bias
    assert _raw("llama-3.1-8b")["rope_scaling"]["rope_type"] == "llama3"


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_num_params_match_published_sizes(name):
    assert load_model_spec(name).num_params == pytest.approx(PUBLISHED_PARAMS[name], rel=0.01)


def test_tiny_llama_params_by_hand():
    # per layer: q,k,v,o = 64·64 + 2·64·32 + 64·64 = 12,288; MLP 3·64·128 = 24,576; norms 128
    # → 36,992 × 2 layers + embed and LM head 2·256·64 = 32,768 + final norm 64 = 106,816
    assert load_model_spec("tiny-llama").num_params == 106_816


def test_kv_bytes_per_token_match_reference():
    assert load_model_spec("llama-2-7b").kv_bytes_per_token() == 512 * 1024
    assert load_model_spec("llama-2-70b").kv_bytes_per_token() == 327_680
    assert load_model_spec("llama-3.1-8b").kv_bytes_per_token() == 128 * 1024
    assert load_model_spec("llama-3.1-8b").kv_bytes_per_token(dtype_bytes=1) == 64 * 1024


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_weight_bytes_are_two_bytes_per_param_at_tp1(name):
    m = load_model_spec(name)
    assert weight_bytes_per_gpu(m) == 2 * m.num_params


def test_unknown_model_names_the_catalog():
    with pytest.raises(ValueError, match="unknown model 'llama-9b'.*llama-2-7b"):
        load_model_spec("llama-9b")


# --- GPUs ------------------------------------------------------------------------------------

# name: (bf16 TFLOP/s, fp8 TFLOP/s, HBM GB/s, memory GB, NVLink bidirectional GB/s, PCIe per dir.)
DATASHEET = {
    "h100-sxm": (989, 1979, 3350, 80, 900, 64),
    "h200": (989, 1979, 4800, 141, 900, 64),
    "a100-80gb": (312, None, 2039, 80, 600, 32),
    "l40s": (362, 733, 864, 48, None, 32),
    "b200": (2250, 4500, 7700, 180, 1800, 64),
    "b300": (2250, 4500, 8000, 288, 1800, 128),
    "gb200": (2500, 5000, 8000, 186, 1800, 225),
    "rtx-pro-6000": (467.8, 935.6, 1597, 96, None, 64),
    "rtx-4090": (165.2, 330.3, 1008, 24, None, 32),
}


def test_gpu_catalog_names():
    assert gpu_names() == sorted([*DATASHEET, "cpu"])


@pytest.mark.parametrize("name", sorted(DATASHEET))
def test_gpu_figures_match_datasheet(name):
    g = get_gpu(name)
    bf16, fp8, hbm, mem, nvlink_bidir, pcie = DATASHEET[name]
    assert (g.bf16_tflops, g.fp8_tflops, g.hbm_bandwidth_gbps, g.memory_gb, g.pcie_gbps) == \
        (bf16, fp8, hbm, mem, pcie)
    # the catalog stores link bandwidth per direction: half the bidirectional datasheet figure
    assert g.nvlink_gbps == (None if nvlink_bidir is None else nvlink_bidir / 2)


def test_peaks_and_links():
    a100, h100, l40s = get_gpu("a100-80gb"), get_gpu("h100-sxm"), get_gpu("l40s")
    assert h100.peak_flops("fp8") == 1979e12 and h100.peak_flops("bf16") == 989e12
    assert a100.peak_flops("fp8") == 312e12        # no FP8 tensor cores: weight-only FP8
    assert l40s.interconnect_gbps == l40s.pcie_gbps == 32   # no NVLink: TP crosses PCIe
    assert h100.memory_bytes == 80 * 2**30
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        h100.peak_flops("int4")


def test_l2_is_in_binary_megabytes_as_nvidia_quotes_it():
    """Two 32,767-token sequences of the RTX PRO 6000's decode tables (4 KV heads of 128,
    BF16) hold 134,213,632 bytes of KV: inside its "128 MB" L2, where the measured kernel
    reads them (1e6-byte megabytes would put them outside)."""
    from servelab.simulator.kernels.attention import _l2_factor
    pro = get_gpu("rtx-pro-6000")
    assert pro.l2_bytes == 128 * 2**20 and get_gpu("a100-80gb").l2_bytes == 40 * 2**20
    kv_set = 2 * 32767 * 4 * 128 * 2 * 2
    assert kv_set > 128e6
    assert _l2_factor(kv_set, pro, 1.5, True) == 1.5
    assert _l2_factor(2 * kv_set, pro, 1.5, True) == 1.0
    assert get_gpu("cpu").l2_bytes == 0.0


def test_compute_capability_is_a_version_string():
    assert get_gpu("h100-sxm").compute_capability == "9.0"
    assert get_gpu("rtx-pro-6000").compute_capability == "12.0"
    with pytest.raises(ValueError, match="compute_capability must be a string like"):
        GPUSpec("x", 1.0, None, 1.0, 1.0, None, 1.0, compute_capability="sm90")


def test_unknown_gpu_names_the_catalog():
    with pytest.raises(ValueError, match="unknown GPU 'v100'.*a100-80gb.*h100-sxm"):
        get_gpu("v100")


def test_gpu_spec_validation_and_overrides():
    with pytest.raises(ValueError, match="hbm_bandwidth_gbps must be a positive number"):
        GPUSpec("x", 1.0, None, 0.0, 1.0, None, 1.0)
    probed = get_gpu("cpu").with_overrides(hbm_bandwidth_gbps=80.0)
    assert probed.hbm_bandwidth_gbps == 80.0 and probed.name == "cpu"
    with pytest.raises(ValueError, match="unknown GPUSpec field.*bandwidth"):
        get_gpu("cpu").with_overrides(bandwidth=1.0)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("sm_count"), "missing field.*sm_count"),   # was priced as a 1-SM GPU
    (lambda d: d.update(hbm_bandwidth_gbps=3.35), "hbm_bandwidth_gbps is in GB/s.*3.35 is outside"),
    (lambda d: d.update(memory_gb=80e9), "memory_gb is in GB.*outside"),
    (lambda d: d.update(bf16_tflops=989e12), "bf16_tflops is in TFLOP/s"),
    (lambda d: d.update(fp8_tflops=1.979e15), "fp8_tflops is in TFLOP/s"),   # FP8 steps 30% faster
    (lambda d: d.update(nvlink_gbps=450e9), "nvlink_gbps is in GB/s"),
    (lambda d: d.update(l2_mb=50e6), "l2_mb is in MB"),
    (lambda d: d.update(host_memory_gb=256e9), "host_memory_gb is in GB"),
])
def test_a_gpu_file_without_its_sm_count_or_in_other_units_is_refused(change, message):
    data = json.loads((Path(__file__).parents[1] / "simulator" / "data" / "gpus" / "h100-sxm.json").read_text())
    change(data)
    with pytest.raises(ValueError, match=message):
        GPUSpec.from_dict(data, "my-gpu.json")


@pytest.mark.parametrize("device_name, gpu", [
    ("NVIDIA B200", "b200"), ("NVIDIA GB200", "gb200"), ("NVIDIA B300 SXM6 AC", "b300"),
    ("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100-sxm")])
def test_a_cuda_device_name_finds_its_own_gpu(device_name, gpu):
    """"B200" is inside "GB200": each Blackwell entry must claim only its own name."""
    assert gpu_for_device_name(device_name) == gpu
