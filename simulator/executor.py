"""The simulated executor: a step takes the time the roofline cost model says.

It implements the same `Executor` protocol as the real backend (`servelab.engine`), so
the simulator runs the shared `engine_step` unchanged. It produces no tokens
(`StepResult.sampled` is None): the scheduler then counts them and finishes a request
when it reaches its trace `output_len`. Swaps and copy-on-write copies need no data
movement here; their cost is in the step time (`BatchShape.num_swap_blocks`,
`num_copy_blocks`).
"""
from __future__ import annotations

from servelab.outputs import BatchShape, SchedulerOutput, StepResult
from servelab.simulator.cost_model import CostModel


class SimulatedExecutor:
    """`execute(out)` prices the step's `BatchShape`; O(scheduled sequences) per step."""

    __slots__ = ("cost_model",)

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model

    def execute(self, output: SchedulerOutput) -> StepResult:
        shape = BatchShape.from_output(output)
        return StepResult(self.cost_model.step_time(shape), shape=shape)
