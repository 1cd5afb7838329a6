"""Command-line options for the scheduler, the KV cache and the policies, shared by every
command that runs the scheduler (`simulate`, `run`, ...), and their conversion to configs.

One definition per flag, so `servelab simulate` and `servelab run` accept the same
spelling, defaults and validation:

    add_scheduler_options(parser, policies=policy_names())
    add_workload_options(parser)
    opts = configs_from_args(args)        # SchedulerOptions(scheduler, cache, policy, policy_options)

Defaults come from the config dataclasses themselves, so `--help` shows what a run gets.
Bad values raise `CLIError` naming the flag (exit status 2), before any work is done.
Pure standard library: importing it costs nothing.
"""
from __future__ import annotations

import argparse
import math
import re
from dataclasses import fields
from typing import NamedTuple, Sequence

from servelab.cli import CLIError
from servelab.config import (BATCHING_MODES, BLOCK_MANAGERS, PREEMPTION_MODES, STEP_COMPOSITIONS,
                             CacheConfig, SchedulerConfig)

_SCHED_DEFAULTS = {f.name: f.default for f in fields(SchedulerConfig)}
_CACHE_DEFAULTS = {f.name: f.default for f in fields(CacheConfig)}
SJF_PREDICTORS = ("oracle", "noisy", "prompt")

#: Config field -> the flag that sets it (for error messages).
_FLAG_OF = {
    "max_num_seqs": "--max-num-seqs", "max_num_batched_tokens": "--max-num-batched-tokens",
    "chunked_prefill": "--chunked-prefill", "step_composition": "--step-composition",
    "preemption": "--preemption", "max_model_len": "--max-model-len",
    "waiting_queue_limit": "--waiting-queue-limit", "batching": "--batching",
    "block_size": "--block-size", "num_gpu_blocks": "--kv-blocks",
    "num_cpu_blocks": "--cpu-kv-blocks", "watermark": "--watermark",
    "enable_prefix_caching": "--prefix-caching",
    "block_manager": "--block-manager",
}

#: Policy flags: args attribute -> (the policy it applies to, its constructor keyword).
_POLICY_FLAGS = {
    "priority_aging_rate": ("priority", "aging_rate"),
    "preemptive_priority": ("priority", "preemptive"),
    "sjf_predictor": ("sjf", "predictor"),
    "sjf_max_wait_s": ("sjf", "max_wait_s"),
    "tenant_weights": ("fair", "weights"),
}


class SchedulerOptions(NamedTuple):
    scheduler: SchedulerConfig
    cache: dict
    """CacheConfig keyword arguments. `num_gpu_blocks` is None when --kv-blocks was not
    given: the caller derives it (from GPU memory) and then builds the CacheConfig."""
    policy: str
    policy_options: dict


# --------------------------------------------------------------------------- value parsers


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def chunk_tokens(text: str) -> int | None:
    """TOKENS (>= 1) or 'off' (None: chunked prefill disabled)."""
    if text.strip().lower() == "off":
        return None
    return positive_int(text)


def wait_seconds(text: str) -> float:
    """SECONDS (> 0) or 'off' (infinity: the guard never fires)."""
    if text.strip().lower() == "off":
        return math.inf
    return positive_float(text)


def tenant_weights(text: str) -> dict[str, float]:
    """'a=1,b=2.5' -> {'a': 1.0, 'b': 2.5}; each tenant once, each weight > 0."""
    weights: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"expected TENANT=WEIGHT items, got {item!r}")
        if name in weights:
            raise argparse.ArgumentTypeError(f"tenant {name!r} is given twice")
        weights[name] = positive_float(value)
    if not weights:
        raise argparse.ArgumentTypeError("expected at least one TENANT=WEIGHT item")
    return weights


# --------------------------------------------------------------------------- options


