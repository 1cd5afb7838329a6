"""Plain per-request and per-step records: what executors emit and reports consume.

Both are flat so that they map one-to-one onto the rows of the requests and steps tables
(`servelab.reports.runio`); a long run keeps them as columns (`servelab.record_table`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from servelab.request import Request, RequestStatus

if TYPE_CHECKING:
    from servelab.outputs import BatchShape


@dataclass(slots=True)
class RequestRecord:
    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    """Output tokens actually produced (per sample; the trace target in replay)."""
    status: str
    """'finished' or 'rejected'."""
    scheduled_s: float | None = None
    """First time the request was scheduled."""
    first_token_s: float | None = None
    finish_s: float | None = None
    """Time of the last token (finished) or of the rejection (rejected)."""
    num_preemptions: int = 0
    tenant: str = "default"
    priority: int = 0
    reject_reason: str = ""
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    n: int = 1
    cached_tokens: int | None = None
    """Prompt tokens served from the prefix cache when the request was first admitted
    (vLLM's name); None when the run kept no prefix cache."""
    cpu_cached_tokens: int | None = None
    """Of `cached_tokens`, those loaded from the CPU tier; None without a prefix cache."""
    token_times: list[float] | None = None
    """Time of every output token of sample 0, when the executor kept them (for ITL)."""

    @classmethod
    def from_request(cls, req: Request) -> RequestRecord:
        """The record of a request that finished or was rejected."""
        finished = req.status is RequestStatus.FINISHED
        return cls(
            request_id=req.request_id, arrival_s=req.arrival_s, prompt_tokens=req.prompt_len,
            output_tokens=req.num_output_tokens if finished else 0,
            status="finished" if finished else "rejected", scheduled_s=req.scheduled_s,
            first_token_s=req.first_token_s, finish_s=req.finish_s,
            num_preemptions=req.num_preemptions, tenant=req.tenant, priority=req.priority,
            reject_reason=req.reject_reason or "", slo_ttft_ms=req.slo_ttft_ms,
            slo_tpot_ms=req.slo_tpot_ms, n=req.n,
            token_times=list(req.token_times) if req.token_times else None,
            cached_tokens=req.cached_tokens, cpu_cached_tokens=req.cpu_cached_tokens)

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_s is None:
            return None
        return (self.first_token_s - self.arrival_s) * 1e3

    @property
    def e2el_ms(self) -> float | None:
        if self.status != "finished" or self.finish_s is None:
            return None
        return (self.finish_s - self.arrival_s) * 1e3

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT); None for one token."""
        if self.status != "finished" or self.output_tokens < 2 or self.first_token_s is None \
                or self.finish_s is None:
            return None
        return (self.finish_s - self.first_token_s) * 1e3 / (self.output_tokens - 1)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass(slots=True)
class StepRecord:
    # Built by `from_shape` (the engine step and the simulator's fast-forward, once per
    # step), which passes the fields positionally: keep this field order, which a test pins.
    start_s: float
    duration_s: float
    """Duration of one step; for a fast-forwarded run, of all `num_steps` together."""
    num_prefill_tokens: int
    num_decode_tokens: int
    num_prefill_seqs: int
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preempted: int = 0
    num_steps: int = 1
    """>1 when the simulator advanced a run of identical decode steps in closed form."""
    prefill_context_sum: int = 0
    prefill_q_context_sum: int = 0
    prefill_q_sq_sum: int = 0
    decode_context_sum: int = 0
    """For a fast-forwarded run: the value at the run's first step."""
    num_swap_blocks: int = 0
    num_copy_blocks: int = 0
    num_offload_blocks: int = 0
    """Prefix blocks copied from the GPU to the CPU tier (evicted there) before the step."""
    num_load_blocks: int = 0
    """Prefix-cache hits copied from the CPU tier to the GPU before the step."""

    @classmethod
    def from_shape(cls, shape: BatchShape, *, start_s: float, duration_s: float,
                   num_running: int, num_waiting: int, num_swapped: int, kv_blocks_used: int,
                   kv_blocks_total: int, num_preempted: int = 0, num_steps: int = 1) -> "StepRecord":
        """The record of a step (or a fast-forwarded run of `num_steps` decode steps) that
        computed the batch `shape` (its token counts, context sums and block moves, one
        decode token per decoding sequence), with the engine's state after it. Callers
        name what they pass; this passes the fields in order, since twenty keywords to the
        constructor cost more than building the record (measure a change here with
        benchmarks/count_instructions.sh)."""
        return cls(start_s, duration_s, shape.num_prefill_tokens, shape.num_decode_seqs,
                   shape.num_prefill_seqs, num_running, num_waiting, num_swapped, kv_blocks_used,
                   kv_blocks_total, num_preempted, num_steps, shape.prefill_context_sum,
                   shape.prefill_q_context_sum, shape.prefill_q_sq_sum, shape.decode_context_sum,
                   shape.num_swap_blocks, shape.num_copy_blocks, shape.num_offload_blocks,
                   shape.num_load_blocks)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
