"""The fidelity report: the cost model against measured kernel times, held out from its fit.

    servelab fidelity --measurements ../shared/gpu-measurements --out docs/fidelity.md

For every packaged profile — each GPU at each engine version it was measured inside, judged
on that version's tables only — every kernel family and size band:
MAPE, median signed error and worst case of the bare roofline and of the fitted profile,
side by side, on the points the profile's fit held out (its split is recorded in the
profile and reproduced here). Then checks on data the fit never saw at all: FP8 KV-cache
attention with BF16-fitted parameters, Vidur's per-layer operator totals (another, eager
engine; only its element-wise operators were fitted, on a seeded part of its points, so
the totals are reported on the held-out points) and Vidur's NCCL all-reduce. Plots of
predicted against measured go beside the Markdown file. Where one GPU was measured inside
several engine versions, the report ends with how its kernel times moved between them
(`engine_ratios`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import date
from pathlib import Path

import numpy as np

from servelab.simulator import kernels as K
from servelab.simulator.calibration import (CalibrationProfile, packaged, packaged_names,
                                            version_key)
from servelab.simulator.gpus import GPUSpec, get_gpu
from servelab.validation.kernel_fit import (
    FAMILIES, Family, error_stats, family_table, holdout_mask, judge)
from servelab.validation.measurements import MeasurementSet, Table, key_columns, load_measurements

TARGETS = {"gemm": 10.0, "attn_prefill": 15.0, "attn_decode": 15.0, "collective": 15.0,
           "moe": 15.0, "moe_fp8": 15.0, "moe_cutlass": 15.0, "moe_fp8_ep": 15.0, "mla_prefill": 15.0, "mla_decode": 15.0,
           "alltoall": 15.0}
"""Held-out MAPE targets per family (%, every band); the Vidur per-layer totals: 20%."""
VIDUR_TARGET = 20.0
COMMAND = "servelab fidelity --measurements ../shared/gpu-measurements --out docs/fidelity.md"


@dataclass
class GpuReport:
    gpu: str
    profile: CalibrationProfile
    families: dict[str, tuple]
    """family -> (bare FamilyFit, fitted FamilyFit) judged on the profile's held-out rows."""
    extra: dict[str, dict]
    """check name -> {band: stats} for data the fit never saw."""
    points: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
    """family -> (measured, bare, fitted) seconds of the held-out rows, for the plot."""
    name: str = ""
    """The packaged profile's name (`simulator/data/calibration/<name>.json`)."""


def evaluate_gpu(ms: MeasurementSet, profile: CalibrationProfile) -> GpuReport:
    gpu = get_gpu(ms.gpu)
    seed = int(profile.fit_stats.get("holdout_seed", 0))
    fraction = float(profile.fit_stats.get("holdout_fraction", 0.3))
    families, points, extra = {}, {}, {}
    for name, fam in FAMILIES.items():
        table = family_table(ms, fam)
        if not len(table) or (name.startswith("mla")
                              and f"{name}.heldout_mape_pct" not in profile.fit_stats):
            continue
        fitted_params = getattr(profile.kernels, name)
        if fitted_params is None:       # a kernel path the profile does not price
            continue
        heldout = holdout_mask(table, fraction, seed)
        b = judge(fam, table, gpu, replace(K.KernelParams.bare(name), **fam.fixed(gpu)), heldout)
        f = judge(fam, table, gpu, fitted_params, heldout)
        families[name] = (b, f)
        rows = table.select(heldout)
        points[name] = (rows["latency_s"], fam.predict(rows, gpu, b.params),
                        fam.predict(rows, gpu, fitted_params))
    extra.update(_fp8_kv_checks(ms, gpu, profile, fraction, seed))
    extra.update(_vidur_checks(ms, gpu, profile, fraction, seed))
    return GpuReport(ms.gpu, profile, families, extra, points)


