"""Fused mixture-of-experts kernel times: one MoE layer's experts on one GPU.

What runs (vLLM's Triton `fused_experts`, `vllm/model_executor/layers/fused_moe/fused_moe.py`):
the (token, expert) pairs are sorted by expert and padded to a multiple of the tile's rows
(`moe_align_block_size`), a grouped GEMM multiplies each tile by its expert's gate and up
projections (hidden -> 2 x inter), an activation kernel applies SiLU·mul, a second grouped
GEMM the down projection (inter -> hidden), and `moe_sum` adds each token's top-k outputs.
Under expert parallelism (EP) a GPU holds experts/EP experts and skips (writes zeros for)
the pairs of the others; tensor parallelism (TP) splits every expert's inter dimension.

The time is a roofline of two terms, as for a dense GEMM (`gemm.py`):

    compute = tiles x tile_rows x 2 x W / (peak x compute_eff)      W = 3 x hidden x inter/TP
    memory  = (active_experts x W x weight_bytes + pairs x activation bytes) / (HBM x memory_eff)

combined by a soft maximum, plus a floor, the top-k combine over every pair of the step and,
for FP8 (W8A8), the activation quantisation. At small batches the weights of each activated
expert are read once and dominate; at large batches the padded tiles' FLOPs do. How many
experts, pairs and tiles the GPU gets is `expert_load`'s business: balanced routing, or the
power-law spread NVIDIA aiconfigurator measures with.

The router GEMM (tokens x hidden x experts) is a dense GEMM the measured kernel does not
include; `moe_layer_time` adds it. Shared experts are a dense MLP: the cost model prices
them with `gemm_time`.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from servelab.simulator.gpus import GPUSpec
from servelab.simulator.kernels.base import INF, _check_fields, _overlap, _Params
from servelab.simulator.kernels.gemm import GemmParams, gemm_time

TILE_ROWS = (1, 8, 16, 32, 64, 128)
"""Tile heights (rows of pairs per thread block) `expert_load` counts tiles for; 1: no
padding (the bare roofline)."""
LOAD_SAMPLES = 32
"""Draws of the power-law routing averaged into its expected load (a seeded generator: the
same draws for every call, so the answer is a pure function of the shape)."""
LARGEST_FIRST, SMALLEST_FIRST = "largest-first", "smallest-first"
"""How the power-law generator tops its rounded counts up to tokens x top-k: to the experts
with the most tokens first, ties in random order, as aiconfigurator's `collector/helper.py`
is written (`_generate_power_law_distribution`) and as its vLLM 0.19 and 0.24 tables
behave; or to the experts with the fewest first, ties by index, which is how the times of
its vLLM 0.14 tables behave at small batches (see docs/moe-mla.md). Serving uses the first."""


# --------------------------------------------------------------------------- expert load


def parse_expert_load(text: str) -> tuple[str, float]:
    """"balanced" -> ("balanced", 0); "power-law:1.2" or aiconfigurator's "power_law_1.2"
    -> ("power-law", 1.2). The exponent must be a number above 0 and not 1."""
    value = str(text).strip()
    if value == "balanced":
        return "balanced", 0.0
    match = re.fullmatch(r"power[-_]law[:_](.*)", value)
    if match:
        try:
            alpha = float(match.group(1))
        except ValueError:
            alpha = math.nan
        if alpha > 0 and alpha != 1 and math.isfinite(alpha):
            return "power-law", alpha
        raise ValueError(f"expert load {text!r}: the power-law exponent must be a number > 0 "
                         f"other than 1 (e.g. power-law:1.2)")
    raise ValueError(f"unknown expert load {text!r}; expected balanced or power-law:ALPHA "
                     f"(e.g. power-law:1.2)")


def expert_load(tokens, experts: int, topk: int, ep: int = 1, load: str = "balanced",
                top_up: str = LARGEST_FIRST) -> np.ndarray:
    """Expected load of the most loaded GPU of an EP group, per token count in `tokens`
    (array or scalar): an array of shape (2 + len(TILE_ROWS), *tokens.shape) holding the
    experts that receive a token, the (token, expert) pairs computed, and for each tile
    height in TILE_ROWS the tiles those pairs fill once each expert's rows are padded.

    balanced: aiconfigurator's `balanced_logits` spreads tokens x top-k pairs evenly (each
    GPU gets tokens x top-k / EP pairs on min(its experts, that many) experts).
    power-law:ALPHA: its `power_law_logits_v3`, in expectation over LOAD_SAMPLES seeded
    draws: expert weights drawn from a power law x^-ALPHA on [1, 0.8 x tokens] (on
    [0.01, 2] when tokens x top-k <= experts), scaled and rounded to tokens x top-k pairs,
    and the EP group with the most pairs is the one measured (what an EP step waits for).
    Cost: a few hundred microseconds per new power-law shape; repeats are cached."""
    kind, alpha = parse_expert_load(load)
    check_moe_shape(experts, topk, ep)
    if top_up not in (LARGEST_FIRST, SMALLEST_FIRST):
        raise ValueError(f"top_up must be {LARGEST_FIRST!r} or {SMALLEST_FIRST!r}, got {top_up!r}")
    t = np.asarray(tokens, dtype=np.float64)
    flat = t.reshape(-1)
    out = np.zeros((2 + len(TILE_ROWS), flat.size))
    for i, n in enumerate(flat.tolist()):
        if n <= 0:
            continue
        if kind == "balanced":
            out[:, i] = _balanced(n, experts, topk, ep)
        elif n != int(n):
            raise ValueError(f"power-law expert load needs whole token counts, got {n}")
        else:
            out[:, i] = _power_law(int(n), experts, topk, ep, alpha, top_up)
    return out.reshape((2 + len(TILE_ROWS), *t.shape))


def check_moe_shape(experts: int, topk: int, ep: int = 1) -> None:
    """One-line errors for a routing that cannot exist."""
    if experts < 1 or ep < 1:
        raise ValueError(f"experts ({experts}) and EP ({ep}) must be >= 1")
    if experts % ep:
        raise ValueError(f"experts ({experts}) must be divisible by EP ({ep})")
    if not 1 <= topk <= experts:
        raise ValueError(f"top-k ({topk}) must be between 1 and the number of experts ({experts})")


def _balanced(tokens: float, experts: int, topk: int, ep: int) -> list[float]:
    pairs = tokens * topk / ep
    active = min(experts / ep, math.ceil(pairs))
    per_expert = max(1.0, tokens * topk / experts)
    return [active, max(pairs, active)] + [active * math.ceil(per_expert / r) for r in TILE_ROWS]


@lru_cache(maxsize=1 << 16)
def _power_law(tokens: int, experts: int, topk: int, ep: int, alpha: float, top_up: str):
    """(active, pairs, tiles per TILE_ROWS...) of the most loaded EP group, averaged over
    LOAD_SAMPLES draws of aiconfigurator's generator. Pure: a fixed seed."""
    rng = np.random.default_rng(0)
    u = rng.random((LOAD_SAMPLES, experts))
    ties = rng.random((LOAD_SAMPLES, experts))
    lo, hi = (1.0, 0.8 * tokens) if tokens * topk > experts else (0.01, 2.0)
    a = 1.0 - alpha
    weights = ((hi ** a - lo ** a) * u + lo ** a) ** (1.0 / a)       # inverse CDF of x^-alpha
    target = tokens * topk
    counts = np.rint(weights / weights.sum(axis=1, keepdims=True) * target)
    delta = target - counts.sum(axis=1)
    index = np.broadcast_to(np.arange(experts), counts.shape)
    if top_up == LARGEST_FIRST:
        order = np.lexsort((ties, -counts), axis=1)
    else:
        order = np.lexsort((index, counts), axis=1)
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(experts)[None, :].repeat(LOAD_SAMPLES, 0), axis=1)
    up = np.maximum(delta, 0)[:, None]
    counts += up // experts + (rank < up % experts)
    for s in np.flatnonzero(delta < 0):           # rounding overshot: take from the smallest
        _trim(counts[s], int(-delta[s]))
    groups = counts.reshape(LOAD_SAMPLES, ep, experts // ep)
    local = groups[np.arange(LOAD_SAMPLES), groups.sum(axis=2).argmax(axis=1)]
    stats = [(local > 0).sum(axis=1).mean(), local.sum(axis=1).mean()]
    stats += [np.ceil(local / r).sum(axis=1).mean() for r in TILE_ROWS]
    return tuple(float(s) for s in stats)


def _trim(counts: np.ndarray, excess: int) -> None:
    order = np.argsort(counts, kind="stable")
    for i in range(excess):
        j = order[i % len(order)]
        counts[j if counts[j] > 0 else int(np.argmax(counts))] -= 1


# ------------------------------------------------------------------------------- kernel


@dataclass(frozen=True, slots=True)
class MoEParams(_Params):
    """vLLM's fused-experts kernel (grouped GEMMs, activation, top-k sum) on one GPU."""

    floor_s: float = 0.0
    """Seconds no fused-MoE call beats: the alignment, two GEMMs, activation and sum
    launches inside a CUDA graph."""
    compute_eff: float = 1.0
    """Fraction of the tensor-core peak on full (64-row or taller) tiles."""
    small_tile_eff: float = 1.0
    """Further fraction on tiles under 64 rows (Hopper's warp-group MMA is 64 rows tall)."""
    memory_eff: float = 1.0
    """Fraction of HBM bandwidth streaming the activated experts' weights."""
    overlap: float = INF
    """Soft-maximum exponent of compute against weight streaming (1: add, inf: max)."""
    combine_traffic: float = 0.0
    """Bytes moved per (token, expert) pair of the whole step — every GPU's, as each writes
    zeros for the others' (EP) — by the activation and the top-k sum, as a multiple of
    the pair's activations (4 x hidden + 6 x inter/TP bytes); 0 in the bare roofline."""
    quant_elem_s: float = 0.0
    """Seconds per activation element quantised to FP8 before each GEMM (W8A8 only)."""
    small_tile_rows: float = 1.0
    """Rows per tile while tokens <= experts (vLLM's default config: 16); an engine setting."""
    large_tile_rows: float = 1.0
    """Rows per tile above that (vLLM's default config: 64); an engine setting."""
    naive_sparsity: float = 0.0
    """Without EP, while tokens x top-k x this <= experts every pair is its own tile and
    reads its expert's weights alone (vLLM's small-batch path, SPARSITY_FACTOR = 4); 0:
    no such path. An engine setting."""

    _fractions = ("compute_eff", "small_tile_eff", "memory_eff")

    def __post_init__(self) -> None:
        _check_fields(self)
        for name in ("small_tile_rows", "large_tile_rows"):
            if getattr(self, name) not in TILE_ROWS:
                raise ValueError(f"MoEParams.{name} must be one of "
                                 f"{', '.join(map(str, TILE_ROWS))}, got {getattr(self, name)!r}")


def moe_experts_time(tokens, hidden, inter, experts: int, topk: int, gpu: GPUSpec, p: MoEParams,
                     ep: int = 1, tp: int = 1, dtype: str = "bf16", load: str = "balanced",
                     top_up: str = LARGEST_FIRST):
    """Seconds of one layer's fused experts on the most loaded GPU for `tokens` tokens
    (array or scalar; every GPU of the EP group sees all of them, as vLLM runs EP with
    the tokens gathered): `experts` routed experts of `inter` width, `topk` per token.

    dtype "bf16": BF16 weights and maths. "fp8": FP8 weights; W8A8 at the FP8 peak where
    the GPU has FP8 tensor cores, else weight-only (Marlin: BF16 maths, 1-byte weights)."""
    if inter % tp:
        raise ValueError(f"the expert width ({inter}) must be divisible by TP ({tp})")
    stats = expert_load(tokens, experts, topk, ep, load, top_up)
    return fused_moe_time(tokens, hidden, inter / tp, experts, topk, ep, stats, gpu, p, dtype)


def fused_moe_time(tokens, hidden, inter_gpu, experts, topk, ep, stats, gpu: GPUSpec,
                   p: MoEParams, dtype: str = "bf16"):
    """`moe_experts_time` from a precomputed `expert_load` (everything broadcasts: a cost
    model tabulates the load over token counts once, a fitter over a table's rows)."""
    if dtype not in ("bf16", "fp8"):
        raise ValueError(f"MoE dtype must be bf16 or fp8, got {dtype!r}")
    t = np.asarray(tokens, dtype=np.float64)
    w8a8 = dtype == "fp8" and gpu.fp8_tflops is not None
    weight_bytes, act_bytes = (1.0 if dtype == "fp8" else 2.0), (1.0 if w8a8 else 2.0)
    per_expert = 3.0 * hidden * np.asarray(inter_gpu, dtype=np.float64)   # gate, up, down
    small = t <= experts
    rows = np.where(small, p.small_tile_rows, p.large_tile_rows)
    active, pairs = stats[0], stats[1]
    tiles = np.where(small, stats[2 + TILE_ROWS.index(int(p.small_tile_rows))],
                     stats[2 + TILE_ROWS.index(int(p.large_tile_rows))])
    if p.naive_sparsity:
        naive = (np.asarray(ep) == 1) & (t * topk * p.naive_sparsity <= experts)
        active, tiles = np.where(naive, pairs, active), np.where(naive, pairs, tiles)
    eff = p.compute_eff * np.where(rows < 64, p.small_tile_eff, 1.0)
    compute = tiles * rows * 2.0 * per_expert / (gpu.peak_flops("fp8" if w8a8 else "bf16") * eff)
    bw = gpu.hbm_bandwidth_gbps * 1e9
    memory = (active * per_expert * weight_bytes
              + pairs * (2.0 * hidden + 3.0 * inter_gpu) * act_bytes) / (bw * p.memory_eff)
    gemms = np.maximum(compute, memory) if p.overlap == INF else _overlap(compute, memory, p.overlap)
    combine = p.combine_traffic * t * topk * (4.0 * hidden + 6.0 * inter_gpu) / bw
    quant = p.quant_elem_s * (t * hidden + pairs * inter_gpu) if w8a8 else 0.0
    return np.where(t > 0, p.floor_s + gemms + combine + quant, 0.0)


def moe_layer_time(tokens, hidden, inter, experts: int, topk: int, gpu: GPUSpec, p: MoEParams,
                   router: GemmParams, ep: int = 1, tp: int = 1, dtype: str = "bf16",
                   load: str = "balanced"):
    """Seconds of one MoE layer on the most loaded GPU: the router GEMM (tokens x hidden x
    experts, BF16, replicated on every GPU) and the fused experts. Shared experts and the
    EP all-to-all (`movement.alltoall_time`) are priced by the caller."""
    t = np.asarray(tokens, dtype=np.float64)
    route = np.where(t > 0, gemm_time(np.maximum(t, 1.0), experts, hidden, gpu, router), 0.0)
    return route + moe_experts_time(t, hidden, inter, experts, topk, gpu, p, ep, tp, dtype, load)
