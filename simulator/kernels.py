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
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import numpy as np

from servelab.simulator.gpus import GPUSpec

INF = math.inf


def _overlap(compute, memory, q: float):
    """Soft maximum of two non-negative times: max at q = inf, sum at q = 1."""
    if q == INF:
        return np.maximum(compute, memory)
    big = np.maximum(compute, memory)
    safe = np.where(big > 0, big, 1.0)
    return big * ((compute / safe) ** q + (memory / safe) ** q) ** (1.0 / q)


def _check_fields(params, skip: tuple[str, ...] = ()) -> None:
    """Every field a number; fractions of peak in (0, 1]; `overlap` >= 1; `l2_gain` >= 1;
    everything else finite and >= 0 (fields in `skip` are checked by their owner)."""
    for f in fields(params):
        if f.name in skip:
            continue
        value = getattr(params, f.name)
        owner = f"{type(params).__name__}.{f.name}"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ValueError(f"{owner} must be a number, got {value!r}")
        if f.name in params._fractions:
            if not 0 < value <= 1:
                raise ValueError(f"{owner} must be a fraction of peak in (0, 1], got {value!r} "
                                 f"(above 1 means the peak is wrong: override the device figure)")
        elif f.name == "overlap":
            if not value >= 1:
                raise ValueError(f"{owner} must be >= 1 (1: no overlap, inf: full), got {value!r}")
        elif f.name == "l2_gain":
            if not 1 <= value < INF:
                raise ValueError(f"{owner} must be >= 1 (L2 is never slower than HBM), "
                                 f"got {value!r}")
        elif not 0 <= value < INF:
            raise ValueError(f"{owner} must be finite and >= 0, got {value!r}")


