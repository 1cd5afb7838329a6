"""`servelab simulate` end to end: run directory, exact rerun from config.json, byte-identical
outputs, one-line errors (exit 2) for everything a user can get wrong, and records written
before a check after the simulation fails (exit 1)."""
from __future__ import annotations

import json
import os

import pytest

from servelab.cli import main
from servelab.reports.runio import read_requests, read_steps
from servelab.simulator.gpus import DTYPE_BYTES
from servelab.simulator.run import SimulationConfig, load_config, run_simulation
from servelab.traces import TraceRecord, Trace, write_csv

FILES = ("config.json", "summary.json", "requests.csv", "steps.csv")


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    """A small two-tenant trace with a shared prefix, written as canonical CSV."""
    records = []
    for i in range(60):
        hashes = (7, 8, 9, 1000 + i) if i % 2 else (2000 + i, 3000 + i, 4000 + i, 5000 + i)
        records.append(TraceRecord(0.05 * i, 40 + (37 * i) % 300, 20 + (53 * i) % 200,
                                   prefix_hashes=hashes, prefix_block_size=128,
                                   tenant="ab"[i % 2], priority=i % 3))
    path = tmp_path_factory.mktemp("trace") / "small.csv"
    write_csv(Trace(tuple(records)), path)
    return path


def simulate(*args: str) -> int:
    return main(["simulate", *args])


def test_run_directory_and_summary(tmp_path, trace_file, capsys):
    out = tmp_path / "run"
    assert simulate("--trace", str(trace_file), "--model", "llama-2-7b", "--gpu", "a100-80gb",
                    "--policy", "fair", "--tenant-weights", "a=2,b=1", "--kv-blocks", "300",
                    "--prefix-caching", "--replicas", "2", "--router", "prefix-affinity",
                    "--slo-ttft-ms", "500", "--out", str(out)) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    printed = capsys.readouterr()
    assert "60 requests finished" in printed.out and "note:" not in printed.out
    assert printed.err == ""                      # no progress bar off a terminal
    requests = read_requests(out / "requests.csv")
    assert [r.request_id for r in requests] == list(range(60))
    assert all(r.status == "finished" for r in requests)
    steps = read_steps(out / "steps.csv")
    assert sum(s.num_steps for s in steps) > len(steps)    # fast-forward was used
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == 60 and set(summary["per_tenant"]) == {"a", "b"}
    doc = json.loads((out / "config.json").read_text())
    assert doc["config"]["policy_options"] == {"weights": {"a": 2.0, "b": 1.0}}
    assert doc["config"]["scheduler"]["max_model_len"] == 4096     # the model's context length
    assert doc["derived"]["kv_blocks_per_replica"] == 300


def test_two_runs_are_byte_identical_and_config_json_reruns_exactly(tmp_path, trace_file):
    args = ["--trace", str(trace_file), "--model", "llama-2-7b", "--gpu", "a100-80gb",
            "--policy", "sjf", "--sjf-predictor", "noisy", "--seed", "3", "--kv-blocks", "120",
            "--preemption", "swap", "--cpu-kv-blocks", "64", "--chunked-prefill", "64"]
    assert simulate(*args, "--out", str(tmp_path / "a")) == 0
    assert simulate(*args, "--out", str(tmp_path / "b")) == 0
    config = load_config(tmp_path / "a" / "config.json")
    assert SimulationConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    run_simulation(config, tmp_path / "c")
    for name in FILES:
        a = (tmp_path / "a" / name).read_bytes()
        assert a == (tmp_path / "b" / name).read_bytes(), name
        assert a == (tmp_path / "c" / name).read_bytes(), name
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["num_preemptions"] > 0


