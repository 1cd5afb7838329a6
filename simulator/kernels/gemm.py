"""Dense GEMM kernel times: a library's menu of tile configurations, the fastest taken."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from servelab._validate import check_float
from servelab.simulator.gpus import GPUSpec
from servelab.simulator.kernels.base import INF, _check_fields, _overlap, _Params, l2_hit

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
    quant_row_s: float = 0.0
    """Seconds per activation row (token) of that kernel, beside its per-element cost: the
    FP8 GEMMs measured inside vLLM 0.24 (aiconfigurator's tables) take about 7 ns more per
    row than BF16 ones on H100 and B200 whatever k and n (k = 32 and 256, n = 64 and 4,096:
    122 against 4 us at 16,384 rows on H100), where vLLM 0.14's cost grows with k instead;
    0: no such cost."""

    _fractions = ("compute_eff", "memory_eff")
    _added = ("quant_row_s",)

    def __post_init__(self) -> None:
        self._check()
        if not 0 <= self.wave_quantization <= 1:
            raise ValueError(f"GemmParams.wave_quantization must be in [0, 1], "
                             f"got {self.wave_quantization!r}")

    def _check(self) -> None:
        for name in ("sm_feed_gbps", "split_k_min"):    # inf allowed: no such limit
            check_float("GemmParams", name, getattr(self, name), 0, lo_open=True, note="inf: no limit")
        for name in ("overlap", "epilogue_overlap", "cta_overlap"):
            check_float("GemmParams", name, getattr(self, name), 1, note="1: no overlap, inf: full")
        _check_fields(self, skip=("sm_feed_gbps", "split_k_min", "overlap", "epilogue_overlap",
                                  "cta_overlap"))


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
        hit = l2_hit(3 * mk, gpu, p.l2_fraction)
        t = t + p.quant_elem_s * mk * ((1 - hit) + hit / p.l2_gain)
    if p.quant_row_s:
        t = t + p.quant_row_s * m[..., 0]
    return t


def _gemm_traffic(m, n, k, gpu, p, bw, weight_bytes, in_bytes, out_bytes, warm_l2):
    """(seconds reading W and X, seconds writing Y) with L2 hits where they apply."""
    w, x, y = weight_bytes * k * n, in_bytes * m * k, out_bytes * m * n
    hit_x = l2_hit(x + w + y, gpu, p.l2_fraction)
    hit_w = l2_hit(BENCH_LAYERS * w + x + y, gpu, p.l2_fraction) if warm_l2 else 0.0
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
