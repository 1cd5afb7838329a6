"""Command-line options for the scheduler, the KV cache and the policies, shared by every
command that runs the scheduler (`simulate`, `run`, ...), and their conversion to configs.

One definition per flag, so `servelab simulate` and `servelab run` accept the same
spelling, defaults and validation. Policy flags, preemption modes and block managers come
from their registries, which the caller passes in: the core imports nothing from
`servelab.policies` or `servelab.memory` (DESIGN.md's import table), and
`servelab.policies.cli_options` is the same API with the registries filled in, for the
commands (`simulate`, `run`). Each policy declares its own flags (`Policy.flags`), so
nothing here names a policy.

    from servelab.policies.cli_options import add_scheduler_options, configs_from_args
    add_scheduler_options(parser, policies=policy_names())
    add_workload_options(parser)
    opts = configs_from_args(args)        # SchedulerOptions(scheduler, cache, policy, policy_options)

Numbers are read by one bounded parser, `number(kind, low, high, ...)`; `positive_int`
and the others are its common ranges. Defaults come from the config dataclasses
themselves, so `--help` shows what a run gets. Bad values raise `CLIError` naming the flag
(exit status 2), before any work is done. Pure standard library: importing it costs nothing.
"""
from __future__ import annotations

import argparse
import inspect
import math
import re
from dataclasses import dataclass, fields
from typing import Callable, Mapping, NamedTuple, Sequence

from servelab._validate import bounds_text, within
from servelab.cli import CLIError
from servelab.config import (BATCHING_MODES, SPECULATIVE_METHODS, STEP_COMPOSITIONS, AdmissionConfig,
                             CacheConfig, SchedulerConfig, SpeculativeConfig)
from servelab.engines import BUDGET, DEFAULT_ENGINE, EnginePreset, engine_names, get_preset


class GivenFlag(argparse.Action):
    """Store the value and remember that the flag was given (`args.given_flags`: dest ->
    (flag as typed, value)), so that a default can be told from a flag given with the
    default's value (`--vllm-args` must agree with the flags given, whatever their value);
    the same option given again under another of its names with another value
    (`--kv-dtype fp8 --kv-cache-dtype bf16`) is refused rather than the last one winning."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, "given_flags", None)
        if given is None:
            given = {}
            setattr(namespace, "given_flags", given)
        if self.dest in given and given[self.dest][1] != values \
                and given[self.dest][0] != option_string:
            raise argparse.ArgumentError(self, f"{values} disagrees with "
                                               f"{given[self.dest][0]} {given[self.dest][1]}")
        given[self.dest] = (option_string, values)
        setattr(namespace, self.dest, values)


def flag_given(args: argparse.Namespace, dest: str) -> bool:
    """Whether `dest`'s flag (a `GivenFlag`) was given on the command line."""
    return dest in (getattr(args, "given_flags", None) or {})

_SCHED_DEFAULTS = {f.name: f.default for f in fields(SchedulerConfig)}
_CACHE_DEFAULTS = {f.name: f.default for f in fields(CacheConfig)}
_ADMISSION_DEFAULTS = {f.name: f.default for f in fields(AdmissionConfig)}
_SPECULATIVE_DEFAULTS = {f.name: f.default for f in fields(SpeculativeConfig)}
OUTPUT_FORMATS = ("csv", "parquet")
"""How a run directory's request and step tables are written (`servelab.reports.runio`)."""

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
    "tenant_queue_limit": "--tenant-queue-limit", "tenant_rate": "--tenant-rate",
    "tenant_burst": "--tenant-burst", "shed_from_priority": "--shed-from-priority",
    "shed_default_slo_ms": "--shed-default-slo-ms",
    "num_speculative_tokens": "--num-speculative-tokens", "acceptance": "--acceptance-rate",
    "tenant_acceptance": "--acceptance-rate", "max_batch": "--speculative-max-batch",
    "draft_model": "--speculative", "method": "--speculative",
}