def _fp8_kv_checks(ms, gpu, profile, fraction, seed) -> dict:
    out = {}
    for name in ("attn_prefill", "attn_decode", "mla_prefill", "mla_decode"):
        fam = FAMILIES[name]
        table = ms.table(fam.table)
        if not len(table) or (name.startswith("mla")
                              and f"{name}.heldout_mape_pct" not in profile.fit_stats):
            continue
        rows = table.select((table["kv_dtype"] == "fp8") & holdout_mask(table, fraction, seed)
                            & ((table["tokens"] > 1) if "tokens" in table.columns else True))
        if len(rows):
            stats = _banded(fam, rows, gpu, getattr(profile.kernels, name))
            note = _fp8_speedup_note(table)
            if note:
                stats["_note"] = note
            out[f"{name}, FP8 KV cache (parameters fitted on BF16)"] = stats
    return out


FP8_KV_MAX_SPEEDUP = (2.0, 4.0)
"""How much faster than with a BF16 cache of the same shape a kernel over an FP8 KV cache
can plausibly run, at the median and at the 90th percentile of a table's shapes: the cache
halves the bytes of K and V, and a kernel may also run its products on FP8 tensor cores
(twice the BF16 rate) or take another path; beyond these, the rows' kernels skipped work."""


def _fp8_speedup_note(table: Table) -> str | None:
    """A line saying that a table's FP8-KV rows run faster than an FP8 cache can explain
    (the BF16 row of the same shape over the FP8 one, median or 90th percentile above
    `FP8_KV_MAX_SPEEDUP`): rows whose kernel skipped work, not a fit's error. None when
    they are plausible or have no BF16 twin."""
    shape_columns = [c for c in table.columns if c not in ("kv_dtype", "latency_s")]
    keys = list(zip(*(table[c].tolist() for c in shape_columns)))
    bf16 = {k: lat for k, dt, lat in zip(keys, table["kv_dtype"], table["latency_s"]) if dt == "bf16"}
    speedups = np.array([bf16[k] / lat for k, dt, lat in zip(keys, table["kv_dtype"], table["latency_s"])
                         if dt == "fp8" and k in bf16 and lat > 0])
    if not len(speedups):
        return None
    p50, p90 = np.percentile(speedups, [50, 90])
    if p50 <= FP8_KV_MAX_SPEEDUP[0] and p90 <= FP8_KV_MAX_SPEEDUP[1]:
        return None
    return (f"These FP8 rows run faster than an FP8 cache explains: against the BF16 row of the "
            f"same shape, {p50:.1f}x at the median, {p90:.1f}x at the 90th percentile and up to "
            f"{speedups.max():,.0f}x ({len(speedups):,} pairs), where halved KV bytes and FP8 "
            f"maths allow about {FP8_KV_MAX_SPEEDUP[0]:g}x and {FP8_KV_MAX_SPEEDUP[1]:g}x: "
            f"kernels that skipped work. The errors below measure those rows as much as the "
            f"model, which prices an FP8 cache with the BF16 fit.")


def _banded(fam: Family, rows: Table, gpu: GPUSpec, params) -> dict:
    pred, meas = fam.predict(rows, gpu, params), rows["latency_s"]
    bands = fam.band(rows)
    out = {"all": error_stats(pred, meas)}
    for label in fam.band_order:
        sel = bands == label
        if sel.any():
            out[label] = error_stats(pred[sel], meas[sel])
    return out


_VIDUR_LAYER_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj", "mlp_act",
                    "attn_rope", "input_layernorm", "post_attention_layernorm")


