"""When speculative decoding pays (run by scripts/speculation.sh): docs/speculative.md and
docs/speculative/speedup.png.

Llama-3.1-70B on 4 x H100 (TP4, vLLM 0.24's defaults) serving the embedded default
workload, with Llama-3.1-8B as the draft (same vocabulary), K = 4:

1. TPOT speedup (mean TPOT without / with) against the request rate, at acceptance 0.6,
   0.8 and 0.9: large at low load, shrinking as the batch grows, below 1 past a rate;
2. at low load (1 req/s), the speedup against the acceptance rate, and the break-even
   acceptance where it crosses 1 (the seeds put it near 50%);
3. `servelab capacity` with and without speculation (acceptance 0.8): the rate each
   sustains within the workload's SLOs.

Every run is a stored sweep point under runs/speculation/ (rerunning reuses them).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from servelab.cli import main as servelab
from servelab.speculative import expected_tokens_per_step

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--trace", "default", "--model", "llama-3.1-70b", "--tp", "4", "--gpu", "h100-sxm",
        "--policies", "fcfs"]
DRAFT = "draft:llama-3.1-8b"
K = 4
RATES = (1, 2, 4, 6, 7, 8, 9, 10)
"""Up to about the capacity (9.4 req/s without speculation): past it the queue never empties
and TPOT depends on how long the run is, not on the engine."""
ACCEPTANCES = (0.6, 0.8, 0.9)
LOW_RATE = 1.0
SWEEP_ACCEPTANCE = tuple(round(0.1 * i, 1) for i in range(11))


def _summaries(out: Path) -> dict[tuple, dict]:
    """(speculative, rate) -> summary of every point of the comparison in `out`."""
    sweep = json.loads((out / "sweep.json").read_text())
    found = {}
    for p in sweep["points"]:
        labels = p["labels"]
        found[(labels.get("speculative"), labels.get("rate"))] = \
            json.loads((out / "runs" / p["name"] / "summary.json").read_text())
    return found


def _compare(out: Path, num_requests: int, *flags: str) -> dict[tuple, dict]:
    code = servelab(["compare", *BASE, "--num-requests", str(num_requests), *flags, "--out", str(out)])
    if code != 0:
        raise SystemExit(f"compare into {out} failed ({code})")
    return _summaries(out)


def _tpot(summary: dict) -> float:
    return summary["mean_tpot_ms"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "speculation")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "speculative.md")
    parser.add_argument("--num-requests", type=int, default=800)
    args = parser.parse_args(argv)
    rates = ",".join(map(str, RATES))

    speedups = {}
    for alpha in ACCEPTANCES:
        found = _compare(args.out / f"rates-a{alpha}", args.num_requests, "--rates", rates,
                         "--speculative", f"off,{DRAFT}", "--num-speculative-tokens", str(K),
                         "--acceptance-rate", str(alpha))
        speedups[alpha] = [_tpot(found[("off", r)]) / _tpot(found[(DRAFT, r)]) for r in RATES]

    at_low = []
    plain_low = None
    for alpha in SWEEP_ACCEPTANCE:
        found = _compare(args.out / f"low-a{alpha}", args.num_requests // 2, "--rates", str(LOW_RATE),
                         "--speculative", f"off,{DRAFT}", "--num-speculative-tokens", str(K),
                         "--acceptance-rate", str(alpha))
        plain_low = _tpot(found[("off", LOW_RATE)])
        at_low.append(plain_low / _tpot(found[(DRAFT, LOW_RATE)]))
    break_even = _crossing(SWEEP_ACCEPTANCE, at_low)

    cap_out = args.out / "capacity"
    code = servelab(["capacity", *BASE, "--num-requests", str(args.num_requests), "--rates", "6",
                     "--speculative", f"off,{DRAFT}", "--num-speculative-tokens", str(K),
                     "--acceptance-rate", "0.8", "--tolerance", "0.03", "--out", str(cap_out)])
    if code != 0:
        raise SystemExit(f"capacity into {cap_out} failed ({code})")
    capacity = {g["labels"]["speculative"]: g["capacity"]
                for g in json.loads((cap_out / "capacity.json").read_text())["groups"]}

    figures = args.doc.parent / "speculative"
    figures.mkdir(exist_ok=True)
    _figure(speedups, at_low, break_even).savefig(figures / "speedup.png", dpi=100, metadata={"Software": None})
    args.doc.write_text(_document(speedups, at_low, break_even, capacity, plain_low, args.num_requests))
    print(f"wrote {args.doc} and {figures / 'speedup.png'}", file=sys.stderr)
    return 0


def _crossing(xs, ys) -> float | None:
    """The x where ys first rises through 1 (linear between samples), or None."""
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if y0 < 1 <= y1:
            return x0 + (1 - y0) * (x1 - x0) / (y1 - y0)
    return None


def _figure(speedups, at_low, break_even) -> Figure:
    fig = Figure(figsize=(13, 5))
    left, right = fig.subplots(1, 2)
    for alpha, ys in speedups.items():
        left.plot(RATES, ys, "o-", label=f"acceptance {alpha}")
    left.axhline(1.0, color="black", ls="--", lw=1)
    left.set_xlabel("request rate (req/s)")
    left.set_ylabel("mean TPOT without / with speculation")
    left.set_title("Speedup against load (K = 4, Llama-3.1-8B draft)")
    left.legend(frameon=False)
    right.plot(SWEEP_ACCEPTANCE, at_low, "o-", color="tab:purple", label="simulated")
    model = [expected_tokens_per_step(K, a) for a in SWEEP_ACCEPTANCE]
    right.plot(SWEEP_ACCEPTANCE, np.array(model) * at_low[0] / model[0], ":", color="grey",
               label="tokens per step, scaled to the simulated speedup at acceptance 0")
    right.axhline(1.0, color="black", ls="--", lw=1)
    if break_even is not None:
        right.axvline(break_even, color="tab:red", ls=":", lw=1.5)
        right.annotate(f"break-even {break_even:.2f}", (break_even, 1.0), textcoords="offset points",
                       xytext=(6, 8), color="tab:red")
    right.set_xlabel("per-token acceptance rate")
    right.set_ylabel("mean TPOT speedup at 1 req/s")
    right.set_title("Speedup against acceptance, at low load")
    right.legend(frameon=False, loc="upper left")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    return fig


def _document(speedups, at_low, break_even, capacity, plain_low, num_requests) -> str:
    rows = "\n".join(f"| {r:g} | " + " | ".join(f"{speedups[a][i]:.2f}x" for a in ACCEPTANCES) + " |"
                     for i, r in enumerate(RATES))
    above = {a: next((r for r, s in zip(RATES, ys) if s < 1), None) for a, ys in speedups.items()}
    cap_off, cap_on = capacity.get("off"), capacity.get(DRAFT)
    crossing = ", ".join(f"{a}: {'never below 1 up to ' + str(RATES[-1]) if r is None else f'{r:g} req/s'}"
                         for a, r in above.items())
    return f"""# Speculative decoding: when it pays and when it hurts

