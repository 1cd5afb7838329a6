"""The simulator's SimPy processes: trace arrivals, and one engine per replica.

    arrivals ──(router)──► Replica.submit ──► scheduler.add_request
    Replica.run:  engine_loop (schedule → SimulatedExecutor → update) ; sleep the step's
                  modelled duration ; publish finished records ; maybe fast-forward

Every replica runs the shared `servelab.engine.engine_loop`, the loop the real backend
runs, as a SimPy process with itself as the driver, so the simulator cannot drift from
the engine it models. An idle engine waits on a SimPy event that the next arrival to it
triggers: it never polls. (The data-parallel ranks of a mixture-of-experts deployment
are the exception: one process steps them together, each through the shared
`engine_step`; see `simulator/data_parallel.py`.)

Event order is explicit, as SimPy orders by (time, priority, insertion id): an arrival is
released with URGENT priority, an engine step ends with NORMAL priority, so requests
arriving at time t are in the scheduler before any step that starts at t — the same rule
as "admit what has arrived by now". Requests with equal trace times are released in one
instant, in trace order. In floats `now + (t - now)` may be `t` less one ulp, and a
request released then would be scheduled before its own arrival time: the arrival process
waits that ulp too (`arrival_process`).

Asynchronous scheduling (vLLM's default; `simulator/async_scheduling.py`): a request that
arrives while a step runs is kept back (`Replica.lag`) and joins the scheduler at the
boundary after that step's end, unless the engine then has nothing in flight.

Fast-forward. After each step the engine asks the scheduler how many of the next steps
are certain to be plain decode steps (`decode_run_bound`); if at least 2, it cuts that to
the steps that start before the next arrival this replica can receive (those that end by
then and the one under way when it comes, which it cannot join: `decode_run_until` on
the run's `BatchShape`; under a policy that accounts service, which an arrival may read,
only those that end by then), applies them at once (`advance_decodes`) and sleeps the
run's closed-form duration, writing one steps.csv row with `num_steps` = k. With a CPU
tier, a run may outlast the free list: each later step evicts cached blocks with a copy
to the tier, and the run's duration adds every such step's copy as the step would pay it
(`OffloadRun`: the host link's latency once per copying step, and each block's time). The
scheduler's state and every request record come out as if the k steps had run
one by one (`fast_forward=False` does that; a property test compares the two), up to
float rounding of the summed step times — and so, in principle, up to which side of a
float-rounding tie an arrival that coincides with a step end to ~1e-15 s falls.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
from simpy import Environment
from simpy.events import NORMAL, URGENT, Event

from servelab.engine import EngineStep, engine_loop
from servelab.outputs import BatchShape
from servelab.policies import Scheduler
from servelab.record_table import RecordLog, RecordTable
from servelab.records import RequestRecord, StepRecord
from servelab.request import Request
from servelab.simulator.async_scheduling import AsyncScheduling
from servelab.simulator.cost_model import CostModel
from servelab.simulator.executor import SimulatedExecutor
from servelab.simulator.router import Router
from servelab.traces.requests import TraceRequests

MAX_RUN_STEPS = 1 << 31
"""Upper bound passed to `decode_run_bound`: runs are limited by the requests, not by us."""

Progress = Callable[[float, int, int], None]
"""progress(simulated seconds, requests done, requests in total)."""


class PriorityTimeout(Event):
    """A SimPy timeout with an explicit priority (SimPy's `Timeout` is always NORMAL)."""

    def __init__(self, env: Environment, delay: float, priority: int) -> None:
        self.env = env
        self.callbacks = []
        self._value = None
        self._ok = True
        env.schedule(self, priority, delay)


class ArrivalFeed:
    """When the next request of one arrival process is released: the exact time of its
    pending SimPy event (math.inf once the trace is exhausted). A replica's fast-forward
    run must end by then, since that request may be routed to it."""

    __slots__ = ("next_s",)

    def __init__(self) -> None:
        self.next_s = math.inf


def arrival_process(env: Environment, requests: Iterable[Request],
                    deliver: Callable[[Request], None], feed: ArrivalFeed) -> Iterator[Event]:
    """Release `requests` (in arrival order) to `deliver` once the clock has reached their
    trace times. SimPy schedules at `now + delay`, which can fall one ulp short of
    `now + (t - now) = t`; then a second timeout of that one ulp (exact: both ends are
    floats one ulp apart) brings the clock to `t`, so no request is ever released before
    it arrives."""
    for req in requests:
        at = req.arrival_s
        while env.now < at:
            delay = at - env.now
            feed.next_s = env.now + delay      # the very sum SimPy schedules at
            yield PriorityTimeout(env, delay, URGENT)
        deliver(req)
    feed.next_s = math.inf


class Replica:
    """One engine: a scheduler over its own KV cache, the simulated executor, and the
    SimPy process (`run`) that steps them.

    `outstanding` counts requests submitted and not yet published as done; a request's
    record is published when the step that finished it ends (what a router can know).
    """

    def __init__(self, env: Environment, index: int, scheduler: Scheduler, cost_model: CostModel,
                 feed: ArrivalFeed, *, fast_forward: bool = True, executor=None,
                 async_scheduling: bool = False) -> None:
        self.env = env
        self.index = index
        self.scheduler = scheduler
        self.cost_model = cost_model
        self.executor = executor if executor is not None else SimulatedExecutor(cost_model)
        self.feed = feed
        self.fast_forward = fast_forward
        self.outstanding = 0
        self.records = RecordLog(RequestRecord)   # kept as columns: a long run's records
        self.steps = RecordLog(StepRecord)        # would otherwise dominate its memory
        self._wake: Event | None = None
        self.lag = AsyncScheduling() if async_scheduling else None
        """The arrivals vLLM's asynchronous scheduling keeps back a step (None: off)."""

    def submit(self, req: Request) -> None:
        """A request arrives now (it may be rejected at once; its record then comes out
        of the next engine step). Wakes the engine if it sleeps. Under asynchronous
        scheduling, a request that arrives while a step runs is kept back (`lag`)."""
        self.outstanding += 1
        lag = self.lag
        if lag is not None and lag.hold(req):
            return
        self.scheduler.add_request(req, self.env.now)
        wake = self._wake
        if wake is not None:
            self._wake = None
            if not wake.triggered:   # a lock-step group's event, which a peer's arrival triggered
                wake.succeed()

    def wake_on(self, event: Event) -> None:
        """The next arrival here triggers `event` (unless something else did first): how
        an idle engine, or an idle lock-step group of ranks, waits for work."""
        self._wake = event

    def publish(self, records: list[RequestRecord]) -> None:
        """Records of requests done in a step that has ended (what a router can know)."""
        self.outstanding -= len(records)
        self.records.extend(records)

    def launched(self) -> None:
        """A step, or a fast-forward run, starts: under asynchronous scheduling, arrivals
        now wait for its end."""
        if self.lag is not None:
            self.lag.step_started()

    def boundary(self) -> None:
        """The step or run in flight has ended (a no-op otherwise): under asynchronous
        scheduling, the requests queued at the previous boundary join the scheduler."""
        lag = self.lag
        if lag is not None and lag.in_step:
            self._admit(lag.step_ended())

    def _admit(self, requests: list[Request]) -> None:
        now, scheduler = self.env.now, self.scheduler
        for req in requests:
            scheduler.add_request(req, now)

    def run(self) -> Iterator[Event]:
        """The engine process: the shared engine loop, with this replica as its driver."""
        return engine_loop(self.scheduler, self.executor, self)

    # --- the engine loop's driver (servelab.engine.EngineDriver) ----------------------
    def step_time(self) -> float:
        if self.lag is not None:
            self.boundary()   # after a fast-forward run
        return self.env.now

    def ran(self, step: EngineStep) -> Event:
        """Sleep the step's duration."""
        self.steps.append(step.step)
        if self.lag is not None:
            self.lag.step_started()
        return PriorityTimeout(self.env, step.result.duration_s, NORMAL)

    def finished(self, step: EngineStep) -> Event | None:
        """Publish the step's records; maybe fast-forward (sleeping the run's duration)."""
        lag = self.lag
        if lag is not None:
            self.boundary()
            if lag.keeps_any and not self.scheduler.has_unfinished():
                self._admit(lag.nothing_in_flight())   # no batch formed behind this step
        if step.records:
            self.publish(step.records)
        # a prompt still prefilling runs again next step: no decode run can start
        if self.fast_forward and not step.output.scheduled.prefill_continues():
            duration = self._decode_run(self.env.now)
            if duration is not None:
                self.launched()
                return PriorityTimeout(self.env, duration, NORMAL)
        return None

    def ran_nothing(self, step: EngineStep) -> None:
        self.publish(step.records)
        lag = self.lag
        if lag is not None and lag.keeps_any:   # no batch in flight: none waits for one
            self._admit(lag.nothing_in_flight())

    def idle(self) -> tuple[Event]:
        """Sleep until an arrival wakes us (a replica waits for ever after the last)."""
        wake = self.env.event()
        self.wake_on(wake)
        return (wake,)

    def _decode_run(self, now: float) -> float | None:
        """Apply a run of plain decode steps starting `now`, if one of >= 2 steps is
        certain; returns its duration. O(running sequences), independent of the run length.
        Its steps.csv row holds the per-step token counts, the context sum of the run's
        first step and the blocks in use at its end (the run's peak)."""
        sched = self.scheduler
        lag = self.lag
        if lag is not None and lag.queued:
            return None   # they join the next step but one: a run of one step at most
        # A run may outlast the free list where each step's copies to the host tier are
        # priced with it (they are added to the run's time below).
        k = sched.decode_run_bound(now, MAX_RUN_STEPS, offloads=True)
        if k < 2:
            return None
        copies = sched.decode_run_offloads
        cost = self.cost_model
        extra = None   # the run's copies to the host tier: seconds over its first k steps
        if copies is not None:
            latency_s, block_s = cost.host_copy
            extra = partial(copies.seconds, latency_s=latency_s, block_s=block_s)
        # Step j of the run decodes every sequence over its context + j (+1: the new token).
        num_seqs, context_sum = sched.decode_shape()
        shape = BatchShape(num_decode_seqs=num_seqs, decode_context_sum=context_sum)
        budget = self.feed.next_s - now
        if budget <= 0:
            return None
        if budget == math.inf or sched.policy.charges_service:
            if budget != math.inf:
                # the policy accounts service, which an arrival may read: the run ends by it
                k = cost.decode_run_steps_within(shape, budget, k, extra)
            duration = cost.decode_run_duration(shape, k)[0] + (extra(k) if extra else 0.0)
        else:
            # Steps that start before the next arrival cannot see it: the run takes those
            # ending by then and the one under way when it comes (unless that one would
            # start at the arrival itself, which then joins it). Under asynchronous
            # scheduling the arrival is then queued at the run's end, as at a step's.
            k, duration = cost.decode_run_until(shape, k, budget, extra)
        if k < 2:
            return None
        if copies is not None:   # the run's steps.csv row counts them
            shape = BatchShape(num_decode_seqs=num_seqs, decode_context_sum=context_sum,
                               num_offload_blocks=copies.blocks(k))
        self.apply_decode_run(now, k, duration, shape)
        return duration

    def apply_decode_run(self, now: float, k: int, duration: float, shape: BatchShape) -> None:
        """Advance the scheduler by a run of `k` plain decode steps starting `now` and
        lasting `duration` (`decode_run_bound` allowed at least k; `shape` is the run's
        first step, `decode_shape`, with the run's copies to the host tier), and write the
        run's steps.csv row."""
        sched = self.scheduler
        sched.advance_decodes(k)
        bm = sched.bm
        self.steps.append(StepRecord.from_shape(
            shape, start_s=now, duration_s=duration, num_running=sched.num_running,
            num_waiting=sched.num_waiting, num_swapped=sched.num_swapped,
            kv_blocks_used=bm.num_used_blocks, kv_blocks_total=bm.num_gpu_blocks, num_steps=k))


class EngineStalled(RuntimeError):
    """The simulation ran out of events with requests not done: an engine stopped with
    work left (a bug). The records of the requests that finished are still there."""


class Cluster:
    """Replicas behind a router, fed by a trace, in one SimPy environment.

    With one replica, or a router that assigns requests up front, each replica gets its
    own arrival process (its fast-forward runs reach its own next arrival); otherwise one
    arrival process routes each request when it arrives, and every replica's runs end by
    the cluster's next arrival. `executors` replaces each replica's `SimulatedExecutor` (a speculating engine's,
`simulator/speculation.py`). `requests` is a list, or a trace's `TraceRequests`, which
    makes each request as it is released: the cluster then holds only the requests in
    flight (a scheduler lets a request go once its record is out). The requests are
    consumed: their serving state is the schedulers' (replay a list from
    `Request.fresh_copy()`; a `TraceRequests` makes fresh ones each time).

    `lock_step_ranks` > 1: every that many consecutive replicas are the data-parallel
    ranks of one mixture-of-experts deployment, stepped together by a `DataParallelGroup`
    (`simulator/data_parallel.py`) instead of each by its own engine loop; `groups` lists
    them (empty otherwise). The cost model must have that many ranks
    (`CostModel.data_parallel_ranks`).

    `async_scheduling`: every engine schedules a step ahead, as vLLM's asynchronous
    scheduling does (`simulator/async_scheduling.py`).
    """

    def __init__(self, schedulers: Sequence[Scheduler], cost_model: CostModel, router: Router,
                 requests: Sequence[Request], *, fast_forward: bool = True,
                 executors: Sequence | None = None, lock_step_ranks: int = 1,
                 async_scheduling: bool = False) -> None:
        if not schedulers:
            raise ValueError("a cluster needs at least one replica")
        if len(schedulers) != router.num_replicas:
            raise ValueError(f"router is for {router.num_replicas} replicas, got {len(schedulers)}")
        arrivals = requests.arrival_s if isinstance(requests, TraceRequests) else \
            np.array([r.arrival_s for r in requests], dtype=np.float64)
        early = np.flatnonzero(arrivals[1:] < arrivals[:-1])
        if len(early):
            i = int(early[0]) + 1
            raise ValueError(f"requests must be in arrival order: request {requests[i].request_id} "
                             f"arrives before request {requests[i - 1].request_id}")
        self.env = env = Environment()
        self.requests = requests
        self.num_requests = len(requests)
        self.last_arrival_s = float(arrivals[-1]) if len(arrivals) else 0.0
        self.router = router
        n = len(schedulers)
        upfront = None if n == 1 else router.assign_upfront(requests)
        feeds = [ArrivalFeed() for _ in range(n)] if upfront is not None else [ArrivalFeed()] * n
        self.replicas = [Replica(env, i, s, cost_model, feeds[i], fast_forward=fast_forward,
                                 executor=None if executors is None else executors[i],
                                 async_scheduling=async_scheduling)
                         for i, s in enumerate(schedulers)]
        if n == 1:
            env.process(arrival_process(env, requests, self.replicas[0].submit, feeds[0]))
        elif upfront is not None:
            for i, replica in enumerate(self.replicas):
                own = [j for j, r in enumerate(upfront) if r == i]
                env.process(arrival_process(env, map(requests.__getitem__, own), replica.submit, feeds[i]))
        else:
            env.process(arrival_process(env, requests, self._route, feeds[0]))
        self.groups = []
        if lock_step_ranks > 1:   # each run of that many replicas: one deployment's DP ranks
            from servelab.simulator.data_parallel import DataParallelGroup
            if n % lock_step_ranks:
                raise ValueError(f"{n} replicas do not form whole groups of {lock_step_ranks} "
                                 "data-parallel ranks")
            self.groups = [DataParallelGroup(env, self.replicas[g:g + lock_step_ranks], cost_model,
                                             fast_forward=fast_forward)
                           for g in range(0, n, lock_step_ranks)]
            for group in self.groups:
                env.process(group.run())
        else:
            for replica in self.replicas:
                env.process(replica.run())

    def _route(self, req: Request) -> None:
        replicas = self.replicas
        i = self.router.route(req, [r.outstanding for r in replicas])
        replicas[i].submit(req)

    @property
    def num_done(self) -> int:
        return sum(len(r.records) for r in self.replicas)

    def run(self, progress: Progress | None = None, num_reports: int = 100) -> None:
        """Simulate until no event is left (every engine idle, the trace exhausted); see
        `simulate_to_end`."""
        simulate_to_end(self, progress, num_reports)


    def request_records(self) -> RecordTable:
        """Every request's record, by request id."""
        records = RecordTable.concat(RequestRecord, [r.records.table() for r in self.replicas])
        return records.sorted_by("request_id")

    def step_records(self) -> RecordTable:
        """All replicas' steps by start time (ties: replica index, then step order)."""
        steps = RecordTable.concat(StepRecord, [r.steps.table() for r in self.replicas])
        return steps.sorted_by("start_s")   # stable: replica order, then step order


def simulate_to_end(cluster, progress: Progress | None = None, num_reports: int = 100) -> None:
    """Run a cluster's SimPy environment (`cluster.env`) until no event is left.
    `progress` is called about `num_reports` times over the trace span
    (`cluster.last_arrival_s`) and at the end; reporting adds no events, so it cannot
    change the simulation. Raises EngineStalled if fewer than `cluster.num_requests` are
    done (`cluster.num_done`)."""
    env = cluster.env
    total = cluster.num_requests
    if progress is None:
        env.run()
    else:
        every = max(cluster.last_arrival_s, 1.0) / num_reports
        next_report = every
        step, peek = env.step, env.peek
        while peek() < math.inf:
            step()
            if env.now >= next_report:
                progress(env.now, cluster.num_done, total)
                next_report = env.now + every
        progress(env.now, cluster.num_done, total)
    done = cluster.num_done
    if done != total:
        raise EngineStalled(f"simulation ended with {done} of {total} requests done: "
                            f"an engine stopped with work left")