def vidur_layer_prediction(ops: Table, gpu: GPUSpec, kernels: K.KernelParams) -> np.ndarray:
    """One layer of Vidur's operators (4 GEMMs, SiLU·mul, rotary, 2 norms, 2 residual adds)
    priced by our kernel models at Vidur's shapes (fp16 = bf16 rates)."""
    h, inter = ops["n_embd"].astype(float), ops["n_expanded_embd"].astype(float)
    tp = ops["num_tensor_parallel_workers"].astype(float)
    heads, kv = ops["n_head"] / tp, np.maximum(ops["n_kv_head"] / tp, 1)
    hd = h / ops["n_head"]
    m = ops["num_tokens"].astype(float)
    total = np.zeros(len(ops))
    for n, k in (((heads + 2 * kv) * hd, h), (h, heads * hd), (2 * inter / tp, h), (h, inter / tp)):
        total += K.gemm_time(m, n, k, gpu, kernels.gemm)
    a = 2.0
    for per_token in (3 * inter / tp * a, 2 * (heads + kv) * hd * a, 2 * h * a, 2 * h * a,
                      3 * h * a, 3 * h * a):
        total += K.elementwise_time(m * per_token, gpu, kernels.elementwise)
    return total


def _vidur_checks(ms, gpu, profile, fraction, seed) -> dict:
    out = {}
    ops = ms.table("vidur_ops")
    if len(ops):
        held = ops.select(holdout_mask(ops, fraction, seed))
        measured = sum(held[op] for op in _VIDUR_LAYER_OPS) + 2 * held["add"]
        for tp in sorted(set(held["num_tensor_parallel_workers"].tolist())):
            sel = held["num_tensor_parallel_workers"] == tp
            rows = held.select(sel)
            pred = vidur_layer_prediction(rows, gpu, profile.kernels)
            bare = vidur_layer_prediction(rows, gpu, K.KernelParams.roofline())
            bands = np.where(rows["num_tokens"] <= 32, "tokens 1-32",
                             np.where(rows["num_tokens"] <= 512, "tokens 33-512", "tokens > 512"))
            stats = {"all": error_stats(pred, measured[sel]),
                     "all (bare roofline)": error_stats(bare, measured[sel])}
            for label in ("tokens 1-32", "tokens 33-512", "tokens > 512"):
                if (bands == label).any():
                    stats[label] = error_stats(pred[bands == label], measured[sel][bands == label])
            out[f"Vidur per-layer operator total, TP {tp} (eager fp16)"] = stats
    ar = ms.table("vidur_allreduce")
    if len(ar):
        pred = K.allreduce_time(ar["nbytes"], ar["num_gpus"], gpu, profile.kernels.collective)
        keep = ar["nbytes"] >= 1024
        stats = {"all": error_stats(pred[keep], ar["latency_s"][keep])}
        for n in sorted(set(ar["num_gpus"].tolist())):
            sel = keep & (ar["num_gpus"] == n)
            stats[f"{n} GPUs"] = error_stats(pred[sel], ar["latency_s"][sel])
        out["Vidur NCCL all-reduce (eager; fitted on vLLM's graph-mode all-reduce)"] = stats
    return out


RATIO_FAMILIES = ("attn_decode", "attn_prefill", "gemm")
"""The families `engine_ratios` compares (BF16 rows, full attention, as fitted)."""


def engine_ratios(old: MeasurementSet, new: MeasurementSet) -> dict[str, dict[str, float]]:
    """Per family: how many shapes both sets measured, and the 10th, 50th and 90th
    percentiles of new / old latency over them (one GPU, two engine versions)."""
    out = {}
    for name in RATIO_FAMILIES:
        fam = FAMILIES[name]
        a, b = family_table(old, fam), family_table(new, fam)
        if not len(a) or not len(b):
            continue
        keys = key_columns(a.family)
        before = dict(zip(zip(*(a[c].tolist() for c in keys)), a["latency_s"].tolist()))
        ratios = [t / before[k] for k, t in zip(zip(*(b[c].tolist() for c in keys)),
                                                 b["latency_s"].tolist()) if k in before]
        if ratios:
            p10, p50, p90 = np.quantile(ratios, [0.1, 0.5, 0.9])
            out[name] = {"n": len(ratios), "p10": float(p10), "p50": float(p50), "p90": float(p90)}
    return out


