"""Fitting the cost model's free parameters to measured steps.

    result = fit_calibration(cost_model, shapes, durations)      # -> FitResult
    result.profile.save("calibration/h100-llama-3.1-8b.json")

With every op's roofline side (compute or memory) held fixed, a step's modelled time is
linear in the coefficients of `calibration.coefficients` (1/efficiency, the decode
per-sequence constant, the step overhead, seconds per collective launch):

    step_time = Σ_k coefficient_k · feature_k(shape)

so a fit is a bounded linear regression. It is solved on *relative* error (each step's
row divided by its measured duration), because the figures people read are percentage
errors and a 2 ms decode step matters as much as a 200 ms prefill. Bounds: an efficiency
may not exceed 1 (coefficient >= 1: nothing runs faster than the device's peak), the
overhead and the latency terms are >= 0. Substituting c = lower + d turns that into
non-negative least squares (`nnls`, Lawson–Hanson). The default loss is l1 — the mean
absolute relative error, i.e. the MAPE reported — by iteratively reweighted NNLS: it
follows the bulk of the steps and is not dragged by a minority slowed by something the
model does not describe (a busy host, a GC pause); "l2" (plain NNLS) fits the mean.

Which side bounds an op depends on the parameters being fitted, so the fit iterates: take
the bounds from the current parameters, solve, re-derive the bounds, until the design
matrix stops changing (it is a pure function of the bounds, so equality is exact). A
cycle or `max_iter` ends the loop at the iterate with the lowest training loss and says
so.

Identifiability. A coefficient whose feature is zero on every training step (no swaps,
tp = 1, an op never on that roofline side), or whose feature is (nearly) a combination of
features already accepted — in `FEATURE_NAMES` order, the step overhead first — cannot be
learned from these steps: it keeps its starting value and is reported with the reason.
"Nearly" is measured scale-free, on the weighted design with unit-norm columns: the part
of the column outside the span of the accepted ones must exceed `collinear_tol` of its
norm. At 1% the coefficient's standard error is ~100× what an orthogonal column would
give (variance inflation 1/tol²), so the default refuses anything closer.

Cost: one `CostModel.features` call per training step per bound iteration (tens of µs
each), then up to 50 NNLS solves of n × 12 (l1); a few bound iterations. Deterministic:
no randomness, no clock.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from servelab.outputs import BatchShape
from servelab.simulator.calibration import (
    COEFFICIENT_FIELDS, FEATURE_NAMES, CalibrationProfile, efficiencies_from_coefficients)
from servelab.simulator.cost_model import CostModel

__all__ = ["LOSSES", "FitResult", "fit_calibration", "identify", "lower_bounds", "nnls",
           "with_fit_stats"]

DEFAULT_COLLINEAR_TOL = 0.01
LOSSES = ("l1", "l2")
_IRLS_STEPS = 50
_PER_SEQ = "attn_decode.memory_per_seq"


# --------------------------------------------------------------------------- NNLS


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """argmin ||a·x − b||₂ subject to x >= 0 (Lawson & Hanson 1974, active set).

    Columns are scaled to unit norm first (a zero column gets x = 0), which makes the
    dual-feasibility tolerance scale-free. Each outer iteration frees the constraint with
    the largest gradient; the inner loop steps back along the segment to the last feasible
    point when an unconstrained solve leaves the orthant. Terminates in finitely many
    steps in exact arithmetic; in floating point, a constraint whose positive gradient is
    rounding (the freed variable's solve is not positive) ends the search, and `max_iter`
    (default 3·columns) raises RuntimeError if anything else loops.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.shape != (a.shape[0],):
        raise ValueError(f"nnls needs a 2-D matrix and a vector of its rows, got shapes "
                         f"{a.shape} and {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("nnls inputs must be finite")
    m, n = a.shape
    norms = np.linalg.norm(a, axis=0)
    usable = norms > 0
    scaled = np.zeros_like(a)
    scaled[:, usable] = a[:, usable] / norms[usable]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    limit = 3 * n if max_iter is None else max_iter
    for _ in range(limit + 1):
        w = scaled.T @ (b - scaled @ x)
        # Rounding in w grows with the size of the solution, not only of b.
        tol = 10 * np.finfo(float).eps * max(m, n) * max(1.0, float(np.abs(b).max(initial=0.0)),
                                                          float(np.abs(x).sum()))
        candidates = ~passive & usable
        if not candidates.any() or w[candidates].max() <= tol:
            break
        j = int(np.argmax(np.where(candidates, w, -np.inf)))
        passive[j] = True
        s = _passive_solve(scaled, b, passive)
        if s[j] <= 0:      # w[j] > 0 was rounding: j cannot improve the fit
            passive[j] = False
            break
        while passive.any() and s[passive].min() <= 0:
            blocking = np.flatnonzero(passive & (s <= 0))
            ratios = x[blocking] / (x[blocking] - s[blocking])
            first = blocking[int(np.argmin(ratios))]      # leaves the orthant first
            x = x + float(ratios.min()) * (s - x)
            passive &= x > tol
            passive[first] = False                         # at least one leaves per pass
            x[~passive] = 0.0
            s = _passive_solve(scaled, b, passive)
        x = s
    else:
        raise RuntimeError(f"nnls did not converge in {limit} iterations")
    out = np.zeros(n)
    out[usable] = x[usable] / norms[usable]
    return out


def _passive_solve(a: np.ndarray, b: np.ndarray, passive: np.ndarray) -> np.ndarray:
    s = np.zeros(a.shape[1])
    if passive.any():
        s[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
    return s


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
    """Lowest coefficient allowed per feature: 1 for 1/efficiency (efficiency <= 1), else 0."""
    return {name: (1.0 if name in COEFFICIENT_FIELDS and COEFFICIENT_FIELDS[name][1] == "inv"
                   else 0.0) for name in FEATURE_NAMES}


# --------------------------------------------------------------------------- the fit


@dataclass(frozen=True)
class FitResult:
    profile: CalibrationProfile
    """The fitted parameters as a profile (device, model, dtypes and tp of `cost_model`)."""
    coefficients: dict[str, float]
    """Every coefficient after the fit (fixed ones at their starting values)."""
    unidentified: dict[str, str]
    """Coefficients the training steps cannot identify -> why; they kept their start."""
    at_bound: tuple[str, ...]
    """Fitted coefficients that ended on their bound (an efficiency of exactly 1, or a
    zero overhead/latency): the data pushes past what the model allows there."""
    iterations: int
    converged: bool
    """False when the bounds cycled or max_iter was hit (the best iterate is returned)."""
    loss: str
    train_error: float
    """The training steps' mean absolute ("l1") or root-mean-square ("l2") relative error
    under the fitted model, roofline max included: what the fit minimised."""

    def cost_model(self, like: CostModel) -> CostModel:
        """`like` with the fitted parameters."""
        return like.with_calibration(self.profile)


def fit_calibration(cost_model: CostModel, shapes: Sequence[BatchShape],
                    durations: Sequence[float], *, model_name: str | None = None,
                    software: dict[str, str] | None = None, notes: str = "",
                    collinear_tol: float = DEFAULT_COLLINEAR_TOL, loss: str = "l1",
                    max_iter: int = 20) -> FitResult:
    """Fit `cost_model`'s efficiencies and step overhead to measured step `durations`.

    `cost_model` supplies the setup (model, device with any measured overrides, tp, dtypes,
    block size) and the starting parameters, which unidentifiable coefficients keep. The
    profile records the device's overrides relative to its catalog entry, `model_name`
    (default: the model's name) and `software`.
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
    current = cost_model
    seen: dict[bytes, int] = {}
    best: tuple[float, int, CostModel, dict, dict, tuple] | None = None
    converged = False
    iterations = 0
    for iterations in range(1, max_iter + 1):
        design = _design(current, shapes)
        key = design.tobytes()
        if key in seen:                 # same bounds as an earlier iterate
            converged = seen[key] == iterations - 1
            break
        seen[key] = iterations
        # Unidentified parameters keep the *starting* values, whatever earlier iterates did.
        coefs, unidentified = _solve(design, y, cost_model, lower, collinear_tol, loss)
        eff, overhead = efficiencies_from_coefficients(
            {k: v for k, v in coefs.items() if k not in unidentified},
            cost_model.efficiencies, cost_model.step_overhead_s)
        fitted = cost_model.with_efficiencies(eff, overhead)
        score = _train_error(fitted, shapes, y, loss)
        at_bound = tuple(k for k, lo in zip(FEATURE_NAMES, lower)
                         if k not in unidentified and coefs[k] <= lo * (1 + 1e-12))
        if best is None or score < best[0]:
            best = (score, iterations, fitted, coefs, unidentified, at_bound)
        current = fitted
    assert best is not None
    score, _, fitted, coefs, unidentified, at_bound = best
    iterations = len(seen)          # fits made (the last pass may only have checked)
    overrides = _overrides(cost_model)
    profile = CalibrationProfile(
        device=cost_model.gpu.name, model=model_name or cost_model.model.name,
        efficiencies=fitted.efficiencies, step_overhead_s=fitted.step_overhead_s,
        tp=cost_model.tp, weight_dtype=cost_model.weight_dtype, kv_dtype=cost_model.kv_dtype,
        software=dict(software or {}), gpu_overrides=overrides,
        fit_stats={"train_steps": float(len(y)), f"train_{loss}_rel_error": score,
                   "iterations": float(iterations)},
        notes=notes)
    return FitResult(profile, coefs, unidentified, at_bound, iterations, converged, loss, score)


def _design(cm: CostModel, shapes: Sequence[BatchShape]) -> np.ndarray:
    rows = np.empty((len(shapes), len(FEATURE_NAMES)))
    for i, shape in enumerate(shapes):
        f = cm.features(shape)
        rows[i] = [f[k] for k in FEATURE_NAMES]
    return rows


def _weighted_nnls(a: np.ndarray, b: np.ndarray, loss: str) -> np.ndarray:
    """argmin over x >= 0 of Σ|a·x − b|² ("l2") or Σ|a·x − b| ("l1", by iteratively
    reweighted least squares: weights 1/max(|r|, δ), δ = 1e-4 of a relative error, until
    the mean absolute residual stops improving by 1e-6, at most _IRLS_STEPS solves)."""
    x = nnls(a, b)
    if loss == "l2":
        return x
    best, best_cost = x, float(np.abs(a @ x - b).mean())
    for _ in range(_IRLS_STEPS):
        w = 1.0 / np.sqrt(np.maximum(np.abs(a @ x - b), 1e-4))
        x = nnls(a * w[:, None], b * w)
        cost = float(np.abs(a @ x - b).mean())
        if cost >= best_cost * (1 - 1e-6):
            break
        best, best_cost = x, cost
    return best


def _solve(design: np.ndarray, y: np.ndarray, cm: CostModel, lower: np.ndarray,
           collinear_tol: float, loss: str) -> tuple[dict[str, float], dict[str, str]]:
    """One bounded relative-error solve with the bounds of `design`; `cm` is the starting
    model, whose coefficients the unidentified ones keep."""
    start = cm.coefficients()
    x = design.copy()
    weighted = x / y[:, None]
    unidentified = identify(weighted, FEATURE_NAMES, collinear_tol)
    names = list(FEATURE_NAMES)
    mem, seq = names.index("attn_decode.memory"), names.index(_PER_SEQ)
    merged = _PER_SEQ in unidentified and "attn_decode.memory" not in unidentified
    if merged:
        # Keep the context-half *parameter* at its start, not its coefficient: the
        # per-sequence coefficient is half/eff, so it rides on the memory column.
        x[:, mem] += x[:, seq] * cm.efficiencies.attn_decode_context_half
        x[:, seq] = 0.0
    free = [j for j, k in enumerate(names) if k not in unidentified]
    fixed = [j for j, k in enumerate(names) if k in unidentified and not (merged and j == seq)]
    coef = np.array([start[k] for k in names])
    rhs = y - x[:, fixed] @ coef[fixed] - x[:, free] @ lower[free]
    d = _weighted_nnls(x[:, free] / y[:, None], rhs / y, loss)
    coef[free] = lower[free] + d
    if merged:
        coef[seq] = cm.efficiencies.attn_decode_context_half * coef[mem]
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
