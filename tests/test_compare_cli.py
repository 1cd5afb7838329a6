"""`servelab compare` flags: every simulate flag, the sweep lists, and points built exactly as
`servelab simulate` builds a run from the same flags."""
from __future__ import annotations

import argparse

import pytest

from servelab.cli import CLIError, build_parser, main
from servelab.simulator.cli import config_from_args
from servelab.sweeps.cli import build_points

COMMON = ["--trace", "default", "--num-requests", "40", "--kv-blocks", "300"]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def compare(*argv: str):
    args = build_parser().parse_args(["compare", *COMMON, "--out", "unused", *argv])
    return build_points(args, args.func.keywords["parser"])


def simulate_config(*argv: str):
    return config_from_args(build_parser().parse_args(["simulate", *COMMON, "--out", "unused", *argv]))


def test_compare_accepts_every_simulate_flag():
    commands = _subparsers(build_parser())
    simulate = set(commands["simulate"]._option_string_actions)
    compare_flags = set(commands["compare"]._option_string_actions)
    assert simulate <= compare_flags
    assert {"--policies", "--rates", "--block-sizes", "--chunk-sizes", "--preemptions", "--block-managers",
            "--gpus", "--models", "--tps", "--workers", "--ray", "--ray-address"} <= compare_flags


def test_each_point_is_the_config_simulate_builds_from_the_same_flags():
    axes, points = compare("--policies", "fcfs,sjf", "--rates", "10,20.5", "--chunk-sizes", "256,off",
                           "--sjf-predictor", "noisy", "--seed", "3", "--slo-ttft-ms", "500",
                           "--max-num-seqs", "64")
    assert axes == {"chunked_prefill": (256, "off"), "policy": ("fcfs", "sjf"), "rate": (10.0, 20.5)}
    assert len(points) == 8
    for point in points:
        labels = dict(point.labels)
        flags = ["--policy", labels["policy"], "--rate", f"{labels['rate']}", "--chunked-prefill",
                 str(labels["chunked_prefill"]),
                 "--seed", "3", "--slo-ttft-ms", "500", "--max-num-seqs", "64"]
        if labels["policy"] == "sjf":   # a policy flag applies to its own policy's points only
            flags += ["--sjf-predictor", "noisy"]
        assert point.config == simulate_config(*flags)
    sjf = next(p for p in points if p.config.policy == "sjf")
    assert sjf.config.policy_options == {"predictor": "noisy", "seed": 3}
    assert next(p for p in points if p.config.policy == "fcfs").config.policy_options == {}


def test_defaults_compare_the_four_policies_at_the_trace_rate():
    axes, points = compare()
    assert axes == {"policy": ("fcfs", "priority", "sjf", "fair"), "rate": (None,)}
    assert [p.config.policy for p in points] == ["fcfs", "priority", "sjf", "fair"]
    assert compare("--policy", "sjf")[0]["policy"] == ("sjf",)


def test_model_sweep_takes_each_models_context_length_and_comes_first():
    axes, points = compare("--models", "llama-2-7b,mistral-7b", "--policies", "fcfs", "--rates", "5",
                           "--block-managers", "paged,contiguous-pow2", "--tps", "1,2")
    assert list(axes) == ["model", "tp", "block_manager", "policy", "rate"]
    lengths = {p.config.model: p.config.scheduler.max_model_len for p in points}
    assert lengths == {"llama-2-7b": 4096, "mistral-7b": simulate_config("--model", "mistral-7b")
                       .scheduler.max_model_len}
    assert {(p.config.tp, p.config.block_manager) for p in points} == {
        (1, "paged"), (2, "paged"), (1, "contiguous-pow2"), (2, "contiguous-pow2")}


