"""The one engine step both executors run.

    output = scheduler.schedule(now)     # pure: who runs how many tokens
    result = executor.execute(output)    # simulated (cost model) or real (model + kernels)
    records = scheduler.update(output, result)

The simulator and the real backend call `engine_step` and nothing else of the
scheduler's step protocol, so they cannot drift apart.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from servelab.outputs import BatchShape, SchedulerOutput, StepResult
from servelab.records import RequestRecord, StepRecord


class Executor(Protocol):
    def execute(self, output: SchedulerOutput) -> StepResult:
        """Perform the swaps, copies and compute of one step; say how long it took."""


class SchedulerLike(Protocol):
    """What the engine step needs of a scheduler (policies.Scheduler implements it)."""

    num_running: int
    num_waiting: int
    num_swapped: int

    def schedule(self, now: float) -> SchedulerOutput: ...
    def update(self, output: SchedulerOutput, result: StepResult) -> list[RequestRecord]: ...
    def pop_records(self) -> list[RequestRecord]: ...


@dataclass(slots=True)
class EngineStep:
    output: SchedulerOutput
    result: StepResult | None
    """None when the step had nothing to execute (the engine is idle)."""
    records: list[RequestRecord]
    """Requests that finished or were rejected in this step."""
    step: StepRecord | None


def engine_step(scheduler, executor: Executor, now: float, kv_blocks_total: int,
                kv_blocks_used) -> EngineStep:
    """Run one step at time `now`. `kv_blocks_used` is a callable giving the blocks in
    use after the step (read lazily, only when a step ran)."""
    output = scheduler.schedule(now)
    if output.is_empty:
        return EngineStep(output, None, scheduler.pop_records(), None)
    result = executor.execute(output)
    records = scheduler.update(output, result)
    shape = result.shape or BatchShape.from_output(output)
    step = StepRecord(  # positional, in field order (see StepRecord)
        now, result.duration_s, shape.num_prefill_tokens, shape.num_decode_seqs,
        shape.num_prefill_seqs, scheduler.num_running, scheduler.num_waiting,
        scheduler.num_swapped, kv_blocks_used(), kv_blocks_total, len(output.preempted), 1,
        shape.prefill_context_sum, shape.prefill_q_context_sum, shape.prefill_q_sq_sum,
        shape.decode_context_sum, shape.num_swap_blocks, shape.num_copy_blocks)
    return EngineStep(output, result, records, step)
