"""The data-parallel ranks of one expert-parallel deployment, stepping in lock-step.

A mixture-of-experts model served with data-parallel attention and expert parallelism
(vLLM's `--data-parallel-size N --enable-expert-parallel`, servelab's `--dp N`) runs one
engine per DP rank, each with its own scheduler and KV cache, but the ranks are not
independent: every MoE layer exchanges tokens between them, so their forward passes
must be aligned. What vLLM does, and this group models:

- Every rank runs a forward pass every step, together. "Forward passes must be aligned,
  and expert layers across all ranks are required to synchronize during every forward
  pass, even when there are fewer requests to be processed than DP ranks"; a rank with
  nothing scheduled runs an empty "dummy" forward pass while any rank has requests
  (docs.vllm.ai serving/data_parallel_deployment). In the source:
  `vllm/v1/engine/core.py::DPEngineCoreProc.run_busy_loop` calls `execute_dummy_batch`
  when its step executed nothing but the engines are running, and
  `_has_global_unfinished_reqs` all-reduces "unfinished requests anywhere" across the DP
  group to decide whether the ranks keep stepping; `vllm/v1/worker/gpu_worker.py::
  Worker.execute_dummy_batch` runs `GPUModelRunner._dummy_run(1)`, a 1-token forward.
- A step lasts as long as its slowest rank's: the MoE layers' collectives wait for every
  rank, so no rank starts its next step before the slowest has finished this one.
- The MoE layers run over the tokens all ranks carry: vLLM's default
  `allgather_reducescatter` all2all backend gathers every rank's tokens before the
  experts and reduce-scatters after (docs.vllm.ai serving/expert_parallel_deployment).
  Attention, the dense GEMMs, the LM head and the sampler run per rank over its own batch.

So each group step at time t: every rank's scheduler schedules its own batch at t
(unchanged); each working rank's executor prices its step (`CostModel.step_time`, the
MoE layers as if the peers carried as many tokens), corrected to the MoE layers over
the group's tokens (`CostModel.lockstep_correction`); an idle rank runs a dummy step
(`CostModel.dummy_step_time`, its one token counted in the group's); the step ends for
every rank at t + the largest price, and every working rank's scheduler is updated with
that duration through the shared `servelab.engine.engine_step`. While no rank has work
the group sleeps until an arrival to any of its ranks (no events). The ranks really wait
for each other at every MoE layer, not once per step; but a rank's batch is the same in
every layer, so the same rank is the slowest in each, and the largest whole-step price is
the sum of the per-layer waits (up to the LM head and sampler after the last layer). A
dummy step never outlasts a working rank's (the same overhead and layers over fewer
tokens, no attention or LM head): the group's step is its slowest working rank's.

Not modelled: vLLM checks "unfinished anywhere" only every 32 steps, so after the last
request of a busy period the ranks run up to 31 more dummy steps, which an arrival in
that window waits behind (a few ms); and vLLM pads every rank's batch to the largest
rank's token count when the step runs a CUDA graph on every rank
(`vllm/v1/worker/dp_utils.py::coordinate_batch_across_dp`; since vllm-project/vllm#34102,
Feb 2026, only then: a rank above `max_cudagraph_capture_size` tokens, min(2 x
max_num_seqs, 512) by default, runs without graphs and nobody pads), which this group
does not (each rank is priced at its own tokens; the MoE layers at the group's sum).
Tried on the recorded Qwen3-30B-A3B DP2 run (docs/real-runs.md): padding below a capture
size of 256 moved its TTFT MAPE from 15.2% to 15.5% and left TPOT at 5.1%; padding every
step, as vLLM did before that change, gave 26.9%.

Also not modelled: ranks carrying unequal token counts exchange them unevenly. vLLM's
`all_gatherv` / `reduce_scatterv` of unequal sizes are one NCCL broadcast from (reduce
to) each rank, grouped (`vllm/distributed/device_communicators/pynccl.py`), so the link
into (out of) the least loaded rank carries every other rank's tokens: at dp = 2 the
larger rank's tokens, where the exchange here is priced as an even one of the group's
total (half of it each way). Tried on the same run, pricing the exchange by that busiest
link: TPOT MAPE 5.5% -> 2.3%, E2E 5.8% -> 2.1%, the TTFT mean error -22.9% -> +2.7%, but
the TTFT MAPE 15.7% -> 19.2%, and requests that arrive to a lightly loaded group, whose
TTFT is one lone prefill step while the peer decodes a few sequences, went from close to
too slow (1,354 tokens: real 74 ms, priced 79 ms, with it 96 ms; 1,423: 80, 88, 106):
those steps are already priced slower than the engine runs them, so a dearer exchange is
not what the loaded steps lack.

Fast-forward. After a group step, if every rank is either idle or certain to run plain
decode steps (`Scheduler.decode_run_bound` >= 2), the group advances the run of steps
at once: step j of rank r costs fixed_r + max(a_r + b_r·j, c_r + d_r·j)
(`CostModel.decode_run_lines`, its MoE layers corrected to the group's tokens, which a
run does not change), the group's step the largest of them, evaluated for every step of
the run with numpy (O(run length), not closed form as for a lone replica). The run is
cut at the next arrival to any rank, as a replica's is, and each working rank writes
one steps.csv row for it. The scheduler state and every record come out as if the steps
had run one by one (`fast_forward=False`; a test compares the two), up to float rounding
of the summed step times.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Sequence

import numpy as np
from simpy import Environment
from simpy.events import Event

from servelab.engine import EngineStep, engine_step
from servelab.outputs import BatchShape, SchedulerOutput, StepResult
from servelab.simulator.cost_model import CostModel

MAX_RUN_STEPS = 1 << 31
"""Upper bound passed to `decode_run_bound`: runs are limited by the requests."""


class _Planned:
    """A rank's scheduler whose next `schedule` returns the output already planned for
    this step: the group schedules every rank first (a rank's step time depends on its
    peers' batches), then runs each rank's `engine_step` on its plan."""

    __slots__ = ("scheduler", "output")

    def __init__(self, scheduler, output: SchedulerOutput) -> None:
        self.scheduler, self.output = scheduler, output

    def schedule(self, now: float) -> SchedulerOutput:
        return self.output

    def update(self, output: SchedulerOutput, result: StepResult):
        return self.scheduler.update(output, result)

    def pop_records(self):
        return self.scheduler.pop_records()

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_swapped(self) -> int:
        return self.scheduler.num_swapped


class _Executed:
    """An executor whose step was already priced: the group's duration."""

    __slots__ = ("result",)

    def __init__(self, result: StepResult) -> None:
        self.result = result

    def execute(self, output: SchedulerOutput) -> StepResult:
        return self.result


class DataParallelGroup:
    """The dp ranks (`Replica`s, in rank order) of one deployment, stepped together by
    one SimPy process (`run`) in place of each rank's own engine loop. Arrivals still
    go to the ranks (`Replica.submit`, through the cluster's router); any of them wakes
    a sleeping group. `dummy_steps[r]` counts the dummy forward passes rank r ran."""

    def __init__(self, env: Environment, ranks: Sequence, cost_model: CostModel, *,
                 fast_forward: bool = True) -> None:
        dp = cost_model.data_parallel_ranks
        if len(ranks) != dp:
            raise ValueError(f"a lock-step group holds the {dp} data-parallel ranks of its "
                             f"cost model's layout, got {len(ranks)}")
        self.env = env
        self.ranks = list(ranks)
        self.cost_model = cost_model
        self.fast_forward = fast_forward
        self.dummy_steps = [0] * dp
        """Dummy forward passes per rank (steps it had nothing scheduled while a peer had)."""

    def run(self) -> Iterator[Event]:
        """The group's engine process: group steps until no request will come."""
        env, ranks = self.env, self.ranks
        while True:
            now = env.now
            plans = [self._plan(rank, now) for rank in ranks]
            if all(plan.is_empty for plan in plans):
                for rank, plan in zip(ranks, plans):
                    rank.ran_nothing(self._step(rank, plan, None, now))
                if any(rank.scheduler.has_unfinished() for rank in ranks):
                    continue          # rejections or preemptions only: step again at once
                wake = env.event()
                for rank in ranks:
                    rank.wake_on(wake)
                yield wake
                continue
            results = [None if plan.is_empty else rank.executor.execute(plan)
                       for rank, plan in zip(ranks, plans)]
            duration = self.step_duration([None if r is None else _shape(r, p)
                                           for r, p in zip(results, plans)],
                                          [None if r is None else r.duration_s for r in results])
            steps = []
            for i, (rank, plan, result) in enumerate(zip(ranks, plans, results)):
                if result is None:
                    self.dummy_steps[i] += 1
                    rank.ran_nothing(self._step(rank, plan, None, now))
                    continue
                step = self._step(rank, plan, dataclasses.replace(result, duration_s=duration), now)
                rank.steps.append(step.step)
                rank.launched()
                steps.append((rank, step))
            yield env.timeout(duration)   # NORMAL priority: arrivals at its end come first
            prefill_continues = False
            for rank, step in steps:
                rank.boundary()
                if step.records:
                    rank.publish(step.records)
                prefill_continues |= step.output.scheduled.prefill_continues()
            if self.fast_forward and not prefill_continues:
                run = self._decode_run(env.now)
                if run is not None:
                    yield env.timeout(run)   # its working ranks launched it

    @staticmethod
    def _plan(rank, now: float) -> SchedulerOutput:
        """The rank's batch for the step starting `now`. Under asynchronous scheduling
        (`simulator/async_scheduling.py`): after a fast-forward run, the requests queued
        at the previous boundary join first; and a rank with nothing to run has no batch
        in flight, so the requests it kept back join at once, as a lone replica's do."""
        rank.boundary()
        plan = rank.scheduler.schedule(now)
        lag = rank.lag
        if plan.is_empty and lag is not None and lag.keeps_any:
            rank.ran_nothing(DataParallelGroup._step(rank, plan, None, now))
            plan = rank.scheduler.schedule(now)
        return plan

    def step_duration(self, shapes: Sequence[BatchShape | None],
                      prices: Sequence[float | None]) -> float:
        """The group's step: the largest of its ranks' prices, each working rank's own
        price (`prices[r]`, MoE layers as if its peers carried as many tokens) corrected
        to the MoE layers over the tokens every rank carries, an idle rank's (shape None)
        a dummy forward pass of one token."""
        cost = self.cost_model
        tokens = [1 if s is None else s.num_prefill_tokens + s.num_decode_seqs for s in shapes]
        total = sum(tokens)
        longest = 0.0
        for shape, price, n in zip(shapes, prices, tokens):
            t = cost.dummy_step_time(total) if shape is None else \
                price + cost.lockstep_correction(n, total)
            if t > longest:
                longest = t
        return longest

    @staticmethod
    def _step(rank, plan: SchedulerOutput, result: StepResult | None, now: float) -> EngineStep:
        """The shared engine step over a plan already made (and, if it computes
        something, already priced)."""
        bm = rank.scheduler.bm
        return engine_step(_Planned(rank.scheduler, plan), _Executed(result), now,
                           bm.num_gpu_blocks, lambda: bm.num_used_blocks)

    # --- fast-forward ----------------------------------------------------------------------

    def _decode_run(self, now: float) -> float | None:
        """Apply a run of >= 2 group steps in which every working rank decodes plainly and
        the others run dummy steps; returns its duration, or None when no such run is
        certain. O(ranks + the steps evaluated): the run's, or those that fit before the
        next arrival."""
        ranks, cost = self.ranks, self.cost_model
        bound, working = MAX_RUN_STEPS, []
        for i, rank in enumerate(ranks):
            if rank.lag is not None and rank.lag.queued:
                return None   # they join the next step but one: a run of one step at most
            sched = rank.scheduler
            if not sched.has_unfinished():
                if rank.outstanding:
                    return None   # a rejection to report at the next step
                continue          # runs dummy steps throughout
            k = sched.decode_run_bound(now, MAX_RUN_STEPS)
            if k < 2:
                return None
            bound = min(bound, k)
            num_seqs, context_sum = sched.decode_shape()
            working.append((i, BatchShape(num_decode_seqs=num_seqs,
                                          decode_context_sum=context_sum)))
        if not working:
            return None
        budget = min(rank.feed.next_s for rank in ranks) - now
        if budget <= 0:
            return None
        idle = len(ranks) - len(working)
        total = sum(shape.num_decode_seqs for _, shape in working) + idle
        lines = []
        for _, shape in working:
            fixed, a, b, c, d = cost.decode_run_lines(shape)
            fixed += cost.lockstep_correction(shape.num_decode_seqs, total)
            lines.append((fixed, a, b, c, d))
        dummy = cost.dummy_step_time(total) if idle else 0.0
        if budget < math.inf:   # steps never get cheaper: budget / the first + 1 start by then
            first = max(dummy, max(fixed + max(a, c) for fixed, a, _, c, _ in lines))
            bound = min(bound, int(budget / first) + 2)
        j = np.arange(bound, dtype=np.float64)
        step = np.full(bound, dummy)
        for fixed, a, b, c, d in lines:
            step = np.maximum(step, fixed + np.maximum(a + b * j, c + d * j))
        ends = np.cumsum(step)
        k = bound
        if budget < math.inf:
            k = int(np.searchsorted(ends, budget, side="right"))    # the steps that end by then
            # and the one under way when the arrival comes, which cannot see it (unless it
            # would start at the arrival itself; or a policy accounts service, which an
            # arrival may read: then the run ends by it)
            charges = any(ranks[i].scheduler.policy.charges_service for i, _ in working)
            if k < bound and not charges and (k == 0 or ends[k - 1] < budget):
                k += 1
        if k < 2:
            return None
        duration = float(ends[k - 1])
        for i, shape in working:
            ranks[i].apply_decode_run(now, k, duration, shape)
            ranks[i].launched()
        busy = {i for i, _ in working}
        for i in range(len(ranks)):
            if i not in busy:
                self.dummy_steps[i] += k
        return duration


def _shape(result: StepResult, plan: SchedulerOutput) -> BatchShape:
    return result.shape or BatchShape.from_output(plan)
