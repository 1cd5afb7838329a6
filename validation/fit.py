"""Fitting the step-level calibration — per-class scales and the step overhead — to
measured steps of real runs.

    result = fit_calibration(cost_model, shapes, durations)      # -> FitResult
    result.profile.save("calibration/h100-llama-3.1-8b.json")

The kernel models (`simulator/kernels.py`, fitted to kernel measurements by
`kernel_fit.py`) price each op class of a step; what a real engine adds on top — CPU time
per step, and how far its kernels sit from the measured ones — is

    step_time = overhead + Σ_class scale[class] · class_time(shape)

which is linear in (overhead, scales) with the class times as features
(`CostModel.features`), so a fit is a bounded linear regression. It is solved on
*relative* error (each step's row divided by its measured duration), because the figures
people read are percentage errors and a 2 ms decode step matters as much as a 200 ms
prefill. Bounds: the overhead is >= 0; a scale is >= `MIN_SCALE` (a class priced at a
tenth of its kernel model means the kernel model is wrong, not the engine). Substituting
c = lower + d turns that into non-negative least squares (scipy's `nnls`). The default
loss is l1 — the mean absolute relative error, i.e. the MAPE reported — by iteratively
reweighted NNLS: it follows the bulk of the steps and is not dragged by a minority slowed
by something the model does not describe (a busy host, a GC pause); "l2" (plain NNLS)
fits the mean.

Identifiability. A coefficient whose feature is zero on every training step (no swaps,
tp = 1, no decodes), or whose feature is (nearly) a combination of features already
accepted — in `FEATURE_NAMES` order, the step overhead first — cannot be learned from
these steps: it keeps its starting value and is reported with the reason. "Nearly" is
measured scale-free, on the weighted design with unit-norm columns: the part of the
column outside the span of the accepted ones must exceed `collinear_tol` of its norm. At
1% the coefficient's standard error is ~100× what an orthogonal column would give
(variance inflation 1/tol²), so the default refuses anything closer.

Cost: one `CostModel.features` call per training step (tens of µs), then up to 50 NNLS
solves of n × 7 (l1). Deterministic: no randomness, no clock.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from servelab.outputs import BatchShape
from servelab.simulator.calibration import OP_CLASSES, CalibrationProfile
from servelab.simulator.cost_model import CostModel

__all__ = ["FEATURE_NAMES", "LOSSES", "MIN_SCALE", "FitResult", "fit_calibration", "identify",
           "lower_bounds", "with_fit_stats"]

DEFAULT_COLLINEAR_TOL = 0.01
LOSSES = ("l1", "l2")
MIN_SCALE = 0.1
FEATURE_NAMES: tuple[str, ...] = ("overhead", *OP_CLASSES)
_IRLS_STEPS = 50


# --------------------------------------------------------------------------- identifiability


def identify(design: np.ndarray, names: Sequence[str],
             collinear_tol: float = DEFAULT_COLLINEAR_TOL) -> dict[str, str]:
    """Columns of `design` the data cannot identify, as {name: reason}; greedy in order.

    A column is accepted when its component orthogonal to the accepted columns keeps more
    than `collinear_tol` of its norm (Gram–Schmidt, reorthogonalised once).
    """
    if not 0 < collinear_tol < 1:
        raise ValueError(f"collinear_tol must be in (0, 1), got {collinear_tol!r}")
    basis: list[np.ndarray] = []
    accepted: list[int] = []
    out: dict[str, str] = {}
    for j, name in enumerate(names):
        col = design[:, j]
        norm = float(np.linalg.norm(col))
        if norm == 0:
            out[name] = "zero on every training step"
            continue
        v = col / norm
        r = v.copy()
        for _ in range(2):
            for q in basis:
                r -= (q @ r) * q
        rest = float(np.linalg.norm(r))
        if rest > collinear_tol:
            basis.append(r / rest)
            accepted.append(j)
            continue
        out[name] = _collinear_reason(design, names, accepted, j)
    return out


def _collinear_reason(design: np.ndarray, names: Sequence[str], accepted: list[int],
                      j: int) -> str:
    """Which accepted columns explain column j (those carrying >= 5% of the fit)."""
    sub = design[:, accepted]
    coef = np.linalg.lstsq(sub, design[:, j], rcond=None)[0]
    weight = np.abs(coef) * np.linalg.norm(sub, axis=0)
    share = weight / weight.sum() if weight.sum() > 0 else weight
    parts = [names[k] for i, k in enumerate(accepted) if share[i] >= 0.05]
    if parts == ["overhead"]:
        return "constant over the training steps (indistinguishable from the step overhead)"
    return f"collinear with {', '.join(parts)} over the training steps"


def lower_bounds() -> dict[str, float]:
    """Lowest coefficient allowed per feature: 0 s of overhead, `MIN_SCALE` per class."""
    return {name: (0.0 if name == "overhead" else MIN_SCALE) for name in FEATURE_NAMES}


# --------------------------------------------------------------------------- the fit


@dataclass(frozen=True)
class FitResult:
    profile: CalibrationProfile
    """The cost model's profile with the fitted scales and overhead (and the setup)."""
    coefficients: dict[str, float]
    """Every coefficient after the fit (unidentified ones at their starting values)."""
    unidentified: dict[str, str]
    """Coefficients the training steps cannot identify -> why; they kept their start."""
    at_bound: tuple[str, ...]
    """Fitted coefficients that ended on their bound (no overhead, or a scale of
    `MIN_SCALE`): the data pushes past what the model allows there."""
    loss: str
    train_error: float
    """The training steps' mean absolute ("l1") or root-mean-square ("l2") relative error
    under the fitted model: what the fit minimised."""

    def cost_model(self, like: CostModel) -> CostModel:
        """`like` with the fitted parameters."""
        return like.with_calibration(self.profile)


