"""Whole real vLLM runs replayed through the simulator (`servelab validate --real-requests`).

    runs = [load_recorded_run(p) for p in paths]          # ValueError: one line per bad folder
    replay = replay_run(runs[0])                          # NotReplayable: one line
    replay.errors["e2el"]["mape_pct"]

A run folder holds `vllm_requests.jsonl` (one request a line: `input_toks`,
`output_toks`, the client's `arrival_time` and the engine's monotonic `queued_ts`,
`scheduled_ts`, `first_token_ts`, `last_token_ts`), `vllm_meta.json` (the model, the
vLLM version, its engine kwargs and, when recorded, the KV-cache block and the device)
and optionally `validation_summary.txt` (another simulator's published error on the same
run). The format is LLMServingSim's `bench/` output (casys-kaist/LLMServingSim, commit
5daddb2); `../shared/real-runs/README.md` describes it.

Checks on every row, each failure dropped and counted by reason (never silently): the
fields are numbers, lengths are >= 1, request ids are unique, and the engine timestamps
are ordered queued <= scheduled <= first token <= last token, which is what makes queue
(scheduled − queued) + prefill (first − scheduled) + decode (last − first) add up to the
end-to-end latency. Metrics are taken on the engine's clock, as the README says and as
LLMServingSim does: TTFT = first_token − queued, E2E = last_token − queued, TPOT =
(E2E − TTFT) / (output − 1). The replay's arrivals are `queued_ts` relative to the first
request; how far they drift from the client's `arrival_time` is reported. The simulated
side is measured likewise from when its engine queued each request (`_queued_at`).
"""
from __future__ import annotations

import json
import math
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from servelab.traces.record import RowIssue

__all__ = ["LATENCIES", "NotReplayable", "RealRequest", "RecordedRun", "Replay",
           "catalog_model", "decode_seconds", "error_metrics", "load_recorded_run",
           "parse_published", "replay_run", "run_gpu", "vllm_engine_config"]

LATENCIES = ("ttft", "tpot", "e2el")
"""The per-request latencies compared, named as `vllm bench serve` names them."""
STATS = ("mean", "p50", "p90", "p99")
_TIMESTAMPS = ("queued_ts", "scheduled_ts", "first_token_ts", "last_token_ts")
_PUBLISHED_STATS = {"Mean": "mean", "Median": "p50", "P90": "p90", "P95": "p95", "P99": "p99"}
_PUBLISHED_METRICS = {"TTFT": "ttft", "TPOT": "tpot", "Latency": "e2el"}


class NotReplayable(ValueError):
    """A run servelab cannot replay (yet); the message is the one line the report shows."""


@dataclass(frozen=True, slots=True)
class RealRequest:
    request_id: str
    arrival_s: float
    """queued_ts relative to the run's first request."""
    prompt_tokens: int
    output_tokens: int
    ttft_ms: float
    e2el_ms: float
    queue_ms: float
    """scheduled − queued: time before the first step that computed any of it."""
    client_lag_ms: float | None
    """(queued − first queued) − (arrival_time − first arrival_time): how much later than
    the client's clock says the engine saw it; None without arrival_time."""

    @property
    def tpot_ms(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el_ms - self.ttft_ms) / (self.output_tokens - 1)


@dataclass(frozen=True)
class RecordedRun:
    path: Path
    label: str
    """The folder's last two parts ("RTX4090/Llama-3.1-8B")."""
    meta: dict[str, Any]
    requests: tuple[RealRequest, ...]
    """Kept rows in arrival order (ties by file order)."""
    source_rows: int
    dropped: tuple[RowIssue, ...]
    published: dict[str, dict[str, dict[str, float]]] | None
    """validation_summary.txt: metric -> stat -> {"real", "sim", "error_pct"}."""
    timeseries: dict[str, np.ndarray] | None
    """vllm_timeseries.csv's columns (engine state once a second: t, running, waiting, ...)."""
    gpu: str | None = None
    """The catalog GPU to price it with, when the user names one (`--gpu`); else `run_gpu`
    reads it from the run."""

    @property
    def model_name(self) -> str:
        return str(self.meta.get("model") or self.meta.get("engine_kwargs", {}).get("model", "?"))


