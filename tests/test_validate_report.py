"""`servelab validate` on runs whose step times are known exactly.

The "real" runs here are simulations priced by a known calibration profile (TRUTH),
dressed as `servelab run` directories: every step's duration is what TRUTH says. So the
true model must predict them with zero error, the fit must find TRUTH again from the
default efficiencies, and replaying the runs with the fitted profile must reproduce each
run's request metrics and the policies' ranking (Kendall's tau-b of 1). The real CPU loop,
with measured durations, is in test_validate_cpu.py.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.cli import main
from servelab.config import SchedulerConfig
from servelab.models import load_model_spec
from servelab.outputs import BatchShape
from servelab.records import StepRecord
from servelab.simulator.calibration import CalibrationProfile, bare_roofline
from servelab.validation.replay import kendall_tau_b
from servelab.simulator.run import SimulationConfig, run_simulation
from servelab.validation.validate import (ValidateOptions, catalog_gpu, error_summary,
                                         load_real_run, split_steps, step_error_report,
                                         step_shape, step_type, validate)
from servelab.validation.verdict import same_shape_spread, verdict
from servelab.traces.canonical import write_csv
from servelab.traces.distributions import Uniform
from servelab.traces.synthetic import TenantSpec, WorkloadSpec, generate

# What the "real" runs were made with: the bare roofline on a slow CPU, each class of
# kernels 1.8-5x slower than its roofline, and 4 ms of step overhead. A fit started from
# the bare roofline can represent it exactly.
TRUTH = replace(bare_roofline("cpu").with_fit(
    {"gemm": 3.3, "attn_prefill": 5.0, "attn_decode": 2.9, "elementwise": 1.8}, 4e-3, {},
    model="tiny-llama", weight_dtype="bf16", kv_dtype="bf16"),
    gpu_overrides={"bf16_tflops": 0.05, "hbm_bandwidth_gbps": 5.0, "pcie_gbps": 5.0})
POLICIES = ("fcfs", "priority", "sjf")
SCHED = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=96, chunked_prefill=48,
                        max_model_len=512)
CACHE = {"block_size": 16, "num_gpu_blocks": 64, "num_cpu_blocks": 0, "watermark": 0.01,
         "enable_prefix_caching": False, "block_manager": "paged"}


def as_real_run(sim_dir, out, policy):
    """A simulated run directory rewritten as `servelab run` writes one."""
    out.mkdir()
    for name in ("steps.csv", "requests.csv", "summary.json"):
        shutil.copy(sim_dir / name, out / name)
    spec = load_model_spec("tiny-llama")
    (out / "config.json").write_text(json.dumps({
        "format": "servelab.real/1",
        "config": {"policy": policy, "policy_options": {}, "scheduler": SCHED.to_dict(),
                   "seed": 0, "replay": True, "slo_ttft_ms": None, "slo_tpot_ms": None},
        "derived": {"hf_config": spec.hf_config, "model": {"name": spec.name}, "device": "cpu",
                    "dtype": "bfloat16", "cache": CACHE, "versions": {"torch": "test"}}}))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("known")
    TRUTH.save(root / "truth.json")
    spec = WorkloadSpec((TenantSpec("a", 18.0, Uniform(16, 200), Uniform(4, 40), priority=1),
                         TenantSpec("b", 12.0, Uniform(16, 200), Uniform(4, 40))), duration_s=1.0)
    write_csv(generate(spec, 0), root / "trace.csv")
    dirs = []
    for policy in POLICIES:
        config = SimulationConfig(
            trace=str(root / "trace.csv"), model="tiny-llama", gpu="cpu", weight_dtype="bf16",
            kv_dtype="bf16", calibration=str(root / "truth.json"), scheduler=SCHED,
            policy=policy, kv_blocks=CACHE["num_gpu_blocks"], fast_forward=False)
        run_simulation(config, root / f"sim-{policy}")
        dirs.append(as_real_run(root / f"sim-{policy}", root / f"real-{policy}", policy))
    return root, dirs


# --- figures -------------------------------------------------------------------------------


def test_error_summary_by_hand():
    e = error_summary(np.array([1.1, 0.9, 2.0, 1.0]), np.array([1.0, 1.0, 1.0, 1.0]))
    assert e["steps"] == 4
    assert e["mape_pct"] == pytest.approx((10 + 10 + 100 + 0) / 4)
    assert e["median_ape_pct"] == pytest.approx(10)
    assert e["p90_ape_pct"] == pytest.approx(np.percentile([10, 10, 100, 0], 90))
    assert e["bias_pct"] == pytest.approx((10 - 10 + 100 + 0) / 4)
    assert e["total_time_error_pct"] == pytest.approx(25)
    assert error_summary(np.array([]), np.array([])) == {"steps": 0}


def test_step_report_groups_by_type_and_bins():
    shapes = [BatchShape(num_decode_seqs=1, decode_context_sum=10),
              BatchShape(num_decode_seqs=40, decode_context_sum=4000),
              BatchShape(1, 100, 0, 0, 10000),
              BatchShape(1, 20, 300, 6000, 400, 3, 600)]
    assert [step_type(s) for s in shapes] == ["decode", "decode", "prefill", "mixed"]
    report = step_error_report(np.array([1.0, 2.0, 3.0, 4.0]), np.array([1.0, 1.0, 1.0, 1.0]),
                               shapes)
    assert report["by_step_type"]["decode"]["mape_pct"] == pytest.approx(50)
    assert list(report["by_batch_tokens"]) == ["1", "8-31", "32-127"]
    assert report["by_batch_tokens"]["32-127"]["steps"] == 2
    assert list(report["by_context_tokens"]) == ["0-255", "256-1023", "1024-4095"]


def test_step_shape_reads_the_records_sufficient_statistics():
    rec = StepRecord(0.0, 0.01, 20, 3, 1, 4, 0, 0, 9, 64, prefill_context_sum=300,
                     prefill_q_context_sum=6000, prefill_q_sq_sum=400, decode_context_sum=600,
                     num_swap_blocks=2, num_copy_blocks=1)
    assert step_shape(rec) == BatchShape(1, 20, 300, 6000, 400, 3, 600, 2, 1)


def test_split_is_seeded_disjoint_and_complete():
    train, test = split_steps(101, 0.5, seed=3)
    assert len(train) == 50 and len(test) == 51
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(101))
    again = split_steps(101, 0.5, seed=3)
    assert (again[0] == train).all() and not (split_steps(101, 0.5, seed=4)[0] == train).all()
    assert [len(part) for part in split_steps(3, 0.99, 0)] == [2, 1]
    with pytest.raises(ValueError, match="train_fraction must be in"):
        split_steps(10, 1.0, 0)


@pytest.mark.parametrize("device, name, entry", [
    ("cuda:0", "NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("cuda", "NVIDIA H200", "h200"),
    ("cuda:1", "NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("cuda", "NVIDIA L40S", "l40s"),
    ("cpu", "x86_64", "cpu"),
])
def test_devices_map_to_the_catalog(device, name, entry):
    assert catalog_gpu(device, name) == entry


def test_unknown_devices_ask_for_gpu():
    with pytest.raises(ValueError, match="cannot map device 'cuda:0'.*H100 PCIe.*pass --gpu"):
        catalog_gpu("cuda:0", "NVIDIA H100 PCIe")


def brute_tau_b(x, y):
    """tau-b from the pairwise sign matrices (vectorised, independent of the loop)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    sx = np.sign(x[:, None] - x[None, :])[np.triu_indices(len(x), 1)]
    sy = np.sign(y[:, None] - y[None, :])[np.triu_indices(len(y), 1)]
    denom = np.sqrt(np.abs(sx).sum() * np.abs(sy).sum())
    return None if denom == 0 else float((sx * sy).sum() / denom)


