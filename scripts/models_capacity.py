"""Serving capacity of mixture-of-experts, MLA and FP8 layouts (run by scripts/models_capacity.sh):
the "Serving capacity (simulated)" section of docs/models.md.

Each layout is one `servelab compare` over a grid of rates on the embedded default workload
(its first 2,000 requests, fcfs, the default engine unless the layout names one): every
point an ordinary `servelab simulate` run, stored under runs/models-capacity/<layout>/runs/
(rerunning reuses them). A layout's answer is the highest rate of its grid below the first
that misses p99 TTFT <= 2 s, p99 TPOT <= 100 ms or rejects a request; its peak is the most
requests per second any point of the grid finished at. `servelab capacity` with
`--p99-ttft-ms 2000 --p99-tpot-ms 100` asks almost the same question, but counts rejected
requests as slow ones (up to 1% may be rejected under a p99 target) and bisects to a
tolerance instead of reporting a fixed grid; the grid keeps this section's question:
nothing rejected.

The grids are the section's as first measured by hand; the script says in the document when
an answer sits at either end of its grid (the grid then bounds it on one side only).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from servelab.cli import main as servelab
from servelab.models import load_model_spec
from servelab.simulator.footprint import weight_bytes_per_gpu

ROOT = Path(__file__).resolve().parents[1]
P99_TTFT_MS = 2000.0
P99_TPOT_MS = 100.0
COMMON = ("--trace", "default", "--policies", "fcfs")
SECTION = "## Serving capacity (simulated)\n"
NEXT_SECTION = "## What is and is not modelled\n"
GIB = 2 ** 30
RUN_TIME = "under three minutes on 2 cores from an empty runs/models-capacity/"
"""Measured with `time bash scripts/models_capacity.sh` (2,000 requests, 2 workers)."""


@dataclass(frozen=True)
class Layout:
    key: str
    label: str
    model: str
    gpu: str
    gpus: int
    flags: tuple[str, ...]
    rates: tuple[float, ...]

    @property
    def argv(self) -> list[str]:
        return ["--model", self.model, "--gpu", self.gpu, *self.flags]

    def command(self, num_requests: int, out: str) -> str:
        rates = ",".join(f"{r:g}" for r in self.rates)
        return (f"servelab compare {' '.join(COMMON)} --num-requests {num_requests} --rates {rates} "
                f"{' '.join(self.argv)} --out {out}")


def _by(start: float, stop: float, step: float) -> tuple[float, ...]:
    n = round((stop - start) / step)
    return tuple(start + i * step for i in range(n + 1))


QWEN, LLAMA, DEEPSEEK = "qwen3-30b-a3b", "llama-3.1-70b", "deepseek-v3"
QWEN_2GPU = (24, 32, 40, *_by(48, 64, 4), 72)
LLAMA_1GPU = (0.25, 0.5, 1, 2)
DS_RATES = (2, 4, 6, 8, 10, 12, 14, 16, 20, 24)
DS_FP8 = ("--weight-dtype", "fp8")
LAYOUTS = (
    Layout("qwen-tp1", "qwen3-30b-a3b on h100-sxm, TP1 (none)", QWEN, "h100-sxm", 1, (), _by(4, 24, 4)),
    Layout("qwen-2x-tp1", "qwen3-30b-a3b, 2 TP1 replicas (`--replicas 2 --router least-outstanding`)",
           QWEN, "h100-sxm", 2, ("--replicas", "2", "--router", "least-outstanding"), _by(16, 40, 4)),
    Layout("qwen-tp2", "qwen3-30b-a3b, TP2 (`--tp 2`)", QWEN, "h100-sxm", 2, ("--tp", "2"), QWEN_2GPU),
    Layout("qwen-ep2", "qwen3-30b-a3b, EP2 with DP2 attention (`--ep 2`)", QWEN, "h100-sxm", 2,
           ("--ep", "2"), QWEN_2GPU),
    Layout("llama-fp8", "llama-3.1-70b on h100-sxm, FP8 (`--weight-dtype fp8`)", LLAMA, "h100-sxm", 1,
           ("--weight-dtype", "fp8"), LLAMA_1GPU),
    Layout("llama-fp8-kv", "llama-3.1-70b, FP8 weights and KV (`--weight-dtype fp8 --kv-dtype fp8`)",
           LLAMA, "h100-sxm", 1, ("--weight-dtype", "fp8", "--kv-dtype", "fp8"), LLAMA_1GPU),
    Layout("llama-bf16-tp2", "llama-3.1-70b, BF16 TP2 (`--tp 2`)", LLAMA, "h100-sxm", 2, ("--tp", "2"),
           (0.5, 1, 1.5, 2, 3, 4)),
    Layout("llama-fp8-tp2", "llama-3.1-70b, FP8 TP2 (`--tp 2 --weight-dtype fp8`)", LLAMA, "h100-sxm", 2,
           ("--tp", "2", "--weight-dtype", "fp8"), _by(1, 6, 1)),
    Layout("ds-tp8", "deepseek-v3 on h200, FP8 TP8 (`--weight-dtype fp8 --tp 8`)",
           DEEPSEEK, "h200", 8, (*DS_FP8, "--tp", "8"), DS_RATES),
    Layout("ds-ep8", "deepseek-v3, FP8 EP8 with DP8 attention (`--weight-dtype fp8 --ep 8`)",
           DEEPSEEK, "h200", 8, (*DS_FP8, "--ep", "8"), DS_RATES),
    Layout("ds-tp8-fp8kv", "deepseek-v3, FP8 weights and KV TP8 (`... --kv-dtype fp8 --tp 8`)",
           DEEPSEEK, "h200", 8, (*DS_FP8, "--kv-dtype", "fp8", "--tp", "8"), DS_RATES),
)


def _grid(layout: Layout, out: Path, num_requests: int, workers: int) -> list[dict]:
    """Run (or reuse) one layout's grid; its points by rate, each with the run's summary,
    stored config and the targets it missed."""
    where = out / layout.key
    code = servelab(["compare", *COMMON, "--num-requests", str(num_requests),
                     "--rates", ",".join(f"{r:g}" for r in layout.rates), *layout.argv,
                     "--workers", str(workers), "--out", str(where)])
    if code != 0:
        raise SystemExit(f"the grid of {layout.label} into {where} failed (exit {code})")
    points = []
    for point in json.loads((where / "sweep.json").read_text())["points"]:
        run = where / "runs" / point["name"]
        summary = json.loads((run / "summary.json").read_text())
        stored = json.loads((run / "config.json").read_text())
        points.append({"rate": float(point["labels"]["rate"]), "summary": summary,
                       "config": stored["config"], "derived": stored["derived"],
                       "misses": _misses(summary)})
    return sorted(points, key=lambda p: p["rate"])


def _misses(summary: dict) -> list[str]:
    """The targets a run missed, with the value it reached ([] when it held)."""
    out = []
    if summary["rejected"]:
        out.append(f"{summary['rejected']} rejected")
    for metric, name, limit in (("p99_ttft_ms", "p99 TTFT", P99_TTFT_MS), ("p99_tpot_ms", "p99 TPOT", P99_TPOT_MS)):
        value = summary.get(metric)
        if value is None or value > limit:
            out.append(f"{name} " + ("n/a" if value is None else f"{value:,.0f} ms"))
    return out


# --------------------------------------------------------------------------- the numbers
def _row(layout: Layout, points: list[dict]) -> dict:
    """What the table and the prose say of one layout."""
    broke = next((p for p in points if p["misses"]), None)
    held = [p for p in points if not p["misses"] and (broke is None or p["rate"] < broke["rate"])]
    answer = held[-1] if held else None
    config = points[0]["config"]
    spec = load_model_spec(config["model"])
    weights = weight_bytes_per_gpu(spec, config["tp"], config["weight_dtype"], ep=config.get("ep", 1))
    return {"layout": layout, "points": points, "answer": answer, "broke": broke, "config": config,
            "rate": answer and answer["rate"],
            "per_gpu": answer and answer["rate"] / layout.gpus,
            "peak": max(points, key=lambda p: p["summary"]["request_throughput"]),
            "held_above": [p["rate"] for p in points if not p["misses"] and broke and p["rate"] > broke["rate"]],
            "weights_gib": weights / GIB,
            "kv_tokens": points[0]["derived"]["kv_blocks_per_replica"] * config["block_size"],
            "ranks": config["replicas"] if config.get("ep", 1) > config["tp"] else 1}


def _rates(layout: Layout) -> str:
    return ", ".join(f"{r:g}" for r in layout.rates)


def _answer(row: dict) -> str:
    if row["rate"] is None:
        return f"none (< {row['layout'].rates[0]:g})"
    text = f"{row['rate']:g}"
    return text + " (grid's top)" if row["broke"] is None else text


def _first_miss(row: dict) -> str:
    broke = row["broke"]
    return "—" if broke is None else f"{broke['rate']:g}: {', '.join(broke['misses'])}"


def _table(rows: list[dict]) -> str:
    lines = ["| layout (flags after `--model M --gpu G`) | GPUs | rates tried (req/s) | meets the SLO up to | "
             "per GPU | peak | first miss (req/s: what) |",
             "|---|---:|---|---:|---:|---:|---|"]
    for r in rows:
        per = "–" if r["per_gpu"] is None else f"{r['per_gpu']:.3g}"
        lines.append(f"| {r['layout'].label} | {r['layout'].gpus} | {_rates(r['layout'])} | {_answer(r)} | "
                     f"{per} | {r['peak']['summary']['request_throughput']:.3g} | {_first_miss(r)} |")
    return "\n".join(lines)


def _at(row: dict, rate: float) -> dict:
    return next(p for p in row["points"] if p["rate"] == rate)["summary"]


def _ms(value: float) -> str:
    return f"{value / 1000:.1f} s" if value >= 1000 else f"{value:,.0f} ms"


def _notes(rows: list[dict]) -> str:
    """Grid-edge and non-monotone answers, said plainly (empty when there are none)."""
    notes = []
    for r in rows:
        if r["held_above"]:
            notes.append(f"{r['layout'].label.split(' (')[0]} also held at "
                         f"{', '.join(f'{x:g}' for x in r['held_above'])} req/s above the first rate that "
                         "missed; the answer is the rate below that first miss")
        if r["broke"] is None:
            notes.append(f"{r['layout'].label.split(' (')[0]} held at every rate of its grid")
    return "".join(f"\n- {n}." for n in notes)


def _qwen(rows: dict) -> str:
    tp1, two, tp2, ep2 = (rows[k] for k in ("qwen-tp1", "qwen-2x-tp1", "qwen-tp2", "qwen-ep2"))
    best2 = max((tp2, ep2), key=lambda r: r["rate"] or 0)
    other = ep2 if best2 is tp2 else tp2
    if (tp2["rate"] or 0) == (ep2["rate"] or 0):
        versus = (f"TP2 and EP2 meet the SLO up to the same rate ({ep2['rate']:g} req/s); at "
                  f"{_first_miss(tp2).replace(': ', ' req/s TP2 misses by ')}, EP2 by "
                  f"{_first_miss(ep2).split(': ', 1)[1]}, and TP2 peaks a little higher "
                  f"({tp2['peak']['summary']['request_throughput']:.3g} against "
                  f"{ep2['peak']['summary']['request_throughput']:.3g} req/s)" if tp2["broke"] and ep2["broke"] else "")
    else:
        name = "EP2" if best2 is ep2 else "TP2"
        versus = (f"{name} meets it up to {best2['rate']:g} req/s and {'TP2' if best2 is ep2 else 'EP2'} up to "
                  f"{other['rate'] or 0:g}, which misses {_first_miss(other).split(': ', 1)[1]} at "
                  f"{other['broke']['rate']:g} req/s")
    lock = ep2["answer"]["derived"].get("data_parallel", {}) if ep2["answer"] else {}
    dummies = lock.get("dummy_steps_per_rank")
    return f"""- **Qwen3-30B-A3B, TP1 against EP2 on H100.** One GPU holds {tp1['weights_gib']:.1f} GiB of
  weights and leaves {tp1['kv_tokens']:,} KV tokens (beside the activation reserve of the
  engine's {tp1['config']['scheduler']['max_num_batched_tokens']:,}-token step budget); a decode batch of a few dozen reads nearly every expert (128 experts, 8 per
  token), so its steps cost like a dense 30B model's: it meets the SLO up to
  {tp1['rate'] or 0:g} req/s and misses {_first_miss(tp1).split(': ', 1)[1]} at {tp1['broke']['rate']:g}. As EP2, each of two
  GPUs holds half the experts ({ep2['weights_gib']:.1f} GiB), keeps {ep2['kv_tokens']:,} KV tokens for its own
  rank's requests and reads half the experts per step; the two ranks step in lock-step, as
  vLLM runs them: every MoE layer runs over both ranks' tokens, a rank with nothing to run
  runs a one-token dummy step{f" ({' and '.join(f'{d:,}' for d in dummies)} on its two ranks in the {ep2['rate']:g} req/s run)" if dummies else ""}, and a
  step ends for both when the slower rank's does, so a rank's decode step waits for the
  other's prefill ([moe-mla.md](moe-mla.md), "Data-parallel ranks in lock-step"). EP2 meets
  the SLO up to {ep2['rate'] or 0:g} req/s, {ep2['per_gpu'] or 0:.3g} per GPU against {tp1['per_gpu'] or 0:.3g} for one TP1 GPU
  and {two['per_gpu'] or 0:.3g} for two independent TP1 replicas (up to {two['rate'] or 0:g} req/s together).
  TP2 halves the expert bytes per GPU too, with no dummy steps and no wait for a peer;
  {versus}."""


def _llama(rows: dict) -> str:
    fp8, fp8kv, tp2, fp8tp2 = (rows[k] for k in ("llama-fp8", "llama-fp8-kv", "llama-bf16-tp2", "llama-fp8-tp2"))
    low = fp8["layout"].rates[0]
    s, skv = _at(fp8, low), _at(fp8kv, low)
    best = max((fp8, fp8kv, tp2, fp8tp2), key=lambda r: r["per_gpu"] or 0)
    most = (f", the most per GPU of the four ({best['per_gpu']:.3g} req/s per GPU)" if best is fp8tp2
            else f"; the most per GPU is {best['layout'].label.split(' (')[0]}'s")

    def meets(r: dict) -> str:
        return (f"meet the SLO up to {r['rate']:g} req/s" if r["rate"] is not None
                else f"meet it at no rate of the grid (at {r['points'][0]['rate']:g} req/s: {', '.join(r['points'][0]['misses'])})")

    def single(r: dict, summary: dict, first: bool) -> str:
        if r["rate"] is not None:
            return f"meets the SLO up to {r['rate']:g} req/s"
        held = summary["completed"] + summary["rejected"]
        rejected = (f"{summary['rejected']} of them are rejected and" if summary["rejected"]
                    else "nothing is rejected, but")
        run = f" (a run of {held:,} requests: the default trace spans {_trace_span_s(rows):g} s)" if first else ""
        return f"at {low:g} req/s{run} {rejected} p99 TTFT is {_ms(summary['p99_ttft_ms'])}"
    return f"""- **Llama-3.1-70B FP8 on one H100 against BF16 on two.** FP8 fits the weights on one GPU
  ({fp8['weights_gib']:.1f} GiB) but leaves {fp8['kv_tokens']:,} KV tokens: a few requests at a time, the
  longest of which cannot fit; {single(fp8, s, True)}. An FP8 KV cache doubles the
  tokens ({fp8kv['kv_tokens']:,}): {single(fp8kv, skv, False)}. Two GPUs in BF16 leave {tp2['kv_tokens']:,}
  tokens and {meets(tp2)}; FP8 weights on two GPUs (TP2, {fp8tp2['kv_tokens']:,} tokens)
  {meets(fp8tp2)}{most}."""


def _deepseek(rows: dict) -> str:
    tp8, ep8, kv8 = (rows[k] for k in ("ds-tp8", "ds-ep8", "ds-tp8-fp8kv"))
    common = max(r for r in tp8["layout"].rates if r <= min(tp8["rate"] or 0, ep8["rate"] or 0)) \
        if tp8["rate"] and ep8["rate"] else tp8["layout"].rates[0]
    a, b = _at(tp8, common), _at(ep8, common)
    lower = "TP8" if a["p99_ttft_ms"] < b["p99_ttft_ms"] else "EP8"
    total_ep = ep8["kv_tokens"] * ep8["ranks"]
    peak = lambda r: r["peak"]["summary"]["request_throughput"]  # noqa: E731
    if tp8["rate"] == ep8["rate"]:
        both = f"Both meet the SLO up to {tp8['rate']:g} req/s"
    else:
        hi, lo = (tp8, ep8) if (tp8["rate"] or 0) > (ep8["rate"] or 0) else (ep8, tp8)
        both = (f"{'TP8' if hi is tp8 else 'EP8'} meets the SLO up to {hi['rate']:g} req/s, "
                f"{'EP8' if hi is tp8 else 'TP8'} up to {lo['rate'] or 0:g} (it misses "
                f"{_first_miss(lo).split(': ', 1)[1]} at {lo['broke']['rate']:g})")
    kv_note = "changes nothing in the answer: KV is not what binds at these rates"
    if kv8["rate"] != tp8["rate"]:
        kv_note = f"moves the answer to {kv8['rate'] or 0:g} req/s"
        bf16 = next((p for p in tp8["points"] if p["rate"] == kv8["rate"]), None)
        if kv8["answer"] is not None and bf16 is not None:   # which SLO sits at the edge there
            kv_note += (f", where its p99 TPOT is {kv8['answer']['summary']['p99_tpot_ms']:.1f} ms "
                        f"against the BF16 cache's {bf16['summary']['p99_tpot_ms']:.1f} ms")
    return f"""- **DeepSeek-V3 on 8 × H200 in FP8, TP8 against EP8.** {both}; they peak at
  {peak(tp8):.3g} and {peak(ep8):.3g} req/s. At {common:g} req/s {lower} has the lower p99 TTFT ({_ms(a['p99_ttft_ms'])} for TP8,
  {_ms(b['p99_ttft_ms'])} for EP8) and p99 TPOT is {a['p99_tpot_ms']:.0f} against {b['p99_tpot_ms']:.0f} ms. EP8 holds
  {total_ep / tp8['kv_tokens']:.1f}× the KV ({total_ep / 1e6:.2f} M tokens over its 8 ranks against {tp8['kv_tokens'] / 1e6:.2f} M:
  MLA's latent is not split by TP, so TP8 stores it 8 times); its eight ranks step in lock-step, so a rank's decode step lasts as long as the slowest
  rank's, a prefill chunk on any of the eight included, and every MoE layer runs over all
  eight ranks' tokens with an all-gather before and a reduce-scatter after. An FP8 KV
  cache ({kv8['kv_tokens'] / 1e6:.2f} M tokens) {kv_note}. DeepSeek-V3's checkpoint is
  block-scaled FP8 (its config.json's `quantization_config.weight_block_size`: 128 × 128),
  and its MoE layers are priced by the FP8 fit of the block-scaled rows measured inside
  vLLM 0.24 on H100, which the H200 borrows ([moe-mla.md](moe-mla.md)).
  For 16 × H100 with two pipeline stages against these 8 × H200 see
  [parallelism.md](parallelism.md)."""


def _wrap(bullet: str) -> str:
    """A bullet of prose refilled to the document's line width (its numbers vary in length)."""
    return textwrap.fill(" ".join(bullet.split()), width=92, subsequent_indent="  ",
                         break_long_words=False, break_on_hyphens=False)


def _trace_span_s(rows: dict) -> float:
    """How long the default workload lasts, as the runs record it (`derived.trace.notes`:
    "generated default ... duration=600s")."""
    notes = next(iter(rows.values()))["points"][0]["derived"]["trace"]["notes"]
    found = [re.search(r"duration=([0-9.]+)s", note) for note in notes]
    spans = [float(m.group(1)) for m in found if m]
    if len(spans) != 1:
        raise SystemExit(f"the runs' trace notes do not name one duration: {notes!r}")
    return spans[0]


def _section(rows: dict, num_requests: int, out: str) -> str:
    span = _trace_span_s(rows)
    example = rows["qwen-ep2"]["layout"]
    intro = f"""Made by `bash scripts/models_capacity.sh` ({RUN_TIME}).
The `default` trace (synthetic, fitted to Azure's 2023 conversation trace: prompts 1,164
tokens on average, outputs 209, over {span:g} s), its first {num_requests:,} requests at each rate
of a grid (a run at a rate below {num_requests / span:.3g} req/s holds the fewer that arrive in the {span:g} s),
fcfs, under the default engine (`vllm-0.24`) unless named. An answer is the highest rate of the grid, below the first that
misses, at which p99 TTFT <= {P99_TTFT_MS / 1000:g} s, p99 TPOT <= {P99_TPOT_MS:g} ms and nothing is rejected; "peak" is
the most requests per second any rate of the grid finished at. Each layout's grid is one
`servelab compare`, e.g."""
    return f"""{SECTION}
{textwrap.fill(" ".join(intro.split()), width=92)}

```
{example.command(num_requests, f'{out}/{example.key}')}
```

(`servelab capacity --p99-ttft-ms {P99_TTFT_MS:g} --p99-tpot-ms {P99_TPOT_MS:g}` would bisect instead of
using a grid, and lets up to 1% of the requests be rejected under a p99 target.)

{_table([rows[layout.key] for layout in LAYOUTS])}
{_notes(list(rows.values()))}
What the answers say, and why:

{_wrap(_qwen(rows))}
{_wrap(_llama(rows))}
{_wrap(_deepseek(rows))}

"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "models-capacity")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "models.md")
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    text = args.doc.read_text(encoding="utf-8")
    if text.count(SECTION) != 1 or text.count(NEXT_SECTION) != 1 or text.index(SECTION) > text.index(NEXT_SECTION):
        raise SystemExit(f"{args.doc} has no single {SECTION.strip()!r} section before {NEXT_SECTION.strip()!r}")
    rows = {layout.key: _row(layout, _grid(layout, args.out, args.num_requests, args.workers))
            for layout in LAYOUTS}
    try:
        shown = args.out.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        shown = str(args.out)
    head, rest = text.split(SECTION)
    args.doc.write_text(head + _section(rows, args.num_requests, shown)
                        + NEXT_SECTION + rest.split(NEXT_SECTION, 1)[1], encoding="utf-8")
    print(f"wrote the {SECTION.strip()!r} section of {args.doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
