"""The whole validation loop on a real CPU run: serve, fit on half the steps, predict the rest.

A 4-layer, hidden-256 Llama (seeded random weights, fp32, torch on one thread) serves ~30
requests of a synthetic trace with chunked prefill (64-token chunks, a 128-token budget),
so steps range from one decode token to mixed batches of 100+ tokens. The CPU's peaks
come from `probe_cpu`; `validate` fits the cost model on a seeded half of the steps (l1,
the MAPE it reports) and predicts the other half.

Threshold, from measurements on this shared 2-core VM (other helpers' test suites
running, load average 1.5–4.7), 16 rounds × trace seeds 0, 1, 2 = 48 runs of exactly
this test's procedure (5 rounds with a busy loop of ours added on top):

- quiet stretches: held-out MAPE 3.4–11% (p90 6–27%); within such a run every step sits
  within ±8% of the fitted model — the model and the fit are good;
- stretches where another process shares our core or its caches: runs of consecutive
  steps take 1.3–2× longer, which no per-step model can predict; held-out MAPE then
  13–44.5%, with the training MAPE as high (noise, not overfitting).
  Over all 48: median 16%, max 44.5%.

So the bound is 60% MAPE (1.35× the worst of 48), and two relative checks carry the
discrimination a noisy absolute bound cannot: the calibrated model's held-out MAPE is
below 0.8× the uncalibrated model's (measured ratio 0.05–0.61; the catalog cpu entry with
its 1 ms overhead misses by 49–90%), and below 2× its own training MAPE + 5 points
(measured held/train ratio 0.68–1.55, closest margin 6.6 points): the fit generalises to
steps it has not seen. On a dedicated machine expect the quiet figures
(docs/validation.md).

Runtime: the run is ~3 s of model work (up to ~30 s when the machine is busy), the probe
~0.4 s, the fit ~0.3 s.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from servelab.backends.run import RealRunConfig, run_real
from servelab.cli import main
from servelab.config import SchedulerConfig
from servelab.simulator.calibration import CalibrationProfile
from servelab.validation.probe import probe_cpu
from servelab.validation.validate import (ValidateOptions, error_summary, load_real_run,
                                         predict_steps, run_cost_model, split_steps, validate)
from servelab.traces.distributions import Uniform
from servelab.traces.synthetic import TenantSpec, WorkloadSpec, generate

SMALL_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512,
                   hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0)
MAX_HELD_OUT_MAPE = 60.0
MAX_RATIO_TO_UNCALIBRATED = 0.8


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpu-run")
    (root / "small-llama").mkdir()
    (root / "small-llama" / "config.json").write_text(json.dumps(SMALL_LLAMA))
    workload = WorkloadSpec((TenantSpec("a", 20.0, Uniform(16, 256), Uniform(4, 48)),),
                            duration_s=1.5)
    config = RealRunConfig(
        model=str(root / "small-llama"), device="cpu", dtype="float32",
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=128,
                                  chunked_prefill=64, max_model_len=512),
        cache={"block_size": 16, "num_gpu_blocks": 256}, trace=generate(workload, seed=0),
        seed=0, progress=False)
    run_real(config, root / "run")
    return root


def test_fitted_model_predicts_held_out_steps(cpu_run):
    run = load_real_run(cpu_run / "run")
    kinds = {(s.num_prefill_tokens > 0, s.num_decode_tokens > 0) for s in run.steps}
    assert kinds == {(True, False), (False, True), (True, True)}   # all three step types
    probe = probe_cpu(dtype="float32")
    report = validate([run], ValidateOptions(fit=True, gpu_overrides=probe.gpu_overrides(),
                                             plots=False), cpu_run / "val")
    held, train = report["held_out"]["overall"], report["train"]["overall"]
    uncalibrated = report["default_held_out"]["overall"]
    summary = (f"held-out MAPE {held['mape_pct']:.1f}% (train {train['mape_pct']:.1f}%, "
               f"uncalibrated {uncalibrated['mape_pct']:.1f}%)")
    assert held["mape_pct"] < MAX_HELD_OUT_MAPE, summary
    assert held["mape_pct"] < MAX_RATIO_TO_UNCALIBRATED * uncalibrated["mape_pct"], summary
    assert held["mape_pct"] < 2 * train["mape_pct"] + 5, summary
    assert held["steps"] + train["steps"] == len(run.steps)
    # tp 1 and no swapping: those parameters are reported, and kept
    assert {"collective", "host_link"} <= set(report["fit"]["unidentified"])
    profile = CalibrationProfile.load(cpu_run / "val" / "calibration.json")
    assert (profile.device, profile.weight_dtype, profile.tp) == ("cpu", "fp32", 1)
    assert profile.gpu_overrides == pytest.approx(probe.gpu_overrides())
    assert profile.source["software.torch"] == torch.__version__
    # the saved profile prices the held-out steps exactly as the reported fit did
    fitted = run_cost_model(run, "cpu").with_calibration(cpu_run / "val" / "calibration.json")
    _, test = split_steps(len(run.steps), 0.5, seed=0)
    measured = np.array([run.steps[i].duration_s for i in test])
    predicted = predict_steps(fitted, [run.steps[i] for i in test])
    assert error_summary(predicted, measured) == held


def test_cli_probes_the_cpu_and_fits(cpu_run, capsys):
    out = cpu_run / "cli"
    assert main(["validate", "--run", str(cpu_run / "run"), "--fit", "--split-seed", "1",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("cpu probe: ") and "float32 matmul" in text and "1 threads" in text
    assert "held-out:  MAPE" in text
    report = json.loads((out / "validation.json").read_text())
    assert report["setup"]["gpu_overrides"].keys() == {"bf16_tflops", "hbm_bandwidth_gbps",
                                                       "pcie_gbps"}
    assert report["fit"]["split_seed"] == 1
    assert sorted(report["plots"]) == sorted(p.name for p in out.glob("*.png"))
