"""`servelab run`: replay a trace on a real model through the shared scheduler.

    servelab run --backend torch --device cuda --model llama-3.1-8b --trace azure-conv-2023 \\
        --num-requests 200 --policy fcfs --out runs/real-fcfs

Scheduler, KV-cache and policy flags are the ones `servelab simulate` takes
(`servelab.options`), so a simulated and a real run of the same trace are spelled alike;
so are its disaggregation flags (`simulator.disaggregation`): `--prefill-replicas 1
--decode-replicas 1` runs a prefill engine and a decode engine (`backends.disaggregated`),
and the flags that only a simulated pool or link has are refused in one line.
`--triton` on a CPU runs the kernels in Triton's interpreter: this command then sets
TRITON_INTERPRET=1 itself, before anything imports triton.

Importing this module is cheap (no torch); the handler imports what it needs.
"""
from __future__ import annotations

import argparse
import os
import sys

from servelab.cli import CLIError
from servelab.options import (add_output_options, add_workload_options, fraction,
                              non_negative_float, non_negative_int)
from servelab.policies.cli_options import add_scheduler_options, configs_from_args

DTYPE_CHOICES = ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16")


def register(subparsers) -> None:
    from servelab.policies import policy_names
    from servelab.backends.disaggregated import add_arguments as add_disaggregation_arguments
    from servelab.traces.cli import add_trace_arguments

    p = subparsers.add_parser(
        "run", help="replay a trace on a real model (PyTorch + Triton paged attention)",
        description="Replay a trace through the shared scheduler on a real Llama-family model "
                    "and write a run directory (config.json, summary.json, requests and steps "
                    "as .csv or .parquet, outputs.jsonl; speculation.json when speculating; "
                    "handoffs and disaggregation.json when disaggregated) comparable with "
                    "`servelab simulate`'s.")
    p.add_argument("--backend", choices=("torch",), default="torch",
                   help="model runtime (default %(default)s)")
    p.add_argument("--device", default="auto",
                   help="cpu, cuda or cuda:N; auto = cuda if available (default %(default)s)")
    p.add_argument("--model", metavar="M",
                   help="catalog name or config.json path (default: the checkpoint's config)")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="folder of safetensors weights (default: seeded random weights)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="run directory to write (refused when it holds another run)")
    p.add_argument("--force", action="store_true",
                   help="write into --out even when it holds another run or other files")
    add_output_options(p)
    add_trace_arguments(p)
    add_scheduler_options(p, policies=policy_names())
    add_workload_options(p)
    add_disaggregation_arguments(p)   # one prefill and one decode engine: docs/disaggregation-real.md
    _as_the_real_backend_takes_them(p)

    b = p.add_argument_group("real backend")
    b.add_argument("--pp", type=int, default=1, metavar="N", help=argparse.SUPPRESS)   # refused below
    b.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                   help="weights, activations and KV (default: bfloat16 on CUDA, float32 on CPU)")
    b.add_argument("--triton", action=argparse.BooleanOptionalAction, default=None,
                   help="Triton kernels (default: on CUDA yes; on CPU no — --triton there runs "
                        "Triton's interpreter, slowly)")
    b.add_argument("--clock", choices=("virtual", "wall"), default="virtual",
                   help="virtual: time advances by measured step durations, idle gaps skipped; "
                        "wall: real time, arrivals waited for (default %(default)s)")
    b.add_argument("--gpu-memory-utilization", type=fraction, default=None, metavar="F",
                   help="fraction of GPU memory the run may use when --kv-blocks is not given "
                        "(default: the engine's, 0.9)")
    b.add_argument("--temperature", type=non_negative_float, default=0.0,
                   help="0 = greedy (default %(default)s)")
    b.add_argument("--top-k", type=non_negative_int, default=0, help="0 = off (default)")
    b.add_argument("--top-p", type=fraction, default=1.0, help="1 = off (default)")
    b.add_argument("--replay", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly each request's trace output length, ignoring EOS "
                        "(default: on)")
    b.add_argument("--save-outputs", action=argparse.BooleanOptionalAction, default=True,
                   help="write outputs.jsonl with every request's token ids (default: on)")
    p.set_defaults(func=_cmd_run)


