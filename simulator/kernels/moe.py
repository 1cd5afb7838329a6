"""Fused mixture-of-experts kernel times: one MoE layer's experts on one GPU.

What runs (vLLM's Triton `fused_experts`, `vllm/model_executor/layers/fused_moe/fused_moe.py`):
the (token, expert) pairs are sorted by expert and padded to a multiple of the tile's rows
(`moe_align_block_size`), a grouped GEMM multiplies each tile by its expert's gate and up
projections (hidden -> 2 x inter), an activation kernel applies SiLU·mul, a second grouped
GEMM the down projection (inter -> hidden), and `moe_sum` adds each token's top-k outputs.
Under expert parallelism (EP) a GPU holds experts/EP experts and skips (writes zeros for)
the pairs of the others; tensor parallelism (TP) splits every expert's inter dimension.

The time is a roofline of two terms, as for a dense GEMM (`gemm.py`):

    compute = tiles x tile_rows x 2 x W / (peak x eff)      W = 3 x hidden x inter/TP
                                                            (2 x: experts without a gate)
    memory  = (weight passes x W x weight_bytes [/ large_memory_eff]
               + pairs x activation bytes) / (HBM x memory_eff) + weight passes x expert_s

combined by a soft maximum (times `misaligned_slowdown` for a width Triton cannot align),
plus a floor, the last tiles' serial loops over K (`k_depth_s`), the top-k combine over
every pair of the step (another GPU's at `remote_pair_share`; read back from L2 while the
pairs' rows fit there, `combine_l2_fraction`) and, for FP8 (W8A8), the activation
quantisation. `eff` is `tuned_compute_eff` for the layers vLLM
ships a tuned kernel config for, else compute_eff / (1 + inter/TP / width_knee): untuned wide
experts run at a lower rate (`VLLM_TUNED_MOE`). At small batches the weights of each activated
expert dominate; at large batches the padded tiles' FLOPs do. An expert's weights are read
once per group of tiles that run together (`small_stream_rows`, `large_stream_rows`: vLLM's
small-batch config runs 16-row tiles one after another, GROUP_SIZE_M = 1, so an expert with
40 pairs streams its weights three times — on A100 and H100 the measured small-batch times
of expert-parallel DeepSeek-V3 layers follow these passes, not the experts touched); a pass
after an expert's first comes from L2 if that expert fits there, and an isolated benchmark
replaying the call (`warm_l2`, as the fitter prices measured rows) finds every touched
expert in L2 if they all fit (`l2_fraction`: RTX PRO 6000, B200 and L40S, 96-128 MB of L2,
hold one DeepSeek-V3 expert of 88 MB). How many experts, pairs, tiles and passes the GPU
gets is `expert_load`'s business: balanced routing, or the power-law spread NVIDIA
aiconfigurator measures with, no expert receiving more than one pair per token.

Experts without a gate (`gated=False`: squared ReLU on one up projection, as NVIDIA's
Nemotron-H models have them, `mlp_hidden_act: relu2`) have one hidden -> inter projection
where gated ones have two: two thirds of the weights, FLOPs and intermediate traffic.

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
from servelab.simulator.kernels.base import INF, _check_fields, _overlap, _Params, l2_hit
from servelab.simulator.kernels.gemm import GemmParams, gemm_time

TILE_ROWS = (1, 8, 16, 32, 64, 128, 256, 512, 1024)
"""Row counts `expert_load` counts per-expert blocks of: tile heights (rows of pairs per
thread block; 1: no padding, the bare roofline) and, above 128, the rows that share one
pass over an expert's weights (a tile height times the kernel's GROUP_SIZE_M)."""
LOAD_SAMPLES = 32
"""Draws of the power-law routing averaged into its expected load (a seeded generator: the
same draws for every call, so the answer is a pure function of the shape)."""
LARGEST_FIRST, SMALLEST_FIRST, ROUND_ROBIN = "largest-first", "smallest-first", "round-robin"
"""How the power-law generator tops its rounded counts up to tokens x top-k: to the experts
with the most tokens first, ties in random order, as aiconfigurator's `collector/helper.py`
was first written (`_generate_power_law_distribution`); to the experts with the fewest
first, ties by index, which is how the times of its vLLM 0.14 tables behave at small
batches (see docs/moe-mla.md); or as the helper is written now: each expert capped at
`tokens` pairs (a token picks an expert once) and the surplus and the rounding deficit
handed out one pair at a time to the EP ranks in turn, each to its least-loaded expert
(`_round_robin_adjust_per_rank`), as the vLLM 0.19 and 0.24 tables behave at small
batches (one token, top-8 of 256 experts, EP 16: about one expert's weights on rank 0, not
two). Serving uses the first."""


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
    if top_up not in (LARGEST_FIRST, SMALLEST_FIRST, ROUND_ROBIN):
        raise ValueError(f"top_up must be {LARGEST_FIRST!r}, {SMALLEST_FIRST!r} or "
                         f"{ROUND_ROBIN!r}, got {top_up!r}")
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
    if top_up == ROUND_ROBIN:
        return _stats(_round_robin_counts(counts, tokens, target, ep), ep)
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
    busiest = counts.reshape(LOAD_SAMPLES, ep, experts // ep).sum(axis=2).argmax(axis=1)
    # A token picks k distinct experts, so no expert gets more than `tokens` pairs: the
    # generator's surplus (an expert drawn for some tokens twice) goes to the ties of the
    # top-k, taken here as the least-loaded experts first (the rank measured stays the one
    # the generator chose before).
    capped = np.minimum(counts, tokens)
    surplus = (counts - capped).sum(axis=1)
    if surplus.any():
        capped = _fill(capped[:, None, :], surplus[:, None], tokens)[:, 0, :]
    groups = capped.reshape(LOAD_SAMPLES, ep, experts // ep)
    local = groups[np.arange(LOAD_SAMPLES), busiest]
    stats = [(local > 0).sum(axis=1).mean(), local.sum(axis=1).mean()]
    stats += [np.ceil(local / r).sum(axis=1).mean() for r in TILE_ROWS]
    return tuple(float(s) for s in stats)


def _stats(counts: np.ndarray, ep: int) -> tuple[float, ...]:
    """(active, pairs, tiles...) of the busiest EP rank of capped, whole counts."""
    groups = counts.reshape(LOAD_SAMPLES, ep, -1)
    local = groups[np.arange(LOAD_SAMPLES), groups.sum(axis=2).argmax(axis=1)]
    stats = [(local > 0).sum(axis=1).mean(), local.sum(axis=1).mean()]
    stats += [np.ceil(local / r).sum(axis=1).mean() for r in TILE_ROWS]
    return tuple(float(x) for x in stats)


def _round_robin_counts(counts: np.ndarray, tokens: int, target: int, ep: int) -> np.ndarray:
    """The current helper's counts: capped at `tokens`, the surplus and then the deficit
    (or excess) to `target` dealt to the ranks in turn, each unit to the rank's least
    (or, taking, most) loaded expert with room, ties to the lowest index."""
    capped = np.minimum(counts, tokens)
    surplus = (counts - capped).sum(axis=1).astype(np.int64)
    shaped = capped.reshape(LOAD_SAMPLES, ep, -1)
    if surplus.any():
        shaped = _deal(shaped, surplus, tokens, add=True)
    delta = (target - shaped.sum(axis=(1, 2))).astype(np.int64)
    if (delta > 0).any():
        shaped = _deal(shaped, np.maximum(delta, 0), tokens, add=True)
    if (delta < 0).any():
        shaped = _deal(shaped, np.maximum(-delta, 0), tokens, add=False)
    return shaped.reshape(LOAD_SAMPLES, -1)


def _deal(counts: np.ndarray, units: np.ndarray, cap: int, add: bool) -> np.ndarray:
    """Deal `units` (per sample) to the ranks in turn, rank 0 first; within a rank, each
    unit to the least loaded expert below `cap` (add) or from the most loaded one above 0,
    ties to the lowest index: a rank's share water-fills it (or drains it) level by level."""
    counts = counts.copy()
    samples, ranks, _ = counts.shape
    left = units.astype(np.int64).copy()
    while left.any():
        room = (cap - counts if add else counts).sum(axis=2)          # (samples, ranks)
        open_ = room > 0
        n_open = open_.sum(axis=1)
        if not (n_open[left > 0] > 0).any():
            break
        share = np.zeros((samples, ranks), dtype=np.int64)
        for s_ in np.flatnonzero((left > 0) & (n_open > 0)):
            order = np.flatnonzero(open_[s_])
            q, r = divmod(int(left[s_]), len(order))
            share[s_, order] = q
            share[s_, order[:r]] += 1
        share = np.minimum(share, room.astype(np.int64))
        counts = _fill(counts, share, cap) if add else -_fill(-counts, share, 0)
        left -= share.sum(axis=1)
    return counts