def test_no_fast_forward_gives_the_same_requests(tmp_path, trace_file):
    args = ["--trace", str(trace_file), "--num-requests", "30", "--rate-scale", "2"]
    assert simulate(*args, "--out", str(tmp_path / "ff")) == 0
    assert simulate(*args, "--no-fast-forward", "--out", str(tmp_path / "slow")) == 0
    fast = read_requests(tmp_path / "ff" / "requests.csv")
    slow = read_requests(tmp_path / "slow" / "requests.csv")
    assert len(fast) == 30 and fast[-1].arrival_s == pytest.approx(29 * 0.05 / 2)
    for a, b in zip(fast, slow):
        assert (a.request_id, a.output_tokens, a.num_preemptions) == (b.request_id, b.output_tokens, b.num_preemptions)
        assert a.finish_s == pytest.approx(b.finish_s, rel=1e-9)
    assert all(s.num_steps == 1 for s in read_steps(tmp_path / "slow" / "steps.csv"))


@pytest.mark.parametrize("args, message", [
    (["--model", "gpt-5"], "unknown model 'gpt-5'"),
    (["--gpu", "tpu-v9"], "unknown GPU 'tpu-v9'"),
    (["--model", "llama-2-70b", "--gpu", "l40s"], "weights need"),
    (["--trace", "/nonexistent/trace.csv"], "not 'default', a dataset name"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be <= 1.0"),
    (["--watermark", "0.9"], "--watermark"),
    (["--sjf-predictor", "noisy"], "--sjf-predictor applies to --policy sjf"),
    (["--tenant-weights", "a=1", "--policy", "priority"], "--tenant-weights applies to --policy fair"),
    (["--tp", "3"], "tp=3 must divide"),
    (["--calibration", "/nonexistent/profile.json"], "cannot read calibration profile"),
    (["--no-prefix-caching", "--kv-offload-gb", "4"], "needs --prefix-caching"),
    (["--model", "qwen3-30b-a3b", "--ep", "2", "--replicas", "1"],
     "--replicas 1 must be a multiple of the 2 data-parallel ranks"),
    (["--rate", "5", "--rate-scale", "2"], "--rate 5 sets the mean request rate, which "
     "--rate-scale 2 would multiply again: give one of them"),
    (["--prefix-caching", "--block-manager", "contiguous-max"],
     "--prefix-caching: --block-manager contiguous-max keeps no prefix cache"),
    (["--prefix-caching", "--kv-offload-gb", "300"], "more than its 1 x h100-sxm can have: 256 GiB"),
    (["--prefix-caching", "--kv-offload-gb", "200", "--cpu-kv-blocks", "40000"],
     "+ 78.1 GiB swap pool (--cpu-kv-blocks) needs 278.1 GiB"),
    (["--preemption", "swap", "--cpu-kv-blocks", "1000000"],   # no CPU tier: the same bound
     "1953.1 GiB swap pool (--cpu-kv-blocks) needs 1953.1 GiB of host memory per replica, "
     "more than its 1 x h100-sxm can have: 256 GiB"),
    (["--prefix-caching", "--kv-offload-gb", "0.0001"], "--kv-offload-gb 0.0001 holds no KV block"),
    (["--prefix-caching", "--block-size", "48"], "prefix hashes name 128-token blocks, which the "
     "KV block size 48 does not divide"),
    (["--prefix-caching", "--block-size", "48"], "or turn prefix caching off (--no-prefix-caching)"),
])
def test_user_errors_exit_2_with_one_line(tmp_path, trace_file, capsys, args, message):
    argv = ["--trace", str(trace_file), *args, "--out", str(tmp_path / "x")]
    if args[0] == "--trace":
        argv = [*args, "--out", str(tmp_path / "x")]
    assert simulate(*argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("servelab simulate: error: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("args", [["--chunked-prefill", "lots"], ["--tenant-weights", "a:1"],
                                  ["--block-manager", "buddy"], ["--sjf-max-wait-s", "soon"],
                                  ["--kv-blocks", "0"], ["--max-num-seqs", "0"],
                                  ["--rate-scale", "-1"], ["--policy", "lottery"],
                                  ["--router", "random"], ["--replicas", "0"],
                                  ["--kv-offload-gb", "-1"], ["--kv-offload-gb", "lots"],
                                  ["--kv-offload-gb", "nan"]])
def test_malformed_flags_are_argparse_errors(args, capsys):
    with pytest.raises(SystemExit) as exc:
        simulate(*args, "--out", "unused")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {args[0]}" in err and "Traceback" not in err


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="SimulationConfig.replicas must be >= 1"):
        SimulationConfig(replicas=0)
    with pytest.raises(ValueError, match="bad options for policy 'fcfs'"):
        SimulationConfig(policy_options={"aging_rate": 1.0})
    with pytest.raises(ValueError, match="unknown simulation config key"):
        SimulationConfig.from_dict({"replica": 2})