def add_scheduler_options(parser: argparse.ArgumentParser,
                          policies: Sequence[str] | None = None) -> None:
    """Scheduler, KV-cache and policy flags, in three help groups. `policies` lists the
    registered policy names for --policy's choices (the caller imports the registry)."""
    s = parser.add_argument_group("scheduler")
    s.add_argument("--max-num-seqs", type=positive_int, default=_SCHED_DEFAULTS["max_num_seqs"],
                   metavar="N", help="most sequences in one step (default %(default)s)")
    s.add_argument("--max-num-batched-tokens", type=positive_int, metavar="N",
                   default=_SCHED_DEFAULTS["max_num_batched_tokens"],
                   help="token budget of one step (default %(default)s)")
    s.add_argument("--chunked-prefill", type=chunk_tokens, metavar="TOKENS|off",
                   default=_SCHED_DEFAULTS["chunked_prefill"],
                   help="largest prefill chunk per sequence and step, or 'off' "
                        "(default %(default)s)")
    s.add_argument("--step-composition", choices=STEP_COMPOSITIONS,
                   default=_SCHED_DEFAULTS["step_composition"],
                   help="decode_first (stall-free) or prefill_first (default %(default)s)")
    s.add_argument("--preemption", choices=PREEMPTION_MODES, default=_SCHED_DEFAULTS["preemption"],
                   help="recompute, or swap to the CPU pool (--cpu-kv-blocks) "
                        "(default %(default)s)")
    s.add_argument("--max-model-len", type=positive_int, default=None, metavar="N",
                   help="longest sequence, prompt + output (default: the command's choice, "
                        "e.g. the model's context length)")
    s.add_argument("--waiting-queue-limit", type=non_negative_int, default=None, metavar="N",
                   help="reject arrivals while N requests wait (default: no limit)")
    s.add_argument("--batching", choices=BATCHING_MODES, default=_SCHED_DEFAULTS["batching"],
                   help="continuous (iteration-level) or static (default %(default)s)")

    c = parser.add_argument_group("KV cache")
    c.add_argument("--block-size", type=positive_int, default=_CACHE_DEFAULTS["block_size"],
                   metavar="TOKENS", help="tokens per KV block (default %(default)s)")
    c.add_argument("--kv-blocks", type=positive_int, default=None, metavar="N",
                   help="GPU KV blocks (default: derived from device memory)")
    c.add_argument("--cpu-kv-blocks", type=non_negative_int, metavar="N",
                   default=_CACHE_DEFAULTS["num_cpu_blocks"],
                   help="CPU swap-pool blocks (default %(default)s: swap falls back to recompute)")
    c.add_argument("--block-manager", choices=BLOCK_MANAGERS,
                   default=_CACHE_DEFAULTS["block_manager"],
                   help="paged, or a contiguous reserve-up-front baseline (default %(default)s)")
    c.add_argument("--watermark", type=non_negative_float, default=_CACHE_DEFAULTS["watermark"],
                   metavar="FRACTION",
                   help="fraction of GPU blocks kept free at admission (default %(default)s)")
    c.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction,
                   default=_CACHE_DEFAULTS["enable_prefix_caching"],
                   help="reuse the KV of shared prompt prefixes (default: off)")

    p = parser.add_argument_group("policy")
    p.add_argument("--policy", default="fcfs", choices=list(policies) if policies else None,
                   help="scheduling policy (default %(default)s)")
    p.add_argument("--priority-aging-rate", type=non_negative_float, default=None, metavar="R",
                   help="priority: effective priority improves by R per second waited")
    p.add_argument("--preemptive-priority", action="store_true", default=None,
                   help="priority: a waiting request may preempt lower-priority running ones")
    p.add_argument("--sjf-predictor", choices=SJF_PREDICTORS, default=None,
                   help="sjf: output-length predictor (default oracle)")
    p.add_argument("--sjf-max-wait-s", type=wait_seconds, default=None, metavar="S|off",
                   help="sjf: starvation guard, admit oldest first once it waited S seconds "
                        "(default 30)")
    p.add_argument("--tenant-weights", type=tenant_weights, default=None, metavar="A=W,B=W",
                   help="fair: tenant shares (default 1 each)")


def add_workload_options(parser: argparse.ArgumentParser) -> None:
    """How the trace is replayed and judged: speed, length, seed, SLOs."""
    w = parser.add_argument_group("workload")
    w.add_argument("--rate-scale", type=positive_float, default=None, metavar="X",
                   help="replay the trace X times faster (2 = twice the request rate)")
    w.add_argument("--num-requests", type=positive_int, default=None, metavar="N",
                   help="replay only the first N requests")
    w.add_argument("--seed", type=int, default=0,
                   help="seed of everything random in the run (default %(default)s)")
    w.add_argument("--slo-ttft-ms", type=positive_float, default=None, metavar="MS",
                   help="TTFT SLO for goodput (a request's own SLO takes precedence)")
    w.add_argument("--slo-tpot-ms", type=positive_float, default=None, metavar="MS",
                   help="TPOT SLO for goodput (a request's own SLO takes precedence)")


# --------------------------------------------------------------------------- conversion


def configs_from_args(args: argparse.Namespace, *,
                      default_max_model_len: int | None = None) -> SchedulerOptions:
    """The scheduler config, cache keyword arguments, policy name and policy options the
    flags describe. Raises CLIError naming the flag for a value the configs reject, or a
    policy flag given for another policy."""
    max_model_len = args.max_model_len or default_max_model_len or _SCHED_DEFAULTS["max_model_len"]
    scheduler = _checked(SchedulerConfig, dict(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        chunked_prefill=args.chunked_prefill, step_composition=args.step_composition,
        preemption=args.preemption, max_model_len=max_model_len,
        waiting_queue_limit=args.waiting_queue_limit, batching=args.batching))
    cache = dict(block_size=args.block_size, num_gpu_blocks=args.kv_blocks,
                 num_cpu_blocks=args.cpu_kv_blocks, watermark=args.watermark,
                 enable_prefix_caching=bool(args.prefix_caching), block_manager=args.block_manager)
    _checked(CacheConfig, {**cache, "num_gpu_blocks": args.kv_blocks or 1})  # validate early
    return SchedulerOptions(scheduler, cache, args.policy, policy_options_from_args(args))


def policy_options_from_args(args: argparse.Namespace) -> dict:
    """Constructor options of args.policy from the policy flags that were given."""
    options: dict = {}
    for attr, (policy, keyword) in _POLICY_FLAGS.items():
        value = getattr(args, attr, None)
        if value is None:
            continue
        if policy != args.policy:
            flag = "--" + attr.replace("_", "-")
            raise CLIError(f"{flag} applies to --policy {policy}, not {args.policy}")
        if keyword == "max_wait_s" and value == math.inf:
            value = None  # 'off'
        options[keyword] = value
    if options.get("predictor") == "noisy":
        options["seed"] = getattr(args, "seed", 0)
    return options


def _checked(cls, kwargs: dict):
    try:
        return cls(**kwargs)
    except ValueError as exc:
        match = re.search(rf"{cls.__name__}\.(\w+)", str(exc))
        flag = _FLAG_OF.get(match.group(1)) if match else None
        raise CLIError(f"{flag}: {exc}" if flag else str(exc)) from None