def _fill(counts: np.ndarray, units: np.ndarray, cap: float) -> np.ndarray:
    """Raise each (sample, rank) row's lowest counts by `units` in all, one at a time to
    the lowest below `cap` (ties: lowest index): every count below a level L rises to L,
    and the leftover lifts the first experts at L by one."""
    lo, hi = counts.min(axis=2).astype(np.float64), np.full(units.shape, float(cap))
    added = lambda level: np.maximum(np.minimum(level[..., None], cap) - counts, 0).sum(axis=2)
    for _ in range(40):                                   # largest L with added(L) <= units
        mid = np.floor((lo + hi + 1) / 2)
        ok = added(mid) <= units
        lo, hi = np.where(ok, mid, lo), np.where(ok, hi, mid - 1)
        if (lo >= hi).all():
            break
    raised = np.maximum(counts, np.minimum(lo, cap)[..., None])
    rest = units - (raised - counts).sum(axis=2)
    at_level = (raised == lo[..., None]) & (raised < cap)
    first = np.cumsum(at_level, axis=2) <= rest[..., None]
    return raised + (at_level & first)


def _trim(counts: np.ndarray, excess: int) -> None:
    order = np.argsort(counts, kind="stable")
    for i in range(excess):
        j = order[i % len(order)]
        counts[j if counts[j] > 0 else int(np.argmax(counts))] -= 1


