"""Capacity answers across parallel layouts (run by scripts/parallelism.sh): docs/parallelism.md
and docs/parallelism/capacity.png.

Two questions, each a few layouts of the same model, searched with `servelab capacity` on
the embedded default workload (vLLM 0.24's defaults, fcfs) for the highest rate whose p99
TTFT and p99 TPOT stay within the targets:

1. DeepSeek-V3 with FP8 weights: 8 x H200 (TP8) against 16 x H100 (TP8 x PP2; 8 x H100 at
   TP8 does not hold the weights, which `simulate` refuses in one line);
2. Llama-3.1-70B on H100: FP8 weights on one GPU, BF16 on two with TP2, BF16 on two with
   PP2 (TP1 x PP2), and BF16 on one (refused).

Every run is a stored capacity point under runs/parallelism/ (rerunning reuses them). A few
minutes on 2 cores at the default 300 requests per run (fewer than the other worked examples:
pipelined runs take every decode step one by one).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from servelab.cli import main as servelab
from servelab.simulator.gpus import get_gpu
from servelab.simulator.pipeline import stage_layer_ranges

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["--p99-ttft-ms", "3000", "--p99-tpot-ms", "150"]
COMMON = ["--trace", "default", "--policies", "fcfs", "--rates", "2", "--tolerance", "0.05", *TARGETS]


@dataclass(frozen=True)
class Layout:
    key: str
    question: str
    label: str
    gpu: str
    tp: int
    pp: int
    flags: tuple[str, ...]

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    @property
    def argv(self) -> list[str]:
        return [*self.flags, "--gpu", self.gpu, "--tp", str(self.tp), "--pp", str(self.pp)]


DEEPSEEK = ("--model", "deepseek-v3", "--weight-dtype", "fp8")
"""DeepSeek-V3's checkpoint FP8 weights, under the default engine as docs/models.md prices it."""
LLAMA = ("--model", "llama-3.1-70b")
LAYOUTS = (
    Layout("ds-h200-tp8", "deepseek", "8 x H200, TP8 (FP8)", "h200", 8, 1, DEEPSEEK),
    Layout("ds-h100-tp8-pp2", "deepseek", "16 x H100, TP8 x PP2 (FP8)", "h100-sxm", 8, 2, DEEPSEEK),
    Layout("llama-fp8-tp1", "llama", "1 x H100, FP8", "h100-sxm", 1, 1, (*LLAMA, "--weight-dtype", "fp8")),
    Layout("llama-bf16-tp2", "llama", "2 x H100, TP2 (BF16)", "h100-sxm", 2, 1, LLAMA),
    Layout("llama-bf16-pp2", "llama", "2 x H100, TP1 x PP2 (BF16)", "h100-sxm", 1, 2, LLAMA),
)
REFUSED = (
    Layout("ds-h100-tp8", "deepseek", "8 x H100, TP8 (FP8)", "h100-sxm", 8, 1, DEEPSEEK),
    Layout("llama-bf16-tp1", "llama", "1 x H100 (BF16)", "h100-sxm", 1, 1, LLAMA),
)


def _capacity(layout: Layout, out: Path, num_requests: int) -> dict:
    """Run (or reuse) the capacity search of one layout; its group, with the summary and
    derived layout of the run at the capacity found (None when no rate held)."""
    where = out / layout.key
    code = servelab(["capacity", *COMMON, *layout.argv, "--num-requests", str(num_requests),
                     "--out", str(where)])
    if code not in (0, 1):
        raise SystemExit(f"capacity of {layout.label} into {where} failed ({code})")
    group, = json.loads((where / "capacity.json").read_text())["groups"]
    probes = []
    for probe in sorted(group["probes"], key=lambda p: p["rate"]):
        summary = json.loads((where / "runs" / probe["run"] / "summary.json").read_text())
        probes.append({**probe, "summary": summary})
    held = group.get("held")
    run = None if held is None else where / "runs" / held["run"]
    stored = None if run is None else json.loads((run / "config.json").read_text())
    return {"group": group, "probes": probes, "config": stored and stored["config"],
            "summary": None if run is None else json.loads((run / "summary.json").read_text()),
            "derived": stored and stored["derived"]}


