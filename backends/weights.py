"""Model weights: where each Hugging Face tensor goes, checkpoint loading, seeded random init.

The model keeps fused projections (`qkv_proj` = q|k|v rows, `gate_up_proj` = gate|up rows)
so a layer runs two GEMMs where the checkpoint stores five tensors. A mixture-of-experts
layer keeps its router as `mlp.gate` and expert j as `mlp.experts.j` with the same fused
projections, whatever the checkpoint calls them (Mixtral: `block_sparse_moe.experts.j.w1`
gate, `w3` up, `w2` down; Qwen3-MoE: `mlp.experts.j.gate_proj/up_proj/down_proj`).
`hf_weight_layout` maps every Hugging Face parameter name to the fused parameter and row
range it fills; loading and validation are driven by that one table.

Everything that can be wrong with a checkpoint (missing config, unsupported architecture,
config that disagrees with the spec, missing / unexpected / mis-shaped tensors) is found
from config.json and the safetensors headers alone, before any tensor is read or any
device memory is allocated.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn

from servelab.models import ModelSpec

__all__ = [
    "WeightSlot", "CheckpointPlan", "resolve_device", "resolve_dtype", "o_proj_has_bias",
    "hf_weight_layout", "plan_checkpoint", "load_checkpoint", "init_random_weights",
]

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved


def resolve_device(name: str | torch.device) -> torch.device:
    """A device that exists on this machine: 'cpu', 'cuda' (= cuda:0) or 'cuda:N'.

    Raises ValueError for unknown device types, for CUDA on a machine without it, and for a
    CUDA index past the device count."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {name!r}: use 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"unsupported device {name!r}: servelab runs on 'cpu' or 'cuda[:N]'")
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available on this machine "
                         f"(torch {torch.__version__}); use 'cpu'")
    index = device.index or 0
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"device {name!r} does not exist: this machine has {count} CUDA "
                         f"device(s), cuda:0..cuda:{count - 1}")
    return torch.device("cuda", index)


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """float32 / bfloat16 / float16 (or their short names) as a torch dtype."""
    if isinstance(name, torch.dtype):
        if name in _DTYPES.values():
            return name
    elif name in _DTYPES:
        return _DTYPES[name]
    raise ValueError(f"unsupported dtype {name!r}: use one of {', '.join(_DTYPES)}")


