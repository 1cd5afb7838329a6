"""A disaggregated simulation from one config, and what it writes beside a co-located run's.

`build_simulation` returns a `DisaggregatedSimulation` for a config whose `disaggregation`
is set: each pool gets its cost model (its GPU and tp), KV capacity and schedulers, then
one `DisaggregatedCluster` runs them. Its result is a co-located run's (requests and
steps of both pools, summary.json computed alike: a request's TTFT is its first token on
its prefill replica, its E2E its last on its decode replica) plus `DisaggregationOutputs`:

- handoffs.csv (or .parquet): one row per handed-off request (`Handoff`): its replicas,
  prompt, KV bytes, blocks held on the prefill side, and the times it arrived, was first
  scheduled, ended its prefill, landed on a decode replica, and was sent;
- disaggregation.json: the layout (GPUs per pool, link, lanes), TTFT split into queueing
  and prefill, the handoff split into waiting for a decode replica (back-pressure),
  waiting for the link and the transfer itself, transfer bytes, KV held on the prefill
  pool (peak, and block-seconds, waiting for a decode replica and in all), per-pool GPU
  busy time and KV use, and throughput and goodput per GPU.

config.json's `derived` holds the pools' derived layout (KV blocks, cost model, profile).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from servelab.config import CacheConfig
from servelab.engines import get_preset
from servelab.record_table import RecordTable, stored_fields
from servelab.simulator.disaggregated_cluster import DisaggregatedCluster
from servelab.simulator.kv_handoff import Handoff, HeldKV
from servelab.simulator.run import (RunCheckError, Simulation, SimulationConfig, _gc_paused,
                                    _kernels_used, _profile_choice, load_workload, trace_provenance)


@dataclass(frozen=True)
class Pool:
    """One pool as built: what its replicas run on and hold."""

    name: str
    replicas: int
    tp: int
    cost: Any
    """Its `CostModel`."""
    kv_blocks: int
    kv_blocks_source: str
    host_blocks: int
    profile_name: str
    profile_line: str

    @property
    def gpus(self) -> int:
        return self.replicas * self.tp

    def describe(self) -> dict[str, Any]:
        cost = self.cost
        return {"replicas": self.replicas, "gpu": cost.gpu.name, "tp": self.tp, "gpus": self.gpus,
                "kv_blocks_per_replica": self.kv_blocks, "kv_blocks_source": self.kv_blocks_source,
                **({"cpu_tier_blocks_per_replica": self.host_blocks} if self.host_blocks else {}),
                "cost_model": {"calibration": self.profile_name, "calibration_source": self.profile_line,
                               "calibration_device": cost.profile.device,
                               "calibration_engine_version": cost.profile.engine_version,
                               "step_overhead_s": cost.step_overhead_s, "scales": dict(cost.scales),
                               "kernels": _kernels_used(cost)}}


def _build_pool(name: str, c: SimulationConfig, pool, model, engine_version, sched, *,
                host: bool) -> Pool:
    from servelab.host_memory import check_host_memory, host_tier_blocks
    from servelab.simulator.calibration import resolve
    from servelab.simulator.cost_model import CostModel
    from servelab.simulator.footprint import kv_capacity_blocks
    from servelab.simulator.gpus import get_gpu

    gpu = get_gpu(pool.gpu or c.gpu)
    tp = pool.tp or c.tp
    profile = resolve(gpu, c.calibration, engine_version=engine_version)
    profile_name, profile_line = _profile_choice(gpu, c.calibration, engine_version)
    cost = CostModel(model, gpu, tp=tp, weight_dtype=c.weight_dtype, kv_dtype=c.kv_dtype,
                     calibration=profile, block_size=c.block_size)
    given = pool.kv_blocks if pool.kv_blocks is not None else c.kv_blocks
    kv_blocks = given if given is not None else kv_capacity_blocks(
        model, cost.gpu, tp=tp, block_size=c.block_size,
        gpu_memory_utilization=c.gpu_memory_utilization, kv_dtype=c.kv_dtype,
        weight_dtype=c.weight_dtype, max_num_batched_tokens=sched.max_num_batched_tokens,
        max_num_seqs=sched.max_num_seqs)
    block_bytes = cost.block_bytes * tp
    offload_gb = c.kv_offload_gb if host else 0.0
    host_blocks = host_tier_blocks(offload_gb, block_bytes)
    check_host_memory(cost.gpu, tp, offload_gb, c.cpu_kv_blocks * block_bytes)
    source = "configured (kv_blocks)" if given is not None else "derived from GPU memory"
    return Pool(name, pool.replicas, tp, cost, kv_blocks, source, host_blocks, profile_name, profile_line)


def _check_pool_holds(pool: Pool, trace, need_of, what: str) -> None:
    """Refuse a pool in which no request can ever get the blocks it needs there."""
    needs = [need_of(r) for r in trace.records]
    needs = [n for n in needs if n is not None]
    if not needs:
        return
    bs = pool.cost.block_size
    capacity = pool.kv_blocks * bs
    if min(needs) > capacity:
        raise ValueError(
            f"{pool.name} pool: a KV cache of {pool.kv_blocks:,} blocks per replica ({capacity:,} tokens) "
            f"cannot hold any request: the smallest needs {min(needs):,} tokens ({what}); give more "
            f"--{pool.name}-kv-blocks, a larger --{pool.name}-tp or a GPU with more memory "
            f"(--{pool.name}-gpu)")


class DisaggregatedSimulation(Simulation):
    """A built disaggregated simulation (see the module docstring). Like `Simulation`,
    everything that can fail on user input fails here, before the run."""

    def __init__(self, config: SimulationConfig) -> None:
        from servelab.host_memory import check_prefix_block_sizes
        from servelab.models import load_model_spec
        from servelab.policies import make_policy
        from servelab.simulator.speed import BatchingScheduler, build_scheduler, make_block_manager
        from servelab.simulator.links import get_link
        from servelab.simulator.router import make_router

        self.config = c = config
        d = c.disaggregation
        with _gc_paused():
            trace = load_workload(c)
        model = load_model_spec(c.model)
        engine_version = get_preset(c.engine).engine_version if c.engine else None
        sched = c.scheduler
        self.prefill = _build_pool("prefill", c, d.prefill, model, engine_version, sched, host=True)
        self.decode = _build_pool("decode", c, d.decode, model, engine_version, sched, host=False)
        _check_pool_holds(self.prefill, trace, lambda r: r.prompt_tokens, "its prompt")
        _check_pool_holds(self.decode, trace,
                          lambda r: r.prompt_tokens + r.output_tokens - 1 if r.output_tokens > 1 else None,
                          "prompt + output")
        if c.prefix_caching:
            check_prefix_block_sizes(trace, c.block_size)
        self.profile_line = (self.prefill.profile_line if self.prefill.profile_line == self.decode.profile_line
                             else f"prefill {self.prefill.profile_line}; decode {self.decode.profile_line}")
        self.profile_name = (self.prefill.profile_name if self.prefill.profile_name == self.decode.profile_name
                             else f"prefill {self.prefill.profile_name}; decode {self.decode.profile_name}")
        self.link = get_link(d.kv_link)
        self.lanes = min(self.prefill.tp, self.decode.tp)
        self.kv_bytes_per_token = self.decode.cost.block_bytes * self.decode.tp // c.block_size
        p, q = self.prefill, self.decode
        prefill_cache = CacheConfig(block_size=c.block_size, num_gpu_blocks=p.kv_blocks,
                                    num_cpu_blocks=c.cpu_kv_blocks, watermark=c.watermark,
                                    enable_prefix_caching=c.prefix_caching, block_manager=c.block_manager,
                                    num_host_blocks=p.host_blocks)
        decode_cache = CacheConfig(block_size=c.block_size, num_gpu_blocks=q.kv_blocks,
                                   num_cpu_blocks=c.cpu_kv_blocks, watermark=c.watermark,
                                   enable_prefix_caching=False, block_manager=c.block_manager)
        prefill_schedulers = [
            BatchingScheduler(sched, HeldKV(make_block_manager(prefill_cache, sched.max_model_len)),
                      make_policy(c.policy, **c.policy_options), enable_prefix_caching=c.prefix_caching)
            for _ in range(p.replicas)]
        decode_schedulers = [build_scheduler(sched, decode_cache, c.policy, c.policy_options)
                             for _ in range(q.replicas)]
        with _gc_paused():
            requests = trace.requests(c.seed)
        self.num_requests = len(trace)
        self.trace_provenance = trace_provenance(trace)
        del trace
        self.cluster = DisaggregatedCluster(
            prefill_schedulers, p.cost, decode_schedulers, q.cost, make_router(c.router, p.replicas),
            requests, link=self.link, kv_transfer=d.kv_transfer,
            kv_bytes_per_token=self.kv_bytes_per_token, num_layers=model.num_layers, lanes=self.lanes,
            async_scheduling=c.async_scheduling)

    def derived(self) -> dict[str, Any]:
        link, d = self.link, self.config.disaggregation
        return {
            "disaggregation": {
                "prefill": self.prefill.describe(), "decode": self.decode.describe(),
                "gpus": self.prefill.gpus + self.decode.gpus,
                "kv_link": {"name": link.name, "bandwidth_gbps": link.bandwidth_gbps,
                            "latency_us": link.latency_us, "source": link.source},
                "kv_transfer": d.kv_transfer, "transfer_lanes": self.lanes,
                "kv_bytes_per_token": self.kv_bytes_per_token},
            "engine": self.config.engine or "servelab",
            "trace": self.trace_provenance,
        }

    def run(self, progress=None):
        """`Simulation.run`, with the handoffs and their summary in `disaggregation`."""
        try:
            result = super().run(progress)
        except RunCheckError as exc:
            raise RunCheckError(str(exc), self._with_outputs(exc.result)) from None
        return self._with_outputs(result)

    def _with_outputs(self, result):
        handoffs = self.cluster.handoff_table()
        report = disaggregation_report(self, result, handoffs)
        return replace(result, disaggregation=DisaggregationOutputs(handoffs, report))


@dataclass(frozen=True)
class DisaggregationOutputs:
    handoffs: RecordTable
    """One `Handoff` per handed-off request, by request id."""
    report: dict[str, Any]
    """disaggregation.json (see `disaggregation_report`)."""

    def write(self, out_dir: Path, output_format: str = "csv") -> None:
        """disaggregation.json and handoffs.<format> in a run directory."""
        import pyarrow as pa
        import pyarrow.csv as pacsv
        import pyarrow.parquet as pq

        from servelab.atomic import atomic_path
        from servelab.reports.runio import write_json

        write_json(out_dir / "disaggregation.json", self.report)
        kinds = stored_fields(Handoff)
        columns = []
        for name in kinds:
            values = self.handoffs.column(name)
            optional = kinds[name].endswith("None")
            array = pa.array(values, from_pandas=optional)
            columns.append(array.cast(pa.int64()) if kinds[name] == "int | None" else array)
        table = pa.table(columns, names=list(kinds))
        path = out_dir / f"handoffs.{output_format}"
        with atomic_path(path) as tmp:
            if output_format == "parquet":
                pq.write_table(table, tmp)
            else:
                pacsv.write_csv(table, tmp, pacsv.WriteOptions(quoting_style="none", quoting_header="none"))
        for other in ("csv", "parquet"):
            if other != output_format:
                (out_dir / f"handoffs.{other}").unlink(missing_ok=True)


def _stats_ms(seconds: np.ndarray) -> dict[str, float | None]:
    """mean, p50, p90, p99 and max in ms (None over no values)."""
    x = seconds * 1e3
    if not len(x):
        return dict.fromkeys(("mean", "p50", "p90", "p99", "max"))
    p50, p90, p99 = np.percentile(x, [50, 90, 99]).tolist()
    return {"mean": float(x.mean()), "p50": p50, "p90": p90, "p99": p99, "max": float(x.max())}


def held(start: np.ndarray, end: np.ndarray, blocks: np.ndarray) -> tuple[int, float]:
    """(peak, integral in block-seconds) of the blocks held over intervals [start, end):
    a sweep over the ends, releases first at equal times, so that a hold of no duration
    counts for nothing. O(n log n)."""
    if not len(start):
        return 0, 0.0
    times = np.concatenate([end, start])
    deltas = np.concatenate([-blocks, blocks])
    order = np.lexsort((deltas, times))   # by time, then releases (negative) first
    level = np.cumsum(deltas[order])
    return int(level.max(initial=0)), float((blocks * (end - start)).sum())


def _pool_use(replicas, span: float) -> dict[str, float | None]:
    """GPU busy fraction (summed step time over the run's span, averaged over replicas)
    and KV use (blocks used over total, weighted by step time) of one pool."""
    steps = [r.steps.table() for r in replicas]
    durations = [t.column("duration_s") for t in steps]
    busy = [float(d.sum()) / span for d in durations] if span > 0 else [0.0]
    weight = sum(float(d.sum()) for d in durations)
    kv = sum(float((t.column("kv_blocks_used") / t.column("kv_blocks_total") * d).sum())
             for t, d in zip(steps, durations))
    return {"gpu_busy_fraction": float(np.mean(busy)), "mean_kv_usage": kv / weight if weight else None}


def handoff_statistics(handoffs: RecordTable, block_bytes: int, span: float) -> dict[str, Any]:
    """The part of disaggregation.json both executors compute alike from the handoffs
    (the simulator's here, the real backend's in `backends/disaggregated.py`): requests
    handed off, the TTFT and handoff splits, the transfers (with their summed seconds) and
    the back-pressure. Times in ms, sizes in bytes and blocks."""
    col = handoffs.column
    landed = np.isfinite(col("landed_s"))
    prefill_end, blocks = col("prefill_end_s"), col("held_blocks")
    waited_until = np.where(landed, col("landed_s"), col("released_s"))
    sent = col("kv_bytes")[landed]
    transfer = (col("transfer_end_s") - col("transfer_start_s"))[landed]
    waiting_peak, waiting_integral = held(prefill_end, waited_until, blocks)
    held_peak, held_integral = held(prefill_end, col("released_s"), blocks)
    return {
        "requests": {"handed_off": int(landed.sum()), "fit_no_decode_replica": int((~landed).sum())},
        "ttft_ms": {"queueing": _stats_ms(col("scheduled_s") - col("arrival_s")),
                    "prefill": _stats_ms(prefill_end - col("scheduled_s"))},
        "handoff_ms": {"waiting_for_decode_replica": _stats_ms((waited_until - prefill_end)[landed]),
                       "waiting_for_link": _stats_ms((col("transfer_start_s") - col("landed_s"))[landed]),
                       "transfer": _stats_ms(transfer),
                       "total": _stats_ms((col("transfer_end_s") - prefill_end)[landed])},
        "transfers": {"count": len(sent), "bytes": int(sent.sum()),
                      "mean_bytes": float(sent.mean()) if len(sent) else None,
                      "seconds": float(transfer.sum())},
        "back_pressure": {"requests_that_waited": int(((waited_until - prefill_end)[landed] > 0).sum()),
                          "waiting_peak_blocks": waiting_peak,
                          "waiting_peak_bytes": waiting_peak * block_bytes,
                          "waiting_block_seconds": waiting_integral,
                          "held_peak_blocks": held_peak, "held_block_seconds": held_integral},
    }


def disaggregation_report(sim: DisaggregatedSimulation, result, handoffs: RecordTable) -> dict[str, Any]:
    """disaggregation.json (see the module docstring). Times in ms, sizes in bytes and
    blocks; statistics over the handed-off requests, except `per_gpu`'s (the summary's
    rates over every GPU of both pools)."""
    summary = result.summary or {}
    span = summary.get("duration") or 0.0
    gpus = sim.prefill.gpus + sim.decode.gpus
    stats = handoff_statistics(handoffs, sim.kv_bytes_per_token * sim.config.block_size, span)
    transfers = stats["transfers"]
    seconds = transfers.pop("seconds")
    transfers["link_busy_fraction"] = seconds / (span * sim.prefill.replicas) if span else None
    rate = {key: None if summary.get(key) is None else summary[key] / gpus
            for key in ("request_throughput", "request_goodput", "output_throughput")}
    return {
        "layout": {name: {"replicas": pool.replicas, "gpu": pool.cost.gpu.name, "tp": pool.tp,
                          "gpus": pool.gpus} for name, pool in (("prefill", sim.prefill), ("decode", sim.decode))}
                  | {"gpus": gpus, "kv_link": sim.link.name, "transfer_lanes": sim.lanes,
                     "kv_transfer": sim.config.disaggregation.kv_transfer},
        "requests": {"handed_off": stats["requests"]["handed_off"],
                     "ended_on_prefill_pool": len(result.requests) - len(handoffs),
                     "fit_no_decode_replica": stats["requests"]["fit_no_decode_replica"],
                     "decode_rejections_for_memory": sim.cluster.decode_rejections_for_memory},
        "ttft_ms": stats["ttft_ms"],
        "handoff_ms": stats["handoff_ms"],
        "transfers": transfers,
        "back_pressure": stats["back_pressure"],
        "utilisation": {"prefill": _pool_use(sim.cluster.prefill, span),
                        "decode": _pool_use(sim.cluster.decode, span)},
        "per_gpu": rate,
    }

def describe(outputs: DisaggregationOutputs, output_format: str = "csv") -> str:
    """What `servelab simulate` prints about a disaggregated run's handoffs."""
    r = outputs.report
    wait, transfer = r["handoff_ms"]["waiting_for_decode_replica"], r["handoff_ms"]["transfer"]
    held = r["back_pressure"]
    if not r["transfers"]["count"]:
        return "disaggregated: no request was handed off"
    return (f"disaggregated: {r['transfers']['count']:,} handoffs, {r['transfers']['bytes'] / 1e9:,.1f} GB "
            f"over {r['layout']['kv_link']}; transfer mean {transfer['mean']:.2f} ms, p99 {transfer['p99']:.2f} ms; "
            f"{held['requests_that_waited']:,} waited for a decode replica (mean {wait['mean']:.1f} ms, "
            f"peak {held['waiting_peak_bytes'] / 2**30:.2f} GiB held); "
            f"wrote disaggregation.json, handoffs.{output_format}")


def read_report(out_dir: Path) -> dict[str, Any] | None:
    """A run directory's disaggregation.json, or None for a co-located run."""
    path = Path(out_dir) / "disaggregation.json"
    return json.loads(path.read_text()) if path.exists() else None
