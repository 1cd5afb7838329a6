"""`servelab simulate`: replay a trace through the simulator and write a run directory.

    servelab simulate --trace T --model M --gpu G --policy P [...] --out DIR

The flags build one `SimulationConfig` (see `simulator/run.py`); DIR receives config.json
(enough to rerun exactly), summary.json, and requests and steps as CSV (or Parquet with
--output-format parquet). Scheduler, KV-cache,
policy and workload flags are the ones `servelab run` takes (`servelab.options`), so a
simulated and a real run are spelled alike. Importing this module is cheap: the simulator
is imported by the handler.

Exit status: 0; 2 with one line for a user error (nothing is simulated); 1 when no request
finished, or when a check after the simulation fails (a bug): the run directory is written
first (without summary.json if the records cannot be summarised), then the check is
reported in one line.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from pathlib import Path
from typing import Iterator

from servelab.cli import CLIError
from servelab.models import catalog_names
from servelab.simulator.gpus import DTYPE_BYTES, gpu_names

DTYPES = tuple(DTYPE_BYTES)
"""--weight-dtype / --kv-dtype choices: every dtype the cost model prices."""


def register(subparsers) -> None:
    from servelab.options import (GivenFlag, add_output_options, add_workload_options,
                                  positive_float, positive_int)
    from servelab.policies import policy_names
    from servelab.policies.cli_options import add_scheduler_options
    from servelab.simulator.router import router_names
    from servelab.traces.cli import add_trace_arguments

    p = subparsers.add_parser(
        "simulate", help="replay a trace through the SimPy simulator with a fitted GPU cost model",
        description="Replay a request trace through the shared scheduler on simulated GPUs "
                    "(a per-kernel cost model fitted to measured kernel times) and write "
                    "config.json, summary.json, and requests and steps (.csv or .parquet) to DIR.")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="run directory to write (refused when it holds another run)")
    p.add_argument("--force", action="store_true",
                   help="write into --out even when it holds another run or other files")
    add_output_options(p)
    add_trace_arguments(p)
    add_workload_options(p)

    h = p.add_argument_group("model, GPU and cost model")
    h.add_argument("--model", default="llama-3.1-8b", metavar="M", action=GivenFlag,
                   help=f"catalog model ({', '.join(catalog_names())}), the Hugging Face id "
                        f"its config came from (meta-llama/Llama-3.1-8B), or a config.json path "
                        f"(default %(default)s)")
    h.add_argument("--gpu", default="h100-sxm", metavar="G",
                   help=f"catalog GPU ({', '.join(gpu_names())}) or a GPU spec .json file "
                        f"(default %(default)s)")
    h.add_argument("--tp", type=positive_int, default=1, action=GivenFlag,
                   help="tensor-parallel GPUs per replica (default %(default)s)")
    h.add_argument("--pp", type=positive_int, default=1, metavar="N", action=GivenFlag,
                   help="pipeline stages per replica (vLLM's --pipeline-parallel-size): the layers "
                        "split over N groups of --tp GPUs, N batches in flight (default %(default)s)")
    h.add_argument("--ep", type=positive_int, default=None, metavar="N",
                   help="expert parallelism of a mixture-of-experts model: its routed experts "
                        "spread over N = tp x dp GPUs (vLLM's --enable-expert-parallel); above "
                        "--tp, each replica is one of N / tp data-parallel attention ranks "
                        "(default 1: every GPU holds every expert, split --tp ways)")
    h.add_argument("--dp", type=positive_int, default=None, metavar="N",
                   help="data-parallel ranks of one deployment (vLLM's --data-parallel-size): N "
                        "replicas, each with --tp GPUs; a mixture-of-experts model's experts "
                        "spread over the N x tp GPUs (--ep N x tp), its MoE layers run over "
                        "all ranks' tokens")
    h.add_argument("--expert-load", default="balanced", metavar="LOAD",
                   help="how a MoE layer's tokens spread over its experts: balanced, or "
                        "power-law:ALPHA (skewed, as NVIDIA aiconfigurator measures; e.g. "
                        "power-law:1.2) (default %(default)s)")
    h.add_argument("--weight-dtype", choices=DTYPES,
                   help="default: the checkpoint's (fp8 where its config.json has an FP8 "
                        "quantization_config, as DeepSeek-V3's, which vLLM serves in FP8; bf16 "
                        "otherwise)")
    h.add_argument("--kv-dtype", "--kv-cache-dtype", choices=DTYPES, default="bf16",
                   action=GivenFlag,
                   help="default %(default)s (--kv-cache-dtype: vLLM's name for it)")
    h.add_argument("--calibration", metavar="FILE",
                   help="calibration profile for this GPU: a JSON file, a packaged profile name, "
                        "or 'none' for the bare roofline (default: the GPU's packaged profile, "
                        "fitted to measured kernel times; see `servelab cost`)")
    h.add_argument("--gpu-memory-utilization", type=positive_float, default=None, metavar="F",
                   help="fraction of GPU memory the engine may use (default: the engine's; 0.9)")
    add_scheduler_options(p, policies=policy_names())
    p.add_argument("--vllm-args", metavar="'FLAGS'",
                   help="a `vllm serve` command line (or its flags), read as the flags above: "
                        "\"vllm serve meta-llama/Llama-3.1-8B --max-num-seqs 256 -tp 2\"; a flag "
                        "also given directly must agree; flags servelab cannot model are refused")

    c = p.add_argument_group("cluster and simulation")
    c.add_argument("--replicas", type=positive_int, default=1, action=GivenFlag,
                   help="engine replicas, each with --tp GPUs (default %(default)s; with --dp "
                        "or --ep above --tp, the data-parallel ranks: a multiple of them)")
    c.add_argument("--router", choices=router_names(), default=None,
                   help="how arrivals are spread over replicas (default round-robin; over the "
                        "data-parallel ranks of --dp, or of --ep above --tp, least-outstanding, "
                        "the closest to vLLM's data-parallel load balancer)")
    c.add_argument("--no-fast-forward", dest="fast_forward", action="store_false",
                   help="simulate every decode step one by one (slower; same results)")
    c.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="each engine schedules a step ahead (vLLM's --async-scheduling): a "
                        "request arriving during a step waits one more (default: the engine's; "
                        "on under the vLLM presets, except with --pp above 1, --speculative "
                        "draft/ngram or --gpu cpu, where vLLM turns it off)")
    from servelab.simulator.disaggregation import add_disaggregation_arguments
    add_disaggregation_arguments(p)   # --prefill-replicas, --decode-replicas, --kv-link, ...
    p.set_defaults(func=_cmd_simulate)


def policy_flag_owners() -> dict[str, str]:
    """Each policy flag's argparse dest -> the policy it configures: for `servelab compare`,
    whose folder (sweeps/) may import simulator/ but not policies/ (DESIGN.md)."""
    from servelab.policies.cli_options import policy_flag_owners as owners
    return owners()


def config_from_args(args: argparse.Namespace):
    """The `SimulationConfig` the flags describe; user errors raise CLIError."""
    from servelab.memory import caches_prefixes
    from servelab.models import catalog_name_of, load_model_spec
    from servelab.policies.cli_options import configs_from_args
    from servelab.simulator.disaggregation import disaggregation_from_args
    from servelab.simulator.run import SimulationConfig
    from servelab.simulator.gpus import get_gpu
    from servelab.traces.cli import trace_dir_from
    from servelab.traces.datasets import DATASETS

    if getattr(args, "vllm_args", None):
        args = with_vllm_args(args)
    alias = None if os.path.exists(args.model) else catalog_name_of(args.model)
    if alias:                                   # a catalog model's Hugging Face id
        args = argparse.Namespace(**{**vars(args), "model": alias})
    with user_errors():
        spec = load_model_spec(args.model)
        context = None if args.max_model_len else spec.context_length
        if args.max_model_len and args.max_model_len > spec.context_length:
            raise ValueError(f"--max-model-len {args.max_model_len:,} is longer than {spec.name}'s "
                             f"context of {spec.context_length:,} tokens (its config.json's "
                             "max_position_embeddings and RoPE scaling); vLLM refuses it too")
        gpu = get_gpu(args.gpu)
    if args.rate is not None and args.rate_scale not in (None, 1.0):
        raise CLIError(f"--rate {args.rate:g} sets the mean request rate, which --rate-scale "
                       f"{args.rate_scale:g} would multiply again: give one of them")
    ep, replicas, ranks = expert_layout(args, spec)
    # data-parallel ranks default to least-outstanding, as --vllm-args -dp N picks it
    # (`servelab.vllm_args`: vLLM's coordinator sends a request to the rank with the fewest
    # waiting and running requests); other replicas to round-robin
    router = args.router or ("least-outstanding" if ranks > 1 else "round-robin")
    opts = configs_from_args(args, default_max_model_len=context,
                             device_memory_bytes=gpu.memory_bytes, device_name=gpu.name)
    cache = opts.cache
    with user_errors():
        disaggregation = disaggregation_from_args(args)
        return SimulationConfig(
            trace=_absolute_if_file(args.trace),
            trace_dir=os.path.abspath(trace_dir_from(args.trace_dir)) if args.trace in DATASETS else None,
            trace_format=args.trace_format, on_bad_row=args.on_bad_row, rate=args.rate,
            arrival_cv=args.arrival_cv, rate_scale=args.rate_scale or 1.0,
            num_requests=args.num_requests, seed=args.seed, download=not args.no_download,
            model=_absolute_if_file(args.model), gpu=_absolute_if_file(args.gpu), tp=args.tp,
            pp=getattr(args, "pp", 1),
            weight_dtype=args.weight_dtype or spec.checkpoint_weight_dtype,
            kv_dtype=args.kv_dtype, ep=ep,
            expert_load=getattr(args, "expert_load", None) or "balanced",
            calibration=_absolute_if_file(args.calibration), engine=opts.engine.name,
            gpu_memory_utilization=opts.gpu_memory_utilization, scheduler=opts.scheduler,
            policy=opts.policy, policy_options=opts.policy_options,
            block_size=cache["block_size"], kv_blocks=cache["num_gpu_blocks"],
            cpu_kv_blocks=cache["num_cpu_blocks"], block_manager=cache["block_manager"],
            prefix_caching=cache["enable_prefix_caching"] and caches_prefixes(cache["block_manager"]),
            watermark=cache["watermark"],
            kv_offload_gb=opts.kv_offload_gb,
            replicas=replicas, router=router, slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms, fast_forward=args.fast_forward,
            async_scheduling=_async_scheduling(args, opts, gpu),
            disaggregation=disaggregation)


def _async_scheduling(args: argparse.Namespace, opts, gpu) -> bool:
    """--async-scheduling, or the engine's default: vLLM turns it on unless something it
    cannot run with is configured (`VllmConfig.__post_init__`, `vllm/config/vllm.py`). Of
    those servelab models: pipeline stages (vLLM 0.14; supported later, but servelab's
    pipelined engine does not model the lag), a speculative proposer other than EAGLE
    or MTP (vLLM PR #31998) and a CPU backend (the `cpu` GPU entry: vLLM PR #31525). A KV
    connector is not among them: disaggregated pools run it."""
    given = getattr(args, "async_scheduling", None)
    if given is not None:
        return given
    spec = opts.scheduler.speculative
    return opts.engine.async_scheduling and getattr(args, "pp", 1) == 1 \
        and (not spec.enabled or spec.method in ("eagle", "mtp")) \
        and gpu.architecture != "cpu"


def expert_layout(args: argparse.Namespace, model) -> tuple[int, int, int]:
    """(ep, replicas, data-parallel ranks of one deployment) from --ep, --dp, --tp and
    --replicas. vLLM's expert-parallel group is
    the TP × DP GPUs of a deployment ("The EP size is automatically calculated",
    docs.vllm.ai serving/expert_parallel_deployment), each data-parallel rank an engine
    with its own scheduler (serving/data_parallel_deployment): --dp N on a
    mixture-of-experts model sets ep = N × tp, and --ep above --tp implies ep / tp ranks.
    The ranks are replicas: --replicas left out becomes their number, and a value given
    must be a multiple of it. On a dense model --dp N is N independent replicas, as vLLM
    runs it. (Commands without these flags, such as the sweeps, get ep 1.)"""
    tp, replicas = args.tp, args.replicas
    ep, dp = getattr(args, "ep", None), getattr(args, "dp", None)
    if dp is not None and model.moe is not None:
        if ep is not None and ep != dp * tp:
            from servelab.simulator.pricing import ep_disagrees_with_dp

            raise CLIError(ep_disagrees_with_dp(ep, dp, tp))
        ep = dp * tp
    ep = ep or 1
    ranks = dp if dp is not None else (ep // tp if ep > tp and ep % tp == 0 else 1)
    from servelab.options import flag_given

    if ranks > 1 and replicas == 1 and not flag_given(args, "replicas"):
        replicas = ranks
    elif replicas % ranks:
        raise CLIError(f"--replicas {replicas} must be a multiple of the {ranks} data-parallel "
                       "ranks of a deployment")
    return ep, replicas, ranks


_VLLM_DESTS_DEFAULTS = {"model": "llama-3.1-8b", "tp": 1, "pp": 1, "replicas": 1,
                        "kv_dtype": "bf16", "policy": "fcfs"}
"""Flags --vllm-args may set whose parser default is not None: a value equal to the default
counts as not given (so that --vllm-args can set it). tests/test_engines.py keeps these
equal to the parser's defaults."""


def _check_prefix_cache_asked(args: argparse.Namespace) -> None:
    """A run that asks for prefix caching or its CPU tier with a block manager that keeps
    no prefix cache is refused (the contiguous baselines build without one, a vLLM preset's
    prefix caching included: what `compare --block-managers` sets paging against)."""
    from servelab.memory import caches_prefixes

    manager = getattr(args, "block_manager", None) or "paged"
    asked = [flag for flag, on in (("--prefix-caching", getattr(args, "prefix_caching", None)),
                                   ("--kv-offload-gb", getattr(args, "kv_offload_gb", None)))
             if on]
    if asked and not caches_prefixes(manager):
        raise CLIError(f"{' and '.join(asked)}: --block-manager {manager} keeps no prefix "
                       f"cache (the paged manager does)")


def with_vllm_args(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with the values --vllm-args sets; a flag given both ways must agree."""
    from servelab.options import flag_given
    from servelab.vllm_args import catalog_model, translate

    with user_errors():
        parsed = translate(args.vllm_args, catalog=catalog_model)
    out = argparse.Namespace(**vars(args))
    for dest, value in parsed.values.items():
        given = getattr(args, dest, None)
        if dest == "router" and given is not None:
            continue   # no vLLM flag: -dp's default router, which a --router given replaces
        explicit = flag_given(args, dest) or (given is not None
                                              and given != _VLLM_DESTS_DEFAULTS.get(dest))
        if explicit and given != value:
            flag = "--" + dest.replace("_", "-")
            raise CLIError(f"{flag} {given} disagrees with --vllm-args, which sets it to {value}")
        setattr(out, dest, value)
    out.vllm_notes = parsed.notes
    return out


def _absolute_if_file(value: str | None) -> str | None:
    """A path given on the command line, made absolute, so that config.json reruns from any
    directory; names ('default', a dataset, a catalog model) are kept as they are."""
    if value is None or not os.path.exists(value):
        return value
    return os.path.abspath(value)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn input errors (ValueError, TraceError, unreadable files) into one-line CLIErrors,
    naming config fields by their flags."""
    try:
        yield
    except (ValueError, OSError) as exc:
        message = f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) and exc.filename \
            else str(exc)
        message = re.sub(r"\b(?:SimulationConfig|SchedulerConfig)\.(\w+)",
                         lambda m: "--" + m.group(1).replace("_", "-"), message)
        raise CLIError(message) from exc


def _without_a_prefix_cache(config) -> list[str]:
    """A note for a router that routes for prefix-cache hits in a run that keeps no prefix
    cache. (A policy that orders by them says so after the run, as every policy that found
    nothing to act on does.)"""
    from servelab.simulator.router import ROUTERS

    if config.prefix_caching or config.replicas == 1 \
            or not ROUTERS.get(config.router).serves_prefix_cache:
        return []
    return [f"--router {config.router} routes for prefix-cache hits, and this run keeps no "
            "prefix cache: nothing is reused (give --prefix-caching)"]


def _cmd_simulate(args: argparse.Namespace) -> int:
    from servelab.progress import RequestProgress
    from servelab.simulator.run import RunCheckError, build_simulation, describe_check_failure, write_run_dir

    from servelab.outdir import OutDirTaken, check_out_dir

    notes = []
    if args.vllm_args:   # read once: its values replace the flags', its notes are printed
        args = with_vllm_args(args)
        notes, args.vllm_args = args.vllm_notes, None
    from servelab.options import speculative_knobs_given

    knobs = speculative_knobs_given(args)
    if args.speculative == "off" and knobs:   # a sweep's off point lets them pass to the others
        raise CLIError(f"{knobs[0]} configures speculative decoding, which --speculative off "
                       "turns off")
    _check_prefix_cache_asked(args)
    config = config_from_args(args)
    with user_errors():
        check_out_dir(Path(args.out), config.to_dict(), force=args.force)
        sim = build_simulation(config)
    from servelab.traces.loaders import UNREAD_COLUMNS

    trace_notes = (getattr(sim, "trace_provenance", None) or {}).get("notes", ())
    notes = [*notes, *(n for n in trace_notes if n.startswith(UNREAD_COLUMNS))]
    cost = getattr(sim, "cost_model", None)         # a co-located run's (pools have two)
    if cost is not None:
        fitted = cost.profile.setup_note(cost.model.name, cost.tp, cost.weight_dtype, cost.kv_dtype)
        notes = [*notes, *(n for n in (fitted, cost.expert_width_note()) if n)]
    notes += _without_a_prefix_cache(config)
    for note in notes:
        print(f"servelab simulate: note: {note}", file=sys.stderr)
    bar = RequestProgress(sim.num_requests, command="simulate", clock="simulated")
    # without a bar (output not a terminal), SimPy runs its own loop: no check per event
    try:
        result = sim.run((lambda sim_s, done, total: bar.update(done, sim_s)) if bar.enabled else None)
        problem = None
    except RunCheckError as exc:   # records to keep: written below, then reported
        result, problem = exc.result, exc
    finally:
        bar.close()
    out = Path(args.out)
    try:   # --out checked again as the files go in: another command may have written it since
        write_run_dir(result, out, args.output_format,
                      check=lambda d: check_out_dir(d, config.to_dict(), force=args.force))
    except OSError as exc:
        raise CLIError(f"cannot write the run directory {out}: {exc.strerror or exc}") from exc
    except OutDirTaken as exc:
        raise CLIError(f"{exc} (written while this run ran: its results are not written)") \
            from exc
    if problem is not None:
        print(f"servelab simulate: error: {describe_check_failure(problem, out)}", file=sys.stderr)
        return 1
    lag = ", asynchronous scheduling" if config.async_scheduling else ""
    line = sim.profile_line        # "carried over: ..." says why: name the profile first
    line = f"{sim.profile_name}, {line}" if line.startswith("carried over") else line
    print(f"engine {config.engine or 'servelab'}{lag}; kernels priced by {line}")
    print(format_summary(result, out, args.output_format))
    if result.disaggregation is not None:   # a prefill and a decode pool
        from servelab.simulator.disaggregated_run import describe
        print(describe(result.disaggregation, args.output_format))
    if not result.summary["completed"]:
        from servelab.reports.health import format_reasons, rejection_reasons
        print(f"servelab simulate: error: no request finished: {result.summary['rejected']:,} rejected "
              f"({format_reasons(rejection_reasons(result.requests))})", file=sys.stderr)
        return 1
    return 0


def format_summary(result, out: Path, output_format: str = "csv") -> str:
    """The lines `servelab simulate` prints: counts, throughput and goodput (n/a without an
    SLO), latencies (n/a over nothing), rejection reasons, and an overload warning."""
    import numpy as np

    from servelab.policies import nothing_to_act_on
    from servelab.reports.columns import column, floats
    from servelab.reports.health import format_reasons, overload, rejection_reasons
    from servelab.traits import TRAIT_COLUMNS, WorkloadTraits
    from servelab.reports.slo import slo_attainment

    s, config = result.summary, result.config
    has_slo = config.slo_ttft_ms is not None or config.slo_tpot_ms is not None or not (
        np.isnan(floats(result.requests, "slo_ttft_ms")).all()
        and np.isnan(floats(result.requests, "slo_tpot_ms")).all())
    goodput = (f"goodput {s['request_goodput']:.2f} req/s ({slo_attainment(s):.1%} of requests within "
               "their SLOs)" if has_slo else "goodput n/a (no SLO: give --slo-ttft-ms / --slo-tpot-ms)")
    lines = [f"{s['completed']} request{'' if s['completed'] == 1 else 's'} finished, "
             f"{s['rejected']} rejected, "
             f"{s['num_preemptions']} preemptions in {s['duration']:.1f} simulated s",
             f"throughput {s['request_throughput']:.2f} req/s, {s['output_throughput']:.0f} output tok/s; {goodput}",
             f"TTFT mean {_ms(s['mean_ttft_ms'], 1)}, p99 {_ms(s['p99_ttft_ms'], 1)}; "
             f"TPOT mean {_ms(s['mean_tpot_ms'], 2)}, p99 {_ms(s['p99_tpot_ms'], 2)}"]
    if s["rejected"]:
        lines.append(f"rejected: {format_reasons(rejection_reasons(result.requests))}")
    sign = overload(result.requests)
    if sign is not None:
        lines.append(f"warning: {sign.describe()}")
    limit = config.scheduler.max_model_len
    done = np.asarray(column(result.requests, "status")) == "finished"
    reached = int(((floats(result.requests, "prompt_tokens") + floats(result.requests, "output_tokens")
                    >= limit) & done).sum())
    if reached:
        lines.append(f"note: {reached:,} request{'' if reached == 1 else 's'} reached "
                     f"--max-model-len {limit:,} (prompt + output): an output the trace asks "
                     "to run longer stops there, as vLLM stops it")
    dropped = (result.derived.get("trace") or {}).get("dropped_rows", 0)
    if dropped:
        lines.append(f"note: --on-bad-row drop left out {dropped:,} of the trace's rows "
                     "(config.json's derived.trace counts them)")
    served = s["completed"] + s["rejected"]
    if config.num_requests is not None and served < config.num_requests:
        lines.append(f"note: the trace holds {served:,} requests, fewer than --num-requests "
                     f"{config.num_requests:,}: all of them were replayed")
    lines += [f"note: {flag} names {', '.join(names)}, which no request of the trace has "
              f"(its tenants: {', '.join(tenants)})" for flag, names, tenants in
              _unknown_tenants(config, set(column(result.requests, "tenant")))]
    idle = nothing_to_act_on(config.policy, WorkloadTraits.of_columns(
        *(column(result.requests, name) for name in TRAIT_COLUMNS)))
    if idle is not None:
        lines.append(f"note: {config.policy} has nothing to act on in this workload ({idle}): "
                     "it orders waiting requests as fcfs does")
    lines.append(f"wrote {out}/config.json, summary.json, requests.{output_format}, "
                 f"steps.{output_format}")
    return "\n".join(lines)


def _unknown_tenants(config, tenants: set) -> list[tuple[str, list[str], list[str]]]:
    """(flag, the tenant names it gives that no request has, the trace's tenants) for the
    per-tenant options a run was given: fair share's weights, speculative acceptance."""
    given = [("--tenant-weights", (config.policy_options or {}).get("weights") or {}),
             ("--acceptance-rate", dict(config.scheduler.speculative.tenant_acceptance))]
    shown = sorted(tenants)[:8] + (["..."] if len(tenants) > 8 else [])
    return [(flag, sorted(set(names) - tenants), shown) for flag, names in given
            if set(names) - tenants]


def _ms(value: float | None, decimals: int) -> str:
    return "n/a" if value is None else f"{value:.{decimals}f} ms"