@pytest.mark.parametrize("argv, message", [
    (["--rates", "10,0"], "expected a finite number > 0"),
    (["--rates", "10,,20"], "comma-separated list"),
    (["--block-sizes", "16,16"], "listed twice"),
    (["--chunk-sizes", "256,many"], "expected an integer"),
    (["--preemptions", "recompute,pause"], "expected one of recompute, swap"),
    (["--block-managers", "paged,buddy"], "expected one of paged"),
])
def test_bad_lists_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        compare(*argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--block-size", "32", "--block-sizes", "16,32"], "give --block-size or --block-sizes, not both"),
    (["--rate", "3", "--rates", "4,5"], "give --rate or --rates, not both"),
    (["--policies", "fcfs,priority", "--sjf-predictor", "noisy"], "--sjf-predictor configures --policy sjf"),
    (["--gpus", "h100-sxm,tpu-v9"], "unknown GPU 'tpu-v9'"),
    (["--policies", "fcfs,lottery"], "unknown policy 'lottery'"),
    (["--models", "llama-2-7b,gpt-9"], "gpt-9"),
])
def test_inconsistent_flags_are_clear_errors(argv, message):
    with pytest.raises(CLIError, match=message):
        compare(*argv)


def test_a_grid_where_no_request_fits_fails_with_the_reason_once(tmp_path, capsys):
    assert main(["compare", *COMMON[:4], "--kv-blocks", "2", "--rates", "5", "--policies", "fcfs,sjf",
                 "--workers", "1", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("servelab compare: error: every point failed, no report written: ValueError: "
                              "KV cache of 2 blocks (32 tokens) cannot hold any request")
    assert not (tmp_path / "x" / "index.html").exists()


def test_a_cpu_tier_the_machine_cannot_hold_fails_before_the_sweep(tmp_path, capsys):
    assert main(["compare", *COMMON, "--prefix-caching", "--kv-offload-gb", "300", "--gpus",
                 "h100-sxm,h200", "--policies", "fcfs,lpm", "--workers", "1",
                 "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err == ("servelab compare: error: gpu=h100-sxm: --kv-offload-gb 300 "
                   "needs 300.0 GiB of host memory "
                   "per replica, more than its 1 x h100-sxm can have: 256 GiB (256 GiB host "
                   "memory per GPU on the reference server, host_memory_gb in the GPU catalog)\n")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("argv, message", [
    (["--rates", "-5,8"], "argument --rates: expected a finite number > 0, got '-5'"),
    (["--tps", "-2"], "argument --tps: expected an integer >= 1, got -2"),
    (["--slo-ttft-ms", "-100"], "argument --slo-ttft-ms: expected a finite number > 0, got '-100'"),
    (["--no-such-flag", "3"], "unrecognized arguments: --no-such-flag 3"),
])
def test_option_errors_are_one_line_with_a_hint_and_negative_values_reach_the_validator(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["compare", *argv, "--out", "unused"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err == f"servelab compare: error: {message} (see 'servelab compare --help')\n"


def test_a_negative_rate_reaches_the_config_check(tmp_path, capsys):
    assert main(["simulate", "--rate", "-.5", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err == "servelab simulate: error: --rate must be a finite number > 0, got -0.5\n"


def test_compare_into_a_folder_of_another_grid_says_so(tmp_path, capsys):
    out = str(tmp_path / "cmp")
    base = ["compare", *COMMON, "--policies", "fcfs", "--workers", "1", "--out", out]
    assert main([*base, "--rates", "5"]) == 0
    assert "held a comparison of another grid" not in capsys.readouterr().err
    assert main([*base, "--rates", "5"]) == 0          # the same grid again: nothing to say
    assert "held a comparison of another grid" not in capsys.readouterr().err
    assert main([*base, "--rates", "5,8"]) == 0
    err = capsys.readouterr().err
    assert (f"compare: note: {out} held a comparison of another grid (1 point); its report is "
            "replaced by this one's (1 of its stored points are reused") in err


def test_engines_sweep_like_any_knob_each_point_with_its_engines_defaults():
    axes, points = compare("--engines", "vllm-0.24,servelab", "--policies", "fcfs")
    assert axes["engine"] == ("vllm-0.24", "servelab")
    by_engine = {p.config.engine: p.config for p in points}
    assert by_engine == {e: simulate_config("--engine", e, "--policy", "fcfs")
                         for e in ("vllm-0.24", "servelab")}
    assert by_engine["vllm-0.24"].prefix_caching and not by_engine["servelab"].prefix_caching


@pytest.mark.parametrize("command", ["compare", "capacity"])
def test_a_layout_the_model_cannot_take_fails_before_the_sweep(tmp_path, capsys, command):
    assert main([command, *COMMON, "--tps", "1,3", "--policies", "fcfs", "--workers", "1",
                 "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(f"servelab {command}: error: tp=3 must divide")   # said once
    assert err[-1].endswith("tp=3 must divide llama-3.1-8b's attention heads (32) and intermediate "
                            "size (14336)")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("command", ["compare", "capacity", "plan"])
def test_a_sweep_never_writes_over_another_commands_report_or_foreign_files(tmp_path, capsys,
                                                                            command):
    """docs/outputs.md: an --out holding another run or other files is refused unless
    --force, for the sweeps as for simulate; a sweep's own folder resumes."""
    other = "plan" if command != "plan" else "capacity"
    cases = {"simulate run": {"config.json": "{}", "summary.json": "{}"},
             "notes": {"notes.txt": "mine"},
             other: {f"{other}.json": "{}", "sweep.json": "{}", "report.md": "# theirs"}}
    for name, files in cases.items():
        out = tmp_path / name.replace(" ", "-")
        out.mkdir()
        for file, text in files.items():
            (out / file).write_text(text)
        assert main([command, *COMMON, "--policies", "fcfs", "--workers", "1",
                     "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"servelab {command}: error: --out {out} holds ") and "--force" in err
        assert err.count("\n") == 1
        assert {p.name: p.read_text() for p in out.iterdir()} == files       # untouched


def test_check_sweep_dir_lets_a_sweep_resume_and_force_replaces_the_other_report(tmp_path):
    from servelab.outdir import SWEEP_LAYOUT, check_sweep_dir
    from servelab.sweeps.cli import drop_other_reports
    from servelab.sweeps.sweep import LOCK_FILE, SWEEP_FILE

    assert {LOCK_FILE, SWEEP_FILE} <= SWEEP_LAYOUT
    out = tmp_path / "cap"
    (out / "runs").mkdir(parents=True)
    check_sweep_dir(out, "compare", force=False)           # interrupted: runs only, any sweep
    for file in ("capacity.json", SWEEP_FILE, "report.md", LOCK_FILE):
        (out / file).write_text("{}")
    check_sweep_dir(out, "capacity", force=False)          # its own report: resumes
    with pytest.raises(ValueError, match="holds a `servelab capacity` report"):
        check_sweep_dir(out, "compare", force=False)
    check_sweep_dir(out, "compare", force=True)            # forced: no refusal
    drop_other_reports(out, "compare")                     # and when the sweep starts
    assert not (out / "capacity.json").exists() and (out / SWEEP_FILE).exists()
    (out / "x").write_text("")
    with pytest.raises(ValueError):
        check_sweep_dir(tmp_path / "cap" / "x", "plan", force=False)   # not a directory


def test_a_length_only_trace_without_rates_is_refused_before_the_sweep(tmp_path, capsys):
    trace = tmp_path / "lengths.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n50,5\n60,6\n")
    out = tmp_path / "x"
    assert main(["compare", "--trace", str(trace), "--policies", "fcfs,sjf", "--workers", "1",
                 "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"servelab compare: error: {trace} is a length-only table (no timestamps): give a "
        "request rate for the synthetic arrival process (--rate, or --rates in a sweep; rate= "
        "from Python)\n")
    assert not out.exists()
    assert main(["compare", "--trace", str(trace), "--policies", "fcfs", "--rates", "2",
                 "--workers", "1", "--out", str(out)]) == 0


@pytest.mark.parametrize("command", ["compare", "capacity"])
def test_a_pp_above_the_models_layers_in_a_sweep_is_one_line_before_any_run(tmp_path, capsys, command):
    """As a tp that does not divide the heads: refused before the sweep (it ran the other
    points and failed each pp=40 one)."""
    out = tmp_path / "s"
    rc = main([command, "--trace", "default", "--policies", "fcfs", "--num-requests", "50",
               "--pp", "1,40", *(["--rates", "5"] if command == "compare" else []), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err == (f"servelab {command}: error: pp=40 exceeds llama-3.1-8b's 32 layers: "
                               "every pipeline stage needs one at least (pp <= 32)\n"), err
    assert not (out / "runs").exists()
