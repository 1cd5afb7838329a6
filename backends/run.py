"""The real engine loop: replay a trace through the shared scheduler on a real model.

    result = run_real(RealRunConfig(model="tiny-llama", device="cpu", trace=trace), "out/")

`run_real` first builds and checks everything — device, model spec, checkpoint, block
pool, scheduler, policy, prompts — and only then creates the run directory and serves, so
bad input fails fast (`RunSetupError`) and leaves nothing behind. The loop is the same
`engine_step` the simulator runs; only the executor differs.

Clocks:

- ``virtual`` (default): time advances by each step's measured duration and jumps over
  idle gaps to the next arrival. Nothing sleeps, the timeline is comparable step for step
  with the simulator's, and the scheduling decisions do not depend on host jitter unless
  an arrival falls inside a step. Scheduler CPU time between steps is not counted.
- ``wall``: real time. Arrivals are released when the wall clock passes them and the loop
  sleeps when idle; the gaps between steps include the scheduler's own CPU time.

The run directory holds the files `servelab simulate` writes: config.json, summary.json,
requests.csv, steps.csv, plus outputs.jsonl (each request's token ids per sample). With
prefix caching, requests.csv says how many prompt tokens each request found cached and how
many of those came from the CPU tier (`kv_offload_gb`), and summary.json the hit rates.
With speculative decoding (`--speculative draft:MODEL` or `ngram`, `backends.speculative`)
it also holds speculation.json: tokens proposed and accepted, in total and per request.
Disaggregated (`--prefill-replicas 1 --decode-replicas 1`, `backends.disaggregated`), a
prefill engine and a decode engine share the model, and the run also writes handoffs.csv
and disaggregation.json, as `servelab simulate` does for a disaggregated run.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import torch

from servelab import __version__
from servelab._validate import check_bounded
from servelab.atomic import atomic_path
from servelab.capacity import SERVELAB_TORCH, kv_capacity_blocks
from servelab.backends.attention import SeqWork
from servelab.backends.clocks import Progress, VirtualClock, WallClock
from servelab.backends.disaggregated import (LINK, RealDisaggregation, DisaggregatedServer,
                                             build_schedulers, check_requests,
                                             decode_cache_config, decode_runner, pool_blocks)
from servelab.backends.executor import RealExecutor, with_prompt_tokens
from servelab.backends.host_pools import check_host_memory, host_tier_blocks
from servelab.backends.model import ModelRunner, sliding_window, check_model_supported
from servelab.backends.sampling import SamplingParams
from servelab.backends.speculative import (AcceptanceCounts, build_proposer, draft_checkpoint,
                                           draft_spec)
from servelab.backends.weights import resolve_device, resolve_dtype
from servelab.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from servelab.engine import Replay, engine_loop, run_to_end
from servelab.host_memory import check_prefix_block_sizes
from servelab.memory.base import BlockUsage
from servelab.models import ModelSpec, load_model_spec
from servelab.options import OUTPUT_FORMATS
from servelab.outdir import check_out_dir
from servelab.outputs import PreemptionMode
from servelab.policies import build_scheduler
from servelab.records import RequestRecord, StepRecord
from servelab.reports import summarize
from servelab.reports.runio import clear_optional_files, write_json, write_records
from servelab.request import Request

__all__ = ["CLOCKS", "RealRunConfig", "RealRunResult", "RunSetupError", "derive_num_gpu_blocks",
           "run_real"]

CONFIG_FORMAT = "servelab.real/1"
CLOCKS = ("virtual", "wall")
CPU_KV_BYTES = 256 * 2**20
"""Default KV pool on a CPU: at most this much, and no more than max_num_seqs sequences of
max_model_len tokens need."""


class RunSetupError(ValueError):
    """The run cannot start as configured (bad device, model, checkpoint, option or trace)."""


@dataclass(frozen=True)
class RealRunConfig:
    """Everything a real run needs; written (resolved) into config.json."""

    model: str | None
    """Catalog name, config.json path or folder; None: the checkpoint's own config."""
    checkpoint: str | None = None
    """Folder of safetensors weights; None: seeded random weights."""
    device: str = "cpu"
    dtype: str | None = None
    """None: bfloat16 on CUDA, float32 on the CPU."""
    use_triton: bool | None = None
    """None: Triton kernels on CUDA, the PyTorch reference on the CPU. Triton on the CPU
    needs TRITON_INTERPRET=1 set before triton is first imported."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: Mapping = field(default_factory=dict)
    """CacheConfig keyword arguments; a missing or None num_gpu_blocks is derived."""
    kv_offload_gb: float = 0.0
    """GiB of host memory for the CPU tier of the prefix cache (`--kv-offload-gb`; 0: none):
    prefix blocks evicted from the device are copied there and loaded back on a hit. Sets
    the cache's num_host_blocks; needs enable_prefix_caching. Pinned when the device is CUDA."""
    policy: str = "fcfs"
    policy_options: Mapping = field(default_factory=dict)
    sampling: SamplingParams = SamplingParams()
    replay: bool = True
    """Ignore EOS and generate each request's trace output length."""
    clock: str = "virtual"
    seed: int = 0
    gpu_memory_utilization: float = 0.9
    trace: object | None = None
    """A `servelab.traces.Trace`, replayed unless run_real is given requests."""
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    save_outputs: bool = True
    warmup: bool = True
    """Run a few throw-away steps first on CUDA, so Triton's JIT is not timed."""
    progress: bool | None = None
    """Progress on stderr: True a bar, False nothing, None a bar on a terminal and a plain
    line every 10 s otherwise."""
    cli_args: Mapping | None = None
    """The command's parsed flags (JSON values), recorded in config.json."""
    output_format: str = "csv"
    """How requests and steps are written: csv or parquet."""
    disaggregation: RealDisaggregation | None = None
    """One prefill engine and one decode engine (`backends.disaggregated`); None: one
    engine serves everything."""

    def __post_init__(self) -> None:
        if self.clock not in CLOCKS:
            raise ValueError(f"RealRunConfig.clock must be one of {CLOCKS}, got {self.clock!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("RealRunConfig.gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}")
        check_bounded("RealRunConfig.seed", self.seed, 0, integer=True)
        if self.model is None and self.checkpoint is None:
            raise ValueError("RealRunConfig needs a model or a checkpoint")
        check_bounded("RealRunConfig.kv_offload_gb", self.kv_offload_gb, 0)
        if self.kv_offload_gb and not self.cache.get("enable_prefix_caching"):
            raise ValueError("RealRunConfig.kv_offload_gb: a CPU tier holds prefix-cache blocks "
                             "and needs enable_prefix_caching (--prefix-caching)")
        if self.kv_offload_gb and self.cache.get("num_host_blocks"):
            raise ValueError("RealRunConfig: give kv_offload_gb or cache num_host_blocks, not both")
        if self.disaggregation is not None:
            if not isinstance(self.disaggregation, RealDisaggregation):
                raise ValueError("RealRunConfig.disaggregation must be a RealDisaggregation or "
                                 f"None, got {self.disaggregation!r}")
            if self.scheduler.speculative.enabled:
                raise ValueError("disaggregated prefill/decode does not run with speculative "
                                 "decoding: drop --speculative or the pool flags")
        if self.output_format not in OUTPUT_FORMATS:
            raise ValueError(f"RealRunConfig.output_format must be one of {OUTPUT_FORMATS}, "
                             f"got {self.output_format!r}")