def _refusal(layout: Layout, out: Path) -> str:
    """The one line `servelab simulate` refuses a layout with."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = servelab(["simulate", "--trace", "default", "--num-requests", "1", *layout.argv,
                         "--out", str(out / layout.key)])
    if code != 2:
        raise SystemExit(f"{layout.label} was expected to be refused, got exit {code}")
    return err.getvalue().strip().removeprefix("servelab simulate: error: ")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "parallelism")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "parallelism.md")
    parser.add_argument("--num-requests", type=int, default=300)
    args = parser.parse_args(argv)
    results = {layout.key: _capacity(layout, args.out, args.num_requests) for layout in LAYOUTS}
    refusals = {layout.key: _refusal(layout, args.out / "refused") for layout in REFUSED}
    rows = {layout.key: _row(layout, results[layout.key], args.num_requests) for layout in LAYOUTS}
    figures = args.doc.parent / "parallelism"
    figures.mkdir(exist_ok=True)
    _figure(results, rows).savefig(figures / "capacity.png", dpi=100, metadata={"Software": None})
    args.doc.write_text(_document(rows, refusals, args.num_requests))
    print(f"wrote {args.doc} and {figures / 'capacity.png'}", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------- the numbers
def _row(layout: Layout, result: dict, num_requests: int) -> dict:
    """What the table and the text say of one layout. A layout whose KV cannot hold more
    than 1% of the workload's requests meets no p99 target, whatever the search found: the
    default workload spans 600 s, so at a very low rate a run holds a few of its requests,
    which may all fit."""
    price = get_gpu(layout.gpu).price_per_hour_usd * layout.gpus
    group, summary, derived = result["group"], result["summary"], result["derived"]
    blocks = None if derived is None else derived["kv_blocks_per_replica"]
    pipeline = None if derived is None else derived.get("pipeline")
    per_engine = None if blocks is None else (pipeline["kv_blocks_per_virtual_engine"] if pipeline else blocks)
    need = _needs(num_requests)
    refused = len(need) if per_engine is None else sum(n > per_engine * 16 for n in need)
    capacity = group.get("capacity") if group["status"] == "found" and refused <= len(need) / 100 else None
    if capacity is None:
        summary = None
    row = {"layout": layout, "price": price, "capacity": capacity, "summary": summary, "refused": refused,
           "config": result["config"],
           "kv_tokens": None if blocks is None else blocks * 16, "pipeline": pipeline,
           "broke": (group.get("broke") or {}).get("misses") or []}
    row["per_dollar"] = None if not capacity else capacity / price * 100
    return row


def _kv(row: dict) -> str:
    if row["kv_tokens"] is None:
        return "n/a"
    text = f"{row['kv_tokens'] / 1000:,.0f}k"
    if row["pipeline"]:
        text += f" ({row['pipeline']['kv_blocks_per_virtual_engine'] * 16 / 1000:,.0f}k per virtual engine)"
    return text


def _weights(row: dict) -> str:
    pipeline = row["pipeline"]
    if pipeline:
        return " / ".join(f"{s['weights_gib']:.1f}" for s in pipeline["stages"])
    return "—"


def _table(rows: list[dict]) -> str:
    lines = ["| Layout | GPUs | $/h | KV tokens per replica | capacity (req/s) | req/s per $100/h | "
             "at capacity: output tok/s, p99 TTFT, p99 TPOT | what broke it above |",
             "|---|---:|---:|---|---:|---:|---|---|"]
    for r in rows:
        s = r["summary"]
        at = "—" if s is None else (f"{s['output_throughput']:,.0f} tok/s, {s['p99_ttft_ms']:,.0f} ms, "
                                    f"{s['p99_tpot_ms']:.0f} ms")
        cap = "none" if r["capacity"] is None else f"{r['capacity']:.3g}"
        per = "—" if r["per_dollar"] is None else f"{r['per_dollar']:.2f}"
        lines.append(f"| {r['layout'].label} | {r['layout'].gpus} | {r['price']:.2f} | {_kv(r)} | {cap} | "
                     f"{per} | {at} | {'; '.join(r['broke']) or '—'} |")
    return "\n".join(lines)


def _figure(results: dict, rows: dict) -> Figure:
    """Each layout's capacity-search probes: p99 TPOT against the rate for DeepSeek-V3 (the
    target that binds there), p99 TTFT for Llama-3.1-70B; dotted, the capacities found."""
    fig = Figure(figsize=(13, 4.8))
    panels = {"deepseek": (fig.add_subplot(1, 2, 1), "p99_tpot_ms", 150, "p99 TPOT (ms)",
                           "DeepSeek-V3, FP8 weights"),
              "llama": (fig.add_subplot(1, 2, 2), "p99_ttft_ms", 3000, "p99 TTFT (ms)",
                        "Llama-3.1-70B on H100")}
    for layout in LAYOUTS:
        ax, metric = panels[layout.question][:2]
        probes = results[layout.key]["probes"]
        line, = ax.plot([p["rate"] for p in probes], [p["summary"][metric] or float("nan") for p in probes],
                        "o-", label=layout.label)
        if rows[layout.key]["capacity"]:
            ax.axvline(rows[layout.key]["capacity"], color=line.get_color(), ls=":", lw=1.2)
    for ax, metric, target, ylabel, title in panels.values():
        ax.axhline(target, color="black", ls="--", lw=1, label="target")
        ax.set_xscale("log")
        if metric == "p99_ttft_ms":
            ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s) of the capacity search's runs; dotted: capacity")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3, which="both")
        ax.legend(frameon=False, fontsize=8)
    return fig


COST_STEP_SECTION = """## Pricing one step: `servelab cost step --pp`

