"""The worked example of `servelab plan` in docs/plan.md (run by scripts/plan_example.sh).

Plans Llama-3.1-8B serving the Azure code trace (2023) at 4x its rate with p99 TTFT at
most 2 s, over every priced catalog GPU at TP 1, 2, 4 and 8, then writes docs/plan.md from
the plan's own report (the answer, the ranked layouts, the frontier figure, what was
pruned) with the command that made it.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from servelab.cli import main as servelab

ROOT = Path(__file__).resolve().parents[1]
TRACE_DIR = Path(os.environ.get("SERVELAB_SHARED", ROOT.parent / "shared")) / "traces"
PLAN = ["plan", "--trace", "azure-code-2023", "--rate-scale", "4", "--model", "llama-3.1-8b",
        "--p99-ttft-ms", "2000"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "plan-azure")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "plan.md")
    args, extra = parser.parse_known_args(argv)
    command = [*PLAN, *extra]
    code = servelab([*command, "--trace-dir", str(TRACE_DIR), "--out", str(args.out)])
    if code not in (0, 1):
        return code
    report = (args.out / "report.md").read_text()
    body = report.split("\n## How it was found")[0].split("\n", 2)[2]   # the answer to the last list
    figures = args.doc.parent / "plan"
    figures.mkdir(exist_ok=True)
    shutil.copyfile(args.out / "figures" / "plan_frontier.png", figures / "frontier.png")
    body = body.replace("figures/plan_frontier.png", "plan/frontier.png")
    args.doc.write_text(
        "# Planning a deployment: how many GPUs, of which kind\n\n"
        "`servelab plan` searches every layout (GPU kind x tensor parallelism x policy x router, and any "
        "other `compare` list) for the fewest replicas that meet the SLO targets at one traffic, and ranks "
        "the layouts by cost an hour (prices per GPU-hour from the GPU catalog: RunPod on-demand rates of "
        "March 2026 as listed by deploybase.ai, each file's `price_source`; `--gpu-price` replaces them) or "
        "by GPUs (`--objective gpus`). Per layout the replica count doubles from one until a count meets "
        "the targets, then is bisected until it sits just above a count that missed, so both sides of each "
        "answer are stored runs; a layout whose next count would cost more than a count known to meet "
        "elsewhere is pruned. Targets: `--p50|p90|p99-ttft-ms`, `--p50|p90|p99-tpot-ms`, `--percentile P` "
        "(reads `--slo-ttft-ms` / `--slo-tpot-ms` as that percentile), and `--attainment F` over "
        "per-request SLOs.\n\n"
        "Disaggregated prefill/decode: with `--prefill-replicas P,... --decode-replicas D,...` (and `--prefill-tp`, `--decode-tp`, `--prefill-gpu`, `--decode-gpu`, `--kv-link` as in `simulate`), every P:D pair becomes a layout beside the co-located one of the same GPU and TP, named like `3 x [1P+2D(TP2)] h100-sxm (TP1)`: its searched count is of pool units, n units being n x P prefill and n x D decode replicas, each priced at its own GPUs.\n\n"
        "## Worked example: Llama-3.1-8B on the Azure code trace at 4x its rate, p99 TTFT under 2 s\n\n"
        "Made by `bash scripts/plan_example.sh`, which runs\n\n"
        f"```bash\nservelab {' '.join(command)} --trace-dir ../shared/traces --out runs/plan-azure\n```\n\n"
        + body.strip() + "\n\n"
        "Every layout's runs are in `runs/plan-azure/runs/`, and its full report (with the finalists "
        "compared side by side) in `runs/plan-azure/index.html`.\n")
    print(f"wrote {args.doc} and {figures / 'frontier.png'}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
