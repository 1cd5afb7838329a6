"""A Llama-family decoder over a paged KV cache, and the runner that owns model and cache.

Covers Llama 2/3/3.1, Mistral, Qwen2 (attention bias on q/k/v) and Qwen3 (an RMSNorm over
each head of q and k before RoPE, as transformers' `Qwen3Attention` does): RMSNorm, RoPE
(plain or Llama-3.1 "llama3" frequency scaling), grouped-query attention, SwiGLU MLP, tied
or separate LM head; mixture-of-experts layers (Mixtral, Qwen3-MoE) route each token to
its top-k SwiGLU experts (`SparseMoeBlock`). DeepSeek's multi-head latent attention is
simulation-only. The forward pass takes a flattened batch with no padding — prefill
chunks first, then decode tokens — so a step costs what its tokens cost, whatever mix of
sequences they come from. Attention reads and writes the paged cache through
`servelab.backends.kernels` (Triton or the PyTorch reference).

Numerics follow Hugging Face transformers: norms in fp32, residual adds in the model
dtype, RoPE angles in fp32, logits returned in fp32.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from servelab.backends.attention import (AttentionMetadata, SeqWork, build_attention_metadata,
                                         paged_attention)
from servelab.backends.kv_cache import KVCache
from servelab.backends.weights import (init_random_weights, load_checkpoint,
                                       o_proj_has_bias, plan_checkpoint, resolve_device,
                                       resolve_dtype)
from servelab.models import SIMULATION_ONLY_ARCHITECTURES, ModelSpec, load_model_spec

__all__ = ["RopeConfig", "rope_config", "rope_inv_freq", "check_model_supported", "CausalLM",
           "ModelRunner"]


# --------------------------------------------------------------------------- RoPE


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    """"default" (plain RoPE) or "llama3" (Llama 3.1 frequency-dependent scaling)."""
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def rope_config(spec: ModelSpec) -> RopeConfig:
    """RoPE parameters from the config, in either spelling transformers writes: v4's
    `rope_theta` + `rope_scaling`, or v5's `rope_parameters` (which holds `rope_theta`)."""
    cfg = spec.hf_config
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type RoPE parameters are not supported")
    if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    theta = float(params.get("rope_theta", spec.rope_theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return RopeConfig(theta)
    if rope_type != "llama3":
        raise ValueError(f"RoPE scaling {rope_type!r} is not supported; servelab runs plain RoPE "
                         "and Llama 3.1's 'llama3' scaling")
    try:
        return RopeConfig(theta, "llama3", float(params["factor"]),
                          float(params["low_freq_factor"]), float(params["high_freq_factor"]),
                          int(params.get("original_max_position_embeddings",
                                         spec.max_position_embeddings)))
    except KeyError as exc:
        raise ValueError(f"llama3 rope scaling lacks the field {exc.args[0]!r}") from None


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], fp32 on the CPU.

    llama3 scaling keeps high frequencies (wavelength below original_len / high_freq_factor),
    divides low frequencies (wavelength above original_len / low_freq_factor) by `factor`,
    and interpolates linearly in original_len / wavelength between the two."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "default":
        return inv_freq
    old_len = rope.original_max_position_embeddings
    low, high = rope.low_freq_factor, rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / rope.factor, inv_freq)
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, interpolated, scaled)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the halves (GPT-NeoX layout) of x [T, heads, D] by angles cos/sin [T, 1, D/2],
    computing in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


# --------------------------------------------------------------------------- modules


