"""Recorded vLLM runs replayed whole (`servelab validate --real-requests`): reading and
checking a run folder, the error metrics on numbers worked by hand, the engine config a
run's meta maps to, and one replay end to end through the CLI. Synthetic runs are written
into tmp_path; the public runs of ../shared/real-runs are read when present."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import SHARED
from servelab.cli import main
from servelab.simulator.footprint import kv_capacity_blocks
from servelab.validation.real_runs import (NotReplayable, _mean_decode_context, catalog_model,
                                           decode_seconds, error_metrics, load_recorded_run,
                                           parse_published, replay_run, run_gpu,
                                           vllm_engine_config)

REAL_RUNS = SHARED / "real-runs" / "llmservingsim-vllm-0.19"
RTX4090 = "NVIDIA GeForce RTX 4090"


def row(i: int, queued: float, prompt: int = 40, output: int = 5, queue: float = 0.0,
        prefill: float = 0.02, decode: float = 0.04, **extra) -> dict:
    """A request queued at `queued` s (engine clock; the client clock is 1000 s ahead)."""
    return {"request_id": f"r{i}", "input_toks": prompt, "output_toks": output,
            "arrival_time": 1000.0 + queued, "queued_ts": queued,
            "scheduled_ts": queued + queue, "first_token_ts": queued + queue + prefill,
            "last_token_ts": queued + queue + prefill + decode, **extra}


def write_run(folder: Path, rows: list, model: str = "meta-llama/Llama-3.1-8B",
              device: str | None = RTX4090, kv_cache: dict | None = None, **kwargs) -> Path:
    folder.mkdir(parents=True)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    (folder / "vllm_requests.jsonl").write_text("\n".join(lines) + "\n")
    meta = {"model": model, "vllm_version": "0.19.0",
            "engine_kwargs": {"model": model, "tensor_parallel_size": 1, "max_num_seqs": 8,
                              "max_num_batched_tokens": 64, "max_model_len": None,
                              "dtype": "bfloat16", "kv_cache_dtype": "auto", **kwargs}}
    if device:
        meta["hardware"] = {"device_name": device}
    if kv_cache:
        meta["kv_cache"] = kv_cache
    (folder / "vllm_meta.json").write_text(json.dumps(meta))
    return folder


SUMMARY = """Metric                           vLLM         Sim     Diff%
-----------------------------------------------------------
TTFT Mean                        25.0        26.0     +4.0%
TTFT P99                         40.0        38.0     -5.0%

