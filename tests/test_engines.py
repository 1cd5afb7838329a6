"""Engine presets (`--engine`) and reading a `vllm serve` command line (`--vllm-args`)."""
from __future__ import annotations

import contextlib
import json

import pytest

from servelab.cli import main
from servelab.engines import DEFAULT_ENGINE, PRESETS, get_preset
from servelab.vllm_args import catalog_model, translate


def test_every_vllm_preset_names_its_engine_version_and_the_default_is_the_newest():
    versions = {p.name: p.engine_version for p in PRESETS.values()}
    assert versions == {"vllm-0.14": "0.14.0", "vllm-0.19": "0.19.0", "vllm-0.24": "0.24.0",
                        "servelab": None}
    assert DEFAULT_ENGINE == "vllm-0.24"
    with pytest.raises(ValueError, match="unknown engine 'vllm-9'; known: vllm-0.14"):
        get_preset("vllm-9")


def test_a_vllm_command_line_becomes_servelab_options():
    parsed = translate("vllm serve meta-llama/Llama-3.1-8B-Instruct --max-num-seqs 256 -tp 2 "
                       "--max_num_batched_tokens=4096 --host 0.0.0.0 --port 8000 "
                       "--no-enable-prefix-caching --kv-cache-dtype fp8 --dtype bfloat16 "
                       "--long-prefill-token-threshold 512 -dp 2 --trust-remote-code",
                       catalog=catalog_model)
    assert parsed.values == {
        "model": "llama-3.1-8b", "max_num_seqs": 256, "tp": 2, "max_num_batched_tokens": 4096,
        "prefix_caching": False, "chunked_prefill": 512, "replicas": 2,
        "router": "least-outstanding", "weight_dtype": "bf16", "kv_dtype": "fp8"}
    assert parsed.notes == ["--vllm-args: meta-llama/Llama-3.1-8B-Instruct is priced as the "
                            "catalog's llama-3.1-8b (a variant has its base model's shapes)"]


def test_switches_take_an_explicit_true_or_false_as_older_vllm_did():
    assert translate("--enable-chunked-prefill false").values == {"chunked_prefill": "off"}
    assert translate("--enable-prefix-caching=False").values == {"prefix_caching": False}
    assert translate("--no-enable-prefix-caching false").values == {"prefix_caching": True}
    assert translate("--enable-prefix-caching true -tp 2").values == {"prefix_caching": True, "tp": 2}


def test_lengths_read_as_vllm_reads_them():
    assert [translate(f"--max-model-len {t}").values["max_model_len"]
            for t in ("32k", "32K", "25.6k", "4096")] == [32000, 32768, 25600, 4096]
    with pytest.raises(ValueError, match="decimals go with k, m, g or t"):
        translate("--max-model-len 1.5K")


def test_dtypes_resolve_whatever_their_order():
    assert translate("--kv-cache-dtype auto --dtype float16").values == {
        "weight_dtype": "fp16", "kv_dtype": "fp16"}
    assert translate("--dtype bfloat16 --quantization fp8").values == {
        "weight_dtype": "fp8", "kv_dtype": "bf16"}
    # 'auto' is the activations' dtype (bf16 unless --dtype says otherwise), not "unset"
    assert translate("--kv-cache-dtype auto").values == {"kv_dtype": "bf16"}
    assert translate("--long-prefill-token-threshold 0").values == {"chunked_prefill": "budget"}
    assert translate("--no-enable-chunked-prefill").values == {"chunked_prefill": "off"}
    assert translate("-pp 2 -tp 8").values == {"pp": 2, "tp": 8}


def test_approximated_flags_give_one_note_each():
    parsed = translate("--enforce-eager --swap-space 4 -O3")
    assert [n.split(":")[0] for n in parsed.notes] == [
        "--vllm-args --enforce-eager", "--vllm-args --swap-space", "--vllm-args -O"]
    assert parsed.values == {}
    # vLLM's data-parallel deployment flags: EPLB is noted, process layout has no effect
    multi = translate("-dp 4 --data-parallel-size-local 2 --api-server-count 2 "
                      "--enable-expert-parallel --enable-eplb --stream-interval 5")
    assert multi.values == {"replicas": 4, "router": "least-outstanding", "dp": 4}
    assert [n.split(":")[0] for n in multi.notes] == ["--vllm-args --enable-eplb"]