def _resolve_device(name: str) -> str:
    if name != "auto":
        return name
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _recorded(args: argparse.Namespace) -> dict:
    """The parsed flags as JSON values, for config.json ('off' for an infinite wait)."""
    out = {}
    for key, value in sorted(vars(args).items()):
        if callable(value) or key in ("force", "given_flags"):   # how to write or parse,
            continue                                              # not what was run
        out[key] = "off" if value == float("inf") else value
    return out


def _device_memory(device: str) -> tuple[int, str]:
    """The device's memory in bytes and its name, which some engine defaults depend on
    (`EnginePreset.batch_defaults`); (0, "cpu") on the CPU, where vLLM, unable to query a
    GPU, takes its small-GPU defaults."""
    import torch

    from servelab.backends.weights import resolve_device
    try:
        resolved = resolve_device(device)
    except ValueError as exc:  # no CUDA, or no such GPU: one line, before anything is written
        raise CLIError(str(exc)) from None
    if resolved.type != "cuda":
        return 0, "cpu"
    props = torch.cuda.get_device_properties(resolved)
    return props.total_memory, props.name


BACKEND_MODULES = ("torch", "triton", "transformers", "safetensors")
"""What `servelab run` needs beyond the simulator: the `backend` extra of pyproject.toml
(tests/test_packaging.py keeps the two the same)."""