@dataclass
class RealRunResult:
    summary: dict
    records: list[RequestRecord]
    """One per request, by request id."""
    steps: list[StepRecord]
    outputs: dict[int, list[list[int]]]
    """request_id -> each sample's generated token ids (a rejected request's are empty)."""
    num_gpu_blocks: int
    num_swap_preemptions: int
    num_recompute_preemptions: int
    num_swapped_blocks: int
    num_copied_blocks: int
    num_offloaded_blocks: int
    """Prefix blocks copied from the device to the CPU tier (evicted there)."""
    num_loaded_blocks: int
    """CPU-tier prefix hits copied back to the device."""
    block_usage: BlockUsage
    """The block manager's statistics at the end (prefix queries and hits are cumulative)."""
    config: dict
    """What config.json holds: {"format", "servelab_version", "config", "derived"}."""
    out_dir: Path | None
    speculation: dict | None = None
    """What speculation.json holds (`speculation_summary`); None without speculation."""
    disaggregation: object | None = None
    """Disaggregated: the `DisaggregationOutputs` (handoffs.csv and disaggregation.json of
    `simulator.disaggregated_run`); None otherwise. num_gpu_blocks and block_usage are
    then the prefill engine's."""


# --------------------------------------------------------------------------- setup


@contextlib.contextmanager
def _setup_step() -> Iterator[None]:
    try:
        yield
    except RunSetupError:
        raise
    except ValueError as exc:  # TraceError and the configs' errors are ValueErrors too
        raise RunSetupError(str(exc)) from None