# ------------------------------------------------------------------------------ writing


def _engine(profile: CalibrationProfile) -> str:
    return f"vLLM {profile.engine_version}" if profile.engine_version else "an unknown engine"


def _title(r: GpuReport) -> str:
    return f"{r.gpu}, {_engine(r.profile)}"


def _cell(stats: dict) -> str:
    if not stats.get("n"):
        return "–"
    return f"{stats['mape_pct']:.1f} / {stats['median_pct']:+.1f} / {stats['worst_pct']:+.0f}"


def render(reports: list[GpuReport], out: Path, plots: list[str], command: str = COMMAND,
           ratios: dict[tuple[str, str, str], dict] | None = None) -> str:
    """The Markdown report; `ratios`: (GPU, old version, new version) -> `engine_ratios`."""
    lines = [
        "# Cost-model fidelity against measured kernel times",
        "",
        f"Generated by `{command}` on {date.today().isoformat()}.",
        "",
        "Each cell is **MAPE % / median signed error % / worst signed error %** (positive: the",
        "model is too slow), on the points each packaged profile's fit **held out** (a seeded",
        "hash of the shape: 30% of every table; the profile records the seed). *Bare* is the",
        "roofline at datasheet peaks with no floors (`--calibration none`); *fitted* is the",
        "packaged profile. Measurements are isolated, repeated kernels, so operands that fit",
        "in L2 stay there: both are judged as such (`warm_l2`); the simulator prices a forward",
        "pass, which reads every layer's data from HBM.",
        "",
        "Glitches: points more than 1.3x slower than a strictly larger problem of the same",
        "kind are left out of the fits; the *fitted, no glitches* column leaves them out of",
        "the figure too (how many there are is given per family).",
        "",
        "Whole runs, the simulator end to end against real vLLM runs request by request, are",
        "judged in [real-runs.md](real-runs.md) (`servelab validate --real-requests`).",
        "",
    ]
    for r in reports:
        src = r.profile.source
        lines += [f"## {_title(r)}", "",
                  f"Profile `simulator/data/calibration/{r.name or r.gpu}.json`, judged on the "
                  f"tables measured inside {_engine(r.profile)}; data: {src.get('data', '?')}.", ""]
        for name, (bare, fitted) in r.families.items():
            target = TARGETS.get(name)
            lines += [f"### {name}" + (f" (target: held-out MAPE <= {target:.0f}% in every band)"
                                        if target else ""), "",
                      f"{fitted.heldout_rows} held-out of {fitted.rows + fitted.heldout_rows} points; "
                      f"{fitted.glitch_rows} glitches. Source: {src.get('kernels.' + name, '?')}", "",
                      "| band | n | bare | fitted | fitted, no glitches |", "|---|---|---|---|---|"]
            for label in ("heldout", *FAMILIES[name].band_order):
                if label not in fitted.stats:
                    continue
                shown = "**all held-out**" if label == "heldout" else label
                lines.append(f"| {shown} | {fitted.stats[label]['n']} | {_cell(bare.stats[label])} | "
                             f"{_cell(fitted.stats[label])} | {_cell(fitted.clean_stats.get(label, {}))} |")
            lines.append("")
        for check, stats in r.extra.items():
            lines += [f"### {check}", ""]
            if stats.get("_note"):
                lines += [stats["_note"], ""]
            lines += ["| band | n | error |", "|---|---|---|"]
            for label, st in stats.items():
                if label != "_note":
                    lines.append(f"| {label} | {st.get('n', 0)} | {_cell(st)} |")
            lines.append("")
    if ratios:
        lines += ["## Kernel times across engine versions", "",
                  "The same GPU's kernels measured inside two vLLM versions, on the shapes both",
                  "tables hold (BF16, full attention): percentiles of the newer time over the older.",
                  "A profile fitted inside one version prices the other this far off.", "",
                  "| GPU | newer / older | family | shapes | p10 | p50 | p90 |",
                  "|---|---|---|---|---|---|---|"]
        for (gpu, old, new), by_family in ratios.items():
            for name, r in by_family.items():
                lines.append(f"| {gpu} | vLLM {new} / {old} | {name} | {r['n']} | {r['p10']:.2f} | "
                             f"{r['p50']:.2f} | {r['p90']:.2f} |")
        lines.append("")
    lines += ["## Plots", ""] + [f"![{p}]({out.stem}/{p})" for p in plots] + [""]
    return "\n".join(lines)


