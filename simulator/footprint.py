"""A model's footprint on one GPU under tensor parallelism: shapes, weights, KV capacity.

The cost model and the KV-capacity calculation both need "how big is this on one GPU":
the weights each GEMM streams, the activations it reads and writes per token, the KV a
token occupies, the bytes a collective moves. Megatron-style TP splits attention heads,
the MLP's intermediate dimension and the vocabulary tp ways; KV heads are split too, or
replicated when tp exceeds them (each GPU then keeps one), as engines do. Hidden-size
activations and norms stay whole on every GPU.

Mixture-of-experts and MLA models (`Footprint`) are laid out as vLLM lays them out:

- Without expert parallelism (`ep=1`) every expert is split tp ways along its
  intermediate dimension, like a dense MLP. With `ep` > 1 (vLLM's
  `--enable-expert-parallel`) the routed experts are spread whole over `ep` GPUs, which
  are the TP × DP GPUs of the replica, so `ep` is a multiple of `tp`; attention stays
  tensor-parallel within each group of `tp` GPUs and is replicated across the `ep / tp`
  data-parallel groups (vLLM `FusedMoEParallelConfig.make`, in
  `vllm/model_executor/layers/fused_moe/config.py`: "When TP = 2, DP = 1 and EP = True ...
  The experts are split between the 2 devices"; docs.vllm.ai, serving/
  data_parallel_deployment: "expert layers form a tensor parallel group of size DP × TP",
  or an EP group with `--enable-expert-parallel`). Shared experts, dense leading layers,
  embeddings and the LM head stay tensor-parallel; the router is replicated, in BF16
  (vLLM builds it as a `ReplicatedLinear` without quantisation).
- MLA caches one latent (kv_lora_rank + qk_rope_head_dim values) per token and layer,
  which has no head dimension to split: every TP rank holds the whole latent of its
  tokens (why vLLM's data-parallel deployment doc recommends data-parallel attention for
  MLA models). Its query/KV down-projections are replicated and the per-head
  up-projections and o_proj split tp ways (vLLM `models/deepseek_v2.py`).

`ShardedShapes` is what the step-time cost model prices, for every model: the GEMMs and
kernels of a dense model; for a mixture-of-experts model also its `ExpertShard` (the routed
experts one GPU runs, priced by the fused-MoE kernel) and its router and shared experts as
GEMMs; for an MLA model its projections as GEMMs and the latent attention itself as the
MLA kernels (which include the per-head up-projection, `kv_b_proj`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from servelab._validate import check_bounded
from servelab.capacity import VLLM_FUSED_BF16
from servelab.capacity import kv_capacity_blocks as engine_kv_capacity_blocks
from servelab.models import MLASpec, ModelSpec, load_model_spec
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


class ExpertShard(NamedTuple):
    """The routed experts of every MoE layer as one GPU of a replica runs them (vLLM's
    fused MoE, `kernels.moe`): all `experts` route, this GPU holds experts / ep of them,
    each `width` wide (whole under expert parallelism, split tp ways without it)."""

    num_layers: int
    """MoE layers (the others have the dense MLP)."""
    experts: int
    topk: int
    hidden: int
    width: int
    """Intermediate width of one expert on this GPU."""
    ep: int
    dp: int
    """Data-parallel attention ranks whose tokens every MoE layer runs over together:
    ep / tp under expert parallelism wider than tp, else 1."""
    default_routing: bool = True
    """The engine's default BF16 fused-MoE kernel takes this layer's routing: top-k
    renormalised (Mixtral; Qwen3-MoE with `norm_topk_prob`, vLLM's `renormalize`) or
    DeepSeek-V3's grouped sigmoid top-k; False for plain softmax top-k, which vLLM 0.24
    on Blackwell sends to FlashInfer's CUTLASS kernel (`KernelParams.moe_cutlass`)."""


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
    """Dense models: qkv_proj, o_proj, mlp_gate_up, mlp_down (per layer), lm_head — in this
    order; a two-matrix MLP (OPT) has mlp_fc1, mlp_fc2 in place of mlp_gate_up, mlp_down.
    Mixture-of-experts and MLA models (`_build_shapes`): their attention projections, the
    dense layers' MLP, the router and shared experts, then lm_head."""
    elementwise: tuple[Elementwise, ...]
    allreduce_bytes_per_token: int
    """Message bytes per token of one all-reduce of the hidden state (two per layer under
    TP: after attention and after the MLP)."""
    gather_bytes_per_seq: int
    """Bytes of one sampled row's full-vocabulary logits, all-gathered under TP."""
    experts: ExpertShard | None = None
    """A mixture-of-experts model's routed experts (None for a dense model)."""
    mla: MLASpec | None = None
    """Multi-head latent attention's dimensions (None: multi-head or grouped-query)."""

    @classmethod
    def of(cls, model: ModelSpec, tp: int = 1, weight_dtype: str = "bf16",
           kv_dtype: str = "bf16", ep: int = 1) -> "ShardedShapes":
        """The GEMMs and kernels of a model's step on one GPU under `tp` (and, for a
        mixture-of-experts model, `ep`: see the module docstring). Raises ValueError for a
        layout the model cannot take."""
        _check_degree("ep", ep)
        if model.moe is not None or model.mla is not None:
            return _build_shapes(model, tp, weight_dtype, kv_dtype, ep)
        if ep != 1:
            raise ValueError(f"ep={ep} spreads experts over GPUs, and {model.name} has none")
        _check_dtypes(weight_dtype, kv_dtype)
        _check_degree("tp", tp)
        if model.num_heads % tp or model.intermediate_size % tp:
            raise ValueError(f"tp={tp} must divide {model.name}'s attention heads "
                             f"({model.num_heads}) and intermediate size ({model.intermediate_size})")
        if model.num_kv_heads % tp and tp % model.num_kv_heads:
            raise ValueError(f"tp={tp} must divide, or be a multiple of, {model.name}'s "
                             f"{model.num_kv_heads} KV heads")
        return _build_shapes(model, tp, weight_dtype, kv_dtype, ep)


def _build_shapes(model: ModelSpec, tp: int, weight_dtype: str, kv_dtype: str,
                  ep: int) -> ShardedShapes:
    """`ShardedShapes` of any model (the module docstring says how vLLM lays out a
    mixture-of-experts or MLA one; a dense model is the case with neither). Dense layers
    keep the dense MLP; MoE layers have the router (BF16, replicated) and shared experts
    (tp-split) as GEMMs and the routed experts as an `ExpertShard`. MLA's fused q/kv
    down-projection is replicated, q_b_proj and o_proj split; the cache holds the whole
    latent on every GPU.

    OPT's differences (`ModelSpec.gated_mlp`, `linear_bias`, `learned_positions`), as
    vLLM's `models/opt.py` runs them: fc1 and fc2 instead of gate_up and down, the
    activation reading and writing fc1's output; biases streamed with their GEMM, the
    column-parallel ones (qkv, fc1) split tp ways and the row-parallel ones (o_proj, fc2)
    whole on every GPU; no rotary kernel; the position table (replicated) gathered and
    added to the token embedding once per step. The defaults add nothing: a Llama-style
    model's shapes are what they were."""
    _check_dtypes(weight_dtype, kv_dtype)
    _check_degree("tp", tp)
    _check_sparse_layout(model, tp, ep)
    wb, kvb, a = DTYPE_BYTES[weight_dtype], DTYPE_BYTES[kv_dtype], ACT_BYTES
    L, h, m = model.num_layers, model.hidden_size, model.mla
    heads = model.num_heads // tp
    gemms: list[Gemm] = []
    if m is not None:
        latent = m.cached_values
        if m.q_lora_rank:
            down = m.q_lora_rank + latent
            gemms += [Gemm("qkv_a_proj", down, h, h * down * wb, L),
                      Gemm("q_b_proj", heads * m.qk_head_dim, m.q_lora_rank,
                           m.q_lora_rank * heads * m.qk_head_dim * wb, L)]
        else:
            gemms += [Gemm("q_proj", heads * m.qk_head_dim, h, h * heads * m.qk_head_dim * wb, L),
                      Gemm("kv_a_proj", latent, h, h * latent * wb, L)]
        o_in = heads * m.v_head_dim
        gemms.append(Gemm("o_proj", h, o_in, o_in * h * wb, L))
        hd, kv_heads, q, kv = m.qk_head_dim, 1, heads * m.qk_head_dim, latent
        kv_per_token = L * latent * kvb
        rope = m.qk_rope_head_dim
        attention_ew = (Elementwise("rotary", (2 * (heads + 1) * rope + rope) * a, L),
                        # RMSNorms of the q and kv latents: read and write each
                        Elementwise("latent_norms", 2 * ((m.q_lora_rank or 0) + m.kv_lora_rank) * a, L))
    else:
        hd = model.head_dim
        kv_heads = max(1, model.num_kv_heads // tp)
        q, kv = heads * hd, kv_heads * hd
        qkv_out = q + 2 * kv
        bias = qkv_out * ACT_BYTES if model.attention_bias else 0
        out_bias = h * ACT_BYTES if model.linear_bias else 0
        gemms += [Gemm("qkv_proj", qkv_out, h, h * qkv_out * wb + bias, L),
                  Gemm("o_proj", h, q, q * h * wb + out_bias, L)]
        kv_per_token = 2 * L * kv * kvb
        attention_ew = (() if model.learned_positions
                        else (Elementwise("rotary", (2 * (q + kv) + hd) * a, L),))
    moe_layers = model.num_moe_layers
    dense_layers = L - moe_layers
    inter = model.intermediate_size // tp if dense_layers else 0
    mlp_ew = []
    if dense_layers and model.gated_mlp:
        gemms += [Gemm("mlp_gate_up", 2 * inter, h, h * 2 * inter * wb, dense_layers),
                  Gemm("mlp_down", h, inter, inter * h * wb, dense_layers)]
        mlp_ew.append(Elementwise("silu_mul", 3 * inter * a, dense_layers))
    elif dense_layers:
        fc1_bias, fc2_bias = (inter * a, h * a) if model.linear_bias else (0, 0)
        gemms += [Gemm("mlp_fc1", inter, h, h * inter * wb + fc1_bias, dense_layers),
                  Gemm("mlp_fc2", h, inter, inter * h * wb + fc2_bias, dense_layers)]
        mlp_ew.append(Elementwise(model.hidden_act, 2 * inter * a, dense_layers))
    experts = None
    if model.moe is not None:
        e = model.moe
        gemms.append(Gemm("moe_router", e.num_experts, h, e.num_experts * h * ACT_BYTES, moe_layers))
        if e.shared_intermediate_size:
            shared = e.shared_intermediate_size // tp
            gemms += [Gemm("shared_gate_up", 2 * shared, h, h * 2 * shared * wb, moe_layers),
                      Gemm("shared_down", h, shared, shared * h * wb, moe_layers)]
            mlp_ew.append(Elementwise("shared_silu_mul", 3 * shared * a, moe_layers))
        # softmax and top-k over the router logits: read them, write ids and weights
        mlp_ew.append(Elementwise("moe_topk", e.num_experts * a + e.experts_per_token * 8, moe_layers))
        width = e.expert_intermediate_size if ep > 1 else e.expert_intermediate_size // tp
        experts = ExpertShard(moe_layers, e.num_experts, e.experts_per_token, h, width, ep,
                              ep // tp if ep > tp else 1,
                              e.norm_topk_prob or model.architecture == "DeepseekV3ForCausalLM")
    vocab = -(-model.vocab_size // tp)
    gemms.append(Gemm("lm_head", vocab, h, h * vocab * ACT_BYTES, 1))
    # The fused kernels of a vLLM-style engine, bytes read + written per row (the KV-cache
    # write is launched with attention and priced there); the embedding gathers the token
    # id, its table row and the output row; sampling reads the logits and writes FP32
    # probabilities over the full vocabulary. A learned position table is a second
    # gather (its row) and an add of the two rows.
    positions = ((Elementwise("position_embedding", 8 + 2 * h * a, 1),
                  Elementwise("position_add", 3 * h * a, 1)) if model.learned_positions else ())
    elementwise = (
        Elementwise("input_norm", 4 * h * a, L),
        *attention_ew,
        Elementwise("post_attention_norm", 4 * h * a, L),
        *mlp_ew,
        Elementwise("embedding", 8 + 2 * h * a, 1),
        *positions,
        Elementwise("final_norm", 4 * h * a, 1),
        Elementwise("sampler", model.vocab_size * (a + 4), 1, per_seq=True),
    )
    return ShardedShapes(
        tp=tp, num_layers=L, hidden=h, heads=heads, kv_heads=kv_heads, head_dim=hd,
        q_dim=q, kv_dim=kv, intermediate=inter, vocab=vocab, kv_elem_bytes=kvb,
        kv_bytes_per_token=kv_per_token, weight_dtype=weight_dtype, gemms=tuple(gemms),
        elementwise=elementwise, allreduce_bytes_per_token=h * a,
        gather_bytes_per_seq=vocab * tp * a if tp > 1 else 0, experts=experts, mla=m)


def _check_dtypes(weight_dtype: str, kv_dtype: str) -> None:
    for name, dtype in (("weight_dtype", weight_dtype), ("kv_dtype", kv_dtype)):
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"{name} must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")


def _check_degree(name: str, degree: int) -> None:
    check_bounded(name, degree, 1, integer=True, noun="an integer")


def _dense_weight_bytes(model: ModelSpec, s: ShardedShapes) -> int:
    """A dense model's weights on one GPU: its GEMM shards (with their biases), the
    embedding shard (shared with the LM head when tied), the replicated norms (scale, and
    bias for a LayerNorm) and the replicated position table of learned positions."""
    gemms = sum(g.weight_bytes * g.repeat for g in s.gemms)
    embedding = 0 if model.tie_word_embeddings else s.vocab * s.hidden * ACT_BYTES
    norms = (2 * s.num_layers + 1) * s.hidden * ACT_BYTES * (2 if model.norm_bias else 1)
    qk_norms = 2 * s.num_layers * s.head_dim * ACT_BYTES if model.qk_norm else 0   # Qwen3
    positions = model.learned_positions * s.hidden * ACT_BYTES                       # OPT
    return gemms + embedding + norms + qk_norms + positions


@dataclass(frozen=True, slots=True)
class Footprint:
    """What one GPU holds of a model under a layout: its weights, the KV cache of one
    token, and the per-token widths its activation peak depends on.

    Dense models are read off `ShardedShapes` (the shapes the cost model prices);
    mixture-of-experts and MLA models are laid out as the module docstring says.
    """

    tp: int
    ep: int
    weight_bytes: int
    kv_bytes_per_token: int
    """The KV cache of one token over all layers on one GPU, in the KV dtype."""
    hidden: int
    qkv: int
    """Query plus cached key/value width per token on one GPU."""
    intermediate: int
    """The widest MLP activation per token on one GPU: a dense layer's, or the top-k
    experts' (plus the shared experts') of a MoE layer."""
    vocab: int
    """Vocabulary rows of the LM head on one GPU (padded up to a multiple of tp)."""

    @classmethod
    def of(cls, model: ModelSpec, tp: int = 1, weight_dtype: str = "bf16",
           kv_dtype: str = "bf16", ep: int = 1) -> "Footprint":
        """Raises ValueError for a layout the model cannot take (tp not dividing heads or
        widths; ep on a dense model, not a multiple of tp, or not dividing the experts)."""
        _check_degree("ep", ep)
        if model.moe is None and model.mla is None:
            if ep != 1:
                raise ValueError(f"ep={ep} spreads experts over GPUs, and {model.name} has none")
            s = ShardedShapes.of(model, tp, weight_dtype, kv_dtype)
            return cls(tp, 1, _dense_weight_bytes(model, s), s.kv_bytes_per_token, s.hidden,
                       s.q_dim + 2 * s.kv_dim, s.intermediate, s.vocab)
        _check_dtypes(weight_dtype, kv_dtype)
        _check_degree("tp", tp)
        _check_sparse_layout(model, tp, ep)
        return _sparse_footprint(model, tp, ep, DTYPE_BYTES[weight_dtype], DTYPE_BYTES[kv_dtype])


def _check_sparse_layout(model: ModelSpec, tp: int, ep: int) -> None:
    moe, name = model.moe, model.name
    if model.num_heads % tp:
        raise ValueError(f"tp={tp} must divide {name}'s {model.num_heads} attention heads")
    if model.mla is None and model.num_kv_heads % tp and tp % model.num_kv_heads:
        raise ValueError(f"tp={tp} must divide, or be a multiple of, {name}'s "
                         f"{model.num_kv_heads} KV heads")
    if model.num_moe_layers < model.num_layers and model.intermediate_size % tp:
        raise ValueError(f"tp={tp} must divide {name}'s dense intermediate size "
                         f"({model.intermediate_size})")
    if moe is None:
        if ep != 1:
            raise ValueError(f"ep={ep} spreads experts over GPUs, and {name} has none")
        return
    if moe.shared_intermediate_size % tp:
        raise ValueError(f"tp={tp} must divide {name}'s shared-expert width "
                         f"({moe.shared_intermediate_size})")
    if ep == 1:
        if moe.expert_intermediate_size % tp:
            raise ValueError(f"tp={tp} must divide {name}'s expert width "
                             f"({moe.expert_intermediate_size}), or spread the experts with ep")
        return
    if ep % tp:
        raise ValueError(f"ep={ep} must be a multiple of tp={tp}: vLLM spreads the experts over "
                         "the TP × DP GPUs of a replica")
    if moe.num_experts % ep:
        raise ValueError(f"ep={ep} (tp {tp} x dp {ep // tp}) must divide {name}'s "
                         f"{moe.num_experts} routed experts")


def _sparse_footprint(model: ModelSpec, tp: int, ep: int, wb: int, kvb: int) -> Footprint:
    """A mixture-of-experts or MLA model's footprint on one GPU (see the module docstring).
    At tp = ep = 1 the weights are `ModelSpec.weight_bytes`."""
    a, h, L = ACT_BYTES, model.hidden_size, model.num_layers
    heads, m = model.num_heads // tp, model.mla
    if m is not None:
        # the down-projections are replicated, the per-head up-projections split
        q = (h * m.q_lora_rank + m.q_lora_rank * heads * m.qk_head_dim if m.q_lora_rank
             else h * heads * m.qk_head_dim)
        kv = h * m.cached_values + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        attention = (q + kv + heads * m.v_head_dim * h) * wb \
            + ((m.q_lora_rank or 0) + m.kv_lora_rank) * a
        kv_per_token = L * m.cached_values * kvb        # every TP rank holds the whole latent
        qkv = heads * m.qk_head_dim + m.cached_values
    else:
        hd = model.head_dim
        q, kv = heads * hd, max(1, model.num_kv_heads // tp) * hd
        attention = (h * (q + 2 * kv) + q * h) * wb \
            + ((q + 2 * kv) * a if model.attention_bias else 0) \
            + (2 * hd * a if model.qk_norm else 0)
        kv_per_token = 2 * L * kv * kvb
        qkv = q + 2 * kv
    dense_width = model.intermediate_size // tp
    moe_layers = model.num_moe_layers
    mlps = (L - moe_layers) * 3 * h * dense_width * wb
    widest = dense_width if moe_layers < L else 0
    if model.moe is not None:
        moe = model.moe
        held, width = ((moe.num_experts, moe.expert_intermediate_size // tp) if ep == 1
                       else (moe.num_experts // ep, moe.expert_intermediate_size))
        shared = moe.shared_intermediate_size // tp
        router = moe.num_experts * h * a
        mlps += moe_layers * (3 * h * (held * width + shared) * wb + router)
        widest = max(widest, moe.experts_per_token * width + shared)
    vocab = -(-model.vocab_size // tp)
    embedding = (1 if model.tie_word_embeddings else 2) * vocab * h * a
    norms = (2 * L + 1) * h * a
    return Footprint(tp, ep, L * attention + mlps + embedding + norms, kv_per_token, h, qkv,
                     widest, vocab)


def weight_bytes_per_gpu(model: ModelSpec, tp: int = 1, weight_dtype: str = "bf16", *,
                         ep: int = 1) -> int:
    """Bytes of weights one GPU holds (`Footprint`): for a dense model its GEMM shards, the
    embedding shard (shared with the LM head when tied) and the replicated norms. At tp=1
    (and ep=1) this is `ModelSpec.weight_bytes` of the dtype: in BF16 exactly
    2 · `ModelSpec.num_params`."""
    return Footprint.of(model, tp, weight_dtype, ep=ep).weight_bytes


# --- KV capacity, derived as an engine derives it ------------------------------------------

def activation_reserve_bytes(model: ModelSpec, tp: int = 1, max_num_batched_tokens: int = 2048,
                             max_num_seqs: int = 128, *, ep: int = 1) -> int:
    """Peak activation memory of a full-budget step on one GPU of the engine the simulator
    models (`servelab.capacity.VLLM_FUSED_BF16`), plus the non-torch reserve. A MoE layer's
    peak is the fused-MoE workspace of each token's top-k experts."""
    f = Footprint.of(model, tp, ep=ep)
    return VLLM_FUSED_BF16.bytes(hidden=f.hidden, qkv=f.qkv, intermediate=f.intermediate,
                                 vocab=f.vocab, max_num_batched_tokens=max_num_batched_tokens,
                                 max_num_seqs=max_num_seqs)


def kv_capacity_blocks(model: ModelSpec | str, gpu: GPUSpec | str, tp: int = 1,
                       block_size: int = 16, gpu_memory_utilization: float = 0.9,
                       kv_dtype: str = "bf16", weight_dtype: str = "bf16",
                       activation_reserve_gb: float | None = None,
                       max_num_batched_tokens: int = 2048, max_num_seqs: int = 128, *,
                       ep: int = 1, proposer: ModelSpec | None = None) -> int:
    """KV blocks that fit on each GPU (`servelab.capacity.kv_capacity_blocks`, the formula
    the real backend uses too): memory × utilization − weights per GPU − activation
    reserve, over the bytes of a block on one GPU. `kv_dtype` "fp8" halves a block;
    `weight_dtype` "fp8" stores the blocks' GEMM weights in one byte; `ep` spreads a
    mixture-of-experts model's routed experts (see the module docstring).

    `proposer` is a speculative decoding proposer that runs beside the model (a draft
    model, or an EAGLE / MTP head as one layer): its weights and its own KV per token, held
    under the same block tables, come out of the same memory.

    `activation_reserve_gb` (GiB, as the catalog reads GB) replaces the modelled reserve
    (`activation_reserve_bytes`). Raises ValueError when the weights or the reserve leave
    no room for one block.
    """
    model = load_model_spec(model) if isinstance(model, str) else model
    gpu = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    check_bounded("block_size", block_size, 1, integer=True, noun="an integer")
    footprint = Footprint.of(model, tp, weight_dtype, kv_dtype, ep=ep)
    budget = gpu.memory_bytes * gpu_memory_utilization
    weights = footprint.weight_bytes
    kv_per_token = footprint.kv_bytes_per_token
    if proposer is not None:
        extra = Footprint.of(proposer, tp, weight_dtype, kv_dtype)
        weights += extra.weight_bytes
        kv_per_token += extra.kv_bytes_per_token
    if activation_reserve_gb is None:
        reserve = activation_reserve_bytes(model, tp, max_num_batched_tokens, max_num_seqs, ep=ep)
    elif activation_reserve_gb < 0:
        raise ValueError(f"activation_reserve_gb must be >= 0, got {activation_reserve_gb!r}")
    else:
        reserve = activation_reserve_gb * GIB
    if weights >= budget:
        layout, hints = ((f"tp={tp}", ["raise tp"]) if model.moe is None
                         else (f"tp={tp}, ep={ep}", ["raise tp or ep"]))
        if proposer is None:   # pipeline stages are not modelled with a proposer
            hints.append("split the layers over pipeline stages (pp)")
        if weight_dtype != "fp8":
            hints.append("use fp8 weights")
        whose = f"{model.name} weights" if proposer is None else \
            f"{model.name}'s weights and its proposer's ({proposer.name}, {extra.weight_bytes / GIB:.1f} GiB)"
        raise ValueError(
            f"{whose} need {weights / GIB:.1f} GiB per GPU at {layout} "
            f"({weight_dtype}), but {gpu.name} offers {budget / GIB:.1f} GiB at "
            f"gpu_memory_utilization={gpu_memory_utilization}: "
            + (f"{', '.join(hints[:-1])} or {hints[-1]}" if len(hints) > 1 else hints[0]))
    return engine_kv_capacity_blocks(
        memory_bytes=gpu.memory_bytes, gpu_memory_utilization=gpu_memory_utilization,
        weight_bytes=weights, reserve_bytes=reserve,
        block_bytes=block_size * kv_per_token, where=f"{model.name} on {gpu.name}")


# --- pipeline stages (simulator/pipeline.py) ---------------------------------------------

FIRST_STAGE_KERNELS = frozenset({"embedding", "position_embedding", "position_add"})
"""Once-per-step kernels only the first pipeline stage runs: the token (and learned
position) embedding. vLLM builds `embed_tokens` on the first rank only (a `PPMissingLayer`
elsewhere; `vllm/model_executor/models/llama.py::LlamaModel.__init__`), and its forward
embeds the input ids there only (`if get_pp_group().is_first_rank`)."""
LAST_STAGE_KERNELS = frozenset({"final_norm", "lm_head", "sampler"})
"""Once-per-step kernels only the last stage runs: the final norm, the LM head and the
sampler (and, under TP, the logits all-gather): vLLM builds `norm` and `lm_head` on the
last rank only, and only the last rank computes logits and samples
(`vllm/v1/worker/gpu_model_runner.py`: a non-last rank returns its intermediate tensors)."""
STEP_KERNELS = FIRST_STAGE_KERNELS | LAST_STAGE_KERNELS | {"logits_gather"}
"""The kernels a step runs once, not once per layer (the logits' all-gather under TP
included): what is left of a step's kernels is its layers'."""


def stage_shapes(shapes: ShardedShapes, first: bool, last: bool) -> ShardedShapes:
    """The kernels one pipeline stage runs: `shapes` of the stage's layers (`stage_model`)
    without the once-per-step kernels of the other ends (`FIRST_STAGE_KERNELS`,
    `LAST_STAGE_KERNELS`; a stage that is not the last gathers no logits). A stage that is
    both first and last is the whole model: `shapes` unchanged."""
    drop = (set() if first else FIRST_STAGE_KERNELS) | (set() if last else LAST_STAGE_KERNELS)
    if not drop:
        return shapes
    return replace(shapes, gemms=tuple(g for g in shapes.gemms if g.name not in drop),
                   elementwise=tuple(e for e in shapes.elementwise if e.name not in drop),
                   gather_bytes_per_seq=shapes.gather_bytes_per_seq if last else 0)


def stage_model(model: ModelSpec, start: int, end: int) -> ModelSpec:
    """Layers [start, end) of `model` as a model of end - start layers: what one pipeline
    stage computes and holds (its MoE layers and dense layers those of the range: a
    DeepSeek-V3 first stage keeps the three dense leading layers). Everything but the
    layer count (and, for a mixture-of-experts model, which layers are dense) is the
    model's; which once-per-step kernels and weights a stage keeps is `stage_shapes`' and
    `stage_footprint`'s business."""
    if not 0 <= start <= end <= model.num_layers:
        raise ValueError(f"layers [{start}, {end}) are not a range of {model.name}'s "
                         f"{model.num_layers} layers")
    moe = model.moe
    if moe is not None:
        moe = replace(moe, dense_layers=tuple(i - start for i in moe.dense_layers if start <= i < end))
    return replace(model, num_layers=end - start, moe=moe)


def stage_footprint(model: ModelSpec, start: int, end: int, pp_rank: int, pp: int, tp: int = 1,
                    weight_dtype: str = "bf16", kv_dtype: str = "bf16", ep: int = 1) -> Footprint:
    """What one GPU of pipeline stage `pp_rank` of `pp` holds, the stage computing layers
    [start, end): those layers' weights and KV, plus the embedding on the first stage and
    the final norm and LM head on the last, as vLLM builds them (`FIRST_STAGE_KERNELS`,
    `LAST_STAGE_KERNELS`). A model with tied embeddings keeps a second copy of the table
    on the last stage, which its LM head reads: vLLM builds `embed_tokens` on the first
    rank "or (config.tie_word_embeddings and get_pp_group().is_last_rank)". `vocab` is the
    LM head's rows on the last stage and 0 elsewhere (no logits, so no logits peak in the
    activation reserve). With pp = 1 this is `Footprint.of(model, ...)`."""
    whole = Footprint.of(stage_model(model, start, end), tp, weight_dtype, kv_dtype, ep=ep)
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first and last:
        return whole
    # once-per-step weights on one GPU: every model without its layers
    once = Footprint.of(stage_model(model, 0, 0), tp, weight_dtype, kv_dtype, ep=ep).weight_bytes
    table = whole.vocab * whole.hidden * ACT_BYTES        # one vocabulary table's shard
    final_norm = whole.hidden * ACT_BYTES * (2 if model.norm_bias else 1)
    weights = whole.weight_bytes - once
    if first:   # the embedding (and a position table): what is once-only but the LM head's
        weights += once - table - final_norm + (table if model.tie_word_embeddings else 0)
    if last:
        weights += table + final_norm
    return replace(whole, weight_bytes=weights, vocab=whole.vocab if last else 0)
