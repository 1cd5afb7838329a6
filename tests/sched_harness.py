"""A fake clock and a fake executor that drive the real scheduler, checking every step:
the simulator's (`simulator/speed` `BatchingScheduler`) or, with `plain=True`, the plain
one the real backend runs (`policies/scheduler.py`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from servelab.config import CacheConfig, SchedulerConfig
from servelab.engine import Replay, VirtualClock, engine_loop, run_to_end
from servelab.outputs import SchedulerOutput, StepResult
from servelab.policies import Scheduler, build_scheduler
from servelab.simulator import speed
from servelab.records import RequestRecord
from servelab.request import Request


class FakeExecutor:
    """Every step takes `step_s` seconds plus `per_token_s` per computed token. With
    `real_tokens`, it draws token ids, and with `stop_every` it stops a sequence early
    (EOS) on some draws: both are functions of the sequence id and its draw count, so
    they do not depend on the order of the step's entries (batched decodes come first)."""

    def __init__(self, step_s: float = 0.01, per_token_s: float = 0.0, real_tokens: bool = False,
                 stop_every: int | None = None):
        self.step_s, self.per_token_s, self.real_tokens = step_s, per_token_s, real_tokens
        self.stop_every = stop_every
        self._draws: dict = {}

    def execute(self, out: SchedulerOutput) -> StepResult:
        tokens = sum(e.num_tokens for e in out.scheduled)
        sampled = None
        stopped = set()
        if self.real_tokens:
            sampled = {}
            for e in out.scheduled:
                if e.num_samples:
                    draws = self._draws[e.seq_id] = self._draws.get(e.seq_id, 0) + 1
                    rid, sample = e.seq_id
                    sampled[e.seq_id] = [10_000_000 + ((rid * 8 + sample + i) * 4096 + draws)
                                         for i in range(e.num_samples)]
                    if self.stop_every and (rid * 7 + sample * 3 + draws) % self.stop_every == 0:
                        stopped.add(e.seq_id)
        return StepResult(self.step_s + self.per_token_s * tokens, sampled, stopped)


@dataclass
class Run:
    scheduler: Scheduler
    outputs: list[SchedulerOutput] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)
    """Request ids in the order they were first scheduled."""
    fast_forwarded: int = 0
    """Steps applied in closed form."""


def make_requests(spec: list[tuple], **common) -> list[Request]:
    """spec rows: (arrival_s, prompt_len, output_len[, dict of extra fields])."""
    reqs = []
    for i, row in enumerate(spec):
        extra = dict(common)
        if len(row) > 3:
            extra.update(row[3])
        reqs.append(Request(i, row[0], row[1], row[2], **extra))
    return reqs


def simulate(requests: list[Request], sched: SchedulerConfig | None = None,
             cache: CacheConfig | None = None, policy="fcfs", policy_options=None,
             executor=None, check_every_step: bool = True, max_steps: int = 20_000,
             on_step=None, on_schedule=None, fast_forward: bool = False,
             batch_decodes: bool = True, plain: bool = False) -> Run:
    """Replay `requests` through a real scheduler with a fake clock. `on_schedule(scheduler,
    output)` runs between schedule() and update(); `on_step` after update(). With
    `fast_forward`, runs of plain decode steps allowed by `decode_run_bound` are applied
    at once (the executor's steps must then take a constant, exactly representable time).
    `batch_decodes=False` makes the scheduler list every decode one by one; `plain=True`
    drives the plain scheduler (no batching, no fast-forward)."""
    sched = sched or SchedulerConfig()
    cache = cache or CacheConfig()
    if plain:
        if fast_forward:
            raise ValueError("the plain scheduler does not fast-forward")
        scheduler = build_scheduler(sched, cache, policy, policy_options)
    else:
        scheduler = speed.build_scheduler(sched, cache, policy, policy_options,
                                          batch_decodes=batch_decodes)
    executor = executor or FakeExecutor()
    if on_schedule is not None:
        executor = _Spy(executor, lambda out: on_schedule(scheduler, out))
    run = Run(scheduler)
    driver = _Checked(run, requests, sched, executor, check_every_step, max_steps, on_step,
                      fast_forward)
    run_to_end(engine_loop(scheduler, executor, driver))
    return run


class _Checked(Replay):
    """The shared engine loop on a virtual clock, checking every step."""

    def __init__(self, run: Run, requests, sched, executor, check_every_step, max_steps,
                 on_step, fast_forward) -> None:
        super().__init__(run.scheduler, requests, VirtualClock())
        self.run, self.sched, self.executor = run, sched, executor
        self.check_every_step, self.on_step, self.fast_forward = check_every_step, on_step, fast_forward
        self.max_steps = self.steps_left = max_steps
        self.seen: set[int] = set()

    def step_time(self) -> float:
        if not self.steps_left:
            raise AssertionError(f"did not finish within {self.max_steps} steps")
        self.steps_left -= 1
        return super().step_time()

    def took(self, step) -> None:
        run, scheduler = self.run, self.scheduler
        run.records.extend(step.records)
        if step.result is None:
            if not step.output.rejected and not step.output.preempted:
                assert not scheduler.has_unfinished() or self.next < len(self.pending), \
                    "idle while work waits"
            return
        run.outputs.append(step.output)
        for e in step.output.scheduled:
            if e.request_id not in self.seen:
                self.seen.add(e.request_id)
                run.admitted.append(e.request_id)
        if self.check_every_step:
            scheduler.bm.check_invariants()
            assert_step_within_limits(step.output, self.sched, scheduler.bm)
        if self.on_step is not None:
            self.on_step(scheduler, step.output)

    def after(self, step) -> None:
        if self.fast_forward:
            _fast_forward(self.scheduler, self.executor, self.clock,
                          self.pending[self.next].arrival_s if self.next < len(self.pending) else None,
                          self.run)


def assert_step_within_limits(out: SchedulerOutput, sched: SchedulerConfig, bm) -> None:
    assert len(out.scheduled) <= sched.max_num_seqs
    assert sum(e.num_tokens for e in out.scheduled) <= sched.max_num_batched_tokens
    assert len({e.seq_id for e in out.scheduled}) == len(out.scheduled)
    assert bm.num_used_blocks <= bm.num_gpu_blocks
    if sched.chunked_prefill is not None:
        assert all(e.num_tokens <= sched.chunked_prefill for e in out.scheduled)


class _Spy:
    def __init__(self, inner, hook):
        self.inner, self.hook = inner, hook

    def execute(self, out):
        self.hook(out)
        return self.inner.execute(out)


def _fast_forward(scheduler, executor, clock, next_arrival, run) -> None:
    step_s = executor.step_s
    now = clock.now()
    limit = 1 << 30
    if next_arrival is not None:
        # step j of the run starts at now + step_s added j times (as the clock adds it)
        # and must start before the arrival
        limit, t = 0, now
        while t < next_arrival:
            limit += 1
            t += step_s
    k = scheduler.decode_run_bound(now, limit)
    if k >= 2:
        scheduler.advance_decodes(k)
        run.fast_forwarded += k
        for _ in range(k):
            clock.advance(step_s)
