"""How well does the cost model predict a real run's steps?

    runs = [load_real_run("runs/real-fcfs")]
    report = validate(runs, ValidateOptions(fit=True), out_dir="runs/validate")

A real run (`servelab run`) records every step's composition (the sufficient statistics
of `BatchShape`) and its measured duration in steps.csv. `validate` prices each step with
the cost model for the same model, device, dtype and tp, and reports per-step error —
MAPE, median and p90 absolute percentage error, bias (mean signed error) and the error of
the summed time — overall, by step type (decode-only, prefill-only, mixed) and by batch
tokens and context bins. With `fit`, it first calibrates the model on a seeded random
split of the steps (`fit.fit_calibration`), writes the profile, and reports the error on
the held-out steps — the only honest figure — beside the training error and the
uncalibrated model's. With `simulate`, it also replays each run's requests through the
simulator with that profile and compares request-level metrics (`replay.py`).

Everything here is deterministic given the run directories and the options; a CPU run's
device peaks come from `probe.py` only when the caller passes them in.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from servelab._validate import check_bounded
from servelab.models import ModelSpec
from servelab.outputs import BatchShape
from servelab.records import RequestRecord, StepRecord
from servelab.simulator.cost_model import CostModel

__all__ = ["RealRun", "ValidateOptions", "catalog_gpu", "error_summary", "load_real_run",
           "predict_steps", "run_cost_model", "split_steps", "step_error_report", "step_shape",
           "step_type", "validate"]

REPORT_FORMAT = "servelab.validation/1"
REAL_RUN_FORMAT = "servelab.real/1"
STEP_TYPES = ("decode", "prefill", "mixed", "other")
BATCH_TOKEN_EDGES = (1, 2, 8, 32, 128, 512, 2048, 8192)
"""Left edges of the batch-token bins: 1, 2–7, 8–31, ..., 8192+ tokens in the step."""
CONTEXT_EDGES = (0, 256, 1024, 4096, 16384, 65536)
"""Left edges of the context bins, in KV tokens the step's attention reads."""
_TORCH_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


# --------------------------------------------------------------------------- real runs


@dataclass(frozen=True)
class RealRun:
    """A `servelab run` directory, read and checked."""

    path: Path
    config: dict
    """config.json's "config": the settings as given."""
    derived: dict
    """config.json's "derived": device, dtype, cache, versions, ..."""
    model: ModelSpec
    steps: list[StepRecord]
    requests: list[RequestRecord]
    summary: dict

    @property
    def device(self) -> str:
        return self.derived["device"]

    @property
    def device_name(self) -> str | None:
        return (self.derived.get("versions") or {}).get("device_name")

    @property
    def dtype(self) -> str:
        """The cost model's name for the run's dtype (fp32, bf16, fp16)."""
        return _TORCH_DTYPES[self.derived["dtype"]]

    @property
    def policy(self) -> str:
        return self.config["policy"]

    @property
    def software(self) -> dict[str, str]:
        versions = self.derived.get("versions") or {}
        return {k: str(v) for k, v in versions.items() if v is not None}


