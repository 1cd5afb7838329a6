"""The prepared GPU check (scripts/gpu_check.sh): its dry mode runs every section end to end
on the CPU and leaves a complete results document, its time boxes stop a section that
overruns without costing the next, and it says in one line what a machine lacks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402


def _env() -> dict:
    """This interpreter, and no $OUT: where $OUT is set (the device machine) the script
    would pack into it, over real results."""
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    return {**env, "PYTHON": sys.executable}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory, traces_dir) -> Path:
    """One dry run of the whole kit on a 32-request slice of the real azure-conv trace."""
    tmp = tmp_path_factory.mktemp("gpu-check")
    trace = tmp / "slice.csv"
    subprocess.run([sys.executable, "scripts/gpu_check.py", "slice", "--trace-dir",
                    str(traces_dir), "--out", str(trace), "--num-requests", "32",
                    "--max-model-len", "256"], cwd=REPO, check=True, capture_output=True)
    out = tmp / "out"
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(out),
                           "--trace", str(trace)], cwd=REPO, capture_output=True, text=True,
                          env=_env(), timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return out


@pytest.mark.slow
def test_dry_run_runs_every_section(dry_run: Path) -> None:
    manifest = json.loads((dry_run / "manifest.json").read_text())
    assert manifest["mode"] == "dry-run"
    assert [s["name"] for s in manifest["sections"]] == list(gpu_check.SECTIONS)
    assert {s["name"]: s["status"] for s in manifest["sections"]} == dict.fromkeys(
        gpu_check.SECTIONS, "ok")
    suite = ET.parse(dry_run / "kernels" / "junit.xml").getroot().find("testsuite")
    assert int(suite.get("tests")) >= 60 and suite.get("failures") == suite.get("errors") == "0"
    suite = ET.parse(dry_run / "backends" / "junit.xml").getroot().find("testsuite")
    assert int(suite.get("tests")) >= 1 and suite.get("failures") == suite.get("errors") == "0"
    rows = json.loads((dry_run / "bandwidth" / "decode_attention.json").read_text())["rows"]
    assert {r["impl"] for r in rows} == {"triton", "reference", "sdpa"}
    for policy in gpu_check.POLICIES:
        summary = json.loads((dry_run / "fidelity" / "runs" / policy / "summary.json").read_text())
        assert summary["completed"] == 24
    profile = json.loads((dry_run / "fidelity" / "val-fit" / "calibration.json").read_text())
    assert profile["model"] == "tiny-llama" and profile["device"] == "cpu"
    ranking = json.loads((dry_run / "fidelity" / "val-heldout" / "validation.json").read_text())
    assert set(ranking["simulate"]["ranking"]["labels"]) == set(gpu_check.POLICIES)
    engine = json.loads((dry_run / "engine" / "throughput.json").read_text())
    assert engine["servelab"]["output_throughput"] > 0 and engine["hf_static"]["output_throughput"] > 0


@pytest.mark.slow
def test_dry_run_document_is_complete_and_marked(dry_run: Path) -> None:
    doc = (dry_run / "gpu-results.md").read_text()
    assert "DRY RUN" in doc
    for heading in ("Kernels", "Bandwidth", "Fidelity", "Engine", "Reproduce"):
        assert f"## {heading}" in doc, heading
    for line in doc.splitlines():
        if line.startswith("!["):
            figure = line[line.index("(") + 1: line.index(")")]
            assert (dry_run / figure).is_file(), figure


def _runner(tmp_path: Path, budgets: dict) -> gpu_check.Runner:
    plan = gpu_check.Plan(**{**gpu_check.asdict(gpu_check.DRY_PLAN), "budgets_s": budgets})
    return gpu_check.Runner(tmp_path, plan, dry_run=True, budget_s=sum(budgets.values()),
                            trace=tmp_path / "t.csv", argv=["--dry-run"])


def test_a_section_past_its_time_box_is_stopped_and_the_next_still_runs(tmp_path: Path) -> None:
    runner = _runner(tmp_path, {"kernels": 2.0, "bandwidth": 30.0, "report": 20.0})

    def sleeper(r, sec, end):
        r.step(sec, end, "sleep", gpu_check.py("-c", "import time; time.sleep(60)"))

    def quick(r, sec, end):
        r.step(sec, end, "print", gpu_check.py("-c", "print('finished')"))

    runner.section("kernels", sleeper)
    runner.section("bandwidth", quick)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    first, second = manifest["sections"]
    assert (first["name"], first["status"]) == ("kernels", "timeout")
    assert first["steps"][0]["wall_s"] < 30
    assert (second["name"], second["status"]) == ("bandwidth", "ok")
    assert (tmp_path / "bandwidth" / "print.log").read_text().strip() == "finished"


def test_a_bug_in_a_section_is_recorded_not_raised(tmp_path: Path) -> None:
    runner = _runner(tmp_path, {"engine": 10.0, "report": 20.0})

    def broken(r, sec, end):
        raise KeyError("no such file")

    runner.section("engine", broken)
    section = json.loads((tmp_path / "manifest.json").read_text())["sections"][0]
    assert section["status"] == "failed" and "KeyError" in section["note"]


def test_no_gpu_and_no_dry_run_says_what_is_missing_in_one_line() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the check would run for real")
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--out", "/nonexistent/never"],
                          cwd=REPO, capture_output=True, text=True, env=_env())
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "a CUDA device" in lines[0]


def test_unknown_section_is_refused() -> None:
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["run", "--out", "x", "--sections", "kernels,warp"])
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["run", "--out", "x", "--section-budgets", "engine=fast"])


def test_results_are_packed_after_every_section(tmp_path: Path) -> None:
    """On the device the call can be stopped at its limit: what finished must already be
    in $OUT (the device returns at most eight files, so one archive)."""
    import tarfile

    out, dest = tmp_path / "work", tmp_path / "OUT"
    out.mkdir()
    dest.mkdir()
    plan = gpu_check.Plan(**{**gpu_check.asdict(gpu_check.DRY_PLAN),
                             "budgets_s": {"kernels": 30.0, "report": 20.0}})
    runner = gpu_check.Runner(out, plan, dry_run=True, budget_s=50.0, trace=tmp_path / "t.csv",
                              argv=[], pack_into=dest)
    runner.section("kernels", lambda r, sec, end: r.step(sec, end, "print",
                                                         gpu_check.py("-c", "print('one')")))
    with tarfile.open(dest / "gpu-check.tgz") as archive:
        names = archive.getnames()
    assert "work/kernels/print.log" in names and "work/manifest.json" in names
    assert json.loads((dest / "manifest.json").read_text())["sections"][0]["status"] == "ok"
