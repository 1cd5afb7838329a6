"""Model descriptions shared by the cost model and the real backend.

A model is described by the fields of its Hugging Face `config.json`, so a user adds a
model by pointing at a config.json; the catalog is a folder of such files shipped with
servelab (`servelab/data/models/<name>.json`; docs/models.md lists them with their
sources).

Dense decoders: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (no bias, an RMSNorm over
each head of q and of k before RoPE: transformers' `Qwen3Attention.q_norm/k_norm`, vLLM's
`vllm/model_executor/models/qwen3.py`).

Mixture-of-experts decoders carry a `MoESpec`, read as transformers and vLLM read them:
Mixtral (`num_local_experts`; every layer routes; the expert width is
`intermediate_size`), Qwen3-MoE (`num_experts`, `moe_intermediate_size`; a layer is dense
when listed in `mlp_only_layers` or when `(i + 1) % decoder_sparse_step != 0`:
transformers' `Qwen3MoeDecoderLayer`), and DeepSeek-V2/V3 (`n_routed_experts`,
`n_shared_experts` of `moe_intermediate_size` each, dense leading layers
`first_k_dense_replace`, and `moe_layer_freq` as vLLM's `models/deepseek_v2.py` reads it).
DeepSeek's attention is multi-head latent attention (`MLASpec`).

OPT (`OPTForCausalLM`, arXiv:2205.01068; transformers' `models/opt/modeling_opt.py`) is a
dense decoder of another make: multi-head attention with biases on q, k, v and out_proj,
a two-matrix MLP (fc1 hidden -> `ffn_dim`, ReLU, fc2 back, both with biases), pre-norm
LayerNorms with a bias, and learned absolute positions (`OPTLearnedPositionalEmbedding`: a
table of `max_position_embeddings` + 2 rows, added to the token embedding; no RoPE); the
LM head is tied to the token embedding. The fields `gated_mlp`, `hidden_act`,
`linear_bias`, `norm_bias` and `learned_positions` say so; their defaults are the
Llama-style decoder every other architecture here is. OPT is simulation-only: the real
backend runs Llama-style decoders (`SIMULATION_ONLY_ARCHITECTURES`). Refused: OPT configs
whose `word_embed_proj_dim` differs from `hidden_size` (OPT-350m's project_in/out) or that
normalise after the blocks (`do_layer_norm_before` false).

Not modelled, and why that is honest: the router's scoring (DeepSeek's sigmoid with a
bias, expert groups `n_group`/`topk_group`, `routed_scaling_factor`) picks experts but
changes no shape; DeepSeek-V3's multi-token-prediction layer (`num_nextn_predict_layers`,
weights vLLM loads only as a speculative-decoding draft) is not counted; FP8 block scales
(1/16384 of the weights) are not counted; a `sliding_window` on Mistral or Mixtral is left
to the real backend, which refuses sequences past it, and the simulator prices full
attention, exact within the window. Refused with one line: any other mixture-of-experts
architecture, a config missing a field its layout needs, and on the new architectures
per-layer attention types (`layer_types` other than full attention) or Qwen3-MoE's
`use_sliding_window`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path

from servelab._validate import check_int

DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                       "Qwen3ForCausalLM", "OPTForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM",
                     "DeepseekV3ForCausalLM")
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
SIMULATION_ONLY_ARCHITECTURES = ("OPTForCausalLM",)
"""Architectures the simulator prices and the real backend does not run (it implements
RoPE, RMSNorm and the SwiGLU MLP only)."""
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
"""Architectures that RMS-normalise every head of q and k (weights [head_dim]) before RoPE."""
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
"""config.json fields that only mixture-of-experts models carry (Qwen3-MoE, Mixtral,
DeepSeek)."""


@dataclass(frozen=True)
class MoESpec:
    """The experts of every mixture-of-experts layer (all such layers are alike).

    A MoE layer holds a router [num_experts, hidden], `num_experts` routed SwiGLU experts
    of width `expert_intermediate_size` of which each token uses `experts_per_token`, and
    `num_shared_experts` experts every token uses (`shared_intermediate_size` wide
    together). The layers in `dense_layers` have the model's dense SwiGLU MLP instead."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    """Indices of the layers whose MLP is dense (`ModelSpec.intermediate_size` wide)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k router probabilities to sum to 1 (Mixtral always; Qwen3-MoE
    and DeepSeek when their config's `norm_topk_prob` says so)."""

    def __post_init__(self) -> None:
        if self.num_experts < 1 or self.expert_intermediate_size < 1:
            raise ValueError(f"a mixture-of-experts layer needs experts (got {self.num_experts}) "
                             f"of width >= 1 (got {self.expert_intermediate_size})")
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts per token must be in [1, {self.num_experts}], got "
                             f"{self.experts_per_token}")
        if self.num_shared_experts < 0 or (self.num_shared_experts > 0) != (
                self.shared_intermediate_size > 0):
            raise ValueError(f"{self.num_shared_experts} shared experts cannot be "
                             f"{self.shared_intermediate_size} wide")


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3, arXiv:2405.04434 §2.1).

    Queries go through a low-rank `q_lora_rank` bottleneck (None: projected directly, as
    DeepSeek-V2-Lite does). Keys and values are rebuilt per head from one latent of
    `kv_lora_rank` values, and RoPE rides on a separate `qk_rope_head_dim`-wide key shared
    by all heads: the cache holds the latent and that key, `cached_values` per token and
    layer (576 for DeepSeek-V3), whatever the number of heads."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        """Width of a query/key head: the position-free part plus the rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cached_values(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    """Width of a query/key head (for MLA the position-free and rotary parts together)."""
    intermediate_size: int
    """The dense MLP's width (a mixture-of-experts model's dense layers)."""
    vocab_size: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    architecture: str = "LlamaForCausalLM"
    qk_norm: bool = False
    """Per-head RMSNorm of q and k before RoPE (Qwen3, Qwen3-MoE)."""
    moe: MoESpec | None = None
    """The experts of a mixture-of-experts model; None for a dense one."""
    mla: MLASpec | None = None
    """Multi-head latent attention (DeepSeek); None for multi-head / grouped-query."""
    gated_mlp: bool = True
    """The dense MLP is SwiGLU's three matrices (gate and up, then down); False: two,
    fc1 (hidden -> intermediate) and fc2 (intermediate -> hidden) around `hidden_act`
    (OPT)."""
    hidden_act: str = "silu"
    """The dense MLP's activation ("relu" for OPT)."""
    linear_bias: bool = False
    """o_proj and the dense MLP's matrices carry a bias (OPT's `enable_bias`); the q/k/v
    biases are `attention_bias`'s."""
    norm_bias: bool = False
    """The norms are LayerNorms with a bias beside the scale (OPT), not RMSNorms."""
    learned_positions: int = 0
    """Rows of a learned absolute position table added to the token embedding (OPT:
    max_position_embeddings + 2); 0: rotary positions, no table."""
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_int("ModelSpec", "num_layers", self.num_layers, lo=0)   # 0: an empty pipeline stage
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_position_embeddings"):
            check_int("ModelSpec", name, getattr(self, name), lo=1)

    @property
    def context_length(self) -> int:
        """The longest sequence the model takes, as vLLM derives it from the config
        (`_get_and_verify_max_len`, vllm/config/model.py): max_position_embeddings, times
        the RoPE scaling factor for scalings other than su, longrope and llama3 (whose
        max_position_embeddings already counts it), from original_max_position_embeddings
        for yarn. vLLM refuses a --max-model-len above it (unless
        VLLM_ALLOW_LONG_MAX_MODEL_LEN=1: positions past it give wrong outputs)."""
        rope = self.hf_config.get("rope_scaling") or self.hf_config.get("rope_parameters") or {}
        kind = rope.get("rope_type") or rope.get("type") or "default"
        if kind in ("su", "longrope", "llama3"):
            return self.max_position_embeddings
        base = rope.get("original_max_position_embeddings") if kind == "yarn" else None
        factor = rope.get("factor") or 1.0
        return int((base or self.max_position_embeddings) * factor)

    # --- parameters -------------------------------------------------------------------------

    def _attention_params(self) -> tuple[int, int]:
        """(GEMM weights, everything else: biases and norms) of one layer's attention."""
        h = self.hidden_size
        if self.mla is not None:
            m, heads = self.mla, self.num_heads
            q = (h * m.q_lora_rank + m.q_lora_rank * heads * m.qk_head_dim
                 if m.q_lora_rank else h * heads * m.qk_head_dim)
            kv = h * m.cached_values + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
            return q + kv + heads * m.v_head_dim * h, (m.q_lora_rank or 0) + m.kv_lora_rank
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = (q + 2 * kv if self.attention_bias else 0) + (h if self.linear_bias else 0)
        return h * q + 2 * h * kv + q * h, bias + (2 * self.head_dim if self.qk_norm else 0)

    def _mlp_params(self, layer: int) -> tuple[int, int]:
        """(GEMM weights, everything else: biases or the router) of one layer's MLP or
        experts."""
        h, moe = self.hidden_size, self.moe
        if moe is None or layer in moe.dense_layers:
            f = self.intermediate_size
            bias = f + h if self.linear_bias else 0
            return (3 if self.gated_mlp else 2) * h * f, bias
        experts = moe.num_experts * moe.expert_intermediate_size + moe.shared_intermediate_size
        return 3 * h * experts, moe.num_experts * h

    @property
    def num_moe_layers(self) -> int:
        return 0 if self.moe is None else self.num_layers - len(self.moe.dense_layers)

    @property
    def num_linear_params(self) -> int:
        """The GEMM weights of the blocks: what FP8 checkpoints quantise (embeddings, LM
        head, norms, biases and routers stay BF16)."""
        attn = self._attention_params()[0]
        return sum(attn + self._mlp_params(i)[0] for i in range(self.num_layers))

    @property
    def num_params(self) -> int:
        """Parameters of the transformer (embeddings, position table and LM head included;
        every expert)."""
        attn = sum(self._attention_params())
        norm = self.hidden_size * (2 if self.norm_bias else 1)
        layers = sum(attn + sum(self._mlp_params(i)) + 2 * norm for i in range(self.num_layers))
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return layers + embed + self.learned_positions * self.hidden_size + norm

    @property
    def num_active_params(self) -> int:
        """Parameters one token uses: all of them but the routed experts it is not sent
        to (the convention of the published "active" figures: embeddings included)."""
        if self.moe is None:
            return self.num_params
        idle = self.moe.num_experts - self.moe.experts_per_token
        return self.num_params - self.num_moe_layers * idle * 3 * self.hidden_size \
            * self.moe.expert_intermediate_size

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        """Bytes of all weights with the blocks' GEMM weights at `dtype_bytes` (1: FP8) and
        the rest in BF16."""
        linear = self.num_linear_params
        return linear * dtype_bytes + (self.num_params - linear) * 2

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of one token over all layers: 2 × layers × kv heads × head dim × bytes
        per element, or for MLA layers × (kv_lora_rank + qk_rope_head_dim) × bytes."""
        if self.mla is not None:
            return self.num_layers * self.mla.cached_values * dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @property
    def checkpoint_weight_dtype(self) -> str:
        """"fp8" for a checkpoint stored in FP8 (`quantization_config.quant_method` "fp8",
        as DeepSeek-V3's), else "bf16". ValueError for other quantisations."""
        quant = self.hf_config.get("quantization_config") or {}
        method = quant.get("quant_method")
        if method is None:
            return "bf16"
        if method == "fp8":
            return "fp8"
        raise ValueError(f"{self.name}: quantization {method!r} is not modelled; servelab "
                         "prices bf16 and fp8 weights")

    # --- reading a config.json --------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, config: dict, name: str | None = None) -> "ModelSpec":
        archs = config.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        experts = ", ".join(f for f in _MOE_FIELDS if config.get(f))
        if arch not in MOE_ARCHITECTURES and (experts or "Moe" in arch):
            raise ValueError(f"{arch} is a mixture-of-experts model ({experts or 'experts'} in its "
                             "config) whose layout servelab does not model; mixture-of-experts "
                             f"architectures: {', '.join(MOE_ARCHITECTURES)}")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; servelab runs "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            heads = _count(config, "num_attention_heads")
            hidden = _count(config, "hidden_size")
            num_layers = _count(config, "num_hidden_layers")
            moe = _moe_spec(arch, config, num_layers) if arch in MOE_ARCHITECTURES else None
            mla = _mla_spec(arch, config) if arch in MLA_ARCHITECTURES else None
            opt = arch == "OPTForCausalLM"
            fields = dict(
                name=name or config.get("_name_or_path") or config.get("model_type", "model"),
                num_layers=num_layers,
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=_count(config, "num_key_value_heads", heads),
                head_dim=(mla.qk_head_dim if mla
                          else _count(config, "head_dim", hidden // heads or None)),
                intermediate_size=_count(config, "ffn_dim" if opt else "intermediate_size"),
                vocab_size=_count(config, "vocab_size"),
                max_position_embeddings=_count(config, "max_position_embeddings", 4096),
                # transformers >= 5 nests it under rope_parameters
                rope_theta=float(config.get("rope_theta")
                                 or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
                attention_bias=bool(config.get("attention_bias", arch == "Qwen2ForCausalLM")),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                architecture=arch,
                qk_norm=arch in QK_NORM_ARCHITECTURES,
                moe=moe,
                mla=mla,
                hf_config=dict(config),
            )
            if opt:
                fields.update(_opt_fields(config, hidden))
            spec = cls(**fields)
        except KeyError as exc:
            raise ValueError(f"model config lacks the field {exc.args[0]!r}") from None
        if spec.num_heads % spec.num_kv_heads:
            raise ValueError(f"num_attention_heads ({spec.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({spec.num_kv_heads})")
        return spec


def _count(config: dict, key: str, default: int | None = None, lo: int = 1) -> int:
    """config[key] (or `default` where it is absent or null, KeyError without one) as a
    whole number >= `lo`; ValueError naming the field otherwise."""
    value = config.get(key)
    if value is None:
        if default is None:
            if key in config:
                raise ValueError(f"model config field {key!r} must be a whole number >= {lo}, "
                                 f"got null")
            raise KeyError(key)
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or abs(value) == float("inf") or value != int(value) or value < lo:
        raise ValueError(f"model config field {key!r} must be a whole number >= {lo}, "
                         f"got {value!r}")
    return int(value)


def _needed(config: dict, arch: str, what: str, *keys: str, lo: int = 1) -> int:
    """The first of `keys` the config sets, as a whole number >= `lo`; ValueError naming
    the first key where none is set."""
    for key in keys:
        if config.get(key) is not None:
            return _count(config, key, lo=lo)
    raise ValueError(f"{arch} is a {what} model whose config lacks {keys[0]!r}")


def _check_full_attention(arch: str, config: dict) -> None:
    """Per-layer sliding windows cannot be priced as full attention: refused."""
    partial = sorted({t for t in config.get("layer_types") or () if t != "full_attention"})
    if partial:
        raise ValueError(f"{arch}: per-layer attention types {partial} are not modelled; "
                         "servelab prices and runs full attention only")
    if arch == "Qwen3MoeForCausalLM" and config.get("use_sliding_window"):
        raise ValueError(f"{arch}: use_sliding_window (sliding-window attention on the layers "
                         "past max_window_layers) is not modelled; servelab prices full attention")


def _opt_fields(config: dict, hidden: int) -> dict:
    """The `ModelSpec` fields in which OPT differs from a Llama-style decoder, read as
    transformers' `OPTConfig` and `modeling_opt.py` read them: `enable_bias` (default
    true) puts biases on every linear layer of the blocks, `activation_function` (default
    relu) sits between fc1 and fc2, the position table has `max_position_embeddings` + 2
    rows (`OPTLearnedPositionalEmbedding.offset`), and the LM head is tied unless the
    config says otherwise (`PretrainedConfig`'s default)."""
    arch = "OPTForCausalLM"
    projected = int(config.get("word_embed_proj_dim") or hidden)
    if projected != hidden:
        raise ValueError(f"{arch}: word_embed_proj_dim {projected} != hidden_size {hidden} "
                         "(project_in/project_out around the blocks) is not modelled")
    if not config.get("do_layer_norm_before", True) or config.get("_remove_final_layer_norm"):
        raise ValueError(f"{arch}: post-block LayerNorms (do_layer_norm_before false) are not "
                         "modelled; servelab prices pre-norm OPT models")
    if not config.get("layer_norm_elementwise_affine", True):
        raise ValueError(f"{arch}: LayerNorms without weights (layer_norm_elementwise_affine "
                         "false) are not modelled")
    bias = bool(config.get("enable_bias", True))
    return dict(gated_mlp=False, hidden_act=str(config.get("activation_function", "relu")),
                attention_bias=bias, linear_bias=bias, norm_bias=True,
                max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
                learned_positions=int(config.get("max_position_embeddings", 2048)) + 2,
                tie_word_embeddings=bool(config.get("tie_word_embeddings", True)))


def _moe_spec(arch: str, config: dict, num_layers: int) -> MoESpec:
    """The experts as transformers' (Mixtral, Qwen3-MoE) and vLLM's (DeepSeek) model code
    lay them out; see the module docstring."""
    _check_full_attention(arch, config)

    def needed(*keys: str) -> int:
        return _needed(config, arch, "mixture-of-experts", *keys)

    top_k = needed("num_experts_per_tok")
    if arch == "MixtralForCausalLM":
        return MoESpec(needed("num_local_experts"), top_k, needed("intermediate_size"))
    if arch == "Qwen3MoeForCausalLM":
        step = config.get("decoder_sparse_step")
        step = 1 if step is None else int(step)
        if step < 1:
            raise ValueError(f"{arch}: decoder_sparse_step must be >= 1, got {step}")
        only = set(config.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
        # transformers >= 5 writes num_local_experts, the published configs num_experts
        return MoESpec(needed("num_experts", "num_local_experts"), top_k,
                       needed("moe_intermediate_size"), dense_layers=dense,
                       norm_topk_prob=bool(config.get("norm_topk_prob", False)))
    width = needed("moe_intermediate_size")
    shared = int(config.get("n_shared_experts") or 0)
    first_dense = _needed(config, arch, "mixture-of-experts", "first_k_dense_replace", lo=0)
    freq = _count(config, "moe_layer_freq", 1)
    dense = tuple(i for i in range(num_layers) if i < first_dense or i % freq)
    return MoESpec(needed("n_routed_experts"), top_k, width, shared, shared * width, dense,
                   norm_topk_prob=bool(config.get("norm_topk_prob", False)))


def _mla_spec(arch: str, config: dict) -> MLASpec:
    if "q_lora_rank" not in config:
        raise ValueError(f"{arch} is a multi-head latent attention model whose config lacks "
                         "'q_lora_rank' (null when queries are projected directly)")

    def needed(key: str) -> int:
        return _needed(config, arch, "multi-head latent attention", key)

    q_lora = config["q_lora_rank"]
    return MLASpec(int(q_lora) if q_lora else None, needed("kv_lora_rank"),
                   needed("qk_nope_head_dim"), needed("qk_rope_head_dim"), needed("v_head_dim"))


def catalog_names() -> list[str]:
    folder = resources.files("servelab") / "data" / "models"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def catalog_name_of(hf_id: str) -> str | None:
    """The catalog entry whose config came from Hugging Face model `hf_id` (its
    `_name_or_path`, any case: "meta-llama/Llama-3.1-8B" -> "llama-3.1-8b"); None if none."""
    return _catalog_hf_ids().get(hf_id.lower())


@cache
def _catalog_hf_ids() -> dict[str, str]:
    """Lower-cased `_name_or_path` -> catalog name (read once: packaged data)."""
    folder = resources.files("servelab") / "data" / "models"
    ids = {}
    for name in catalog_names():
        hf_id = json.loads((folder / f"{name}.json").read_text()).get("_name_or_path")
        if hf_id:
            ids[str(hf_id).lower()] = name
    return ids


def load_model_spec(name_or_path: str) -> ModelSpec:
    """A catalog name (`llama-3.1-8b`) or the Hugging Face id its config came from, a
    config.json path, or a folder holding one."""
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" and path.exists():
        try:
            config = json.loads(path.read_text())
            if not isinstance(config, dict):
                raise ValueError(f"expected a JSON object, got {type(config).__name__}")
            return ModelSpec.from_hf_config(config, name=path.parent.name
                                            if path.name == "config.json" else path.stem)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    entry = resources.files("servelab") / "data" / "models" / f"{name_or_path}.json"
    alias = None if entry.is_file() else catalog_name_of(name_or_path)
    if alias:
        return load_model_spec(alias)
    if not entry.is_file():
        raise ValueError(f"unknown model {name_or_path!r}: not a config.json path, and the "
                         f"catalog has {', '.join(catalog_names())}")
    return ModelSpec.from_hf_config(json.loads(entry.read_text()), name=name_or_path)