# ------------------------------------------------------------------- tuned kernel configs


VLLM_TUNED_MOE: dict[tuple[str, str], frozenset[tuple[int, int]]] = {
    ("a100-80gb", "bf16"): frozenset({(1, 14336), (8, 7168), (8, 4096), (8, 3584), (8, 2048),
                                      (8, 1792)}),
    ("h100-sxm", "bf16"): frozenset({(8, 7168), (8, 4096), (8, 3584), (8, 2048), (8, 1792)}),
    ("h100-sxm", "fp8"): frozenset({(8, 14336), (8, 8192), (8, 7168), (8, 4096), (8, 3584),
                                    (8, 2048)}),
    ("h200", "bf16"): frozenset({(8, 14336), (8, 7168), (8, 4096), (8, 3584), (8, 2048),
                                 (8, 1792)}),
    ("h200", "fp8"): frozenset({(8, 14336), (8, 7168)}),
    ("l40s", "bf16"): frozenset({(8, 3584)}),
}
"""(catalog GPU, dtype) -> the few-expert layer shapes (experts per GPU E, expert width per GPU
N) for which vLLM ships a tuned Triton fused-MoE config: the files
`vllm/model_executor/layers/fused_moe/configs/E=<E>,N=<N>,device_name=<GPU>[,dtype=fp8_w8a8].json`
(device names NVIDIA_A100-SXM4-80GB, NVIDIA_H100_80GB_HBM3, NVIDIA_H200, NVIDIA_L40S) in
vllm-project/vllm, looked up one by one for the Mixtral-shaped layers (E <= 16) that
aiconfigurator's tables measure; L40S has one of them (E=8, N=3584: Mixtral at TP 4, whose
large-batch rows the untuned fit priced 41% slow at the median), B200 and the RTX PRO 6000
Server Edition none. vLLM has more few-expert files (e.g. A100 E=1 at N=1792, 3584 and
7168; H100 E=16, N=1792) whose shapes no table measures: they are not listed, so the model
prices them as untuned. The public index read lists vLLM's history, not one release:
Mixtral's configs are long-standing, so they are taken as present in every engine version
modelled here.

Many-expert layers are not listed though vLLM has files for some (looked up for every
table shape: H100 29 of 177, e.g. E=128 at N=192, 384, 768, 928 and 1856 and E=256 at
N=512; H200 25; A100 2, E=128 N=192 and E=16 N=2688; L40S 2, E=128 at N=928 and 1856; the
RTX PRO 6000 Server Edition none): the gain of their tuned tiles varies file by file, from
none (H100 E=128 N=768, Qwen3-30B-A3B at TP 1) to 1.7x (H100 E=128 N=1856) in the large-batch
rows, so one tuned rate for them all moved the bands over target by three of 13 (A100,
H100 0.14 and 0.24, L40S) while the overall held-out error rose on H100 (9.7 to 9.9%):
their fit absorbs them. Without
such a file vLLM runs `get_default_config`'s tiles; with one, larger tiles per batch size,
and at large batches those layers measure about twice the compute rate of untuned ones on
A100 and 2.5-3x on H100 (`MoEParams.tuned_compute_eff`, fitted where a GPU has such shapes;
H200's shapes, (8, 14336) among them, are priced with the H100 fit it carries: unmeasured).
Separately, on B200 (vLLM 0.24, FlashInfer's TRT-LLM kernel for the few-expert rows) the
compute rate falls as experts widen, about -40% at 14,336-16,384 per GPU against widths up
to 3,584: `MoEParams.width_knee` prices that in an empirical form fitted per profile
(docs/moe-mla.md). Many-expert layers were not looked up: their fit absorbs whatever configs
they have."""


