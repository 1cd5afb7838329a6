"""Fitting the kernel models of `simulator/kernels.py` to measured kernel times.

    ms = load_measurements(["../shared/gpu-measurements"], "h100-sxm", drop_bad_rows=True,
                           engine_version="0.14.0")
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

import numpy as np

from servelab.simulator import kernels as K
from servelab.simulator.calibration import DEFAULT_STEP_OVERHEAD_S, CalibrationProfile
from servelab.simulator.gpus import GPUSpec, get_gpu
from servelab.simulator.kernels.movement import alltoall_from_ring
from servelab.validation.kernel_families import FAMILIES, Family, vidur_elementwise
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
    "moe": ("tokens", "hidden", "inter", "experts", "topk", "tp", "ep", "load"),
    "mla_prefill": ("batch", "tokens", "heads"),
    "mla_decode": ("batch", "context", "heads"),
    "nccl": ("op", "num_gpus", "nbytes"),
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
    return fam.prepare(table.select(fam.select(table))) if len(table) else table


def fit_family(fam: Family, table: Table, gpu: GPUSpec, heldout: np.ndarray,
               base: object, max_points: int | None = None) -> FamilyFit:
    """Least squares on log(predicted/measured) over the rows not held out, from each of
    the family's starting points and for each kernel path it may run (`Family.fixed`, then
    `Family.alternatives`); the lowest robust loss wins. `max_points` fits on a
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
    y = np.log(train["latency_s"])
    best, best_params = None, None
    untold = fam.untold(table)
    free = [n for n in fam.fitted if n not in {**fam.fixed(gpu), **untold}]
    if len(train) < len(free):
        raise ValueError(f"{fam.name}: {len(train)} training points for {len(free)} parameters "
                         f"({int(heldout.sum())} of {len(table)} held out, "
                         f"{int((~heldout & glitch).sum())} glitches): hold fewer out "
                         "(--holdout) or measure more shapes")
    for fixed in (fam.fixed(gpu), *fam.alternatives(gpu)):
        fixed = {**fixed, **untold}
        names = [n for n in fam.fitted if n not in fixed]
        lo = np.log([fam.fitted[n][0] for n in names])
        hi = np.log([fam.fitted[n][1] for n in names])
        params = _parameters(replace(base, **fixed), names)

        def residuals(x: np.ndarray, params=params) -> np.ndarray:
            return np.log(fam.predict(train, gpu, params(x))) - y

        for start in fam.starts:
            x0 = np.log([start.get(n, fam.fitted[n][2]) for n in names])
            x0 = np.clip(x0, lo + 1e-9, hi - 1e-9)
            solution = least_squares(residuals, x0, bounds=(lo, hi), loss="soft_l1",
                                     f_scale=0.05, max_nfev=3000)
            if best is None or solution.cost < best.cost:
                best, best_params = solution, params(solution.x)
    return judge(fam, table, gpu, fam.canonical(best_params), heldout)


def _parameters(base, names: list[str]):
    """x (log values of `names`) -> a copy of `base` with them, kept inside their domains
    despite rounding at a bound."""
    def params(x: np.ndarray):
        values = dict(zip(names, np.exp(x).tolist()))
        for n in names:
            if n.endswith("_eff"):
                values[n] = min(1.0, values[n])
            if n in ("overlap", "epilogue_overlap", "cta_overlap", "batch_saturation",
                     "misaligned_slowdown") or n.endswith("l2_gain"):   # as _check_fields
                values[n] = max(1.0, values[n])
            if n == "wave_quantization":
                values[n] = min(1.0, values[n])
        return replace(base, **values)
    return params


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


_FP8_OF = {"gemm_fp8": ("gemm", "GEMM"), "moe_fp8": ("moe", "MoE")}
OPTIONAL_FAMILIES = {"moe_cutlass": "no FlashInfer CUTLASS BF16 MoE measurements beside "
                                    "another kernel's: every layer is priced with kernels.moe",
                     "moe_fp8_ep": "no FP8 MoE measurements under EP on another kernel than "
                                   "without: every layout is priced with kernels.moe_fp8"}
"""Kernel paths an engine takes only on some GPUs: without measurements a profile has none
(`KernelParams.moe_cutlass` None), and nothing is carried from another profile."""
"""FP8 families that take their BF16 family's parameters where no FP8 rows were measured
(with the name said in the provenance)."""


