"""The step-level calibration fit: identifiability and recovery of known parameters.

Steps are priced by a cost model with known per-class scales and step overhead; the fit,
started from the GPU's packaged profile (scales 1, the default overhead), must find them
again (exactly on noise-free steps, closely under noise), keep what the steps cannot
identify at its start and say why, and write a profile that prices exactly like the
fitted model.
"""
from __future__ import annotations

import numpy as np
import pytest

from servelab.outputs import BatchShape
from servelab.simulator.calibration import CalibrationProfile, resolve
from servelab.simulator.cost_model import CostModel
from servelab.simulator.gpus import get_gpu
from servelab.validation.fit import MIN_SCALE, fit_calibration, identify, lower_bounds

SCALES = {"gemm": 1.3, "attn_prefill": 0.8, "attn_decode": 1.5, "elementwise": 2.0}
OVERHEAD = 3e-3


def truth_profile(scales=SCALES, overhead=OVERHEAD, gpu="h100-sxm") -> CalibrationProfile:
    return resolve(gpu).with_fit(scales, overhead, {})


def random_shapes(n: int, seed: int = 0, kinds=("decode", "prefill", "mixed")) -> list[BatchShape]:
    """Decode, prefill and mixed steps over wide ranges of batch size and context."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        nd = 0 if kind == "prefill" else int(rng.integers(1, 256))
        ctx = nd * int(rng.integers(32, 4096))
        npf = 0 if kind == "decode" else int(rng.integers(1, 4))
        q = rng.integers(16, 1024, npf)
        c = rng.integers(0, 2048, npf)
        out.append(BatchShape(npf, int(q.sum()), int(c.sum()), int((q * c).sum()),
                              int((q * q).sum()), nd, ctx))
    return out


def measured(shapes, profile=None, noise=0.0, seed=1):
    truth = CostModel("llama-3.1-8b", "h100-sxm", calibration=profile or truth_profile())
    y = np.array([truth.step_time(s) for s in shapes])
    return y * (1 + noise * np.random.default_rng(seed).standard_normal(len(y)))


# --- identifiability -----------------------------------------------------------------------


def test_identify_names_zero_constant_and_collinear_columns():
    rng = np.random.default_rng(0)
    x = rng.random(50) + 0.5
    z = rng.random(50)
    design = np.column_stack([np.ones(50), x, np.zeros(50), 3 * np.ones(50), 2 * x + 5, z,
                              z + 1e-4 * rng.random(50)])
    names = ["overhead", "a", "b", "c", "d", "e", "f"]
    out = identify(design, names)
    assert set(out) == {"b", "c", "d", "f"}
    assert out["b"] == "zero on every training step"
    assert "indistinguishable from the step overhead" in out["c"]
    assert out["d"] == "collinear with overhead, a over the training steps"
    assert out["f"] == "collinear with e over the training steps"
    assert identify(design, names, collinear_tol=1e-7).keys() == {"b", "c", "d"}


# --- the fit -------------------------------------------------------------------------------


def test_fit_recovers_known_parameters_from_noise_free_steps():
    shapes = random_shapes(240)
    start = CostModel("llama-3.1-8b", "h100-sxm")
    result = fit_calibration(start, shapes, measured(shapes))
    assert result.train_error < 1e-12
    assert set(result.unidentified) == {"collective", "host_link"}
    for name, value in SCALES.items():
        assert result.profile.scale(name) == pytest.approx(value, rel=1e-9), name
    assert result.profile.step_overhead_s == pytest.approx(OVERHEAD, rel=1e-9)
    # what the steps cannot see keeps its starting value, exactly
    assert result.profile.scale("collective") == start.scales["collective"] == 1.0
    assert result.profile.kernels == start.kernels      # kernel parameters are not refitted


@pytest.mark.parametrize("loss", ["l1", "l2"])
def test_fit_under_noise_predicts_held_out_steps(loss):
    shapes = random_shapes(400, seed=3)
    y = measured(shapes, noise=0.05)
    result = fit_calibration(CostModel("llama-3.1-8b", "h100-sxm"), shapes[:200], y[:200],
                             loss=loss)
    fitted = result.cost_model(CostModel("llama-3.1-8b", "h100-sxm"))
    pred = np.array([fitted.step_time(s) for s in shapes[200:]])
    truth = measured(shapes[200:])
    # the model, not the noise: within 2% of the noise-free truth on unseen steps
    assert np.abs(pred / truth - 1).mean() < 0.02


def test_l1_ignores_a_minority_of_slowed_steps():
    """Steps slowed 2× by something outside the model (a busy host): the l1 fit keeps
    predicting the undisturbed steps; the l2 fit is dragged towards the slow ones."""
    shapes = random_shapes(300, seed=5)
    y = measured(shapes)
    slowed = np.random.default_rng(0).random(len(y)) < 0.25
    y_seen = np.where(slowed, 2 * y, y)
    start = CostModel("llama-3.1-8b", "h100-sxm")
    errors = {}
    for loss in ("l1", "l2"):
        fitted = fit_calibration(start, shapes, y_seen, loss=loss).cost_model(start)
        pred = np.array([fitted.step_time(s) for s in shapes])
        errors[loss] = float(np.median(np.abs(pred[~slowed] / y[~slowed] - 1)))
    assert errors["l1"] < 0.01 < errors["l2"]


def test_classes_a_workload_never_runs_keep_their_start():
    """Decode-only steps: prefill attention is zero on every step and keeps its scale."""
    rng = np.random.default_rng(0)
    shapes = [BatchShape(num_decode_seqs=int(b), decode_context_sum=int(b * c))
              for b, c in zip(rng.integers(1, 128, 80), rng.integers(64, 4096, 80))]
    start = CostModel("llama-3.1-8b", "h100-sxm")
    result = fit_calibration(start, shapes, measured(shapes))
    assert result.unidentified["attn_prefill"] == "zero on every training step"
    assert result.profile.scale("attn_prefill") == 1.0
    assert result.profile.scale("attn_decode") == pytest.approx(SCALES["attn_decode"], rel=1e-6)
    assert result.train_error < 1e-9


def test_scales_never_fall_below_their_bound():
    """Steps far faster than the kernel models allow: the fit stops at MIN_SCALE and says so."""
    shapes = random_shapes(90, seed=7, kinds=("prefill",))
    y = measured(shapes) * 0.01
    result = fit_calibration(CostModel("llama-3.1-8b", "h100-sxm"), shapes, y)
    assert "gemm" in result.at_bound
    assert result.profile.scale("gemm") == MIN_SCALE
    assert all(lo <= result.coefficients[k] for k, lo in lower_bounds().items()
               if k not in result.unidentified)


def test_fit_is_deterministic_and_its_profile_prices_like_the_fit(tmp_path):
    shapes = random_shapes(120, seed=11)
    y = measured(shapes, noise=0.03)
    start = CostModel("llama-3.1-8b", "h100-sxm")
    a = fit_calibration(start, shapes, y, software={"torch": "2.13"}, notes="test")
    b = fit_calibration(start, shapes, y, software={"torch": "2.13"}, notes="test")
    assert a.profile.to_dict() == b.profile.to_dict()
    path = a.profile.save(tmp_path / "p.json")
    loaded = CalibrationProfile.load(path)
    assert loaded == a.profile and loaded.source["software.torch"] == "2.13"
    assert loaded.model == "llama-3.1-8b" and loaded.device == "h100-sxm"
    via_file = start.with_calibration(path)
    assert [via_file.step_time(s) for s in shapes] == \
        [a.cost_model(start).step_time(s) for s in shapes]
    assert CostModel.from_calibration(path).step_time(shapes[0]) == via_file.step_time(shapes[0])


def test_fit_records_measured_device_figures():
    probed = CostModel("tiny-llama", get_gpu("cpu").with_overrides(
        bf16_tflops=0.08, hbm_bandwidth_gbps=6.0), weight_dtype="fp32", kv_dtype="fp32")
    shapes = random_shapes(60, seed=2)
    truth = probed.with_calibration(probed.profile.with_fit({"gemm": 3.0}, 0.01, {}))
    y = np.array([truth.step_time(s) for s in shapes])
    profile = fit_calibration(probed, shapes, y).profile
    assert profile.gpu_overrides == {"bf16_tflops": 0.08, "hbm_bandwidth_gbps": 6.0}
    assert (profile.device, profile.weight_dtype, profile.kv_dtype) == ("cpu", "fp32", "fp32")
    assert profile.scale("gemm") == pytest.approx(3.0, rel=1e-6)
    assert profile.step_overhead_s == pytest.approx(0.01, rel=1e-6)


@pytest.mark.parametrize("durations, message", [
    ([0.01, 0.0], r"finite and > 0; step 1 has 0\.0$"),
    ([0.01, float("nan")], "finite and > 0"),
    ([0.01], "2 shapes but 1 durations"),
])
def test_bad_fit_input_is_named(durations, message):
    with pytest.raises(ValueError, match=message):
        fit_calibration(CostModel("tiny-llama", "cpu"), random_shapes(2), durations)
    with pytest.raises(ValueError, match="loss must be one of l1, l2"):
        fit_calibration(CostModel("tiny-llama", "cpu"), random_shapes(2), [1.0, 1.0], loss="l3")
