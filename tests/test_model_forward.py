"""The paged Llama-family runner against Hugging Face transformers on tiny random checkpoints.

Each architecture gets a 2-layer model (hidden 64, 4 heads, 2 kv heads, head_dim 16,
vocab 256) built by transformers from a seed, with norms and biases perturbed so that
every tensor matters (Qwen3's per-head q/k norms included), saved with save_pretrained and
loaded by the runner. Tolerance:
fp32 on both sides, 1e-4 absolute on logits (observed differences are ~1e-6).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from _backend_device import DEVICE
from servelab.backends.attention import SeqWork, build_attention_metadata
from servelab.backends.model import ModelRunner, rope_config, rope_inv_freq
from servelab.models import load_model_spec

ATOL = 1e-4
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 50000.0}),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM",
                    {"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE}),
    "llama-bias-tied": ("LlamaConfig", "LlamaForCausalLM",
                        {"attention_bias": True, "tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_theta": 1000000.0}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"rope_theta": 1000000.0}),
    "qwen3-bias": ("Qwen3Config", "Qwen3ForCausalLM", {"attention_bias": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4096}),
}


def save_tiny_checkpoint(folder, variant: str, seed: int = 0):
    """Builds the variant with transformers (seeded), perturbs norms and biases away from
    their 1/0 init, saves it as safetensors in `folder`, and returns the HF model."""
    import transformers

    config_cls, model_cls, extra = VARIANTS[variant]
    config = getattr(transformers, config_cls)(**TINY, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """variant -> (folder, HF model), each built once per module on first use."""
    built: dict[str, tuple] = {}

    def get(variant: str):
        if variant not in built:
            folder = tmp_path_factory.mktemp(variant)
            built[variant] = folder, save_tiny_checkpoint(folder, variant)
        return built[variant]

    return get


def make_runner(folder, block_size: int = 4, num_gpu_blocks: int = 64) -> ModelRunner:
    return ModelRunner.from_checkpoint(str(folder), device=DEVICE, dtype="float32",
                                       num_gpu_blocks=num_gpu_blocks, block_size=block_size,
                                       use_triton=False, poison_kv=True)


def prompt(seed: int, length: int) -> list[int]:
    return random.Random(seed).choices(range(256), k=length)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_full_prompt_forward_matches_hf_at_every_position(checkpoints, variant):
    folder, hf = checkpoints(variant)
    runner = make_runner(folder)
    ids = prompt(1, 19)
    seq = SeqWork(ids, 0, [9, 2, 30, 7, 41], is_prefill=True)
    meta = build_attention_metadata([seq], runner.block_size, runner.device, use_triton=False)
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(ids, device=runner.device),
                              torch.arange(len(ids), device=runner.device), meta, runner.kv_cache)
        logits = runner.model.compute_logits(hidden)
        expected = hf(torch.tensor([ids])).logits[0].float()
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.cpu(), expected, atol=ATOL, rtol=0)


@dataclass
class _Seq:
    tokens: list[int]
    prompt_len: int
    start_step: int
    table: list[int] = field(default_factory=list)
    computed: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


def serve_greedy(runner: ModelRunner, prompts: list[list[int]], start_steps: list[int],
                 chunk: int, new_tokens: int, seed: int = 0) -> list[_Seq]:
    """A miniature engine: chunked prefill, greedy decode, blocks handed out lazily from a
    shuffled free list so block tables are non-contiguous and interleaved across sequences.
    Sequences join at their start step, so prefill chunks share steps with decodes."""
    free = list(range(runner.kv_cache.num_blocks))
    random.Random(seed).shuffle(free)
    seqs = [_Seq(list(p), len(p), s) for p, s in zip(prompts, start_steps)]
    step = 0
    while any(len(s.generated) < new_tokens for s in seqs):
        work, owners = [], []
        for s in seqs:
            if step < s.start_step or len(s.generated) == new_tokens:
                continue
            is_prefill = s.computed < s.prompt_len
            ids = s.tokens[s.computed: s.computed + chunk] if is_prefill else s.tokens[-1:]
            while len(s.table) * runner.block_size < s.computed + len(ids):
                s.table.append(free.pop())
            work.append(SeqWork(ids, s.computed, list(s.table), is_prefill))
            owners.append(s)
        logits = runner.run(work)
        for row, s in enumerate(owners):
            s.computed += work[row].num_tokens
            if s.computed == len(s.tokens):
                s.logits.append(logits[row].cpu())
                s.tokens.append(int(logits[row].argmax()))
        step += 1
    return seqs


@pytest.mark.parametrize("variant, block_size", [
    ("llama", 4), ("llama", 16), ("llama3-rope", 4), ("llama-bias-tied", 4), ("qwen2", 4),
    ("qwen2", 16), ("qwen3", 4), ("qwen3", 16), ("qwen3-bias", 4), ("mistral", 4)])
def test_chunked_paged_mixed_batches_match_hf_generate(checkpoints, variant, block_size):
    folder, hf = checkpoints(variant)
    runner = make_runner(folder, block_size=block_size, num_gpu_blocks=48)
    prompts = [prompt(2, 13), prompt(3, 9), prompt(4, 6)]
    new_tokens = 8
    seqs = serve_greedy(runner, prompts, start_steps=[0, 1, 3], chunk=5, new_tokens=new_tokens)
    assert any(b != a + 1 for s in seqs for a, b in zip(s.table, s.table[1:]))
    for s, p in zip(seqs, prompts):
        ids = torch.tensor([p])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=new_tokens, output_logits=True,
                              return_dict_in_generate=True)
        assert s.generated == out.sequences[0, len(p):].tolist()
        assert len(s.logits) == len(out.logits) == new_tokens
        for mine, theirs in zip(s.logits, out.logits):
            torch.testing.assert_close(mine, theirs[0].float(), atol=ATOL, rtol=0)


def test_run_returns_rows_in_the_order_given(checkpoints):
    folder, hf = checkpoints("llama")
    runner = make_runner(folder)
    a, b = prompt(5, 7), prompt(6, 3)
    runner.run([SeqWork(b, 0, [2], True)])
    # b's decode row is listed before a's prefill row; each row must hold its own logits.
    mixed = runner.run([SeqWork([17], 3, [2], False), SeqWork(a, 0, [5, 6], True)])
    with torch.no_grad():
        expected_b = hf(torch.tensor([b + [17]])).logits[0, -1]
        expected_a = hf(torch.tensor([a])).logits[0, -1]
    torch.testing.assert_close(mixed[0].cpu(), expected_b, atol=ATOL, rtol=0)
    torch.testing.assert_close(mixed[1].cpu(), expected_a, atol=ATOL, rtol=0)


def test_llama3_rope_scaling_matches_hf_inverse_frequencies(checkpoints):
    folder, hf = checkpoints("llama3-rope")
    spec = load_model_spec(str(folder))
    rope = rope_config(spec)
    assert (rope.rope_type, rope.theta, rope.factor) == ("llama3", 500000.0, 8.0)
    ours = rope_inv_freq(rope, spec.head_dim)
    torch.testing.assert_close(ours, hf.model.rotary_emb.inv_freq.float(), atol=0, rtol=1e-6)
    plain = rope_inv_freq(type(rope)(rope.theta), spec.head_dim)
    assert not torch.allclose(ours, plain)   # the scaling changes something in this config


def test_rope_config_reads_the_transformers_v4_spelling():
    from servelab.models import ModelSpec

    config = {"architectures": ["LlamaForCausalLM"], "rope_theta": 500000.0,
              "rope_scaling": dict(LLAMA3_ROPE), **TINY}
    rope = rope_config(ModelSpec.from_hf_config(config))
    assert rope.rope_type == "llama3" and rope.theta == 500000.0
    assert rope.original_max_position_embeddings == 32
    with pytest.raises(ValueError, match="'yarn' is not supported"):
        yarn = {"rope_type": "yarn", "factor": 2.0}
        rope_config(ModelSpec.from_hf_config({**config, "rope_scaling": yarn}))


def test_qwen3_per_head_qk_norm_changes_the_output(checkpoints):
    """The q/k norms are loaded and applied: with their weights reset to 1 the logits move."""
    folder, hf = checkpoints("qwen3")
    runner = make_runner(folder)
    assert runner.spec.qk_norm and runner.model.model.layers[0].self_attn.q_norm is not None
    ids = prompt(7, 11)
    seq = SeqWork(ids, 0, [3, 8, 1], is_prefill=True)

    def logits():
        meta = build_attention_metadata([seq], runner.block_size, runner.device, use_triton=False)
        with torch.inference_mode():
            return runner.model.compute_logits(
                runner.model(torch.tensor(ids, device=runner.device),
                             torch.arange(len(ids), device=runner.device), meta, runner.kv_cache))

    before = logits()
    with torch.no_grad():
        for layer in runner.model.model.layers:
            layer.self_attn.q_norm.weight.fill_(1.0)
            layer.self_attn.k_norm.weight.fill_(1.0)
    assert not torch.allclose(before, logits(), atol=1e-3)


def test_an_moe_config_missing_its_expert_fields_is_refused_with_one_line():
    from servelab.models import ModelSpec

    config = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128, **TINY}
    with pytest.raises(ValueError, match="^Qwen3MoeForCausalLM is a mixture-of-experts model"):
        ModelSpec.from_hf_config(config)