def vllm_tuned(gpu_name: str, dtype: str, experts, ep, inter_gpu) -> np.ndarray:
    """Whether vLLM has a tuned config for these layers on this GPU: a boolean array of
    the broadcast shape of `experts`, `ep` and `inter_gpu`."""
    shapes = VLLM_TUNED_MOE.get((gpu_name, dtype))
    if not shapes:
        return np.zeros(np.broadcast(experts, ep, inter_gpu).shape, dtype=bool)
    local = np.rint(np.asarray(experts, dtype=np.float64) / np.asarray(ep, dtype=np.float64))
    code = local * 1e6 + np.rint(np.asarray(inter_gpu, dtype=np.float64))
    return np.isin(code, [e * 1e6 + n for e, n in shapes])


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
    zeros for the others' (EP; `remote_pair_share` of them where a kernel skips them) — by
    the activation and the top-k sum, as a multiple of the pair's activations (4 x hidden
    + 6 x inter/TP bytes; 4 x inter/TP for experts without a gate); 0 in the bare
    roofline."""
    quant_elem_s: float = 0.0
    """Seconds per activation element quantised to FP8 before each GEMM (W8A8 only)."""
    small_tile_rows: float = 1.0
    """Rows per tile while tokens <= the GPU's experts, experts / EP (vLLM's default config:
    16; `get_default_config` compares the batch with E, which `try_get_optimal_moe_config`
    reads from the layer's weights: the local experts under EP); an engine setting."""
    large_tile_rows: float = 1.0
    """Rows per tile above that (vLLM's default config: 64); an engine setting."""
    naive_sparsity: float = 0.0
    """Without EP, while tokens x top-k x this <= experts every pair is its own tile and
    reads its expert's weights alone (vLLM's small-batch path, SPARSITY_FACTOR = 4); 0:
    no such path. An engine setting."""
    small_stream_rows: float = 0.0
    """Rows of one expert's pairs that share one pass over its weights while tokens <=
    experts / EP: the tile height times GROUP_SIZE_M (vLLM's small-batch default config:
    16 x 1, so every 16-row tile streams the expert's weights again); 0: one pass per
    expert touched. An engine setting."""
    large_stream_rows: float = 0.0
    """The same above that (vLLM's default config: 64-row tiles grouped by 8, 512 rows);
    0: one pass per expert touched. An engine setting."""
    l2_fraction: float = 0.0
    """Share of L2 the touched experts' weights may fill and still be served from it when
    a benchmark replays the same call (`warm_l2`); 0: never. A serving forward pass reads
    every layer's weights from HBM, so the simulator never applies it."""
    l2_gain: float = 1.0
    """How much faster than HBM those L2-resident weights are read."""
    tuned_compute_eff: float = 0.0
    """`compute_eff` of the layers vLLM ships a tuned kernel config for on this GPU
    (`VLLM_TUNED_MOE`); 0: they run as fast as the others."""
    width_knee: float = 0.0
    """Expert width per GPU (inter/TP) at which the untuned kernel's compute efficiency
    has halved: it is divided by 1 + width/knee (see `VLLM_TUNED_MOE`); 0: no fall."""
    expert_s: float = 0.0
    """Seconds each pass over an expert's weights costs besides its bytes (starting that
    expert's group of tiles); 0: none. It is what stops narrow experts getting cheaper:
    FlashInfer's CUTLASS FP8 kernel in vLLM 0.24 on H100 (aiconfigurator's `moe_perf`,
    128 experts of hidden 4,096 x inter 1,536, 16 tokens top-8, balanced) takes 4.09, 2.19,
    1.26, 0.87, 0.48 and 0.41 ms at TP 1, 2, 4, 8, 16 and 32: the bytes fall 32-fold, the
    time 10-fold, leaving about 3 µs per expert; fitted, 1.6 µs there and 0.04-0.1 µs for
    the Triton kernels."""

    large_memory_eff: float = 1.0
    """Further fraction of `memory_eff` at which the default config's large tiles (64 x 64,
    32 deep, above experts/EP tokens) stream the experts' weights (not the activations)
    where vLLM has no tuned file for the layer: on Ampere and Ada slower than the small
    config's 16 x 32 tiles, 64 deep. L40S (vLLM 0.14, aiconfigurator's `moe_perf`,
    Mixtral's 8 experts of 4,096 x 14,336, TP 1, power-law routing): 3.03 ms at 8 tokens
    and 6.29 ms at 16 in FP8, 4.04 and 6.47 ms in BF16, for about the same experts'
    weights. Fitted 0.48 (L40S FP8), 0.66 (A100,
    L40S BF16), 0.88-1.00 on Hopper and Blackwell; 1: no difference."""
    remote_pair_share: float = 1.0
    """A pair routed to another GPU's experts (EP) pays this multiple of a pair's
    `combine_traffic`. vLLM's Triton kernel runs a block whose expert is off the rank as
    `write_zeros_to_output` (vllm/model_executor/layers/fused_moe/fused_moe.py): a zero row
    in both GEMMs' outputs (2 x inter/TP + hidden elements, which a local pair's GEMMs
    write as results), which the activation and the top-k sum then read as a local pair's.
    That is (6 x hidden + 10 x inter/TP) bytes against (4 x hidden + 6 x inter/TP): 1.56x
    for Qwen3-30B-A3B's layer, 1.64x for Mixtral's. Fitted on the Triton tables: 1.3-1.9
    (A100, H100 under vLLM 0.14 and 0.24, RTX PRO 6000, L40S FP8), 3.4 on L40S BF16. The
    FlashInfer kernels vLLM 0.24 runs keep only the GPU's own pairs: fitted 0.01 (its
    bound) for H100 FP8 (CUTLASS), 0.08-0.23 on B200. 1: a remote pair costs a local one's
    combine."""
    combine_l2_fraction: float = 0.0
    """Share of L2 the call's intermediate rows may fill and still be read back from it by
    the activation and the top-k sum (each GEMM's output is written and read again within
    the call, so this holds in serving as in a benchmark); 0: never. The rows held at once
    are the larger of the gate/up output and the down output, for every (token, expert)
    pair of the step (Triton's intermediate cache has a row per pair, a remote pair's
    zeros included), BF16; the share falls off as for a streamed set (`l2_hit`,
    sharpness 2). L40S (96 MB of L2; vLLM 0.14, aiconfigurator's `moe_perf`, FP8,
    Qwen3-30B-A3B's layer at EP 128, power-law:1.2 routing, where the combine is most of the
    time): 74, 124, 310, 878 and 1,970 µs at 512 to 8,192 tokens, 1.7x, 2.5x, 2.8x and 2.2x
    per doubling as the rows leave L2, then 2x (0.24 µs per token), where the combine
    traffic itself is linear in the tokens."""
    combine_l2_gain: float = 1.0
    """How much faster than HBM those rows are read from L2 (1: no faster)."""
    misaligned_slowdown: float = 1.0
    """Multiple of the grouped GEMMs' time (compute, weight streaming and the K loops) for a
    layer whose expert width per GPU (inter/TP) or hidden size is not a multiple of
    `TRITON_ALIGNMENT`; 1: no difference. Triton compiles a kernel once per
    divisibility-by-16 pattern of its integer arguments (`JITFunction._spec_of`,
    triton/runtime/jit.py), and only with those hints vectorises the loads; vLLM's fused-MoE
    kernel takes the widths and strides as such arguments. Measured (aiconfigurator's
    `moe_perf`, BF16, 128 experts of width 1,856 / 704 at TP 8-32 and 512 of width 1,344 at
    TP 8-16, so 22-232 per GPU), every GPU but the L40S runs those layers 1.3-2x slower
    than the model of aligned ones prices them, from 8 tokens up (below, the floor hides it):
    fitted per profile. Width 464 (a multiple of 16) of the same layer shows nothing."""
    k_depth_s: float = 0.0
    """Seconds per element of the two GEMMs' reduction depths (hidden for gate and up,
    inter/TP for down) that a call waits for besides its throughput terms: each tile runs
    its loop over K one step after another, and the last tiles to start are waited for
    whole. It is what makes a narrow layer's few-token call cost more with a wider hidden
    size though it moves few bytes: on H100 (vLLM 0.14, aiconfigurator's `moe_perf`, one
    token, balanced, experts of 0.9-2.8 MB at TP 32) 20.8, 21.5, 24.4, 31.4 and 45.6 µs at
    hidden 2,688, 3,072, 4,096, 6,144 and 7,168, whose weights take 2-7 µs at HBM speed.
    Fitted 3.7-5.0 ns per element on A100 and H100 0.14 (0.23-0.32 µs per 64-deep step),
    0.3-2.3 ns on the vLLM 0.19-0.24 tables and L40S BF16, about 0 for L40S FP8 (whose
    large tiles' streaming rate, `large_memory_eff`, took it over); 0: no such wait."""

    _fractions = ("compute_eff", "small_tile_eff", "memory_eff", "large_memory_eff")
    _added = ("small_stream_rows", "large_stream_rows", "l2_fraction", "l2_gain",
              "tuned_compute_eff", "width_knee", "expert_s", "k_depth_s", "large_memory_eff",
              "remote_pair_share", "misaligned_slowdown", "combine_l2_fraction",
              "combine_l2_gain")

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.misaligned_slowdown < 1:
            raise ValueError(f"MoEParams.misaligned_slowdown must be >= 1 (1: aligned and "
                             f"misaligned widths alike), got {self.misaligned_slowdown!r}")
        if self.tuned_compute_eff > 1:
            raise ValueError(f"MoEParams.tuned_compute_eff must be 0 (no tuned configs) or a "
                             f"fraction of peak in (0, 1], got {self.tuned_compute_eff!r}")
        for name in ("small_tile_rows", "large_tile_rows"):
            if getattr(self, name) not in TILE_ROWS:
                raise ValueError(f"MoEParams.{name} must be one of "
                                 f"{', '.join(map(str, TILE_ROWS))}, got {getattr(self, name)!r}")
        for name in ("small_stream_rows", "large_stream_rows"):
            if getattr(self, name) not in (0.0, *TILE_ROWS):
                raise ValueError(f"MoEParams.{name} must be 0 or one of "
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
                   p: MoEParams, dtype: str = "bf16", warm_l2: bool = False, gated=True):
    """`moe_experts_time` from a precomputed `expert_load` (everything broadcasts: a cost
    model tabulates the load over token counts once, a fitter over a table's rows).
    `warm_l2`: as an isolated benchmark replaying the call measures it, with the touched
    experts' weights served from L2 where they fit (`MoEParams.l2_fraction`). `gated`
    (a bool, or one per row): False for experts without a gate projection (see the module
    docstring)."""
    if dtype not in ("bf16", "fp8"):
        raise ValueError(f"MoE dtype must be bf16 or fp8, got {dtype!r}")
    t = np.asarray(tokens, dtype=np.float64)
    kernel = kernel_dtype(dtype, gpu)
    w8a8 = kernel == "fp8"
    weight_bytes, act_bytes = (1.0 if dtype == "fp8" else 2.0), (1.0 if w8a8 else 2.0)
    inter_gpu = np.asarray(inter_gpu, dtype=np.float64)
    projections = np.where(gated, 3.0, 2.0)                 # (gate,) up, down
    per_expert = projections * hidden * inter_gpu
    small = t <= np.asarray(experts) / np.asarray(ep)
    rows = np.where(small, p.small_tile_rows, p.large_tile_rows)
    active, pairs = stats[0], stats[1]
    tiles = np.where(small, stats[2 + TILE_ROWS.index(int(p.small_tile_rows))],
                     stats[2 + TILE_ROWS.index(int(p.large_tile_rows))])
    passes = active
    if p.small_stream_rows or p.large_stream_rows:
        passes = np.where(small, _passes(stats, p.small_stream_rows),
                          _passes(stats, p.large_stream_rows))
    if p.naive_sparsity:
        naive = (np.asarray(ep) == 1) & (t * topk * p.naive_sparsity <= experts)
        active, tiles = np.where(naive, pairs, active), np.where(naive, pairs, tiles)
        passes = np.where(naive, pairs, passes)
    eff = layer_compute_eff(p, gpu, dtype, experts, ep, inter_gpu) \
        * np.where(rows < 64, p.small_tile_eff, 1.0)
    compute = tiles * rows * 2.0 * per_expert / (gpu.peak_flops(kernel) * eff)
    bw = gpu.hbm_bandwidth_gbps * 1e9
    weights = passes * per_expert * weight_bytes
    if p.l2_fraction:
        # a pass after an expert's first finds its weights in L2 if one expert fits; the
        # first passes of a replayed call do if every touched expert fits (`warm_l2`)
        first = active * per_expert * weight_bytes
        again = l2_hit(per_expert * weight_bytes, gpu, p.l2_fraction)
        warm = l2_hit(first, gpu, p.l2_fraction) if warm_l2 else 0.0
        weights = (first * ((1.0 - warm) + warm / p.l2_gain)
                   + (weights - first) * ((1.0 - again) + again / p.l2_gain))
    if p.large_memory_eff != 1.0:     # the default config's large tiles (a tuned file's own)
        default = ~small & ~vllm_tuned(gpu.name, kernel, experts, ep, inter_gpu)
        weights = np.where(default, weights / p.large_memory_eff, weights)
    memory = (weights + pairs * (2.0 * hidden + projections * inter_gpu) * act_bytes) \
        / (bw * p.memory_eff)
    if p.expert_s:
        memory = memory + passes * p.expert_s
    gemms = np.maximum(compute, memory) if p.overlap == INF else _overlap(compute, memory, p.overlap)
    if p.k_depth_s:
        gemms = gemms + p.k_depth_s * (hidden + inter_gpu)
    if p.misaligned_slowdown != 1.0:
        gemms = np.where(misaligned_width(hidden, inter_gpu), p.misaligned_slowdown * gemms, gemms)
    counted = t * topk                # every GPU's pairs, each GPU's own at full weight
    if p.remote_pair_share != 1.0:
        counted = pairs + p.remote_pair_share * np.maximum(counted - pairs, 0.0)
    combine = p.combine_traffic * counted * (4.0 * hidden + 2.0 * projections * inter_gpu) / bw
    if p.combine_l2_fraction:
        held = t * topk * np.maximum(hidden, (projections - 1.0) * inter_gpu) * 2.0
        hit = l2_hit(held, gpu, p.combine_l2_fraction, sharpness=2.0)
        combine = combine * ((1.0 - hit) + hit / p.combine_l2_gain)
    quant = p.quant_elem_s * (t * hidden + pairs * inter_gpu) if w8a8 else 0.0
    return np.where(t > 0, p.floor_s + gemms + combine + quant, 0.0)