def test_every_dtype_the_cost_model_prices_simulates(tmp_path, trace_file):
    """fp32 too (what the real backend runs on a CPU, so `validate --simulate` replays CPU
    runs); the KV capacity derived from GPU memory follows the dtype's bytes."""
    blocks = {}
    for dtype in DTYPE_BYTES:
        out = tmp_path / dtype
        assert simulate("--trace", str(trace_file), "--num-requests", "8",
                        "--model", "llama-3.1-8b", "--gpu", "h100-sxm",
                        "--weight-dtype", dtype, "--kv-dtype", dtype,
                        "--out", str(out)) == 0
        config = load_config(out / "config.json")
        assert (config.weight_dtype, config.kv_dtype) == (dtype, dtype)
        assert json.loads((out / "summary.json").read_text())["completed"] == 8
        derived = json.loads((out / "config.json").read_text())["derived"]
        blocks[dtype] = derived["kv_blocks_per_replica"]
    assert blocks["fp8"] > blocks["bf16"] == blocks["fp16"] > blocks["fp32"] > 0


def test_unknown_dtypes_are_refused_with_the_known_ones(capsys):
    with pytest.raises(ValueError, match="SimulationConfig.kv_dtype must be one of 'bf16', "
                                         "'fp16', 'fp8', 'fp32', got 'int4'"):
        SimulationConfig(kv_dtype="int4")
    with pytest.raises(SystemExit) as exc:
        simulate("--weight-dtype", "int4", "--out", "unused")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --weight-dtype" in err and "'int4'" in err
    assert all(f"'{dtype}'" in err for dtype in DTYPE_BYTES), err


def test_the_summary_names_rejections_overload_and_a_missing_slo(tmp_path, trace_file, capsys):
    assert simulate("--trace", str(trace_file), "--rate-scale", "20", "--max-model-len", "300",
                    "--out", str(tmp_path / "a")) == 0
    out = capsys.readouterr().out
    assert "goodput n/a (no SLO" in out
    rejected = json.loads((tmp_path / "a" / "summary.json").read_text())["rejected"]
    assert rejected > 0 and f"rejected: {rejected} x prompt of " in out and "exceeds max_model_len 300" in out
    assert simulate("--trace", "default", "--num-requests", "600", "--rate", "40", "--slo-ttft-ms", "1000",
                    "--out", str(tmp_path / "b")) == 0
    out = capsys.readouterr().out
    assert "of requests within their SLOs" in out
    assert "warning: overloaded: the waiting queue never emptied over the last quarter" in out


def test_a_run_where_no_request_can_be_served_exits_non_zero_with_the_reason(tmp_path, trace_file, capsys):
    assert simulate("--trace", str(trace_file), "--kv-blocks", "2", "--out", str(tmp_path / "a")) == 2
    err = capsys.readouterr().err
    assert "KV cache of 2 blocks (32 tokens) cannot hold any request" in err and err.count("\n") == 1
    assert err.rstrip().endswith("give more --kv-blocks (--num-gpu-blocks-override in --vllm-args)")
    assert not (tmp_path / "a").exists()
    # every prompt is longer than the model may hold: the run happens, rejects everything, says why
    assert simulate("--trace", str(trace_file), "--max-model-len", "30", "--out", str(tmp_path / "b")) == 1
    captured = capsys.readouterr()
    assert "no request finished: 60 rejected (60 x prompt of" in captured.err
    assert "TTFT mean n/a, p99 n/a" in captured.out
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["completed"] == 0 and summary["mean_ttft_ms"] is None


