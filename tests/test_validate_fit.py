"""The calibration fit: NNLS, identifiability, and recovery of known parameters.

Steps are priced by a cost model with known efficiencies and overhead; the fit, started
from the published defaults, must find those parameters again (exactly on noise-free
steps, closely under noise), keep what the steps cannot identify at its start and say
why, and write a profile that prices exactly like the fitted model.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.outputs import BatchShape
from servelab.simulator.calibration import CalibrationProfile, Efficiencies
from servelab.simulator.cost_model import CostModel
from servelab.validation.fit import fit_calibration, identify, lower_bounds, nnls
from servelab.simulator.gpus import get_gpu

TRUTH = Efficiencies(gemm_compute=0.62, gemm_memory=0.71, attn_prefill_compute=0.5,
                     attn_prefill_memory=0.6, attn_decode_compute=0.3, attn_decode_memory=0.66,
                     attn_decode_context_half=512.0, elementwise_memory=0.55)
OVERHEAD = 3e-3


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


def measured(shapes, efficiencies=TRUTH, overhead=OVERHEAD, noise=0.0, seed=1):
    truth = CostModel("llama-3.1-8b", "h100-sxm", efficiencies=efficiencies,
                      step_overhead_s=overhead)
    y = np.array([truth.step_time(s) for s in shapes])
    return y * (1 + noise * np.random.default_rng(seed).standard_normal(len(y)))


# --- NNLS ----------------------------------------------------------------------------------


def brute_force_nnls(a, b):
    """The NNLS optimum by enumerating supports: the best feasible unconstrained solve."""
    n = a.shape[1]
    best, best_x = math.inf, np.zeros(n)
    for k in range(n + 1):
        for support in itertools.combinations(range(n), k):
            x = np.zeros(n)
            if support:
                x[list(support)] = np.linalg.lstsq(a[:, support], b, rcond=None)[0]
            if (x >= -1e-12).all():
                cost = float(np.sum((a @ np.maximum(x, 0) - b) ** 2))
                if cost < best - 1e-12:
                    best, best_x = cost, np.maximum(x, 0)
    return best_x, best


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 12), cols=st.integers(1, 5))
def test_nnls_reaches_the_brute_force_optimum(seed, rows, cols):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((rows, cols)) * rng.choice([1e-3, 1.0, 1e3], cols)  # bad scaling
    b = rng.standard_normal(rows)
    x = nnls(a, b)
    _, best = brute_force_nnls(a, b)
    assert (x >= 0).all()
    assert np.sum((a @ x - b) ** 2) <= best * (1 + 1e-9) + 1e-12
    # KKT, scale-free: zero gradient on the support, none pointing inwards elsewhere
    scale = np.linalg.norm(a, axis=0) * max(float(np.linalg.norm(b)), 1e-300)
    grad = a.T @ (a @ x - b) / np.where(scale > 0, scale, 1.0)
    assert (np.abs(grad[x > 0]) < 1e-6).all() and (grad[x == 0] > -1e-6).all()


def test_nnls_exact_and_degenerate_cases():
    a = np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    assert np.allclose(nnls(a, a @ np.array([3.0, 0.5])), [3.0, 0.5])
    # b = 3·a0 − 0.5·a1: the best non-negative fit drops a1 and projects b on a0 alone
    assert np.allclose(nnls(a, a @ np.array([3.0, -0.5])), [2.75, 0.0])
    assert nnls(np.zeros((3, 2)), np.ones(3)).tolist() == [0.0, 0.0]
    assert nnls(a, -np.ones(3)).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="finite"):
        nnls(a, np.array([1.0, np.nan, 0.0]))
    with pytest.raises(ValueError, match="2-D matrix"):
        nnls(a, np.ones(2))


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
    assert result.converged and result.train_error < 1e-12
    assert set(result.unidentified) == {"attn_decode.compute", "collective.link",
                                        "collective.latency", "swap.link"}
    eff = result.profile.efficiencies
    for name in ("gemm_compute", "gemm_memory", "attn_prefill_compute", "attn_prefill_memory",
                 "attn_decode_memory", "attn_decode_context_half", "elementwise_memory"):
        assert getattr(eff, name) == pytest.approx(getattr(TRUTH, name), rel=1e-9), name
    assert result.profile.step_overhead_s == pytest.approx(OVERHEAD, rel=1e-9)
    # what the steps cannot see keeps its starting value, exactly
    for name in ("attn_decode_compute", "collective_link", "collective_latency_s", "swap_link"):
        assert getattr(eff, name) == getattr(start.efficiencies, name)


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


def test_constant_per_sequence_term_keeps_the_context_half_parameter():
    """Decode steps all of 32 sequences: the per-sequence decode cost is indistinguishable
    from the overhead, so attn_decode_context_half keeps its start (not its coefficient)."""
    rng = np.random.default_rng(0)
    shapes = [BatchShape(num_decode_seqs=32, decode_context_sum=int(c))
              for c in rng.integers(32 * 64, 32 * 4096, 80)]
    start = CostModel("llama-3.1-8b", "h100-sxm")
    result = fit_calibration(start, shapes, measured(shapes))
    assert "indistinguishable from the step overhead" in result.unidentified[
        "attn_decode.memory_per_seq"]
    assert "attn_prefill.compute" in result.unidentified
    assert result.profile.efficiencies.attn_decode_context_half == \
        start.efficiencies.attn_decode_context_half
    assert result.train_error < 0.01


def test_efficiencies_never_exceed_one():
    """Steps faster than the device's peaks allow: the fit stops at efficiency 1 and says so."""
    shapes = random_shapes(90, seed=7, kinds=("prefill",))
    y = measured(shapes) * 0.2
    result = fit_calibration(CostModel("llama-3.1-8b", "h100-sxm"), shapes, y)
    assert "gemm.compute" in result.at_bound
    assert result.profile.efficiencies.gemm_compute == 1.0
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
    assert loaded == a.profile and loaded.software == {"torch": "2.13"}
    via_file = start.with_calibration(path)
    assert [via_file.step_time(s) for s in shapes] == \
        [a.cost_model(start).step_time(s) for s in shapes]
    assert CostModel.from_calibration(path).step_time(shapes[0]) == via_file.step_time(shapes[0])


def test_fit_records_measured_device_figures():
    probed = CostModel("tiny-llama", get_gpu("cpu").with_overrides(
        bf16_tflops=0.08, hbm_bandwidth_gbps=6.0), weight_dtype="fp32", kv_dtype="fp32")
    shapes = random_shapes(60, seed=2)
    y = np.array([probed.with_efficiencies(TRUTH, 0.01).step_time(s) for s in shapes])
    profile = fit_calibration(probed, shapes, y).profile
    assert profile.gpu_overrides == {"bf16_tflops": 0.08, "hbm_bandwidth_gbps": 6.0}
    assert (profile.device, profile.weight_dtype, profile.kv_dtype) == ("cpu", "fp32", "fp32")
    # elementwise traffic is collinear with the GEMMs for this model (kept at its start),
    # so the overhead absorbs a sliver of it
    assert profile.step_overhead_s == pytest.approx(0.01, rel=1e-3)


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