def plot(reports: list[GpuReport], folder: Path) -> list[str]:
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for r in reports:
        fig, axes = plt.subplots(1, 2, figsize=(11, 5), sharex=True, sharey=True)
        for ax, which, title in ((axes[0], 1, "bare roofline"), (axes[1], 2, "fitted profile")):
            for fam, pts in r.points.items():
                ax.scatter(pts[0] * 1e3, pts[which] * 1e3, s=3, alpha=0.35, label=fam)
            lo = min(float(p[0].min()) for p in r.points.values()) * 1e3
            hi = max(float(p[0].max()) for p in r.points.values()) * 1e3
            ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("measured (ms)")
            ax.set_title(f"{_title(r)}: {title} (held-out points)")
        axes[0].set_ylabel("predicted (ms)")
        axes[1].legend(markerscale=4, fontsize=8, loc="upper left")
        fig.tight_layout()
        name = f"{r.name or r.gpu}_predicted_vs_measured.png"
        fig.savefig(folder / name, dpi=110)
        plt.close(fig)
        names.append(name)
    return names


def write_report(measurement_dirs: list[str | Path], out: str | Path,
                 gpus: list[str] | None = None, progress=print, command: str = COMMAND,
                 engine_versions: list[str] | None = None) -> Path:
    """Judge every packaged profile (of the GPUs in `gpus` and the engine versions in
    `engine_versions`; default all) on the tables of its own GPU and engine version, and
    write the Markdown report and its plots."""
    out = Path(out)
    reports = []
    chosen = [get_gpu(g).name for g in gpus] if gpus else None
    loaded: dict[str, dict[str, MeasurementSet]] = {}
    for name in packaged_names():
        profile = packaged(name)
        if chosen is not None and profile.device not in chosen:
            continue
        if engine_versions and profile.engine_version not in engine_versions:
            continue
        progress(f"{name}: loading {profile.device}'s measurements inside "
                 f"{_engine(profile)} and judging the packaged profile")
        ms = load_measurements(measurement_dirs, profile.device, drop_bad_rows=True,
                               engine_version=profile.engine_version)
        loaded.setdefault(profile.device, {})[profile.engine_version or "?"] = ms
        reports.append(replace(evaluate_gpu(ms, profile), name=name))
    if not reports:
        fitted = sorted({f"{packaged(n).device} ({packaged(n).engine_version or '?'})"
                         for n in packaged_names()})
        raise ValueError(f"no packaged profile was fitted on {', '.join(chosen or ['any GPU'])}"
                         f"{' inside vLLM ' + ', '.join(engine_versions) if engine_versions else ''}"
                         f": fidelity judges packaged profiles on their own GPU's tables, which "
                         f"exist for {', '.join(fitted)} (a profile of your own: `servelab "
                         f"calibrate` prints its held-out error per band)")
    ratios = {}
    for gpu, by_version in loaded.items():
        versions = sorted((v for v in by_version if v != "?"), key=version_key)
        for newer in versions[1:]:
            ratios[(gpu, versions[0], newer)] = engine_ratios(by_version[versions[0]],
                                                              by_version[newer])
    out.parent.mkdir(parents=True, exist_ok=True)
    plots = plot(reports, out.parent / out.stem)
    out.write_text(render(reports, out, plots, command, ratios))
    return out