TRITON_ALIGNMENT = 16
"""Triton specialises a kernel for integer arguments divisible by this (see
`MoEParams.misaligned_slowdown`)."""


def misaligned_width(hidden, inter_gpu) -> np.ndarray:
    """Whether a layer's hidden size or expert width per GPU is not a multiple of
    `TRITON_ALIGNMENT` (elementwise)."""
    return (np.remainder(np.rint(np.asarray(hidden, dtype=np.float64)), TRITON_ALIGNMENT) != 0) \
        | (np.remainder(np.rint(np.asarray(inter_gpu, dtype=np.float64)), TRITON_ALIGNMENT) != 0)


def misaligned_note(width: int, slowdown: float) -> str:
    """What a reader of a price should know of an expert width per GPU that
    `misaligned_width` flags, priced with `slowdown` (`MoEParams.misaligned_slowdown`)."""
    how = (f"the fused experts' GEMMs are priced {slowdown:.2f}x slower, as this GPU's tables "
           f"measure such widths" if slowdown != 1.0 else
           "this profile prices no slowdown for it (its tables show none or measure none)")
    return f"expert width per GPU {width} is not a multiple of {TRITON_ALIGNMENT}: {how}"


def kernel_dtype(dtype: str, gpu: GPUSpec) -> str:
    """The maths a layer of `dtype` weights runs in: "fp8" (W8A8) where the GPU has FP8
    tensor cores, else "bf16" (BF16 weights, or FP8 weights run weight-only, which take
    the BF16 kernel's tuned configs and efficiencies)."""
    return "fp8" if dtype == "fp8" and gpu.fp8_tflops is not None else "bf16"