class SchedulerOptions(NamedTuple):
    scheduler: SchedulerConfig
    cache: dict
    """CacheConfig keyword arguments. `num_gpu_blocks` is None when --kv-blocks was not
    given: the caller derives it (from GPU memory) and then builds the CacheConfig."""
    policy: str
    policy_options: dict
    kv_offload_gb: float = 0.0
    """--kv-offload-gb: GiB of CPU memory per replica for the prefix cache's CPU tier; the
    caller turns it into `num_host_blocks` (it depends on the model's KV bytes)."""
    engine: EnginePreset | None = None
    """The --engine preset whose defaults filled the flags not given."""
    gpu_memory_utilization: float | None = None
    """--gpu-memory-utilization, or the engine's default (None where the command has no
    such flag)."""


# --------------------------------------------------------------------------- value parsers


@dataclass(frozen=True)
class Number:
    """An argparse `type` reading one `kind` (int or float) in a range: `low` <= value
    (> with `low_open`), value <= `high` (< with `high_open`); a bound left out does not
    limit. Floats are always finite. A bad value is one line stating what is accepted:
    "expected an integer >= 1, got 0", "expected a number in (0, 1], got '1.5'",
    "expected a finite number > 0, got 'inf'"; text that is not a number at all:
    "expected an integer, got '1.5'". The range is checked and worded by
    `servelab._validate.within` / `bounds_text`, as the configs' own checks are. Made by
    `number(...)`; a module-level instance pickles like a function."""

    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __post_init__(self) -> None:
        if self.kind not in (int, float):
            raise TypeError(f"number() reads int or float, not {self.kind!r}")

    @property
    def expected(self) -> str:
        """What is accepted, as the messages say it: 'an integer >= 1', 'a number in (0, 1]'."""
        bounds = bounds_text(self.low, self.high, lo_open=self.low_open, hi_open=self.high_open)
        # Without an upper bound the range alone would admit 'inf': say 'finite' there.
        noun = "an integer" if self.kind is int else \
            "a finite number" if self.high is None else "a number"
        return f"{noun} {bounds}" if bounds else noun

    def __call__(self, text: str) -> int | float:
        try:
            value = self.kind(text)
        except ValueError:
            what = "an integer" if self.kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if self.kind is float and not math.isfinite(value) or \
                not within(value, self.low, self.high, lo_open=self.low_open, hi_open=self.high_open):
            # An integer is shown as read (" 7" -> 7), a number as typed ('1e400').
            shown = value if self.kind is int else repr(text)
            raise argparse.ArgumentTypeError(f"expected {self.expected}, got {shown}")
        return value


def number(kind: type[int] | type[float] = int, low: float | None = None,
           high: float | None = None, *, low_open: bool = False,
           high_open: bool = False) -> Callable[[str], int | float]:
    """The argparse `type` reading `kind` in [low, high] (open at a side with `low_open` /
    `high_open`; a bound left out does not limit): see `Number`."""
    return Number(kind, low, high, low_open, high_open)


positive_int = number(int, low=1)
non_negative_int = number(int, low=0)
positive_float = number(float, low=0, low_open=True)
non_negative_float = number(float, low=0)
fraction = number(float, low=0, high=1, low_open=True)
"""A share in (0, 1]: --attainment, --top-p."""
_at_least_one = number(float, low=1)
"""--tenant-burst: a bucket holds at least one arrival."""


def chunk_tokens(text: str) -> int | str:
    """TOKENS (>= 1), 'off' (chunked prefill disabled) or 'budget' (one prefill may take
    the whole step token budget, as vLLM V1 allows)."""
    word = text.strip().lower()
    if word in ("off", BUDGET):
        return word
    return positive_int(text)


# --------------------------------------------------------------------------- options