def check_model_supported(spec: ModelSpec) -> None:
    """Raises ValueError for config features this decoder does not implement."""
    cfg = spec.hf_config
    if spec.architecture in SIMULATION_ONLY_ARCHITECTURES:
        raise ValueError(f"{spec.name} ({spec.architecture}) is simulation-only: the real backend "
                         "runs RoPE / RMSNorm / SwiGLU decoders; use servelab simulate")
    if spec.mla is not None:
        raise ValueError(f"{spec.architecture} uses multi-head latent attention, which the real "
                         "backend does not run (MLA is simulation-only)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
    if cfg.get("mlp_bias", False):
        raise ValueError("mlp_bias is not supported")
    if spec.head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {spec.head_dim}")
    rope_config(spec)


def _param(*shape: int, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, **where) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(size, **where)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, **where) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, **where)
        self.bias = _param(out_features, **where) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, **where) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = spec.num_heads, spec.num_kv_heads
        self.head_dim = spec.head_dim
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.split = (q, kv, kv)
        self.scale = spec.head_dim ** -0.5
        self.qkv_proj = Linear(spec.hidden_size, q + 2 * kv, spec.attention_bias, **where)
        self.o_proj = Linear(q, spec.hidden_size, o_proj_has_bias(spec), **where)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, **where) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, **where) if spec.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        num_tokens = x.shape[0]
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:   # per head, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one GEMM."""

    def __init__(self, hidden_size: int, intermediate_size: int, **where) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, False, **where)
        self.down_proj = Linear(intermediate_size, hidden_size, False, **where)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoeBlock(nn.Module):
    """Mixtral / Qwen3-MoE experts: the router's softmax (fp32) over the experts, each
    token's top-k, renormalised to sum to 1 when `norm_topk_prob`, then every expert runs
    its SwiGLU on the tokens routed to it and adds its output, times the token's weight, in
    expert order (transformers' `MixtralSparseMoeBlock`, `Qwen3MoeSparseMoeBlock`). Costs
    top-k expert MLPs per token, one small GEMM per expert that any token chose."""

    def __init__(self, spec: ModelSpec, **where) -> None:
        super().__init__()
        moe = spec.moe
        self.top_k, self.renormalise = moe.experts_per_token, moe.norm_topk_prob
        self.gate = Linear(spec.hidden_size, moe.num_experts, False, **where)
        self.experts = nn.ModuleList(MLP(spec.hidden_size, moe.expert_intermediate_size, **where)
                                     for _ in range(moe.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)     # [T, k]
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for expert in chosen.unique().tolist():
            token, slot = torch.where(chosen == expert)
            y = self.experts[expert](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(x.dtype))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, index: int, **where) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **where)
        self.self_attn = Attention(spec, **where)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **where)
        routed = spec.moe is not None and index not in spec.moe.dense_layers
        self.mlp = (SparseMoeBlock(spec, **where) if routed
                    else MLP(spec.hidden_size, spec.intermediate_size, **where))

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, meta, k_cache, v_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderStack(nn.Module):
    def __init__(self, spec: ModelSpec, **where) -> None:
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = _param(spec.vocab_size, spec.hidden_size, **where)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, **where) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **where)