def test_kendall_tau_b_by_hand():
    assert kendall_tau_b([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0, abs=1e-12)
    assert kendall_tau_b([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0, abs=1e-12)
    assert kendall_tau_b([1, 2, 3, 4], [1, 2, 2, 3]) == pytest.approx(5 / np.sqrt(6 * 5))
    assert kendall_tau_b([1, 1, 1], [1, 2, 3]) is None
    assert kendall_tau_b([1], [1]) is None
    with pytest.raises(ValueError, match="equally long"):
        kendall_tau_b([1, 2], [1])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=2, max_size=9))
def test_kendall_tau_b_properties(pairs):
    x, y = [p[0] for p in pairs], [p[1] for p in pairs]
    tau = kendall_tau_b(x, y)
    expected = brute_tau_b(x, y)
    assert (tau is None) == (expected is None)
    if tau is not None:
        assert tau == pytest.approx(expected, abs=1e-12)
        assert -1 - 1e-12 <= tau <= 1 + 1e-12
        assert kendall_tau_b(y, x) == pytest.approx(tau)
        assert kendall_tau_b(x, [-v for v in y]) == pytest.approx(-tau)
        assert kendall_tau_b([np.exp(v) for v in x], y) == pytest.approx(tau)


# --- run directories -----------------------------------------------------------------------


