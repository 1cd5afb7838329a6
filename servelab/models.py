"""Model descriptions shared by the cost model and the real backend.

A model is described by the fields of its Hugging Face `config.json`, so a user adds a
model by pointing at a config.json; the catalog is a folder of such files shipped with
servelab (`servelab/data/models/<name>.json`).

Dense decoders only: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (no bias, an RMSNorm
over each head of q and of k before RoPE: transformers' `Qwen3Attention.q_norm/k_norm`,
vLLM's `vllm/model_executor/models/qwen3.py`). Mixture-of-experts configs are refused.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM")
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM",)
"""Architectures that RMS-normalise every head of q and k (weights [head_dim]) before RoPE."""
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
"""config.json fields that only mixture-of-experts models carry (Qwen3-MoE, Mixtral,
DeepSeek)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    architecture: str = "LlamaForCausalLM"
    qk_norm: bool = False
    """Per-head RMSNorm of q and k before RoPE (Qwen3)."""
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_params(self) -> int:
        """Parameters of the transformer (embeddings and LM head included)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """2 (K and V) × layers × kv heads × head dim × bytes per element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf_config(cls, config: dict, name: str | None = None) -> "ModelSpec":
        archs = config.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        moe = [f for f in _MOE_FIELDS if config.get(f)]
        if moe or "Moe" in arch:
            raise ValueError(f"{arch} is a mixture-of-experts model ({', '.join(moe) or 'experts'} "
                             f"in its config), which servelab does not model yet; dense "
                             f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; servelab runs "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            spec = cls(
                name=name or config.get("_name_or_path") or config.get("model_type", "model"),
                num_layers=int(config["num_hidden_layers"]),
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                intermediate_size=int(config["intermediate_size"]),
                vocab_size=int(config["vocab_size"]),
                max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
                # transformers >= 5 nests it under rope_parameters
                rope_theta=float(config.get("rope_theta")
                                 or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
                attention_bias=bool(config.get("attention_bias", arch == "Qwen2ForCausalLM")),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                architecture=arch,
                qk_norm=arch in QK_NORM_ARCHITECTURES,
                hf_config=dict(config),
            )
        except KeyError as exc:
            raise ValueError(f"model config lacks the field {exc.args[0]!r}") from None
        if spec.num_heads % spec.num_kv_heads:
            raise ValueError(f"num_attention_heads ({spec.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({spec.num_kv_heads})")
        return spec


def catalog_names() -> list[str]:
    folder = resources.files("servelab") / "data" / "models"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def load_model_spec(name_or_path: str) -> ModelSpec:
    """A catalog name (`llama-3.1-8b`), a config.json path, or a folder holding one."""
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" and path.exists():
        return ModelSpec.from_hf_config(json.loads(path.read_text()), name=path.parent.name
                                        if path.name == "config.json" else path.stem)
    entry = resources.files("servelab") / "data" / "models" / f"{name_or_path}.json"
    if not entry.is_file():
        raise ValueError(f"unknown model {name_or_path!r}: not a config.json path, and the "
                         f"catalog has {', '.join(catalog_names())}")
    return ModelSpec.from_hf_config(json.loads(entry.read_text()), name=name_or_path)
