"""The shared scheduler / KV-cache / policy flags and their conversion to configs."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from servelab.cli import CLIError
from servelab.config import CacheConfig, SchedulerConfig
from servelab.options import add_workload_options
from servelab.policies import make_policy, policy_names
from servelab.policies.cli_options import add_scheduler_options, configs_from_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="t", exit_on_error=False)
    add_scheduler_options(parser, policies=policy_names())
    add_workload_options(parser)
    return parser.parse_args(list(argv))


def test_the_servelab_engines_defaults_are_the_configs_defaults():
    opts = configs_from_args(parse("--engine", "servelab"))
    assert opts.scheduler == SchedulerConfig()
    blocks = CacheConfig().num_gpu_blocks
    assert CacheConfig(**{**opts.cache, "num_gpu_blocks": blocks}) == CacheConfig()
    assert opts.cache["num_gpu_blocks"] is None  # derived by the command
    assert (opts.policy, opts.policy_options) == ("fcfs", {})
    assert configs_from_args(parse(), default_max_model_len=2048).scheduler.max_model_len == 2048
    assert opts.gpu_memory_utilization == 0.9 and opts.engine.name == "servelab"
    assert configs_from_args(parse("--max-model-len", "64"),
                             default_max_model_len=2048).scheduler.max_model_len == 64


GIB = 1 << 30


@pytest.mark.parametrize("memory_gib, name, tokens, seqs", [
    (80, "h100-sxm", 8192, 1024),      # vLLM: >= 70 GiB and not an A100
    (96, "rtx-pro-6000", 8192, 1024),
    (80, "a100-80gb", 2048, 256),      # an A100 keeps the small budget (vLLM PR #17885)
    (48, "l40s", 2048, 256),
    (0, "cpu", 2048, 256),             # device unknown: vLLM's fallback
])
def test_a_vllm_engine_gives_vllms_defaults_for_the_device(memory_gib, name, tokens, seqs):
    opts = configs_from_args(parse("--engine", "vllm-0.24"), device_memory_bytes=memory_gib * GIB,
                             device_name=name)
    s = opts.scheduler
    assert (s.max_num_batched_tokens, s.max_num_seqs) == (tokens, seqs)
    assert s.chunked_prefill == tokens            # one prefill may take the whole budget
    assert s.preemption == "recompute"
    assert opts.cache["enable_prefix_caching"] is True and opts.cache["watermark"] == 0.0
    assert opts.cache["block_size"] == 16 and opts.gpu_memory_utilization == 0.9


def test_flags_given_override_the_engines_defaults():
    opts = configs_from_args(parse("--max-num-batched-tokens", "4096", "--no-prefix-caching",
                                   "--watermark", "0.02"), device_memory_bytes=80 * GIB,
                             device_name="h100-sxm")
    assert opts.engine.name == "vllm-0.24"        # the default engine
    assert (opts.scheduler.max_num_batched_tokens, opts.scheduler.chunked_prefill) == (4096, 4096)
    assert opts.scheduler.max_num_seqs == 1024
    assert opts.cache["enable_prefix_caching"] is False and opts.cache["watermark"] == 0.02
    capped = configs_from_args(parse("--chunked-prefill", "512"))
    assert capped.scheduler.chunked_prefill == 512
    budget = configs_from_args(parse("--engine", "servelab", "--chunked-prefill", "budget"))
    assert budget.scheduler.chunked_prefill == budget.scheduler.max_num_batched_tokens == 2048


def test_every_flag_reaches_its_config_field():
    opts = configs_from_args(parse(
        "--max-num-seqs", "7", "--max-num-batched-tokens", "99", "--chunked-prefill", "off",
        "--step-composition", "prefill_first", "--preemption", "swap", "--max-model-len", "300",
        "--waiting-queue-limit", "4", "--batching", "static", "--block-size", "8",
        "--kv-blocks", "50", "--cpu-kv-blocks", "20", "--block-manager", "contiguous-pow2",
        "--watermark", "0.05", "--prefix-caching"))
    assert opts.scheduler == SchedulerConfig(
        max_num_seqs=7, max_num_batched_tokens=99, chunked_prefill=None,
        step_composition="prefill_first", preemption="swap", max_model_len=300,
        waiting_queue_limit=4, batching="static")
    assert opts.cache == dict(block_size=8, num_gpu_blocks=50, num_cpu_blocks=20, watermark=0.05,
                              enable_prefix_caching=True, block_manager="contiguous-pow2")


@pytest.mark.parametrize("argv, expected", [
    (["--policy", "priority", "--priority-aging-rate", "0.5", "--preemptive-priority"],
     {"aging_rate": 0.5, "preemptive": True}),
    (["--policy", "sjf", "--sjf-predictor", "noisy", "--sjf-max-wait-s", "off", "--seed", "9"],
     {"predictor": "noisy", "max_wait_s": None, "seed": 9}),
    (["--policy", "sjf", "--sjf-max-wait-s", "2.5"], {"max_wait_s": 2.5}),
    (["--policy", "fair", "--tenant-weights", "a=1, b=2.5"], {"weights": {"a": 1.0, "b": 2.5}}),
])
def test_policy_flags_become_constructor_options(argv, expected):
    opts = configs_from_args(parse(*argv))
    assert opts.policy_options == expected
    make_policy(opts.policy, **opts.policy_options)  # the policy accepts them


def test_a_policy_flag_for_another_policy_is_refused():
    with pytest.raises(CLIError, match="--tenant-weights applies to --policy fair, not sjf"):
        configs_from_args(parse("--policy", "sjf", "--tenant-weights", "a=1"))


@pytest.mark.parametrize("argv, message", [
    (["--max-model-len", "1"], r"^--max-model-len: SchedulerConfig\.max_model_len must be >= 2"),
    (["--block-size", "70000"], r"^--block-size: CacheConfig\.block_size must be in"),
    (["--watermark", "0.9"], r"^--watermark: CacheConfig\.watermark must be in"),
])
def test_values_the_configs_refuse_name_the_flag(argv, message):
    with pytest.raises(CLIError, match=message):
        configs_from_args(parse(*argv))


@pytest.mark.parametrize("argv", [
    ["--tenant-weights", "a=1,a=2"], ["--tenant-weights", "a"], ["--tenant-weights", "a=0"],
    ["--chunked-prefill", "0"], ["--kv-blocks", "-3"], ["--policy", "nope"],
    ["--rate-scale", "0"], ["--sjf-max-wait-s", "soon"],
])
def test_malformed_values_are_argument_errors(argv):
    with pytest.raises(argparse.ArgumentError):
        parse(*argv)


@pytest.mark.parametrize("module", ["servelab.options", "servelab.backends.cli"])
def test_importing_the_options_and_the_run_command_stays_cheap(module):
    code = (f"import sys, {module}\n"
            "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'triton', 'transformers', 'numpy'))))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == ""
