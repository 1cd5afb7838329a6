"""`servelab fidelity` and `servelab calibrate` on the real H100 tables (one GPU, a few
seconds each), and `calibrate` on a small synthetic folder for its flags and errors.

The fidelity report judges the packaged profile on the points its fit held out: it must
show both the bare roofline and the fitted profile per family, with the fitted GEMM error
well below the roofline's, and its held-out figures must be the ones the profile recorded
when it was fitted (the split is reproduced from the profile's seed and fraction).
"""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from _gpu_tables import real_measurements, write_aic

from servelab.cli import main
from servelab.simulator import kernels as K
from servelab.simulator.calibration import CalibrationProfile, packaged
from servelab.simulator.gpus import get_gpu

CELL = r"(\d+\.\d) / ([+-]\d+\.\d) / ([+-]\d+)"
FITTED_FAMILIES = ("gemm", "attn_prefill", "attn_decode", "collective")


def section(markdown: str, title: str) -> str:
    """The text of the `### title` section (its heading may add a target), up to the next
    heading."""
    start = re.search(rf"^### {re.escape(title)}( \(|$)", markdown, re.M).start()
    end = markdown.find("\n#", start + 1)
    return markdown[start:end if end >= 0 else None]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("fidelity") / "fidelity.md"
    rc = main(["fidelity", "--measurements", str(real_measurements()), "--out", str(out),
               "--gpu", "h100-sxm", "--engine-version", "0.14.0"])
    assert rc == 0
    return out


@pytest.mark.parametrize("argv, who", [(["--gpu", "h200"], "h200"),
                                        (["--gpu", "rtx-pro-6000", "--engine-version", "0.14.0"],
                                         "rtx-pro-6000 inside vLLM 0.14.0")])