def load_recorded_run(path: str | Path) -> RecordedRun:
    """Read and check one run folder; ValueError (one line naming the folder) when a file
    is missing or unreadable, or no row survives the checks."""
    folder = Path(path)
    label = "/".join(folder.resolve().parts[-2:])
    try:
        meta = json.loads((folder / "vllm_meta.json").read_text(encoding="utf-8"))
        lines = (folder / "vllm_requests.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"{folder}: not a recorded vLLM run ({exc.filename}: "
                         f"{exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{folder}/vllm_meta.json: not valid JSON ({exc.msg})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{folder}/vllm_meta.json: expected a JSON object")
    kept, issues = _check_rows([(n, line) for n, line in enumerate(lines, 1) if line.strip()])
    if not kept:
        raise ValueError(f"{folder}/vllm_requests.jsonl: no usable request"
                         + "".join(f"; {i.count} {i.reason} ({i.example})" for i in issues))
    kept.sort(key=lambda r: (r["queued_ts"], r["line"]))
    q0, a0 = kept[0]["queued_ts"], kept[0].get("arrival_time")
    requests = tuple(RealRequest(
        request_id=str(r.get("request_id", r["line"])), arrival_s=r["queued_ts"] - q0,
        prompt_tokens=r["input_toks"], output_tokens=r["output_toks"],
        ttft_ms=(r["first_token_ts"] - r["queued_ts"]) * 1e3,
        e2el_ms=(r["last_token_ts"] - r["queued_ts"]) * 1e3,
        queue_ms=(r["scheduled_ts"] - r["queued_ts"]) * 1e3,
        client_lag_ms=None if a0 is None or r.get("arrival_time") is None
        else ((r["queued_ts"] - q0) - (r["arrival_time"] - a0)) * 1e3) for r in kept)
    summary = folder / "validation_summary.txt"
    published = parse_published(summary.read_text(encoding="utf-8")) if summary.is_file() else None
    return RecordedRun(folder, label, meta, requests, len(kept) + sum(i.count for i in issues),
                       tuple(issues), published or None, _read_timeseries(folder))


def _read_timeseries(folder: Path) -> dict[str, np.ndarray] | None:
    """vllm_timeseries.csv as numeric columns; None when absent or not numeric (it only
    feeds a figure)."""
    import csv

    path = folder / "vllm_timeseries.csv"
    if not path.is_file():
        return None
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    try:
        return {k: np.array([float(r[k]) for r in rows]) for k in rows[0]} if rows else None
    except (TypeError, ValueError):
        return None


def _check_rows(lines: list[tuple[int, str]]) -> tuple[list[dict], list[RowIssue]]:
    """The rows (line number, text) that pass every check, and one `RowIssue` per reason
    for the rest (count, first example)."""
    kept, issues, seen = [], {}, set()

    def drop(reason: str, n: int, detail: str) -> None:
        old = issues.get(reason)
        issues[reason] = RowIssue(reason, 1 + (old.count if old else 0),
                                  old.example if old else f"line {n}: {detail}")

    for n, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            drop("not a JSON object", n, exc.msg)
            continue
        if not isinstance(row, dict):
            drop("not a JSON object", n, type(row).__name__)
            continue
        bad = [k for k in ("input_toks", "output_toks", *_TIMESTAMPS) if not _number(row.get(k))]
        if bad:
            drop("missing or non-numeric field", n, f"{bad[0]} is {row.get(bad[0])!r}")
            continue
        if not all(float(row[k]).is_integer() and row[k] >= 1 for k in ("input_toks", "output_toks")):
            drop("token count not an integer >= 1", n,
                 f"input_toks {row['input_toks']!r}, output_toks {row['output_toks']!r}")
            continue
        times = [row[k] for k in _TIMESTAMPS]
        if any(b < a for a, b in zip(times, times[1:])):
            drop("timestamps out of order (queued <= scheduled <= first token <= last token)",
                 n, ", ".join(f"{k} {row[k]}" for k in _TIMESTAMPS))
            continue
        rid = row.get("request_id")
        if rid is not None and rid in seen:
            drop("duplicate request_id", n, repr(rid))
            continue
        seen.add(rid)
        if not _number(row.get("arrival_time")):
            row["arrival_time"] = None
        row.update(line=n, input_toks=int(row["input_toks"]), output_toks=int(row["output_toks"]))
        kept.append(row)
    return kept, list(issues.values())


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_published(text: str) -> dict[str, dict[str, dict[str, float]]]:
    """LLMServingSim's validation_summary.txt ("TTFT Mean  65456.6  65820.2  +0.6%" per
    line: its real figure, its simulated figure and their difference, ms) as metric ->
    stat -> {"real", "sim", "error_pct"}; lines of any other shape are skipped."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    pattern = re.compile(r"^(TTFT|TPOT|Latency) (Mean|Median|P\d+)\s+(\S+)\s+(\S+)\s+([+-]?[\d.]+)%$")
    for line in text.splitlines():
        m = pattern.match(line.strip())
        if m and m.group(2) in _PUBLISHED_STATS:
            metric, stat = _PUBLISHED_METRICS[m.group(1)], _PUBLISHED_STATS[m.group(2)]
            out.setdefault(metric, {})[stat] = {"real": float(m.group(3)), "sim": float(m.group(4)),
                                                "error_pct": float(m.group(5))}
    return out


# --------------------------------------------------------------------------- setup


def catalog_model(run: RecordedRun) -> str:
    """The catalog model the run served (`servelab.vllm_args.catalog_model`: its Hugging
    Face id, or the entry its variant tails name, "Qwen/Qwen3-30B-A3B-Instruct-2507" ->
    qwen3-30b-a3b: a re-release with the base entry's architecture is assumed, which only
    its context length may not share). NotReplayable for a model with no catalog entry."""
    from servelab.models import catalog_names, load_model_spec
    from servelab.vllm_args import catalog_model as served_model

    name = run.model_name
    try:
        return served_model(name)
    except ValueError:
        pass
    hf_ids = sorted((load_model_spec(n).hf_config.get("_name_or_path", ""), n)
                    for n in catalog_names())
    supported = ", ".join(f"{hf} ({n})" for hf, n in hf_ids if "/" in hf)
    raise NotReplayable(f"{run.label}: model {name!r} has no catalog entry; supported: {supported}")


def run_gpu(run: RecordedRun) -> str:
    """The catalog GPU of a run: the one given (`RecordedRun.gpu`), else
    `hardware.device_name` in its meta when recorded, else the `hardware` of the recording
    simulator's config.json beside it (LLMServingSim's cluster config: "RTXPRO6000" =
    rtx-pro-6000, by catalog name or alias), else a folder of its path so named."""
    from servelab.simulator.gpus import get_gpu, gpu_for_device_name, gpu_names

    if run.gpu is not None:
        return run.gpu
    device = (run.meta.get("hardware") or {}).get("device_name")
    if device and gpu_for_device_name(device):
        return gpu_for_device_name(device)
    squash = lambda s: re.sub(r"[^a-z0-9]", "", s.lower())  # noqa: E731
    names = {squash(a): n for n in gpu_names() for a in (n, *get_gpu(n).aliases)}
    named = {squash(h) for h in _config_hardware(run.path)} & set(names)
    if len(named) == 1:
        return names[named.pop()]
    for part in reversed(run.path.resolve().parts):
        if squash(part) in names:
            return names[squash(part)]
    raise NotReplayable(f"{run.label}: cannot tell its GPU (device_name {device!r}, no hardware "
                        f"in a config.json, no folder named after a catalog GPU): give --gpu; "
                        f"catalog: {', '.join(gpu_names())}")


def _config_hardware(folder: Path) -> list[str]:
    """The `hardware` names of every instance in the recording simulator's config.json
    (nodes -> instances -> hardware); [] when there is none or it cannot be read."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        return [str(i["hardware"]) for node in config["nodes"] for i in node["instances"]
                if "hardware" in i]
    except (OSError, ValueError, KeyError, TypeError):
        return []