def add_scheduler_options(parser: argparse.ArgumentParser, *, policy_classes: Mapping[str, type],
                          preemptions: Sequence[str], block_managers: Sequence[str],
                          policies: Sequence[str] | None = None) -> None:
    """Scheduler, KV-cache and policy flags, in their help groups. The registries come from
    the caller: `policy_classes` (name -> policy class), the `preemptions` modes and the
    `block_managers` (`servelab.policies.cli_options` passes the registered ones).
    `policies` limits --policy's choices (default: every policy class); every policy
    class's own flags are offered, each applying to its policy only."""
    s = parser.add_argument_group("scheduler")
    s.add_argument("--engine", choices=engine_names(), default=DEFAULT_ENGINE,
                   help="the engine mirrored: its defaults for every flag below not given, and "
                        "(simulate) the kernel profiles measured inside it; 'servelab' keeps "
                        "servelab's own defaults (default %(default)s)")
    s.add_argument("--max-num-seqs", type=positive_int, default=None,
                   metavar="N", help="most sequences in one step (default: the engine's; vLLM: "
                                     "1024 on a GPU of >= 70 GiB other than an A100, else 256)")
    s.add_argument("--max-num-batched-tokens", type=positive_int, metavar="N", default=None,
                   help="token budget of one step (default: the engine's; vLLM: 8192 on a GPU "
                        "of >= 70 GiB other than an A100, else 2048)")
    s.add_argument("--chunked-prefill", type=chunk_tokens, metavar="TOKENS|budget|off",
                   default=None,
                   help="largest prefill chunk per sequence and step, 'budget' (the whole token "
                        "budget) or 'off' (default: the engine's; vLLM: budget)")
    s.add_argument("--step-composition", choices=STEP_COMPOSITIONS,
                   default=_SCHED_DEFAULTS["step_composition"],
                   help="decode_first (stall-free) or prefill_first (default %(default)s)")
    s.add_argument("--preemption", choices=list(preemptions), default=None,
                   help="recompute, or swap to the CPU pool (--cpu-kv-blocks) "
                        "(default: the engine's; vLLM: recompute)")
    s.add_argument("--max-model-len", type=positive_int, default=None, metavar="N",
                   help="longest sequence, prompt + output (default: the command's choice, "
                        "e.g. the model's context length)")
    s.add_argument("--waiting-queue-limit", type=non_negative_int, default=None, metavar="N",
                   help="reject arrivals while N requests wait (default: no limit)")
    s.add_argument("--batching", choices=BATCHING_MODES, default=_SCHED_DEFAULTS["batching"],
                   help="continuous (iteration-level) or static (default %(default)s)")

    c = parser.add_argument_group("KV cache")
    c.add_argument("--block-size", type=positive_int, default=None,
                   metavar="TOKENS", help="tokens per KV block (default: the engine's; vLLM: 16)")
    c.add_argument("--kv-blocks", type=positive_int, default=None, metavar="N",
                   help="GPU KV blocks (default: derived from device memory)")
    c.add_argument("--cpu-kv-blocks", type=non_negative_int, metavar="N",
                   default=_CACHE_DEFAULTS["num_cpu_blocks"],
                   help="CPU swap-pool blocks (default %(default)s: swap falls back to recompute)")
    c.add_argument("--block-manager", choices=list(block_managers),
                   default=_CACHE_DEFAULTS["block_manager"],
                   help="paged, or a contiguous reserve-up-front baseline (default %(default)s)")
    c.add_argument("--watermark", type=non_negative_float, default=None,
                   metavar="FRACTION",
                   help="fraction of GPU blocks kept free at admission (default: the engine's; "
                        "vLLM: 0; servelab: 0.01)")
    c.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV of shared prompt prefixes (default: the engine's; vLLM: "
                        "on; servelab: off)")
    c.add_argument("--kv-offload-gb", type=non_negative_float, default=0.0, metavar="GB",
                   help="CPU memory per replica, GiB, for prefix blocks evicted from the GPU "
                        "(a CPU tier of the prefix cache, LRU; hits are loaded back over "
                        "PCIe); needs --prefix-caching (default 0: none)")

    a = parser.add_argument_group(
        "admission", "a stage before the policy, for any policy: a refused request is rejected "
                     "with its reason and counts as missing its SLOs")
    a.add_argument("--tenant-queue-limit", type=non_negative_int, default=None, metavar="N",
                   help="reject an arrival while N requests of its tenant wait to start "
                        "(default: no limit)")
    a.add_argument("--tenant-rate", type=positive_float, default=None, metavar="REQ_PER_S",
                   help="token bucket per tenant: admit each tenant's arrivals at this mean rate "
                        "(default: no limit)")
    a.add_argument("--tenant-burst", type=_at_least_one, metavar="N", default=None,
                   help="arrivals a tenant may send at once under --tenant-rate "
                        f"(default {_ADMISSION_DEFAULTS['tenant_burst']:g})")
    a.add_argument("--shed-from-priority", type=int, default=None, metavar="P",
                   help="shed a request of priority P or a larger value (a lower tier) when its "
                        "predicted wait exceeds its TTFT SLO (default: never shed)")
    a.add_argument("--shed-default-slo-ms", type=positive_float, metavar="MS", default=None,
                   help="TTFT SLO --shed-from-priority judges a request without its own by "
                        f"(default {_ADMISSION_DEFAULTS['shed_default_slo_ms']:g})")

    add_speculative_options(parser)

    p = parser.add_argument_group("policy")
    p.add_argument("--policy", default="fcfs", action=GivenFlag,
                   choices=list(policies) if policies is not None else list(policy_classes),
                   help="scheduling policy (default %(default)s)")
    for name, cls in policy_classes.items():
        for flag in cls.flags:
            _add_policy_flag(p, name, cls, flag)