def test_the_collector_is_paused_while_simulating_and_restored_after(tmp_path, trace_file):
    """Loading, simulating and writing run with the cyclic collector paused (a speed-up);
    it is on again afterwards, and a caller that disabled it keeps it disabled."""
    import gc

    from servelab.simulator import run as run_module

    seen = []
    config = SimulationConfig(trace=str(trace_file), model="tiny-llama", gpu="h100-sxm")
    sim = run_module.build_simulation(config)
    cluster_run = sim.cluster.run
    sim.cluster.run = lambda progress=None: seen.append(gc.isenabled()) or cluster_run(progress)
    assert gc.isenabled()
    sim.run()
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        sim = run_module.build_simulation(config)
        sim.run()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(RuntimeError):
        with run_module._gc_paused():
            raise RuntimeError("a failing run")
    assert gc.isenabled()


def test_config_json_reruns_from_another_directory(tmp_path, trace_file, traces_dir, monkeypatch):
    """Relative paths on the command line are stored absolute: the trace file, --trace-dir."""
    import shutil
    here = tmp_path / "here"
    here.mkdir()
    shutil.copy(trace_file, here / "t.csv")
    monkeypatch.chdir(here)
    assert simulate("--trace", "t.csv", "--num-requests", "10", "--out", "a") == 0
    assert simulate("--trace", "azure-conv-2023", "--trace-dir", os.path.relpath(traces_dir, here),
                    "--num-requests", "10", "--out", "b") == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for run in ("a", "b"):
        config = load_config(here / run / "config.json")
        assert config.trace_dir is None or config.trace_dir == str(traces_dir.resolve())
        run_simulation(config, elsewhere / run)
        assert (elsewhere / run / "requests.csv").read_bytes() == (here / run / "requests.csv").read_bytes()


def test_a_progress_bar_on_a_terminal_changes_no_output(tmp_path, trace_file, monkeypatch):
    """On a terminal the run reports progress as it goes (stepping SimPy itself);
    elsewhere SimPy runs its own loop. The run directories are the same bytes."""
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    args = ["--trace", str(trace_file), "--model", "llama-2-7b", "--gpu", "a100-80gb",
            "--policy", "fcfs", "--kv-blocks", "300"]
    assert simulate(*args, "--out", str(tmp_path / "plain")) == 0
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert simulate(*args, "--out", str(tmp_path / "bar")) == 0
    assert "requests" in terminal.getvalue() and "simulated" in terminal.getvalue()
    for name in FILES:
        assert (tmp_path / "plain" / name).read_bytes() == (tmp_path / "bar" / name).read_bytes()


# --------------------------------------------------------------------------- checks after the run
def _break_after_the_run(monkeypatch, how: str) -> None:
    """Make a check after the simulation fail: records that `summarize` refuses (request 3
    scheduled a millisecond before it arrived), or an engine that stopped with work left."""
    from dataclasses import replace

    from servelab.record_table import RecordTable
    from servelab.records import RequestRecord
    from servelab.simulator.engine import Cluster, EngineStalled

    if how == "bad records":
        records = Cluster.request_records

        def early(self):
            return RecordTable.from_records(RequestRecord, [
                replace(r, scheduled_s=r.arrival_s - 1e-3) if r.request_id == 3 else r for r in records(self)])
        monkeypatch.setattr(Cluster, "request_records", early)
    else:
        run = Cluster.run

        def stalled(self, progress=None):
            run(self, progress)
            raise EngineStalled("simulation ended with 59 of 60 requests done: an engine stopped with work left")
        monkeypatch.setattr(Cluster, "run", stalled)


@pytest.mark.parametrize("how, message, files", [
    ("bad records", "request 3: times must satisfy arrival_s <= scheduled_s", set(FILES) - {"summary.json"}),
    ("stalled", "simulation ended with 59 of 60 requests done", set(FILES)),
])
def test_a_failed_check_after_the_run_writes_the_records_then_one_line(tmp_path, trace_file, capsys,
                                                                       monkeypatch, how, message, files):
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text("{}")    # a stale summary must not pass for this run's
    _break_after_the_run(monkeypatch, how)
    assert simulate("--trace", str(trace_file), "--out", str(out), "--force") == 1
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err.count("\n") == 1
    assert printed.err.startswith(f"servelab simulate: error: {message}")
    assert "a bug in servelab" in printed.err and str(out) in printed.err
    assert {p.name for p in out.iterdir()} == files
    requests = read_requests(out / "requests.csv")
    assert len(requests) == 60 and len(read_steps(out / "steps.csv")) > 0
    if how == "bad records":
        assert requests[3].scheduled_s == pytest.approx(requests[3].arrival_s - 1e-3)
    assert load_config(out / "config.json").trace == str(trace_file)