def layer_compute_eff(p: MoEParams, gpu: GPUSpec, dtype: str, experts, ep, inter_gpu):
    """The fraction of peak a layer's full tiles of `dtype` weights reach: `tuned_compute_eff`
    where vLLM has a tuned config for its kernel (`kernel_dtype`), else `compute_eff`,
    lowered for wide experts (`width_knee`)."""
    eff = p.compute_eff
    if p.width_knee:
        eff = eff / (1.0 + np.asarray(inter_gpu, dtype=np.float64) / p.width_knee)
    if p.tuned_compute_eff:
        tuned = vllm_tuned(gpu.name, kernel_dtype(dtype, gpu), experts, ep, inter_gpu)
        eff = np.where(tuned, p.tuned_compute_eff, eff)
    return eff


def _passes(stats, stream_rows: float):
    """Passes over expert weights: one per touched expert (stream_rows 0), else one per
    `stream_rows` of each expert's pairs (its tiles that share one read of the weights)."""
    if not stream_rows:
        return stats[0]
    return stats[2 + TILE_ROWS.index(int(stream_rows))]


def moe_layer_time(tokens, hidden, inter, experts: int, topk: int, gpu: GPUSpec, p: MoEParams,
                   router: GemmParams, ep: int = 1, tp: int = 1, dtype: str = "bf16",
                   load: str = "balanced"):
    """Seconds of one MoE layer on the most loaded GPU: the router GEMM (tokens x hidden x
    experts, BF16, replicated on every GPU) and the fused experts. Shared experts and the
    EP all-to-all (`movement.alltoall_time`) are priced by the caller."""
    t = np.asarray(tokens, dtype=np.float64)
    route = np.where(t > 0, gemm_time(np.maximum(t, 1.0), experts, hidden, gpu, router), 0.0)
    return route + moe_experts_time(t, hidden, inter, experts, topk, gpu, p, ep, tp, dtype, load)
