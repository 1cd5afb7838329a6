"""The one engine step both executors run, and the one loop around it.

    output = scheduler.schedule(now)     # pure: who runs how many tokens
    result = executor.execute(output)    # simulated (cost model) or real (model + kernels)
    records = scheduler.update(output, result)

`engine_loop` repeats `engine_step` and hands each step to a driver, which owns the clock:
SimPy's in the simulator, a virtual or wall clock in the real backend and the test harness
(`Replay`). The simulator, the real backend and the harness run this loop and nothing
else of the scheduler's step protocol, so they cannot drift apart.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Protocol, Sequence

from servelab.outputs import BatchShape, SchedulerOutput, StepResult
from servelab.records import RequestRecord, StepRecord
from servelab.request import Request


class Executor(Protocol):
    def execute(self, output: SchedulerOutput) -> StepResult:
        """Perform the swaps, copies and compute of one step; say how long it took."""


class BlockCounts(Protocol):
    """What the engine loop reads of a block manager: the GPU blocks there are and in use
    (memory.BlockManager implements it; the core names only these two)."""

    num_gpu_blocks: int
    num_used_blocks: int


class SchedulerLike(Protocol):
    """What the engine step and loop need of a scheduler (policies.Scheduler implements
    it), and nothing more."""

    num_running: int
    num_waiting: int
    num_swapped: int
    bm: BlockCounts

    def add_request(self, req: Request, now: float) -> bool: ...
    def schedule(self, now: float) -> SchedulerOutput: ...
    def update(self, output: SchedulerOutput, result: StepResult) -> list[RequestRecord]: ...
    def pop_records(self) -> list[RequestRecord]: ...
    def has_unfinished(self) -> bool: ...


@dataclass(slots=True)
class EngineStep:
    output: SchedulerOutput
    result: StepResult | None
    """None when the step had nothing to execute (the engine is idle)."""
    records: list[RequestRecord]
    """Requests that finished or were rejected in this step."""
    step: StepRecord | None


def engine_step(scheduler: SchedulerLike, executor: Executor, now: float, kv_blocks_total: int,
                kv_blocks_used: Callable[[], int]) -> EngineStep:
    """Run one step at time `now`. `kv_blocks_used` is a callable giving the blocks in
    use after the step (read lazily, only when a step ran)."""
    output = scheduler.schedule(now)
    if output.is_empty:
        return EngineStep(output, None, scheduler.pop_records(), None)
    result = executor.execute(output)
    records = scheduler.update(output, result)
    shape = result.shape or BatchShape.from_output(output)
    step = StepRecord.from_shape(
        shape, start_s=now, duration_s=result.duration_s, num_running=scheduler.num_running,
        num_waiting=scheduler.num_waiting, num_swapped=scheduler.num_swapped,
        kv_blocks_used=kv_blocks_used(), kv_blocks_total=kv_blocks_total,
        num_preempted=len(output.preempted))
    return EngineStep(output, result, records, step)


# --------------------------------------------------------------------------- the loop
class EngineDriver(Protocol):
    """What an engine loop needs from its surroundings; each keeps its own clock. What
    `ran`, `finished` and `idle` return, the loop yields (a SimPy driver's events)."""

    def step_time(self) -> float:
        """When the next step starts; requests that arrived by then are in the scheduler."""

    def ran(self, step: EngineStep) -> object | None:
        """A step computed something: take its step record and let its duration pass
        (returning an event to wait on, or None)."""

    def finished(self, step: EngineStep) -> object | None:
        """The step's duration has passed: take its records, and apply what follows it
        (a fast-forward run; returning an event to wait on, or None)."""

    def ran_nothing(self, step: EngineStep) -> None:
        """A step computed nothing (rejections or preemptions only, or an idle engine):
        take its records."""

    def idle(self) -> Iterable | None:
        """Nothing is left to serve: wait for the next arrival (yielding what to wait on,
        if anything), or None when no request will come (the loop ends)."""


def engine_loop(scheduler: SchedulerLike, executor: Executor, driver: EngineDriver) -> Iterator:
    """Engine steps until the driver says no request will come. A step that computed
    nothing while requests remain (it only rejected or preempted) is followed by the
    next at once. A generator: SimPy runs it as a process; `run_to_end` runs it
    without an event loop."""
    bm = scheduler.bm
    total_blocks = bm.num_gpu_blocks

    def used_blocks() -> int:
        return bm.num_used_blocks

    while True:
        step = engine_step(scheduler, executor, driver.step_time(), total_blocks, used_blocks)
        if step.result is not None:
            wait = driver.ran(step)
            if wait is not None:
                yield wait
            wait = driver.finished(step)
            if wait is not None:
                yield wait
            continue
        driver.ran_nothing(step)
        if not scheduler.has_unfinished():
            wait = driver.idle()
            if wait is None:
                return
            yield from wait


def run_to_end(loop: Iterator) -> None:
    """Run an `engine_loop` whose driver yields nothing (no event loop around it)."""
    collections.deque(loop, maxlen=0)


class VirtualClock:
    """Time is the sum of step durations; waiting jumps to the time waited for."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds

    def wait_until(self, t: float) -> None:
        self._now = max(self._now, t)


class Replay:
    """An engine driver without an event loop: `requests` join the scheduler (in arrival
    order, ties by id) when the clock has reached their arrival; a step's duration is
    added to the clock; an idle engine waits for the next arrival, and the loop ends once
    every request has arrived and none is left. Subclasses see each step in `took`
    (before its duration passes) and, if it computed something, in `after`.

    The clock has `now()`, `advance(seconds)` and `wait_until(t)` (VirtualClock, or the
    real backend's wall clock)."""

    def __init__(self, scheduler: SchedulerLike, requests: Sequence[Request], clock) -> None:
        self.scheduler = scheduler
        self.clock = clock
        self.pending = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
        self.next = 0
        """Index of the next request to arrive."""

    def step_time(self) -> float:
        now = self.clock.now()
        pending, scheduler = self.pending, self.scheduler
        while self.next < len(pending) and pending[self.next].arrival_s <= now:
            scheduler.add_request(pending[self.next], now)
            self.next += 1
        return now

    def ran(self, step: EngineStep) -> None:
        self.took(step)
        self.clock.advance(step.result.duration_s)

    def finished(self, step: EngineStep) -> None:
        self.after(step)

    def ran_nothing(self, step: EngineStep) -> None:
        self.took(step)

    def idle(self) -> tuple | None:
        if self.next >= len(self.pending):
            return None
        self.clock.wait_until(self.pending[self.next].arrival_s)
        return ()

    def took(self, step: EngineStep) -> None:
        """Every step, before its duration passes. Default: nothing."""

    def after(self, step: EngineStep) -> None:
        """After a step that computed something has taken its time. Default: nothing."""
