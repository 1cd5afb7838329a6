"""Replay real runs through the simulator and compare what users would see.

    report = compare_runs(runs, "out/calibration.json", "cpu", Path("out/replay"))

For each real run the same requests (requests.csv: arrival, prompt and output tokens,
tenant, priority, SLOs) are written as a canonical trace CSV and simulated with the same
scheduler, policy, KV blocks, block size and cache settings, priced by the calibrated
cost model (`SimulationConfig(calibration=...)`, exactly what `servelab simulate
--calibration` does). Each replay is a normal simulator run directory that
`python -m servelab.simulator.run DIR/config.json` reruns.

Request-level figures compared: TTFT, TPOT and E2E latency at p50/p90/p99 and request and
output throughput. Given several runs of one trace under different policies, each metric
ranks the policies twice — by the real and by the simulated values — and Kendall's tau-b
between the two says whether the simulator would have picked the same winner.

A disaggregated run (`--prefill-replicas 1 --decode-replicas 1`) replays as the
simulator's prefill and decode pools with each engine's KV blocks; on the run's virtual
clock each engine advanced by its own steps, the timeline of two devices, which is what
the pools model. Its KV copies ran within one device's memory (a fraction of a
millisecond), so the replay prices them free (the `ideal` link). A speculative run
replays at the per-token acceptance that gives the acceptance the run measured
(accepted / proposed tokens in speculation.json, under the simulator's independent-token
model, `servelab.speculative`).

What a replay cannot reproduce, and says so in its notes: prefix-cache sharing (the
request rows do not carry prompt hashes), more than one sample per request (the trace
schema has no n), early stops at EOS (the replay generates the recorded lengths), each
request's own acceptance (the replay uses the run's overall one), and, on the wall clock,
two disaggregated engines sharing one device (the replay gives each its own).
"""
from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from servelab.simulator.disaggregation import DisaggregationConfig
    from servelab.simulator.run import SimulationConfig
    from servelab.validation.validate import RealRun
    from servelab.traces.record import Trace

__all__ = ["METRICS", "compare_runs", "kendall_tau_b", "replay_config", "trace_from_requests"]

METRICS: dict[str, bool] = {
    **{f"{stat}_{m}_ms": False for m in ("ttft", "tpot", "e2el")
       for stat in ("median", "p90", "p99")},
    "request_throughput": True, "output_throughput": True,
}
"""Summary keys compared, and whether higher is better (else lower is)."""