def test_fidelity_with_nothing_to_judge_writes_nothing_and_says_why(tmp_path, capsys, argv, who):
    out = tmp_path / "f.md"
    assert main(["fidelity", "--measurements", str(tmp_path), *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"servelab fidelity: error: no packaged profile was fitted on {who}: ")
    assert "h100-sxm (0.24.0)" in err and err.count("\n") == 1 and not out.exists()


def test_fidelity_report_has_bare_and_fitted_tables_per_family(report):
    text = report.read_text()
    assert "## h100-sxm, vLLM 0.14.0" in text and "## a100-80gb" not in text and "## l40s" not in text
    assert "vLLM 0.24.0" not in text         # --engine-version 0.14.0: the 0.24 profile is not judged
    assert "judged on the tables measured inside vLLM 0.14.0" in text
    for name in FITTED_FAMILIES:
        body = section(text, name)
        assert "| band | n | bare | fitted | fitted, no glitches |" in body
        row = re.search(rf"^\| \*\*all held-out\*\* \| (\d+) \| {CELL} \| {CELL} \| {CELL} \|$",
                        body, re.M)
        assert row, body
        assert int(row.group(1)) > 0
        bands = re.findall(rf"^\| [^*|][^|]* \| \d+ \| {CELL} \| {CELL} \|", body, re.M)
        assert bands, f"{name}: no per-band rows"


def test_fidelity_fitted_gemm_error_is_below_the_roofline_and_what_the_profile_recorded(report):
    text = report.read_text()
    body = section(text, "gemm")
    row = re.search(rf"^\| \*\*all held-out\*\* \| (\d+) \| {CELL} \| {CELL} \|", body, re.M)
    bare_mape, fitted_mape = float(row.group(2)), float(row.group(5))
    assert fitted_mape < bare_mape / 3, (fitted_mape, bare_mape)
    assert float(row.group(3)) < -10            # the bare roofline is too fast
    stats = packaged("h100-sxm").fit_stats
    assert fitted_mape == pytest.approx(stats["gemm.heldout_mape_pct"], abs=0.06)
    held, total = re.search(r"(\d+) held-out of (\d+) points", body).groups()
    assert int(total) == stats["gemm.rows"] and int(held) == int(row.group(1))
    assert int(held) == pytest.approx(stats["holdout_fraction"] * int(total), rel=0.1)


def test_fidelity_plot_is_a_real_png_linked_from_the_report(report):
    png = report.parent / report.stem / "h100-sxm_predicted_vs_measured.png"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    width, height = struct.unpack(">II", data[16:24])
    assert width > 800 and height > 400
    assert f"![h100-sxm_predicted_vs_measured.png]({report.stem}/{png.name})" in report.read_text()


# --- calibrate on the real H100 tables --------------------------------------------------------


def test_calibrate_real_h100_tables_writes_a_profile_and_prints_held_out_errors(tmp_path, capsys):
    out = tmp_path / "h100.json"
    rc = main(["calibrate", "--from-measurements", str(real_measurements()), "--gpu", "h100-sxm",
               "--engine-version", "0.14.0",
               "--out", str(out), "--drop-bad-rows", "--seed", "3", "--holdout", "0.25",
               "--max-points", "400", "--data-version", "aiconfigurator 095f58a51, vidur 7d47513"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    profile = CalibrationProfile.load(out)
    stats = profile.fit_stats
    assert profile.device == "h100-sxm"
    assert (stats["holdout_seed"], stats["holdout_fraction"]) == (3, 0.25)
    assert profile.source["data"] == "aiconfigurator 095f58a51, vidur 7d47513"
    merged = re.search(r"^dropped: (\d+) repeated measurements merged$", printed.err, re.M)
    assert merged and int(merged.group(1)) == stats["dropped.repeated measurements merged"] > 0
    lines = printed.out.splitlines()
    assert lines[0] == "h100-sxm: fitted on 75% of each table, error on the held-out 25%"
    assert lines[-1] == f"wrote {out}"
    sampled = re.search(r"^fitting gemm on 400 points \(sampled from ([\d,]+)\) \.\.\.$", printed.err, re.M)
    assert sampled and int(sampled.group(1).replace(",", "")) > 400, printed.err
    for name in (*FITTED_FAMILIES, "gemm_fp8", "elementwise"):
        line = re.search(rf"^  {name} +(\d+) points  held-out MAPE +(\d+\.\d)%", printed.out, re.M)
        assert line, f"no held-out figure for {name}"
        assert int(line.group(1)) == stats[f"{name}.rows"]
        assert float(line.group(2)) == pytest.approx(stats[f"{name}.heldout_mape_pct"], abs=0.06)
    assert stats["gemm.heldout_mape_pct"] < 15 and stats["attn_decode.heldout_mape_pct"] < 15


def test_calibrate_real_tables_without_drop_names_the_repeated_row(tmp_path, capsys):
    out = tmp_path / "h100.json"
    rc = main(["calibrate", "--from-measurements", str(real_measurements()), "--gpu", "h100-sxm",
               "--engine-version", "0.14.0",
               "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert re.match(r"servelab calibrate: error: \S+\.parquet: row \d+: the same point as "
                    r"\S+\.parquet: row \d+ \(", err), err
    assert "--drop-bad-rows" in err
    assert not out.exists()


# --- calibrate on a small synthetic folder -----------------------------------------------------


@pytest.fixture
def synthetic_gemms(tmp_path):
    """BF16 GEMMs of the H100, priced by known parameters (fitted back exactly)."""
    truth = K.GemmParams(floor_s=5e-6, compute_eff=0.7, memory_eff=0.85, overlap=2.0, k_step_s=3e-10)
    rows = []
    for m in 2 ** np.arange(0, 14, 2):
        for n in (1024, 4096, 14336):
            for k in (1024, 4096, 8192):
                t = float(K.gemm_time(m, n, k, get_gpu("h100-sxm"), truth))
                rows.append({"m": int(m), "n": n, "k": k, "latency": t * 1e3})
    write_aic(tmp_path / "meas" / "h100_sxm" / "gemm_perf.parquet", rows)
    return tmp_path / "meas"


def test_calibrate_json_and_fallback_on_synthetic_tables(synthetic_gemms, tmp_path, capsys):
    out = tmp_path / "p.json"
    argv = ["calibrate", "--from-measurements", str(synthetic_gemms), "--gpu", "h100-sxm",
            "--out", str(out), "--fallback", "a100-80gb"]
    assert main([*argv, "--json"]) == 0
    printed = capsys.readouterr().out
    report = json.loads(printed[:printed.rindex("wrote ")])
    assert set(report) == {"gemm"}
    assert set(report["gemm"]) == {"params", "stats", "stats_without_glitches", "glitch_rows"}
    assert report["gemm"]["stats"]["heldout"]["mape_pct"] < 0.01
    assert report["gemm"]["params"]["floor_s"] == pytest.approx(5e-6, rel=0.01)
    profile = CalibrationProfile.load(out)
    assert profile.kernels.attn_decode == packaged("a100-80gb").kernels.attn_decode
    assert profile.engine_version == "0.14.0"        # the one version the tables carry
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert re.search(r"^  attn_decode +no measurements on h100-sxm: carried from the a100-80gb "
                     r"profile$", text, re.M)
    assert re.search(r"^  gemm_fp8 +no FP8 GEMM measurements: the BF16 GEMM parameters$", text, re.M)


@pytest.mark.parametrize("extra, message", [
    (["--gpu", "nope"], "unknown GPU 'nope'"),
    (["--gpu", "h100-sxm", "--fallback", "nope"], "cannot read calibration profile nope"),
    (["--gpu", "a100-80gb"], "no measurements for a100-80gb"),
])
def test_calibrate_user_errors_are_one_line(synthetic_gemms, tmp_path, capsys, extra, message):
    out = tmp_path / "p.json"
    rc = main(["calibrate", "--from-measurements", str(synthetic_gemms), "--out", str(out), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("servelab calibrate: error: ") and message in err, err
    assert err.count("\n") == 1 and not out.exists()


def test_calibrate_refuses_a_holdout_outside_0_1(synthetic_gemms, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", "--from-measurements", str(synthetic_gemms), "--gpu", "h100-sxm",
              "--out", str(tmp_path / "p.json"), "--holdout", "1"])
    assert exc.value.code == 2
    assert "argument --holdout: expected a number in [0, 1), got '1'" in capsys.readouterr().err


def test_engine_ratios_compare_the_shapes_both_versions_measured(tmp_path):
    """newer / older latency percentiles per family, on matching shapes only; and the
    report's section that shows them."""
    from servelab.validation.fidelity import engine_ratios, render
    from servelab.validation.measurements import load_measurements

    old = [{"m": m, "n": 4096, "k": 4096, "latency": 0.01 * m} for m in (1, 2, 4, 8, 16)]
    new = [{**r, "latency": r["latency"] * f, "version": "0.24.0"}
           for r, f in zip(old, (0.5, 1.0, 1.0, 1.0, 2.0))]
    new.append({"m": 32, "n": 4096, "k": 4096, "latency": 99.0, "version": "0.24.0"})  # unmatched
    write_aic(tmp_path / "old" / "h100_sxm" / "gemm_perf.parquet", old)
    write_aic(tmp_path / "new" / "h100_sxm" / "gemm_perf.parquet", new)
    ratios = engine_ratios(load_measurements([tmp_path / "old"], "h100-sxm"),
                           load_measurements([tmp_path / "new"], "h100-sxm"))
    assert set(ratios) == {"gemm"}
    r = ratios["gemm"]
    assert r["n"] == 5 and r["p50"] == pytest.approx(1.0)
    assert r["p10"] == pytest.approx(0.7) and r["p90"] == pytest.approx(1.6)
    text = render([], Path("fidelity.md"), [], ratios={("h100-sxm", "0.14.0", "0.24.0"): ratios})
    assert "| h100-sxm | vLLM 0.24.0 / 0.14.0 | gemm | 5 | 0.70 | 1.00 | 1.60 |" in text


def test_calibrate_checks_its_out_path_before_fitting(synthetic_gemms, tmp_path, capsys):
    """A fit takes minutes: an --out it could not write was a traceback after it; now a
    folder as --out, or one that cannot be made, is one line before any work, and a
    missing folder is made."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out, message in ((tmp_path, "is a folder: name the profile file to write"),
                         (blocker / "p.json", "cannot make the folder of --out")):
        rc = main(["calibrate", "--from-measurements", str(synthetic_gemms), "--gpu", "h100-sxm",
                   "--out", str(out)])
        err = capsys.readouterr().err
        assert rc == 2 and message in err and err.count("\n") == 1, err
    out = tmp_path / "new" / "folder" / "p.json"
    assert main(["calibrate", "--from-measurements", str(synthetic_gemms), "--gpu", "h100-sxm",
                 "--out", str(out)]) == 0
    assert out.exists()


def test_calibrate_refuses_a_family_left_fewer_points_than_parameters(synthetic_gemms, tmp_path,
                                                                      capsys):
    """--holdout 0.99 left the GEMM fit a handful of points (and another family none) and
    wrote its guesses as a fitted profile, exit 0: one line now, and nothing written."""
    out = tmp_path / "p.json"
    rc = main(["calibrate", "--from-measurements", str(synthetic_gemms), "--gpu", "h100-sxm",
               "--holdout", "0.99", "--out", str(out)])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and re.fullmatch(r"servelab calibrate: error: gemm: \d+ training points for "
                                    r"\d+ parameters .*: hold fewer out \(--holdout\) or measure "
                                    r"more shapes", err[-1]), err
    assert not out.exists()


def test_calibrate_does_not_write_over_what_it_reads(synthetic_gemms, tmp_path, capsys):
    """--out naming the GPU file, or a table of the measurements, replaced it with the
    profile (exit 0): both are refused in one line, and left as they were."""
    table = synthetic_gemms / "h100_sxm" / "gemm_perf.parquet"
    gpu_file = tmp_path / "my-gpu.json"
    spec = json.loads((Path(__file__).parents[1] / "simulator" / "data" / "gpus" /
                       "h100-sxm.json").read_text())
    gpu_file.write_text(json.dumps({**spec, "calibration": None}))
    before = {p: p.read_bytes() for p in (table, gpu_file)}
    for gpu, out, message in ((str(gpu_file), gpu_file, "is the GPU file --gpu reads"),
                              ("h100-sxm", table, "would be a table among the measurements")):
        rc = main(["calibrate", "--from-measurements", str(synthetic_gemms), "--gpu", gpu,
                   "--out", str(out)])
        err = capsys.readouterr().err
        assert rc == 2 and message in err and err.count("\n") == 1, err
    assert {p: p.read_bytes() for p in before} == before


def test_fp8_kv_rows_faster_than_an_fp8_cache_explains_are_said_to_be_so():
    """The RTX PRO 6000's FP8-KV prefill rows run up to 1,137x faster than the BF16 row of
    the same shape: the report printed their errors (1,856% MAPE) as the model's. Pairs
    within what halved KV bytes and FP8 maths allow get no note."""
    import numpy as np

    from servelab.validation.fidelity import _fp8_speedup_note
    from servelab.validation.measurements import Table

    def table(speedups):
        n = len(speedups)
        bf16 = np.full(n, 1e-3)
        return Table("attn_prefill", {
            "tokens": np.tile(np.arange(n), 2), "heads": np.full(2 * n, 8),
            "kv_dtype": np.array(["bf16"] * n + ["fp8"] * n, dtype=object),
            "latency_s": np.concatenate([bf16, bf16 / np.array(speedups)])}, ["r"] * (2 * n))

    assert _fp8_speedup_note(table([1.0, 1.3, 1.6, 1.9] * 5)) is None
    note = _fp8_speedup_note(table([1.5] * 15 + [40.0, 100.0, 300.0, 900.0, 1137.0]))
    assert note.startswith("These FP8 rows run faster than an FP8 cache explains") and "1,137x (20 pairs)" in note