def test_run_simulation_writes_the_records_before_raising_a_failed_check(tmp_path, trace_file, monkeypatch):
    import pickle

    from servelab.simulator.run import RunCheckError

    _break_after_the_run(monkeypatch, "bad records")
    config = SimulationConfig(trace=str(trace_file))
    with pytest.raises(RunCheckError, match="request 3: times must satisfy") as caught:
        run_simulation(config, tmp_path / "run")
    assert caught.value.result.summary is None and len(caught.value.result.requests) == 60
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.json", "requests.csv", "steps.csv"]
    # a sweep worker's failure reaches the driver as its message (a failed point)
    copy = pickle.loads(pickle.dumps(caught.value))
    assert isinstance(copy, ValueError) and str(copy) == str(caught.value) and copy.result is None


def test_out_holding_another_run_is_refused_unless_forced(tmp_path, trace_file, capsys):
    """Rerunning the same command replaces the run with itself; another run, or a folder
    of other files, is refused in one line and left as it was, unless --force."""
    out = tmp_path / "run"
    assert simulate("--trace", str(trace_file), "--out", str(out)) == 0
    assert simulate("--trace", str(trace_file), "--out", str(out)) == 0      # the same run
    capsys.readouterr()
    before = (out / "config.json").read_text()
    assert simulate("--trace", str(trace_file), "--out", str(out), "--policy", "sjf") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"servelab simulate: error: --out {out} holds "
                                                   "another run (its policy differs)")
    assert "--force" in err and (out / "config.json").read_text() == before
    assert simulate("--trace", str(trace_file), "--out", str(out), "--policy", "sjf", "--force") == 0
    assert load_config(out / "config.json").policy == "sjf"
    # a disaggregated run replaced by a co-located one leaves none of its own files
    assert simulate("--trace", str(trace_file), "--out", str(out), "--prefill-replicas", "1",
                    "--decode-replicas", "1", "--force") == 0
    assert (out / "disaggregation.json").exists() and (out / "handoffs.csv").exists()
    assert simulate("--trace", str(trace_file), "--out", str(out), "--force") == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "requests.csv", "steps.csv",
                                                     "summary.json"]
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    assert simulate("--trace", str(trace_file), "--out", str(notes)) == 2
    assert "is not empty and holds no servelab run" in capsys.readouterr().err
    assert [p.name for p in notes.iterdir()] == ["todo.txt"]


def test_a_policy_with_nothing_to_act_on_says_so(tmp_path, traces_dir, capsys):
    """azure-conv-2023 has one tenant and one priority: priority admits as fcfs does."""
    common = ["--trace", "azure-conv-2023", "--trace-dir", str(traces_dir), "--num-requests", "40"]
    assert simulate(*common, "--out", str(tmp_path / "p"), "--policy", "priority") == 0
    out = capsys.readouterr().out
    assert ("note: priority has nothing to act on in this workload (every request has priority 0): "
            "it orders waiting requests as fcfs does") in out
    assert simulate(*common, "--out", str(tmp_path / "f"), "--policy", "sjf") == 0
    assert "nothing to act on" not in capsys.readouterr().out