def _add_policy_flag(group, policy: str, cls, flag) -> None:
    """One declared policy flag; its help names the policy and the constructor default."""
    default = inspect.signature(cls).parameters[flag.keyword].default
    shown = "" if flag.switch or default in (None, inspect.Parameter.empty) \
        else f" (default {default})"
    kwargs = dict(action="store_true") if flag.switch else dict(
        type=flag.parse, choices=flag.choices, metavar=flag.metavar)
    group.add_argument("--" + flag.flag, dest=flag.dest, default=None,
                       help=f"{policy}: {flag.help}{shown}", **kwargs)


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


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """How the run directory's tables are written."""
    o = parser.add_argument_group("output")
    o.add_argument("--output-format", choices=OUTPUT_FORMATS, default="csv",
                   help="write requests and steps as CSV (default) or Parquet (smaller and "
                        "several times faster to write and read: use it for large runs)")


# --------------------------------------------------------------------------- conversion


def configs_from_args(args: argparse.Namespace, *, policy_classes: Mapping[str, type],
                      default_max_model_len: int | None = None, device_memory_bytes: int = 0,
                      device_name: str = "") -> SchedulerOptions:
    """The scheduler config, cache keyword arguments, policy name and policy options the
    flags describe, the --engine preset's defaults filling the flags not given (some depend
    on the device: its memory and name); `policy_classes` as given to
    `add_scheduler_options`. Raises CLIError naming the flag for a value the configs
    reject, or a policy flag given for another policy."""
    engine = get_preset(getattr(args, "engine", None) or DEFAULT_ENGINE)
    d = engine.defaults(device_memory_bytes, device_name)

    def given_or_default(dest: str, field: str):
        value = getattr(args, dest, None)
        return d[field] if value is None else value

    max_model_len = args.max_model_len or default_max_model_len or _SCHED_DEFAULTS["max_model_len"]
    budget = given_or_default("max_num_batched_tokens", "max_num_batched_tokens")
    chunk = given_or_default("chunked_prefill", "chunked_prefill")
    chunk = budget if chunk == BUDGET else None if chunk == "off" else chunk
    max_num_seqs = given_or_default("max_num_seqs", "max_num_seqs")
    if engine.engine_version is not None:   # a vLLM preset: vLLM's own rule for the two
        if getattr(args, "max_num_seqs", None) is None:
            # `EngineArgs._set_default_args` (vllm/engine/arg_utils.py): the default
            # max_num_seqs is at most the token budget
            max_num_seqs = min(max_num_seqs, budget)
        elif budget < max_num_seqs:   # `SchedulerConfig` (vllm/config/scheduler.py) refuses it
            whose = "" if getattr(args, "max_num_batched_tokens", None) is not None \
                else f" ({engine.name}'s default)"
            raise CLIError(f"--max-num-batched-tokens {budget}{whose} is below --max-num-seqs "
                           f"{max_num_seqs}: vLLM refuses a step budget smaller than its "
                           "sequences (each decoding sequence takes a token of it); raise "
                           "--max-num-batched-tokens or lower --max-num-seqs")
    scheduler = _checked(SchedulerConfig, dict(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget, chunked_prefill=chunk,
        step_composition=args.step_composition,
        preemption=given_or_default("preemption", "preemption"), max_model_len=max_model_len,
        waiting_queue_limit=args.waiting_queue_limit, batching=args.batching,
        admission=admission_from_args(args), speculative=speculative_from_args(args)))
    cache = dict(block_size=given_or_default("block_size", "block_size"),
                 num_gpu_blocks=args.kv_blocks, num_cpu_blocks=args.cpu_kv_blocks,
                 watermark=given_or_default("watermark", "watermark"),
                 enable_prefix_caching=bool(given_or_default("prefix_caching",
                                                             "enable_prefix_caching")),
                 block_manager=args.block_manager)
    _checked(CacheConfig, {**cache, "num_gpu_blocks": args.kv_blocks or 1})  # validate early
    offload = getattr(args, "kv_offload_gb", 0.0) or 0.0
    if offload and not cache["enable_prefix_caching"]:
        raise CLIError("--kv-offload-gb: a CPU tier holds prefix-cache blocks and needs "
                       "--prefix-caching")
    return SchedulerOptions(scheduler, cache, args.policy,
                            policy_options_from_args(args, policy_classes),
                            offload, engine, given_or_default("gpu_memory_utilization",
                                                              "gpu_memory_utilization"))