class CausalLM(nn.Module):
    """The decoder with an LM head; parameter names are Hugging Face's except for the fused
    `qkv_proj` and `gate_up_proj` (see `weights.hf_weight_layout`).

    Parameters are allocated uninitialised on `device` in `dtype`; fill them with
    `weights.load_checkpoint` or `weights.init_random_weights`."""

    def __init__(self, spec: ModelSpec, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        check_model_supported(spec)
        where = {"device": device, "dtype": dtype}
        self.spec = spec
        self.model = DecoderStack(spec, **where)
        self.lm_head = nn.Module()
        self.lm_head.weight = (self.model.embed_tokens.weight if spec.tie_word_embeddings
                               else _param(spec.vocab_size, spec.hidden_size, **where))
        self.register_buffer("inv_freq", rope_inv_freq(rope_config(spec), spec.head_dim).to(device),
                             persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for a flattened batch of T tokens
        (input_ids and positions [T] int64) whose layout `meta` describes."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        h = F.embedding(input_ids, self.model.embed_tokens.weight)
        for index, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, meta, *kv_cache.layer(index))
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, hidden] -> [S, vocab] fp32."""
        return F.linear(hidden, self.lm_head.weight).float()


# --------------------------------------------------------------------------- runner


def sliding_window(spec: ModelSpec) -> int | None:
    """The attention window the config asks for, if any (full attention is all we run)."""
    cfg = spec.hf_config
    window = cfg.get("sliding_window")
    if spec.architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") \
            and not cfg.get("use_sliding_window", False):
        return None
    return int(window) if window else None


class ModelRunner:
    """Owns the model and its KV cache; `run` computes one step of a flattened batch.

    Construction checks everything it can before allocating: the device exists, the spec's
    features are supported, and the checkpoint (if any) matches the spec tensor by tensor.
    The KV cache is allocated before the weights are read, so a cache that does not fit
    fails before the (slow) load. Without a checkpoint the weights are seeded random
    (`seed`), so any catalog model can be timed without downloads.

    Per engine step the executor calls `offload`, `swap_out`, `swap_in`, `load`,
    `copy_blocks` (the scheduler's block moves, in that order), then `run`, then
    `sampling.sample` on the logits of the sequences that draw a token.
    """

    def __init__(self, spec: ModelSpec, *, device: str | torch.device,
                 dtype: str | torch.dtype, num_gpu_blocks: int, num_cpu_blocks: int = 0,
                 num_host_blocks: int = 0, block_size: int = 16, use_triton: bool, checkpoint: str | Path | None = None,
                 seed: int = 0, poison_kv: bool = False) -> None:
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        check_model_supported(spec)
        plan = plan_checkpoint(checkpoint, spec) if checkpoint is not None else None
        self.spec = spec
        self.block_size = block_size
        self.use_triton = use_triton
        self.sliding_window = sliding_window(spec)
        self.kv_cache = KVCache(num_layers=spec.num_layers, num_blocks=num_gpu_blocks,
                                block_size=block_size, num_kv_heads=spec.num_kv_heads,
                                head_dim=spec.head_dim, dtype=self.dtype, device=self.device,
                                num_cpu_blocks=num_cpu_blocks,
                                num_host_blocks=num_host_blocks, poison=poison_kv)
        self.model = CausalLM(spec, device=self.device, dtype=self.dtype)
        if plan is not None:
            load_checkpoint(self.model, plan, spec)
        else:
            init_random_weights(self.model, seed)

    @classmethod
    def from_checkpoint(cls, path: str | Path, **kwargs) -> "ModelRunner":
        """A runner whose spec is read from the checkpoint's own config.json."""
        return cls(load_model_spec(str(path)), checkpoint=path, **kwargs)

    @property
    def num_weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def _check_window(self, seqs: list[SeqWork]) -> None:
        if self.sliding_window is None:
            return
        for i, seq in enumerate(seqs):
            if seq.seq_len > self.sliding_window:
                raise ValueError(f"seqs[{i}] reaches {seq.seq_len} tokens, past the model's "
                                 f"sliding window of {self.sliding_window}; only full attention "
                                 "is implemented")

    @torch.inference_mode()
    def run(self, seqs: list[SeqWork], num_logits: list[int] | None = None) -> torch.Tensor:
        """Computes one step and returns the logits fp32 of each sequence's last token,
        [len(seqs), vocab] in the order of `seqs` (any prefill/decode order). With
        `num_logits`, of each sequence's last num_logits[i] tokens instead (a speculative
        verify step reads all of its tokens'), sequence after sequence."""
        if not seqs:
            raise ValueError("run() needs at least one sequence")
        counts = [1] * len(seqs) if num_logits is None else list(num_logits)
        if num_logits is not None and (len(counts) != len(seqs) or any(
                not 1 <= n <= s.num_tokens for n, s in zip(counts, seqs))):
            raise ValueError("run(): num_logits needs one count per sequence, each between 1 "
                             "and the sequence's num_tokens")
        self._check_window(seqs)
        order = ([i for i, s in enumerate(seqs) if s.is_prefill]
                 + [i for i, s in enumerate(seqs) if not s.is_prefill])
        batch = [seqs[i] for i in order]
        meta = build_attention_metadata(batch, self.block_size, self.device, self.use_triton,
                                        num_blocks=self.kv_cache.num_blocks)
        ids = [t for s in batch for t in s.token_ids]
        positions = [s.context_len + j for s in batch for j in range(s.num_tokens)]
        bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise ValueError(f"token id(s) {bad[:5]} outside the vocabulary "
                             f"[0, {self.spec.vocab_size})")
        input_ids = torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
        positions_t = torch.tensor(positions, dtype=torch.int64).to(self.device, non_blocking=True)
        # the rows read, in batch order, and where each goes in the answer (seqs order)
        ends = itertools.accumulate(s.num_tokens for s in batch)
        rows = [end - counts[i] + j for end, i in zip(ends, order) for j in range(counts[i])]
        first_row = [0, *itertools.accumulate(counts)]
        dest = [first_row[i] + j for i in order for j in range(counts[i])]
        hidden = self.model(input_ids, positions_t, meta, self.kv_cache)
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        out = torch.empty_like(logits)
        out[torch.tensor(dest, device=self.device)] = logits
        return out

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self.kv_cache.swap_out(pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self.kv_cache.swap_in(pairs)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.kv_cache.copy_blocks(pairs)

    def offload(self, pairs: list[tuple[int, int]]) -> None:
        self.kv_cache.offload(pairs)

    def load(self, pairs: list[tuple[int, int]]) -> None:
        self.kv_cache.load(pairs)
