"""Fitting the kernel models of `simulator/kernels.py` to measured kernel times.

    ms = load_measurements(["../shared/gpu-measurements"], "h100-sxm", drop_bad_rows=True)
    result = calibrate(ms, seed=0)          # -> KernelFit
    result.profile.save("h100-sxm.json")

Each kernel family (`FAMILIES`) names the table it is fitted to, which rows count (e.g.
BF16 GEMMs), the parameters it fits with their physical bounds, and how to predict a row.
The fit minimises relative error — residuals are log(predicted / measured), so a 3 µs
kernel weighs as much as a 3 ms one — with a soft-L1 loss (scipy's `least_squares`): the
few measurements that are slower than a strictly larger problem (a clock dip, a bad
kernel choice) cannot drag the parameters.

Held-out data. Rows are split by a seeded hash of the point's key columns (not of the
row's position), so the same point is held out whatever the file order, and a profile's
recorded seed and fraction reproduce its split exactly (`holdout_mask`). Parameters are
fitted on the rest; every figure reported as held-out comes from rows the fit never saw.

Cost: a few seconds per GPU (least squares over ~10⁴ rows per family, vectorised).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, fields, replace
from datetime import date
from typing import Callable

import numpy as np

from servelab.simulator import kernels as K
from servelab.simulator.calibration import DEFAULT_STEP_OVERHEAD_S, CalibrationProfile
from servelab.simulator.gpus import GPUSpec, get_gpu
from servelab.validation.measurements import MeasurementSet, Table, key_columns

DEFAULT_HOLDOUT = 0.3
DEFAULT_SEED = 0

ASSUMED_HOST_LINK = K.HostLinkParams(latency_s=1e-5, link_eff=0.7)
"""No public measurements of KV-block copies over PCIe: a DMA launch of ~10 µs and 70% of
the per-direction link (pinned copies reach ~0.8; a swap moves many block-sized pieces).
An assumption, and recorded as one in every profile."""


# ------------------------------------------------------------------------------ split


SPLIT_KEYS = {
    "gemm": ("m", "n", "k"),
    "attn_prefill": ("batch", "tokens", "heads", "kv_heads", "head_dim"),
    "attn_decode": ("batch", "context", "heads", "kv_heads", "head_dim"),
    "allreduce": ("num_gpus", "nbytes"),
    "vidur_ops": ("model", "num_tokens", "num_tensor_parallel_workers"),
    "vidur_elementwise": ("model", "num_tokens", "num_tensor_parallel_workers"),
    "vidur_allreduce": ("num_gpus", "nbytes"),
}
"""What a held-out point is: a shape, whatever its dtype (a GEMM shape held out in BF16 is
held out in FP8 too, so a check on another dtype is a check on unseen shapes) and, for
Vidur, every operator of one (model, tokens, tp) point (so its per-layer total is unseen)."""


def holdout_mask(table: Table, fraction: float = DEFAULT_HOLDOUT, seed: int = DEFAULT_SEED
                 ) -> np.ndarray:
    """True for held-out rows: a seeded hash of each row's shape (`SPLIT_KEYS`), compared
    to `fraction`."""
    if not 0 <= fraction < 1:
        raise ValueError(f"holdout fraction must be in [0, 1), got {fraction!r}")
    cols = [table[c].tolist() for c in SPLIT_KEYS[table.family]]
    out = np.empty(len(table), dtype=bool)
    for i, values in enumerate(zip(*cols)):
        text = f"{seed}|" + "|".join(map(str, values))
        out[i] = int(hashlib.sha1(text.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < fraction
    return out


# --------------------------------------------------------------------------- glitches

GLITCH_RATIO = 1.3
"""A measurement more than this much slower than a strictly larger problem of the same
kind (the same kernel with every size at least as large) is a glitch of the measuring run
— a clock dip, a cold cache, a bad kernel choice — not a property of the shape."""


def glitches(table: Table, axes: tuple[str, ...]) -> np.ndarray:
    """True for rows slower than GLITCH_RATIO x the fastest strictly larger problem: same
    values in every key column but `axes`, and >= in each of `axes` (> in one)."""
    out = np.zeros(len(table), dtype=bool)
    if not axes or not len(table):
        return out
    others = [c for c in key_columns(table.family) if c not in axes]
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(zip(*(table[c].tolist() for c in others))):
        groups.setdefault(key, []).append(i)
    for rows in groups.values():
        rows = np.array(rows)
        values = [np.unique(table[a][rows]) for a in axes]
        index = tuple(np.searchsorted(v, table[a][rows]) for v, a in zip(values, axes))
        grid = np.full([len(v) for v in values], np.inf)
        grid[index] = table["latency_s"][rows]
        best = grid.copy()          # best[i] = fastest problem >= i in every axis
        for ax in range(len(axes)):
            best = np.flip(np.minimum.accumulate(np.flip(best, ax), axis=ax), ax)
        larger = np.full(grid.shape, np.inf)    # fastest problem > i in one axis at least
        for ax in range(len(axes)):
            shifted = np.full(grid.shape, np.inf)
            src = [slice(None)] * len(axes)
            dst = [slice(None)] * len(axes)
            src[ax], dst[ax] = slice(1, None), slice(0, -1)
            shifted[tuple(dst)] = best[tuple(src)]
            larger = np.minimum(larger, shifted)
        out[rows] = grid[index] > GLITCH_RATIO * larger[index]
    return out


# ---------------------------------------------------------------------------- families


@dataclass(frozen=True)
class Family:
    """How one kernel family is fitted and judged."""

    name: str
    """The `KernelParams` field it fills."""
    table: str
    select: Callable[[Table], np.ndarray]
    """Which rows of the table this family is fitted to."""
    fitted: dict[str, tuple[float, float, float]]
    """Parameter -> (lower bound, upper bound, starting value)."""
    predict: Callable[[Table, GPUSpec, object], np.ndarray]
    band: Callable[[Table], np.ndarray]
    """A label per row for the per-band figures."""
    band_order: tuple[str, ...]
    fixed: Callable[[GPUSpec], dict] = lambda gpu: {}
    """Parameters set, not fitted, on a GPU (a kernel property such as which attention
    kernel its architecture runs); a fixed name is dropped from `fitted`."""
    starts: tuple[dict, ...] = ({},)
    """Starting points to try (each overrides some starting values); the best fit wins."""
    size_axes: tuple[str, ...] = ()
    """Columns along which a larger value is strictly more work (for `glitches`)."""


def _band(values: np.ndarray, edges: tuple[float, ...], labels: tuple[str, ...]) -> np.ndarray:
    return np.array(labels, dtype=object)[np.searchsorted(edges, values, side="left")]


M_BANDS = ("m 1-32", "m 33-512", "m 513-4096", "m > 4096")
PREFILL_BANDS = ("tokens <= 512", "tokens 513-4096", "tokens 4097-32768", "tokens > 32768")
DECODE_BANDS = tuple(f"batch {b}, context {c}" for b in ("1-8", "9-64", "> 64")
                     for c in ("<= 1k", "1k-16k", "> 16k"))
ALLREDUCE_BANDS = tuple(f"{n} GPUs, {s}" for n in (2, 4, 8) for s in ("<= 64 KiB", "64 KiB-8 MiB", "> 8 MiB"))
TOKEN_BANDS = ("tokens 1-32", "tokens 33-512", "tokens > 512")


def _gemm_predict(t: Table, gpu: GPUSpec, p, dtype: str) -> np.ndarray:
    # as measured: an isolated GEMM replayed with its weights (warm L2)
    if dtype == "fp8":
        return K.gemm_time(t["m"], t["n"], t["k"], gpu, p, "fp8", 1.0, 1.0, 2.0, warm_l2=True)
    return K.gemm_time(t["m"], t["n"], t["k"], gpu, p, "bf16", 2.0, 2.0, 2.0, warm_l2=True)


_GEMM_FITTED = {
    "floor_s": (5e-7, 4e-5, 2.5e-6), "compute_eff": (0.3, 1.0, 0.9), "memory_eff": (0.3, 1.0, 0.85),
    "overlap": (1.0, 12.0, 3.0), "epilogue_overlap": (1.0, 12.0, 1.5),
    "cta_overlap": (1.0, 12.0, 3.0), "k_step_s": (1e-12, 2e-8, 2e-9),
    "sm_feed_gbps": (10.0, 3000.0, 150.0), "split_k_min": (32.0, 65536.0, 500.0),
    "split_k_s": (1e-8, 1e-5, 1e-6), "write_penalty": (0.5, 4.0, 1.2),
    "gemv_k_step_s": (1e-12, 2e-8, 5e-10), "wave_quantization": (1e-3, 1.0, 0.5),
    "l2_fraction": (0.05, 2.0, 0.7), "l2_gain": (1.0, 20.0, 2.0),
    "quant_elem_s": (1e-14, 2e-10, 1e-11)}


def _gemm_starts(n: int) -> tuple[dict, ...]:
    """The generic start, then `n - 1` seeded log-normal perturbations of it: the menu's
    minimum makes the loss surface ragged, and a few starts find its floor reliably."""
    rng = np.random.default_rng(1)
    starts = [{}]
    for _ in range(n - 1):
        start = {k: v[2] * float(np.exp(rng.normal(0, 0.4))) for k, v in _GEMM_FITTED.items()}
        for name in ("compute_eff", "memory_eff", "wave_quantization"):
            start[name] = min(start[name], 0.99)
        starts.append(start)
    return tuple(starts)


def _kv_bytes(t: Table) -> np.ndarray:
    return np.where(t["kv_dtype"] == "fp8", 1.0, 2.0)


def _prefill_predict(t: Table, gpu: GPUSpec, p) -> np.ndarray:
    # batch b sequences of s new tokens each, nothing cached before them, as measured:
    # one layer replayed (warm L2)
    b, s = t["batch"].astype(float), t["tokens"].astype(float)
    return K.prefill_attention_time(b, b * s, 0.0, b * s * s, 0.0, t["heads"], t["kv_heads"],
                                    t["head_dim"], gpu, p, _kv_bytes(t), warm_l2=True)


def _decode_predict(t: Table, gpu: GPUSpec, p) -> np.ndarray:
    b = t["batch"].astype(float)
    return K.decode_attention_time(b, b * t["context"], t["heads"], t["kv_heads"], t["head_dim"],
                                   gpu, p, _kv_bytes(t), warm_l2=True)


FA3_ARCHITECTURES = ("hopper",)
"""GPUs whose engines run FlashAttention 3 (query-head packing, split-KV decode for every
head layout); the others run FlashAttention 2 (vLLM 0.14)."""


def _collective_fixed(gpu: GPUSpec) -> dict:
    return {"fabric_gbps": 0.0} if gpu.nvlink_gbps is not None else {}


def _prefill_fixed(gpu: GPUSpec) -> dict:
    return {"packs_gqa": 1.0 if gpu.architecture in FA3_ARCHITECTURES else 0.0}


def _decode_fixed(gpu: GPUSpec) -> dict:
    if gpu.architecture in FA3_ARCHITECTURES:     # one split-KV kernel path for every layout
        return {"split_floor_s": 0.0, "mha_block_gbps": 0.0}
    return {"batch_saturation": 1.0}


def _attention_rows(t: Table) -> np.ndarray:
    """BF16-KV rows; 1-token prefills are excluded (they take the decode kernel's path)."""
    keep = t["kv_dtype"] == "bf16"
    return keep & (t["tokens"] > 1) if "tokens" in t.columns else keep


def _allreduce_predict(t: Table, gpu: GPUSpec, p) -> np.ndarray:
    return K.allreduce_time(t["nbytes"], t["num_gpus"], gpu, p)


def _elementwise_predict(t: Table, gpu: GPUSpec, p) -> np.ndarray:
    return K.elementwise_time(t["nbytes"], gpu, p)


FRACTION = (0.05, 1.0)
FAMILIES: dict[str, Family] = {
    "gemm": Family(
        "gemm", "gemm", lambda t: t["dtype"] == "bf16", _GEMM_FITTED,
        lambda t, g, p: _gemm_predict(t, g, p, "bf16"),
        lambda t: _band(t["m"], (32, 512, 4096), M_BANDS), M_BANDS, size_axes=("m", "n", "k"),
        fixed=lambda gpu: {"quant_elem_s": 0.0}, starts=_gemm_starts(3)),
    "gemm_fp8": Family(
        "gemm_fp8", "gemm", lambda t: t["dtype"] == "fp8", _GEMM_FITTED,
        lambda t, g, p: _gemm_predict(t, g, p, "fp8"),
        lambda t: _band(t["m"], (32, 512, 4096), M_BANDS), M_BANDS, size_axes=("m", "n", "k"),
        starts=_gemm_starts(3)),
    "attn_prefill": Family(
        "attn_prefill", "attn_prefill", _attention_rows,
        {"floor_s": (1e-7, 1e-3, 1e-5), "compute_eff": (*FRACTION, 0.55),
         "memory_eff": (0.01, 1.0, 0.5), "padded_tile_pairs": (1.0, 1e5, 5000.0),
         "critical_path": (1e-3, 5.0, 0.5), "l2_gain": (1.0, 4.0, 1.2)},
        _prefill_predict,
        lambda t: _band(t["batch"] * t["tokens"], (512, 4096, 32768), PREFILL_BANDS), PREFILL_BANDS,
        fixed=_prefill_fixed, size_axes=("batch", "tokens")),
    "attn_decode": Family(
        "attn_decode", "attn_decode", _attention_rows,
        {"floor_s": (1e-7, 1e-3, 1e-5), "split_floor_s": (1e-8, 1e-4, 4e-6),
         "seq_head_s": (1e-12, 1e-6, 3e-9), "work_item_s": (1e-11, 1e-6, 2e-8),
         "q_head_s": (1e-13, 1e-7, 5e-10), "memory_eff": (*FRACTION, 0.8),
         "head_stream_gbps": (1.0, 1e4, 300.0), "batch_saturation": (1.0, 256.0, 8.0),
         "mha_block_gbps": (0.1, 1e3, 20.0), "l2_gain": (1.0, 4.0, 1.2)},
        _decode_predict,
        lambda t: _decode_band(t), DECODE_BANDS, fixed=_decode_fixed, size_axes=("batch", "context"),
        starts=tuple({"head_stream_gbps": r, "batch_saturation": b}
                     for r in (300.0, 1000.0) for b in (1.5, 12.0))),
    "collective": Family(
        "collective", "allreduce", lambda t: t["backend"] == "vllm_graph",
        {"custom_latency_s": (1e-7, 1e-4, 5e-6), "two_shot_s": (1e-8, 1e-4, 5e-6),
         "custom_link_eff": (0.01, 1.0, 0.5),
         "ring_latency_s": (1e-7, 1e-3, 1e-5), "ring_link_eff": (0.01, 1.0, 0.7),
         "hop_s": (1e-10, 1e-4, 3e-7), "fabric_gbps": (0.1, 1e3, 20.0)},
        _allreduce_predict,
        lambda t: _allreduce_band(t), ALLREDUCE_BANDS, size_axes=("nbytes",),
        fixed=_collective_fixed),
    "elementwise": Family(
        "elementwise", "vidur_elementwise", lambda t: np.ones(len(t), dtype=bool),
        {"floor_s": (1e-7, 1e-4, 3e-6), "memory_eff": (0.01, 1.0, 0.5)},
        _elementwise_predict,
        lambda t: _band(t["num_tokens"], (32, 512), TOKEN_BANDS), TOKEN_BANDS,
        size_axes=("num_tokens",)),
}


def _decode_band(t: Table) -> np.ndarray:
    b = _band(t["batch"], (8, 64), ("batch 1-8", "batch 9-64", "batch > 64"))
    c = _band(t["context"], (1024, 16384), ("context <= 1k", "context 1k-16k", "context > 16k"))
    return np.array([f"{x}, {y}" for x, y in zip(b, c)], dtype=object)


def _allreduce_band(t: Table) -> np.ndarray:
    s = _band(t["nbytes"], (65536, 8 * 1024 * 1024), ("<= 64 KiB", "64 KiB-8 MiB", "> 8 MiB"))
    return np.array([f"{n} GPUs, {x}" for n, x in zip(t["num_gpus"], s)], dtype=object)


# ----------------------------------------------------------------- Vidur element-wise


def vidur_elementwise(ops: Table) -> Table:
    """Vidur's bandwidth-bound operators as one row each: (op, tokens, bytes, seconds).

    Bytes read + written per token of each operator as Vidur runs it (unfused, eager, fp16):
    RMSNorm reads and writes the hidden state; the residual add reads two and writes one;
    rotary reads and writes Q and K of this GPU's heads; SiLU·mul reads gate and up and
    writes one; the embedding reads a table row and writes it."""
    if not len(ops):
        return Table("vidur_elementwise", {}, [])
    h, inter = ops["n_embd"].astype(float), ops["n_expanded_embd"].astype(float)
    tp = ops["num_tensor_parallel_workers"].astype(float)
    heads, kv = ops["n_head"] / tp, np.maximum(ops["n_kv_head"] / tp, 1)
    hd = h / ops["n_head"]
    a = 2.0
    per_token = {"input_layernorm": 2 * h * a, "post_attention_layernorm": 2 * h * a,
                 "add": 3 * h * a, "attn_rope": 2 * (heads + kv) * hd * a,
                 "mlp_act": 3 * inter / tp * a, "emb": 2 * h * a}
    parts = []
    for op, per in per_token.items():
        tokens = ops["num_tokens"].astype(float)
        cols = {"op": np.array([op] * len(ops), dtype=object), "model": ops["model"],
                "num_tokens": ops["num_tokens"], "num_tensor_parallel_workers": tp.astype(int),
                "nbytes": tokens * per, "latency_s": ops[op]}
        parts.append(Table("vidur_elementwise", cols, [f"{o} ({op})" for o in ops.origin]))
    return Table.concat("vidur_elementwise", parts)


# -------------------------------------------------------------------------------- fit


@dataclass
class FamilyFit:
    family: str
    params: object
    rows: int
    heldout_rows: int
    glitch_rows: int
    """Rows flagged by `glitches` (left out of the fit, reported both ways)."""
    stats: dict[str, dict[str, float]] = field(default_factory=dict)
    """"train" / "heldout" / per band label -> n, mape_pct, median_pct, worst_pct, on
    every held-out row."""
    clean_stats: dict[str, dict[str, float]] = field(default_factory=dict)
    """The same on held-out rows that are not glitches."""


@dataclass
class KernelFit:
    profile: CalibrationProfile
    families: dict[str, FamilyFit]


def error_stats(predicted: np.ndarray, measured: np.ndarray) -> dict[str, float]:
    """n, MAPE, median signed error and worst absolute error, in percent."""
    if not len(measured):
        return {"n": 0}
    err = predicted / measured - 1.0
    worst = int(np.argmax(np.abs(err)))
    return {"n": int(len(err)), "mape_pct": float(np.mean(np.abs(err)) * 100),
            "median_pct": float(np.median(err) * 100), "worst_pct": float(err[worst] * 100)}


def family_table(ms: MeasurementSet, fam: Family) -> Table:
    table = vidur_elementwise(ms.table("vidur_ops")) if fam.table == "vidur_elementwise" \
        else ms.table(fam.table)
    return table.select(fam.select(table)) if len(table) else table


def fit_family(fam: Family, table: Table, gpu: GPUSpec, heldout: np.ndarray,
               base: object, max_points: int | None = None) -> FamilyFit:
    """Least squares on log(predicted/measured) over the rows not held out, from each of
    the family's starting points; the lowest robust loss wins. `max_points` fits on a
    seeded sample of that many training rows (a quick look; the judgement still uses
    every held-out row)."""
    from scipy.optimize import least_squares

    glitch = glitches(table, fam.size_axes)
    usable = ~heldout & ~glitch
    if max_points is not None and usable.sum() > max_points:
        chosen = np.random.default_rng(0).choice(np.flatnonzero(usable), max_points, replace=False)
        usable = np.zeros(len(table), dtype=bool)
        usable[chosen] = True
    train = table.select(usable)
    fixed = fam.fixed(gpu)
    base = replace(base, **fixed)
    names = [n for n in fam.fitted if n not in fixed]
    lo = np.log([fam.fitted[n][0] for n in names])
    hi = np.log([fam.fitted[n][1] for n in names])
    y = np.log(train["latency_s"])

    def params(x: np.ndarray):
        values = dict(zip(names, np.exp(x).tolist()))
        for n in names:     # keep values inside their domains despite rounding at a bound
            if n.endswith("_eff"):
                values[n] = min(1.0, values[n])
            if n in ("overlap", "epilogue_overlap", "cta_overlap", "l2_gain", "batch_saturation"):
                values[n] = max(1.0, values[n])
            if n == "wave_quantization":
                values[n] = min(1.0, values[n])
        return replace(base, **values)

    def residuals(x: np.ndarray) -> np.ndarray:
        return np.log(fam.predict(train, gpu, params(x))) - y

    best = None
    for start in fam.starts:
        x0 = np.log([start.get(n, fam.fitted[n][2]) for n in names])
        x0 = np.clip(x0, lo + 1e-9, hi - 1e-9)
        solution = least_squares(residuals, x0, bounds=(lo, hi), loss="soft_l1", f_scale=0.05,
                                 max_nfev=3000)
        if best is None or solution.cost < best.cost:
            best = solution
    return judge(fam, table, gpu, params(best.x), heldout)


def judge(fam: Family, table: Table, gpu: GPUSpec, params, heldout: np.ndarray) -> FamilyFit:
    """Errors of `params` on a family's rows: train, held-out, and held-out per band, on
    every row and on the rows that are not glitches."""
    pred = fam.predict(table, gpu, params)
    meas = table["latency_s"]
    glitch = glitches(table, fam.size_axes)
    bands = fam.band(table)

    def summary(rows: np.ndarray) -> dict:
        out = {"train": error_stats(pred[~heldout & rows], meas[~heldout & rows]),
               "heldout": error_stats(pred[heldout & rows], meas[heldout & rows])}
        for label in fam.band_order:
            sel = heldout & rows & (bands == label)
            if sel.any():
                out[label] = error_stats(pred[sel], meas[sel])
        return out

    everything = np.ones(len(table), dtype=bool)
    return FamilyFit(fam.name, params, int((~heldout).sum()), int(heldout.sum()),
                     int(glitch.sum()), summary(everything), summary(~glitch))


def calibrate(ms: MeasurementSet, seed: int = DEFAULT_SEED, holdout: float = DEFAULT_HOLDOUT,
              fallback: CalibrationProfile | None = None, data_version: str = "",
              max_points: int | None = None, progress=None) -> KernelFit:
    """Fit every family that has measurements; take the others from `fallback` (a profile
    of another GPU, e.g. of the same era) or leave them at the bare roofline, and say so."""
    gpu = get_gpu(ms.gpu)
    fits: dict[str, FamilyFit] = {}
    values = {}
    provenance = {}
    for name, fam in FAMILIES.items():
        table = family_table(ms, fam)
        if len(table) < 2 * len(fam.fitted):
            if name == "gemm_fp8" and "gemm" in values:
                values[name] = values["gemm"]
                provenance[f"kernels.{name}"] = "no FP8 GEMM measurements: the BF16 GEMM parameters"
            elif fallback is not None:
                values[name] = getattr(fallback.kernels, name)
                provenance[f"kernels.{name}"] = (f"no measurements on {ms.gpu}: carried from the "
                                                 f"{fallback.device} profile")
            else:
                provenance[f"kernels.{name}"] = "no measurements: bare roofline"
            continue
        mask = holdout_mask(table, holdout, seed)
        if progress:
            progress(f"fitting {name} on {int((~mask).sum())} points ...")
        fit = fit_family(fam, table, gpu, mask, getattr(K.KernelParams.roofline(), name),
                         max_points)
        fits[name] = fit
        values[name] = fit.params
        provenance[f"kernels.{name}"] = ms.sources.get(fam.table if fam.table != "vidur_elementwise"
                                                       else "vidur_ops", "")
    values["host_link"] = ASSUMED_HOST_LINK
    provenance["kernels.host_link"] = "assumption (no public measurements): see ASSUMED_HOST_LINK"
    provenance["step_overhead_s"] = ("assumption (kernel tables do not see CPU time): "
                                     "fit it from real runs with `servelab validate --fit`")
    kernels = K.KernelParams(**{f.name: values.get(f.name, getattr(K.KernelParams.roofline(), f.name))
                                for f in fields(K.KernelParams)})
    stats = {"holdout_fraction": holdout, "holdout_seed": seed}
    if max_points is not None:
        stats["max_points"] = max_points
    for name, fit in fits.items():
        stats[f"{name}.rows"] = fit.rows + fit.heldout_rows
        if fit.stats["heldout"].get("n"):
            stats[f"{name}.heldout_mape_pct"] = round(fit.stats["heldout"]["mape_pct"], 2)
    stats.update({f"dropped.{k}": v for k, v in ms.dropped.items()})
    source = {"project": "servelab calibrate --from-measurements", "date": date.today().isoformat(),
              "gpu": ms.gpu, **provenance}
    if data_version:
        source["data"] = data_version
    profile = CalibrationProfile(device=ms.gpu, kernels=kernels,
                                 step_overhead_s=DEFAULT_STEP_OVERHEAD_S, source=source,
                                 fit_stats=_rounded(stats))
    return KernelFit(profile, fits)


def _rounded(stats: dict) -> dict:
    return {k: (round(v, 6) if isinstance(v, float) and math.isfinite(v) else v)
            for k, v in stats.items()}