`servelab cost step --pp N` prices one step of a pipelined replica the way the simulator
does (`simulator/pricing.py` builds the run's `PipelineLayout`): each stage's time, the
slowest stage, each send between stages with its link, and the step's end for a lone
batch passing idle stages (`StageTimeline.run_step`: the stages' times plus the sends).
With pp batches in flight the slowest stage paces the replica: one step per its time. The
op table sums each kernel over the stages (every layer once; the embedding and step
overhead from the first stage, the LM head from the last). `--points FILE.csv` takes a
`pp` column like the other flags. Like every `cost` command it prices with the profile
`simulate` runs with by default (its default preset `vllm-0.24`: `h100-sxm.vllm-0.24` here);
`--engine-version 0.14.0` picks the older kernels.

```
$ servelab {cost_step_command}
{cost_step_example}
```

(Stage 0 is the slowest here because it carries the step's 1 ms engine overhead; the
second send crosses nodes, GPUs 8-11 being on the second node.) A layout the simulator
refuses is refused in one line, by the same checks: `--pp` above the model's layers, a
stage whose weights do not fit its GPUs ("raise tp, split the layers over pipeline stages
(pp) or use fp8 weights"), and `--pp`
with data-parallel expert parallelism (`--dp`, or `--ep` above `--tp`). vLLM needs no
divisibility of the layers by pp (its split gives the remainder to the earlier stages), so
none is asked here.
"""
"""The hand-written section on `servelab cost step --pp`; its example is filled in with that
command's output as it runs today (`cost_step_example`)."""
COST_STEP_COMMAND = "cost step --gpu h100-sxm --model llama-3.1-70b --tp 4 --pp 3 --decode 64:2000"


def cost_step_example() -> str:
    """The first lines of `servelab COST_STEP_COMMAND` (the stages and sends; the op table
    left out)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if servelab(COST_STEP_COMMAND.split()) != 0:
            raise SystemExit(f"servelab {COST_STEP_COMMAND} failed")
    lines = out.getvalue().splitlines()
    head = [line for line in lines if not line.startswith(("  op ", "  ", " "))
            or line.lstrip().startswith(("stage", "send", "a lone batch"))]
    head = [line.split("; ops below")[0] + ("; ..." if "; ops below" in line else "") for line in head]
    return "\n".join(head)


def _document(rows: dict, refusals: dict, num_requests: int) -> str:
    ds = [rows[k] for k in ("ds-h200-tp8", "ds-h100-tp8-pp2")]
    llama = [rows[k] for k in ("llama-fp8-tp1", "llama-bf16-tp2", "llama-bf16-pp2")]
    h100 = rows["ds-h100-tp8-pp2"]
    ds_pipe = h100["pipeline"]
    config = rows["llama-bf16-tp2"]["config"]
    sched, engine = config["scheduler"], config.get("engine") or "servelab"
    splits = "; ".join(f"{name}'s {layers} layers at PP{pp}: "
                       + " + ".join(str(b - a) for a, b in stage_layer_ranges(layers, pp))
                       for name, layers, pp in (("DeepSeek-V3", 61, 2), ("Llama-3.1-70B", 80, 3)))
    cheaper = min(ds, key=lambda r: -(r["per_dollar"] or 0))
    tp2, pp2 = rows["llama-bf16-tp2"], rows["llama-bf16-pp2"]
    fp8 = rows["llama-fp8-tp1"]
    pp2_pipe = pp2["pipeline"]
    command = "servelab capacity " + " ".join(COMMON) + f" --num-requests {num_requests} <layout flags>"
    cost_section = COST_STEP_SECTION.format(cost_step_command=COST_STEP_COMMAND,
                                            cost_step_example=cost_step_example())
    return f"""# Parallel layouts: tensor and pipeline parallelism

A replica is `--tp` GPUs per pipeline stage times `--pp` stages (and, for a mixture-of-experts
model with expert parallelism, data-parallel ranks: [moe-mla.md](moe-mla.md)). `compare`,
`capacity` and `plan` take `--pp` as a list like `--replicas` (`--pp 1,2`), and `plan` prices
a replica as tp x pp GPUs. Pipeline parallelism is simulation-only: `servelab run` refuses
`--pp`. `--vllm-args` reads vLLM's `-pp N` / `--pipeline-parallel-size N`.

## How the simulator runs pipeline stages

`simulator/pipeline.py` (its docstring cites vLLM's source for each point):

- **Layers per stage** as vLLM's `get_pp_indices` splits them: num_layers // pp each, the
  remainder one more each for the stages before the last, from the second-to-last backwards
  ({splits}).
  vLLM's `VLLM_PP_LAYER_PARTITION` override is not exposed.
- **Stage prices** are the cost model's: a stage with L_s layers is priced as the model cut to
  those layers (its MoE and dense layers among them), the embedding and the step's engine
  overhead on the first stage, the final norm, LM head, sampler and (under TP) logits gather
  on the last. The stages of a step add up to the unpipelined step exactly.
- **Between stages** the hidden states and the residual travel: tokens x hidden x 2 x 2 bytes
  (BF16), each TP rank sending its 1/tp slice over its own link and the receiving stage
  all-gathering them, as vLLM does. Stage s runs on GPUs s*tp .. (s+1)*tp - 1 and eight GPUs
  share a node: within a node the GPU's NVLink (PCIe where it has none), across nodes
  `ib-400g` (InfiniBand NDR, one 400 Gb/s NIC per GPU as in a DGX H100/H200; servelab's
  disaggregated pools default to it too), as vLLM's guide lays a model out over nodes: TP
  within a node, PP across nodes (docs.vllm.ai serving/distributed_serving).
  DeepSeek-V3 at TP8 x PP2 crosses nodes: {_transfers()}.
- **Memory per stage**: each stage's GPUs hold their layers' weights and KV, plus the
  embedding on the first stage and the final norm and LM head on the last (a tied embedding
  on both); each sizes its KV as an engine does (memory x utilization - weights - activation
  peak, logits only on the last stage), and the replica's capacity is the smallest stage's,
  as vLLM takes the minimum over its workers.
- **Batches in flight**: vLLM V1 keeps pp batches in flight (its batch queue), skipping in the
  scheduler a request whose previous step has not come back. servelab models this as vLLM V0
  did, with **pp virtual engines per replica**: each its own scheduler over 1/pp of the KV
  blocks (V0 divided the blocks the same way), a new request going to the one with the fewest
  unfinished requests, each engine's step passing through the replica's stages in turn. A
  stage runs one batch at a time, in launch order; a lone batch takes the sum of its stage
  times and transfers, and under load the virtual engines keep every stage busy.
- **How this differs from V1**: requests and KV are split statically among the pp batches
  when a request arrives, where V1's one scheduler lets any request join any batch over one
  shared KV pool. A replica's KV is thus fragmented in pp parts (a long request must fit in
  one part, and one part can preempt while another has room), and prefix-cache hits are
  per virtual engine. It is chosen because the shared scheduler assumes that `schedule()` and
  `update()` alternate, which V1's batch queue breaks; V0's split needs no change to it.
- **Not modelled**: the decode fast-forward (a pipelined replica runs every step, so its runs
  are slower to simulate), speculative decoding, disaggregated pools and data-parallel expert
  parallelism with `--pp` above 1 (each refused in one line, as is a `--pp` above the model's
  layers).

{cost_section}
## Capacity answers

Made by `bash scripts/parallelism.sh`: for each layout, `{command}` (the embedded default
workload, {num_requests} requests per run, the {engine} preset's defaults: `max_num_seqs`
{sched['max_num_seqs']} and {sched['max_num_batched_tokens']} batched tokens; capacity is the highest rate whose p99 TTFT is at most 3 s and p99 TPOT at most
150 ms, to 5%). Prices are the GPU catalog's per GPU-hour. Fewer requests per run than the
other worked examples keep the script to a few minutes: a capacity here is good to a few
percent, and p99 over {num_requests} requests is its third-worst request.

![p99 TPOT (DeepSeek-V3) and p99 TTFT (Llama-3.1-70B) against the rate of each capacity search run](parallelism/capacity.png)

### DeepSeek-V3 (FP8 weights): 8 x H200 or 16 x H100 with PP2

Refused: 8 x H100 at TP8: `{refusals['ds-h100-tp8']}`

Both layouts run the default engine (vLLM 0.24) and its H100 kernels, which the H200
borrows; DeepSeek-V3's MoE layers are priced by the FP8 fit of the block-scaled rows
measured inside vLLM 0.24 ([moe-mla.md](moe-mla.md)).

{_table(ds)}

- 16 x H100 need two pipeline stages across two nodes: weights per GPU {_weights(h100)} GiB on
  the two stages (layers {ds_pipe['stages'][0]['layers'][0]}-{ds_pipe['stages'][0]['layers'][1] - 1} and
  {ds_pipe['stages'][1]['layers'][0]}-{ds_pipe['stages'][1]['layers'][1] - 1}), over `{ds_pipe['links'][0]['link']}` x {ds_pipe['links'][0]['lanes']}.
  At capacity the stages were busy {', '.join(f'{f:.0%}' for f in ds_pipe['stage_busy_fraction'])} of the time.
- Per dollar the cheaper answer is **{cheaper['layout'].label}**: {cheaper['per_dollar']:.2f} req/s per
  $100 an hour, against {min(ds, key=lambda r: r['per_dollar'] or 0)['per_dollar']:.2f}.
  Pipelining does not make an H100 step faster: a virtual engine's step crosses both stages,
  and decode is bound by reading the weights, which each stage reads once per batch in flight.

### Llama-3.1-70B on H100: FP8 on one GPU, BF16 on two (TP2 or PP2)

Refused: BF16 on one H100: `{refusals['llama-bf16-tp1']}`

{_table(llama)}

- **FP8 on one GPU** leaves {_kv(fp8)} tokens of KV beside the weights and the activation
  reserve; {_fits(fp8, num_requests)}.
- **TP2 against PP2 on the same two GPUs**: TP2 reaches {tp2['capacity'] or 0:.3g} req/s, PP2
  {pp2['capacity'] or 0:.3g} req/s. Each PP2 stage holds as much as a TP2 GPU, but its KV
  ({_kv(pp2)}) is split between the two virtual engines, each of which reads its stage's
  weights once per step: with decode bound by those reads, two half-size batches cost two
  weight reads where TP2 pays one for the whole batch, and a token waits for both stages. At
  capacity PP2's stages were busy {', '.join(f'{f:.0%}' for f in pp2_pipe['stage_busy_fraction'])} of the time. {_verdict(tp2, pp2)}
"""


def _transfers() -> str:
    """What moving a step's activations between DeepSeek-V3's two H100 stages costs."""
    from servelab.models import load_model_spec
    from servelab.simulator.cost_model import CostModel
    from servelab.simulator.pipeline import PipelineLayout

    model = load_model_spec("deepseek-v3")
    layout = PipelineLayout(model, CostModel(model, "h100-sxm", tp=8, weight_dtype="fp8"), 2)
    return ", ".join(f"{tokens:,} tokens' activations ({tokens * model.hidden_size * 4 / 2**20:.1f} MiB) take "
                     f"{layout.transfer_time(0, tokens) * 1e6:,.0f} µs" for tokens in (64, 8192))


@functools.cache
def _needs(num_requests: int) -> list[int]:
    """KV tokens each request of the workload needs to finish (prompt + output - 1), sorted."""
    from servelab.simulator.run import SimulationConfig, load_workload

    trace = load_workload(SimulationConfig(trace="default", num_requests=num_requests))
    return sorted(r.prompt_tokens + max(r.output_tokens, 1) - 1 for r in trace.records)


def _fits(row: dict, num_requests: int) -> str:
    """Whether a layout's KV holds the workload's longest requests."""
    need, beyond = _needs(num_requests), row["refused"]
    if not beyond:
        return f"every request of the workload fits (the longest needs {need[-1]:,} tokens)"
    text = f"{beyond} of the {len(need)} requests need more (up to {need[-1]:,} tokens) and are refused at any rate"
    if beyond <= len(need) / 100:
        return text + ", within the 1% a p99 target allows"
    return (text + ": more than the 1% a p99 target allows, so no rate meets the targets (the search's "
            "lowest rates hold only on runs of the few requests of the workload's 600 s that fit)")


def _verdict(tp2: dict, pp2: dict) -> str:
    a, b = tp2["capacity"] or 0.0, pp2["capacity"] or 0.0
    if a > b:
        return (f"Within one node TP2 is the better use of two GPUs here ({a / b:.1f}x the capacity)"
                if b else "Within one node TP2 is the better use of two GPUs here") + \
            "; pipeline parallelism is what lets a model span nodes (DeepSeek-V3 on H100)."
    return "PP2 matches or beats TP2 here: the batches in flight outweigh the weight reads."


if __name__ == "__main__":
    sys.exit(main())
