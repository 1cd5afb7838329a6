"""Analytic kernel times: what one GPU kernel of a given shape costs.

Every kernel is priced by a roofline of its own — FLOPs over a fraction of the tensor-core
peak, bytes over a fraction of HBM (or link) bandwidth — plus what a bare roofline lacks
and the measurements show (`../shared/gpu-measurements/`): a time floor no kernel beats,
compute and memory traffic that overlap only partly, a serial latency along a GEMM's
reduction dimension, and attention whose efficiency depends on batch, context and heads
through the work each thread block gets. Parameters are few, named and physical; each
dataclass field says what it means. `KernelParams.roofline()` is the bare roofline (every
efficiency 1, no floor, full overlap); fitted values live in calibration profiles.

All functions take numpy arrays or floats and broadcast, so one call prices a table of
shapes (the cost model tabulates GEMMs over every token count once per setup; the fitter
evaluates thousands of measured shapes per iteration).

Combining compute and memory: `_overlap(c, m, q) = (c^q + m^q)^(1/q)`. q = inf is the
roofline's max (perfect overlap), q = 1 the sum (none); measured kernels sit between.

The models live one family per module — `gemm`, `attention`, `moe` (fused experts), `mla`
(latent attention), `movement` (element-wise, all-reduce, all-to-all, host copies) — over
`base`; this package gathers them and the per-GPU bundle.
"""
from __future__ import annotations

from dataclasses import dataclass

from servelab.simulator.kernels.attention import (
    TILE_ROWS, DecodeAttentionParams, PrefillAttentionParams, decode_attention_lines,
    decode_attention_time, fa2_num_splits, prefill_attention_coefficients, prefill_attention_time)
from servelab.simulator.kernels.base import INF
from servelab.simulator.kernels.gemm import BENCH_LAYERS, TILE_M, TILE_N, GemmParams, gemm_time
from servelab.simulator.kernels.mla import (
    MLADecodeParams, MLAPrefillParams, mla_decode_lines, mla_decode_time,
    mla_prefill_coefficients, mla_prefill_time)
from servelab.simulator.kernels.moe import (
    MoEParams, expert_load, fused_moe_time, moe_experts_time, moe_layer_time, parse_expert_load)
from servelab.simulator.kernels.movement import (
    AllToAllParams, CollectiveParams, ElementwiseParams, HostLinkParams, allreduce_route,
    allreduce_time, alltoall_time, elementwise_time, host_copy_time)

__all__ = ["BENCH_LAYERS", "INF", "TILE_M", "TILE_N", "TILE_ROWS", "AllToAllParams",
           "CollectiveParams", "DecodeAttentionParams", "ElementwiseParams", "GemmParams",
           "HostLinkParams", "KernelParams", "MLADecodeParams", "MLAPrefillParams", "MoEParams",
           "PrefillAttentionParams", "allreduce_route", "allreduce_time", "alltoall_time",
           "decode_attention_lines", "decode_attention_time", "elementwise_time", "expert_load",
           "fa2_num_splits",
           "fused_moe_time", "gemm_time", "host_copy_time", "mla_decode_lines", "mla_decode_time",
           "mla_prefill_coefficients", "mla_prefill_time", "moe_experts_time", "moe_layer_time",
           "parse_expert_load", "prefill_attention_coefficients", "prefill_attention_time"]


# ------------------------------------------------------------------------------ bundle


_SECTIONS = {"gemm": GemmParams, "gemm_fp8": GemmParams, "attn_prefill": PrefillAttentionParams,
             "attn_decode": DecodeAttentionParams, "elementwise": ElementwiseParams,
             "collective": CollectiveParams, "host_link": HostLinkParams, "moe": MoEParams,
             "moe_fp8": MoEParams, "moe_cutlass": MoEParams, "moe_fp8_ep": MoEParams,
             "mla_prefill": MLAPrefillParams,
             "mla_decode": MLADecodeParams, "alltoall": AllToAllParams}