ENGINE = "vllm-0.19"
"""The engine preset of a run that does not say its vLLM version (the shared runs are
vLLM 0.19.0, `vllm_version` in their meta)."""


def major_minor(version) -> tuple[int, int] | None:
    """(0, 19) for "0.19.0" (or "v0.19.1"); None when the text names no version."""
    found = re.search(r"(\d+)\.(\d+)", str(version or ""))
    return (int(found[1]), int(found[2])) if found else None


def run_engine(run: RecordedRun) -> str:
    """The vLLM preset of the run's `vllm_version` (its major.minor), else the preset
    nearest to it (`servelab.engines`; the report's setup line then says so), else ENGINE."""
    from servelab.engines import PRESETS

    wanted = major_minor(run.meta.get("vllm_version"))
    presets = {major_minor(p.engine_version): name for name, p in PRESETS.items() if p.engine_version}
    if wanted is None:
        return ENGINE
    step = lambda v: 1000 * v[0] + v[1]  # noqa: E731  (a major version outweighs any minor)
    return presets.get(wanted) or presets[min(presets, key=lambda v: abs(step(v) - step(wanted)))]


def vllm_engine_config(run: RecordedRun, model: str, gpu: str, trace_path: str,
                       calibration: str | None = None):
    """The `SimulationConfig` of the engine that ran `run`: what `servelab simulate --engine
    vllm-X.Y --vllm-args FLAGS` builds (the preset of its vLLM version, `run_engine`) from
    the flags the run's own config names (`vllm_flags`: every engine kwarg, and its
    recorded KV cache: num_gpu_blocks as --num-gpu-blocks-override, block_size,
    gpu_memory_utilization, enable_prefix_caching); a kwarg servelab cannot model makes
    the run NotReplayable, with the reason.
    A run with expert parallelism (`enable_expert_parallel`) spreads its experts over the
    TP × DP GPUs, its DP ranks one deployment (`--dp`). Every other setting is the preset's (`servelab.engines`: vLLM V1's defaults), so the
    replay is what a user gets who passes the same flags."""
    from servelab.cli import CLIError, build_parser
    from servelab.simulator.cli import config_from_args

    argv = ["simulate", "--trace", trace_path, "--trace-format", "servelab", "--model", model,
            "--gpu", gpu, "--engine", run_engine(run), "--out", "unused",
            "--vllm-args", " ".join(vllm_flags(run))]
    if calibration is not None:
        argv += ["--calibration", calibration]
    try:
        return config_from_args(build_parser().parse_args(argv))
    except CLIError as exc:
        raise NotReplayable(f"{run.label}: {exc}") from None


