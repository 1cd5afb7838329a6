"""scripts/gpu_results.py on a synthetic gpu-check folder whose figures are chosen so that
every target's measured value is known: the document states those values, judges each
target, names a failed or timed-out step with its log, marks a dry run, and refuses a
folder with no manifest.json. (The dry run of the whole kit, which also writes this
document, is tests/test_gpu_check.py.)"""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import gpu_results  # noqa: E402

POLICIES = ("fcfs", "priority", "sjf", "fair")
DEVICE_RUNS = "/tmp/gpu-check/fidelity/runs"  # validate keys runs by their device path
E2E_MS = [float(v) for v in range(1, 101)]  # p95 (numpy, linear) = 95.05
REPLAY_SCALE = {"fcfs": 1.02, "priority": 0.97, "sjf": 0.90, "fair": 1.04}  # sjf worst: -10%


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def write_requests(path: Path, e2e_ms: list[float]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["request_id", "arrival_s", "finish_s", "e2el_ms", "status"])
        for i, ms in enumerate(e2e_ms):
            w.writerow([i, i, i + ms / 1e3, ms, "finished"])
        w.writerow([len(e2e_ms), 0, "", "", "rejected"])  # no latency: must be left out


def step(section: str, name: str, status: str = "ok", rc: int | None = 0, note: str = "") -> dict:
    return {"name": name, "argv": [], "status": status, "wall_s": 1.0, "rc": rc,
            "log": f"{section}/{name}.log", "note": note}


def manifest(mode: str, overrides: dict[str, dict] | None = None) -> dict:
    """Every section ok, except the steps given as {"section/step": step fields}."""
    steps = {"env": ["collect"], "kernels": ["pytest"], "bandwidth": ["decode_attention"],
             "fidelity": [f"run-{p}" for p in POLICIES]
             + ["validate-default", "validate-fit", "validate-heldout"],
             "engine": ["throughput"]}
    sections = []
    for section, names in steps.items():
        recorded = [step(section, n, **(overrides or {}).get(f"{section}/{n}", {})) for n in names]
        statuses = {s["status"] for s in recorded}
        sections.append({"name": section, "budget_s": 100.0, "wall_s": 10.0, "note": "",
                         "status": "ok" if statuses == {"ok"} else
                         "timeout" if "timeout" in statuses else "failed", "steps": recorded})
    return {"format": "servelab.gpu-check/1", "mode": mode, "command": "bash scripts/gpu_check.sh",
            "started_utc": "2026-12-01T10:00:00+00:00", "finished_utc": "2026-12-01T10:08:00+00:00",
            "budget_s": 535.0, "wall_s": 480.0, "plan": {"model": "llama-3.1-8b",
                                                          "dtype": "bfloat16"},
            "bandwidth_peak_gbps": 4800.0, "sections": sections}


def bandwidth_rows(best_pct: float) -> list[dict]:
    def row(impl, batch, context, pct):
        return {"impl": impl, "batch": batch, "context": context, "kv_bytes": 1,
                "median_us": 1.0, "gbps": round(pct * 48, 1), "pct_of_peak": pct}
    return [row("triton", 64, 8192, 80.0), row("triton", 256, 32768, best_pct),
            row("triton", 256, 4096, 95.0),   # context too short to count
            row("triton", 16, 32768, 97.0),   # batch too small to count
            row("sdpa", 256, 32768, 99.0)]    # not the Triton kernel


def per_run(mapes_steps: dict[str, tuple[float, int]]) -> dict:
    return {f"{DEVICE_RUNS}/{p}": {"steps": n, "mape_pct": mape, "median_ape_pct": mape,
                                   "p90_ape_pct": mape, "bias_pct": -mape,
                                   "total_time_error_pct": -mape}
            for p, (mape, n) in mapes_steps.items()}