def add_speculative_options(parser: argparse.ArgumentParser) -> None:
    """--speculative and its knobs (`servelab.speculative`)."""
    g = parser.add_argument_group(
        "speculative decoding", "each decode step of a speculating sequence proposes K tokens and "
                                "verifies them in one target forward of K + 1 tokens")
    g.add_argument("--speculative", default=None, metavar="draft:MODEL|" + "|".join(SPECULATIVE_METHODS[1:]) + "|off",
                   help="the proposer: a draft model of the target's vocabulary (draft:llama-3.1-8b for llama-3.1-70b), "
                        "an n-gram lookup, an EAGLE head, or the model's MTP layer (default: off)")
    g.add_argument("--num-speculative-tokens", type=positive_int, default=None, metavar="K",
                   help=f"tokens proposed per step (default {_SPECULATIVE_DEFAULTS['num_speculative_tokens']})")
    g.add_argument("--acceptance-rate", default=None, metavar="A|TENANT=A,...",
                   help="per-token probability that a proposed token is accepted, for every "
                        "request or per tenant (0.8,batch=0.5: 0.8 unless the tenant is named); "
                        f"the simulator draws from it (default {_SPECULATIVE_DEFAULTS['acceptance']}); "
                        "the real backend measures it")
    g.add_argument("--speculative-max-batch", type=positive_int, default=None, metavar="N",
                   help="speculate only in steps with at most N running requests (default: always)")


def _speculative_knobs(args: argparse.Namespace) -> dict:
    """--speculative's knobs, flag -> value (None: not given)."""
    return {"--num-speculative-tokens": getattr(args, "num_speculative_tokens", None),
            "--acceptance-rate": getattr(args, "acceptance_rate", None),
            "--speculative-max-batch": getattr(args, "speculative_max_batch", None)}


def speculative_knobs_given(args: argparse.Namespace) -> list[str]:
    """The --speculative knobs the command line gives, as flags."""
    return [flag for flag, value in _speculative_knobs(args).items() if value is not None]


