"""A whole simulation from one config: the library entry point behind `servelab simulate`.

    config = SimulationConfig(trace="default", model="llama-3.1-8b", gpu="h100-sxm", policy="sjf")
    result = run_simulation(config, out_dir=Path("runs/sjf"))   # or out_dir=None: nothing written
    result.summary["p99_ttft_ms"]

`SimulationConfig` is a frozen dataclass holding everything a run depends on (trace and
how it is loaded, model, GPU, cost-model and memory settings, scheduler, policy, cluster,
SLOs, seed); it round-trips through JSON, and a run directory's config.json reruns the
run exactly:

    python -m servelab.simulator.run RUN_DIR/config.json --out OTHER_DIR

Values a run derives (KV blocks that fit, the cost model's parameters, the trace's
provenance) are written beside the config in config.json under "derived", for people;
loading a config ignores them and derives them again. Nothing here reads the environment
or a clock or keeps state between calls, so runs in one process (a sweep) are independent.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from servelab import __version__
from servelab._validate import check_bounded, check_choice, check_float, check_int, check_known_keys
from servelab.config import CacheConfig, SchedulerConfig
from servelab.record_table import RecordTable
from servelab.engines import engine_names, get_preset
from servelab.simulator.disaggregation import DisaggregationConfig, check_disaggregation
from servelab.simulator.gpus import DTYPE_BYTES
from servelab.simulator.router import ROUTERS
from servelab.traces.formats import trace_format_names

CONFIG_FORMAT = "servelab.simulation/1"
_OWNER = "SimulationConfig"
_DTYPES = tuple(DTYPE_BYTES)
"""Weight and KV-cache dtypes a simulation accepts: every dtype the cost model prices
(fp32 included, which is what the real backend runs on a CPU, so CPU runs replay)."""


@dataclass(frozen=True)
class SimulationConfig:
    # --- workload -----------------------------------------------------------------------
    trace: str = "default"
    """A trace file, a dataset name, or 'default' (the embedded workload)."""
    trace_dir: str | None = None
    """Where named datasets live (None: ~/.cache/servelab/traces)."""
    trace_format: str = "auto"
    on_bad_row: str = "error"
    rate: float | None = None
    """Target mean request rate (req/s): arrivals for length-only tables, a rescaling of
    timed traces, the total rate of 'default'."""
    arrival_cv: float = 1.0
    """Inter-arrival CV of drawn arrivals (length-only tables)."""
    rate_scale: float = 1.0
    """Replay speed: arrival times divided by this (2 = twice the load)."""
    num_requests: int | None = None
    """Keep only the first N requests."""
    seed: int = 0
    """Seeds drawn arrivals, the default workload and per-request sampling seeds."""
    download: bool = True
    """Download a named dataset missing from trace_dir."""
    # --- model, hardware, cost model ----------------------------------------------------
    model: str = "llama-3.1-8b"
    gpu: str = "h100-sxm"
    tp: int = 1
    pp: int = 1
    """Pipeline stages per replica, each on tp GPUs (`simulator/pipeline.py`): a replica
    then has tp × pp GPUs and runs pp virtual engines, one batch in flight each, which
    share its KV blocks, CPU blocks and CPU tier equally."""
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    ep: int = 1
    """Expert parallelism of a mixture-of-experts model: 1, or tp × dp (vLLM's
    --enable-expert-parallel spreads the experts over the TP × DP GPUs of a deployment).
    Above tp, each replica is one of ep / tp data-parallel attention ranks, so `replicas`
    is a multiple of ep / tp (see `cost_model`)."""
    expert_load: str = "balanced"
    """How a MoE layer's tokens spread over its experts: "balanced" or "power-law:ALPHA"."""
    calibration: str | None = None
    """A calibration profile for this GPU (a file, a packaged profile name, or "none" for
    the bare roofline); None: the GPU's packaged profile, fitted to measured kernel times."""
    engine: str | None = None
    """An engine preset (`servelab.engines`: vllm-0.24, ...): its engine version picks the
    packaged profile fitted to kernels measured inside it when `calibration` is None.
    None: the GPU's catalog profile, as before presets (what `servelab` does too). The
    preset's scheduler defaults are not applied here: the CLI resolves them into the
    fields below, which hold every value a run uses."""
    gpu_memory_utilization: float = 0.9
    # --- scheduler and policy -----------------------------------------------------------
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    policy: str = "fcfs"
    policy_options: dict[str, Any] = field(default_factory=dict)
    # --- KV cache -----------------------------------------------------------------------
    block_size: int = 16
    kv_blocks: int | None = None
    """KV capacity per replica in blocks; None derives it from GPU memory like an engine."""
    cpu_kv_blocks: int = 0
    """Swap space per replica in blocks."""
    block_manager: str = "paged"
    prefix_caching: bool = False
    watermark: float = 0.01
    kv_offload_gb: float = 0.0
    """CPU memory per replica, GiB, for a host tier of the prefix cache (0: none): prefix
    blocks evicted from the GPU are kept there and loaded back on a hit. Needs
    prefix_caching; at most the GPU's host memory per GPU × tp, less the swap pool."""
    # --- cluster ------------------------------------------------------------------------
    replicas: int = 1
    router: str = "round-robin"
    # --- metrics and engine -------------------------------------------------------------
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    fast_forward: bool = True
    async_scheduling: bool = False
    """Each engine schedules a step ahead, as vLLM's asynchronous scheduling does: a request
    that arrives while a step runs waits one more step (`simulator/async_scheduling.py`).
    The vLLM presets turn it on (`servelab.engines`); not modelled with pipeline stages."""
    # --- disaggregated prefill/decode (simulator/disaggregation.py) ----------------------
    disaggregation: DisaggregationConfig | None = None
    """A prefill pool and a decode pool joined by a KV link, in place of `replicas`
    co-located replicas; None (the default): co-located."""

    def __post_init__(self) -> None:
        o = _OWNER
        for name in ("trace", "model", "gpu"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{o}.{name} must be a non-empty string, got {value!r}")
        for name in ("trace_dir", "calibration"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{o}.{name} must be a non-empty string or None, got {value!r}")
        if self.engine is not None:
            check_choice(o, "engine", self.engine, tuple(engine_names()))
        check_choice(o, "trace_format", self.trace_format, ("auto", *trace_format_names()))
        check_choice(o, "on_bad_row", self.on_bad_row, ("error", "drop"))
        if self.rate is not None:
            _check_positive("rate", self.rate)
        _check_positive("arrival_cv", self.arrival_cv)
        _check_positive("rate_scale", self.rate_scale)
        if self.num_requests is not None:
            check_int(o, "num_requests", self.num_requests, 1)
        check_int(o, "seed", self.seed, 0)
        check_int(o, "tp", self.tp, 1)
        check_choice(o, "weight_dtype", self.weight_dtype, _DTYPES)
        check_choice(o, "kv_dtype", self.kv_dtype, _DTYPES)
        check_float(o, "gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, lo_open=True)
        if not isinstance(self.scheduler, SchedulerConfig):
            raise ValueError(f"{o}.scheduler must be a SchedulerConfig, got {type(self.scheduler).__name__}")
        check_int(o, "block_size", self.block_size, 1, 1 << 16)
        if self.kv_blocks is not None:
            check_int(o, "kv_blocks", self.kv_blocks, 1)
        check_int(o, "cpu_kv_blocks", self.cpu_kv_blocks, 0)
        from servelab.memory import block_manager_names
        from servelab.policies import preemption_names
        check_choice(o, "block_manager", self.block_manager, block_manager_names())
        check_choice(o, "scheduler.preemption", self.scheduler.preemption, preemption_names())
        check_float(o, "watermark", self.watermark, 0.0, 0.5)
        check_bounded(f"{o}.kv_offload_gb", self.kv_offload_gb, 0)
        if self.kv_offload_gb and not self.prefix_caching:
            raise ValueError(f"{o}.kv_offload_gb: a CPU tier holds prefix-cache blocks and needs "
                             "prefix caching (--prefix-caching)")
        check_int(o, "replicas", self.replicas, 1)
        _check_experts(self)
        _check_pipeline(self)
        check_choice(o, "router", self.router, tuple(ROUTERS))
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        for name in ("download", "prefix_caching", "fast_forward", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{o}.{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.policy_options, dict) or not all(isinstance(k, str) for k in self.policy_options):
            raise ValueError(f"{o}.policy_options must map option names to values, got {self.policy_options!r}")
        try:   # a private, JSON-shaped copy: the config is frozen, and round-trips exactly
            object.__setattr__(self, "policy_options", json.loads(json.dumps(self.policy_options)))
        except (TypeError, ValueError):
            raise ValueError(f"{o}.policy_options must hold JSON values, got {self.policy_options!r}") from None
        from servelab.policies import make_policy
        make_policy(self.policy, **self.policy_options)   # unknown policy or bad options: ValueError
        if self.disaggregation is not None:
            check_disaggregation(self)
        if self.async_scheduling and self.pp > 1:
            raise ValueError(f"{o}.async_scheduling with pipeline stages (pp > 1) is not "
                             "modelled: their virtual engines keep batches in flight their own way")

    @property
    def tenant_weights(self) -> dict[str, float] | None:
        """The tenant shares the policy serves by, which the fairness index is measured
        against (`Policy.tenant_weights`)."""
        from servelab.policies import make_policy
        return make_policy(self.policy, **self.policy_options).tenant_weights

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("kv_offload_gb", "engine", "async_scheduling"):   # so that configs without them read as before
            if not out[name]:
                del out[name]
        for name, default in (("ep", 1), ("expert_load", "balanced"), ("pp", 1)):   # likewise
            if out[name] == default:
                del out[name]
        out["scheduler"] = self.scheduler.to_dict()
        out["policy_options"] = json.loads(json.dumps(self.policy_options))
        if self.disaggregation is None:   # co-located configs read as before
            del out["disaggregation"]
        else:
            out["disaggregation"] = self.disaggregation.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SimulationConfig":
        """The inverse of `to_dict`; absent keys take their defaults, unknown keys are errors."""
        if not isinstance(data, dict):
            raise ValueError(f"a simulation config must be a JSON object, got {type(data).__name__}")
        check_known_keys(data, {f.name for f in fields(cls)}, "unknown simulation config key(s)")
        values = dict(data)
        if "scheduler" in values:
            sched = values["scheduler"]
            if not isinstance(sched, dict):
                raise ValueError(f"'scheduler' must be an object, got {sched!r}")
            check_known_keys(sched, {f.name for f in fields(SchedulerConfig)},
                             "unknown scheduler config key(s)")
            values["scheduler"] = SchedulerConfig(**sched)
        if values.get("disaggregation") is not None:
            values["disaggregation"] = DisaggregationConfig.from_dict(values["disaggregation"])
        return cls(**values)


def _check_pipeline(c: SimulationConfig) -> None:
    """pp is an integer >= 1; pipelined replicas (pp > 1) are co-located, plain-decoding
    and without data-parallel ranks. Whether the model has pp layers is checked when the
    stages are built (`pipeline.stage_layer_ranges`)."""
    check_int(_OWNER, "pp", c.pp, 1)
    if c.pp == 1:
        return
    why = (("speculative decoding", "pipeline stages run plain decoding")
           if c.scheduler.speculative.enabled else
           ("disaggregated prefill/decode pools", "pipeline stages run in co-located replicas")
           if c.disaggregation is not None else
           (f"data-parallel expert parallelism (ep={c.ep} above tp={c.tp})",
            "pipeline stages run without data-parallel ranks") if c.ep > c.tp else None)
    if why is not None:
        raise ValueError(f"{_OWNER}.pp {c.pp} with {why[0]} is not modelled: {why[1]}")


def _check_experts(c: SimulationConfig) -> None:
    """ep is 1 or a multiple of tp whose data-parallel ranks (ep / tp) the replicas fill;
    the expert load parses. Whether the model has experts to spread is the cost model's
    check (build time)."""
    from servelab.simulator.kernels.moe import parse_expert_load

    check_int(_OWNER, "ep", c.ep, 1)
    if c.ep > 1 and c.ep % c.tp:
        raise ValueError(f"{_OWNER}.ep {c.ep} must be a multiple of {_OWNER}.tp {c.tp}: vLLM "
                         "spreads the experts over the TP × DP GPUs of a deployment")
    dp = c.ep // c.tp
    if dp > 1 and c.replicas % dp:
        raise ValueError(f"{_OWNER}.replicas={c.replicas} must be a multiple of ep / tp = {dp}: "
                         f"each replica is one of the {dp} data-parallel ranks of an ep={c.ep} "
                         "deployment")
    if not isinstance(c.expert_load, str):
        raise ValueError(f"{_OWNER}.expert_load must be a string, got {c.expert_load!r}")
    parse_expert_load(c.expert_load)


def _check_positive(name: str, value: Any) -> None:
    check_bounded(f"{_OWNER}.{name}", value, 0, lo_open=True)


def load_config(path: str | Path) -> SimulationConfig:
    """A config from a run directory's config.json (its "derived" part is ignored: a run
    derives it again) or from a bare `SimulationConfig.to_dict()` JSON object."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if isinstance(data, dict) and "format" in data:
        if data["format"] != CONFIG_FORMAT:
            raise ValueError(f"{path}: format {data['format']!r} is not {CONFIG_FORMAT!r}")
        data = data.get("config")
    try:
        return SimulationConfig.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None


# --------------------------------------------------------------------------- building a run
@contextlib.contextmanager
def _gc_paused():
    """Pause Python's cyclic garbage collector. Loading a trace and simulating create
    millions of long-lived, acyclic objects (requests, records, block tables), and the
    collector's passes over them cost 3-5 % of a run; the few cycles made meanwhile
    (hundreds per 10,000 requests) are collected when it resumes. Nested pauses and
    an already disabled collector are left as they were."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@dataclass(frozen=True)
class SimulationResult:
    config: SimulationConfig
    requests: RecordTable
    """One record per request, by request id (a Sequence of `RequestRecord`, held as
    columns)."""
    steps: RecordTable
    """Every replica's steps by start time (a Sequence of `StepRecord`, held as columns)."""
    summary: dict[str, Any] | None
    """`reports.metrics.summarize` of the records (None only in a `RunCheckError`'s result,
    when the records could not be summarised)."""
    derived: dict[str, Any]
    """What the run derived from the config (KV blocks, cost model, trace provenance)."""
    out_dir: Path | None = None
    disaggregation: Any = None
    """A disaggregated run's handoffs and their report (`DisaggregationOutputs`,
    simulator/disaggregated_run.py); None for a co-located run."""


class RunCheckError(ValueError):
    """A simulation ran to the end, but what it produced fails a check made afterwards (an
    engine stopped with work left, or records that `summarize` refuses): a bug in servelab,
    not in the inputs. `result` holds what was simulated, its summary None when it could
    not be computed; `run_simulation` writes it before raising. Across processes (a sweep's
    workers) only the message travels: `result` is None there."""

    def __init__(self, message: str, result: SimulationResult | None = None) -> None:
        super().__init__(message)
        self.result = result

    def __reduce__(self):
        return type(self), self.args   # pickled without the records


class Simulation:
    """A built, not yet run, simulation: `build_simulation` does everything that can fail
    on user input (trace, model, GPU, capacity), so `run` fails only on a bug."""

    def __init__(self, config: SimulationConfig) -> None:
        from servelab.host_memory import check_host_memory, check_prefix_block_sizes, host_tier_blocks
        from servelab.models import load_model_spec
        from servelab.simulator.cost_model import CostModel
        from servelab.simulator.engine import Cluster
        from servelab.simulator.calibration import resolve
        from servelab.simulator.speed import build_scheduler
        from servelab.simulator.footprint import kv_capacity_blocks
        from servelab.simulator.gpus import get_gpu
        from servelab.simulator.router import make_router

        self.config = c = config
        with _gc_paused():
            trace = load_workload(c)
        model = load_model_spec(c.model)
        gpu = get_gpu(c.gpu)
        engine_version = get_preset(c.engine).engine_version if c.engine else None
        profile = resolve(gpu, c.calibration, engine_version=engine_version)
        self.profile_name, self.profile_line = _profile_choice(gpu, c.calibration, engine_version)
        cost = CostModel(model, gpu, tp=c.tp, weight_dtype=c.weight_dtype,
                         kv_dtype=c.kv_dtype, calibration=profile, block_size=c.block_size,
                         ep=c.ep, expert_load=c.expert_load)
        self.cost_model = cost
        sched = c.scheduler
        if sched.speculative.enabled:
            from servelab.simulator.speculation import proposer_spec
            proposer = proposer_spec(sched.speculative, model)
        else:
            proposer = None
        self.pipeline = self.stage_kv_blocks = None
        if c.pp > 1:   # pipeline stages, pp virtual engines per replica (simulator/pipeline.py)
            from servelab.simulator.pipeline import PipelineLayout
            self.pipeline = PipelineLayout(model, cost, c.pp)
            if c.kv_blocks is None:   # the engine's capacity is its smallest stage's
                self.stage_kv_blocks = self.pipeline.stage_kv_blocks(
                    c.gpu_memory_utilization, sched.max_num_batched_tokens, sched.max_num_seqs)
        self.kv_blocks = c.kv_blocks if c.kv_blocks is not None else \
            min(self.stage_kv_blocks) if self.stage_kv_blocks is not None else kv_capacity_blocks(
            model, cost.gpu, tp=c.tp, block_size=c.block_size,
            gpu_memory_utilization=c.gpu_memory_utilization, kv_dtype=c.kv_dtype,
            weight_dtype=c.weight_dtype, max_num_batched_tokens=sched.max_num_batched_tokens,
            max_num_seqs=sched.max_num_seqs, ep=c.ep,
            **({"proposer": proposer} if proposer is not None else {}))
        _check_some_request_fits(trace, self.kv_blocks // c.pp, c.block_size, given=c.kv_blocks is not None)
        if c.prefix_caching:
            check_prefix_block_sizes(trace, c.block_size)
        replica_block_bytes = cost.block_bytes * c.tp
        self.host_blocks = host_tier_blocks(c.kv_offload_gb, replica_block_bytes)
        check_host_memory(cost.gpu, c.tp * c.pp, c.kv_offload_gb, c.cpu_kv_blocks * replica_block_bytes)
        # a pipelined replica's virtual engines each get 1/pp of its blocks, as vLLM V0's did
        cache = CacheConfig(block_size=c.block_size, num_gpu_blocks=self.kv_blocks // c.pp,
                            num_cpu_blocks=c.cpu_kv_blocks // c.pp, watermark=c.watermark,
                            enable_prefix_caching=c.prefix_caching, block_manager=c.block_manager,
                            num_host_blocks=self.host_blocks // c.pp)
        schedulers = [build_scheduler(sched, cache, c.policy, c.policy_options)
                      for _ in range(c.replicas * c.pp)]
        self.speculators = self._speculators(trace, model, cost) if sched.speculative.enabled else None
        with _gc_paused():
            requests = trace.requests(c.seed)
        # The trace's records are not kept: its requests, as columns, carry what the run
        # needs; each is made as it arrives (a million records, or requests made up front,
        # would hold a few hundred MB through the run).
        self.num_requests = len(trace)
        self.trace_provenance = trace_provenance(trace)
        del trace
        if self.pipeline is not None:
            from servelab.simulator.pipeline import PipelinedCluster
            self.cluster = PipelinedCluster(schedulers, self.pipeline, make_router(c.router, c.replicas),
                                            requests)
            return
        # the data-parallel ranks of a mixture-of-experts deployment step in lock-step
        self.cluster = Cluster(schedulers, cost, make_router(c.router, c.replicas), requests,
                               fast_forward=c.fast_forward, executors=self.speculators,
                               lock_step_ranks=cost.data_parallel_ranks,
                               async_scheduling=c.async_scheduling)

    def _speculators(self, trace, model, cost) -> list:
        """One speculating executor per replica (`simulator/speculation.py`), with each
        request's acceptance rate (its tenant's where one is given)."""
        from servelab.simulator.cost_model import CostModel
        from servelab.simulator.speculation import SpeculativeExecutor, proposer_spec

        c, spec = self.config, self.config.scheduler.speculative
        proposer = proposer_spec(spec, model)
        proposer_cost = None if proposer is None else CostModel(
            proposer, cost.catalog_gpu, tp=c.tp, weight_dtype=c.weight_dtype, kv_dtype=c.kv_dtype,
            calibration=cost.profile, block_size=c.block_size)
        tenants = dict(spec.tenant_acceptance)
        acceptance = {i: tenants[r.tenant] for i, r in enumerate(trace.records) if r.tenant in tenants}
        return [SpeculativeExecutor(cost, spec, c.seed, acceptance, proposer_cost) for _ in range(c.replicas)]

    def derived(self) -> dict[str, Any]:
        cost = self.cost_model
        tier = {"cpu_tier_blocks_per_replica": self.host_blocks} if self.host_blocks else {}
        return {
            "kv_blocks_per_replica": self.kv_blocks, **tier,
            "kv_blocks_source": "configured (kv_blocks)" if self.config.kv_blocks is not None else
                                "derived from GPU memory",
            "cost_model": {"model": cost.model.name, "gpu": cost.gpu.name, "tp": cost.tp,
                           "engine": self.config.engine or "servelab",
                           "calibration": self.profile_name,
                           "calibration_source": self.profile_line,
                           "calibration_device": cost.profile.device,
                           "calibration_engine_version": cost.profile.engine_version,
                           "step_overhead_s": cost.step_overhead_s,
                           "scales": dict(cost.scales),
                           "kernels": _kernels_used(cost)},
            "trace": self.trace_provenance,
            **({"speculation": self._speculation_stats()} if self.speculators else {}),
            **({"pipeline": self._pipeline_stats()} if self.pipeline is not None else {}),
            **({"data_parallel": self._lock_step_stats()} if getattr(self.cluster, "groups", None)
               else {}),
        }

    def _lock_step_stats(self) -> dict:
        """The lock-step groups of a data-parallel MoE deployment (`simulator/data_parallel.py`)
        and the dummy forward passes each rank ran while a peer had work."""
        groups = self.cluster.groups
        return {"groups": len(groups), "ranks_per_group": len(groups[0].ranks),
                "dummy_steps_per_rank": [n for g in groups for n in g.dummy_steps]}

    def _pipeline_stats(self) -> dict:
        """A pipelined replica's stages, links, KV per stage and virtual engine, and how busy
        each stage was (`simulator/pipeline.py`)."""
        pp = self.config.pp
        return {**self.pipeline.describe(), "virtual_engines": pp,
                "kv_blocks_per_stage": self.stage_kv_blocks,
                "kv_blocks_per_virtual_engine": self.kv_blocks // pp, **self.cluster.stats()}

    def _speculation_stats(self) -> dict:
        """Acceptance over every replica's verify steps, and per request."""
        from servelab.simulator.speculation import SpeculationStats

        total = SpeculationStats()
        for executor in self.speculators:
            for mine, theirs in ((total.steps, executor.stats.steps), (total.proposed, executor.stats.proposed),
                                 (total.accepted, executor.stats.accepted)):
                mine.update(theirs)
        spec = self.config.scheduler.speculative
        return {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
                **total.to_dict()}

    def run(self, progress=None) -> SimulationResult:
        """Simulate to the end; `progress(sim_s, done, total)` is called now and then.
        Raises RunCheckError, holding the records, if a check after the simulation fails."""
        from servelab.reports.metrics import summarize
        from servelab.simulator.engine import EngineStalled

        cluster, c = self.cluster, self.config
        problem = summary = None
        with _gc_paused():
            try:
                cluster.run(progress)
            except EngineStalled as exc:
                problem = str(exc)
            requests, steps = cluster.request_records(), cluster.step_records()
            try:
                summary = summarize(requests, steps, slo_ttft_ms=c.slo_ttft_ms,
                                    slo_tpot_ms=c.slo_tpot_ms, tenant_weights=c.tenant_weights)
            except ValueError as exc:
                problem = problem or str(exc)
        derived = self.derived()
        if summary is not None:
            summary = {**priced_by(derived), **summary}
        result = SimulationResult(c, requests, steps, summary, derived)
        if problem is not None:
            raise RunCheckError(problem, result)
        return result


def priced_by(derived: dict[str, Any]) -> dict[str, Any]:
    """The engine preset and calibration profile of a run, for the head of summary.json,
    named as config.json's `derived` names them: `engine` ("servelab" without a preset),
    `profile` (`cost_model.calibration`) and `profile_engine_version` (the vLLM version
    its kernels were measured inside; None for the bare roofline). A disaggregated run
    names each pool's profile: `profile` is {"prefill": ..., "decode": ...}."""
    pools = derived.get("disaggregation")
    if pools is not None:
        return {"engine": derived["engine"],
                "profile": {name: pools[name]["cost_model"]["calibration"] for name in ("prefill", "decode")}}
    cost = derived["cost_model"]
    return {"engine": cost["engine"], "profile": cost["calibration"],
            "profile_engine_version": cost["calibration_engine_version"]}


def trace_provenance(trace) -> dict[str, Any]:
    """Where a run's requests came from, for config.json's `derived.trace`."""
    return {"source": trace.source, "format": trace.format, "requests": len(trace),
            "dropped_rows": trace.num_dropped, "clipped_requests": trace.num_clipped,
            "notes": list(trace.notes)}


def _kernels_used(cost) -> dict:
    """The kernel parameters that price this model's steps: the mixture-of-experts and
    latent-attention families only for models that have them."""
    unused = set()
    if cost.model.moe is None:
        unused |= {"moe", "moe_fp8", "alltoall"}
    if cost.model.mla is None:
        unused |= {"mla_prefill", "mla_decode"}
    return {name: params for name, params in cost.kernels.to_dict().items() if name not in unused}


def _profile_choice(gpu, calibration: str | None, engine_version: str | None) -> tuple[str, str]:
    """The name of the profile that prices a run, and one line saying why it is that one."""
    from servelab.simulator.calibration import packaged_choice, same_profile

    if calibration is not None:
        shown = "the bare roofline" if calibration == "none" else calibration
        if engine_version is not None and calibration != "none":
            name, why = packaged_choice(gpu, engine_version)
            if same_profile(calibration, name):   # the engine's own choice, named
                return calibration, f"{shown}, as given (--calibration): {why}"
        return calibration, f"{shown}, as given (--calibration)"
    if engine_version is not None:
        return packaged_choice(gpu, engine_version)
    return gpu.calibration or "none", f"{gpu.calibration or 'none'}: {gpu.name}'s catalog profile"


def _check_some_request_fits(trace, kv_blocks: int, block_size: int, given: bool = False) -> None:
    """Refuse a run in which no request can ever finish: each needs KV slots for its prompt
    and all its output but the last token, alone in the cache at best. (A run that passes
    may still reject every request, e.g. under contiguous reservations: the command says so
    after the run.) `given`: the block count was set (--kv-blocks, vLLM's
    --num-gpu-blocks-override), not derived from memory, which the hint then leaves out."""
    capacity = kv_blocks * block_size
    need = min(r.prompt_tokens + max(r.output_tokens, 1) - 1 for r in trace.records)
    if need > capacity:
        hint = ("give more --kv-blocks (--num-gpu-blocks-override in --vllm-args)" if given else
                "give --kv-blocks, a larger --gpu-memory-utilization or a larger GPU")
        raise ValueError(f"KV cache of {kv_blocks:,} blocks ({capacity:,} tokens) cannot hold any request: "
                         f"the smallest needs {need:,} tokens (prompt + output); {hint}")


def check_layout(config: SimulationConfig) -> None:
    """ValueError if the model cannot be laid out as the config says (tp not dividing its
    heads or widths, ep not dividing its experts, dtypes it cannot take): the shape checks
    of `build_simulation`, without the trace or the GPU (what a sweep checks once per
    layout before it starts)."""
    from servelab.models import load_model_spec
    from servelab.simulator.footprint import Footprint

    model = load_model_spec(config.model)
    Footprint.of(model, config.tp, config.weight_dtype, config.kv_dtype, ep=config.ep)
    if config.pp > model.num_layers:   # as PipelineLayout refuses it
        raise ValueError(f"pp={config.pp} exceeds {model.name}'s {model.num_layers} layers: every "
                         f"pipeline stage needs one at least (pp <= {model.num_layers})")


def check_host_tier(config: SimulationConfig) -> None:
    """ValueError if the config's CPU tier holds no block, or it and the swap pool need
    more host memory than its machine has: the host-memory checks of `build_simulation`,
    without the trace (what a sweep checks once per machine before it starts)."""
    from servelab.host_memory import check_host_memory, host_tier_blocks
    from servelab.models import load_model_spec
    from servelab.simulator.cost_model import CostModel
    from servelab.simulator.gpus import get_gpu

    c = config
    if not (c.kv_offload_gb or c.cpu_kv_blocks):
        return
    cost = CostModel(load_model_spec(c.model), get_gpu(c.gpu), tp=c.tp, weight_dtype=c.weight_dtype,
                     kv_dtype=c.kv_dtype, calibration=c.calibration, block_size=c.block_size,
                     ep=c.ep, expert_load=c.expert_load)
    if c.kv_offload_gb:
        host_tier_blocks(c.kv_offload_gb, cost.block_bytes * c.tp)
    # a replica's blocks span its tp x pp GPUs, as `build_simulation` counts them
    check_host_memory(cost.gpu, c.tp * c.pp, c.kv_offload_gb,
                      c.cpu_kv_blocks * cost.block_bytes * c.tp)


def build_simulation(config: SimulationConfig) -> Simulation:
    """Load the trace, model and GPU, derive the KV capacity and wire the replicas.
    Raises ValueError (TraceError included) on anything wrong with the inputs."""
    if config.disaggregation is not None:   # a prefill and a decode pool
        from servelab.simulator.disaggregated_run import DisaggregatedSimulation
        return DisaggregatedSimulation(config)
    return Simulation(config)


def load_workload(config: SimulationConfig):
    """The trace a config names, cut to num_requests (before a timed trace is rescaled to
    `rate`: the requests replayed arrive at that rate) and replayed at rate_scale."""
    from servelab.traces.datasets import resolve_trace
    from servelab.traces.record import TraceError
    from servelab.traces.transforms import scale_rate

    c = config
    trace = resolve_trace(c.trace, trace_dir=c.trace_dir, rate=c.rate,
                          cv=c.arrival_cv, seed=c.seed, on_bad_row=c.on_bad_row,
                          format=c.trace_format, download=c.download,
                          num_requests=c.num_requests)
    if c.rate_scale != 1.0:
        trace = scale_rate(trace, c.rate_scale)
    if not len(trace):
        raise TraceError(f"trace {c.trace!r} holds no requests to simulate")
    return trace


def run_simulation(config: SimulationConfig, out_dir: Path | None = None,
                   progress=None, output_format: str = "csv") -> SimulationResult:
    """Build and run one simulation; with `out_dir`, write its run directory there
    (config.json, summary.json, requests and steps as `output_format`: csv or parquet).
    A RunCheckError is raised after its records are written."""
    sim = build_simulation(config)
    try:
        result = sim.run(progress)
    except RunCheckError as exc:
        if out_dir is not None:
            write_run_dir(exc.result, Path(out_dir), output_format)
        raise
    if out_dir is not None:
        write_run_dir(result, Path(out_dir), output_format)
        result = dataclasses.replace(result, out_dir=Path(out_dir))
    return result


def write_run_dir(result: SimulationResult, out_dir: Path, output_format: str = "csv",
                  check=None) -> None:
    """config.json, summary.json (unless the result has none: a stale one goes), requests
    and steps (.csv or .parquet), moved into `out_dir` together (`outdir.staged_run_dir`:
    an earlier run's files are replaced as a whole, never mixed with these; `check(out_dir)`
    runs just before, under the directory's lock)."""
    from servelab.outdir import staged_run_dir
    from servelab.reports.runio import RUN_FILES, write_json, write_records

    with staged_run_dir(out_dir, RUN_FILES, check) as staging:
        write_json(staging / "config.json", {"format": CONFIG_FORMAT, "servelab_version": __version__,
                                             "config": result.config.to_dict(),
                                             "derived": result.derived})
        if result.summary is not None:
            write_json(staging / "summary.json", result.summary)
        write_records(staging, result.requests, result.steps, output_format)
        if result.disaggregation is not None:   # disaggregation.json, handoffs.<format>
            result.disaggregation.write(staging, output_format)


def main(argv: list[str] | None = None) -> int:
    """`python -m servelab.simulator.run CONFIG --out DIR [--output-format F]`: rerun a run
    directory's config."""
    from servelab.options import add_output_options

    parser = argparse.ArgumentParser(prog="python -m servelab.simulator.run",
                                     description="Rerun a simulation from its config.json.")
    parser.add_argument("config", help="a run directory's config.json")
    parser.add_argument("--out", required=True, help="run directory to write")
    parser.add_argument("--force", action="store_true",
                        help="replace what --out holds, even another run")
    add_output_options(parser)
    args = parser.parse_args(argv)
    try:
        from servelab.outdir import OutDirTaken, check_out_dir

        config = load_config(args.config)
        check_out_dir(Path(args.out), config.to_dict(), force=args.force)
        sim = build_simulation(config)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        result, problem = sim.run(), None
    except RunCheckError as exc:
        result, problem = exc.result, exc
    try:
        write_run_dir(result, Path(args.out), args.output_format,
                      check=lambda d: check_out_dir(d, config.to_dict(), force=args.force))
    except OutDirTaken as exc:   # another command wrote --out while this one ran
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if problem is not None:
        print(f"error: {describe_check_failure(problem, args.out)}", file=sys.stderr)
        return 1
    return 0


def describe_check_failure(exc: RunCheckError, out_dir: Path | str) -> str:
    """One line for a run whose records failed a check after the simulation, once they are
    written to out_dir."""
    summary = "" if exc.result.summary is None else "summary.json, "
    return (f"{exc} (a check after the simulation failed: a bug in servelab, please report it; "
            f"the simulated records are in {out_dir}: config.json, {summary}requests and steps)")


if __name__ == "__main__":
    sys.exit(main())
