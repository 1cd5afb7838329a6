"""The verdict of a validation: the figures a reader must see first, and plain-words
warnings when they say the cost model does not describe the runs — or the runs do not
describe the machine (steps of one composition whose durations vary far more than a quiet
GPU allows)."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from servelab.outputs import BatchShape
from servelab.validation.validate import ValidateOptions


def same_shape_spread(shapes: Sequence[BatchShape], measured: np.ndarray) -> dict[str, Any]:
    """Steps of identical composition should take the same time on a quiet machine: the
    compositions seen more than once, and the largest slowest/fastest ratio among them."""
    groups: dict[tuple, list[float]] = {}
    for shape, t in zip(shapes, measured):
        key = tuple(getattr(shape, f) for f in BatchShape.__slots__)
        groups.setdefault(key, []).append(float(t))
    repeated = {k: v for k, v in groups.items() if len(v) > 1}
    if not repeated:
        return {"repeated_shapes": 0, "worst_ratio": None}
    ratios = {k: max(v) / min(v) for k, v in repeated.items()}
    worst = max(ratios, key=ratios.get)
    return {"repeated_shapes": len(repeated), "worst_ratio": ratios[worst],
            "worst_shape": dict(zip(BatchShape.__slots__, worst)),
            "ratios_above_2x": sum(r > 2 for r in ratios.values())}


def verdict(report: dict, shapes: Sequence[BatchShape], measured: np.ndarray,
            options: ValidateOptions) -> dict[str, Any]:
    """The figures a reader must see first, and warnings in plain words when they say the
    model does not describe these runs (or the runs do not describe the machine)."""
    key = "held_out" if "held_out" in report else ("starting" if options.calibration else "default")
    overall = report[key]["overall"]
    out: dict[str, Any] = {"steps_judged": key, "step_mape_pct": overall["mape_pct"],
                           "total_time_error_pct": overall["total_time_error_pct"],
                           "warnings": []}
    warn = out["warnings"].append
    which = "held-out " if key == "held_out" else ""
    if overall["mape_pct"] > options.max_mape_pct:
        warn(f"{which}step MAPE is {overall['mape_pct']:.1f}% (above {options.max_mape_pct:g}%): "
             f"the cost model does not describe these steps")
    if abs(overall["total_time_error_pct"]) > options.max_total_error_pct:
        warn(f"summed step time is off by {overall['total_time_error_pct']:+.1f}% (beyond "
             f"±{options.max_total_error_pct:g}%): simulated runs will be "
             f"{'slower' if overall['total_time_error_pct'] > 0 else 'faster'} than these")
    spread = same_shape_spread(shapes, measured)
    out["same_shape"] = spread
    if spread["worst_ratio"] is not None and spread["worst_ratio"] > options.max_same_shape_spread:
        warn(f"{spread['ratios_above_2x']} of {spread['repeated_shapes']} repeated step "
             f"compositions vary by more than {options.max_same_shape_spread:g}x (worst "
             f"{spread['worst_ratio']:.1f}x): the machine was disturbed while measuring; "
             f"rerun on a quiet one before trusting a fit")
    sim = report.get("simulate")
    if sim:
        errors = {}
        for label, run in sim["runs"].items():
            tput = run["metrics"]["output_throughput"]
            if tput["real"]:
                errors[label] = (tput["sim"] / tput["real"] - 1) * 100
        out["replay_throughput_error_pct"] = errors
        for label, err in errors.items():
            if abs(err) > options.max_total_error_pct:
                warn(f"replay of {label}: simulated output throughput is off by {err:+.1f}% "
                     f"(beyond ±{options.max_total_error_pct:g}%)")
    return out