@pytest.mark.parametrize("line, message", [
    ("--speculative-config '{\"num_speculative_tokens\": 3}'", "give servelab's --speculative"),
    ("--kv-transfer-config '{}'", "--prefill-replicas N --decode-replicas M"),
    ("--frobnicate 3", "--frobnicate: not a vLLM flag servelab knows; it reads"),
    ("--max-num-seqs", "--max-num-seqs: expects a value"),
    ("--max-num-seqs many", "expected an integer, got 'many'"),
    ("--gpu-memory-utilization 1.5", "expected a fraction in (0, 1]"),
    ("--quantization awq", "--quantization awq: servelab models fp8"),
    ("m1 m2", "unexpected word 'm2'"),
    ("--model 'unclosed", "cannot split the command line"),
])
def test_flags_servelab_cannot_model_are_refused_in_one_line(line, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        translate(line)


def test_expert_parallelism_makes_the_data_parallel_ranks_one_deployment():
    assert translate("-dp 2 --enable-expert-parallel").values == {
        "replicas": 2, "router": "least-outstanding", "dp": 2}
    assert translate("--enable-expert-parallel -tp 2").values == {"tp": 2, "dp": 1}


def test_expert_parallelism_on_a_dense_model_is_said_to_change_nothing():
    """It was accepted without a word (--ep on a dense model is refused: that flag asks
    for something; vLLM's switch on a dense model is a no-op there too)."""
    out = translate("vllm serve meta-llama/Llama-3.1-8B -dp 2 --enable-expert-parallel",
                    catalog=catalog_model)
    assert "dp" not in out.values and out.values["replicas"] == 2
    assert out.notes[-1] == ("--vllm-args --enable-expert-parallel: llama-3.1-8b has no experts to "
                             "spread; the switch changes nothing (as in vLLM)")


def test_served_models_map_to_the_catalog(tmp_path):
    assert catalog_model("mistralai/Mistral-7B") == "mistral-7b"
    assert catalog_model("meta-llama/Llama-3.1-70B-Instruct") == "llama-3.1-70b"
    assert catalog_model(str(tmp_path)) == str(tmp_path)    # a local checkpoint folder
    with pytest.raises(ValueError, match="'org/Unknown-1B' is not in servelab's catalog"):
        catalog_model("org/Unknown-1B")
    variants = {"mistralai/Mixtral-8x7B-Instruct-v0.1": "mixtral-8x7b",
                "meta-llama/Llama-2-7b-chat-hf": "llama-2-7b",
                "meta-llama/Meta-Llama-3.1-8B-Instruct": "llama-3.1-8b",
                "Qwen/Qwen3-30B-A3B-Instruct-2507": "qwen3-30b-a3b",
                "deepseek-ai/DeepSeek-V3-0324": "deepseek-v3",
                "Qwen/Qwen3-235B-A22B-FP8": "qwen3-235b-a22b"}
    assert {served: catalog_model(served) for served in variants} == variants


def test_a_variant_is_named_and_an_fp8_checkpoint_sets_fp8_weights():
    fp8 = translate("vllm serve Qwen/Qwen3-235B-A22B-FP8 -tp 8", catalog=catalog_model)
    assert fp8.values == {"model": "qwen3-235b-a22b", "tp": 8, "weight_dtype": "fp8"}
    assert fp8.notes == ["--vllm-args: Qwen/Qwen3-235B-A22B-FP8 is priced as the catalog's "
                         "qwen3-235b-a22b with fp8 weights (a variant has its base model's shapes)"]
    assert translate("vllm serve meta-llama/Llama-3.1-8B", catalog=catalog_model).notes == []
    # vLLM's --dtype is the activations' dtype: an FP8 checkpoint's weights stay FP8
    for line in ("Qwen/Qwen3-235B-A22B-FP8 --dtype bfloat16", "deepseek-ai/DeepSeek-V3 --dtype bfloat16"):
        assert translate(f"vllm serve {line}", catalog=catalog_model).values["weight_dtype"] == "fp8"


def test_deepseek_v3_runs_in_its_checkpoints_fp8_unless_told_otherwise(tmp_path):
    line = "vllm serve deepseek-ai/DeepSeek-V3 -tp 8"
    assert main(["simulate", "--num-requests", "5", "--gpu", "h200", "--vllm-args", line,
                 "--out", str(tmp_path / "v3")]) == 0
    assert _config(tmp_path / "v3")["config"]["weight_dtype"] == "fp8"
    assert main(["simulate", "--num-requests", "5", "--out", str(tmp_path / "llama")]) == 0
    assert _config(tmp_path / "llama")["config"]["weight_dtype"] == "bf16"


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_a_cpu_backend_schedules_synchronously_under_a_vllm_preset(tmp_path, capsys):
    """vLLM PR #31525 turns asynchronous scheduling off for CPU backends."""
    from servelab.cli import build_parser
    from servelab.simulator.cli import config_from_args

    common = ["simulate", "--num-requests", "2", "--model", "tiny-llama", "--gpu", "cpu"]
    assert main([*common, "--out", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("engine vllm-0.24; kernels priced by the bare roofline: no measured "
                          "kernels for cpu")
    assert not _config(tmp_path / "c")["config"].get("async_scheduling", False)
    asked = build_parser().parse_args([*common, "--async-scheduling", "--out", "unused"])
    assert config_from_args(asked).async_scheduling is True             # asked for


def test_simulate_mirrors_the_engine_and_says_which_kernels_price_it(tmp_path, capsys):
    assert main(["simulate", "--num-requests", "20", "--out", str(tmp_path / "v")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("engine vllm-0.24, asynchronous scheduling; kernels priced by ")
    config = _config(tmp_path / "v")
    c, cost = config["config"], config["derived"]["cost_model"]
    assert c["engine"] == "vllm-0.24" and c["async_scheduling"] is True
    assert (c["scheduler"]["max_num_seqs"], c["scheduler"]["max_num_batched_tokens"]) == (1024, 8192)
    assert c["scheduler"]["chunked_prefill"] == 8192
    assert (c["prefix_caching"], c["watermark"]) == (True, 0.0)
    assert cost["engine"] == "vllm-0.24" and cost["calibration_source"] in out

    assert main(["simulate", "--num-requests", "20", "--engine", "servelab",
                 "--out", str(tmp_path / "s")]) == 0
    c = _config(tmp_path / "s")["config"]
    assert "engine" not in c or c["engine"] == "servelab"
    assert (c["scheduler"]["chunked_prefill"], c["prefix_caching"], c["watermark"]) == (512, False, 0.01)
    assert "async_scheduling" not in c          # off, and configs without it read as before


@pytest.mark.parametrize("extra, expected", [
    ([], True),                                            # the vLLM preset's default
    (["--no-async-scheduling"], False),
    (["--engine", "servelab"], False),
    (["--engine", "servelab", "--async-scheduling"], True),
    (["--vllm-args=--no-async-scheduling"], False),
    (["--pp", "2"], False),                                # vLLM 0.14 turns it off with PP
    (["--speculative", "ngram"], False),                   # and with proposers other than EAGLE/MTP
    (["--speculative", "eagle"], True),
    (["--prefill-replicas", "1", "--decode-replicas", "1"], True),   # a KV connector keeps it
])
def test_async_scheduling_follows_the_engine_unless_given(extra, expected):
    from servelab.cli import build_parser
    from servelab.simulator.cli import config_from_args

    args = build_parser().parse_args(["simulate", "--out", "unused", *extra])
    if args.vllm_args:
        from servelab.simulator.cli import with_vllm_args
        args = with_vllm_args(args)
    assert config_from_args(args).async_scheduling is expected


def test_async_scheduling_where_it_is_not_modelled_is_one_line(tmp_path, capsys):
    assert main(["simulate", "--pp", "2", "--async-scheduling", "--out", str(tmp_path / "r")]) == 2
    assert not (tmp_path / "r").exists()
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--async-scheduling with pipeline stages (pp > 1) is not modelled" in err


def test_simulate_reads_a_vllm_command_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["simulate", "--num-requests", "20", "--out", str(out), "--vllm-args",
                 "vllm serve meta-llama/Llama-3.1-8B --max-num-seqs 64 --enforce-eager"]) == 0
    assert "note: --vllm-args --enforce-eager" in capsys.readouterr().err
    c = _config(out)["config"]
    assert (c["model"], c["scheduler"]["max_num_seqs"]) == ("llama-3.1-8b", 64)
    assert c["scheduler"]["max_num_batched_tokens"] == 8192       # vLLM's default on an H100


@pytest.mark.parametrize("argv, message", [
    (["--max-num-seqs", "32", "--vllm-args", "--max-num-seqs 64"],
     "--max-num-seqs 32 disagrees with --vllm-args, which sets it to 64"),
    (["--vllm-args", "--enable-lora"], "LoRA adapters are not modelled"),
    # a flag given with its default's value is given all the same
    (["--tp", "1", "--vllm-args", "vllm serve meta-llama/Llama-3.1-8B -tp 2"],
     "--tp 1 disagrees with --vllm-args, which sets it to 2"),
    (["--model", "llama-3.1-8b", "--vllm-args", "vllm serve meta-llama/Llama-3.1-70B -tp 4"],
     "--model llama-3.1-8b disagrees with --vllm-args, which sets it to llama-3.1-70b"),
    (["--kv-dtype", "bf16", "--vllm-args", "--kv-cache-dtype fp8"],
     "--kv-dtype bf16 disagrees with --vllm-args, which sets it to fp8"),
    (["--engine", "vllm-9"], "invalid choice: 'vllm-9'"),
    (["--calibration", "h100-sxm"], "calibration profile h100-sxm was fitted to kernels measured "
     "inside vLLM 0.14.0, not the chosen engine's 0.24.0: leave the calibration out to use "
     "h100-sxm.vllm-0.24, or choose that engine (--engine vllm-0.14)"),
])
def test_bad_engine_input_is_one_line_before_the_run(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) if argv[0] == "--engine" else contextlib.nullcontext():
        assert main(["simulate", "--num-requests", "5", "--out", str(tmp_path / "x"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and not (tmp_path / "x").exists()


@pytest.mark.parametrize("argv", [
    ["simulate", "--kv-dtype", "fp8", "--kv-cache-dtype", "bf16", "--out", "unused"],
    ["trace", "stats", "default", "--arrival-cv", "4", "--cv", "1"],
])
def test_one_option_under_two_names_with_two_values_is_refused(argv, capsys):
    """An option's aliases (vLLM's name beside servelab's) given different values: an
    error naming both, not the last one silently winning; the same value twice is fine."""
    with pytest.raises(SystemExit):
        main(argv)
    assert "disagrees with" in capsys.readouterr().err
    from servelab.cli import build_parser

    same = ["simulate", "--kv-dtype", "fp8", "--kv-cache-dtype", "fp8", "--out", "unused"]
    assert build_parser().parse_args(same).kv_dtype == "fp8"


def test_the_defaults_vllm_args_may_override_are_the_parsers():
    from servelab.cli import build_parser
    from servelab.simulator.cli import _VLLM_DESTS_DEFAULTS

    args = build_parser().parse_args(["simulate", "--out", "unused"])
    assert {dest: getattr(args, dest) for dest in _VLLM_DESTS_DEFAULTS} == _VLLM_DESTS_DEFAULTS


@pytest.mark.parametrize("flags, router", [
    (["--model", "qwen3-30b-a3b", "--dp", "2"], "least-outstanding"),
    (["--vllm-args", "vllm serve Qwen/Qwen3-30B-A3B -dp 2 --enable-expert-parallel"], "least-outstanding"),
    (["--model", "qwen3-30b-a3b", "--ep", "2"], "least-outstanding"),     # ep / tp = 2 ranks
    (["--model", "qwen3-30b-a3b", "--ep", "2", "--tp", "2"], "round-robin"),  # one engine
    (["--dp", "2"], "least-outstanding"),                                 # dense: 2 replicas
    (["--vllm-args", "-dp 2"], "least-outstanding"),
    (["--replicas", "2"], "round-robin"),
    (["--model", "qwen3-30b-a3b", "--dp", "2", "--router", "round-robin"], "round-robin"),
    (["--vllm-args", "-dp 2", "--router", "round-robin"], "round-robin"),   # not a disagreement
])
def test_data_parallel_ranks_get_the_same_router_however_they_are_spelled(flags, router):
    """vLLM's DP load balancer sends a request to the rank with the fewest waiting and
    running requests; --dp, --ep above --tp and --vllm-args -dp all take least-outstanding,
    the closest router, unless --router says otherwise."""
    from servelab.cli import build_parser
    from servelab.simulator.cli import config_from_args

    args = build_parser().parse_args(["simulate", "--out", "unused", *flags])
    assert config_from_args(args).router == router


def test_a_kv_dtype_disagreeing_with_the_vllm_kv_cache_dtype_auto_is_refused(capsys):
    from servelab.cli import main

    assert main(["simulate", "--trace", "default", "--num-requests", "5", "--kv-dtype", "fp8",
                 "--vllm-args", "--kv-cache-dtype auto", "--out", "unused"]) == 2
    assert "--kv-dtype fp8 disagrees with --vllm-args, which sets it to bf16" in capsys.readouterr().err


def test_a_vllm_presets_sequences_never_exceed_its_token_budget():
    """vLLM: the default max_num_seqs is at most max_num_batched_tokens
    (`EngineArgs._set_default_args`), and a smaller budget than a given max_num_seqs is
    refused (`SchedulerConfig`). servelab's own preset keeps its 128 sequences."""
    from servelab.cli import CLIError, build_parser
    from servelab.simulator.cli import config_from_args

    def seqs(*flags):
        args = build_parser().parse_args(["simulate", "--out", "unused", *flags])
        return config_from_args(args).scheduler.max_num_seqs

    assert seqs() == 1024 and seqs("--max-num-batched-tokens", "512") == 512
    assert seqs("--vllm-args", "--max-num-batched-tokens 16") == 16
    assert seqs("--engine", "servelab", "--max-num-batched-tokens", "64") == 128
    with pytest.raises(CLIError, match=r"^--max-num-batched-tokens 16 is below --max-num-seqs 64: vLLM"):
        seqs("--max-num-batched-tokens", "16", "--max-num-seqs", "64")
    with pytest.raises(CLIError, match=r"^--max-num-batched-tokens 8192 \(vllm-0.24's default\) is below "
                                       r"--max-num-seqs 10000: .*; raise --max-num-batched-tokens or lower"):
        seqs("--max-num-seqs", "10000")


def test_a_carried_over_profile_is_named_before_why(tmp_path, capsys):
    assert main(["simulate", "--num-requests", "5", "--model", "tiny-llama", "--gpu", "rtx-4090",
                 "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("engine vllm-0.24, asynchronous scheduling; kernels priced by l40s, "
                          "carried over: no rtx-4090 tables")
    source = _config(tmp_path / "r")["derived"]["cost_model"]["calibration_source"]
    assert source.startswith("carried over: ")          # the reports put the name before it


def test_data_parallel_ranks_of_a_moe_model_are_one_lockstep_deployment_however_spelled(
        tmp_path, capsys):
    """vLLM runs a MoE model's DP ranks in lock-step over experts spread across them, with
    or without --enable-expert-parallel; `-dp 2` used to become two independent replicas
    holding every expert each."""
    from servelab.vllm_args import catalog_model

    for flags in (("--enable-expert-parallel",), ()):
        parsed = translate("vllm serve Qwen/Qwen3-30B-A3B -dp 2 " + " ".join(flags),
                           catalog=catalog_model)
        assert (parsed.values["dp"], parsed.values["replicas"]) == (2, 2), flags
        assert any("priced here as expert parallelism" in n for n in parsed.notes) != bool(flags)
    dense = translate("vllm serve meta-llama/Llama-3.1-8B -dp 2", catalog=catalog_model)
    assert "dp" not in dense.values and dense.values["replicas"] == 2   # independent, as vLLM
    blocks = []
    for name, flags in (("a", ["--vllm-args", "vllm serve Qwen/Qwen3-30B-A3B -dp 2"]),
                        ("b", ["--model", "qwen3-30b-a3b", "--dp", "2"])):
        assert main(["simulate", "--num-requests", "5", *flags, "--out", str(tmp_path / name)]) == 0
        config = _config(tmp_path / name)
        blocks.append((config["config"]["ep"], config["derived"]["kv_blocks_per_replica"]))
    assert blocks[0] == blocks[1] and blocks[0][0] == 2


def test_naming_the_profile_the_engine_would_carry_over_is_accepted(tmp_path, capsys):
    """rtx-pro-6000 has tables for vLLM 0.19 only: under the default engine (0.24) leaving
    the calibration out carries that profile over, so naming it is the same choice (it was
    refused as fitted inside another engine version); another version's profile of a GPU
    that has one for this engine is still refused."""
    from servelab.simulator.calibration import resolve

    assert main(["simulate", "--gpu", "rtx-pro-6000", "--calibration", "rtx-pro-6000.vllm-0.19",
                 "--num-requests", "5", "--out", str(tmp_path / "x")]) == 0
    assert "as given (--calibration): carried over: no rtx-pro-6000 tables for vLLM 0.24.0" \
        in capsys.readouterr().out
    assert resolve("rtx-pro-6000", "rtx-pro-6000.vllm-0.19", "0.24.0").engine_version == "0.19.0"
    with pytest.raises(ValueError, match="leave the calibration out to use h100-sxm.vllm-0.24"):
        resolve("h100-sxm", "h100-sxm", "0.24.0")