_RECORDED = ("block_size", "gpu_memory_utilization", "enable_prefix_caching")
"""Settings a run's `kv_cache` records as the engine resolved them: they win over the
engine kwargs it was given."""
_NEGATABLE = frozenset({"enable_prefix_caching", "enable_chunked_prefill", "async_scheduling"})
"""Boolean engine kwargs whose False is a `--no-...` flag; another False one is a switch
left off, vLLM's default."""


def vllm_flags(run: RecordedRun) -> list[str]:
    """The `vllm serve` flags of the run's `vllm_meta.json`: every engine kwarg but the
    model (None values left out; a boolean as its switch; a dict or list as JSON), its
    recorded KV cache's resolved settings in place of the kwargs' (`_RECORDED`) and its
    block count as --num-gpu-blocks-override. `servelab.vllm_args` reads them as it reads
    a command line: a kwarg servelab cannot model is refused there, so the run is not
    replayed as if it had not been set."""
    import json
    import shlex

    kwargs = {k: v for k, v in (run.meta.get("engine_kwargs") or {}).items() if k != "model"}
    cache = run.meta.get("kv_cache") or {}
    kwargs.update({k: cache[k] for k in _RECORDED if cache.get(k) is not None})
    flags = []
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            if value or name in _NEGATABLE:
                flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (dict, list)):
            flags.append(f"{flag} {shlex.quote(json.dumps(value))}")
        else:
            flags.append(f"{flag} {shlex.quote(str(value))}")
    if cache.get("num_gpu_blocks") is not None:
        flags.append(f"--num-gpu-blocks-override {cache['num_gpu_blocks']}")
    return flags


# --------------------------------------------------------------------------- replay


@dataclass(frozen=True)
class Replay:
    run: RecordedRun
    config: Any
    """The `SimulationConfig` replayed (its trace file was temporary)."""
    derived: dict[str, Any]
    """What the simulation derived (`SimulationResult.derived`), plus
    "formula_kv_blocks": the KV capacity servelab derives from GPU memory for this setup."""
    real: dict[str, np.ndarray]
    sim: dict[str, np.ndarray]
    """Latency -> per-request ms in `run.requests` order (NaN where undefined)."""
    errors: dict[str, dict[str, Any]]
    """Latency -> `error_metrics(real, sim)`."""
    rejected: int
    preemptions: int
    timeline: dict[str, np.ndarray]
    """The simulated engine once a second: "t_s", "running", "waiting" (as vllm_timeseries.csv)."""
    cost_model: Any
    """The `CostModel` that priced the replay."""