def make_folder(root: Path, mode: str = "gpu", best_pct: float = 88.4, speedup_hf: float = 800.0,
                overrides: dict | None = None) -> Path:
    """A gpu-check folder. Targets: best counted Triton row `best_pct` of 4800 GB/s; speed-up
    3000 / `speedup_hf`; step MAPE on priority, sjf, fair (100, 300, 100 steps at 4, 6, 2%)
    4.8% step-weighted; p95 E2E errors +2, -3, -10, +4%; tau-b 1 on one metric of two."""
    write_json(root / "manifest.json", manifest(mode, overrides))
    write_json(root / "env.json", {"device_name": "NVIDIA H200", "memory_gib": 139.8,
                                   "driver": "570.86", "compute_capability": "9.0",
                                   "python": "3.12.3", "torch": "2.7.0", "triton": "3.3.0",
                                   "servelab_commit": "abc123\n(with uncommitted changes)"})
    (root / "kernels").mkdir()
    (root / "kernels/junit.xml").write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="5" failures="1" '
        'errors="0" skipped="1"><testcase classname="tests.test_kernels_decode" name="test_ok"/>'
        '<testcase classname="tests.test_kernels_decode" name="test_nan[bf16]"><failure '
        'message="AssertionError: max abs diff 0.5&#10;second line">trace</failure></testcase>'
        '</testsuite></testsuites>')
    write_json(root / "bandwidth/decode_attention.json", {
        "device": "NVIDIA H200", "settings": {"peak_gbps": 4800.0, "iters": 15},
        "not_compared": {"flashinfer": "not installed on this machine"},
        "rows": bandwidth_rows(best_pct)})
    for p in POLICIES:
        if (overrides or {}).get(f"fidelity/run-{p}"):
            continue  # that run failed: it left nothing
        write_json(root / f"fidelity/runs/{p}/summary.json",
                   {"completed": 100, "median_ttft_ms": 120.0, "output_throughput": 2500.0})
        write_requests(root / f"fidelity/runs/{p}/requests.csv", E2E_MS)
        write_requests(root / f"fidelity/val-heldout/replay/{p}/run/requests.csv",
                       [v * REPLAY_SCALE[p] for v in E2E_MS])
    write_json(root / "fidelity/val-fit/validation.json", {
        "setup": {"gpu": "h200", "model": "llama-3.1-8b", "dtype": "bf16"},
        "fit": {"train_steps": 100, "loss": "l1", "coefficients": {"overhead": 0.0004, "gemm": 1.1},
                "unidentified": {"collective": "zero on every training step"}, "at_bound": []},
        "held_out": {"overall": {"steps": 100, "mape_pct": 3.2}}})
    write_json(root / "fidelity/val-heldout/validation.json", {
        "per_run": per_run({"fcfs": (1.0, 200), "priority": (4.0, 100), "sjf": (6.0, 300),
                            "fair": (2.0, 100)}),
        "simulate": {"runs": {p: {"metrics": {"median_ttft_ms": {
            "real": 120.0, "sim": 126.0, "error_pct": 5.0}}, "notes": []} for p in POLICIES},
            "ranking": {"labels": list(POLICIES), "mean_kendall_tau_b": 0.8333, "metrics": {
                "median_ttft_ms": {"real_order": list(POLICIES), "sim_order": list(POLICIES),
                                   "kendall_tau_b": 1.0},
                "p99_e2el_ms": {"real_order": list(POLICIES),
                                "sim_order": ["priority", "fcfs", "sjf", "fair"],
                                "kendall_tau_b": 0.6667}}}}})
    write_json(root / "engine/throughput.json", {
        "device": "NVIDIA H200", "num_requests": 48, "output_tokens": 9000,
        "servelab": {"output_throughput": 3000.0, "median_ttft_ms": 250.0},
        "hf_static": {"output_throughput": speedup_hf, "median_ttft_ms": 900.0},
        "output_throughput_speedup": 3000.0 / speedup_hf})
    return root


def generate(folder: Path) -> str:
    out = folder.parent / "docs" / "gpu-results.md"
    assert gpu_results.main([str(folder), "--out", str(out)]) == 0
    return out.read_text()


def target(doc: str, name: str) -> tuple[str, str]:
    """The Measured and Verdict cells of the target row whose name starts with `name`."""
    row = next(line for line in doc.splitlines() if line.startswith(f"| {name}"))
    cells = [c.strip() for c in row.strip("|").split(" | ")]
    return cells[1], cells[2].strip("*")