@dataclass(frozen=True, slots=True)
class KernelParams:
    """Every kernel family's parameters for one GPU."""

    gemm: GemmParams = GemmParams()
    gemm_fp8: GemmParams = GemmParams()
    """FP8 GEMMs (W8A8 at the FP8 peak); where none were measured, the BF16 parameters."""
    attn_prefill: PrefillAttentionParams = PrefillAttentionParams()
    attn_decode: DecodeAttentionParams = DecodeAttentionParams()
    elementwise: ElementwiseParams = ElementwiseParams()
    collective: CollectiveParams = CollectiveParams()
    host_link: HostLinkParams = HostLinkParams()
    moe: MoEParams = MoEParams()
    """Fused mixture-of-experts layers, BF16 weights (and weight-only FP8 where the GPU has
    no FP8 tensor cores)."""
    moe_fp8: MoEParams = MoEParams()
    """Fused mixture-of-experts layers, FP8 weights and activations (W8A8)."""
    moe_cutlass: MoEParams | None = None
    """BF16 fused MoE on FlashInfer's CUTLASS kernel, where the engine runs another kernel
    by default and falls back to this one for a routing that kernel does not take: vLLM
    0.24 on Blackwell runs FlashInfer's TRT-LLM BF16 kernel for renormalised top-k, Llama-4
    and DeepSeek-V3 routing (`TrtLlmBf16ExpertsMonolithic._supports_routing_method`) and
    the CUTLASS one otherwise (plain softmax top-k: a Qwen3-MoE config with
    `norm_topk_prob` false). None where no table measured that kernel beside the default
    one: every layer is priced with `moe`."""
    moe_fp8_ep: MoEParams | None = None
    """FP8 fused MoE under expert parallelism, where the engine runs another kernel then
    than without it: vLLM 0.24 on H100 ran block-scaled FP8 layers on FlashInfer's CUTLASS
    kernel at every EP degree above 1 and on Triton without EP (aiconfigurator's tables,
    their `kernel_source`). None where no table shows such a split: `moe_fp8` prices
    every layout."""
    mla_prefill: MLAPrefillParams = MLAPrefillParams()
    mla_decode: MLADecodeParams = MLADecodeParams()
    alltoall: AllToAllParams = AllToAllParams()

    @classmethod
    def roofline(cls) -> "KernelParams":
        """The bare roofline: peaks reached, no floors, no latencies, full overlap."""
        return cls()

    @staticmethod
    def bare(name: str):
        """Family `name`'s bare-roofline parameters (an optional path's too)."""
        return _SECTIONS[name]()

    def gemm_for(self, dtype: str) -> GemmParams:
        return self.gemm_fp8 if dtype == "fp8" else self.gemm

    def moe_for(self, dtype: str, gpu, default_routing: bool = True, ep: int = 1) -> MoEParams:
        """The fused-MoE parameters that price `dtype` weights on `gpu`: W8A8 FP8 where it
        has FP8 tensor cores (`moe_fp8_ep` under expert parallelism, `ep` > 1, where the
        profile has one), else (BF16, or FP8 run weight-only) the BF16 kernel's — the
        fallback kernel's (`moe_cutlass`) for a layer whose routing the default BF16 kernel
        does not take (`default_routing` False), where the profile has one."""
        from servelab.simulator.kernels.moe import kernel_dtype

        if kernel_dtype(dtype, gpu) == "fp8":
            return self.moe_fp8 if ep <= 1 or self.moe_fp8_ep is None else self.moe_fp8_ep
        return self.moe if default_routing or self.moe_cutlass is None else self.moe_cutlass

    def to_dict(self) -> dict[str, dict]:
        return {name: getattr(self, name).to_dict() for name in _SECTIONS
                if getattr(self, name) is not None}

    @classmethod
    def from_dict(cls, data: dict, source: str = "kernels") -> "KernelParams":
        if not isinstance(data, dict):
            raise ValueError(f"{source} must be an object of kernel families, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_SECTIONS))
        if unknown:
            raise ValueError(f"{source}: unknown kernel family(ies) {', '.join(unknown)}; "
                             f"known: {', '.join(_SECTIONS)}")
        return cls(**{name: _SECTIONS[name].from_dict(value, f"{source}.{name}")
                      for name, value in data.items()})
