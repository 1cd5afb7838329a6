"""Plots of a cost model's per-step error against measured steps (`servelab validate`).

    plot_step_errors(predicted_s, measured_s, kinds, batch_tokens, out_dir, title=...)

Three PNGs, each answering one question a reader asks of a step-time model:

- step_pred_vs_measured.png — is it right across the range? Predicted against measured
  seconds on log–log axes, coloured by step type, with the y = x line and ±20% bands.
- step_error_hist.png — how large and how biased is the error? A histogram of the signed
  percentage error, median marked.
- step_error_vs_tokens.png — where does it break? Signed error against batch tokens (log x).

Uses matplotlib's object API (no pyplot state), so concurrent calls do not interfere.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = ["plot_step_errors"]

_COLOURS = {"decode": "#1f77b4", "prefill": "#d62728", "mixed": "#2ca02c", "other": "#7f7f7f"}


def plot_step_errors(predicted_s: Sequence[float], measured_s: Sequence[float],
                     kinds: Sequence[str], batch_tokens: Sequence[int], out_dir: str | Path,
                     title: str = "") -> list[str]:
    """Write the three plots into out_dir; returns their file names."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    pred = np.asarray(predicted_s, dtype=float)
    meas = np.asarray(measured_s, dtype=float)
    kinds = np.asarray(kinds)
    tokens = np.asarray(batch_tokens, dtype=float)
    if not (len(pred) == len(meas) == len(kinds) == len(tokens)):
        raise ValueError("predicted, measured, kinds and batch_tokens must be equally long")
    if len(pred) == 0:
        raise ValueError("no steps to plot")
    if not ((pred > 0).all() and (meas > 0).all()):
        raise ValueError("step times must be > 0 to plot on log axes")
    out = Path(out_dir)
    err = (pred - meas) / meas * 100
    present = [k for k in _COLOURS if (kinds == k).any()]
    names = []

    fig = Figure(figsize=(5.5, 5))
    ax = fig.subplots()
    lo, hi = min(pred.min(), meas.min()) / 1.2, max(pred.max(), meas.max()) * 1.2
    line = np.geomspace(lo, hi, 50)
    ax.fill_between(line * 1e3, line * 0.8e3, line * 1.2e3, color="0.9", label="±20%")
    ax.plot(line * 1e3, line * 1e3, color="0.4", lw=1, label="y = x")
    for k in present:
        m = kinds == k
        ax.scatter(meas[m] * 1e3, pred[m] * 1e3, s=12, alpha=0.7, color=_COLOURS[k],
                   label=f"{k} ({m.sum()})")
    ax.set(xscale="log", yscale="log", xlabel="measured step time (ms)",
           ylabel="predicted step time (ms)", title=title or "predicted vs measured")
    for axis in (ax.xaxis, ax.yaxis):       # 20 and 50 read better than 2×10¹, 5×10¹
        axis.set_major_formatter(FuncFormatter(_plain))
        axis.set_minor_formatter(FuncFormatter(_plain_minor))
    ax.legend(fontsize=8, loc="upper left")
    names.append(_save(fig, out, "step_pred_vs_measured.png"))

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    ax.hist([err[kinds == k] for k in present], bins=30, stacked=True,
            color=[_COLOURS[k] for k in present], label=present)
    med = float(np.median(err))
    ax.axvline(med, color="k", lw=1, ls="--", label=f"signed median {med:+.1f}%")
    ax.axvline(0, color="0.5", lw=0.8)
    ax.set(xlabel="step-time error (%)  [(predicted − measured) / measured]",
           ylabel="steps", title=f"{title}\nMAPE {np.abs(err).mean():.1f}%" if title
           else f"MAPE {np.abs(err).mean():.1f}%")
    ax.legend(fontsize=8)
    names.append(_save(fig, out, "step_error_hist.png"))

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for k in present:
        m = kinds == k
        ax.scatter(tokens[m], err[m], s=12, alpha=0.7, color=_COLOURS[k], label=k)
    ax.axhline(0, color="0.5", lw=0.8)
    ax.set(xscale="log", xlabel="batch tokens (prefill chunk tokens + decode sequences)",
           ylabel="step-time error (%)", title=title or "error vs batch tokens")
    ax.xaxis.set_major_formatter(FuncFormatter(_plain))
    ax.legend(fontsize=8)
    names.append(_save(fig, out, "step_error_vs_tokens.png"))
    return names


def _plain(value: float, _pos=None) -> str:
    return f"{value:g}"


def _plain_minor(value: float, _pos=None) -> str:
    """Label the 2× and 5× minor ticks of a decade only: enough to read, not crowded."""
    mantissa = value / 10 ** np.floor(np.log10(value)) if value > 0 else 0
    return f"{value:g}" if round(mantissa) in (2, 5) and abs(mantissa - round(mantissa)) < 1e-6 else ""


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    return name