Latency Median                   60.0        60.6     +1.0%
"""


# --------------------------------------------------------------------------- reading


def test_rows_are_checked_and_every_dropped_row_counted(tmp_path):
    rows = [row(0, 10.0, queue=0.5), row(1, 10.25, output=1, decode=0.0),
            row(2, 10.5, prefill=0.1, decode=0.2),
            "{not json", {**row(3, 11.0), "input_toks": "many"},
            {**row(4, 11.0), "first_token_ts": 9.0},          # before it was queued
            {**row(5, 11.0), "output_toks": 0}, {**row(6, 12.0), "request_id": "r0"}]
    run = load_recorded_run(write_run(tmp_path / "runs" / "run", rows))
    assert run.label == "runs/run" and run.source_rows == 8
    assert {i.reason: i.count for i in run.dropped} == {
        "not a JSON object": 1, "missing or non-numeric field": 1,
        "timestamps out of order (queued <= scheduled <= first token <= last token)": 1,
        "token count not an integer >= 1": 1, "duplicate request_id": 1}
    assert next(i.example for i in run.dropped if i.reason == "not a JSON object").startswith("line 4:")
    a, b, c = run.requests
    assert [r.arrival_s for r in run.requests] == pytest.approx([0.0, 0.25, 0.5])
    assert (a.queue_ms, a.ttft_ms, a.e2el_ms, a.tpot_ms) == pytest.approx((500, 520, 560, 10))
    assert b.tpot_ms is None                                  # one output token: no TPOT
    assert (c.ttft_ms, c.tpot_ms) == pytest.approx((100, 50))
    assert a.client_lag_ms == pytest.approx(0.0, abs=1e-6)


def test_requests_are_put_in_queue_order(tmp_path):
    run = load_recorded_run(write_run(tmp_path / "runs" / "run", [row(0, 3.0), row(1, 1.0)]))
    assert [r.request_id for r in run.requests] == ["r1", "r0"]
    assert [r.arrival_s for r in run.requests] == [0.0, 2.0]


def test_a_folder_without_a_run_or_rows_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"not a recorded vLLM run \(.*vllm_meta.json"):
        load_recorded_run(tmp_path)
    bad = write_run(tmp_path / "bad", [{**row(0, 1.0), "queued_ts": None}])
    with pytest.raises(ValueError, match=r"no usable request; 1 missing or non-numeric field "
                                         r"\(line 1: queued_ts is None\)"):
        load_recorded_run(bad)


def test_published_summary_is_parsed(tmp_path):
    assert parse_published(SUMMARY) == {
        "ttft": {"mean": {"real": 25.0, "sim": 26.0, "error_pct": 4.0},
                 "p99": {"real": 40.0, "sim": 38.0, "error_pct": -5.0}},
        "e2el": {"p50": {"real": 60.0, "sim": 60.6, "error_pct": 1.0}}}
    folder = write_run(tmp_path / "runs" / "run", [row(0, 1.0)])
    (folder / "validation_summary.txt").write_text(SUMMARY)
    assert load_recorded_run(folder).published["ttft"]["mean"]["error_pct"] == 4.0


# --------------------------------------------------------------------------- setup


def test_an_expert_parallel_run_replays_with_its_data_parallel_layout(tmp_path):
    """DP 2 with expert parallelism: two engines, the experts over their 2 GPUs; a dated
    re-release ("-2507") maps to its catalog entry."""
    moe = load_recorded_run(write_run(tmp_path / "a" / "moe", [row(0, 1.0)],
                                      model="Qwen/Qwen3-30B-A3B-Instruct-2507",
                                      enable_expert_parallel=True, data_parallel_size=2))
    assert catalog_model(moe) == "qwen3-30b-a3b"
    c = vllm_engine_config(moe, "qwen3-30b-a3b", "rtx-pro-6000", "t.csv")
    assert (c.tp, c.ep, c.replicas, c.router) == (1, 2, 2, "least-outstanding")
    plain = load_recorded_run(write_run(tmp_path / "a" / "dp", [row(0, 1.0)],
                                        model="Qwen/Qwen3-30B-A3B", data_parallel_size=2))
    assert vllm_engine_config(plain, "qwen3-30b-a3b", "rtx-pro-6000", "t.csv").ep == 1


def test_unknown_model_and_unknown_gpu_each_get_one_line(tmp_path):
    unknown = load_recorded_run(write_run(tmp_path / "a" / "odd", [row(0, 1.0)], model="org/Odd-7B"))
    with pytest.raises(NotReplayable, match=r"^a/odd: model 'org/Odd-7B' has no catalog entry; "
                                            r"supported: .*Qwen/Qwen3-32B \(qwen3-32b\)"
                                            r".*meta-llama/Llama-3.1-8B \(llama-3.1-8b\)"):
        catalog_model(unknown)
    nogpu = load_recorded_run(write_run(tmp_path / "a" / "x", [row(0, 1.0)], device="Mystery GPU"))
    with pytest.raises(NotReplayable, match=r"^a/x: cannot tell its GPU \(device_name 'Mystery "
                                            r"GPU'.*catalog: .*h100-sxm"):
        run_gpu(nogpu)


def test_gpu_from_device_name_or_folder_and_model_from_catalog(tmp_path):
    by_name = load_recorded_run(write_run(tmp_path / "x" / "a", [row(0, 1.0)],
                                          model="META-LLAMA/Llama-3.1-8B",
                                          device="NVIDIA GeForce RTX 4090"))
    assert (run_gpu(by_name), catalog_model(by_name)) == ("rtx-4090", "llama-3.1-8b")
    by_folder = load_recorded_run(write_run(tmp_path / "RTXPRO6000" / "Qwen3-32B", [row(0, 1.0)],
                                            model="Qwen/Qwen3-32B", device=None))
    assert (run_gpu(by_folder), catalog_model(by_folder)) == ("rtx-pro-6000", "qwen3-32b")
    # a copy under any folder: the recording simulator's config.json names the hardware,
    # which wins over a folder named after another GPU
    copied = write_run(tmp_path / "h100" / "copy", [row(0, 1.0)], device=None)
    (copied / "config.json").write_text(json.dumps(
        {"nodes": [{"instances": [{"hardware": "RTXPRO6000"}, {"hardware": "RTXPRO6000"}]}]}))
    assert run_gpu(load_recorded_run(copied)) == "rtx-pro-6000"
    (copied / "config.json").write_text("{not json")
    assert run_gpu(load_recorded_run(copied)) == "h100-sxm"          # the folder, as before
    given = dataclasses.replace(load_recorded_run(copied), gpu="l40s")   # --gpu
    assert run_gpu(given) == "l40s"


def test_engine_config_is_vllm_defaults_overridden_by_the_run(tmp_path):
    run = load_recorded_run(write_run(
        tmp_path / "runs" / "run", [row(0, 1.0)], tensor_parallel_size=2, max_num_seqs=32,
        max_num_batched_tokens=1024, kv_cache_dtype="fp8",
        kv_cache={"num_gpu_blocks": 777, "block_size": 32, "gpu_memory_utilization": 0.8,
                  "enable_prefix_caching": False}))
    c = vllm_engine_config(run, "llama-3.1-8b", "h100-sxm", "t.csv")
    s = c.scheduler
    assert (c.engine, c.tp, c.weight_dtype, c.kv_dtype) == ("vllm-0.19", 2, "bf16", "fp8")
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.chunked_prefill) == (32, 1024, 1024)
    assert (s.preemption, s.step_composition, c.watermark) == ("recompute", "decode_first", 0.0)
    assert s.max_model_len == 131072                       # the model's, as vLLM derives it
    assert (c.kv_blocks, c.block_size, c.gpu_memory_utilization, c.prefix_caching) == \
        (777, 32, 0.8, False)
    assert c.async_scheduling is True                      # vLLM 0.19's default
    bare = vllm_engine_config(load_recorded_run(write_run(tmp_path / "runs" / "b", [row(0, 1.0)])),
                              "llama-3.1-8b", "rtx-4090", "t.csv")
    assert (bare.kv_blocks, bare.block_size, bare.prefix_caching, bare.gpu_memory_utilization) == \
        (None, 16, True, 0.9)
    # engine kwargs without a recorded KV cache are read too, every one of them: honoured,
    # or the run is not replayed (a setting servelab cannot model is not dropped)
    asked = dict(gpu_memory_utilization=0.5, enable_prefix_caching=False, block_size=32,
                 enable_chunked_prefill=False, async_scheduling=False)
    c = vllm_engine_config(load_recorded_run(write_run(tmp_path / "runs" / "k", [row(0, 1.0)],
                                                       **asked)),
                           "llama-3.1-8b", "h100-sxm", "t.csv")
    assert (c.gpu_memory_utilization, c.prefix_caching, c.block_size,
            c.scheduler.chunked_prefill, c.async_scheduling) == (0.5, False, 32, None, False)
    spec = load_recorded_run(write_run(tmp_path / "runs" / "s", [row(0, 1.0)],
                                       speculative_config={"method": "ngram",
                                                           "num_speculative_tokens": 4}))
    with pytest.raises(NotReplayable, match="--speculative-config.*its JSON is not read"):
        vllm_engine_config(spec, "llama-3.1-8b", "h100-sxm", "t.csv")


# --------------------------------------------------------------------------- metrics


def test_error_metrics_on_numbers_worked_by_hand():
    e = error_metrics([100.0, 200.0, 400.0, np.nan, 50.0], [110.0, 180.0, 400.0, 70.0, np.nan])
    assert e["n"] == 3                                     # pairs with a NaN on either side left out
    assert e["mape_pct"] == pytest.approx(20 / 3)          # |+10%|, |-10%|, 0
    assert e["median_signed_pct"] == pytest.approx(0.0)
    assert e["real"]["mean"] == pytest.approx(700 / 3) and e["sim"]["mean"] == pytest.approx(230.0)
    assert e["stat_error_pct"]["mean"] == pytest.approx((230 - 700 / 3) / (700 / 3) * 100)
    assert (e["real"]["p50"], e["sim"]["p50"]) == (200.0, 180.0)
    assert e["stat_error_pct"]["p50"] == pytest.approx(-10.0)
    assert e["real"]["p90"] == pytest.approx(360.0)        # linear: 200 + 0.8 · 200
    assert error_metrics([np.nan], [1.0]) == {"n": 0}


# --------------------------------------------------------------------------- end to end


def _tiny_runs(tmp_path: Path) -> tuple[Path, Path]:
    rows = [row(i, 0.05 * i, prompt=30 + 7 * i, output=4 + i % 3) for i in range(8)]
    run = write_run(tmp_path / "RTX4090" / "tiny", rows)
    (run / "validation_summary.txt").write_text(SUMMARY)
    moe = write_run(tmp_path / "RTX4090" / "moe", rows[:2], model="Qwen/Qwen3-30B-A3B",
                    enable_expert_parallel=True)
    return run, moe


def test_simulated_latencies_count_from_the_step_boundary_that_queued_the_request():
    """vLLM queues a request between steps; the replay's request is queued at the first
    step its replica starts at or after its arrival (the arrival itself if idle)."""
    from types import SimpleNamespace as NS

    from servelab.validation.real_runs import _queued_at

    class Log(list):
        def table(self):
            return self

    steps = Log([NS(start_s=0.0), NS(start_s=0.5), NS(start_s=0.9), NS(start_s=4.0)])
    records = Log([NS(request_id=0, arrival_s=0.0), NS(request_id=1, arrival_s=0.2),
                   NS(request_id=2, arrival_s=0.9), NS(request_id=3, arrival_s=9.0)])
    other = NS(steps=Log([NS(start_s=0.3)]), records=Log([NS(request_id=4, arrival_s=0.2)]))
    assert _queued_at([NS(steps=steps, records=records), other]) == \
        {0: 0.0, 1: 0.5, 2: 0.9, 3: 9.0, 4: 0.3}


def test_replay_matches_requests_one_to_one(tmp_path):
    run, _ = _tiny_runs(tmp_path)
    rp = replay_run(load_recorded_run(run))
    assert rp.rejected == 0 and rp.errors["e2el"]["n"] == 8
    assert rp.config.model == "llama-3.1-8b" and rp.config.gpu == "rtx-4090"
    assert np.isfinite(rp.sim["ttft"]).all() and (rp.sim["e2el"] > rp.sim["ttft"]).all()
    assert rp.derived["formula_kv_blocks"] == rp.derived["kv_blocks_per_replica"]


def test_cli_writes_the_report_and_lists_what_it_could_not_replay(tmp_path, capsys):
    run, moe = _tiny_runs(tmp_path)
    out = tmp_path / "docs" / "real.md"
    assert main(["validate", "--real-requests", str(run), str(moe), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# Whole runs") and f"--out {out}`" in text
    assert "| RTX4090/tiny | " in text and "| TTFT | mean | 25.0 |" not in text
    assert "- RTX4090/moe: cannot be replayed as recorded: qwen3-30b-a3b weights need" in text
    assert "| first request left out |" in text and "| TTFT | mean |" in text
    data = json.loads((out.parent / "real" / "real-runs.json").read_text())
    assert data["runs"]["RTX4090/tiny"]["published"]["ttft"]["mean"]["error_pct"] == 4.0
    assert list(data["not_replayed"]) == ["RTX4090/moe"]
    # the probe scales every step by the factor that takes the median TPOT error out (the
    # tiny run's simulated TPOTs are about twice the real ones)
    variants = data["runs"]["RTX4090/tiny"]["variants"]
    as_is = variants["as replayed"]["tpot"]["median_signed_pct"]
    label = f"every step x{100 / (100 + as_is):.3f}: the median TPOT error taken out"
    probe = [e for name, e in variants.items() if name.startswith(label)]
    assert as_is > 50 and len(probe) == 1 and abs(probe[0]["tpot"]["median_signed_pct"]) < 5
    assert f"| {label} (bias or spread?) |" in text
    # the MAPEs' range with every step priced within +-1%: the replay as it is lies in it,
    # and the tiny run's TPOTs (about twice the real ones) move with every price
    spread = data["runs"]["RTX4090/tiny"]["sensitivity"]
    for m in ("ttft", "tpot", "e2el"):
        assert spread[m]["min"] <= variants["as replayed"][m]["mape_pct"] <= spread[m]["max"]
        assert spread[m]["min"] <= spread[m]["mean"] <= spread[m]["max"]
    assert spread["tpot"]["max"] - spread["tpot"]["min"] > 1.0
    ttft = variants["as replayed"]["ttft"]["mape_pct"]
    assert (f"| {ttft:.1f}% ({spread['ttft']['min']:.1f}-{spread['ttft']['max']:.1f}%) |"
            in text)
    assert "Every step priced up to 1% slower or faster (seven replays" in text
    assert sorted(p.name for p in (out.parent / "real").glob("*.png")) == [
        "RTX4090_tiny_engine.png", "RTX4090_tiny_latency.png"]
    assert "not replayed: RTX4090/moe" in capsys.readouterr().err


def test_an_out_that_is_not_an_earlier_report_is_refused_before_any_replay(tmp_path, capsys):
    """--out FILE.md replaces an earlier report only: another Markdown file, or a figures
    folder FILE/ holding other files, is refused in one line (and left alone) unless --force."""
    run, _ = _tiny_runs(tmp_path)
    notes = tmp_path / "notes.md"
    notes.write_text("# My notes\n")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "diagram.png").write_bytes(b"png")
    args = ["validate", "--real-requests", str(run), "--no-plots"]
    assert main(args + ["--out", str(notes)]) == 2
    err = capsys.readouterr().err
    assert "--out " + str(notes) + " is not a report of `servelab validate --real-requests`: " \
           "use another --out, or --force to replace it" in err and "RTX4090/tiny" not in err
    assert notes.read_text() == "# My notes\n" and (tmp_path / "notes" / "diagram.png").exists()
    report = tmp_path / "real.md"
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "data.csv").write_text("x\n")
    assert main(args + ["--out", str(report)]) == 2
    assert "its figures' folder" in capsys.readouterr().err and not report.exists()
    assert main(args + ["--out", str(report), "--force"]) == 0
    (tmp_path / "real" / "data.csv").unlink()
    assert main(args + ["--out", str(report)]) == 0        # an earlier report: replaced
    assert report.read_text().startswith("# Whole runs")
    (tmp_path / "plain").write_text("x")                   # FILE is a file: no figures folder
    for force in ([], ["--force"]):
        assert main(args + ["--out", str(tmp_path / "plain.md"), *force]) == 2
        assert "which is a file here: use another --out" in capsys.readouterr().err


def test_runs_of_the_same_gpu_and_model_keep_their_own_sections(tmp_path, capsys):
    """Two recordings under different parents with the same GPU/model folders get labels
    that tell them apart (their sections, figures and JSON entries stay their own); the
    same folder given twice is one error."""
    rows = [row(i, 0.05 * i, prompt=30 + 7 * i, output=4 + i % 3) for i in range(8)]
    day1 = write_run(tmp_path / "day1" / "RTX4090" / "tiny", rows)
    day2 = write_run(tmp_path / "day2" / "RTX4090" / "tiny", rows[:5])
    out = tmp_path / "r.md"
    assert main(["validate", "--real-requests", str(day1), str(day2), "--out", str(out)]) == 0
    data = json.loads((tmp_path / "r" / "real-runs.json").read_text())
    assert sorted(data["runs"]) == ["day1/RTX4090/tiny", "day2/RTX4090/tiny"]
    assert [data["runs"][k]["errors"]["ttft"]["n"] for k in sorted(data["runs"])] == [8, 5]
    assert len(list((tmp_path / "r").glob("*.png"))) == 4
    assert main(["validate", "--real-requests", str(day1), str(day1) + "/", "--out", str(out)]) == 2
    assert "is given twice: replay each run once" in capsys.readouterr().err


def test_a_run_priced_as_another_gpu_says_so_in_its_verdict(tmp_path):
    """--gpu prices a run as another GPU than the one that recorded it: its verdict says
    so (and is reported only), rather than that the GPU has no measured kernels."""
    run, _ = _tiny_runs(tmp_path)
    out = tmp_path / "r.md"
    assert main(["validate", "--real-requests", str(run), "--gpu", "h100-sxm", "--no-plots",
                 "--out", str(out)]) == 0
    row = next(line for line in out.read_text().splitlines() if line.startswith("| RTX4090/tiny"))
    assert "(priced as h100-sxm, recorded on rtx-4090: reported only)" in row


@pytest.mark.parametrize("version, engine", [("0.19.0", "vllm-0.19"), ("v0.19.0", "vllm-0.19"),
                                             ("0.24.1", "vllm-0.24"),
                                             ("0.9.2", "vllm-0.14"), ("0.22.0", "vllm-0.24"),
                                             ("1.0.0", "vllm-0.24"), (None, "vllm-0.19")])
def test_a_run_replays_under_the_preset_of_its_vllm_version_or_the_nearest(version, engine):
    from types import SimpleNamespace as NS
    from servelab.validation.real_runs import run_engine

    assert run_engine(NS(meta={"vllm_version": version})) == engine


def test_the_setup_line_says_when_the_preset_is_not_the_runs_own_version():
    from types import SimpleNamespace as NS
    from servelab.validation.real_runs_report import _version_note

    replay = lambda version, engine: NS(run=NS(meta={"vllm_version": version}),  # noqa: E731
                                        config=NS(engine=engine))
    assert _version_note(replay("0.9.2", "vllm-0.14")) == " (the run's vLLM 0.9.2 has no preset: the nearest)"
    assert _version_note(replay("0.14.1", "vllm-0.14")) == ""
    assert _version_note(replay(None, "vllm-0.19")) == ""


def test_gpu_names_the_gpu_of_a_run_that_cannot_tell_its_own(tmp_path, capsys):
    nogpu = write_run(tmp_path / "a" / "x", [row(0, 1.0), row(1, 1.2)], device=None)
    out = tmp_path / "r.md"
    assert main(["validate", "--real-requests", str(nogpu), "--out", str(out), "--no-plots"]) == 2
    assert "no run could be replayed: a/x: cannot tell its GPU" in capsys.readouterr().err
    assert not out.exists()                              # nothing replayed, nothing written
    assert main(["validate", "--real-requests", str(nogpu), "--gpu", "rtx-4090", "--out", str(out),
                 "--no-plots"]) == 0
    data = json.loads((tmp_path / "r" / "real-runs.json").read_text())
    assert list(data["runs"]) == ["a/x"] and not data["not_replayed"]
    assert "--gpu rtx-4090" in out.read_text()
    assert main(["validate", "--real-requests", str(nogpu), "--gpu", "tpu-v9", "--out", str(out)]) == 2
    assert "unknown GPU 'tpu-v9'" in capsys.readouterr().err


def test_cli_refuses_step_record_options_and_non_markdown_out(tmp_path, capsys):
    run, _ = _tiny_runs(tmp_path)
    out = str(tmp_path / "r.md")
    assert main(["validate", "--real-requests", str(run), "--fit", "--out", out]) == 2
    assert "--fit applies to --run (servelab run directories), not to --real-requests" in \
        capsys.readouterr().err
    assert main(["validate", "--real-requests", str(run), "--out", str(tmp_path / "dir")]) == 2
    assert "expected a Markdown file (FILE.md)" in capsys.readouterr().err


def test_decode_context_is_prompt_plus_tokens_generated_by_then(tmp_path):
    """r0 (prompt 100, 50 tokens from 1 s to 6 s after it was queued) holds 100 + 20 at 3 s;
    r1 (queued at 2 s, prompt 300, 10 tokens from 2.5 s to 4.5 s) 300 + 2.5; r2 is done."""
    run = load_recorded_run(write_run(tmp_path / "a" / "b", [
        row(0, 0.0, prompt=100, output=50, prefill=1.0, decode=5.0),
        row(1, 2.0, prompt=300, output=10, prefill=0.5, decode=2.0),
        row(2, 0.5, prompt=40, output=5, prefill=0.1, decode=0.2)]))
    assert _mean_decode_context(run.requests, 3.0) == int((120 + 302.5) / 2)
    assert _mean_decode_context(run.requests, 0.2) == 0


def test_pure_decode_seconds_take_context_from_kv_or_requests_and_price_each_dp_rank(tmp_path):
    """Seconds with prompt tokens or waiting requests are left out; a data-parallel run's
    running count is split over its ranks; recorded KV usage gives the context."""
    from types import SimpleNamespace as NS

    rows = [row(i, 0.0, prompt=1000, output=400, prefill=0.5, decode=10.0) for i in range(8)]
    folder = write_run(tmp_path / "a" / "ts", rows, kv_cache={"num_gpu_blocks": 1000})
    (folder / "vllm_timeseries.csv").write_text(
        "t,prompt_throughput,gen_throughput,running,waiting,kv_cache_pct\n"
        "1.0,8000.0,100.0,8,0,0.0\n3.0,0.0,400.0,8,0,0.0\n4.0,0.0,400.0,8,2,0.0\n"
        "5.5,0.0,200.0,8,0,0.0\n")
    run = load_recorded_run(folder)
    shapes = []

    def step_time(shape):
        shapes.append((shape.num_decode_seqs, shape.decode_context_sum))
        return 0.01

    replay = NS(run=run, cost_model=NS(data_parallel_ranks=2, step_time=step_time))
    d = decode_seconds(replay)
    assert d["context_from"] == "requests" and d["t_s"].tolist() == [3.0, 5.5]
    assert d["context"].tolist() == [1000 + 100, 1000 + 200]      # 2.5 s and 5 s of 10 s
    assert d["real_ms"].tolist() == [20.0, 40.0] and d["priced_ms"].tolist() == [10.0, 10.0]
    assert shapes == [(4, 4 * 1101), (4, 4 * 1201)]
    (folder / "vllm_timeseries.csv").write_text(
        "t,prompt_throughput,gen_throughput,running,waiting,kv_cache_pct\n"
        "3.0,0.0,400.0,8,0,12.8\n")
    d = decode_seconds(NS(run=load_recorded_run(folder),
                          cost_model=NS(data_parallel_ranks=1, step_time=step_time)))
    assert d["context_from"] == "kv" and d["context"].tolist() == [256]   # 12.8% of 16,000 / 8


# --------------------------------------------------------------------------- public runs


@pytest.fixture(scope="module")
def real_runs() -> dict[str, Path]:
    if not REAL_RUNS.is_dir():
        pytest.skip(f"the public real runs are not at {REAL_RUNS} (../shared absent)")
    return {f"{p.parent.name}/{p.name}": p for p in sorted(REAL_RUNS.glob("*/*"))}


def test_public_runs_read_clean_and_agree_with_the_published_real_figures(real_runs):
    assert len(real_runs) == 4
    for label, path in real_runs.items():
        run = load_recorded_run(path)
        assert (run.source_rows, len(run.requests), run.dropped) == (300, 300, ())
        mean_ttft = np.mean([r.ttft_ms for r in run.requests])
        # the same clock and alignment as LLMServingSim's own "vLLM" column
        assert mean_ttft == pytest.approx(run.published["ttft"]["mean"]["real"], abs=0.1), label
        assert run_gpu(run) in ("rtx-4090", "rtx-pro-6000")
    moe = load_recorded_run(real_runs["RTXPRO6000/Qwen3-30B-A3B-Instruct-2507"])
    assert catalog_model(moe) == "qwen3-30b-a3b"


def test_public_moe_run_replays_with_data_parallel_expert_parallelism(real_runs):
    rp = replay_run(load_recorded_run(real_runs["RTXPRO6000/Qwen3-30B-A3B-Instruct-2507"]))
    c = rp.config
    assert (c.gpu, c.model, c.tp, c.ep, c.replicas) == ("rtx-pro-6000", "qwen3-30b-a3b", 1, 2, 2)
    assert rp.rejected == 0 and rp.errors["e2el"]["n"] == 300
    # one GPU holds half the experts: more room for KV than the whole model leaves
    whole = kv_capacity_blocks("qwen3-30b-a3b", "rtx-pro-6000")
    assert rp.derived["kv_blocks_per_replica"] == rp.derived["formula_kv_blocks"] > 1.5 * whole


def test_public_rtx4090_run_replays_with_its_recorded_engine(real_runs):
    rp = replay_run(load_recorded_run(real_runs["RTX4090/Llama-3.1-8B"]))
    c = rp.config
    assert (c.gpu, c.model, c.tp, c.kv_blocks, c.scheduler.max_num_seqs,
            c.scheduler.max_model_len) == ("rtx-4090", "llama-3.1-8b", 1, 2588, 256, 32768)
    assert rp.rejected == 0 and rp.errors["e2el"]["n"] == 300


def test_a_setup_the_simulator_refuses_is_not_replayed_rather_than_fatal(tmp_path):
    big = load_recorded_run(write_run(tmp_path / "RTX4090" / "big", [row(0, 1.0)],
                                      model="Qwen/Qwen3-32B", device=None))
    with pytest.raises(NotReplayable, match=r"^RTX4090/big: cannot be replayed as recorded: "
                                            r"qwen3-32b weights need .* raise tp"):
        replay_run(big)


def test_when_no_run_can_be_replayed_nothing_is_written_and_the_reason_is_one_line(tmp_path,
                                                                                     capsys):
    """A calibration for another GPU fails every run: an empty report with exit 0 hid it."""
    run, _ = _tiny_runs(tmp_path)
    out = tmp_path / "r.md"
    assert main(["validate", "--real-requests", str(run), "--calibration", "a100-80gb",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("servelab validate: error: no run could be replayed: RTX4090/tiny: ")
    assert "calibration profile is for device 'a100-80gb'" in err and not out.exists()


def test_fit_options_without_fit_are_refused(tmp_path, capsys):
    assert main(["validate", "--run", str(tmp_path), "--loss", "l2", "--split-seed", "5",
                 "--out", str(tmp_path / "v")]) == 2
    assert capsys.readouterr().err == ("servelab validate: error: --split-seed, --loss apply to "
                                       "--fit, which was not given\n")