class _Params:
    """Shared checks and (de)serialisation for the parameter dataclasses below."""

    _fractions: tuple[str, ...] = ()

    def _check(self) -> None:
        _check_fields(self)

    def to_dict(self) -> dict[str, float | str]:
        return {k: ("inf" if v == INF else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict, source: str):
        if not isinstance(data, dict):
            raise ValueError(f"{source} must be an object, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(names))}")
        missing = sorted(names - set(data))
        if missing:   # a silent default would be the bare roofline's value
            raise ValueError(f"{source}: missing field(s) {', '.join(missing)}")
        values = {k: (INF if v == "inf" else v) for k, v in data.items()}
        try:
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from None


# --------------------------------------------------------------------------------- GEMM
#
# A GEMM library picks, per shape, the fastest of a menu of kernel configurations: output
# tiles of TILE_M x TILE_N per thread block (CTA), with or without split-K, and a
# matrix-vector kernel for a single row. The model prices each configuration and takes
# the fastest — which is what makes efficiency depend on the shape: a small m wastes the
# tile's rows, few tiles leave SMs idle (or split k), a partial last wave idles the rest.

TILE_M = (64, 128, 256)
TILE_N = (32, 64, 128, 256)
"""Output tiles a GPU library's tensor-core kernels offer (a CPU's have no such padding:
its menu is one 1 x 1 "tile")."""
BENCH_LAYERS = 6
"""The measurement collector replays six layers' GEMMs sharing one input in a CUDA graph
and reports the mean: a weight is still in L2 at its next replay if six of them fit."""


@dataclass(frozen=True, slots=True)
class GemmParams(_Params):
    """A dense GEMM Y[m, n] = X[m, k] · W[k, n] (m = tokens, W = the weight)."""

    floor_s: float = 0.0
    """Seconds no GEMM beats inside a CUDA graph: launch gap, prologue and epilogue (FP8:
    with the activation-quantisation kernel's launch)."""
    compute_eff: float = 1.0
    """Fraction of the dense tensor-core peak a busy SM sustains on a full tile."""
    memory_eff: float = 1.0
    """Fraction of HBM bandwidth sustained streaming operands."""
    overlap: float = INF
    """Soft-maximum exponent of the k-loop against HBM streaming (1: add, inf: max)."""
    epilogue_overlap: float = INF
    """Soft-maximum exponent of writing the output against the rest."""
    cta_overlap: float = INF
    """Soft-maximum exponent, inside one thread block, of k-loop latency, tile maths and
    the operand feed into the SM."""
    k_step_s: float = 0.0
    """Serial seconds per element of k in one thread block's loop (dependent loads)."""
    sm_feed_gbps: float = INF
    """GB/s at which operands reach one SM's shared memory from L2."""
    split_k_min: float = INF
    """Least k one slice of a split-K configuration gets (the library's granularity);
    inf: the library never splits k."""
    split_k_s: float = 0.0
    """Fixed seconds of the split-K reduction pass."""
    write_penalty: float = 1.0
    """Cost of writing one output byte relative to reading one."""
    gemv_k_step_s: float = 0.0
    """Seconds per element of k of the single-row (m = 1) matrix-vector kernel; 0: the
    library has none and uses the tiled kernels."""
    wave_quantization: float = 0.0
    """1: a static grid, the last partial wave of thread blocks costs a full wave;
    0: a persistent (stream-K) scheduler spreads it (and the bare roofline)."""
    l2_fraction: float = 0.0
    """Share of the datasheet L2 usable to keep data between kernels."""
    l2_gain: float = 1.0
    """L2 bandwidth as a multiple of the effective HBM bandwidth."""
    quant_elem_s: float = 0.0
    """Seconds per activation element of the separate quantisation kernel FP8 GEMMs run
    first (0: none, as for BF16)."""

    _fractions = ("compute_eff", "memory_eff")

    def __post_init__(self) -> None:
        self._check()
        if not 0 <= self.wave_quantization <= 1:
            raise ValueError(f"GemmParams.wave_quantization must be in [0, 1], "
                             f"got {self.wave_quantization!r}")

    def _check(self) -> None:
        for name in ("sm_feed_gbps", "split_k_min"):    # inf allowed: no such limit
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"GemmParams.{name} must be > 0 (inf: no limit), got {value!r}")
        for name in ("overlap", "epilogue_overlap", "cta_overlap"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1:
                raise ValueError(f"GemmParams.{name} must be >= 1 (1: no overlap, inf: full), "
                                 f"got {value!r}")
        _check_fields(self, skip=("sm_feed_gbps", "split_k_min", "overlap", "epilogue_overlap",
                                  "cta_overlap"))


def _hit(working_set, gpu: GPUSpec, fraction: float):
    """Share of a working set served from L2: a smooth step around the usable capacity."""
    if not gpu.l2_mb or not fraction:
        return 0.0
    return 1.0 / (1.0 + (working_set / (fraction * gpu.l2_mb * 1e6)) ** 8)


def gemm_time(m, n, k, gpu: GPUSpec, p: GemmParams, dtype: str = "bf16",
              weight_bytes: float = 2.0, in_bytes: float = 2.0, out_bytes: float = 2.0,
              warm_l2: bool = False):
    """Seconds of one [m, k] x [k, n] GEMM computing at the `dtype` peak.

    Bytes: the weight (k·n elements of `weight_bytes`), the input activations (m·k of
    `in_bytes`) and the output (m·n of `out_bytes`). W8A8 FP8: dtype "fp8", 1, 1, 2;
    weight-only FP8 on a GPU without FP8 tensor cores: dtype "bf16", 1, 2, 2.
    Activations just written by the previous kernel are read from L2 when the working set
    fits; weights come from HBM unless `warm_l2` (an isolated benchmark replaying them)."""
    m = np.asarray(m, dtype=np.float64)[..., None]
    n = np.asarray(n, dtype=np.float64)[..., None]
    k = np.asarray(k, dtype=np.float64)[..., None]
    sms = gpu.sm_count
    per_sm = gpu.peak_flops(dtype) * p.compute_eff / sms
    bw = gpu.hbm_bandwidth_gbps * 1e9 * p.memory_eff
    tiles_m, tiles_n = ((1,), (1,)) if gpu.architecture == "cpu" else (TILE_M, TILE_N)
    tm = np.repeat(np.array(tiles_m, np.float64), len(tiles_n))
    tn = np.tile(np.array(tiles_n, np.float64), len(tiles_m))
    tiles = np.maximum(np.ceil(m / tm) * np.ceil(n / tn), 1.0)
    split = np.clip(sms / tiles, 1.0, np.maximum(1.0, k / p.split_k_min))
    times = [_gemm_config(m, n, k, tm, tn, tiles, s, is_split, gpu, p, per_sm, bw, weight_bytes,
                          in_bytes, out_bytes, warm_l2)
             for s, is_split in ((np.ones_like(split), False), (split, True))]
    if p.gemv_k_step_s:
        traffic = _gemm_traffic(m, n, k, gpu, p, bw, weight_bytes, in_bytes, out_bytes, warm_l2)
        gemv = _smax(_smax(k * p.gemv_k_step_s, traffic[0], p.overlap), traffic[1],
                     p.epilogue_overlap)
        times.append(np.where(m == 1, gemv, INF))
    best = np.min(np.concatenate(times, axis=-1), axis=-1)
    t = p.floor_s + best
    if p.quant_elem_s:
        mk = m[..., 0] * k[..., 0]
        hit = _hit(3 * mk, gpu, p.l2_fraction)
        t = t + p.quant_elem_s * mk * ((1 - hit) + hit / p.l2_gain)
    return t


def _gemm_traffic(m, n, k, gpu, p, bw, weight_bytes, in_bytes, out_bytes, warm_l2):
    """(seconds reading W and X, seconds writing Y) with L2 hits where they apply."""
    w, x, y = weight_bytes * k * n, in_bytes * m * k, out_bytes * m * n
    hit_x = _hit(x + w + y, gpu, p.l2_fraction)
    hit_w = _hit(BENCH_LAYERS * w + x + y, gpu, p.l2_fraction) if warm_l2 else 0.0
    hit_y = hit_x if warm_l2 else 0.0
    read = (w * (1 - hit_w) + x * (1 - hit_x)) / bw + (w * hit_w + x * hit_x) / (bw * p.l2_gain)
    write = y * p.write_penalty * ((1 - hit_y) + hit_y / p.l2_gain) / bw
    return read, write


def _gemm_config(m, n, k, tm, tn, tiles, s, is_split, gpu, p, per_sm, bw, weight_bytes, in_bytes,
                 out_bytes, warm_l2):
    """Seconds of every tile configuration (last axis) with split factor `s`."""
    ctas = tiles * s
    sms = gpu.sm_count
    waves = np.maximum(ctas / sms + p.wave_quantization * (np.ceil(ctas / sms) - ctas / sms), 1.0)
    feed = (in_bytes * np.minimum(m, tm) + weight_bytes * np.minimum(n, tn)) / (p.sm_feed_gbps * 1e9)
    per_k = _smax3(p.k_step_s, 2.0 * tm * tn / per_sm, feed, p.cta_overlap)
    main = waves * (k / s) * per_k
    read, write = _gemm_traffic(m, n, k, gpu, p, bw, weight_bytes, in_bytes, out_bytes, warm_l2)
    if is_split:           # FP32 partial results written and read back, then a reduction
        write = write + 8.0 * s * m * n / bw
    t = _smax(_smax(main, read, p.overlap), write, p.epilogue_overlap)
    return t + (p.split_k_s if is_split else 0.0)


def _smax(a, b, q: float):
    return np.maximum(a, b) if q == INF else _overlap(a, b, q)


def _smax3(a, b, c, q: float):
    if q == INF:
        return np.maximum(np.maximum(a, b), c)
    big = np.maximum(np.maximum(a, b), c)
    safe = np.where(big > 0, big, 1.0)
    return big * ((a / safe) ** q + (b / safe) ** q + (c / safe) ** q) ** (1.0 / q)


# ---------------------------------------------------------------------------- attention
#
# As engines launch it (vLLM), an attention call includes writing the step's new K and V
# into the paged cache, so both attention models price that write too.


def _l2_factor(nbytes, gpu: GPUSpec, gain: float, warm_l2: bool):
    """Bandwidth multiplier for a working set of `nbytes`: `gain` when it fits in L2 and
    the caller prices an isolated, repeated kernel (a benchmark replays one layer, so its
    operands stay in L2); 1 in a forward pass, which reads each layer's data once."""
    if not warm_l2 or gain == 1.0 or not gpu.l2_mb:
        return 1.0
    return np.where(np.asarray(nbytes) <= gpu.l2_mb * 1e6, gain, 1.0)


@dataclass(frozen=True, slots=True)
class PrefillAttentionParams(_Params):
    """Causal attention of prefill chunks over a paged cache (flash-attention style): the
    time is the sum of a floor, the tensor-core work, the longest thread block's critical
    path and the memory traffic (measured kernels overlap them little)."""

    floor_s: float = 0.0
    """Seconds no prefill launch beats (the cache write and the attention kernel)."""
    compute_eff: float = 1.0
    """Fraction of the BF16 tensor-core peak on QKᵀ and PV at long sequences."""
    memory_eff: float = 1.0
    """Fraction of HBM bandwidth on Q, O, the K/V read and the cache write."""
    padded_tile_pairs: float = 0.0
    """(query, key) pairs of work wasted per sequence and thread-block head on partly
    filled query tiles: why many short sequences cost more than one long one."""
    critical_path: float = 0.0
    """Weight of the longest thread block's work (one 128-row query tile over its keys,
    at one SM's share of the peak): a long sequence's last tile cannot be split."""
    packs_gqa: float = 0.0
    """1 where the kernel packs the query heads sharing a KV head into one thread block
    (FlashAttention 3 on Hopper), 0 where each query head is its own (FlashAttention 2):
    what the padding waste is counted per."""
    l2_gain: float = 1.0
    """Bandwidth multiplier when the working set fits in L2 and stays there between
    replays of one kernel (isolated benchmarks only; a forward pass reads from HBM)."""

    _fractions = ("compute_eff", "memory_eff")

    def __post_init__(self) -> None:
        self._check()
        if self.packs_gqa not in (0.0, 1.0):
            raise ValueError(f"PrefillAttentionParams.packs_gqa must be 0 or 1, got {self.packs_gqa!r}")


TILE_ROWS = 128
"""Query rows per flash-attention thread block."""


def prefill_attention_coefficients(heads, kv_heads, head_dim, gpu: GPUSpec,
                                   p: PrefillAttentionParams, kv_bytes=2.0,
                                   act_bytes: float = 2.0) -> tuple:
    """Seconds per unit of each statistic of a prefill batch, one layer: (floor, per
    causal pair, per sequence [padding], per key a tile attends to on average [critical
    path], per new token, per cached token [memory]). `prefill_attention_time` combines
    them; the cost model folds them into its hot path."""
    rate = gpu.peak_flops("bf16") * p.compute_eff
    bw = gpu.hbm_bandwidth_gbps * 1e9 * p.memory_eff
    block_heads = kv_heads if p.packs_gqa else heads
    kv_row = 2.0 * kv_heads * head_dim * kv_bytes             # one token's K and V in the cache
    per_token = (2.0 * heads * head_dim * act_bytes           # Q read, O written
                 + kv_row                                     # its own K/V, read by attention
                 + 2.0 * kv_heads * head_dim * act_bytes + kv_row)   # cache write: read, store
    return (p.floor_s,
            4.0 * head_dim * heads / rate,                    # QKᵀ and PV, 2 FLOPs per MAC
            4.0 * head_dim * block_heads * p.padded_tile_pairs / rate,
            p.critical_path * 4.0 * head_dim * TILE_ROWS / (rate / gpu.sm_count),
            per_token / bw,
            kv_row / bw)


def prefill_attention_time(seqs, tokens, q_ctx_sum, q_sq_sum, ctx_sum, heads, kv_heads,
                           head_dim, gpu: GPUSpec, p: PrefillAttentionParams, kv_bytes=2.0,
                           act_bytes: float = 2.0, warm_l2: bool = False):
    """Seconds of one layer's prefill attention over `seqs` chunks of `tokens` new tokens
    in all; chunk i has q_i new tokens after c_i cached ones, and the sums are
    Σ q_i·c_i, Σ q_i², Σ c_i. Zero when there is nothing to prefill."""
    floor, per_pair, per_seq, per_key, per_token, per_ctx = prefill_attention_coefficients(
        heads, kv_heads, head_dim, gpu, p, kv_bytes, act_bytes)
    tokens = np.asarray(tokens, dtype=np.float64)
    pairs = q_ctx_sum + 0.5 * (q_sq_sum + tokens)            # causal (query, key) pairs
    mean_keys = (q_sq_sum + q_ctx_sum) / np.maximum(tokens, 1.0)
    compute = pairs * per_pair + seqs * per_seq + mean_keys * per_key
    memory = tokens * per_token + ctx_sum * per_ctx
    if warm_l2:
        bw_bytes = memory * gpu.hbm_bandwidth_gbps * 1e9 * p.memory_eff
        memory = memory / _l2_factor(bw_bytes, gpu, p.l2_gain, True)
    return np.where(tokens > 0, floor + compute + memory, 0.0)


@dataclass(frozen=True, slots=True)
class DecodeAttentionParams(_Params):
    """One query token per sequence over its cached context (paged, split-KV).

    Time = floor + per-(sequence, KV head) overhead + the larger of the per-item work and
    the KV bytes over the streaming rate, where the rate is HBM-bound at large batch and
    parallelism-bound (too few work items to fill the GPU) at small batch."""

    floor_s: float = 0.0
    """Seconds no decode launch beats (the cache write and the attention kernel)."""
    split_floor_s: float = 0.0
    """Extra floor of the split-KV path's merge kernel, where it is a second launch
    (FlashAttention 2 with grouped-query attention); 0 where it is not."""
    seq_head_s: float = 0.0
    """Serial seconds per (sequence, KV head): page-table walk and kernel prologue."""
    work_item_s: float = 0.0
    """Seconds per (sequence, KV head) work item that streaming can hide."""
    q_head_s: float = 0.0
    """Seconds per (sequence, query head): loading Q, storing O, merging partial results."""
    memory_eff: float = 1.0
    """Fraction of HBM bandwidth streaming K/V at large batch and long context."""
    head_stream_gbps: float = 0.0
    """GB/s one KV head's split-KV work streams at small batch (parallelism-bound); 0: no
    such limit."""
    batch_saturation: float = 1.0
    """Sequences beyond which more sequences add streaming parallelism."""
    mha_block_gbps: float = 0.0
    """GB/s of one thread block on the multi-head path without split-KV (one block per
    sequence and head: FlashAttention 2 when query and KV heads are equal); 0: no such path."""
    l2_gain: float = 1.0
    """Bandwidth multiplier when the KV set fits in L2 and stays there between replays
    of one kernel (isolated benchmarks only; a forward pass reads from HBM)."""

    _fractions = ("memory_eff",)

    def __post_init__(self) -> None:
        self._check()
        if self.batch_saturation < 1:
            raise ValueError(f"DecodeAttentionParams.batch_saturation must be >= 1, "
                             f"got {self.batch_saturation!r}")


def decode_attention_lines(batch, heads, kv_heads, head_dim, gpu: GPUSpec,
                           p: DecodeAttentionParams, kv_bytes=2.0, context_sum=None,
                           warm_l2: bool = False):
    """Decode attention of `batch` sequences with C context tokens in all costs
    max(floor, intercept + slope·C) seconds per layer: (floor, intercept, slope).

    For a fixed batch the time is convex and piecewise linear in C — what lets a run of
    decode steps be summed in closed form. (`context_sum` is only needed for `warm_l2`,
    whose L2 residency depends on C.) Decode is bandwidth-bound for any grouped-query
    ratio a model uses (a few FLOPs per KV byte against a ridge in the hundreds)."""
    batch = np.asarray(batch, dtype=np.float64)
    heads, kv_heads = np.asarray(heads, np.float64), np.asarray(kv_heads, np.float64)
    hbm = gpu.hbm_bandwidth_gbps * 1e9 * p.memory_eff
    mha = (heads == kv_heads) & (p.mha_block_gbps > 0)
    split = hbm if not p.head_stream_gbps else np.minimum(
        hbm, p.head_stream_gbps * 1e9 * kv_heads * np.maximum(1.0, batch / p.batch_saturation))
    rate = np.where(mha, np.minimum(hbm, p.mha_block_gbps * 1e9 * batch * kv_heads), split)
    kv_row = 2.0 * kv_heads * head_dim * kv_bytes
    if warm_l2:
        rate = rate * _l2_factor(np.asarray(context_sum) * kv_row, gpu, p.l2_gain, True)
    floor = p.floor_s + np.where(mha, 0.0, p.split_floor_s)
    base = floor + batch * kv_heads * p.seq_head_s
    items = batch * (kv_heads * p.work_item_s + heads * p.q_head_s)
    live = batch > 0
    slope = np.where(live, kv_row / np.maximum(rate, 1e-300), 0.0)
    return np.where(live, base + items, 0.0), np.where(live, base, 0.0), slope


def decode_attention_time(batch, context_sum, heads, kv_heads, head_dim, gpu: GPUSpec,
                          p: DecodeAttentionParams, kv_bytes=2.0, warm_l2: bool = False):
    floor, intercept, slope = decode_attention_lines(batch, heads, kv_heads, head_dim, gpu, p,
                                                     kv_bytes, context_sum, warm_l2)
    return np.maximum(floor, intercept + slope * context_sum)


# ------------------------------------------------------------------------- element-wise


@dataclass(frozen=True, slots=True)
class ElementwiseParams(_Params):
    """Bandwidth-bound kernels: norms, rotary, activation, KV-cache writes, embedding."""

    floor_s: float = 0.0
    """Seconds no element-wise kernel beats (launch and one wave of thread blocks)."""
    memory_eff: float = 1.0
    """Fraction of HBM bandwidth a large element-wise kernel reaches."""

    _fractions = ("memory_eff",)

    def __post_init__(self) -> None:
        self._check()


def elementwise_time(nbytes, gpu: GPUSpec, p: ElementwiseParams):
    """Seconds of one element-wise kernel moving `nbytes` (read + written); 0 for 0."""
    nbytes = np.asarray(nbytes, dtype=np.float64)
    return np.where(nbytes > 0, p.floor_s + nbytes / (gpu.hbm_bandwidth_gbps * 1e9 * p.memory_eff),
                    0.0)


# --------------------------------------------------------------------------- collectives


@dataclass(frozen=True, slots=True)
class CollectiveParams(_Params):
    """All-reduce across the tensor-parallel GPUs of one node.

    As engines ship it: a custom all-reduce for small messages (vLLM uses it up to
    `custom_max_bytes`, and without NVLink only between `pcie_custom_max_gpus` GPUs, the
    pair a PCIe switch connects peer to peer), in two flavours — one-shot (every GPU reads
    all its peers' whole buffers: (n-1) x the message, one synchronisation) and two-shot
    (reduce-scatter then all-gather: 2(n-1)/n of it, a second synchronisation) — of which
    the faster is taken, as the engine's size thresholds pick; a ring (NCCL) otherwise,
    moving 2(n-1)/n of the message per GPU. Without NVLink a group larger than a switch's
    pair sends every GPU's share across the host's fabric, which `fabric_gbps` caps."""

    custom_latency_s: float = 0.0
    """Seconds of a small custom all-reduce: launch plus a barrier over the peers."""
    two_shot_s: float = 0.0
    """Extra seconds of the two-shot flavour's second phase (one more barrier)."""
    custom_link_eff: float = 1.0
    """Fraction of per-direction link bandwidth the custom all-reduce moves data at."""
    ring_latency_s: float = 0.0
    """Fixed seconds of a ring all-reduce (launch, channel setup)."""
    ring_link_eff: float = 1.0
    """Bus bandwidth of the ring as a fraction of the per-direction link figure."""
    hop_s: float = 0.0
    """Extra seconds per additional GPU in the group (one more synchronisation step)."""
    fabric_gbps: float = 0.0
    """GB/s of the shared host fabric (PCIe switches, the socket link) that the ring
    traffic of all GPUs without NVLink crosses; 0 where GPUs talk over NVLink."""
    custom_max_bytes: float = 8 * 1024 * 1024
    """Largest message the engine sends through the custom all-reduce (vLLM: 8 MiB);
    an engine setting, not a fitted one."""
    pcie_custom_max_gpus: float = 2
    """Most GPUs the engine runs the custom all-reduce across without NVLink (vLLM: 2);
    an engine setting."""

    _fractions = ("custom_link_eff", "ring_link_eff")

    def __post_init__(self) -> None:
        self._check()


def allreduce_time(nbytes, num_gpus, gpu: GPUSpec, p: CollectiveParams):
    """Seconds of one all-reduce of `nbytes` per GPU over `num_gpus` GPUs (0 for one)."""
    nbytes = np.asarray(nbytes, dtype=np.float64)
    n = np.asarray(num_gpus, dtype=np.float64)
    link = gpu.interconnect_gbps * 1e9
    moved = 2.0 * (n - 1) / np.maximum(n, 1)       # bus bytes per message byte
    ring_bw = link * p.ring_link_eff
    if gpu.nvlink_gbps is None and p.fabric_gbps:
        ring_bw = np.where(n > p.pcie_custom_max_gpus,
                           np.minimum(ring_bw, p.fabric_gbps * 1e9 / np.maximum(n - 1, 1)), ring_bw)
    custom_bw = link * p.custom_link_eff
    sync = p.custom_latency_s + (n - 1) * p.hop_s
    one_shot = sync + nbytes * (n - 1) / custom_bw
    two_shot = sync + p.two_shot_s + nbytes * moved / custom_bw
    custom = np.minimum(one_shot, two_shot)
    ring = p.ring_latency_s + (n - 1) * p.hop_s + nbytes * moved / ring_bw
    use_custom = nbytes <= p.custom_max_bytes
    if gpu.nvlink_gbps is None:
        use_custom = use_custom & (n <= p.pcie_custom_max_gpus)
    t = np.where(use_custom, custom, ring)
    return np.where((n > 1) & (nbytes > 0), t, 0.0)


# ----------------------------------------------------------------------------- host link


@dataclass(frozen=True, slots=True)
class HostLinkParams(_Params):
    """Copies between GPU memory and pinned host memory (swap, a CPU prefix-cache tier)."""

    latency_s: float = 0.0
    """Fixed seconds of one batched copy (launch, DMA setup)."""
    link_eff: float = 1.0
    """Fraction of per-direction PCIe bandwidth a pinned copy of KV blocks reaches."""

    _fractions = ("link_eff",)

    def __post_init__(self) -> None:
        self._check()


def host_copy_time(nbytes, gpu: GPUSpec, p: HostLinkParams):
    nbytes = np.asarray(nbytes, dtype=np.float64)
    return np.where(nbytes > 0, p.latency_s + nbytes / (gpu.pcie_gbps * 1e9 * p.link_eff), 0.0)


# ------------------------------------------------------------------------------ bundle


_SECTIONS = {"gemm": GemmParams, "gemm_fp8": GemmParams, "attn_prefill": PrefillAttentionParams,
             "attn_decode": DecodeAttentionParams, "elementwise": ElementwiseParams,
             "collective": CollectiveParams, "host_link": HostLinkParams}


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

    @classmethod
    def roofline(cls) -> "KernelParams":
        """The bare roofline: peaks reached, no floors, no latencies, full overlap."""
        return cls()

    def gemm_for(self, dtype: str) -> GemmParams:
        return self.gemm_fp8 if dtype == "fp8" else self.gemm

    def to_dict(self) -> dict[str, dict]:
        return {name: getattr(self, name).to_dict() for name in _SECTIONS}

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