def replay_run(run: RecordedRun, calibration: str | None = None, **overrides: Any) -> Replay:
    """Replay `run` through the simulator with its engine's config (`vllm_engine_config`),
    `overrides` replacing fields of that `SimulationConfig` (e.g. kv_blocks=None to derive
    the KV capacity instead of using the recorded one). NotReplayable when its model or GPU
    has no catalog entry, its dtypes are not modelled, or the simulator refuses the setup
    (e.g. weights that leave no room for the KV cache)."""
    from dataclasses import replace

    from servelab.simulator.footprint import kv_capacity_blocks
    from servelab.simulator.run import build_simulation
    from servelab.traces.canonical import write_csv
    from servelab.traces.record import Trace, TraceRecord

    model, gpu = catalog_model(run), run_gpu(run)
    trace = Trace(tuple(TraceRecord(r.arrival_s, r.prompt_tokens, r.output_tokens)
                        for r in run.requests), source=str(run.path), format="servelab")
    with tempfile.TemporaryDirectory(prefix="servelab-real-run-") as tmp:
        write_csv(trace, Path(tmp) / "trace.csv")
        config = replace(vllm_engine_config(run, model, gpu, str(Path(tmp) / "trace.csv"),
                                            calibration), **overrides)
        try:
            simulation = build_simulation(config)
        except ValueError as exc:   # the inputs: e.g. weights that leave no room for KV
            raise NotReplayable(f"{run.label}: cannot be replayed as recorded: {exc}") from None
    result = simulation.run()
    c = config
    formula = kv_capacity_blocks(model, gpu, tp=c.tp, block_size=c.block_size,
                                 gpu_memory_utilization=c.gpu_memory_utilization,
                                 kv_dtype=c.kv_dtype, weight_dtype=c.weight_dtype,
                                 max_num_batched_tokens=c.scheduler.max_num_batched_tokens,
                                 max_num_seqs=c.scheduler.max_num_seqs, ep=c.ep)
    records = sorted(result.requests, key=lambda r: r.request_id)
    nan = float("nan")
    real = {"ttft": np.array([r.ttft_ms for r in run.requests]),
            "tpot": np.array([nan if r.tpot_ms is None else r.tpot_ms for r in run.requests]),
            "e2el": np.array([r.e2el_ms for r in run.requests])}
    queued = _queued_at(simulation.cluster.replicas)
    since = [queued.get(r.request_id, r.arrival_s) for r in records]
    sim = {"ttft": np.array([nan if r.first_token_s is None else (r.first_token_s - q) * 1e3
                             for r, q in zip(records, since)]),
           "tpot": np.array([nan if r.tpot_ms is None else r.tpot_ms for r in records]),
           "e2el": np.array([nan if r.status != "finished" else (r.finish_s - q) * 1e3
                             for r, q in zip(records, since)])}
    return Replay(run, config, {**result.derived, "formula_kv_blocks": formula}, real, sim,
                  {m: error_metrics(real[m], sim[m]) for m in LATENCIES},
                  sum(r.status != "finished" for r in records),
                  sum(r.num_preemptions for r in records),
                  _timeline([r.steps.table() for r in simulation.cluster.replicas]),
                  simulation.cost_model)


def _queued_at(replicas) -> dict[int, float]:
    """Request id -> when its engine queued it: the first step start at or after its
    arrival on the replica that served it (the step boundary that took it in; the arrival
    itself when the engine was idle, as it then starts a step at once). The recorded
    runs measure latencies from the engine's `queued_ts`, which vLLM's engine core takes
    between steps when it drains its input queue (`EngineCore._process_input_queue`,
    `vllm/v1/engine/core.py`); the replay's arrivals are those times, which fall inside
    the simulated engine's steps, so its latencies are measured from its own boundary
    that queued each request, as the real ones are."""
    queued = {}
    for replica in replicas:
        starts = np.array([s.start_s for s in replica.steps.table()])
        for rec in replica.records.table():
            i = int(np.searchsorted(starts, rec.arrival_s, side="left"))
            queued[rec.request_id] = float(starts[i]) if i < len(starts) else rec.arrival_s
    return queued


def _timeline(replica_steps) -> dict[str, np.ndarray]:
    """Running and waiting requests at each whole second, from each replica's step
    records, summed over the replicas (a data-parallel run's engine counts every rank's,
    as vllm_timeseries.csv does)."""
    starts = [np.array([s.start_s for s in steps]) for steps in replica_steps]
    last = max((float(s[-1]) for s in starts if len(s)), default=None)
    if last is None:
        return {"t_s": np.zeros(0), "running": np.zeros(0), "waiting": np.zeros(0)}
    t = np.arange(1.0, math.floor(last) + 1.0)
    running, waiting = np.zeros(len(t), dtype=np.int64), np.zeros(len(t), dtype=np.int64)
    for steps, start in zip(replica_steps, starts):
        if not len(start):
            continue
        at = np.clip(np.searchsorted(start, t, side="right") - 1, 0, len(start) - 1)
        running += np.array([steps[i].num_running for i in at], dtype=np.int64)
        waiting += np.array([steps[i].num_waiting for i in at], dtype=np.int64)
    return {"t_s": t, "running": running, "waiting": waiting}