def o_proj_has_bias(spec: ModelSpec) -> bool:
    """Llama's, Qwen3's and Qwen3-MoE's `attention_bias` cover q, k, v and o (transformers'
    `LlamaAttention`, `Qwen3Attention`, `Qwen3MoeAttention`); Qwen2's covers q, k and v
    only."""
    return spec.attention_bias and spec.architecture in (
        "LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True, slots=True)
class WeightSlot:
    """Where one checkpoint tensor lives in the model: rows [row_start, row_start +
    shape[0]) of parameter `param`."""

    param: str
    row_start: int
    shape: tuple[int, ...]


_SWIGLU_NAMES = {"MixtralForCausalLM": ("block_sparse_moe", "w1", "w3", "w2")}
"""Per architecture: the checkpoint's name of a MoE layer's module, and of an expert's
gate, up and down projections (default: "mlp", "gate_proj", "up_proj", "down_proj")."""


def _swiglu_slots(hf: str, ours: str, names: tuple[str, str, str], hidden: int,
                  width: int) -> dict[str, WeightSlot]:
    """The three tensors of one SwiGLU MLP (`hf` and `ours` end in a dot)."""
    gate, up, down = names
    return {f"{hf}{gate}.weight": WeightSlot(f"{ours}gate_up_proj.weight", 0, (width, hidden)),
            f"{hf}{up}.weight": WeightSlot(f"{ours}gate_up_proj.weight", width, (width, hidden)),
            f"{hf}{down}.weight": WeightSlot(f"{ours}down_proj.weight", 0, (hidden, width))}


def _mlp_layout(spec: ModelSpec, layer: int) -> dict[str, WeightSlot]:
    """Layer `layer`'s dense MLP, or its router and experts."""
    h, ours, moe = spec.hidden_size, f"model.layers.{layer}.mlp.", spec.moe
    if moe is None or layer in moe.dense_layers:
        return _swiglu_slots(ours, ours, ("gate_proj", "up_proj", "down_proj"), h,
                             spec.intermediate_size)
    block, *names = _SWIGLU_NAMES.get(spec.architecture,
                                      ("mlp", "gate_proj", "up_proj", "down_proj"))
    hf = f"model.layers.{layer}.{block}."
    layout = {f"{hf}gate.weight": WeightSlot(f"{ours}gate.weight", 0, (moe.num_experts, h))}
    for j in range(moe.num_experts):
        layout.update(_swiglu_slots(f"{hf}experts.{j}.", f"{ours}experts.{j}.", tuple(names), h,
                                    moe.expert_intermediate_size))
    return layout


def hf_weight_layout(spec: ModelSpec) -> dict[str, WeightSlot]:
    """Every Hugging Face tensor name the model needs, mapped to its slot (model order)."""
    h = spec.hidden_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    layout = {"model.embed_tokens.weight":
              WeightSlot("model.embed_tokens.weight", 0, (spec.vocab_size, h))}
    for i in range(spec.num_layers):
        attn = f"model.layers.{i}.self_attn."
        for proj, start, rows in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
            layout[f"{attn}{proj}_proj.weight"] = WeightSlot(f"{attn}qkv_proj.weight", start,
                                                             (rows, h))
            if spec.attention_bias:
                layout[f"{attn}{proj}_proj.bias"] = WeightSlot(f"{attn}qkv_proj.bias", start,
                                                               (rows,))
        layout[f"{attn}o_proj.weight"] = WeightSlot(f"{attn}o_proj.weight", 0, (h, q))
        if o_proj_has_bias(spec):
            layout[f"{attn}o_proj.bias"] = WeightSlot(f"{attn}o_proj.bias", 0, (h,))
        if spec.qk_norm:
            for norm in ("q_norm", "k_norm"):
                layout[f"{attn}{norm}.weight"] = WeightSlot(f"{attn}{norm}.weight", 0,
                                                            (spec.head_dim,))
        layout.update(_mlp_layout(spec, i))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            name = f"model.layers.{i}.{norm}.weight"
            layout[name] = WeightSlot(name, 0, (h,))
    layout["model.norm.weight"] = WeightSlot("model.norm.weight", 0, (h,))
    if not spec.tie_word_embeddings:
        layout["lm_head.weight"] = WeightSlot("lm_head.weight", 0, (spec.vocab_size, h))
    return layout


@dataclass(frozen=True)
class CheckpointPlan:
    """A validated checkpoint: which file holds each tensor the model needs."""

    path: Path
    files: dict[str, Path]
    """HF tensor name -> safetensors file."""


def _checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map' object")
        files = sorted({folder / f for f in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint {folder} holds no *.safetensors file")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"checkpoint {folder}: shard(s) named in the index are missing: {missing}")
    return files


def _check_config(folder: Path, spec: ModelSpec) -> None:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"checkpoint {folder} has no config.json")
    found = ModelSpec.from_hf_config(json.loads(config_path.read_text()), name=spec.name)
    differ = [f.name for f in fields(ModelSpec)
              if f.compare and getattr(found, f.name) != getattr(spec, f.name)]
    if differ:
        detail = ", ".join(f"{n}: checkpoint {getattr(found, n)!r} vs spec {getattr(spec, n)!r}"
                           for n in differ)
        raise ValueError(f"checkpoint {folder} does not match the model spec ({detail})")


def plan_checkpoint(path: str | Path, spec: ModelSpec) -> CheckpointPlan:
    """Validates a checkpoint folder against `spec` from config.json and tensor headers only.

    Raises ValueError naming the problem: no folder / config.json / shards, an unsupported
    architecture, a config that disagrees with the spec, a tensor that is missing,
    unexpected, or of the wrong shape (with expected and found shapes)."""
    from safetensors import safe_open

    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"checkpoint {folder} is not a directory")
    _check_config(folder, spec)
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in _checkpoint_files(folder):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                found[name] = (file, tuple(f.get_slice(name).get_shape()))
    layout = hf_weight_layout(spec)
    missing = [n for n in layout if n not in found]
    if missing:
        raise ValueError(f"checkpoint {folder} lacks {len(missing)} tensor(s) the model needs, "
                         f"e.g. {missing[:3]}")
    unexpected = [n for n in found if n not in layout and not n.endswith(_IGNORED_SUFFIXES)
                  and not (spec.tie_word_embeddings and n == "lm_head.weight")]
    if unexpected:
        raise ValueError(f"checkpoint {folder} holds {len(unexpected)} tensor(s) this "
                         f"{spec.architecture} does not use, e.g. {unexpected[:3]}")
    for name, slot in layout.items():
        if found[name][1] != slot.shape:
            raise ValueError(f"checkpoint tensor {name} has shape {found[name][1]}, the model "
                             f"expects {slot.shape}")
    return CheckpointPlan(folder, {name: found[name][0] for name in layout})


def load_checkpoint(model: nn.Module, plan: CheckpointPlan, spec: ModelSpec) -> None:
    """Copies every tensor of a validated checkpoint into its slot, casting to the model's
    dtype; reads each shard once, straight onto the model's device."""
    from safetensors import safe_open

    layout = hf_weight_layout(spec)
    device = next(model.parameters()).device
    by_file: dict[Path, list[str]] = {}
    for name, file in plan.files.items():
        by_file.setdefault(file, []).append(name)
    with torch.no_grad():
        for file, names in sorted(by_file.items()):
            with safe_open(file, framework="pt", device=str(device)) as f:
                for name in names:
                    slot = layout[name]
                    param = model.get_parameter(slot.param)
                    param[slot.row_start: slot.row_start + slot.shape[0]].copy_(f.get_tensor(name))


def init_random_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Seeded init in place, on the model's device and dtype: norms 1, everything else
    N(0, std). Deterministic for a given (seed, device type); as fast as a fill."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=generator)
