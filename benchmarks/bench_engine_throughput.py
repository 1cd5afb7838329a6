"""servelab's real engine against Hugging Face transformers `generate()` with static batching.

Both serve the same requests on the same GPU — a slice of a public trace (default: the
first 200 requests of azure-conv-2023), the same synthetic prompt token ids, the same output
lengths — with a model of Llama-3.1-8B's shapes (seeded random weights, bf16; random
weights cost exactly what trained ones cost). Neither may stop early: servelab replays the
trace's output lengths (EOS ignored); generate() is forced with
min_new_tokens = max_new_tokens.

- servelab: `servelab run --device cuda` — continuous batching, paged KV, Triton kernels —
  on the wall clock.
- HF static batching: requests are taken in arrival order in batches of --hf-batch-size
  (a batch starts when the previous one ends, with the requests that have arrived by then,
  or waits for the next arrival); prompts are left-padded; a batch generates the longest
  output among its requests, and each request counts only its own tokens. Token times come
  from a stopping criterion that synchronises and reads the clock after every token.

Metrics (output tokens per second, TTFT and TPOT percentiles) are computed for both by
`servelab.reports.summarize` from per-request records, so the definitions are identical.
By default every request arrives at t = 0 (an offline throughput test); --trace-arrivals
replays the trace's arrival times instead (scaled by --rate-scale).

    python benchmarks/bench_engine_throughput.py --out results/engine_throughput
    python benchmarks/bench_engine_throughput.py --dry-run      # the plan only, no GPU needed

Writes ``<out>.json`` (device, settings, both engines' metrics, the speed-up) and the
servelab run directory ``<out>-servelab/``. The JSON is rewritten after each engine, so a
run stopped during the second keeps the first's figures. `--device cpu` (with a small
model such as tiny-llama and --dtype float32) exercises the same code on the CPU: a check
that the script works, not a measurement.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from servelab.options import positive_float, positive_int
from servelab.records import RequestRecord

REPORTED = ("request_throughput", "output_throughput", "total_token_throughput", "duration",
            "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
            "mean_tpot_ms", "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms", "num_preemptions")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b", help="catalog name or config.json")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--trace", default="azure-conv-2023", help="dataset name or trace file")
    p.add_argument("--trace-dir", default=None,
                   help="where datasets live (default: $SERVELAB_TRACE_DIR or ~/.cache/servelab/traces)")
    p.add_argument("--num-requests", type=positive_int, default=200)
    p.add_argument("--max-model-len", type=positive_int, default=4096,
                   help="clip prompt + output to this many tokens (counted in the plan)")
    p.add_argument("--trace-arrivals", action="store_true",
                   help="replay the trace's arrival times (default: all arrive at t = 0)")
    p.add_argument("--rate-scale", type=positive_float, default=1.0,
                   help="with --trace-arrivals: replay this many times faster")
    p.add_argument("--hf-batch-size", type=positive_int, default=32)
    p.add_argument("--policy", default="fcfs")
    p.add_argument("--max-num-seqs", type=positive_int, default=256)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=8192)
    p.add_argument("--chunked-prefill", type=positive_int, default=2048)
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--kv-blocks", type=positive_int, default=None,
                   help="servelab's KV blocks (default: derived from free GPU memory)")
    p.add_argument("--gpu-memory-utilization", type=positive_float, default=0.85)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true", help="run servelab only")
    p.add_argument("--skip-servelab", action="store_true", help="run the HF baseline only")
    p.add_argument("--out", type=Path, default=Path("results/engine_throughput"),
                   help="output path prefix (default %(default)s)")
    p.add_argument("--dry-run", action="store_true",
                   help="load the trace, print the plan and exit (no GPU needed)")
    args = p.parse_args(argv)
    if args.skip_hf and args.skip_servelab:
        p.error("--skip-hf and --skip-servelab leave nothing to run")
    if args.rate_scale != 1.0 and not args.trace_arrivals:
        p.error("--rate-scale only applies with --trace-arrivals")
    if not 0 < args.gpu_memory_utilization <= 1:
        p.error("--gpu-memory-utilization must be in (0, 1]")
    return args


def load_workload(args: argparse.Namespace):
    """The trace slice as replayed by both engines, and its requests with prompt token ids."""
    from servelab.backends.executor import with_prompt_tokens
    from servelab.models import load_model_spec
    from servelab.traces import clip_lengths, first_n, resolve_trace, scale_rate
    from servelab.traces.cli import trace_dir_from

    spec = load_model_spec(args.model)
    trace = resolve_trace(args.trace, trace_dir=trace_dir_from(args.trace_dir))
    trace = clip_lengths(first_n(trace, args.num_requests), args.max_model_len)
    if args.trace_arrivals:
        if args.rate_scale != 1.0:
            trace = scale_rate(trace, args.rate_scale)
        start = trace.records[0].arrival_s
        trace = trace.with_records(
            (replace(r, arrival_s=r.arrival_s - start) for r in trace.records),
            note="re-based to the first arrival")
    else:
        trace = trace.with_records((replace(r, arrival_s=0.0) for r in trace.records),
                                   note="all requests arrive at t = 0 (offline)")
    requests = [with_prompt_tokens(r, spec.vocab_size, args.seed)
                for r in trace.to_requests(seed=args.seed)]
    return spec, trace, requests


def print_plan(args, trace, requests) -> None:
    prompts = sum(r.prompt_len for r in requests)
    outputs = sum(r.output_len for r in requests)
    size = args.hf_batch_size
    batches = [requests[i:i + size] for i in range(0, len(requests), size)]
    generated = sum(max(r.output_len for r in b) * len(b) for b in batches)
    print(f"{len(requests)} requests from {trace.source} ({trace.num_clipped} clipped to "
          f"{args.max_model_len} tokens): {prompts} prompt and {outputs} output tokens; "
          f"arrivals {'from the trace' if args.trace_arrivals else 'all at t = 0'}")
    print(f"servelab: {args.model} {args.dtype}, policy {args.policy}, max_num_seqs "
          f"{args.max_num_seqs}, {args.max_num_batched_tokens} tokens/step, chunk "
          f"{args.chunked_prefill}, block {args.block_size}")
    print(f"HF static batching: {len(batches)} batches of <= {args.hf_batch_size}; generates "
          f"{generated} tokens for {outputs} wanted ({generated / outputs:.2f}x)")


def run_servelab(args, trace, requests, out_dir: Path, device: str = "cuda") -> dict:
    from servelab.backends.run import RealRunConfig, run_real
    from servelab.config import SchedulerConfig

    config = RealRunConfig(
        model=args.model, device=device, dtype=args.dtype, use_triton=device.startswith("cuda"),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  chunked_prefill=args.chunked_prefill,
                                  max_model_len=args.max_model_len),
        cache=dict(block_size=args.block_size, num_gpu_blocks=args.kv_blocks),
        policy=args.policy, replay=True, clock="wall", seed=args.seed,
        gpu_memory_utilization=args.gpu_memory_utilization, trace=trace)
    result = run_real(config, out_dir, requests=[r.fresh_copy() for r in requests])
    metrics = {k: result.summary[k] for k in REPORTED}
    metrics.update(num_gpu_blocks=result.num_gpu_blocks, run_dir=str(out_dir))
    return metrics


def run_hf_static(args, spec, requests, device: str = "cuda") -> dict:
    import transformers
    from servelab.reports import summarize

    on_gpu = torch.device(device).type == "cuda"

    class TokenClock(transformers.StoppingCriteria):
        """Never stops generation: waits for the GPU and stamps each token's time."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            if on_gpu:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    @torch.inference_mode()
    def generate(model, batch, new_tokens: int | None = None) -> list[float]:
        """Left-padded static batch; the wall time of each generated token."""
        width = max(r.prompt_len for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):
            ids[row, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
            mask[row, width - r.prompt_len:] = 1
        new = new_tokens or max(r.output_len for r in batch)
        clock = TokenClock()
        model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                       max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                       pad_token_id=0, stopping_criteria=[clock])
        if len(clock.times) != new:
            raise RuntimeError(f"generate() produced {len(clock.times)} tokens, expected {new}")
        return clock.times

    hf_config = dict(spec.hf_config)
    config = transformers.AutoConfig.for_model(hf_config.pop("model_type", "llama"), **hf_config)
    config.eos_token_id = None
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = getattr(transformers, spec.architecture)._from_config(
            config, dtype=getattr(torch, args.dtype)).eval()
    generate(model, requests[:1], new_tokens=2)  # CUDA / cuBLAS warm-up, not timed
    records: list[RequestRecord] = []
    pending = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
    t0 = time.perf_counter()
    i = 0
    while i < len(pending):
        now = time.perf_counter() - t0
        if pending[i].arrival_s > now:
            time.sleep(pending[i].arrival_s - now)
            now = time.perf_counter() - t0
        batch = []
        while i < len(pending) and len(batch) < args.hf_batch_size and pending[i].arrival_s <= now:
            batch.append(pending[i])
            i += 1
        times = [t - t0 for t in generate(model, batch)]
        for r in batch:
            tokens = times[:r.output_len]
            records.append(RequestRecord(
                request_id=r.request_id, arrival_s=r.arrival_s, prompt_tokens=r.prompt_len,
                output_tokens=r.output_len, status="finished", scheduled_s=now,
                first_token_s=tokens[0], finish_s=tokens[-1], token_times=tokens))
    del model
    if on_gpu:
        torch.cuda.empty_cache()
    summary = summarize(records, [])
    return {k: summary[k] for k in REPORTED if k != "num_preemptions"}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.dry_run and args.device == "cuda" and not torch.cuda.is_available():
        print("bench_engine_throughput: needs a CUDA GPU (torch.cuda.is_available() is False); "
              "use --dry-run to check the plan", file=sys.stderr)
        return 2
    spec, trace, requests = load_workload(args)
    print_plan(args, trace, requests)
    if args.dry_run:
        return 0
    on_gpu = args.device == "cuda"
    results: dict = {"device": torch.cuda.get_device_name() if on_gpu else "cpu",
                     "model": args.model,
                     "settings": {k: (str(v) if isinstance(v, Path) else v)
                                  for k, v in vars(args).items()},
                     "num_requests": len(requests),
                     "output_tokens": sum(r.output_len for r in requests)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    path = args.out.with_suffix(".json")
    if not args.skip_servelab:
        results["servelab"] = run_servelab(args, trace, requests,
                                           args.out.with_name(args.out.name + "-servelab"),
                                           device=args.device)
        path.write_text(json.dumps(results, indent=2) + "\n")
        gc.collect()  # the run's KV cache must be gone before generate() needs the memory
        if on_gpu:
            torch.cuda.empty_cache()
    if not args.skip_hf:
        results["hf_static"] = run_hf_static(args, spec, requests, device=args.device)
    if "servelab" in results and "hf_static" in results:
        results["output_throughput_speedup"] = (results["servelab"]["output_throughput"]
                                                / results["hf_static"]["output_throughput"])
    path.write_text(json.dumps(results, indent=2) + "\n")
    for engine in ("servelab", "hf_static"):
        if engine in results:
            m = results[engine]
            print(f"{engine:>9}: {m['output_throughput']:9.1f} output tok/s  TTFT p50/p99 "
                  f"{m['median_ttft_ms']:.0f}/{m['p99_ttft_ms']:.0f} ms  TPOT p50/p99 "
                  f"{m['median_tpot_ms']:.1f}/{m['p99_tpot_ms']:.1f} ms")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