def kendall_tau_b(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Kendall's tau-b of two equally long samples (`scipy.stats.kendalltau`, variant b).
    None when undefined: fewer than 2 values, or every pair tied in x or in y (a constant
    sample), where scipy gives NaN."""
    if len(x) != len(y):
        raise ValueError(f"kendall_tau_b needs equally long samples, got {len(x)} and {len(y)}")
    x, y = [float(v) for v in x], [float(v) for v in y]
    if not all(map(math.isfinite, x + y)):
        raise ValueError("kendall_tau_b needs finite values")
    if len(set(x)) < 2 or len(set(y)) < 2:
        return None
    from scipy.stats import kendalltau

    return float(kendalltau(x, y, variant="b").statistic)


def trace_from_requests(run: RealRun) -> Trace:
    """The run's requests as a canonical `Trace` (arrival order, ties by request id)."""
    from servelab.traces.record import Trace, TraceRecord

    rows = sorted(run.requests, key=lambda r: (r.arrival_s, r.request_id))
    records = [TraceRecord(r.arrival_s, r.prompt_tokens, max(1, r.output_tokens),
                           tenant=r.tenant, priority=r.priority, slo_ttft_ms=r.slo_ttft_ms,
                           slo_tpot_ms=r.slo_tpot_ms) for r in rows]
    return Trace(tuple(records), source=f"{run.path}/requests.csv", format="servelab",
                 notes=(f"requests of real run {run.path}",))


def _notes(run: RealRun) -> list[str]:
    notes = []
    if run.config.get("disaggregation"):
        copies = _read_json(run.path / "disaggregation.json")["handoff_ms"]["transfer"]["mean"]
        took = "" if copies is None else f" (the real ones took {copies:.3g} ms on average)"
        notes.append(f"replayed as the simulator's prefill and decode pools, one engine each; "
                     f"KV copies priced free{took}")
        if run.config.get("clock") == "wall":
            notes.append("on the wall clock the real engines shared one device; the replay "
                         "gives each engine a device of its own")
    stats = _speculation(run)
    if stats is not None and not stats.get("proposed_tokens"):
        notes.append("the real run proposed no token (requests too short to speculate), so the "
                     "replay runs without speculation")
    elif stats is not None:
        notes.append(f"replayed at a per-token acceptance of {_acceptance(stats):.3f}, which gives "
                     f"the run's measured acceptance rate {stats['acceptance_rate']:.3f} to "
                     f"every request alike")
        if run.device == "cpu" and run.config["scheduler"]["speculative"]["method"] == "draft":
            notes.append("the replay prices the draft's forwards inside the verify step, as a GPU "
                         "runs them; the real CPU backend pays each one's host overhead, so the "
                         "replay comes out faster")
    if run.derived["cache"].get("enable_prefix_caching"):
        notes.append("prefix caching was on in the real run; the replay has no prompt hashes, "
                     "so it sees no sharing")
    if any(r.n != 1 for r in run.requests):
        notes.append("requests with n > 1 samples replay as n = 1 (the trace schema has no n)")
    if not run.config.get("replay", True):
        notes.append("the real run stopped at EOS; the replay generates the recorded lengths")
    return notes


def replay_config(run: RealRun, profile_path: str, gpu: str, out_dir: Path) -> SimulationConfig:
    """Write the run's trace and model config under out_dir; the `SimulationConfig` that
    replays the run with the profile."""
    from servelab.config import SchedulerConfig, SpeculativeConfig
    from servelab.reports.runio import write_json
    from servelab.simulator.run import SimulationConfig
    from servelab.traces.canonical import write_csv

    out_dir.mkdir(parents=True, exist_ok=True)
    trace_path = out_dir / "trace.csv"
    write_csv(trace_from_requests(run), trace_path)
    model_path = out_dir / f"{_safe(run.model.name)}.json"
    write_json(model_path, run.model.hf_config)
    cache, cfg = run.derived["cache"], run.config
    scheduler = SchedulerConfig(**cfg["scheduler"])
    stats = _speculation(run)
    if stats is not None:
        speculative = replace(scheduler.speculative, acceptance=_acceptance(stats)) \
            if stats.get("proposed_tokens") else SpeculativeConfig()   # nothing proposed: nothing to verify
        scheduler = replace(scheduler, speculative=speculative)
    try:
        return SimulationConfig(
            trace=str(trace_path), trace_format="servelab", seed=cfg.get("seed", 0),
            model=str(model_path), gpu=gpu, tp=1, weight_dtype=run.dtype, kv_dtype=run.dtype,
            calibration=str(profile_path), scheduler=scheduler,
            disaggregation=_pools(run),
            policy=cfg["policy"], policy_options=dict(cfg.get("policy_options") or {}),
            block_size=cache["block_size"], kv_blocks=cache["num_gpu_blocks"],
            cpu_kv_blocks=cache.get("num_cpu_blocks", 0),
            block_manager=cache.get("block_manager", "paged"),
            prefix_caching=bool(cache.get("enable_prefix_caching", False)),
            watermark=cache.get("watermark", 0.01), slo_ttft_ms=cfg.get("slo_ttft_ms"),
            slo_tpot_ms=cfg.get("slo_tpot_ms"))
    except ValueError as exc:
        raise ValueError(f"cannot replay {run.path} in the simulator: {exc}") from None


def _pools(run: RealRun) -> DisaggregationConfig | None:
    """The simulator's pools of a disaggregated real run (one engine each, its KV blocks),
    None for a co-located one."""
    from servelab.simulator.disaggregation import DisaggregationConfig, PoolConfig

    given = run.config.get("disaggregation")
    if not given:
        return None
    blocks = run.derived["disaggregation"]
    return DisaggregationConfig(
        prefill=PoolConfig(kv_blocks=blocks["prefill"]["kv_blocks"]),
        decode=PoolConfig(kv_blocks=blocks["decode"]["kv_blocks"]),
        kv_link="ideal", kv_transfer=given.get("kv_transfer") or DisaggregationConfig().kv_transfer)


def _speculation(run: RealRun) -> dict | None:
    """A speculative run's speculation.json; None for a run without speculation."""
    if not run.config["scheduler"].get("speculative", {}).get("method"):
        return None
    return _read_json(run.path / "speculation.json")


def _acceptance(stats: dict) -> float:
    """The per-token acceptance α whose expected accepted share of K proposals,
    (α + α² + ... + α^K) / K, is the measured accepted / proposed tokens of a run's
    speculation.json (`stats`)."""
    from scipy.optimize import brentq

    from servelab.speculative import expected_tokens_per_step

    k, measured = stats["num_speculative_tokens"], stats["acceptance_rate"]
    if measured is None or measured <= 0.0:
        return 0.0
    if measured >= 1.0:
        return 1.0
    return float(brentq(lambda a: (expected_tokens_per_step(k, a) - 1) / k - measured, 0.0, 1.0))


def _read_json(path: Path) -> dict:
    """A JSON file a disaggregated or speculative run writes; ValueError if it is missing."""
    from servelab.reports.runio import read_json

    if not path.is_file():
        raise ValueError(f"{path} is missing: the run's config says it wrote one")
    return read_json(path)


def compare_runs(runs: Sequence[RealRun], profile_path: str, gpu: str,
                 out_dir: Path) -> dict[str, Any]:
    """Replay every run (out_dir/<label>/ holds each replay's run directory) and compare
    request-level metrics; with two or more runs, the policy rankings and their tau-b."""
    from servelab.simulator.run import run_simulation

    labels = _labels(runs)
    per_run: dict[str, Any] = {}
    real: dict[str, dict] = {}
    sim: dict[str, dict] = {}
    for label, run in zip(labels, runs):
        folder = out_dir / label
        result = run_simulation(replay_config(run, profile_path, gpu, folder), folder / "run")
        real[label], sim[label] = run.summary, result.summary
        per_run[label] = {
            "run": str(run.path), "policy": run.policy, "replay_dir": str(folder / "run"),
            "notes": _notes(run),
            "metrics": {k: {"real": run.summary[k], "sim": result.summary[k],
                            "error_pct": _rel_error_pct(result.summary[k], run.summary[k])}
                        for k in METRICS}}
    report: dict[str, Any] = {"runs": per_run}
    if len(runs) >= 2:
        report["ranking"] = rank_policies(real, sim)
    return report


def rank_policies(real: dict[str, dict], sim: dict[str, dict]) -> dict[str, Any]:
    """Per metric: the labels best first by real and by simulated value, and tau-b between
    the values; plus the mean tau-b over the metrics where it is defined."""
    labels = list(real)
    out: dict[str, Any] = {}
    taus = []
    for metric, higher_better in METRICS.items():
        r = [real[k][metric] for k in labels]
        s = [sim[k][metric] for k in labels]
        tau = kendall_tau_b(r, s)
        if tau is not None:
            taus.append(tau)
        sign = -1 if higher_better else 1
        out[metric] = {"real_order": [labels[i] for i in _order(r, sign)],
                       "sim_order": [labels[i] for i in _order(s, sign)], "kendall_tau_b": tau}
    return {"labels": labels, "metrics": out,
            "mean_kendall_tau_b": sum(taus) / len(taus) if taus else None}


def _order(values: list[float], sign: int) -> list[int]:
    return sorted(range(len(values)), key=lambda i: (sign * values[i], i))


def _rel_error_pct(sim: float | None, real: float | None) -> float | None:
    return None if sim is None or real is None or real == 0 else (sim - real) / real * 100


def _labels(runs: Sequence[RealRun]) -> list[str]:
    """Each run's policy, or policy-<dir name> when policies repeat."""
    policies = [r.policy for r in runs]
    labels = [_safe(p) for p in policies] if len(set(policies)) == len(policies) else \
        [_safe(f"{r.policy}-{r.path.name}") for r in runs]
    if len(set(labels)) < len(labels):
        labels = [f"{label}-{i}" for i, label in enumerate(labels)]
    return labels


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "run"