def fit_calibration(cost_model: CostModel, shapes: Sequence[BatchShape],
                    durations: Sequence[float], *, model_name: str | None = None,
                    software: dict[str, str] | None = None, notes: str = "",
                    collinear_tol: float = DEFAULT_COLLINEAR_TOL, loss: str = "l1") -> FitResult:
    """Fit `cost_model`'s class scales and step overhead to measured step `durations`.

    `cost_model` supplies the setup (model, device with any measured overrides, tp, dtypes,
    block size), the kernel parameters and the starting coefficients, which unidentifiable
    ones keep. The profile records the device's overrides relative to its catalog entry,
    `model_name` (default: the model's name) and `software`.
    """
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {loss!r}")
    y = np.asarray(durations, dtype=np.float64)
    if len(shapes) != len(y):
        raise ValueError(f"{len(shapes)} shapes but {len(y)} durations")
    if len(y) == 0:
        raise ValueError("no steps to fit")
    if not (np.isfinite(y).all() and (y > 0).all()):
        bad = int(np.flatnonzero(~(np.isfinite(y) & (y > 0)))[0])
        raise ValueError(f"step durations must be finite and > 0; step {bad} has {float(y[bad])!r}")
    lower = np.array([lower_bounds()[k] for k in FEATURE_NAMES])
    design = np.array([[f[k] for k in FEATURE_NAMES]
                       for f in (cost_model.features(s) for s in shapes)])
    coefs, unidentified = _solve(design, y, cost_model.coefficients(), lower, collinear_tol, loss)
    fitted_profile = cost_model.profile.with_fit(
        {k: coefs[k] for k in OP_CLASSES}, coefs["overhead"],
        {"train_steps": float(len(y))}, model=model_name or cost_model.model.name,
        tp=cost_model.tp, weight_dtype=cost_model.weight_dtype, kv_dtype=cost_model.kv_dtype)
    fitted_profile = replace(
        fitted_profile, gpu_overrides=_overrides(cost_model), notes=notes,
        source={**fitted_profile.source, **{f"software.{k}": v for k, v in (software or {}).items()}})
    fitted = cost_model.with_calibration(fitted_profile)
    score = _train_error(fitted, shapes, y, loss)
    at_bound = tuple(k for k, lo in zip(FEATURE_NAMES, lower)
                     if k not in unidentified and coefs[k] <= lo * (1 + 1e-12) + 1e-15)
    profile = replace(fitted_profile, fit_stats={**fitted_profile.fit_stats,
                                                 f"train_{loss}_rel_error": score})
    return FitResult(profile, coefs, unidentified, at_bound, loss, score)


def _weighted_nnls(a: np.ndarray, b: np.ndarray, loss: str) -> np.ndarray:
    """argmin over x >= 0 of Σ|a·x − b|² ("l2") or Σ|a·x − b| ("l1", by iteratively
    reweighted least squares: weights 1/max(|r|, δ), δ = 1e-4 of a relative error, until
    the mean absolute residual stops improving by 1e-6, at most _IRLS_STEPS solves)."""
    from scipy.optimize import nnls

    x = nnls(a, b)[0]
    if loss == "l2":
        return x
    best, best_cost = x, float(np.abs(a @ x - b).mean())
    for _ in range(_IRLS_STEPS):
        w = 1.0 / np.sqrt(np.maximum(np.abs(a @ x - b), 1e-4))
        x = nnls(a * w[:, None], b * w)[0]
        cost = float(np.abs(a @ x - b).mean())
        if cost >= best_cost * (1 - 1e-6):
            break
        best, best_cost = x, cost
    return best


def _solve(design: np.ndarray, y: np.ndarray, start: dict[str, float], lower: np.ndarray,
           collinear_tol: float, loss: str) -> tuple[dict[str, float], dict[str, str]]:
    """One bounded relative-error solve; unidentified coefficients keep `start`."""
    names = list(FEATURE_NAMES)
    unidentified = identify(design / y[:, None], names, collinear_tol)
    free = [j for j, k in enumerate(names) if k not in unidentified]
    fixed = [j for j, k in enumerate(names) if k in unidentified]
    coef = np.array([start[k] for k in names])
    rhs = y - design[:, fixed] @ coef[fixed] - design[:, free] @ lower[free]
    d = _weighted_nnls(design[:, free] / y[:, None], rhs / y, loss)
    coef[free] = lower[free] + d
    return dict(zip(names, map(float, coef))), unidentified


def _train_error(cm: CostModel, shapes: Sequence[BatchShape], y: np.ndarray, loss: str) -> float:
    pred = np.fromiter((cm.step_time(s) for s in shapes), dtype=np.float64, count=len(shapes))
    rel = (pred - y) / y
    return float(np.abs(rel).mean()) if loss == "l1" else float(math.sqrt(np.mean(rel ** 2)))


def _overrides(cm: CostModel) -> dict[str, float]:
    """The device figures `cm` uses that differ from its catalog entry."""
    from servelab.simulator.gpus import get_gpu

    catalog = get_gpu(cm.gpu.name)
    out = {}
    for name in ("bf16_tflops", "fp8_tflops", "hbm_bandwidth_gbps", "memory_gb",
                 "nvlink_gbps", "pcie_gbps"):
        value = getattr(cm.gpu, name)
        if value is not None and value != getattr(catalog, name):
            out[name] = float(value)
    return out


def with_fit_stats(result: FitResult, **stats: float) -> FitResult:
    """`result` with more figures in its profile's fit_stats (e.g. held-out errors)."""
    profile = replace(result.profile, fit_stats={**result.profile.fit_stats,
                                                 **{k: float(v) for k, v in stats.items()}})
    return replace(result, profile=profile)