def speculative_from_args(args: argparse.Namespace) -> SpeculativeConfig:
    """The speculative decoding the flags describe (off where a command has none of its
    flags); its knobs without --speculative are an error."""
    method = getattr(args, "speculative", None)
    knobs = _speculative_knobs(args)
    if method is None:
        given = speculative_knobs_given(args)
        if given:
            raise CLIError(f"{given[0]} configures speculative decoding: give --speculative too")
        return SpeculativeConfig()
    if method == "off":   # said explicitly (a sweep's point without it): its knobs are for the others
        return SpeculativeConfig()
    name, _, draft = method.partition(":")
    if name not in SPECULATIVE_METHODS:
        raise CLIError(f"--speculative: expected draft:MODEL or one of {', '.join(SPECULATIVE_METHODS[1:])}, "
                       f"got {method!r}")
    if name == "draft" and not draft:
        raise CLIError("--speculative draft needs its model: draft:MODEL (a catalog name or config.json)")
    if name != "draft" and draft:
        raise CLIError(f"--speculative {name} takes no model, got {method!r}")
    kwargs: dict = {"method": name, "draft_model": draft or None,
                    "max_batch": knobs["--speculative-max-batch"]}
    if knobs["--num-speculative-tokens"] is not None:
        kwargs["num_speculative_tokens"] = knobs["--num-speculative-tokens"]
    if knobs["--acceptance-rate"] is not None:
        kwargs["acceptance"], kwargs["tenant_acceptance"] = _acceptance(knobs["--acceptance-rate"])
    return _checked(SpeculativeConfig, kwargs)


def _acceptance(text: str) -> tuple[float, tuple[tuple[str, float], ...]]:
    """'0.8' or '0.8,batch=0.5' or 'interactive=0.9,batch=0.5': the default rate and the
    per-tenant ones."""
    default, tenants = _SPECULATIVE_DEFAULTS["acceptance"], []
    for item in (part.strip() for part in text.split(",")):
        tenant, sep, value = item.rpartition("=")
        try:
            rate = float(value)
        except ValueError:
            raise CLIError(f"--acceptance-rate: expected a number or TENANT=NUMBER, got {item!r}") from None
        if not 0 <= rate <= 1:
            raise CLIError(f"--acceptance-rate: an acceptance rate is in [0, 1], got {item!r}")
        if sep:
            tenants.append((tenant.strip(), rate))
        else:
            default = rate
    return default, tuple(sorted(tenants))


def admission_from_args(args: argparse.Namespace) -> AdmissionConfig:
    """The admission stage the flags describe (every rule off where a command has none of
    its flags)."""
    given = {name: getattr(args, name) for name in _ADMISSION_DEFAULTS
             if getattr(args, name, None) is not None}
    for setting, rule in (("tenant_burst", "tenant_rate"), ("shed_default_slo_ms", "shed_from_priority")):
        if setting in given and rule not in given:
            raise CLIError(f"{_FLAG_OF[setting]} applies with {_FLAG_OF[rule]}, which "
                           "was not given")
    return _checked(AdmissionConfig, given)


def policy_options_from_args(args: argparse.Namespace, policy_classes: Mapping[str, type]) -> dict:
    """Constructor options of args.policy from the policy flags that were given."""
    options: dict = {}
    for policy, flag in _policy_flags(policy_classes):
        value = getattr(args, flag.dest, None)
        if value is None:
            continue
        if policy != args.policy:
            raise CLIError(f"--{flag.flag} applies to --policy {policy}, not {args.policy}")
        options[flag.keyword] = flag.to_option(value) if flag.to_option else value
    cls = policy_classes.get(args.policy)
    return cls.options_from_flags(options, getattr(args, "seed", 0)) if cls else options


def policy_flag_owners(policy_classes: Mapping[str, type]) -> dict[str, str]:
    """Each policy flag's argparse dest -> the policy it configures."""
    return {flag.dest: policy for policy, flag in _policy_flags(policy_classes)}


def _policy_flags(classes: Mapping[str, type]) -> list:
    return [(name, flag) for name, cls in classes.items() for flag in cls.flags]


def _checked(cls, kwargs: dict):
    try:
        return cls(**kwargs)
    except ValueError as exc:
        match = re.search(rf"{cls.__name__}\.(\w+)", str(exc))
        flag = _FLAG_OF.get(match.group(1)) if match else None
        raise CLIError(f"{flag}: {exc}" if flag else str(exc)) from None
