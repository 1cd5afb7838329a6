"""Checkpoint loading, seeded random init, and the errors bad input gets before any work."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from servelab.backends.attention import SeqWork, build_attention_metadata
from servelab.backends.model import ModelRunner
from servelab.backends.weights import (hf_weight_layout, plan_checkpoint, resolve_device,
                                       resolve_dtype)
from servelab.models import ModelSpec, load_model_spec

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6)
HUGE = 10**12  # blocks: allocating this would fail, so an error about it proves no allocation


def build_hf(arch: str = "LlamaForCausalLM", **extra):
    import transformers

    config_cls = {"LlamaForCausalLM": "LlamaConfig", "Qwen2ForCausalLM": "Qwen2Config",
                  "MistralForCausalLM": "MistralConfig"}[arch]
    torch.manual_seed(0)
    return getattr(transformers, arch)(getattr(transformers, config_cls)(**TINY, **extra)).eval()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    build_hf().save_pretrained(folder, safe_serialization=True)
    return folder


def runner_kwargs(**overrides) -> dict:
    return {"device": "cpu", "dtype": "float32", "num_gpu_blocks": 16, "block_size": 4,
            "use_triton": False, **overrides}


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


# --------------------------------------------------------------------------- layout


@pytest.mark.parametrize("arch, extra", [
    ("LlamaForCausalLM", {}),
    ("LlamaForCausalLM", {"attention_bias": True, "tie_word_embeddings": True}),
    ("Qwen2ForCausalLM", {}),
    ("MistralForCausalLM", {}),
])
def test_layout_names_and_shapes_are_exactly_hf_state_dict(arch, extra):
    hf = build_hf(arch, **extra)
    spec = ModelSpec.from_hf_config({**hf.config.to_dict(), "architectures": [arch]})
    expected = {n: tuple(t.shape) for n, t in hf.state_dict().items()
                if not (spec.tie_word_embeddings and n == "lm_head.weight")}
    assert {n: s.shape for n, s in hf_weight_layout(spec).items()} == expected


# --------------------------------------------------------------------------- loading


def test_sharded_checkpoint_loads_the_same_weights(llama_dir, tmp_path):
    build_hf().save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    whole = ModelRunner.from_checkpoint(str(llama_dir), **runner_kwargs())
    sharded = ModelRunner.from_checkpoint(str(tmp_path), **runner_kwargs())
    for (name, a), (_, b) in zip(whole.model.named_parameters(), sharded.model.named_parameters()):
        assert torch.equal(a, b), name


def test_loaded_weights_land_in_fused_slots(llama_dir):
    runner = ModelRunner.from_checkpoint(str(llama_dir), **runner_kwargs(dtype="bfloat16"))
    tensors = load_file(llama_dir / "model.safetensors")
    qkv = runner.model.get_parameter("model.layers.1.self_attn.qkv_proj.weight")
    assert qkv.dtype == torch.bfloat16
    assert torch.equal(qkv[64:96], tensors["model.layers.1.self_attn.k_proj.weight"].bfloat16())
    gate_up = runner.model.get_parameter("model.layers.0.mlp.gate_up_proj.weight")
    assert torch.equal(gate_up[96:], tensors["model.layers.0.mlp.up_proj.weight"].bfloat16())


def test_unsupported_architecture_fails_before_allocating(llama_dir, tmp_path):
    folder = copy_checkpoint(llama_dir, tmp_path / "gpt2")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    spec = load_model_spec(str(llama_dir))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        ModelRunner(spec, checkpoint=str(folder), **runner_kwargs(num_gpu_blocks=HUGE))


def test_missing_tensor_is_named(llama_dir, tmp_path):
    folder = copy_checkpoint(llama_dir, tmp_path / "missing")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        ModelRunner.from_checkpoint(str(folder), **runner_kwargs(num_gpu_blocks=HUGE))


def test_mismatched_shape_names_tensor_and_both_shapes(llama_dir, tmp_path):
    folder = copy_checkpoint(llama_dir, tmp_path / "shape")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(16, 64)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.v_proj\.weight has shape "
                                         r"\(16, 64\), the model expects \(32, 64\)"):
        ModelRunner.from_checkpoint(str(folder), **runner_kwargs(num_gpu_blocks=HUGE))


def test_unexpected_tensor_is_named(llama_dir, tmp_path):
    folder = copy_checkpoint(llama_dir, tmp_path / "extra")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.gate_proj.bias"] = torch.zeros(96)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"does not use.*mlp\.gate_proj\.bias"):
        ModelRunner.from_checkpoint(str(folder), **runner_kwargs())


def test_checkpoint_that_disagrees_with_the_spec_is_refused(llama_dir):
    spec = load_model_spec(str(llama_dir))
    other = ModelSpec.from_hf_config({**spec.hf_config, "num_key_value_heads": 4}, name=spec.name)
    with pytest.raises(ValueError, match="num_kv_heads: checkpoint 2 vs spec 4"):
        plan_checkpoint(llama_dir, other)


def test_missing_folder_and_missing_config(tmp_path):
    spec = ModelSpec.from_hf_config({**TINY, "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="is not a directory"):
        plan_checkpoint(tmp_path / "nowhere", spec)
    with pytest.raises(ValueError, match="has no config.json"):
        plan_checkpoint(tmp_path, spec)


# --------------------------------------------------------------------------- random init


def test_random_init_is_seeded_and_typed():
    spec = ModelSpec.from_hf_config({**TINY, "architectures": ["LlamaForCausalLM"],
                                     "tie_word_embeddings": True})
    a = ModelRunner(spec, seed=3, **runner_kwargs(dtype="bf16"))
    b = ModelRunner(spec, seed=3, **runner_kwargs(dtype="bf16"))
    c = ModelRunner(spec, seed=4, **runner_kwargs(dtype="bf16"))
    params_a, params_b, params_c = (dict(r.model.named_parameters()) for r in (a, b, c))
    assert all(p.dtype == torch.bfloat16 for p in params_a.values())
    assert all(torch.equal(params_a[n], params_b[n]) for n in params_a)
    assert not torch.equal(params_a["model.layers.0.self_attn.qkv_proj.weight"],
                           params_c["model.layers.0.self_attn.qkv_proj.weight"])
    assert torch.equal(params_a["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    assert 0.015 < params_a["model.layers.0.mlp.down_proj.weight"].float().std() < 0.025
    assert a.model.lm_head.weight is a.model.model.embed_tokens.weight
    logits = a.run([SeqWork([1, 2, 3], 0, [0], True)])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("name, message", [
    ("tpu", "unknown device 'tpu'"),
    ("mps", "unsupported device 'mps'"),
    (f"cuda:{max(torch.cuda.device_count(), 7)}", "does not exist|not available"),
])
def test_bad_devices_are_refused_before_allocating(name, message):
    spec = ModelSpec.from_hf_config({**TINY, "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match=message):
        ModelRunner(spec, **runner_kwargs(device=name, num_gpu_blocks=HUGE))


def test_cuda_refused_on_a_machine_without_cuda_and_cpu_accepted():
    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_device("cuda") == torch.device("cuda", 0)
    else:
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


def test_dtypes():
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        resolve_dtype("int8")


def test_unsupported_model_features_are_refused():
    base = {**TINY, "architectures": ["LlamaForCausalLM"]}
    for extra, message in (({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
                           ({"mlp_bias": True}, "mlp_bias"),
                           ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
                            "'dynamic'")):
        spec = ModelSpec.from_hf_config({**base, **extra})
        with pytest.raises(ValueError, match=message):
            ModelRunner(spec, **runner_kwargs(num_gpu_blocks=HUGE))


def test_sequence_past_a_sliding_window_is_refused():
    spec = ModelSpec.from_hf_config({**TINY, "architectures": ["MistralForCausalLM"],
                                     "sliding_window": 8})
    runner = ModelRunner(spec, **runner_kwargs())
    runner.run([SeqWork(list(range(8)), 0, [0, 1], True)])
    with pytest.raises(ValueError, match="past the model's sliding window of 8"):
        runner.run([SeqWork([5], 8, [0, 1, 2], False)])


def test_bad_batches_are_refused():
    spec = ModelSpec.from_hf_config({**TINY, "architectures": ["LlamaForCausalLM"]})
    runner = ModelRunner(spec, **runner_kwargs())
    for seqs, message in (
        ([SeqWork([1, 2, 3, 4, 5], 0, [0], True)], "needs 2 blocks of 4 slots"),
        ([SeqWork([1, 2], 3, [0, 1], False)], "decode but computes 2 tokens"),
        ([SeqWork([], 0, [0], True)], "computes no tokens"),
        ([SeqWork([1], 0, [16], True)], r"block id outside \[0, 16\)"),
        ([SeqWork([1], 0, [-1], True)], r"block id outside"),
        ([SeqWork([300], 0, [0], True)], r"token id\(s\) \[300\] outside the vocabulary"),
        ([], "at least one sequence"),
    ):
        with pytest.raises(ValueError, match=message):
            runner.run(seqs)
    with pytest.raises(ValueError, match="all prefill sequences before all decode sequences"):
        build_attention_metadata([SeqWork([1], 2, [0], False), SeqWork([1], 0, [1], True)],
                                 block_size=4, device="cpu", use_triton=False)