def calibrate(ms: MeasurementSet, seed: int = DEFAULT_SEED, holdout: float = DEFAULT_HOLDOUT,
              fallback: CalibrationProfile | None = None, data_version: str = "",
              max_points: int | None = None, progress=None,
              families: tuple[str, ...] | None = None,
              ring: "tuple[K.CollectiveParams, str] | None" = None,
              gpu: GPUSpec | None = None) -> KernelFit:
    """Fit every family that has measurements (or only `families`); take the others from
    `fallback` (a profile of another GPU, e.g. of the same era) or leave them at the bare
    roofline, and say so.

    The all-to-all (the EP exchange) without measurements is, in order: the fallback's
    where the fallback was measured on this GPU (its own tables inside another engine
    version); else, on a PCIe GPU (no NVLink), derived from this GPU's own ring all-reduce
    — fitted here, or `ring` (parameters and their provenance) when the collective family
    is not refitted — by `kernels.movement.alltoall_from_ring`, which says why the ring
    prices the exchange better than another GPU's all-to-all there (on NVLink the
    derivation is 8-27% fast against A100/H100's measured exchanges, so an NVLink GPU
    borrows a measured one); else the fallback's; else the bare roofline. `gpu`: the
    measured GPU's spec where it is not in the catalog (a GPU file)."""
    gpu = gpu or get_gpu(ms.gpu)
    own_ring = ring
    fits: dict[str, FamilyFit] = {}
    values = {}
    provenance = {}
    for name, fam in FAMILIES.items():
        if families is not None and name not in families:
            continue
        table = family_table(ms, fam)
        if len(table) < 2 * len(fam.fitted):
            if name in OPTIONAL_FAMILIES:
                values[name] = None
                provenance[f"kernels.{name}"] = OPTIONAL_FAMILIES[name]
            elif name in _FP8_OF and _FP8_OF[name][0] in values:
                bf16, label = _FP8_OF[name]
                values[name] = values[bf16]
                provenance[f"kernels.{name}"] = (f"no FP8 {label} measurements: the BF16 {label} "
                                                 f"parameters")
            elif name == "alltoall" and (fallback is None or fallback.device != ms.gpu) \
                    and own_ring is not None and gpu.nvlink_gbps is None:
                values[name] = alltoall_from_ring(own_ring[0])
                provenance[f"kernels.{name}"] = _ring_provenance(ms.gpu, own_ring[1])
            elif fallback is not None:
                values[name] = getattr(fallback.kernels, name)
                provenance[f"kernels.{name}"] = (f"no measurements on {ms.gpu}: carried from the "
                                                 f"{fallback.device} profile")
            else:
                provenance[f"kernels.{name}"] = "no measurements: bare roofline"
            continue
        mask = holdout_mask(table, holdout, seed)
        if progress:
            train = int((~mask).sum())
            sampled = f" (sampled from {train:,})" if max_points is not None \
                and train > max_points else ""
            progress(f"fitting {name} on {min(train, max_points or train):,} points{sampled} ...")
        fit = fit_family(fam, table, gpu, mask, K.KernelParams.bare(name), max_points)
        fits[name] = fit
        values[name] = fit.params
        provenance[f"kernels.{name}"] = ms.sources.get(fam.table if fam.table != "vidur_elementwise"
                                                       else "vidur_ops", "")
        if name == "collective":
            own_ring = fit.params, provenance[f"kernels.{name}"]
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
    profile = CalibrationProfile(device=ms.gpu, kernels=kernels, engine_version=ms.engine_version,
                                 step_overhead_s=DEFAULT_STEP_OVERHEAD_S, source=source,
                                 fit_stats=_rounded(stats))
    return KernelFit(profile, fits)


def extend_profile(base: CalibrationProfile, ms: MeasurementSet, families: tuple[str, ...],
                   data_version: str = "", fallback: CalibrationProfile | None = None,
                   progress=None) -> KernelFit:
    """`base` with `families` fitted to `ms` (with base's held-out seed and fraction) and
    everything else — every other family's parameters, provenance and figures — kept
    exactly: how the packaged profiles gained the MoE, MLA and all-to-all families
    without refitting their dense kernels. Families without measurements come from
    `fallback`, as in `calibrate`."""
    if ms.gpu != base.device:
        raise ValueError(f"measurements of {ms.gpu} cannot extend a profile of {base.device}")
    if base.engine_version and ms.engine_version not in (None, base.engine_version):
        raise ValueError(f"tables measured inside vLLM {ms.engine_version} cannot extend a "
                         f"profile fitted inside vLLM {base.engine_version}")
    seed = int(base.fit_stats.get("holdout_seed", DEFAULT_SEED))
    fraction = float(base.fit_stats.get("holdout_fraction", DEFAULT_HOLDOUT))
    collective = base.source.get("kernels.collective", "")
    ring = (base.kernels.collective, collective) if _measured(collective) else None
    result = calibrate(ms, seed, fraction, fallback=fallback, data_version=data_version,
                       progress=progress, families=families, ring=ring)
    new = result.profile
    kernels = replace(base.kernels, **{n: getattr(new.kernels, n) for n in families
                                       if f"kernels.{n}" in new.source})
    source = dict(base.source)
    source.update({k: v for k, v in new.source.items()
                   if k.startswith("kernels.") and k[len("kernels."):] in families})
    if data_version:
        source["data"] = data_version
    stats = dict(base.fit_stats)
    stats.update({k: v for k, v in new.fit_stats.items() if k.split(".")[0] in families})
    profile = replace(base, kernels=kernels, source=source, fit_stats=stats)
    return KernelFit(profile, result.families)


def _measured(provenance: str) -> bool:
    """Whether a family's provenance line names a table it was fitted to (not a carry-over,
    the bare roofline or an assumption)."""
    return bool(provenance) and not provenance.startswith(("no ", "assumption"))


def _ring_provenance(gpu: str, collective_source: str) -> str:
    return (f"no all-to-all measurements on {gpu}: derived from its own NCCL ring all-reduce "
            f"fit (kernels.collective, {collective_source}): ring latency, hop and bus "
            f"bandwidth, an all-gather or reduce-scatter moving (n-1)/n of the buffer per GPU "
            f"(kernels.movement.alltoall_from_ring)")


def _rounded(stats: dict) -> dict:
    return {k: (round(v, 6) if isinstance(v, float) and math.isfinite(v) else v)
            for k, v in stats.items()}
