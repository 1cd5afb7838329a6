"""The mixture-of-experts runner (Mixtral, Qwen3-MoE) against Hugging Face transformers on
tiny random checkpoints, as tests/test_model_forward.py checks the dense ones.

Each variant is a 2-layer model (hidden 64, 4 heads, 2 kv heads, head_dim 16, vocab 256)
built by transformers from a seed, with norms perturbed and the routers drawn wide enough
that tokens spread over the experts (transformers starts Qwen3-MoE's router at zero, which
would route every token alike), saved with save_pretrained (the hub's per-expert tensor
names) and loaded by the runner. Tolerance: fp32 on both sides, 1e-4 absolute on logits.
"""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from _backend_device import DEVICE
from servelab.backends.attention import SeqWork, build_attention_metadata
from servelab.backends.model import ModelRunner, check_model_supported
from servelab.backends.weights import hf_weight_layout, init_random_weights
from servelab.models import load_model_spec
from test_model_forward import ATOL, TINY, make_runner, prompt, serve_greedy

VARIANTS = {
    # every layer routes, top-2 of 4, always renormalised
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_local_experts": 4, "num_experts_per_tok": 2, "rope_theta": 1e6}),
    # layer 1 dense (mlp_only_layers), renormalised top-2 of 6, q/k norms
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "norm_topk_prob": True, "mlp_only_layers": [1]}),
    # layer 0 dense ((0 + 1) % decoder_sparse_step != 0), top-3 weights not renormalised
    "qwen3-moe-sparse-step": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                              {"num_experts": 5, "num_experts_per_tok": 3,
                               "moe_intermediate_size": 24, "norm_topk_prob": False,
                               "decoder_sparse_step": 2}),
}


