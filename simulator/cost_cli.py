"""`servelab cost`: what the cost model thinks a kernel or a whole step costs.

    servelab cost gemm --gpu h100-sxm --m 512 --n 4096 --k 4096
    servelab cost attention --gpu a100-80gb --phase decode --batch 64 --context 2048 \\
        --heads 32 --kv-heads 8 --head-dim 128
    servelab cost allreduce --gpu h100-sxm --gpus 4 --elements 4194304
    servelab cost step --gpu h100-sxm --model llama-3.1-8b --prefill 512,2048:1024 --decode 32:1500
    servelab cost step --gpu h100-sxm --model llama-3.1-70b --tp 4 --pp 2 --decode 64:2000
    servelab cost moe --gpu h100-sxm --tokens 256 --hidden 7168 --inter 2048 --experts 256 \
        --topk 8 --ep 8 --dtype fp8 --expert-load power-law:1.2
    servelab cost mla --gpu h100-sxm --phase decode --batch 64 --context 4096 --heads 128 --tp 8
    servelab cost gemm --gpu l40s --points shapes.csv --out priced.csv

Each prints milliseconds; `--json` prints machine-readable output; `--points FILE.csv` prices
every row of a CSV whose columns are named like the flags (a flag gives the value of a
missing column) and writes the same rows with a `predicted_ms` column. `--calibration
FILE|NAME|none` chooses the parameters; `--engine-version V` the packaged profile fitted
to that vLLM version's kernels (see `calibration.profile_for`); with neither, the profile
`servelab simulate` prices the GPU with by default (its default engine's version). The
answer names the profile and its engine version.

Importing this module is cheap; the handler imports numpy and the cost model.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys

from servelab.cli import CLIError
from servelab.options import non_negative_int, positive_int

KINDS = ("gemm", "attention", "allreduce", "step", "moe", "mla")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "cost", help="price a GEMM, an attention, MoE or MLA kernel, an all-reduce or a whole step",
        description="Print what the cost model charges for one kernel or one engine step, "
                    "in milliseconds, with the roofline terms behind it.")
    kinds = p.add_subparsers(dest="kind", metavar="KIND", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--gpu", required=True, metavar="G", help="catalog GPU or GPU spec .json")
    common.add_argument("--calibration", metavar="FILE",
                        help="profile file, packaged profile name, or 'none' for the bare "
                             "roofline (default: the one --engine-version picks)")
    common.add_argument("--engine-version", metavar="V",
                        help="price as the kernels of this vLLM version run (e.g. 0.24.0): the "
                             "packaged profile fitted to them, or the nearest one, as "
                             "`calibration.profile_for` picks (default: the version of "
                             "`simulate`'s default engine)")
    common.add_argument("--json", action="store_true",
                        help="print JSON (with --points: the priced rows)")
    common.add_argument("--points", metavar="FILE.csv",
                        help="price every row of a CSV (columns named like the flags)")
    common.add_argument("--out", metavar="FILE.csv",
                        help="with --points: where to write the priced rows (default: stdout)")

    g = kinds.add_parser("gemm", parents=[common], help="one [m,k] x [k,n] GEMM")
    g.add_argument("--m", type=positive_int, help="rows (tokens)")
    g.add_argument("--n", type=positive_int, help="output features")
    g.add_argument("--k", type=positive_int, help="input features (reduction)")
    g.add_argument("--dtype", choices=("bf16", "fp16", "fp8"), default="bf16",
                   help="input dtype (fp8: W8A8 at the FP8 peak; default %(default)s)")

    a = kinds.add_parser("attention", parents=[common], help="prefill or decode attention, one layer")
    a.add_argument("--phase", choices=("prefill", "decode"))
    a.add_argument("--batch", type=positive_int, help="sequences")
    a.add_argument("--tokens", type=positive_int,
                   help="prefill: new tokens per sequence (decode: ignored, one each)")
    a.add_argument("--context", type=non_negative_int, default=0,
                   help="tokens already cached per sequence (default %(default)s)")
    a.add_argument("--heads", type=positive_int, help="query heads")
    a.add_argument("--kv-heads", type=positive_int, help="KV heads")
    a.add_argument("--head-dim", type=positive_int, default=128, help="default %(default)s")
    a.add_argument("--kv-dtype", choices=("bf16", "fp16", "fp8"), default="bf16",
                   help="default %(default)s")

    r = kinds.add_parser("allreduce", parents=[common], help="one all-reduce")
    r.add_argument("--gpus", type=positive_int, help="GPUs in the group")
    r.add_argument("--elements", type=positive_int, help="elements per GPU")
    r.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                   help="default %(default)s")

    e = kinds.add_parser("moe", parents=[common],
                         help="one mixture-of-experts layer (router GEMM + fused experts)")
    e.add_argument("--tokens", type=positive_int, help="tokens in the step (every GPU sees them)")
    e.add_argument("--hidden", type=positive_int, help="hidden size")
    e.add_argument("--inter", type=positive_int, help="one expert's intermediate size")
    e.add_argument("--experts", type=positive_int, help="routed experts")
    e.add_argument("--topk", type=positive_int, help="experts per token")
    e.add_argument("--ep", type=positive_int, default=1,
                   help="expert parallelism: GPUs the experts are spread over (default 1)")
    e.add_argument("--tp", type=positive_int, default=1,
                   help="tensor parallelism: GPUs each expert's width is split over (default 1; "
                        "with --ep, one layer on ep x tp GPUs, as aiconfigurator's tables "
                        "measure it; `cost step --ep` is vLLM's layout: experts whole over ep GPUs)")
    e.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16",
                   help="expert weights (fp8: W8A8 where the GPU has FP8 tensor cores, else "
                        "weight-only as vLLM's Marlin kernel runs it; default %(default)s)")
    e.add_argument("--expert-load", default="balanced", metavar="balanced|power-law:ALPHA",
                   help="how tokens spread over experts (default %(default)s; power-law as "
                        "aiconfigurator measures it, the most loaded GPU priced)")
    e.add_argument("--routing", choices=("renormalize", "softmax"), default="renormalize",
                   help="the router's top-k: renormalised (Mixtral, Qwen3 with norm_topk_prob, "
                        "and DeepSeek-V3's grouped top-k) or plain softmax, which some engines "
                        "run on another BF16 kernel (vLLM 0.24 on Blackwell: FlashInfer's "
                        "CUTLASS one; default %(default)s)")

    m = kinds.add_parser("mla", parents=[common],
                         help="multi-head latent attention (DeepSeek style), one layer")
    m.add_argument("--phase", choices=("prefill", "decode"))
    m.add_argument("--batch", type=positive_int, help="sequences")
    m.add_argument("--tokens", type=positive_int,
                   help="prefill: new tokens per sequence (decode: one each)")
    m.add_argument("--context", type=non_negative_int, default=0,
                   help="tokens already cached per sequence (default %(default)s)")
    m.add_argument("--heads", type=positive_int, help="the model's attention heads (all GPUs)")
    m.add_argument("--tp", type=positive_int, default=1,
                   help="tensor parallelism: divides the heads (default 1)")
    m.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16",
                   help="latent cache dtype (default %(default)s)")

    s = kinds.add_parser("step", parents=[common], help="a whole engine step, op by op")
    s.add_argument("--model", help="catalog model or config.json")
    s.add_argument("--tp", type=positive_int, default=1, help="tensor parallelism (default 1)")
    s.add_argument("--weight-dtype", choices=("bf16", "fp16", "fp8"),
                   help="default: the checkpoint's (fp8 for deepseek-v3, bf16 otherwise), as "
                        "`simulate` takes it")
    s.add_argument("--kv-dtype", choices=("bf16", "fp16", "fp8"), default="bf16")
    s.add_argument("--ep", type=positive_int, default=None, metavar="N",
                   help="a mixture-of-experts model's expert parallelism, as `simulate --ep` "
                        "(default 1; above --tp, this GPU is one of N / tp data-parallel "
                        "ranks, each carrying the step's tokens)")
    s.add_argument("--dp", type=positive_int, default=None, metavar="N",
                   help="data-parallel ranks, as `simulate --dp` (on a MoE model: --ep N x tp; on a "
                        "dense model independent replicas, each priced as one)")
    s.add_argument("--pp", type=positive_int, default=1, metavar="N",
                   help="pipeline stages, as `simulate --pp`: the layers split as vLLM splits "
                        "them, each stage priced on its tp GPUs, the activations sent between "
                        "stages; prints each stage, the slowest, the sends and the step's end "
                        "for a lone batch (default 1)")
    s.add_argument("--expert-load", default=None, metavar="LOAD",
                   help="balanced (default) or power-law:ALPHA, as `simulate --expert-load`")
    s.add_argument("--prefill", default="", metavar="T[:C],...",
                   help="prefill chunks: T new tokens after C cached (C defaults to 0)")
    s.add_argument("--decode", default="", metavar="B:C,...",
                   help="decode groups: B sequences at context C each")
    p.set_defaults(func=_cmd_cost)


def _cmd_cost(args: argparse.Namespace) -> int:
    from servelab.simulator import pricing

    try:
        if args.points:
            from servelab.cli import build_parser

            flag_defaults = vars(build_parser().parse_args(["cost", args.kind, "--gpu", args.gpu]))
            rows = pricing.price_points(args.kind, args.points, vars(args),
                                        note=lambda line: print(f"cost: note: {line}",
                                                                file=sys.stderr),
                                        flag_defaults=flag_defaults)
            if args.json:                  # numbers as numbers, as without --points
                print(json.dumps([{k: _number(v) for k, v in row.items()} for row in rows],
                                 indent=2))
                if not args.out:
                    return 0
            _write_rows(rows, args.out)
            return 0
        if args.out:
            raise ValueError("--out needs --points")
        result = pricing.price(args.kind, vars(args))
        note = pricing.carried_over_note(vars(args))
        if note:
            print(f"cost: note: {note}", file=sys.stderr)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(pricing.describe(args.kind, result))
    return 0


def _number(cell):
    """A CSV cell as the int or float it spells, else as it is."""
    if not isinstance(cell, str):
        return cell
    for kind in (int, float):
        try:
            value = kind(cell)
        except ValueError:
            continue
        return value if value == value and abs(value) != float("inf") else cell
    return cell


def _write_rows(rows: list[dict], out: str | None) -> None:
    if not rows:
        return
    handle = open(out, "w", newline="") if out else sys.stdout
    try:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    finally:
        if out:
            handle.close()