def test_bad_run_directories_are_named(tmp_path, runs):
    root, dirs = runs
    with pytest.raises(ValueError, match="does not exist"):
        load_real_run(tmp_path / "nope")
    (tmp_path / "half").mkdir()
    with pytest.raises(ValueError, match="steps.csv or steps.parquet is missing"):
        shutil.copy(dirs[0] / "config.json", tmp_path / "half" / "config.json")
        load_real_run(tmp_path / "half")
    with pytest.raises(ValueError, match="a simulated run: validate compares a real run"):
        load_real_run(root / "sim-fcfs")
    (tmp_path / "half" / "vllm_meta.json").write_text("{}")   # a recorded vLLM run's folder
    with pytest.raises(ValueError, match="is a recorded vLLM run .* replay it with --real-requests"):
        load_real_run(tmp_path / "half")
    broken = tmp_path / "broken"
    shutil.copytree(dirs[0], broken)
    doc = json.loads((broken / "config.json").read_text())
    del doc["derived"]["device"]
    (broken / "config.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"broken/config.json: missing field\(s\) derived.device"):
        load_real_run(broken)


def test_true_profile_predicts_every_step_exactly(runs, tmp_path):
    root, dirs = runs
    options = ValidateOptions(calibration=str(root / "truth.json"),
                              gpu_overrides=TRUTH.gpu_overrides, plots=False)
    report = validate([load_real_run(d) for d in dirs], options, tmp_path)
    assert report["starting"]["overall"]["mape_pct"] < 1e-9
    default = validate([load_real_run(dirs[0])], ValidateOptions(plots=False))
    assert default["default"]["overall"]["mape_pct"] > 50    # the catalog cpu is far off


def test_fit_and_replay_reproduce_the_runs(runs, tmp_path):
    root, dirs = runs
    real = [load_real_run(d) for d in dirs]
    options = ValidateOptions(fit=True, gpu_overrides=TRUTH.gpu_overrides, simulate=True)
    report = validate(real, options, tmp_path)
    assert report["held_out"]["overall"]["mape_pct"] < 1e-6
    assert report["default_held_out"]["overall"]["mape_pct"] > 50
    assert {"collective", "host_link"} <= set(report["fit"]["unidentified"])
    profile = CalibrationProfile.load(tmp_path / "calibration.json")
    assert profile.step_overhead_s == pytest.approx(TRUTH.step_overhead_s, rel=1e-6)
    assert profile.gpu_overrides == TRUTH.gpu_overrides
    assert profile.fit_stats["test_mape_pct"] < 1e-6
    for label, run in report["simulate"]["runs"].items():
        for metric, v in run["metrics"].items():
            assert v["sim"] == pytest.approx(v["real"], rel=1e-6), (label, metric)
        assert (tmp_path / "replay" / label / "run" / "summary.json").is_file()
    ranking = report["simulate"]["ranking"]
    assert ranking["labels"] == list(POLICIES)
    for metric, r in ranking["metrics"].items():
        assert r["real_order"] == r["sim_order"], metric
        assert r["kendall_tau_b"] is None or r["kendall_tau_b"] == pytest.approx(1.0, abs=1e-12), metric
    assert ranking["mean_kendall_tau_b"] == pytest.approx(1.0, abs=1e-12)
    saved = json.loads((tmp_path / "validation.json").read_text())
    assert saved["plots"] == ["step_pred_vs_measured.png", "step_error_hist.png",
                              "step_error_vs_tokens.png"]
    assert all((tmp_path / name).stat().st_size > 1000 for name in saved["plots"])


def test_runs_of_different_setups_are_refused(runs, tmp_path):
    root, dirs = runs
    other = tmp_path / "fp16"
    shutil.copytree(dirs[0], other)
    doc = json.loads((other / "config.json").read_text())
    doc["derived"]["dtype"] = "float16"
    (other / "config.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="differ in dtype"):
        validate([load_real_run(dirs[0]), load_real_run(other)], ValidateOptions(plots=False))
    with pytest.raises(ValueError, match="simulate needs a calibration"):
        ValidateOptions(simulate=True)


def test_cli(runs, tmp_path, capsys):
    root, dirs = runs
    out = tmp_path / "val"
    args = ["validate", "--run", str(dirs[0]), "--run", str(dirs[2]), "--fit", "--simulate",
            "--no-probe", "--no-plots", "--train-fraction", "0.6", "--out", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    # without the probe the catalog cpu's peaks put a few kernels on the other side of their
    # roofline than in the truth, which per-class scales cannot undo exactly: < 1% is left
    assert re.search(r"held-out:  MAPE 0\.\d%", text), text
    assert "not identified, kept at its start: host_link (zero on every training step)" in text
    assert "mean Kendall tau-b over metrics: +1.00" in text
    report = json.loads((out / "validation.json").read_text())
    assert report["fit"]["train_steps"] == round(0.6 * report["steps"])
    # a profile validate wrote is what `simulate --calibration` loads
    assert main(["simulate", "--trace", str(root / "trace.csv"), "--model", "tiny-llama",
                 "--gpu", "cpu", "--calibration", str(out / "calibration.json"),
                 "--kv-blocks", "64", "--out", str(tmp_path / "sim")]) == 0
    assert main(["validate", "--run", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "run directory" in capsys.readouterr().err


# --- the verdict ---------------------------------------------------------------------------


def test_verdict_is_quiet_when_the_model_fits_and_warns_when_it_does_not(runs, tmp_path, capsys):
    root, dirs = runs
    true = validate([load_real_run(dirs[0])], ValidateOptions(
        calibration=str(root / "truth.json"), gpu_overrides=TRUTH.gpu_overrides, plots=False))
    assert true["verdict"]["warnings"] == []
    assert abs(true["verdict"]["total_time_error_pct"]) < 1e-6
    # the bare roofline of a catalog cpu: far too fast, in MAPE and in total time
    bare = validate([load_real_run(dirs[0])], ValidateOptions(plots=False))
    warnings = bare["verdict"]["warnings"]
    assert any("step MAPE is" in w and "does not describe these steps" in w for w in warnings)
    assert any("summed step time is off by -" in w and "faster than these" in w for w in warnings)
    args = ["validate", "--run", str(dirs[0]), "--no-probe", "--no-plots", "--out", str(tmp_path / "v")]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "summary: all step MAPE" in text and "WARNING: step MAPE is" in text
    assert main(args + ["--strict"]) == 1
    # the truth profile carries its device figures: nothing to warn about, strict passes
    assert main(["validate", "--run", str(dirs[0]), "--no-probe", "--no-plots", "--strict",
                 "--calibration", str(root / "truth.json"), "--out", str(tmp_path / "w")]) == 0


def test_same_shape_spread_flags_a_disturbed_machine():
    a, b = BatchShape(num_decode_seqs=4, decode_context_sum=400), BatchShape(1, 64, 0, 0, 4096)
    quiet = same_shape_spread([a, a, b, b], np.array([1.0, 1.1, 2.0, 2.0]))
    assert quiet["repeated_shapes"] == 2 and quiet["worst_ratio"] == pytest.approx(1.1)
    noisy = same_shape_spread([a, a, a, b], np.array([1.0, 2.5, 1.2, 9.0]))
    assert noisy["worst_ratio"] == pytest.approx(2.5) and noisy["ratios_above_2x"] == 1
    assert noisy["worst_shape"]["num_decode_seqs"] == 4
    assert same_shape_spread([a, b], np.array([1.0, 2.0]))["repeated_shapes"] == 0
    report = {"default": {"overall": error_summary(np.array([1.0, 2.5, 1.2, 9.0]),
                                                   np.array([1.0, 2.5, 1.2, 9.0]))}}
    v = verdict(report, [a, a, a, b], np.array([1.0, 2.5, 1.2, 9.0]), ValidateOptions())
    assert len(v["warnings"]) == 1 and "machine was disturbed" in v["warnings"][0]


def test_out_that_holds_something_else_is_refused_before_any_work(runs, tmp_path, capsys):
    """--out is the report's own: not one of the runs validated, not a directory of other
    files (unless --force); a report directory of an earlier validate is rewritten."""
    _, dirs = runs
    base = ["validate", "--run", str(dirs[0]), "--no-probe", "--no-plots"]
    assert main(base + ["--out", str(dirs[0])]) == 2
    assert "is a run being validated" in capsys.readouterr().err
    assert not (dirs[0] / "validation.json").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert main(base + ["--out", str(mine)]) == 2
    assert "holds files that are not a validate report's (notes.txt): use another --out, " \
           "or --force" in capsys.readouterr().err
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert main(base + ["--out", str(mine), "--force"]) == 0
    assert (mine / "validation.json").exists() and (mine / "notes.txt").read_text() == "keep me"
    assert main(base + ["--out", str(mine)]) == 0          # its own report now: rewritten


def test_a_rerun_into_its_own_report_leaves_nothing_of_the_earlier_one(runs, tmp_path, capsys):
    """Validating fewer runs into the same --out: the earlier replays and fit are gone, not
    left beside the new report; one run given twice is refused (its steps would sit on
    both sides of the held-out split)."""
    _, dirs = runs
    out, fresh = tmp_path / "v", tmp_path / "fresh"
    two = ["validate", "--run", str(dirs[0]), "--run", str(dirs[2]), "--no-probe", "--no-plots"]
    assert main(two + ["--fit", "--simulate", "--out", str(out)]) == 0
    one = ["validate", "--run", str(dirs[0]), "--no-probe", "--no-plots", "--fit", "--simulate"]
    assert main(one + ["--out", str(out)]) == 0
    assert main(one + ["--out", str(fresh)]) == 0
    listing = lambda d: sorted(str(p.relative_to(d)) for p in d.rglob("*"))  # noqa: E731
    assert listing(out / "replay") == listing(fresh / "replay")
    assert main(["validate", "--run", str(dirs[0]), "--run", str(dirs[0]) + "/",
                 "--out", str(tmp_path / "twice")]) == 2
    assert "is given twice" in capsys.readouterr().err