def save_tiny_moe_checkpoint(folder, variant: str, seed: int = 0):
    import transformers

    config_cls, model_cls, extra = VARIANTS[variant]
    config = getattr(transformers, config_cls)(**TINY, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".gate.weight"):      # the routers
                param.normal_(0.0, 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """variant -> (folder, HF model), each built once per module on first use."""
    built: dict[str, tuple] = {}

    def get(variant: str):
        if variant not in built:
            folder = tmp_path_factory.mktemp(variant)
            built[variant] = folder, save_tiny_moe_checkpoint(folder, variant)
        return built[variant]

    return get


def _forward_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    seq = SeqWork(ids, 0, list(range(-(-len(ids) // runner.block_size))), is_prefill=True)
    meta = build_attention_metadata([seq], runner.block_size, runner.device, use_triton=False)
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(ids, device=runner.device),
                              torch.arange(len(ids), device=runner.device), meta, runner.kv_cache)
        return runner.model.compute_logits(hidden)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_spec_reads_the_saved_config(checkpoints, variant):
    folder, hf = checkpoints(variant)
    spec = load_model_spec(str(folder))
    extra = VARIANTS[variant][2]
    assert spec.moe.num_experts == extra.get("num_local_experts", extra.get("num_experts"))
    assert spec.moe.experts_per_token == extra["num_experts_per_tok"]
    assert spec.moe.norm_topk_prob == extra.get("norm_topk_prob", True)
    dense = {"mixtral": (), "qwen3-moe": (1,), "qwen3-moe-sparse-step": (0,)}[variant]
    assert spec.moe.dense_layers == dense
    assert spec.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_layout_is_exactly_the_saved_checkpoint(checkpoints, variant):
    folder, _ = checkpoints(variant)
    spec = load_model_spec(str(folder))
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert {name: slot.shape for name, slot in hf_weight_layout(spec).items()} == saved


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_full_prompt_forward_matches_hf_at_every_position(checkpoints, variant):
    folder, hf = checkpoints(variant)
    runner = make_runner(folder)
    ids = prompt(1, 19)
    logits = _forward_logits(runner, ids)
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(logits.cpu(), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant, block_size", [
    ("mixtral", 4), ("mixtral", 16), ("qwen3-moe", 4), ("qwen3-moe-sparse-step", 4)])
def test_chunked_paged_mixed_batches_match_hf_generate(checkpoints, variant, block_size):
    folder, hf = checkpoints(variant)
    runner = make_runner(folder, block_size=block_size, num_gpu_blocks=48)
    prompts = [prompt(2, 13), prompt(3, 9), prompt(4, 6)]
    new_tokens = 8
    seqs = serve_greedy(runner, prompts, start_steps=[0, 1, 3], chunk=5, new_tokens=new_tokens)
    for s, p in zip(seqs, prompts):
        ids = torch.tensor([p])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=new_tokens, output_logits=True,
                              return_dict_in_generate=True)
        assert s.generated == out.sequences[0, len(p):].tolist()
        for mine, theirs in zip(s.logits, out.logits):
            torch.testing.assert_close(mine, theirs[0].float(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["mixtral", "qwen3-moe-sparse-step"])
def test_routing_matters(checkpoints, variant):
    """The tokens spread over the experts, and a wrong top-k normalisation moves the
    logits: the comparisons above can fail."""
    folder, _ = checkpoints(variant)
    runner = make_runner(folder)
    ids = prompt(5, 17)
    routed = [layer.mlp for layer in runner.model.model.layers if hasattr(layer.mlp, "gate")]
    router_logits = []
    for block in routed:
        block.gate.register_forward_hook(lambda module, args, out: router_logits.append(out))
    before = _forward_logits(runner, ids)
    for block, logits in zip(routed, router_logits, strict=True):
        chosen = torch.topk(logits, block.top_k, dim=-1).indices
        assert len(chosen.unique()) == len(block.experts)      # every expert gets tokens
    for layer in runner.model.model.layers:
        if hasattr(layer.mlp, "renormalise"):
            layer.mlp.renormalise = not layer.mlp.renormalise
    assert not torch.allclose(before, _forward_logits(runner, ids), atol=1e-3)


def test_catalog_tiny_moe_runs_from_seeded_random_weights():
    spec = load_model_spec("tiny-moe")
    kwargs = dict(device=DEVICE, dtype="float32", num_gpu_blocks=8, block_size=4, use_triton=False)
    first = ModelRunner(spec, seed=3, **kwargs)
    assert first.num_weight_bytes == spec.num_params * 4
    logits = first.run([SeqWork(prompt(6, 7), 0, [0, 1], True)])
    again = ModelRunner(spec, seed=3, **kwargs).run([SeqWork(prompt(6, 7), 0, [0, 1], True)])
    assert torch.equal(logits, again) and torch.isfinite(logits).all()
    other = ModelRunner(spec, seed=3, **kwargs)
    init_random_weights(other.model, seed=4)
    assert not torch.equal(logits, other.run([SeqWork(prompt(6, 7), 0, [0, 1], True)]))


@pytest.mark.kernels
def test_triton_attention_under_the_experts_matches_the_reference_path():
    """The MoE runner over the Triton kernels (interpreter on CPU) against the PyTorch
    references, on poisoned, non-contiguous block tables (as tests/test_model_triton.py)."""
    spec = load_model_spec("tiny-moe")
    kwargs = dict(device=DEVICE, dtype="float32", num_gpu_blocks=16, block_size=4, seed=1,
                  poison_kv=True)
    triton_runner = ModelRunner(spec, use_triton=True, **kwargs)
    reference_runner = ModelRunner(spec, use_triton=False, **kwargs)
    a, b = prompt(7, 7), prompt(8, 9)
    steps = [[SeqWork(a, 0, [9, 2], True), SeqWork(b[:5], 0, [5, 11, 0], True)],
             [SeqWork([3], 7, [9, 2], False), SeqWork(b[5:], 5, [5, 11, 0], True)]]
    for step in steps:
        got, expected = triton_runner.run(step), reference_runner.run(step)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_mla_is_refused_by_the_real_backend_in_one_line():
    with pytest.raises(ValueError, match=r"^DeepseekV3ForCausalLM uses multi-head latent "
                                         r"attention, which the real backend does not run "
                                         r"\(MLA is simulation-only\)$"):
        check_model_supported(load_model_spec("deepseek-v3"))