def test_targets_state_the_measured_values_and_judge_them(tmp_path: Path) -> None:
    doc = generate(make_folder(tmp_path / "run"))
    measured, verdict = target(doc, "Decode kernel")
    assert measured.startswith("88.4% of 4,800 GB/s") and "batch 256, context 32768" in measured
    assert verdict == "met"
    assert target(doc, "Engine") == ("3.75x", "met")
    measured, verdict = target(doc, "Step-time MAPE")
    assert measured.startswith("4.8% over 500 steps of priority, sjf, fair")
    assert "fcfs's own held-out half: 3.2%" in measured and verdict == "met"
    measured, verdict = target(doc, "p95 E2E")
    assert measured.startswith("worst 10.0%") and "fcfs +2.0%" in measured
    assert verdict == "not met"
    measured, verdict = target(doc, "Policy ranking")
    assert "mean τ-b 0.83" in measured and "1 of 2 metrics (median_ttft_ms)" in measured
    assert verdict == "not met"
    assert "| 5 | 3 | 1 | 0 | 1 |" in doc  # tests, passed, failed, errors, skipped
    assert "`tests.test_kernels_decode::test_nan[bf16]`: AssertionError: max abs diff 0.5" in doc
    assert "second line" not in doc
    assert "| fcfs | 100 | 120 | — | — | — | 95.0 | 2,500 |" in doc  # p95 of 1..100 ms
    assert "| collective | — | unidentified: zero on every training step |" in doc
    assert "calibration/h200-llama-3.1-8b-bf16.json" in doc


def test_targets_below_their_bars_are_not_met(tmp_path: Path) -> None:
    doc = generate(make_folder(tmp_path / "run", best_pct=84.9, speedup_hf=1500.0))
    assert target(doc, "Decode kernel")[1] == "not met"
    assert "84.9% of 4,800 GB/s" in target(doc, "Decode kernel")[0]
    assert target(doc, "Engine") == ("2.00x", "not met")


def test_figures_are_written_and_linked_relative_to_the_document(tmp_path: Path) -> None:
    doc = generate(make_folder(tmp_path / "run"))
    links = [line[line.index("(") + 1: line.index(")")] for line in doc.splitlines()
             if line.startswith("![")]
    assert {"gpu-results/bandwidth.png", "gpu-results/p95_e2e.png",
            "gpu-results/engine_throughput.png"} <= set(links)
    for link in links:
        assert (tmp_path / "docs" / link).is_file(), link


def test_failed_and_timed_out_steps_are_named_with_their_logs(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "run", overrides={
        "fidelity/run-sjf": {"status": "failed", "rc": 1},
        "engine/throughput": {"status": "timeout", "rc": None, "note": "stopped after 200 s"}})
    data = json.loads((folder / "engine/throughput.json").read_text())
    del data["hf_static"], data["output_throughput_speedup"]  # the baseline never finished
    (folder / "engine/throughput.json").write_text(json.dumps(data))
    doc = generate(folder)
    assert "| fidelity | failed |" in doc
    assert "fidelity/run-sjf failed (rc 1); log `fidelity/run-sjf.log`" in doc
    assert ("- sjf: `fidelity/runs/sjf/summary.json` is absent: step fidelity/run-sjf failed "
            "(rc 1); log `fidelity/run-sjf.log`") in doc
    measured, verdict = target(doc, "Engine")
    assert verdict == "not measured" and "no hf_static figures" in measured
    assert "timed out (stopped after 200 s); log `engine/throughput.log`" in measured
    measured, verdict = target(doc, "p95 E2E")  # sjf's -10% is gone with its run
    assert measured == ("worst 4.0% (fcfs +2.0%, priority -3.0%, fair +4.0%); "
                        "no real run or replay of sjf")
    assert verdict == "not measured"  # within the bar, but not on every policy


def test_a_folder_with_only_a_manifest_still_gets_a_document(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    data = manifest("gpu")
    data["sections"] = data["sections"][:1]  # the run stopped after env
    write_json(folder / "manifest.json", data)
    doc = generate(folder)
    for name in ("Decode kernel", "Engine", "Step-time MAPE", "p95 E2E", "Policy ranking"):
        assert target(doc, name)[1] == "not measured", name
    assert "`engine/throughput.json` is absent: the engine section did not run" in doc
    assert "## Reproduce" in doc


@pytest.mark.parametrize("mode", ["dry-run", "gpu"])
def test_only_a_dry_run_is_marked_dry(tmp_path: Path, mode: str) -> None:
    doc = generate(make_folder(tmp_path / "run", mode=mode))
    assert ("DRY RUN" in doc) == (mode == "dry-run")
    if mode == "dry-run":
        assert doc.splitlines()[2].startswith("> **DRY RUN")


def test_a_folder_without_a_manifest_exits_2_with_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts/gpu_results.py"), str(tmp_path),
                           "--out", str(tmp_path / "r.md")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "manifest.json" in proc.stderr
    assert not (tmp_path / "r.md").exists()


def test_the_document_depends_on_the_folder_alone(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "run")
    assert generate(folder) == generate(folder)