def load_real_run(path: str | Path) -> RealRun:
    """Read a real run directory; ValueError names the file and what is wrong."""
    from servelab.reports.runio import read_json, read_requests, read_steps, table_file

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"run directory {path} does not exist")
    if (path / "vllm_meta.json").is_file() and not any(
            (path / f).is_file() for f in ("steps.csv", "steps.parquet")):
        raise ValueError(f"{path} is a recorded vLLM run (vllm_meta.json), not a `servelab run` "
                         f"directory: replay it with --real-requests {path}")
    for name in ("config.json", "steps.csv", "requests.csv", "summary.json"):
        files = [name] if name.endswith(".json") else [name, name.replace(".csv", ".parquet")]
        if not any((path / f).is_file() for f in files):
            raise ValueError(f"{path} is not a run directory: {' or '.join(files)} is missing")
    doc = read_json(path / "config.json")
    fmt = doc.get("format") if isinstance(doc, dict) else None
    if fmt != REAL_RUN_FORMAT:
        hint = " (a simulated run: validate compares a real run, `servelab run`, with the " \
               "cost model)" if fmt == "servelab.simulation/1" else ""
        raise ValueError(f"{path / 'config.json'}: format {fmt!r} is not {REAL_RUN_FORMAT!r}{hint}")
    config, derived = doc.get("config"), doc.get("derived")
    try:
        model = ModelSpec.from_hf_config(derived["hf_config"], name=derived["model"]["name"])
        if derived["dtype"] not in _TORCH_DTYPES:
            raise ValueError(f"dtype {derived['dtype']!r} is not one of {', '.join(_TORCH_DTYPES)}")
        missing = [name for name, present in (
            ("derived.device", "device" in derived), ("config.policy", "policy" in config),
            ("config.scheduler", "scheduler" in config),
            ("derived.cache.block_size", "block_size" in derived.get("cache", {}))) if not present]
        if missing:
            raise ValueError(f"missing field(s) {', '.join(missing)}")
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path / 'config.json'}: missing or malformed field {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{path / 'config.json'}: {exc}") from None
    steps = read_steps(path)
    if not steps:
        raise ValueError(f"{table_file(path, 'steps')} holds no steps")
    return RealRun(path, config, derived, model, steps, read_requests(path),
                   read_json(path / "summary.json"))


def catalog_gpu(device: str, device_name: str | None) -> str:
    """The catalog entry for a torch device ("cpu", "cuda:0") and its reported name."""
    if device.split(":")[0] == "cpu":
        return "cpu"
    from servelab.simulator.gpus import gpu_for_device_name

    name = gpu_for_device_name(device_name) if device_name else None
    if name is not None:
        return name
    raise ValueError(f"cannot map device {device!r} ({device_name!r}) to a catalog GPU; "
                     f"pass --gpu with one of the catalog's names")


def run_cost_model(run: RealRun, gpu: str | None = None,
                   gpu_overrides: dict[str, float] | None = None) -> CostModel:
    """The cost model of `run`'s setup: its model, dtype, block size, tp 1 (the real
    backend runs on one device), on `gpu` (default: mapped from the run's device)."""
    from servelab.simulator.gpus import get_gpu

    spec = get_gpu(gpu or catalog_gpu(run.device, run.device_name))
    if gpu_overrides:
        spec = spec.with_overrides(**gpu_overrides)
    return CostModel(run.model, spec, tp=1, weight_dtype=run.dtype, kv_dtype=run.dtype,
                     block_size=run.derived["cache"]["block_size"])


# --------------------------------------------------------------------------- steps


def step_shape(step: StepRecord) -> BatchShape:
    """The composition a steps.csv row records (each decode sequence computes one token)."""
    return BatchShape(step.num_prefill_seqs, step.num_prefill_tokens, step.prefill_context_sum,
                      step.prefill_q_context_sum, step.prefill_q_sq_sum, step.num_decode_tokens,
                      step.decode_context_sum, step.num_swap_blocks, step.num_copy_blocks)


def step_type(shape: BatchShape) -> str:
    if shape.num_prefill_tokens and shape.num_decode_seqs:
        return "mixed"
    if shape.num_prefill_tokens:
        return "prefill"
    return "decode" if shape.num_decode_seqs else "other"


def context_tokens(shape: BatchShape) -> int:
    """KV tokens the step's attention reads: cached context plus the chunks themselves."""
    return shape.prefill_context_sum + shape.num_prefill_tokens + shape.decode_context_sum


def predict_steps(cost: CostModel, steps: Sequence[StepRecord]) -> np.ndarray:
    """Modelled seconds of each record (a fast-forwarded record: its whole run)."""
    out = np.empty(len(steps))
    for i, step in enumerate(steps):
        shape = step_shape(step)
        out[i] = cost.step_time(shape) if step.num_steps == 1 else \
            cost.decode_run_duration(shape, step.num_steps)[0]
    return out


def split_steps(n: int, train_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) step indices: a seeded permutation, the first round(f·n) for training,
    each part sorted. Both parts are non-empty."""
    if not 0 < train_fraction < 1:
        raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction!r}")
    if n < 2:
        raise ValueError(f"need at least 2 steps to split into training and held-out, got {n}")
    order = np.random.default_rng(seed).permutation(n)
    k = min(n - 1, max(1, round(train_fraction * n)))
    return np.sort(order[:k]), np.sort(order[k:])


# --------------------------------------------------------------------------- error figures


def error_summary(predicted: np.ndarray, measured: np.ndarray) -> dict[str, float]:
    """Percentage errors of predicted vs measured seconds (signed: positive = too slow)."""
    predicted, measured = np.asarray(predicted, float), np.asarray(measured, float)
    if len(predicted) == 0:
        return {"steps": 0}
    signed = (predicted - measured) / measured * 100
    ape = np.abs(signed)
    return {"steps": int(len(measured)), "mape_pct": float(ape.mean()),
            "median_ape_pct": float(np.median(ape)), "p90_ape_pct": float(np.percentile(ape, 90)),
            "bias_pct": float(signed.mean()),
            "total_time_error_pct": float((predicted.sum() / measured.sum() - 1) * 100)}


def _bin_label(value: int, edges: Sequence[int]) -> str:
    i = int(np.searchsorted(edges, value, side="right")) - 1
    lo = edges[max(i, 0)]
    if i + 1 >= len(edges):
        return f"{lo}+"
    hi = edges[i + 1] - 1
    return str(lo) if hi == lo else f"{lo}-{hi}"


def step_error_report(predicted: np.ndarray, measured: np.ndarray,
                      shapes: Sequence[BatchShape]) -> dict[str, Any]:
    """`error_summary` overall, by step type, by batch tokens and by context (empty bins
    left out; bins in increasing order)."""
    predicted, measured = np.asarray(predicted, float), np.asarray(measured, float)
    kinds = np.array([step_type(s) for s in shapes])
    tokens = np.array([s.num_tokens for s in shapes])
    context = np.array([context_tokens(s) for s in shapes])

    def grouped(labels: np.ndarray, order: Sequence[str]) -> dict[str, dict]:
        return {k: error_summary(predicted[labels == k], measured[labels == k])
                for k in order if (labels == k).any()}

    token_bins = [_bin_label(e, BATCH_TOKEN_EDGES) for e in BATCH_TOKEN_EDGES]
    context_bins = [_bin_label(e, CONTEXT_EDGES) for e in CONTEXT_EDGES]
    return {"overall": error_summary(predicted, measured),
            "by_step_type": grouped(kinds, STEP_TYPES),
            "by_batch_tokens": grouped(np.array([_bin_label(t, BATCH_TOKEN_EDGES) for t in tokens]),
                                       token_bins),
            "by_context_tokens": grouped(np.array([_bin_label(c, CONTEXT_EDGES) for c in context]),
                                         context_bins)}


# --------------------------------------------------------------------------- the command


@dataclass(frozen=True)
class ValidateOptions:
    gpu: str | None = None
    """Catalog GPU to price with; None maps the runs' device (`catalog_gpu`)."""
    gpu_overrides: dict[str, float] = field(default_factory=dict)
    """Measured device figures (a CPU probe's), used by the fit and recorded in its profile."""
    calibration: str | None = None
    """A profile to evaluate (or to start the fit from); None: the GPU's default profile."""
    fit: bool = False
    train_fraction: float = 0.5
    split_seed: int = 0
    collinear_tol: float = 0.01
    loss: str = "l1"
    """What the fit minimises over relative step errors: "l1" (mean absolute: the MAPE
    reported, and robust to steps slowed by something outside the model — a busy host,
    a GC pause) or "l2" (mean square: tracks the mean, outliers included)."""
    simulate: bool = False
    plots: bool = True
    max_mape_pct: float = 15.0
    """Above this step MAPE (held-out with a fit) the report warns: the model does not
    describe these steps."""
    max_total_error_pct: float = 10.0
    """Above this error in the summed step time (or in a replay's throughput) it warns."""
    max_same_shape_spread: float = 2.0
    """Steps of one composition whose durations vary more than this ratio (slowest /
    fastest) point at a disturbed machine; above it the report warns."""

    def __post_init__(self) -> None:
        from servelab.validation.fit import LOSSES

        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if not 0 < self.collinear_tol < 1:
            raise ValueError(f"collinear_tol must be in (0, 1), got {self.collinear_tol!r}")
        if not 0 < self.train_fraction < 1:
            raise ValueError(f"train_fraction must be in (0, 1), got {self.train_fraction!r}")
        check_bounded("split_seed", self.split_seed, 0, integer=True, noun="an integer")
        if self.simulate and not (self.fit or self.calibration):
            raise ValueError("simulate needs a calibration: fit one (--fit) or pass a profile "
                             "(--calibration FILE)")
        for name in ("max_mape_pct", "max_total_error_pct"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.max_same_shape_spread > 1:
            raise ValueError(f"max_same_shape_spread must be > 1, got {self.max_same_shape_spread!r}")


EARLIER_OUTPUTS = ("validation.json", "calibration.json", "step_pred_vs_measured.png",
                   "step_error_hist.png", "step_error_vs_tokens.png")
"""What a validation writes into its directory, beside `replay/`: an earlier one's are
removed first, so that no file describes runs or options the new report does not."""


def _clear_earlier_report(out: Path) -> None:
    import shutil

    for name in EARLIER_OUTPUTS:
        (out / name).unlink(missing_ok=True)
    if (out / "replay").is_dir():
        shutil.rmtree(out / "replay")


def validate(runs: Sequence[RealRun], options: ValidateOptions,
             out_dir: str | Path | None = None) -> dict[str, Any]:
    """Per-step validation of `runs` (one setup), optionally fitted and replayed; returns
    the report and, with out_dir, writes validation.json there (plus calibration.json,
    the plots and the replay run directories as asked)."""
    if not runs:
        raise ValueError("no runs to validate")
    if options.simulate and out_dir is None:
        raise ValueError("simulate writes replay run directories: give an out_dir")
    speculative = [r for r in runs if r.config["scheduler"].get("speculative", {}).get("method")]
    if options.fit and speculative:
        raise ValueError(f"{speculative[0].path} is a speculative run: its steps.csv records a step by "
                         "its sequences, not the K + 1-token verifies and proposals it ran, so a fit "
                         "would take that work for plain decodes. Fit on a run without speculation "
                         "(--fit) and replay this one with --calibration FILE --simulate")
    base = _common_cost_model(runs, options)
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        _clear_earlier_report(out)
    steps = [s for run in runs for s in run.steps]
    shapes = [step_shape(s) for s in steps]
    measured = np.array([s.duration_s for s in steps])
    start = base.with_calibration(options.calibration) if options.calibration else base
    start_name = "starting" if options.calibration else "default"
    report: dict[str, Any] = {
        "format": REPORT_FORMAT,
        "runs": [str(r.path) for r in runs],
        "setup": {"model": base.model.name, "gpu": base.gpu.name, "tp": base.tp,
                  "dtype": base.weight_dtype, "block_size": base.block_size,
                  "gpu_overrides": dict(options.gpu_overrides),
                  "calibration": options.calibration},
        "steps": len(steps),
    }
    if options.fit:
        final, shown = _fit(report, runs, start, base, shapes, measured, options, out)
        profile_path = report["fit"].get("profile_path")
    else:
        final, shown = start, np.arange(len(steps))
        report[start_name] = step_error_report(predict_steps(start, steps), measured, shapes)
        profile_path = options.calibration
    report["per_run"] = {
        str(run.path): error_summary(predict_steps(final, run.steps),
                                     np.array([s.duration_s for s in run.steps]))
        for run in runs}
    if options.simulate:
        from servelab.validation.replay import compare_runs

        report["simulate"] = compare_runs(runs, profile_path, base.gpu.name, out / "replay")
    if out is not None and options.plots:
        from servelab.reports.validation_plots import plot_step_errors

        label = "held-out steps, calibrated" if options.fit else f"all steps, {start_name} model"
        report["plots"] = plot_step_errors(
            predict_steps(final, [steps[i] for i in shown]), measured[shown],
            [step_type(shapes[i]) for i in shown], [shapes[i].num_tokens for i in shown], out,
            title=f"{base.model.name} on {base.gpu.name} ({label})")
    from servelab.validation.verdict import verdict

    report["verdict"] = verdict(report, shapes, measured, options)
    if out is not None:
        from servelab.reports.runio import write_json

        write_json(out / "validation.json", report)
    return report


def _fit(report: dict, runs: Sequence[RealRun], start: CostModel, base: CostModel,
         shapes: list[BatchShape], measured: np.ndarray, options: ValidateOptions,
         out: Path | None) -> tuple[CostModel, np.ndarray]:
    """Fit on the training split; fill report's fit, held_out, train and <start>_held_out
    sections; save the profile into out. Returns (fitted model, held-out indices)."""
    from servelab.validation.fit import fit_calibration, with_fit_stats

    steps = [s for run in runs for s in run.steps]
    if any(s.num_steps != 1 for s in steps):
        raise ValueError("fitting needs one record per step; these runs hold fast-forwarded "
                         "records (num_steps > 1)")
    train, test = split_steps(len(steps), options.train_fraction, options.split_seed)
    result = fit_calibration(
        start, [shapes[i] for i in train], measured[train], software=runs[0].software,
        collinear_tol=options.collinear_tol, loss=options.loss,
        notes=f"servelab validate --fit on {len(train)} of {len(steps)} steps of "
              f"{', '.join(r.path.name for r in runs)} (train fraction "
              f"{options.train_fraction}, split seed {options.split_seed}, loss {options.loss})")
    fitted = result.cost_model(base)
    predicted = predict_steps(fitted, steps)

    def errors(idx: np.ndarray, pred: np.ndarray) -> dict:
        return step_error_report(pred[idx], measured[idx], [shapes[i] for i in idx])

    held_out = errors(test, predicted)
    result = with_fit_stats(result, test_steps=len(test),
                            test_mape_pct=held_out["overall"]["mape_pct"],
                            test_median_ape_pct=held_out["overall"]["median_ape_pct"],
                            test_p90_ape_pct=held_out["overall"]["p90_ape_pct"])
    report["fit"] = {
        "train_fraction": options.train_fraction, "split_seed": options.split_seed,
        "loss": options.loss, "train_steps": len(train), "test_steps": len(test),
        "unidentified": result.unidentified, "at_bound": list(result.at_bound),
        "coefficients": result.coefficients, "profile": result.profile.to_dict()}
    report["held_out"] = held_out
    report["train"] = errors(train, predicted)
    start_name = "starting" if options.calibration else "default"
    report[f"{start_name}_held_out"] = errors(test, predict_steps(start, steps))
    if out is not None:
        report["fit"]["profile_path"] = str(result.profile.save(out / "calibration.json"))
    return fitted, test


def _common_cost_model(runs: Sequence[RealRun], options: ValidateOptions) -> CostModel:
    """The one setup every run shares (model, dtype, device, block size), or ValueError."""
    first = runs[0]
    gpu = options.gpu or catalog_gpu(first.device, first.device_name)
    for run in runs[1:]:
        theirs = options.gpu or catalog_gpu(run.device, run.device_name)
        mismatch = [what for what, a, b in (
            ("model", first.model, run.model), ("dtype", first.dtype, run.dtype),
            ("device", gpu, theirs),
            ("block size", first.derived["cache"]["block_size"], run.derived["cache"]["block_size"]))
            if a != b]
        if mismatch:
            raise ValueError(f"runs {first.path} and {run.path} differ in {', '.join(mismatch)}: "
                             f"validate one setup at a time")
    return run_cost_model(first, gpu, options.gpu_overrides)