def check_backend_installed() -> None:
    """A clear error, with the command that fixes it, when the backend extra is missing."""
    import importlib.util

    missing = [name for name in BACKEND_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise CLIError(f"servelab run needs the real backend's packages ({', '.join(missing)} "
                       "missing): pip install 'servelab[backend]' (on a machine without a GPU "
                       "add PIP_CONSTRAINT=constraints/cpu.txt for the CPU build of torch), or "
                       "run bash scripts/test.sh, which installs them")


def _as_the_real_backend_takes_them(parser: argparse.ArgumentParser) -> None:
    """The help of flags shared with `simulate` that `run` takes narrower: the proposers it
    runs (`backends.speculative.REAL_METHODS`), one engine per pool, and no acceptance
    rate to draw from (it measures one); each is refused in one line beyond that."""
    for action in parser._actions:
        if action.dest == "speculative":
            action.metavar = "draft:MODEL|ngram|off"
            action.help = ("the proposer: a draft model of the target's vocabulary "
                           "(draft:tiny-llama) or an n-gram lookup (default: off); EAGLE and "
                           "MTP heads are simulation-only")
        elif action.dest == "acceptance_rate":
            action.help = argparse.SUPPRESS   # refused: the run measures its acceptance
        elif action.dest in ("prefill_replicas", "decode_replicas"):
            action.help = f"{action.dest.split('_')[0]} replicas: 1 (one engine each)"


def _cmd_run(args: argparse.Namespace) -> int:
    if args.pp != 1:
        raise CLIError(f"--pp {args.pp}: pipeline parallelism is simulation-only (servelab simulate "
                       "--pp); the real backend runs a model on one device")
    if args.model is None and args.checkpoint is None:
        raise CLIError("give --model, --checkpoint, or both")
    if getattr(args, "acceptance_rate", None) is not None:
        raise CLIError("--acceptance-rate is the simulator's: the real backend measures how "
                       "many proposed tokens its target accepts (speculation.json)")
    check_backend_installed()
    device = _resolve_device(args.device)
    if args.triton and device.split(":")[0] == "cpu":
        # The kernels are decorated when first imported: the interpreter must be chosen first.
        if "servelab.backends.kernels.decode_attention" in sys.modules \
                and os.environ.get("TRITON_INTERPRET") != "1":
            raise CLIError("--triton on the CPU needs TRITON_INTERPRET=1 before the kernels "
                           "are imported; set it in the environment")
        os.environ["TRITON_INTERPRET"] = "1"

    from servelab.backends.disaggregated import RealDisaggregation
    from servelab.backends.run import CPU_KV_BYTES, RealRunConfig, RunSetupError, run_real
    from servelab.backends.sampling import SamplingParams
    from servelab.models import load_model_spec
    from servelab.traces.cli import trace_from_args
    from servelab.traces.record import TraceError
    from servelab.traces.transforms import first_n, scale_rate

    try:
        disaggregation = RealDisaggregation.from_args(args)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    try:
        spec = load_model_spec(args.model if args.model is not None else args.checkpoint)
    except (ValueError, OSError) as exc:  # unknown model, unsupported architecture
        raise CLIError(str(exc)) from None
    from servelab.backends.model import sliding_window
    window = sliding_window(spec)
    memory, name = _device_memory(device)
    opts = configs_from_args(args, default_max_model_len=min(
        spec.max_position_embeddings, window or spec.max_position_embeddings),
        device_memory_bytes=memory, device_name=name)
    if opts.scheduler.preemption == "swap" and not opts.cache["num_cpu_blocks"]:
        print("servelab run: note: --preemption swap without --cpu-kv-blocks: every "
              "preemption falls back to recompute", file=sys.stderr)
    out = os.fspath(args.out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise CLIError(f"--out {out} exists and is not a directory")
    trace = trace_from_args(args, seed=args.seed)
    try:
        if args.rate_scale is not None:
            trace = scale_rate(trace, args.rate_scale)
        if args.num_requests is not None:
            trace = first_n(trace, args.num_requests)
    except TraceError as exc:
        raise CLIError(str(exc)) from None
    try:
        config = RealRunConfig(
            model=args.model, checkpoint=args.checkpoint, device=device, dtype=args.dtype,
            use_triton=args.triton, scheduler=opts.scheduler, cache=opts.cache,
            policy=opts.policy, policy_options=opts.policy_options,
            sampling=SamplingParams(args.temperature, args.top_k, args.top_p),
            replay=args.replay, clock=args.clock, seed=args.seed,
            gpu_memory_utilization=opts.gpu_memory_utilization, trace=trace,
            slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
            save_outputs=args.save_outputs, cli_args=_recorded(args),
            output_format=args.output_format, kv_offload_gb=opts.kv_offload_gb,
            disaggregation=disaggregation)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    try:
        result = run_real(config, out, force=args.force)
    except RunSetupError as exc:
        raise CLIError(str(exc)) from None
    if args.gpu_memory_utilization is not None and device.split(":")[0] == "cpu" \
            and args.kv_blocks is None:
        print(f"servelab run: note: --gpu-memory-utilization sizes the KV cache on a GPU; on "
              f"the CPU it holds at most {CPU_KV_BYTES // 2**20} MiB ({result.num_gpu_blocks:,} "
              "blocks here): set it with --kv-blocks", file=sys.stderr)
    if opts.engine is not None and opts.engine.async_scheduling and device.split(":")[0] != "cpu":
        # (vLLM's CPU backend schedules synchronously too: vllm-project/vllm#31525)
        print(f"servelab run: note: {opts.engine.name} schedules asynchronously (a request "
              "arriving during a step waits one step more); this engine steps synchronously, "
              "as `servelab simulate --no-async-scheduling` does", file=sys.stderr)
    s = result.summary
    if not s["completed"]:                   # as simulate says it: no latency to print
        from servelab.reports.health import format_reasons, rejection_reasons
        print(f"servelab run: error: no request finished: {s['rejected']:,} rejected "
              f"({format_reasons(rejection_reasons(result.records))}); the run is in {out}",
              file=sys.stderr)
        return 1
    hits = ""
    if s.get("prefix_cache_hit_rate") is not None:
        hits = f", prefix cache hit rate {s['prefix_cache_hit_rate']:.1%}"
        if opts.kv_offload_gb:
            hits += f" ({s['prefix_cache_cpu_hit_rate']:.1%} from the CPU tier)"
    speculated = ""
    if result.speculation is not None:
        spec = result.speculation
        speculated = (f", speculative acceptance {spec['acceptance_rate']:.1%} "
                      f"({spec['tokens_per_verify_step']:.2f} tokens per verify step)"
                      if spec["proposed_tokens"] else ", nothing speculated")
    handed = ""
    if result.disaggregation is not None:
        r = result.disaggregation.report
        transfer = r["handoff_ms"]["transfer"]
        handed = (f", {r['transfers']['count']} handoffs ({r['transfers']['bytes'] / 2**20:.1f} MiB, "
                  f"copy mean {transfer['mean'] or 0.0:.3f} ms, "
                  f"{r['back_pressure']['requests_that_waited']} waited for the decode engine)")
    print(f"{s['completed']} requests finished, {s['rejected']} rejected in {s['duration']:.3f} s "
          f"({args.clock} clock): {s['output_throughput']:.1f} output tok/s, "
          f"mean TTFT {s['mean_ttft_ms']:.1f} ms, mean TPOT {s['mean_tpot_ms']:.2f} ms, "
          f"{s['num_preemptions']} preemptions{hits}{speculated}{handed} -> {out}")
    return 0