`--speculative draft:MODEL|ngram|eagle|mtp` with `--num-speculative-tokens K`: each decode
step of a speculating sequence proposes K tokens and verifies them in one target forward of
K + 1 tokens; `--acceptance-rate A` (or `A,TENANT=A,...`) is the per-token probability that
a proposed token is accepted (the simulator draws from it, deterministically per request;
the real backend measures it), `--speculative-max-batch N` turns speculation off in steps
with more than N running requests. The scheduler reserves K lookahead KV slots and K + 1
tokens of the step's budget per speculating sequence; the verify pass is priced like a
prefill chunk of K + 1 tokens over the sequence's context, the proposer as K forwards of
the draft model (an EAGLE / MTP head: one decoder layer of the target's shape; an n-gram
lookup: free), and the draft's weights and KV come out of the same GPU memory. A run's
`config.json` records the acceptance (`derived.speculation`: decode steps, proposed and
accepted tokens, per request). Its `acceptance_rate` is accepted over proposed tokens, as
vLLM's draft acceptance rate counts it (and the real backend's speculation.json), not the
per-token probability `--acceptance-rate` sets: a token is proposed only while the ones
before it were accepted, so with probability A and K tokens it comes to
A(1 − A^K) / (K(1 − A)) in expectation (0.59 for A = 0.8, K = 4). In `compare` and `capacity`, `--speculative off,draft:M`
and `--num-speculative-tokens 2,4` are sweep axes (K changes nothing without a proposer:
sweep it over proposers only, `off` in a comparison of its own). The real backend runs the same
scheduling with a draft model (or n-gram proposals) and rejection sampling, and measures
acceptance per request: [speculative-real.md](speculative-real.md).

## Llama-3.1-70B on 4 x H100 with a Llama-3.1-8B draft, K = 4

Made by `bash scripts/speculation.sh` (the embedded default workload, {num_requests} requests
per run, vLLM 0.24's defaults, fcfs):

![TPOT speedup against load and against acceptance](speculative/speedup.png)

Mean TPOT without speculation over mean TPOT with it:

| Rate (req/s) | {' | '.join(f'acceptance {a}' for a in ACCEPTANCES)} |
|---:|{'---:|' * len(ACCEPTANCES)}
{rows}

- **At low load it pays**: {speedups[0.8][0]:.2f}x at 1 req/s with acceptance 0.8 (mean TPOT
  {plain_low:.1f} ms without). The seeds expect 2-3x from a good draft; K = 4 at 0.8 gives
  {expected_tokens_per_step(K, 0.8):.2f} tokens per target step, less the draft's four forwards.
- **It shrinks with load** and turns into a loss: the first rate where it is below 1 is
  ({crossing}). There the batch is already compute-bound, and every speculating sequence's
  K + 1 verify tokens and the draft's forwards crowd out other requests' work. (The
  rates stop near the capacity: past it the queue never empties, and TPOT measures the
  run's length more than the engine.)
- **Capacity** within the workload's SLOs (90% attainment): {cap_off if cap_off is not None else 'n/a'} req/s
  without speculation, {cap_on if cap_on is not None else 'n/a'} req/s with it: speculation lowers the
  rate the deployment sustains, which is why engines cap it by batch size
  (`--speculative-max-batch`).
- **Break-even acceptance** at 1 req/s: {('%.2f' % break_even) if break_even is not None else 'not crossed'}
  (the seeds: near 50%). Below it the draft's forwards and the K + 1-token verify cost more
  than the accepted tokens save.
"""


if __name__ == "__main__":
    sys.exit(main())