def error_metrics(real: Sequence[float], sim: Sequence[float]) -> dict[str, Any]:
    """Per-request and distribution errors of `sim` against `real` (pairs where both are
    finite and real > 0): MAPE and the median signed error (%, positive = simulated
    slower), and mean/p50/p90/p99 of each side with the signed error of each statistic.
    Percentiles interpolate linearly (numpy's default, LLMServingSim's figures too)."""
    real, sim = np.asarray(real, dtype=float), np.asarray(sim, dtype=float)
    keep = np.isfinite(real) & np.isfinite(sim) & (real > 0)
    r, s = real[keep], sim[keep]
    if not len(r):
        return {"n": 0}
    rel = (s - r) / r * 100

    def stats(x: np.ndarray) -> dict[str, float]:
        return {"mean": float(x.mean()), **{f"p{q}": float(np.percentile(x, q)) for q in (50, 90, 99)}}

    real_stats, sim_stats = stats(r), stats(s)
    return {"n": int(keep.sum()), "mape_pct": float(np.abs(rel).mean()),
            "median_signed_pct": float(np.median(rel)), "real": real_stats, "sim": sim_stats,
            "stat_error_pct": {k: (sim_stats[k] - real_stats[k]) / real_stats[k] * 100
                               for k in STATS}}


def decode_seconds(replay: Replay) -> dict[str, Any] | None:
    """The real run's pure-decode seconds priced by the replay's cost model: seconds of
    vllm_timeseries.csv with no prompt tokens, nothing waiting and >= 4 requests running,
    where the real step time is running / generated tokens per second.

    A running request's context is KV usage × KV tokens / running where the run recorded
    its KV usage and capacity; else it is read from the requests themselves: each request
    decoding at the second's sample holds its prompt plus the tokens it had generated by
    then, counted linearly between its first and last token ("context_from": "kv" or
    "requests"). The timeseries' clock starts at the first request's queued_ts: on the four
    public runs its running count matches the requests in flight at that instant within
    0.5-2.6 requests on average. A data-parallel run's `running` is all ranks': each rank
    is priced with running / dp, its peers as busy. None when the run recorded no
    timeseries or no pure-decode second."""
    from servelab.outputs import BatchShape

    ts, run = replay.run.timeseries, replay.run
    cache = run.meta.get("kv_cache") or {}
    need = ("prompt_throughput", "gen_throughput", "running", "waiting")
    if ts is None or not all(k in ts for k in need):
        return None
    keep = ((ts["prompt_throughput"] == 0) & (ts["waiting"] == 0) & (ts["running"] >= 4)
            & (ts["gen_throughput"] > 0))
    if not keep.any():
        return None
    running = ts["running"][keep].astype(int)
    from_kv = ("kv_cache_pct" in ts and bool(cache.get("num_gpu_blocks"))
               and bool((ts["kv_cache_pct"][keep] > 0).all()))
    if from_kv:
        kv_tokens = (ts["kv_cache_pct"][keep] / 100 * cache["num_gpu_blocks"]
                     * cache.get("block_size", 16))
        context = (kv_tokens / running).astype(int)
    else:
        context = np.array([_mean_decode_context(run.requests, t) for t in ts["t"][keep]])
    dp = replay.cost_model.data_parallel_ranks
    per_rank = np.maximum(np.rint(running / dp).astype(int), 1)
    priced = np.array([replay.cost_model.step_time(BatchShape(num_decode_seqs=int(n),
                                                              decode_context_sum=int(n * (c + 1))))
                       for n, c in zip(per_rank, context)])
    return {"t_s": ts["t"][keep], "running": running, "context": context,
            "real_ms": running / ts["gen_throughput"][keep] * 1e3, "priced_ms": priced * 1e3,
            "context_from": "kv" if from_kv else "requests"}


def _mean_decode_context(requests: Sequence[RealRequest], t: float) -> int:
    """Mean tokens held by the requests decoding `t` s after the first was queued: each
    one's prompt plus the tokens generated by then (linear between first and last token)."""
    held = []
    for r in requests:
        first, last = r.arrival_s + r.ttft_ms / 1e3, r.arrival_s + r.e2el_ms / 1e3
        if first <= t < last:
            held.append(r.prompt_tokens + r.output_tokens * (t - first) / (last - first))
    return int(np.mean(held)) if held else 0
