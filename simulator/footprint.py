"""A model's footprint on one GPU under tensor parallelism: shapes, weights, KV capacity.

The cost model and the KV-capacity calculation both need "how big is this on one GPU":
the weights each GEMM streams, the activations it reads and writes per token, the KV a
token occupies, the bytes a collective moves. Megatron-style TP splits attention heads,
the MLP's intermediate dimension and the vocabulary tp ways; KV heads are split too, or
replicated when tp exceeds them (each GPU then keeps one), as engines do. Hidden-size
activations and norms stay whole on every GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

from servelab.capacity import VLLM_FUSED_BF16
from servelab.capacity import kv_capacity_blocks as engine_kv_capacity_blocks
from servelab.models import ModelSpec, load_model_spec
from servelab.simulator.gpus import DTYPE_BYTES, GIB, GPUSpec, get_gpu

ACT_BYTES = 2
"""Activations, norms, biases, embeddings and the LM head are BF16 whatever the weight
dtype (FP8 checkpoints quantise the linear layers of the blocks only)."""


@dataclass(frozen=True, slots=True)
class Gemm:
    """One GEMM of the stack on one GPU, [tokens, k] x [k, n] (`repeat` times: once per
    layer, or once)."""

    name: str
    n: int
    """Output features (the weight's columns on this GPU)."""
    k: int
    """Reduction dimension (input features)."""
    weight_bytes: int
    """Bytes streamed from HBM per call (weights in their dtype, plus any BF16 bias)."""
    repeat: int

    @property
    def weight_elems(self) -> int:
        """Multiply-accumulate weights: FLOPs per token = 2 · weight_elems."""
        return self.n * self.k


@dataclass(frozen=True, slots=True)
class Elementwise:
    """One bandwidth-bound kernel of the stack on one GPU (`repeat` times per step)."""

    name: str
    bytes_per_row: int
    """Bytes read plus written per token (or per sequence, when `per_seq`)."""
    repeat: int
    per_seq: bool = False
    """Runs over the sampled rows (one per sequence) rather than over every token."""


@dataclass(frozen=True, slots=True)
class ShardedShapes:
    tp: int
    num_layers: int
    hidden: int
    heads: int
    """Query heads on one GPU."""
    kv_heads: int
    """KV heads on one GPU (replicated when tp exceeds them)."""
    head_dim: int
    q_dim: int
    """Query width on one GPU: heads/tp · head_dim."""
    kv_dim: int
    """K (or V) width on one GPU: kv heads per GPU · head_dim."""
    intermediate: int
    vocab: int
    """Vocabulary rows of the LM head on one GPU (padded up to a multiple of tp)."""
    kv_elem_bytes: int
    kv_bytes_per_token: int
    """K and V of one token across all layers on one GPU, in the KV dtype."""
    weight_dtype: str
    gemms: tuple[Gemm, ...]
    """qkv_proj, o_proj, mlp_gate_up, mlp_down (per layer), lm_head — in this order."""
    elementwise: tuple[Elementwise, ...]
    allreduce_bytes_per_token: int
    """Message bytes per token of one all-reduce of the hidden state (two per layer under
    TP: after attention and after the MLP)."""
    gather_bytes_per_seq: int
    """Bytes of one sampled row's full-vocabulary logits, all-gathered under TP."""

    @classmethod
    def of(cls, model: ModelSpec, tp: int = 1, weight_dtype: str = "bf16",
           kv_dtype: str = "bf16") -> "ShardedShapes":
        for name, dtype in (("weight_dtype", weight_dtype), ("kv_dtype", kv_dtype)):
            if dtype not in DTYPE_BYTES:
                raise ValueError(f"{name} must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp must be an integer >= 1, got {tp!r}")
        if model.num_heads % tp or model.intermediate_size % tp:
            raise ValueError(f"tp={tp} must divide {model.name}'s attention heads "
                             f"({model.num_heads}) and intermediate size ({model.intermediate_size})")
        if model.num_kv_heads % tp and tp % model.num_kv_heads:
            raise ValueError(f"tp={tp} must divide, or be a multiple of, {model.name}'s "
                             f"{model.num_kv_heads} KV heads")
        wb, kvb, a = DTYPE_BYTES[weight_dtype], DTYPE_BYTES[kv_dtype], ACT_BYTES
        L, h, hd = model.num_layers, model.hidden_size, model.head_dim
        heads, kv_heads = model.num_heads // tp, max(1, model.num_kv_heads // tp)
        q, kv = heads * hd, kv_heads * hd
        inter = model.intermediate_size // tp
        vocab = -(-model.vocab_size // tp)          # engines pad the vocabulary to a multiple
        qkv_out = q + 2 * kv
        bias = qkv_out * ACT_BYTES if model.attention_bias else 0
        gemms = (
            Gemm("qkv_proj", qkv_out, h, h * qkv_out * wb + bias, L),
            Gemm("o_proj", h, q, q * h * wb, L),
            Gemm("mlp_gate_up", 2 * inter, h, h * 2 * inter * wb, L),
            Gemm("mlp_down", h, inter, inter * h * wb, L),
            Gemm("lm_head", vocab, h, h * vocab * ACT_BYTES, 1),
        )
        # The fused kernels of a vLLM-style engine, bytes read + written per row (the
        # KV-cache write is launched with attention and priced there):
        elementwise = (
            # residual add + RMSNorm: read x and the residual, write both
            Elementwise("input_norm", 4 * h * a, L),
            # rotary on Q and K in place, reading cos/sin for the position
            Elementwise("rotary", (2 * (q + kv) + hd) * a, L),
            Elementwise("post_attention_norm", 4 * h * a, L),
            # SiLU(gate) * up: read both halves, write one
            Elementwise("silu_mul", 3 * inter * a, L),
            # embedding gather: token id, the table row, the output row
            Elementwise("embedding", 8 + 2 * h * a, 1),
            Elementwise("final_norm", 4 * h * a, 1),
            # sampling over the full vocabulary: read the logits, write FP32 probabilities
            Elementwise("sampler", model.vocab_size * (a + 4), 1, per_seq=True),
        )
        return cls(
            tp=tp, num_layers=L, hidden=h, heads=heads, kv_heads=kv_heads, head_dim=hd,
            q_dim=q, kv_dim=kv, intermediate=inter, vocab=vocab, kv_elem_bytes=kvb,
            kv_bytes_per_token=2 * L * kv * kvb, weight_dtype=weight_dtype, gemms=gemms,
            elementwise=elementwise, allreduce_bytes_per_token=h * a,
            gather_bytes_per_seq=vocab * tp * a if tp > 1 else 0,
        )


def weight_bytes_per_gpu(model: ModelSpec, tp: int = 1, weight_dtype: str = "bf16") -> int:
    """Bytes of weights one GPU holds: its GEMM shards, the embedding shard (shared with
    the LM head when tied) and the replicated norms. At tp=1 in BF16 this is exactly
    2 · `ModelSpec.num_params`."""
    s = ShardedShapes.of(model, tp, weight_dtype)
    gemms = sum(g.weight_bytes * g.repeat for g in s.gemms)
    embedding = 0 if model.tie_word_embeddings else s.vocab * s.hidden * ACT_BYTES
    norms = (2 * s.num_layers + 1) * s.hidden * ACT_BYTES
    qk_norms = 2 * s.num_layers * s.head_dim * ACT_BYTES if model.qk_norm else 0   # Qwen3
    return gemms + embedding + norms + qk_norms


# --- KV capacity, derived as an engine derives it ------------------------------------------

def activation_reserve_bytes(model: ModelSpec, tp: int = 1, max_num_batched_tokens: int = 2048,
                             max_num_seqs: int = 128) -> int:
    """Peak activation memory of a full-budget step on one GPU of the engine the simulator
    models (`servelab.capacity.VLLM_FUSED_BF16`), plus the non-torch reserve."""
    s = ShardedShapes.of(model, tp)
    return VLLM_FUSED_BF16.bytes(hidden=s.hidden, qkv=s.q_dim + 2 * s.kv_dim,
                                 intermediate=s.intermediate, vocab=s.vocab,
                                 max_num_batched_tokens=max_num_batched_tokens,
                                 max_num_seqs=max_num_seqs)


def kv_capacity_blocks(model: ModelSpec | str, gpu: GPUSpec | str, tp: int = 1,
                       block_size: int = 16, gpu_memory_utilization: float = 0.9,
                       kv_dtype: str = "bf16", weight_dtype: str = "bf16",
                       activation_reserve_gb: float | None = None,
                       max_num_batched_tokens: int = 2048, max_num_seqs: int = 128) -> int:
    """KV blocks that fit on each GPU (`servelab.capacity.kv_capacity_blocks`, the formula
    the real backend uses too): memory × utilization − weights/tp − activation reserve,
    over the bytes of a block on one GPU.

    `activation_reserve_gb` (GiB, as the catalog reads GB) replaces the modelled reserve
    (`activation_reserve_bytes`). Raises ValueError when the weights or the reserve leave
    no room for one block.
    """
    model = load_model_spec(model) if isinstance(model, str) else model
    gpu = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    shapes = ShardedShapes.of(model, tp, weight_dtype, kv_dtype)
    budget = gpu.memory_bytes * gpu_memory_utilization
    weights = weight_bytes_per_gpu(model, tp, weight_dtype)
    if activation_reserve_gb is None:
        reserve = activation_reserve_bytes(model, tp, max_num_batched_tokens, max_num_seqs)
    elif activation_reserve_gb < 0:
        raise ValueError(f"activation_reserve_gb must be >= 0, got {activation_reserve_gb!r}")
    else:
        reserve = activation_reserve_gb * GIB
    if weights >= budget:
        raise ValueError(
            f"{model.name} weights need {weights / GIB:.1f} GiB per GPU at tp={tp} "
            f"({weight_dtype}), but {gpu.name} offers {budget / GIB:.1f} GiB at "
            f"gpu_memory_utilization={gpu_memory_utilization}: raise tp or use fp8 weights")
    return engine_kv_capacity_blocks(
        memory_bytes=gpu.memory_bytes, gpu_memory_utilization=gpu_memory_utilization,
        weight_bytes=weights, reserve_bytes=reserve,
        block_bytes=block_size * shapes.kv_bytes_per_token, where=f"{model.name} on {gpu.name}")
