"""Achieved HBM bandwidth of paged decode attention against the GPU's peak.

Decode attention is memory-bound: each step streams every cached K/V byte of the batch
once and does ~2 FLOP per byte. So the figure of merit is useful K/V bytes read divided by
kernel time, as a percentage of the HBM peak (H100 SXM: 3350 GB/s). Measured over context
length x batch with Llama-3.1-8B attention shapes (32 query heads, 8 KV heads, head_dim 128,
bf16; one layer), block size 16, every sequence of a batch at the same context length and
its blocks scattered over the pool in random order.

Implementations:
  triton     servelab's paged decode kernel (split-KV, public function incl. its wrapper)
  reference  servelab's PyTorch reference (walks the block table per sequence)
  sdpa       torch scaled_dot_product_attention over a contiguous [B, 8, ctx, 128] cache
             (enable_gqa), the dense baseline with no paging at all

FlashInfer's and vLLM's paged decode kernels would be the fairest baselines; neither is
wired in. The output records whether each is installed on the device, so a reader knows
whether the comparison was possible there.

Timing: CUDA events per iteration after warm-up (which also absorbs Triton's JIT), the L2
cache flushed before each iteration by default, median reported. Tiny configurations are
launch-latency bound, not bandwidth bound; read their percentages accordingly.
`--device cpu` runs the same loop on CPU tensors (Triton under TRITON_INTERPRET=1,
perf_counter timing): a check that the script works, not a measurement of anything.

    python benchmarks/bench_decode_attention.py --out results/decode_attention
    python benchmarks/bench_decode_attention.py --dry-run        # plan only, no GPU needed

Writes ``<out>.json`` (device, settings, rows) and ``<out>.csv`` (rows).
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B
DTYPE = torch.bfloat16
KV_BYTES_PER_TOKEN = 2 * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize  # K and V, one layer
IMPLEMENTATIONS = ("triton", "reference", "sdpa")
L2_FLUSH_BYTES = 256 * 2**20  # larger than any current GPU's L2


@dataclass(frozen=True)
class Row:
    impl: str
    batch: int
    context: int
    kv_bytes: int
    median_us: float
    gbps: float
    pct_of_peak: float


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=_int_list,
                   default=[128, 512, 1024, 2048, 4096, 8192, 16384, 32768],
                   help="context lengths in tokens (comma-separated)")
    p.add_argument("--batches", type=_int_list, default=[1, 4, 16, 64, 256],
                   help="batch sizes (comma-separated)")
    p.add_argument("--impls", default=",".join(IMPLEMENTATIONS),
                   help=f"implementations to run, from {','.join(IMPLEMENTATIONS)}")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--split-size", type=int, default=512, help="split-KV tokens per split")
    p.add_argument("--peak-gbps", type=float, default=3350.0,
                   help="HBM peak in GB/s (10^9 B/s); default H100 SXM")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-flush-l2", action="store_true", help="keep L2 warm between iterations")
    p.add_argument("--max-kv-gib", type=float, default=40.0,
                   help="skip configurations whose K/V cache exceeds this many GiB")
    p.add_argument("--reference-max-tokens", type=int, default=1 << 18,
                   help="run the (slow, per-sequence) reference only while batch x context "
                        "is at most this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: a functional check under the Triton interpreter (default cuda)")
    p.add_argument("--out", type=Path, default=None,
                   help="output path prefix: writes <out>.json and <out>.csv")
    p.add_argument("--dry-run", action="store_true",
                   help="print the planned configurations and exit (no GPU needed)")
    args = p.parse_args(argv)
    impls = [s for s in args.impls.split(",") if s]
    unknown = sorted(set(impls) - set(IMPLEMENTATIONS))
    if unknown or not impls:
        p.error(f"--impls: unknown {unknown}; choose from {','.join(IMPLEMENTATIONS)}")
    args.impls = impls
    for name in ("block_size", "split_size", "iters", "reference_max_tokens"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.warmup < 0 or args.peak_gbps <= 0 or args.max_kv_gib <= 0:
        p.error("--warmup must be >= 0, --peak-gbps and --max-kv-gib > 0")
    return args


def planned(args: argparse.Namespace) -> list[tuple[int, int, list[str]]]:
    """(batch, context, implementations to run) for every configuration within budget."""
    plan = []
    for batch in args.batches:
        for context in args.contexts:
            if batch * context * KV_BYTES_PER_TOKEN > args.max_kv_gib * 2**30:
                continue
            impls = [i for i in args.impls
                     if i != "reference" or batch * context <= args.reference_max_tokens]
            plan.append((batch, context, impls))
    return plan


def other_kernels() -> dict[str, str]:
    """Why each outside paged-decode kernel is not in the table: absent, or not wired in."""
    reasons = {}
    for name in ("flashinfer", "vllm"):
        installed = importlib.util.find_spec(name) is not None
        reasons[name] = ("installed, but this benchmark does not call it yet" if installed
                         else "not installed on this machine")
    return reasons


def _time_us(fn, args: argparse.Namespace, flush: torch.Tensor | None) -> float | None:
    """Median microseconds per call, or None if the call ran out of GPU memory."""
    if args.device == "cpu":
        return _median_wall_time_us(fn, args)
    try:
        return _median_event_time_us(fn, args, flush)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def _median_wall_time_us(fn, args: argparse.Namespace) -> float:
    for _ in range(args.warmup):
        fn()
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _median_event_time_us(fn, args: argparse.Namespace, flush: torch.Tensor | None) -> float:
    for _ in range(args.warmup):
        fn()
    times = []
    for _ in range(args.iters):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _paged_inputs(batch: int, context: int, args: argparse.Namespace, gen: torch.Generator):
    dev = args.device
    blocks_per_seq = -(-context // args.block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, args.block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.empty(shape, dtype=DTYPE, device=dev).normal_(generator=gen)
    v_cache = torch.empty(shape, dtype=DTYPE, device=dev).normal_(generator=gen)
    order = torch.randperm(num_blocks, generator=gen, device=dev)
    block_tables = order.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q = torch.empty(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE,
                    device=dev).normal_(generator=gen)
    return q, k_cache, v_cache, block_tables, seq_lens


def _empty_cache(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        torch.cuda.empty_cache()


def run(args: argparse.Namespace) -> list[Row]:
    from servelab.backends.kernels import paged_decode_attention

    dev = args.device
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    flush = None if args.no_flush_l2 or dev == "cpu" else torch.empty(
        L2_FLUSH_BYTES, dtype=torch.uint8, device=dev)
    scale = HEAD_DIM ** -0.5
    rows = []
    for batch, context, impls in planned(args):
        kv_bytes = batch * context * KV_BYTES_PER_TOKEN
        timings: dict[str, float | None] = {}
        if "triton" in impls or "reference" in impls:
            q, k_cache, v_cache, tables, lens = _paged_inputs(batch, context, args, gen)
            for impl in ("triton", "reference"):
                if impl in impls:
                    timings[impl] = _time_us(
                        lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale,
                                                       use_triton=impl == "triton",
                                                       split_size=args.split_size),
                        args, flush)
            del q, k_cache, v_cache, tables, lens
            _empty_cache(args)
        if "sdpa" in impls:
            shape = (batch, NUM_KV_HEADS, context, HEAD_DIM)
            k = torch.empty(shape, dtype=DTYPE, device=dev).normal_(generator=gen)
            v = torch.empty(shape, dtype=DTYPE, device=dev).normal_(generator=gen)
            q = torch.empty(batch, NUM_HEADS, 1, HEAD_DIM, dtype=DTYPE,
                            device=dev).normal_(generator=gen)
            timings["sdpa"] = _time_us(
                lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, scale=scale, enable_gqa=True), args, flush)
            del q, k, v
            _empty_cache(args)
        for impl, us in timings.items():
            if us is None:
                print(f"  {impl:<9} batch {batch:>4} ctx {context:>6}: out of GPU memory, skipped")
                continue
            gbps = kv_bytes / (us * 1e-6) / 1e9
            rows.append(Row(impl, batch, context, kv_bytes, round(us, 2), round(gbps, 1),
                            round(100 * gbps / args.peak_gbps, 1)))
            print(f"  {impl:<9} batch {batch:>4} ctx {context:>6}: {us:10.1f} us "
                  f"{gbps:8.1f} GB/s ({100 * gbps / args.peak_gbps:5.1f}% of peak)", flush=True)
    return rows


def format_table(rows: list[Row], impls: list[str]) -> str:
    """One line per (batch, context): GB/s and % of peak for each implementation."""
    by_key: dict[tuple[int, int], dict[str, Row]] = {}
    for r in rows:
        by_key.setdefault((r.batch, r.context), {})[r.impl] = r
    header = f"{'batch':>5} {'context':>7} " + " ".join(
        f"{i + ' GB/s (%peak)':>24}" for i in impls)
    lines = [header, "-" * len(header)]
    for (batch, context), cells in sorted(by_key.items()):
        text = [f"{cells[i].gbps:>15.1f} ({cells[i].pct_of_peak:>5.1f}%)" if i in cells
                else f"{'-':>24}" for i in impls]
        lines.append(f"{batch:>5} {context:>7} " + " ".join(text))
    return "\n".join(lines)


def write_outputs(out: Path, rows: list[Row], args: argparse.Namespace, device: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    payload = {"device": device, "dtype": str(DTYPE), "num_heads": NUM_HEADS,
               "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM, "settings": settings,
               "not_compared": other_kernels(), "rows": [asdict(r) for r in rows]}
    out.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    with out.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(Row.__dataclass_fields__))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = planned(args)
    if args.dry_run:
        for batch, context, impls in plan:
            gib = batch * context * KV_BYTES_PER_TOKEN / 2**30
            print(f"batch {batch:>4} ctx {context:>6}: {gib:7.3f} GiB K/V  {','.join(impls)}")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_decode_attention: needs a CUDA GPU (torch.cuda.is_available() is False); "
              "use --dry-run to check the plan, or --device cpu to exercise the script",
              file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{device}; peak {args.peak_gbps:.0f} GB/s; {len(plan)} configurations")
    rows = run(args)
    print(format_table(rows, args.impls))
    if args.out is not None:
        write_outputs(args.out, rows, args, device)
        print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.csv')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