def test_an_option_is_never_taken_for_a_longer_one(capsys):
    """`servelab run` has --gpu-memory-utilization and no --gpu: argparse's abbreviations
    read --gpu h100-sxm as a utilization and refused it as "expected a number"."""
    from servelab.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["run", "--device", "cpu", "--model", "tiny-llama", "--gpu", "h100-sxm",
              "--out", "unused"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --gpu h100-sxm" in capsys.readouterr().err


def test_a_short_trace_and_an_unknown_tenant_are_noted(tmp_path, trace_file, capsys):
    assert simulate("--trace", str(trace_file), "--model", "llama-2-7b", "--gpu", "a100-80gb",
                    "--num-requests", "100", "--policy", "fair", "--tenant-weights", "a=2,zz=1",
                    "--out", str(tmp_path / "run")) == 0
    out = capsys.readouterr().out
    assert ("note: the trace holds 60 requests, fewer than --num-requests 100: all of them were "
            "replayed") in out
    assert "note: --tenant-weights names zz, which no request of the trace has (its tenants: a, b)" in out


def test_rows_dropped_from_the_trace_are_noted_on_the_console(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,10,5\n0.1,abc,5\n0.2,12,4\n")
    assert simulate("--trace", str(trace), "--on-bad-row", "drop", "--out", str(tmp_path / "run")) == 0
    assert ("note: --on-bad-row drop left out 1 of the trace's rows (config.json's derived.trace "
            "counts them)") in capsys.readouterr().out


def test_requests_stopped_at_max_model_len_are_noted(tmp_path, capsys):
    """A 2,040-token prompt asking for 20 tokens under a 2,048-token limit stops after 8,
    as vLLM stops it: requests.csv says 8, and the console now says why."""
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,2040,20\n0.1,100,5\n")
    assert simulate("--trace", str(trace), "--max-model-len", "2048", "--out", str(tmp_path / "r")) == 0
    assert ("note: 1 request reached --max-model-len 2,048 (prompt + output): an output the "
            "trace asks to run longer stops there, as vLLM stops it") in capsys.readouterr().out
    assert (tmp_path / "r" / "requests.csv").read_text().splitlines()[1].split(",")[2:4] == \
        ["2040", "8"]


def test_a_prefix_router_without_a_prefix_cache_is_noted(tmp_path, trace_file, capsys):
    note = ("servelab simulate: note: --router prefix-affinity routes for prefix-cache hits, "
            "and this run keeps no prefix cache: nothing is reused (give --prefix-caching)")
    for flag, noted in (("--no-prefix-caching", True), ("--prefix-caching", False)):
        assert simulate("--trace", str(trace_file), "--num-requests", "20", flag, "--replicas", "2",
                        "--router", "prefix-affinity", "--out", str(tmp_path / flag)) == 0
        assert (note in capsys.readouterr().err) is noted


def test_vllms_kv_cache_dtype_flag_is_an_alias(tmp_path, trace_file):
    assert simulate("--trace", str(trace_file), "--num-requests", "3", "--kv-cache-dtype", "fp8",
                    "--out", str(tmp_path / "run")) == 0
    config = json.loads((tmp_path / "run" / "config.json").read_text())["config"]
    assert config["kv_dtype"] == "fp8"


def test_expert_parallelism_with_disaggregation_is_refused_for_what_it_is(tmp_path, capsys):
    """--ep 2 above --tp 1 makes two data-parallel ranks (replicas); the refusal is about
    expert parallelism, not about a --replicas the user never gave."""
    assert simulate("--num-requests", "5", "--model", "qwen3-30b-a3b", "--ep", "2",
                    "--prefill-replicas", "1", "--decode-replicas", "1",
                    "--out", str(tmp_path / "x")) == 2
    assert capsys.readouterr().err == ("servelab simulate: error: disaggregated prefill/decode is "
                                       "not modelled with expert parallelism (--ep)\n")


def test_a_rerun_from_config_json_guards_out_as_simulate_does(tmp_path, trace_file, capsys):
    from servelab.simulator.run import main as rerun

    first, other = tmp_path / "first", tmp_path / "other"
    assert simulate("--trace", str(trace_file), "--num-requests", "5", "--out", str(first)) == 0
    assert simulate("--trace", str(trace_file), "--num-requests", "6", "--out", str(other)) == 0
    config = str(first / "config.json")
    assert rerun([config, "--out", str(first)]) == 0             # the same run: rewritten
    assert rerun([config, "--out", str(other)]) == 2             # another run: refused
    assert "holds another run" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert rerun([config, "--out", str(tmp_path / "file")]) == 2
    assert rerun([config, "--out", str(other), "--force"]) == 0


def _files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_run_directory_is_replaced_whole_or_not_at_all(tmp_path, trace_file, monkeypatch):
    """An interrupt while a run's files are written left the new config.json beside the
    old run's summary and tables; now the files go in together, so the folder keeps the
    earlier run, and no staging folder is left behind."""
    import servelab.reports.runio as runio

    out = tmp_path / "run"
    assert simulate("--trace", str(trace_file), "--num-requests", "5", "--out", str(out)) == 0
    before = _files(out)
    real = runio.write_steps

    def interrupted(path, records):
        real(path, records)
        raise KeyboardInterrupt
    monkeypatch.setattr(runio, "write_steps", interrupted)
    assert simulate("--trace", str(trace_file), "--num-requests", "6", "--out", str(out),
                    "--force") == 130     # "interrupted", as at Ctrl-C
    assert _files(out) == before


def test_a_run_written_into_its_out_meanwhile_is_not_mixed_with_nor_replaced(tmp_path, trace_file):
    """Two commands into one --out at once both passed the first check and both wrote: one
    run's tables could end up beside the other's config. At the move, --out is checked
    again, under a lock."""
    from servelab.outdir import check_out_dir
    from servelab.simulator.run import SimulationConfig, run_simulation, write_run_dir

    out = tmp_path / "run"
    first = run_simulation(SimulationConfig(trace=str(trace_file), num_requests=5), out)
    before = _files(out)
    second = run_simulation(SimulationConfig(trace=str(trace_file), num_requests=6))
    with pytest.raises(ValueError, match="holds another run"):
        write_run_dir(second, out, check=lambda d: check_out_dir(d, second.config.to_dict(),
                                                                  force=False))
    assert _files(out) == before
    import fcntl                               # POSIX: where runs lock their directory
    held = os.open(out, os.O_RDONLY)           # another command moving its files in now
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(ValueError, match="another command is writing"):
            write_run_dir(first, out)
    finally:
        os.close(held)
    assert _files(out) == before and not list(out.glob(".staging-*"))
    write_run_dir(first, out)                  # the lock released: written, nothing left over
    assert _files(out) == before


def test_a_max_model_len_past_the_models_context_is_refused_as_vllm_does(tmp_path, capsys):
    """vLLM's _get_and_verify_max_len refuses it (positions past the context give wrong
    outputs); a 200k-token prompt on Llama-3.1-8B (131,072) used to be priced silently."""
    assert simulate("--max-model-len", "1000000", "--out", str(tmp_path / "x")) == 2
    assert capsys.readouterr().err == (
        "servelab simulate: error: --max-model-len 1,000,000 is longer than llama-3.1-8b's "
        "context of 131,072 tokens (its config.json's max_position_embeddings and RoPE "
        "scaling); vLLM refuses it too\n")
    assert not (tmp_path / "x").exists()


def test_the_context_length_follows_vllms_rope_scaling_rules():
    from servelab.models import ModelSpec, load_model_spec

    raw = dict(load_model_spec("tiny-llama").hf_config, max_position_embeddings=4096)
    length = lambda rope: ModelSpec.from_hf_config({**raw, "rope_scaling": rope}).context_length
    assert length(None) == 4096
    assert length({"rope_type": "llama3", "factor": 8.0}) == 4096      # counted already
    assert length({"type": "linear", "factor": 2.0}) == 8192
    assert length({"rope_type": "yarn", "factor": 4.0,
                   "original_max_position_embeddings": 2048}) == 8192
    assert load_model_spec("deepseek-v3").context_length == 163840    # yarn 40 x 4096


@pytest.mark.parametrize("flags, line", [
    (["--tenant-burst", "3"], "--tenant-burst applies with --tenant-rate, which was not given"),
    (["--shed-default-slo-ms", "500"],
     "--shed-default-slo-ms applies with --shed-from-priority, which was not given"),
])
def test_an_admission_setting_without_its_rule_is_refused_not_dropped(tmp_path, capsys, flags, line):
    assert simulate(*flags, "--out", str(tmp_path / "x")) == 2
    assert capsys.readouterr().err == f"servelab simulate: error: {line}\n"


def test_an_admission_setting_with_its_rule_reaches_the_config(tmp_path):
    out = tmp_path / "x"
    assert simulate("--num-requests", "20", "--tenant-rate", "2", "--tenant-burst", "3",
                    "--out", str(out)) == 0
    admission = json.loads((out / "config.json").read_text())["config"]["scheduler"]["admission"]
    assert (admission["tenant_rate"], admission["tenant_burst"]) == (2.0, 3.0)


def test_a_catalog_models_hugging_face_id_names_it(tmp_path):
    """As --vllm-args reads `vllm serve meta-llama/Llama-3.1-8B`; the run records the
    catalog name (a slash would nest sweep folders)."""
    out = tmp_path / "x"
    assert simulate("--model", "Meta-Llama/Llama-3.1-8B", "--num-requests", "5", "--out", str(out)) == 0
    assert json.loads((out / "config.json").read_text())["config"]["model"] == "llama-3.1-8b"


def test_speculative_knobs_beside_speculative_off_are_refused(tmp_path, capsys):
    assert simulate("--speculative", "off", "--num-speculative-tokens", "7",
                    "--out", str(tmp_path / "x")) == 2
    assert capsys.readouterr().err == ("servelab simulate: error: --num-speculative-tokens "
                                       "configures speculative decoding, which --speculative off "
                                       "turns off\n")


@pytest.mark.parametrize("model", ["llama-3.1-8b", "qwen3-30b-a3b"])
def test_data_parallel_ranks_beside_disaggregated_pools_are_named_as_given(tmp_path, capsys, model):
    """The refusal named --replicas or --ep, flags the user never gave."""
    assert simulate("--model", model, "--prefill-replicas", "1", "--decode-replicas", "1",
                    "--dp", "2", "--out", str(tmp_path / "x")) == 2
    assert capsys.readouterr().err == (
        "servelab simulate: error: --dp is not modelled with disaggregated pools: a "
        "disaggregated run sizes its pools with --prefill-replicas and --decode-replicas\n")


def test_a_run_fitted_profile_on_another_setup_is_noted(tmp_path, capsys):
    """docs/validation.md: a profile fitted to real runs does not transfer to another model."""
    from servelab.simulator.calibration import packaged

    fitted = packaged("h100-sxm").with_fit({"gemm": 1.2}, 0.02, {}, model="llama-3.1-8b", tp=1)
    path = fitted.save(tmp_path / "fitted.json")
    assert fitted.setup_note("llama-3.1-8b", 1, "bf16", "bf16") is None
    assert packaged("h100-sxm").setup_note("qwen3-32b", 2, "fp8", "fp8") is None   # kernel-level
    common = ["--num-requests", "5", "--engine", "servelab", "--calibration", str(path)]
    assert simulate(*common, "--out", str(tmp_path / "same")) == 0
    assert "note:" not in capsys.readouterr().err
    assert simulate(*common, "--model", "llama-2-7b", "--tp", "2", "--out", str(tmp_path / "x")) == 0
    assert ("servelab simulate: note: the calibration profile was fitted to real runs of "
            "llama-3.1-8b at tp 1, bf16 weights, bf16 KV; this run is llama-2-7b at tp 2, bf16 "
            "weights, bf16 KV: its step overhead") in capsys.readouterr().err


def test_a_block_manager_without_a_prefix_cache_runs_and_records_none(tmp_path):
    """Under a vLLM preset (prefix caching on by default) a contiguous baseline runs without
    one, and its config, summary and request table say so (no prefix-cache keys, no
    cached-token columns), as outputs.md describes a run that kept no prefix cache."""
    out = tmp_path / "cmax"
    assert simulate("--trace", "default", "--rate", "2", "--num-requests", "20",
                    "--block-manager", "contiguous-max", "--out", str(out)) == 0
    assert load_config(out / "config.json").prefix_caching is False
    assert "prefix_cache_hit_rate" not in json.loads((out / "summary.json").read_text())
    assert "cached_tokens" not in (out / "requests.csv").read_text().splitlines()[0]