def derive_num_gpu_blocks(spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                          block_size: int, scheduler: SchedulerConfig,
                          gpu_memory_utilization: float = 0.9, draft: ModelSpec | None = None) -> int:
    """KV blocks for a run that did not say: on CUDA, `servelab.capacity.kv_capacity_blocks`
    (the simulator's formula) of the memory CUDA reports, what others already hold, the
    weights and this runner's activation peak (`SERVELAB_TORCH`); on a CPU, at most
    CPU_KV_BYTES and no more than max_num_seqs full-length sequences need. A speculative
    `draft` model keeps a block of its own beside each of the target's, and its weights.
    Raises ValueError when not one block fits."""
    elem = torch.empty((), dtype=dtype).element_size()
    block_bytes = spec.kv_bytes_per_token(elem) * block_size
    weight_bytes = spec.num_params * elem
    if draft is not None:
        block_bytes += draft.kv_bytes_per_token(elem) * block_size
        weight_bytes += draft.num_params * elem
    if device.type != "cuda":
        needed = scheduler.max_num_seqs * -(-scheduler.max_model_len // block_size)
        return max(1, min(CPU_KV_BYTES // block_bytes, needed))
    free, total = torch.cuda.mem_get_info(device)
    reserve = SERVELAB_TORCH.bytes(
        hidden=spec.hidden_size, qkv=(spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim,
        intermediate=spec.intermediate_size, vocab=spec.vocab_size,
        max_num_batched_tokens=scheduler.max_num_batched_tokens, max_num_seqs=scheduler.max_num_seqs)
    return kv_capacity_blocks(memory_bytes=total, gpu_memory_utilization=gpu_memory_utilization,
                              in_use_bytes=total - free, weight_bytes=weight_bytes,
                              reserve_bytes=reserve, block_bytes=block_bytes,
                              where=f"{spec.name} on {device}",
                              hint="pass --kv-blocks or use a smaller model")


WARM_UP_TABLE_WIDTHS = (1, 2, 16, 17, 32, 33, 64, 65)
"""Block-table widths the warm-up visits. Triton compiles a kernel once per specialisation
of its integer arguments (equal to 1, a multiple of 16, or neither: here the table's row
stride and the split count) and of its constexprs (one split or several), so a run meets
new variants as its sequences grow; these widths reach each combination once."""


def warm_up_steps(max_model_len: int, block_size: int) -> list[list[SeqWork]]:
    """The throw-away steps of `_warm_up`: for each table width that fits, decodes of one
    and of two sequences, prefill chunks of 1, 16 and 17 tokens over the rest of the
    table, and a mixed step. Every table points at block 0 only (contents are garbage and
    never read by a real sequence before it writes them)."""
    steps = []
    for width in WARM_UP_TABLE_WIDTHS:
        seq_len = width * block_size
        if seq_len > max_model_len:
            break
        table = [0] * width
        decode = SeqWork([1], seq_len - 1, table, False)
        chunks = [SeqWork([2] * n, seq_len - n, table, True) for n in (1, 16, 17) if n <= seq_len]
        steps += [[decode], [decode, decode], *([c] for c in chunks), [chunks[-1], decode]]
    return steps


def _warm_up(runner: ModelRunner, max_model_len: int) -> None:
    """Throw-away steps before timing starts, so Triton compiles (or loads from its cache)
    the kernel variants a run meets instead of doing it inside a timed step: on an H100/H200
    a compile inside a step made that step about 20x slower (docs/gpu-results.md).

    The steps write block 0; it is put back as it was, so that a NaN-poisoned cache stays
    poisoned and a read of a block nobody wrote still shows (found on the H200, where the
    warm-up runs: tests/test_backend_disaggregated.py saw a decode cache no longer all NaN)."""
    cache = runner.kv_cache
    block_zero = cache.k[:, 0].clone(), cache.v[:, 0].clone()
    for seqs in warm_up_steps(max_model_len, runner.block_size):
        runner.run(seqs)
    cache.k[:, 0].copy_(block_zero[0])
    cache.v[:, 0].copy_(block_zero[1])
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def _versions(device: torch.device) -> dict:
    versions = {"python": platform.python_version()}
    for dist in ("servelab", "torch", "triton", "transformers", "safetensors", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    versions["cuda"] = torch.version.cuda
    if device.type == "cuda":
        versions["device_name"] = torch.cuda.get_device_name(device)
    else:
        versions["device_name"] = platform.processor() or platform.machine()
    return versions


# --------------------------------------------------------------------------- the run


def run_real(config: RealRunConfig, out_dir: str | os.PathLike | None = None, *,
             requests: Sequence[Request] | None = None, force: bool = False) -> RealRunResult:
    """Serve `requests` (default: config.trace's) on the real model and write the run
    directory (unless out_dir is None). Raises RunSetupError before creating anything when
    the run cannot start, or when out_dir holds another run and `force` is off
    (`servelab.outdir`)."""
    with _setup_step():
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
        use_triton = device.type == "cuda" if config.use_triton is None else config.use_triton
        if use_triton and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RunSetupError("Triton kernels on the CPU need TRITON_INTERPRET=1 in the "
                                "environment before triton is imported")
        spec = load_model_spec(config.model if config.model is not None else config.checkpoint)
        check_model_supported(spec)
        sched_cfg = config.scheduler
        speculative = sched_cfg.speculative
        draft = (draft_spec(speculative, spec, sched_cfg.max_model_len)
                 if speculative.enabled else None)
        cache_kwargs = dict(config.cache)
        block_size = cache_kwargs.get("block_size", CacheConfig.block_size)
        num_blocks = cache_kwargs.get("num_gpu_blocks")
        blocks_source = "given" if num_blocks else "derived"
        disagg = config.disaggregation
        if disagg is not None:   # num_blocks: the prefill engine's
            num_blocks, decode_blocks, blocks_source = pool_blocks(
                disagg, num_blocks, lambda: derive_num_gpu_blocks(
                    spec, device, dtype, block_size, sched_cfg, config.gpu_memory_utilization))
        elif not num_blocks:
            num_blocks = derive_num_gpu_blocks(spec, device, dtype, block_size, sched_cfg,
                                               config.gpu_memory_utilization, draft)
        if config.kv_offload_gb:
            cache_kwargs["num_host_blocks"] = host_tier_blocks(config.kv_offload_gb, spec, dtype,
                                                               block_size)
        cache_cfg = CacheConfig(**{**cache_kwargs, "num_gpu_blocks": num_blocks})
        check_host_memory(spec, device, dtype, cache_cfg, config.kv_offload_gb)
        if cache_cfg.enable_prefix_caching and requests is None and config.trace is not None:
            check_prefix_block_sizes(config.trace, block_size)
        if disagg is None:
            scheduler = build_scheduler(sched_cfg, cache_cfg, config.policy,
                                        dict(config.policy_options), emit_block_tables=True,
                                        keep_token_times=True)
        else:
            decode_cache = decode_cache_config(cache_cfg, decode_blocks)
            scheduler, decode_scheduler = build_schedulers(sched_cfg, cache_cfg, decode_cache,
                                                           config.policy, dict(config.policy_options))
        if requests is None:
            if config.trace is None:
                raise RunSetupError("no requests: give RealRunConfig.trace or requests=")
            requests = config.trace.to_requests(seed=config.seed)
        if not requests:
            raise RunSetupError("the trace has no requests")
        if disagg is not None:
            check_requests(requests, num_blocks, decode_blocks, block_size)
        window = sliding_window(spec)
        if window is not None and sched_cfg.max_model_len > window:
            raise RunSetupError(f"max_model_len {sched_cfg.max_model_len} exceeds {spec.name}'s "
                                f"sliding window of {window} tokens; only full attention is "
                                f"implemented: use max_model_len <= {window}")
        live = {r.request_id: with_prompt_tokens(r, spec.vocab_size, config.seed) for r in requests}
        if len(live) != len(requests):
            raise RunSetupError("request ids must be unique")
        eos = spec.hf_config.get("eos_token_id")
        described = _describe(config, spec, device, dtype, use_triton, cache_cfg, blocks_source,
                              scheduler.policy.describe(), eos, len(live), draft)
        if disagg is not None:   # so that co-located configs read as before
            described["config"]["disaggregation"] = disagg.to_dict()
            described["derived"]["disaggregation"] = {
                "prefill": {"kv_blocks": num_blocks}, "decode": {"kv_blocks": decode_blocks},
                "decode_cache": decode_cache.to_dict(), "kv_link": LINK,
                "weights": "shared by both engines"}
        out = Path(out_dir) if out_dir is not None else None
        if out is not None:   # before the model is built: a refusal costs nothing
            check_out_dir(out, described["config"], force=force)

        def make_runner(model: ModelSpec, checkpoint: str | None) -> ModelRunner:
            return ModelRunner(model, device=device, dtype=dtype, num_gpu_blocks=num_blocks,
                               num_cpu_blocks=cache_cfg.num_cpu_blocks,
                               num_host_blocks=cache_cfg.num_host_blocks, block_size=block_size,
                               use_triton=use_triton, checkpoint=checkpoint, seed=config.seed)

        runner = make_runner(spec, config.checkpoint)
        proposer = build_proposer(speculative, draft, make_runner) if speculative.enabled else None
    executor = RealExecutor(runner, live if disagg is None else {}, config.sampling,
                            replay=config.replay, eos_token_id=eos, seed=config.seed,
                            proposer=proposer)
    runners = list(executor.runners)
    if disagg is not None:
        decode_executor = RealExecutor(decode_runner(runner, decode_blocks, cache_cfg.num_cpu_blocks),
                                       {}, config.sampling, replay=config.replay,
                                       eos_token_id=eos, seed=config.seed)
        runners.append(decode_executor.runner)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "config.json", described)

    if config.warmup and device.type == "cuda":
        for warmed in runners:
            _warm_up(warmed, sched_cfg.max_model_len)
    progress = Progress(len(live), config.progress, config.clock)
    clock = WallClock() if config.clock == "wall" else VirtualClock()
    if disagg is None:
        records, steps, preempted = _serve(scheduler, executor, list(live.values()), clock,
                                           progress)
        records.sort(key=lambda r: r.request_id)
        outputs = {rid: [list(s.output_token_ids) for s in req.seqs]
                   for rid, req in sorted(live.items())}
    else:
        server = DisaggregatedServer((scheduler, executor), (decode_scheduler, decode_executor),
                                     list(live.values()), clock, progress, replay=config.replay)
        server.run()
        records, steps, preempted, outputs = (server.records, server.steps, server.preempted,
                                              server.outputs())
    summary = summarize(records, steps, slo_ttft_ms=config.slo_ttft_ms,
                        slo_tpot_ms=config.slo_tpot_ms,
                        tenant_weights=scheduler.policy.tenant_weights)
    disaggregated = server.run_outputs(summary, str(device)) if disagg is not None else None
    speculation = (speculation_summary(speculative, executor.acceptance, sorted(live))
                   if speculative.enabled else None)
    if out is not None:
        clear_optional_files(out)
        write_json(out / "summary.json", summary)
        write_records(out, records, steps, config.output_format)
        if config.save_outputs:
            _write_outputs(out / "outputs.jsonl", outputs)
        if speculation is not None:
            write_json(out / "speculation.json", speculation)
        if disaggregated is not None:
            disaggregated.write(out, config.output_format)
    return RealRunResult(
        summary, records, steps, outputs, num_blocks,
        num_swap_preemptions=preempted[PreemptionMode.SWAP],
        num_recompute_preemptions=preempted[PreemptionMode.RECOMPUTE],
        num_swapped_blocks=sum(s.num_swap_blocks for s in steps),
        num_copied_blocks=sum(s.num_copy_blocks for s in steps),
        num_offloaded_blocks=sum(s.num_offload_blocks for s in steps),
        num_loaded_blocks=sum(s.num_load_blocks for s in steps),
        block_usage=scheduler.bm.usage(), config=described, out_dir=out,
        speculation=speculation, disaggregation=disaggregated)


def _serve(scheduler, executor: RealExecutor, requests: list[Request], clock,
           progress: Progress) -> tuple[list[RequestRecord], list[StepRecord],
                                        dict[PreemptionMode, int]]:
    """The replay loop (the shared engine loop); returns the request records, the step
    records and the number of preemptions by mode."""
    driver = _RealReplay(scheduler, requests, clock, executor, progress)
    run_to_end(engine_loop(scheduler, executor, driver))
    progress.update(len(driver.records), clock.now(), len(driver.steps), scheduler, force=True)
    progress.close()
    return driver.records, driver.steps, driver.preempted


class _RealReplay(Replay):
    """Takes each step's records (releasing their executor state), step records and
    preemptions, and shows progress."""

    def __init__(self, scheduler, requests, clock, executor: RealExecutor,
                 progress: Progress) -> None:
        super().__init__(scheduler, requests, clock)
        self.executor, self.progress = executor, progress
        self.records: list[RequestRecord] = []
        self.steps: list[StepRecord] = []
        self.preempted = dict.fromkeys(PreemptionMode, 0)

    def took(self, step) -> None:
        for record in step.records:
            self.executor.release(record.request_id)
        self.records += step.records
        for _, mode in step.output.preempted:
            self.preempted[mode] += 1
        self.progress.update(len(self.records), step.output.now, len(self.steps), self.scheduler)
        if step.step is not None:
            self.steps.append(step.step)


def _describe(config: RealRunConfig, spec: ModelSpec, device, dtype, use_triton, cache_cfg,
              blocks_source, policy, eos, num_requests, draft: ModelSpec | None) -> dict:
    """config.json: the run's settings as given ("config"), and what the run derived from
    them and from the machine ("derived"), in the simulator's layout."""
    trace = config.trace
    trace_info = {"source": "<requests given in code>"} if trace is None else {
        "source": trace.source, "format": trace.format, "notes": list(trace.notes),
        "num_dropped": trace.num_dropped, "num_clipped": trace.num_clipped}
    given = {
        "backend": "torch", "model": config.model, "checkpoint": config.checkpoint,
        "device": config.device, "dtype": config.dtype, "use_triton": config.use_triton,
        "clock": config.clock, "replay": config.replay,
        "sampling": {"temperature": config.sampling.temperature, "top_k": config.sampling.top_k,
                     "top_p": config.sampling.top_p},
        "seed": config.seed, "scheduler": config.scheduler.to_dict(), "cache": dict(config.cache),
        "policy": config.policy, "policy_options": dict(config.policy_options),
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "slo_ttft_ms": config.slo_ttft_ms, "slo_tpot_ms": config.slo_tpot_ms,
        "cli_args": dict(config.cli_args) if config.cli_args is not None else None,
    }
    if config.kv_offload_gb:   # so that configs without a CPU tier read as before
        given["kv_offload_gb"] = config.kv_offload_gb
    derived = {
        "model": {k: v for k, v in asdict(spec).items() if k != "hf_config"},
        "hf_config": spec.hf_config,
        "weights": "checkpoint" if config.checkpoint is not None
        else f"seeded random (seed {config.seed})",
        "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "use_triton": use_triton, "triton_interpret": use_triton and device.type == "cpu",
        "eos_token_id": None if config.replay else eos,
        "cache": cache_cfg.to_dict(), "kv_blocks": blocks_source, "policy": policy,
        "trace": {**trace_info, "num_requests": num_requests},
        "versions": _versions(device),
    }
    speculative = config.scheduler.speculative
    if speculative.enabled:   # so that configs without speculation read as before
        derived["speculative"] = {"method": speculative.method, "draft": None if draft is None else {
            "model": {k: v for k, v in asdict(draft).items() if k != "hf_config"},
            "weights": "checkpoint" if draft_checkpoint(speculative.draft_model) is not None
            else f"seeded random (seed {config.seed})"}}
    return {"format": CONFIG_FORMAT, "servelab_version": __version__, "config": given,
            "derived": derived}


def speculation_summary(config: SpeculativeConfig, counts: Mapping[int, AcceptanceCounts],
                        request_ids: Sequence[int]) -> dict:
    """speculation.json: the proposer, then decode steps, verify steps (a decode step that
    proposed at least one token), tokens proposed and accepted, in total and per request
    (zeros for one that never decoded). The keys the simulator records in config.json
    (`derived.speculation`) mean the same here."""
    totals = AcceptanceCounts()
    per_request = []
    for rid in request_ids:
        c = counts.get(rid, AcceptanceCounts())
        totals.decode_steps += c.decode_steps
        totals.verify_steps += c.verify_steps
        totals.proposed += c.proposed
        totals.accepted += c.accepted
        per_request.append({"request_id": rid, "decode_steps": c.decode_steps,
                            "verify_steps": c.verify_steps, "proposed": c.proposed,
                            "accepted": c.accepted, "acceptance_rate": c.acceptance_rate})
    decodes, verifies, accepted = totals.decode_steps, totals.verify_steps, totals.accepted
    return {"method": config.method, "draft_model": config.draft_model,
            "num_speculative_tokens": config.num_speculative_tokens,
            "decode_steps": decodes, "verify_steps": verifies, "proposed_tokens": totals.proposed,
            "accepted_tokens": accepted, "acceptance_rate": totals.acceptance_rate,
            "tokens_per_decode_step": (decodes + accepted) / decodes if decodes else None,
            "tokens_per_verify_step": (verifies + accepted) / verifies if verifies else None,
            "requests": per_request}


def _write_outputs(path: Path, outputs: Mapping[int, list[list[int]]]) -> None:
    """One JSON line per request: {"request_id": r, "samples": [[token ids], ...]};
    written atomically, so a crash leaves no half file."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for rid, samples in outputs.items():
            f.write(json.dumps({"request_id": rid, "samples": samples}) + "\n")
